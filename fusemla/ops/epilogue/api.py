"""Public entry points of the fused epilogue.

:func:`epilogue_spec` checks a layer's fixed arguments once (W_UV, the output's format) and
:func:`mla_epilogue_step` runs one step on it: what an engine calls. :func:`mla_epilogue` takes
everything in one call."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fusemla.contracts.epilogue import EpilogueArgs, EpilogueSpec, build_spec, prepare, prepare_step
from fusemla.ops.epilogue.launch import run

if TYPE_CHECKING:  # pragma: no cover
    from fusemla.quant import QuantizedWeight


def mla_epilogue(
    attn_out: torch.Tensor,
    w_uv: torch.Tensor | QuantizedWeight,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    group_size: int = 128,
    scale_ue8m0: bool = False,
    scale_col_major: bool = False,
    scale_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused MLA decode epilogue: the W_UV up-projection straight into o_proj's input, in one
    kernel launch (fp32 accumulation).

    - ``attn_out [N, H, L]``: the latent attention output, bf16 or fp16, any strides with a
      contiguous last dim.
    - ``w_uv [H, L, V]``: in the activations' dtype (stride 1 along V or along L), or an FP8
      :class:`fusemla.quant.QuantizedWeight` with a per-tensor, per-head or block scale
      (DeepSeek's 128 x 128 ``weight_scale_inv``, :func:`fusemla.quant.split_kv_b_proj_fp8`).
    - ``out_dtype``: None (the activations' dtype): returns ``o [N, H*V]``,
      ``o[n, h*V + v] = sum_l attn_out[n, h, l] * W_UV[h, l, v]``.
      ``torch.float8_e4m3fn`` (``float8_e4m3fnuz`` on MI300): returns ``(codes [N, H*V],
      scales [N, H*V / group_size] fp32)``, vLLM's ``per_token_group_quant_fp8`` of the fp32
      product (per token and group: ``s = max(absmax, 1e-10) * fl(1/448)``, with ``scale_ue8m0``
      rounded up to a power of two (vLLM's kernels floor ``s`` at 1e-10 before that: groups
      with absmax below 4.5e-8 only, a token of zeros 2^-33 there, 2^-42 here);
      codes ``clamp(o / s, +-448)`` to nearest even; 224 instead
      of 448 for e4m3fnuz, as vLLM). A group lies inside one head: ``V % group_size == 0``,
      ``group_size`` a power of two >= 16.
    - ``out``: o_proj's input buffer ``[N, H*V]`` to write (last dim contiguous, any row
      stride); ``scale_out``: the scales' buffer, any strides; without it the scales are
      row-major, or column-major (stride ``(1, N)``) with ``scale_col_major``.

    Raises :class:`fusemla.errors.FuseMLAError` subclasses naming the argument, before anything
    is written (also for an ``out`` or ``scale_out`` that shares memory with ``attn_out`` or
    with the other). CUDA-graph and ``torch.compile(fullgraph=True)`` safe.
    """
    return _execute(
        prepare(
            attn_out,
            w_uv,
            out=out,
            out_dtype=out_dtype,
            group_size=group_size,
            scale_ue8m0=scale_ue8m0,
            scale_col_major=scale_col_major,
            scale_out=scale_out,
        )
    )


def epilogue_spec(
    w_uv: torch.Tensor | QuantizedWeight,
    *,
    out_dtype: torch.dtype | None = None,
    group_size: int = 128,
    scale_ue8m0: bool = False,
    scale_col_major: bool = False,
) -> EpilogueSpec:
    """A layer's fixed epilogue arguments, checked once, for :func:`mla_epilogue_step` (they
    mean what they mean in :func:`mla_epilogue`). The spec holds references, not copies."""
    return build_spec(
        w_uv,
        out_dtype=out_dtype,
        group_size=group_size,
        scale_ue8m0=scale_ue8m0,
        scale_col_major=scale_col_major,
    )


def mla_epilogue_step(
    spec: EpilogueSpec,
    attn_out: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One step of the fused epilogue on a layer's :func:`epilogue_spec`: same meaning and
    result as :func:`mla_epilogue`, with only the step's arguments checked."""
    return _execute(prepare_step(spec, attn_out, out=out, scale_out=scale_out))


def _execute(args: EpilogueArgs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run validated arguments: eagerly, or through the registered op while compiling."""
    if torch.compiler.is_compiling():
        from fusemla.ops.custom_ops import call_mla_epilogue

        call_mla_epilogue(args)
    else:
        run(args)
    return args.result
