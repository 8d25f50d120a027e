"""The fused MLA prologue: ``kernel`` (Triton), ``configs`` (tiles), ``args`` (argument record
and host checks), ``launch`` (one launch), ``api`` (the public functions).

Submodules are imported lazily, so importing :mod:`fusemla.contracts.prologue` (as the reference
does) imports neither Triton nor the kernel.
"""

from __future__ import annotations

from typing import Any

_PUBLIC = ("mla_prologue", "mla_decode_prologue", "mla_prologue_step", "prologue_spec")


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        from fusemla.ops.prologue import api

        return getattr(api, name)
    raise AttributeError(f"module 'fusemla.ops.prologue' has no attribute {name!r}")
