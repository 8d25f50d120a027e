"""Offline quantization of the absorbed ``W_UK_T`` weight, and DeepSeek-V3 checkpoint helpers.

``W_UK_T`` is the ``[H, P, L]`` slice of DeepSeek's ``kv_b_proj`` (``P = qk_nope_head_dim``, the
reduction dim of the absorbed BMM; ``L = kv_lora_rank``, the latent dim). It is quantized once,
at load time, into a :class:`QuantizedWeight`, the container the kernel consumes:

* ``"fp8"``: ``float8_e4m3fn`` / ``float8_e4m3fnuz`` codes with one fp32 scale per tensor or per
  head; ``w ~= data * scale``.
* ``"mxfp4"`` (OCP Microscaling spec): 4-bit e2m1 codes packed two per byte along ``P``, with one
  e8m0 scale byte per block of 32 consecutive ``p`` (per ``h``, ``l``);
  ``w[h, p, l] ~= e2m1(code) * 2**(scale[h, p // 32, l] - 127)``.

All functions here are plain PyTorch, run on any device and may sync it (they check that the
weights are finite): they are meant for weight loading, not for the decode step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fusemla.errors import FuseMLATypeError, FuseMLAValueError, describe

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FORMATS = ("fp8", "mxfp4")
MX_BLOCK = 32  # elements of P sharing one e8m0 scale
E2M1_EMAX = 2  # exponent of e2m1's largest normal (6 = 1.5 * 2**2)
E2M1_MAX = 6.0
E8M0_BIAS = 127
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ----------------------------------------------------------------------------- argument checks


def _tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise FuseMLATypeError(f"{name}: expected a torch.Tensor, got {describe(x)}")
    return x


def _dtype(name: str, x: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if x.dtype not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise FuseMLATypeError(f"{name}: expected dtype {names}, got {describe(x)}")


def _rank(name: str, x: torch.Tensor, rank: int, what: str) -> None:
    if x.dim() != rank or x.numel() == 0:
        raise FuseMLAValueError(f"{name}: expected a non-empty {what} tensor, got {describe(x)}")


def _pos_int(name: str, x: object) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise FuseMLATypeError(f"{name}: expected a positive int, got {describe(x)}")
    if x <= 0:
        raise FuseMLAValueError(f"{name}: expected a positive int, got {x}")
    return x


def _dtype_arg(name: str, x: object, allowed: Sequence[torch.dtype]) -> torch.dtype:
    if not isinstance(x, torch.dtype) or x not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise FuseMLATypeError(f"{name}: expected one of {names}, got {describe(x)}")
    return x


def _finite(name: str, x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):  # syncs: fine at load time
        raise FuseMLAValueError(f"{name}: expected finite values, got inf or NaN in {describe(x)}")


def _heads_apart(x: torch.Tensor, k_major: bool) -> bool:
    """``x`` ``[H, K, N]`` holds each head as one contiguous ``[K, N]`` block (or, ``k_major``,
    one contiguous ``[N, K]`` block), the heads any distance apart that keeps them from
    overlapping: a contiguous tensor (or, ``k_major``, one whose ``transpose(1, 2)`` is), or
    e.g. a view of one side of a checkpoint's ``[H, P + V, L]`` weight."""
    H, K, N = x.shape
    inner = x[:1].transpose(1, 2) if k_major else x[:1]
    if not inner.is_contiguous():
        return False
    return H == 1 or K * N == 0 or x.stride(0) >= K * N


def _block_size(block_size: object) -> tuple[int, int]:
    """A checkpoint's ``weight_block_size`` ``(bn, bk)``: two positive ints."""
    if (
        not isinstance(block_size, (tuple, list))
        or len(block_size) != 2
        or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block_size)
    ):
        raise FuseMLAValueError(
            f"block_size: expected two positive ints (bn, bk), got {describe(block_size)}"
        )
    return block_size[0], block_size[1]


def _pow2(exp: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2**exp`` for int ``exp`` in [-127, 128] (-127: subnormal; 128: NaN).

    Built from the bit pattern, so no ``exp2`` rounding and no flush-to-zero of ``2**-127``.
    """
    e = exp.to(torch.int32)
    bits = torch.where(e == -127, torch.full_like(e, 1 << 22), (e + 127) << 23)
    bits = torch.where(e >= 128, torch.full_like(e, 0x7FC00000), bits)
    return bits.view(torch.float32)


# ----------------------------------------------------------------------------- container


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized per-head weight ``[H, K, N]`` (K = reduction dim, N = output dim): the
    prologue's ``W_UK_T`` ``[H, P, L]``, or the epilogue's ``W_UV`` ``[H, L, V]``.

    ``format == "fp8"``:
        ``data``: ``[H, K, N]`` ``float8_e4m3fn`` or ``float8_e4m3fnuz``, contiguous or K-major
        (``data.transpose(1, 2)`` contiguous: what :func:`quantize_fp8_weight` makes), or either
        of these per head with the heads further apart (``data.stride(0) >= K * N``): a view of
        one side of a checkpoint's ``kv_b_proj`` (:func:`split_kv_b_proj_fp8` with
        ``share=True``).
        ``scale``: fp32, contiguous: ``[1]`` (per tensor), ``[H]`` (per head), or with
        ``block=(bk, bn)`` ``[H, ceil(K / bk), ceil(N / bn)]`` (one scale per block of each
        head, DeepSeek's 128 x 128 ``weight_scale_inv`` as the checkpoint stores it, in this
        weight's orientation); ``w ~= data.float() * scale`` (broadcast over its block).
    ``format == "mxfp4"``:
        ``data``: ``[H, P // 2, L]`` uint8, contiguous; two e2m1 codes per byte along ``P``: the
        low nibble holds ``p = 2*i``, the high nibble ``p = 2*i + 1``.
        ``scale``: uint8 e8m0 ``[H, P // 32, L]``, contiguous;
        ``w[h, p, l] ~= e2m1(code) * 2**(scale[h, p // 32, l] - 127)``.

    Shapes, dtypes, layout and devices are checked on construction (values are not: that would
    sync). With ``H == 1`` a ``[1]`` fp8 scale reports granularity ``"tensor"``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    format: str
    #: FP8 block scales only: the block's (rows along K, columns along N); None otherwise
    block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.format, str):
            raise FuseMLATypeError(
                f"format: expected a str ('fp8' or 'mxfp4'), got {describe(self.format)}"
            )
        if self.format not in FORMATS:
            raise FuseMLAValueError(f"format: expected 'fp8' or 'mxfp4', got {self.format!r}")
        data = _tensor("data", self.data)
        scale = _tensor("scale", self.scale)
        if self.block is not None and self.format != "fp8":
            raise FuseMLAValueError(
                f"block: block scales are FP8 weights' (format 'fp8'), got format {self.format!r}"
            )
        if self.format == "fp8":
            _dtype("data", data, FP8_DTYPES)
            _rank("data", data, 3, "[H, K, N]")
            _dtype("scale", scale, (torch.float32,))
            H, K, N = data.shape
            if self.block is not None:
                blk = self.block
                if not (
                    isinstance(blk, tuple)
                    and len(blk) == 2
                    and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in blk)
                ):
                    raise FuseMLAValueError(
                        f"block: expected a pair of positive ints (e.g. (128, 128)), got {blk!r}"
                    )
                expected = (H, -(-K // blk[0]), -(-N // blk[1]))
                if tuple(scale.shape) != expected:
                    raise FuseMLAValueError(
                        f"scale: expected shape [H, ceil(K / {blk[0]}), ceil(N / {blk[1]})] = "
                        f"{list(expected)} for block {blk}, got {describe(scale)}"
                    )
            elif scale.shape not in ((1,), (H,)):
                raise FuseMLAValueError(
                    f"scale: expected shape [1] (per tensor) or [H={H}] "
                    f"(per head) (or block scales with block=(bk, bn)), got {describe(scale)}"
                )
        else:
            _dtype("data", data, (torch.uint8,))
            _rank("data", data, 3, "[H, P // 2, L]")
            _dtype("scale", scale, (torch.uint8,))
            H, half, L = data.shape
            if (2 * half) % MX_BLOCK:
                raise FuseMLAValueError(
                    f"data: expected [H, P // 2, L] with P = 2 * "
                    f"data.shape[1] a multiple of {MX_BLOCK}, got P = "
                    f"{2 * half} from {describe(data)}"
                )
            expected = (H, 2 * half // MX_BLOCK, L)
            if tuple(scale.shape) != expected:
                raise FuseMLAValueError(
                    f"scale: expected shape [H, P // 32, L] = "
                    f"{list(expected)}, got {describe(scale)}"
                )
        fp8 = self.format == "fp8"
        if not (
            (_heads_apart(data, False) or _heads_apart(data, True)) if fp8 else data.is_contiguous()
        ):
            raise FuseMLAValueError(
                "data: expected a contiguous tensor"
                + (
                    " or a K-major one (data.transpose(1, 2) contiguous), or heads apart "
                    "(each head's [K, N] or K-major [N, K] contiguous, heads not overlapping)"
                    if fp8
                    else ""
                )
                + f", got {describe(data)}"
            )
        if not scale.is_contiguous():
            raise FuseMLAValueError(f"scale: expected a contiguous tensor, got {describe(scale)}")
        if scale.device != data.device:
            raise FuseMLATypeError(
                f"scale: expected device {data.device} (that of data), got {describe(scale)}"
            )

    @property
    def H(self) -> int:
        """Number of heads."""
        return self.data.shape[0]

    @property
    def K(self) -> int:
        """Reduction dim, unpacked (W_UK_T's P, W_UV's L)."""
        return self.data.shape[1] * (2 if self.format == "mxfp4" else 1)

    @property
    def N(self) -> int:
        """Output dim (W_UK_T's L, W_UV's V)."""
        return self.data.shape[2]

    #: W_UK_T's names for (K, N): ``qk_nope_head_dim`` and ``kv_lora_rank``
    P = K
    L = N

    @property
    def shape(self) -> tuple[int, int, int]:
        """The logical shape ``(H, K, N)``."""
        return (self.H, self.K, self.N)

    @property
    def k_major(self) -> bool:
        """FP8 ``data`` stored K-major (each head's ``data[h].T`` contiguous, ``data`` not
        contiguous)."""
        d = self.data
        return self.format == "fp8" and not _heads_apart(d, False) and _heads_apart(d, True)

    @property
    def device(self) -> torch.device:
        """Device of ``data`` and ``scale``."""
        return self.data.device

    @property
    def granularity(self) -> str:
        """``"tensor"``, ``"head"`` or ``"block"`` (fp8; :attr:`block` gives its size),
        ``"block32"`` (mxfp4)."""
        if self.format == "mxfp4":
            return "block32"
        if self.block is not None:
            return "block"
        return "tensor" if self.scale.shape == (1,) else "head"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real weight ``[H, K, N]`` in ``dtype``, computed in fp32 then cast."""
        dtype = _dtype_arg("dtype", dtype, FLOAT_DTYPES)
        if self.format == "fp8" and self.block is not None:
            bk, bn = self.block
            s = self.scale.repeat_interleave(bk, dim=1).repeat_interleave(bn, dim=2)
            w = self.data.float() * s[:, : self.K, : self.N]
        elif self.format == "fp8":
            scale = self.scale.view(-1, 1, 1) if self.scale.numel() > 1 else self.scale
            w = self.data.float() * scale
        else:
            w = dequantize_mxfp4(self.data, self.scale)
        return w.to(dtype)


def weight_format(w: object) -> str:
    """The one weight-format rule: ``"plain"`` for a tensor (the activations' dtype), else the
    :class:`QuantizedWeight`'s format (``"fp8"`` or ``"mxfp4"``).

    Raises:
        FuseMLATypeError: ``w`` is neither.
    """
    if isinstance(w, torch.Tensor):
        return "plain"
    if isinstance(w, QuantizedWeight):
        return w.format
    raise FuseMLATypeError(
        f"weight: expected a torch.Tensor or a fusemla.quant.QuantizedWeight, got {describe(w)}"
    )


def weight_parts(w: object) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """``(data, scale, format)`` of a weight: a plain tensor is its own data, with no scale."""
    fmt = weight_format(w)
    return (w, None, fmt) if fmt == "plain" else (w.data, w.scale, fmt)


# ----------------------------------------------------------------------------- fp8


def quantize_fp8_weight(
    w_uk_t: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    per_head: bool = False,
    k_major: bool = True,
    block: tuple[int, int] | None = None,
) -> QuantizedWeight:
    """Symmetric FP8 quantization of ``w_uk_t`` ``[H, P, L]`` (or any ``[H, K, N]`` weight,
    e.g. W_UV; bf16, fp16 or fp32).

    ``scale = amax / fmax`` over the tensor (``[1]``) or each head (``[H]``, ``per_head=True``),
    or each ``block = (bk, bn)`` of each head (``[H, ceil(K / bk), ceil(N / bn)]``, edge blocks
    partial; DeepSeek's checkpoints use 128 x 128),
    with ``fmax`` 448 (e4m3fn) or 240 (e4m3fnuz); an all-zero tensor/head gets scale 1.0 and a
    scale below fp32's smallest normal is raised to it. ``data = saturate(w.float() / scale)``
    (IEEE fp32 division) cast to ``dtype``, rounding to nearest even; so each amax maps to fmax.

    ``k_major`` (default): ``data`` is stored K-major, ``[H, L, P]`` in memory seen as
    ``[H, P, L]`` (``data.transpose(1, 2)`` contiguous): each output column's P codes are one
    contiguous run, the layout the prologue kernel reads fastest at decode batch sizes (on an
    H200 at 128 heads, 8.87 -> 7.99 us per layer at B = 1; benchmarks/results/
    h200_layout_probe_*.json). ``k_major=False``: ``data`` contiguous ``[H, P, L]``. Values
    are the same either way.
    """
    w = _tensor("w_uk_t", w_uk_t)
    _dtype("w_uk_t", w, FLOAT_DTYPES)
    _rank("w_uk_t", w, 3, "[H, P, L]")
    dtype = _dtype_arg("dtype", dtype, FP8_DTYPES)
    for name, flag in (("per_head", per_head), ("k_major", k_major)):
        if not isinstance(flag, bool):
            raise FuseMLATypeError(f"{name}: expected a bool, got {describe(flag)}")
    if block is not None:
        if (
            not isinstance(block, tuple)
            or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block)
        ):
            raise FuseMLAValueError(f"block: expected a pair of positive ints, got {block!r}")
        if per_head:
            raise FuseMLAValueError("block: block scales and per_head=True exclude each other")
    _finite("w_uk_t", w)
    w32 = w.float()
    fmax = float(torch.finfo(dtype).max)
    tiny = torch.finfo(torch.float32).tiny
    if block is not None:
        H, K, N = w32.shape
        bk, bn = block
        kb, nb = -(-K // bk), -(-N // bn)
        padded = w32.new_zeros(H, kb * bk, nb * bn)
        padded[:, :K, :N] = w32
        amax = padded.abs().view(H, kb, bk, nb, bn).amax(dim=(2, 4))  # [H, kb, nb]
        scale = torch.where(amax > 0, (amax / fmax).clamp_min(tiny), torch.ones_like(amax))
        full = scale.repeat_interleave(bk, dim=1).repeat_interleave(bn, dim=2)[:, :K, :N]
        q = (w32 / full).clamp(-fmax, fmax).to(dtype)
    else:
        amax = w32.abs().amax(dim=(1, 2)) if per_head else w32.abs().amax().view(1)
        scale = torch.where(amax > 0, (amax / fmax).clamp_min(tiny), torch.ones_like(amax))
        q = (w32 / scale.view(-1, 1, 1)).clamp(-fmax, fmax).to(dtype)
    q = q.transpose(1, 2).contiguous().transpose(1, 2) if k_major else q.contiguous()
    return QuantizedWeight(q, scale.contiguous(), "fp8", block=block)


# ----------------------------------------------------------------------------- mxfp4


def e2m1_values(device: str | torch.device | None = None) -> torch.Tensor:
    """The 16 e2m1 values as fp32, index = code (bit 3 sign, bits 2..1 exponent, bit 0 mantissa).

    ``[0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, -1, -1.5, -2, -3, -4, -6]``.
    """
    mags = list(_E2M1_MAGNITUDES)
    return torch.tensor(mags + [-m for m in mags], dtype=torch.float32, device=device)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, 0..15) of fp32 ``x``: nearest value, ties to an even code, saturating.

    The magnitude code counts the midpoints between grid values that ``|x|`` passes. At a
    midpoint the tie goes to the neighbour whose mantissa bit is 0 (the even code): past the
    midpoint above an even code only when strictly greater, above an odd code already when
    equal. The sign bit is copied from ``x`` (so a small negative value rounds to -0).
    """
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for k in range(len(_E2M1_MAGNITUDES) - 1):
        mid = (_E2M1_MAGNITUDES[k] + _E2M1_MAGNITUDES[k + 1]) / 2
        code += (a > mid if k % 2 == 0 else a >= mid).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def quantize_mxfp4_weight(w_uk_t: torch.Tensor) -> QuantizedWeight:
    """MXFP4 (OCP MX) quantization of ``w_uk_t`` ``[H, P, L]`` (bf16/fp16/fp32, ``P % 32 == 0``).

    Per block of 32 consecutive ``p`` (per ``h``, ``l``): the shared exponent is
    ``e = floor(log2(amax)) - 2`` clamped to [-127, 127] (an all-zero block gets -127); each
    element ``w / 2**e`` (exact: a power-of-two scaling) is rounded to the nearest e2m1 value,
    ties to the even code, saturating to +-6 (block values in ``[6, 8) * 2**e`` become 6). Codes
    are packed two per byte along ``P`` (low nibble ``p = 2i``), the scale byte is ``e + 127``.
    """
    w = _tensor("w_uk_t", w_uk_t)
    _dtype("w_uk_t", w, FLOAT_DTYPES)
    _rank("w_uk_t", w, 3, "[H, P, L]")
    H, P, L = w.shape
    if P % MX_BLOCK:
        raise FuseMLAValueError(
            f"w_uk_t: expected P (dim 1) a multiple of {MX_BLOCK} for mxfp4, got {describe(w)}"
        )
    _finite("w_uk_t", w)
    blocks = w.float().reshape(H, P // MX_BLOCK, MX_BLOCK, L)
    amax = blocks.abs().amax(dim=2)  # [H, P // 32, L]
    # floor(log2(amax)) exactly, subnormals included: amax = m * 2**k with m in [0.5, 1)
    _, k = torch.frexp(amax)
    e = torch.where(amax > 0, k.to(torch.int32) - 1 - E2M1_EMAX, -E8M0_BIAS)
    e = e.clamp(-E8M0_BIAS, E8M0_BIAS)  # finite fp32 gives e <= 125, so 2**-e is a normal
    scaled = blocks * _pow2(-e)[:, :, None, :]
    codes = _round_e2m1(scaled).reshape(H, P // 2, 2, L)
    data = codes[:, :, 0, :] | (codes[:, :, 1, :] << 4)
    scale = (e + E8M0_BIAS).to(torch.uint8)
    return QuantizedWeight(data.contiguous(), scale.contiguous(), "mxfp4")


def dequantize_mxfp4(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Unpack and scale MXFP4 ``data`` ``[H, P // 2, L]`` uint8 with e8m0 ``scale``
    ``[H, P // 32, L]`` uint8 into fp32 ``[H, P, L]``.

    ``w[h, p, l] = e2m1(nibble) * 2**(scale[h, p // 32, l] - 127)``, exact in fp32 (a scale byte
    of 255, which the quantizer never writes, decodes to NaN as the spec says).
    """
    qw = QuantizedWeight(data, scale, "mxfp4")  # validates
    H, P, L = qw.shape
    lut = e2m1_values(data.device)
    codes = torch.stack([data & 0xF, data >> 4], dim=2).reshape(H, P, L)
    values = lut[codes.long()].reshape(H, P // MX_BLOCK, MX_BLOCK, L)
    factor = _pow2(scale.to(torch.int32) - E8M0_BIAS)[:, :, None, :]
    return (values * factor).reshape(H, P, L)


# ----------------------------------------------------------------------------- checkpoints


def split_kv_b_proj(
    kv_b_proj_weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split DeepSeek's ``kv_b_proj`` weight ``[H * (P + V), L]`` into ``(W_UK_T, W_UV)``.

    The weight is viewed as ``[H, P + V, L]``; ``W_UK_T = [:, :P, :]`` ``[H, P, L]`` and
    ``W_UV = [:, P:, :].transpose(1, 2)`` ``[H, L, V]``; both contiguous, in the input's dtype
    (bf16, fp16 or fp32; dequantize an FP8 checkpoint first with :func:`dequantize_block_fp8`).
    Equivalently ``W_UK_T = W.T.view(L, H, P + V)[..., :P].permute(1, 2, 0)``.
    """
    w = _tensor("kv_b_proj_weight", kv_b_proj_weight)
    if w.dtype in FP8_DTYPES:
        raise FuseMLATypeError(
            f"kv_b_proj_weight: expected dtype bf16, fp16 or fp32 (dequantize "
            f"an FP8 checkpoint with dequantize_block_fp8), got {describe(w)}"
        )
    _dtype("kv_b_proj_weight", w, FLOAT_DTYPES)
    H = _pos_int("num_heads", num_heads)
    P = _pos_int("qk_nope_head_dim", qk_nope_head_dim)
    V = _pos_int("v_head_dim", v_head_dim)
    if w.dim() != 2 or w.shape[0] != H * (P + V) or w.shape[1] == 0:
        raise FuseMLAValueError(
            f"kv_b_proj_weight: expected shape [num_heads * (qk_nope_head_dim "
            f"+ v_head_dim), L] = [{H * (P + V)}, L], got {describe(w)}"
        )
    w3 = w.view(H, P + V, w.shape[1]) if w.is_contiguous() else w.reshape(H, P + V, -1)
    return w3[:, :P, :].contiguous(), w3[:, P:, :].transpose(1, 2).contiguous()


def dequantize_block_fp8(
    weight: torch.Tensor, weight_scale_inv: torch.Tensor, block_size: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """The real fp32 ``[N, K]`` weight of a DeepSeek-V3 block-FP8 checkpoint tensor.

    ``weight``: ``[N, K]`` float8_e4m3fn (or e4m3fnuz); ``weight_scale_inv``: ``[ceil(N / bn),
    ceil(K / bk)]`` fp32 (bf16/fp16 accepted) for ``block_size = (bn, bk)``. Returns
    ``weight.float() * weight_scale_inv[n // bn, k // bk]`` (edge blocks are partial).
    """
    w = _tensor("weight", weight)
    s = _tensor("weight_scale_inv", weight_scale_inv)
    _dtype("weight", w, FP8_DTYPES)
    _dtype("weight_scale_inv", s, FLOAT_DTYPES)
    _rank("weight", w, 2, "[N, K]")
    bn, bk = _block_size(block_size)
    N, K = w.shape
    expected = (-(-N // bn), -(-K // bk))
    if tuple(s.shape) != expected:
        raise FuseMLAValueError(
            f"weight_scale_inv: expected shape [ceil(N / {bn}), ceil(K / "
            f"{bk})] = {list(expected)} for weight [{N}, {K}], "
            f"got {describe(s)}"
        )
    if s.device != w.device:
        raise FuseMLATypeError(
            f"weight_scale_inv: expected device {w.device} (that of weight), got {describe(s)}"
        )
    full = s.float().repeat_interleave(bn, dim=0)[:N].repeat_interleave(bk, dim=1)[:, :K]
    return w.float() * full


def split_kv_b_proj_fp8(
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    *,
    num_heads: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    block_size: tuple[int, int] = (128, 128),
    share: bool = False,
) -> tuple[QuantizedWeight, QuantizedWeight]:
    """Split a DeepSeek-V3 block-FP8 ``kv_b_proj`` into ``(W_UK_T, W_UV)`` as stored: no
    dequantization, no requantization.

    ``weight``: ``[H * (P + V), L]`` float8_e4m3fn (or e4m3fnuz); ``weight_scale_inv``:
    ``[H * (P + V) / bn, ceil(L / bk)]`` fp32 (bf16/fp16 accepted, converted with ``.float()``)
    for ``block_size = (bn, bk)``: ``bn`` rows along the output dim ``H * (P + V)``, ``bk``
    columns along ``L`` (partial edge blocks along ``L`` are fine). Viewed as
    ``[H, P + V, L]``, the two pieces are FP8 :class:`QuantizedWeight` objects with block scales
    in their own ``[H, K-blocks, N-blocks]`` orientation:

    * ``W_UK_T = [:, :P, :]``: ``data`` ``[H, P, L]`` contiguous, ``block=(bn, bk)``, ``scale``
      ``[H, P / bn, ceil(L / bk)]``;
    * ``W_UV = [:, P:, :].transpose(1, 2)``: ``data`` ``[H, L, V]`` stored K-major (memory
      ``[H, V, L]``: each output column's ``L`` codes are one contiguous run),
      ``block=(bk, bn)``, ``scale`` ``[H, ceil(L / bk), V / bn]`` contiguous.

    The codes are byte-identical copies of the checkpoint's bytes (NaN patterns included) and
    the scales are exactly its values, re-indexed; neither output shares memory with the
    inputs. So ``dequantize()`` of each piece equals (``torch.equal``) the fp32 piece of
    ``split_kv_b_proj(dequantize_block_fp8(weight, weight_scale_inv, block_size), ...)``.
    Only shapes, dtypes and devices are checked: this never syncs the device.

    ``share=True``: the codes are views of ``weight`` instead (its own bytes, no copy: an engine
    that keeps ``kv_b_proj`` for prefill holds the codes once), each head ``(P + V) * L``
    elements after the last, so ``weight`` must be contiguous; writing into ``weight`` in place
    changes them. The scales are still copies (``H * (P + V) / bn * ceil(L / bk)`` floats).

    Raises:
        FuseMLATypeError: a non-tensor, a wrong dtype, a non-int dim, or the two tensors on
            different devices.
        FuseMLAValueError: a non-positive dim, a bad ``block_size``, a wrong shape, a block
            of ``bn`` rows that would straddle the W_UK_T / W_UV split inside a head
            (``P % bn != 0``) or the boundary between heads (``V % bn != 0``), or
            ``share=True`` with a non-contiguous ``weight``.
    """
    w = _tensor("weight", weight)
    s = _tensor("weight_scale_inv", weight_scale_inv)
    _dtype("weight", w, FP8_DTYPES)
    _dtype("weight_scale_inv", s, FLOAT_DTYPES)
    H = _pos_int("num_heads", num_heads)
    P = _pos_int("qk_nope_head_dim", qk_nope_head_dim)
    V = _pos_int("v_head_dim", v_head_dim)
    bn, bk = _block_size(block_size)
    _rank("weight", w, 2, "[num_heads * (qk_nope_head_dim + v_head_dim), L]")
    R, L = w.shape
    if R != H * (P + V):
        raise FuseMLAValueError(
            f"weight: expected shape [num_heads * (qk_nope_head_dim + v_head_dim), L] = "
            f"[{H * (P + V)}, L], got {describe(w)}"
        )
    for name, dim, boundary in (
        ("qk_nope_head_dim", P, "the W_UK_T / W_UV split inside a head"),
        ("v_head_dim", V, "the boundary between two heads"),
    ):
        if dim % bn:
            raise FuseMLAValueError(
                f"block_size: a block of bn = {bn} rows (block_size = {tuple(block_size)}) "
                f"would straddle {boundary}: {name} = {dim} is not a multiple of {bn}; each "
                f"head's W_UK_T (P rows) and W_UV (V rows) must be whole blocks of rows"
            )
    expected = (R // bn, -(-L // bk))
    if tuple(s.shape) != expected:
        raise FuseMLAValueError(
            f"weight_scale_inv: expected shape [num_heads * (qk_nope_head_dim + v_head_dim) / "
            f"{bn}, ceil(L / {bk})] = {list(expected)} for weight [{R}, {L}] and block_size "
            f"{tuple(block_size)}, got {describe(s)}"
        )
    if s.device != w.device:
        raise FuseMLATypeError(
            f"weight_scale_inv: expected device {w.device} (that of weight), got {describe(s)}"
        )
    if not isinstance(share, bool):
        raise FuseMLATypeError(f"share: expected a bool, got {describe(share)}")
    if share and not w.is_contiguous():
        raise FuseMLAValueError(
            f"weight: share=True views its codes per head, which needs a contiguous weight, "
            f"got {describe(w)} (share=False copies them)"
        )
    pb, lb = P // bn, expected[1]
    cf = torch.contiguous_format
    if share:
        codes = w.view(H, P + V, L)
        uk_data = codes[:, :P, :]
        uv_data = codes[:, P:, :].transpose(1, 2)
    else:
        codes = w.view(torch.uint8).reshape(H, P + V, L)  # bytes: copied as they are, never cast
        uk_data = codes[:, :P, :].clone(memory_format=cf).view(w.dtype)
        uv_data = codes[:, P:, :].clone(memory_format=cf).view(w.dtype).transpose(1, 2)
    s3 = s.float().reshape(H, pb + V // bn, lb)
    uk_scale = s3[:, :pb, :].clone(memory_format=cf)
    uv_scale = s3[:, pb:, :].transpose(1, 2).clone(memory_format=cf)
    return (
        QuantizedWeight(uk_data, uk_scale, "fp8", block=(bn, bk)),
        QuantizedWeight(uv_data, uv_scale, "fp8", block=(bk, bn)),
    )


def prepare_w_uk_t(
    kv_b_proj_weight: torch.Tensor,
    *,
    num_heads: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    weight_scale_inv: torch.Tensor | None = None,
    format: str = "bf16",
    per_head: bool = False,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor | QuantizedWeight, torch.Tensor]:
    """``(W_UK_T, W_UV)`` for the kernel, from a checkpoint's ``kv_b_proj`` weight.

    ``kv_b_proj_weight``: ``[H * (P + V), L]`` bf16/fp16/fp32, or FP8 with its block
    ``weight_scale_inv`` (dequantized first, see :func:`dequantize_block_fp8`). The weight is
    split in fp32 (:func:`split_kv_b_proj`) and W_UK_T is returned as ``format``:

    * ``"bf16"``: unquantized ``[H, P, L]`` tensor in ``dtype`` (bf16, fp16 or fp32);
    * ``"fp8"``: :func:`quantize_fp8_weight` (``fp8_dtype``, ``per_head``);
    * ``"mxfp4"``: :func:`quantize_mxfp4_weight`.

    Quantization starts from the fp32 values, never from a bf16 rounding. ``W_UV`` is
    ``[H, L, V]`` in ``dtype``.
    """
    w = _tensor("kv_b_proj_weight", kv_b_proj_weight)
    if not isinstance(format, str) or format not in ("bf16", *FORMATS):
        raise FuseMLAValueError(f"format: expected 'bf16', 'fp8' or 'mxfp4', got {format!r}")
    dtype = _dtype_arg("dtype", dtype, FLOAT_DTYPES)
    if w.dtype in FP8_DTYPES:
        if weight_scale_inv is None:
            raise FuseMLAValueError(
                f"weight_scale_inv: required when kv_b_proj_weight is FP8, "
                f"got None for kv_b_proj_weight {describe(w)}"
            )
        w32 = dequantize_block_fp8(w, weight_scale_inv)
    else:
        if weight_scale_inv is not None:
            raise FuseMLAValueError(
                f"weight_scale_inv: expected None for a non-FP8 "
                f"kv_b_proj_weight {describe(w)}, got "
                f"{describe(weight_scale_inv)}"
            )
        _dtype("kv_b_proj_weight", w, FLOAT_DTYPES)
        w32 = w.float()
    w_uk_t, w_uv = split_kv_b_proj(w32, num_heads, qk_nope_head_dim, v_head_dim)
    if format == "fp8":
        uk: torch.Tensor | QuantizedWeight = quantize_fp8_weight(
            w_uk_t, dtype=fp8_dtype, per_head=per_head
        )
    elif format == "mxfp4":
        uk = quantize_mxfp4_weight(w_uk_t)
    else:
        uk = w_uk_t.to(dtype)
    return uk, w_uv.to(dtype)
