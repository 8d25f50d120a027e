"""Plain-PyTorch reference of the MLA decode epilogue: what engines run today (a bmm into
o_proj's input, then vLLM's ``per_token_group_quant_fp8`` for a block-FP8 o_proj), in fp32.

:func:`group_quant_fp8` is the quantization rule, exactly: per token and group of
``group_size`` consecutive columns, ``absmax = max(max |x|, 1e-10)``, ``s = absmax * (1 /
fmax)`` (fp32 multiply by the fp32 reciprocal), with ``ue8m0`` ``s = 2**ceil(log2 s)``
(exact), codes ``clamp(x / s, -fmax, fmax)`` (IEEE fp32 division) rounded to nearest even.
``fmax`` is :func:`fusemla.contracts.epilogue.fp8_group_max` (448 for e4m3fn).
"""

from __future__ import annotations

import torch

from fusemla.contracts.epilogue import EPS, EpilogueArgs, fp8_group_max, prepare


def _pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """``2**ceil(log2 s)`` for positive normal fp32 ``s``, exactly (from the bits)."""
    bits = s.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def group_quant_fp8(
    x: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of fp32 ``x`` ``[N, C]`` quantized per token and group (the module's
    rule): codes ``[N, C]`` in ``dtype``, scales ``[N, C / group_size]`` fp32, row-major."""
    N, C = x.shape
    g = x.float().reshape(N, C // group_size, group_size)
    fmax = fp8_group_max(dtype)
    absmax = g.abs().amax(dim=2).clamp_min(EPS)
    s = absmax * torch.tensor(1.0 / fmax, dtype=torch.float32, device=x.device)
    if ue8m0:
        s = _pow2_ceil(s.contiguous())
    codes = (g / s[:, :, None]).clamp(-fmax, fmax).to(dtype)
    return codes.reshape(N, C), s


def product_f32(args: EpilogueArgs) -> torch.Tensor:
    """``attn_out @ W_UV`` per head in fp32, as o_proj's input ``[N, H*V]`` (FP8 weights
    dequantized in fp32 first)."""
    from fusemla.quant import QuantizedWeight

    w = args.w_uv
    w32 = w.dequantize(torch.float32) if isinstance(w, QuantizedWeight) else w.float()
    x = args.attn_out.float().transpose(0, 1)  # [H, N, L]
    return torch.bmm(x, w32).transpose(0, 1).reshape(args.N, args.H * args.V)


def epilogue_into(args: EpilogueArgs) -> None:
    """The epilogue on validated arguments, written into ``args.out`` (and ``args.scale_out``):
    the CPU fallback of the fused op, and the tests' reference."""
    if args.N == 0:
        return
    y = product_f32(args)
    spec = args.spec
    if spec.fp8_out:
        codes, s = group_quant_fp8(y, spec.group_size, args.out.dtype, ue8m0=spec.scale_ue8m0)
        args.out.copy_(codes)
        args.scale_out.copy_(s)
    else:
        args.out.copy_(y.to(args.out.dtype))


def mla_epilogue_ref(
    attn_out: torch.Tensor,
    w_uv: object,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    group_size: int = 128,
    scale_ue8m0: bool = False,
    scale_col_major: bool = False,
    scale_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The unfused epilogue with :func:`fusemla.mla_epilogue`'s arguments and results."""
    args = prepare(
        attn_out,
        w_uv,
        out=out,
        out_dtype=out_dtype,
        group_size=group_size,
        scale_ue8m0=scale_ue8m0,
        scale_col_major=scale_col_major,
        scale_out=scale_out,
    )
    epilogue_into(args)
    return args.result
