"""Plain-PyTorch references: what engines run today unfused, the CPU fallback, and what tests
and benchmarks compare against. Nothing here imports a Triton kernel.

``fusemla.reference.prologue``: :func:`mla_prologue_ref` (and :func:`mla_decode_prologue_ref`).
``fusemla.reference.attention``: paged latent attention (decode) and prefill attention.
"""

from fusemla.reference.prologue import mla_decode_prologue_ref, mla_prologue_ref

__all__ = ["mla_decode_prologue_ref", "mla_prologue_ref"]
