"""The fused MLA decode epilogue: ``kernel`` (Triton), ``configs`` (tiles), ``launch`` (the plan
and one launch), ``api`` (the public functions); the argument contract is
:mod:`fusemla.contracts.epilogue`.

Submodules are imported lazily, so importing the contract (as the reference does) imports
neither Triton nor the kernel.
"""

from __future__ import annotations

from typing import Any

_PUBLIC = ("mla_epilogue", "mla_epilogue_step", "epilogue_spec")


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        from fusemla.ops.epilogue import api

        return getattr(api, name)
    raise AttributeError(f"module 'fusemla.ops.epilogue' has no attribute {name!r}")
