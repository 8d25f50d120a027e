"""fusemla: fused Triton kernels for the decode step of DeepSeek-style Multi-Head Latent Attention.

The public ops are imported lazily, so ``import fusemla`` does not import Triton: a program may
still set ``TRITON_INTERPRET=1`` after importing the package and before the first op is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "mla_decode_prologue": "fusemla.ops.decode_prologue",
    "mla_decode_prologue_ref": "fusemla.reference",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # pragma: no cover
    from fusemla.ops.decode_prologue import mla_decode_prologue
    from fusemla.reference import mla_decode_prologue_ref


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fusemla' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
