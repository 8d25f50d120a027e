"""fusemla: fused Triton kernels and an engine-ready layer for DeepSeek-style Multi-Head Latent
Attention.

Layout (arrows point one way: layers -> ops -> Triton helpers; integrations -> ops):
``fusemla.ops`` (Triton kernels, custom ops), ``fusemla.reference`` (plain PyTorch),
``fusemla.layers`` (:class:`MLAAttention`), ``fusemla.metadata`` (per-step batch metadata),
``fusemla.integrations`` (engines, imported lazily), ``fusemla.testing`` (dims, models, inputs,
comparison, toy scheduler, launch spy).

The public names are imported lazily, so ``import fusemla`` does not import Triton: a program
may still set ``TRITON_INTERPRET=1`` after importing the package and before the first op runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.5.0"

_LAZY = {
    "mla_prologue": "fusemla.ops.prologue.api",
    "mla_decode_prologue": "fusemla.ops.prologue.api",
    "mla_prologue_step": "fusemla.ops.prologue.api",
    "prologue_spec": "fusemla.ops.prologue.api",
    "PrologueSpec": "fusemla.contracts.prologue",
    "mla_prologue_step_ref": "fusemla.reference.prologue",
    "mla_prologue_ref": "fusemla.reference.prologue",
    "mla_decode_prologue_ref": "fusemla.reference.prologue",
    "PrologueOutput": "fusemla.contracts.prologue",
    "mla_epilogue": "fusemla.ops.epilogue.api",
    "mla_epilogue_step": "fusemla.ops.epilogue.api",
    "epilogue_spec": "fusemla.ops.epilogue.api",
    "EpilogueSpec": "fusemla.contracts.epilogue",
    "mla_epilogue_ref": "fusemla.reference.epilogue",
    "MLAAttention": "fusemla.layers.mla",
    "MLAConfig": "fusemla.config",
    "BatchMetadata": "fusemla.metadata",
}

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # pragma: no cover
    from fusemla.config import MLAConfig
    from fusemla.contracts.epilogue import EpilogueSpec
    from fusemla.contracts.prologue import PrologueOutput, PrologueSpec
    from fusemla.layers.mla import MLAAttention
    from fusemla.metadata import BatchMetadata
    from fusemla.ops.epilogue.api import epilogue_spec, mla_epilogue, mla_epilogue_step
    from fusemla.ops.prologue.api import (
        mla_decode_prologue,
        mla_prologue,
        mla_prologue_step,
        prologue_spec,
    )
    from fusemla.reference.epilogue import mla_epilogue_ref
    from fusemla.reference.prologue import (
        mla_decode_prologue_ref,
        mla_prologue_ref,
        mla_prologue_step_ref,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fusemla' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
