"""Triton helpers shared by fusemla's kernels: vectorized RoPE pairs and exact FP8 rounding."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_rope_halves(
    p_rows, m_rows, HALF: tl.constexpr, BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr
):
    """The two halves of each rotary pair for rows ``p_rows`` ([ROWS] row pointers; lanes
    beyond ``2 * HALF`` and rows off ``m_rows`` read 0) as fp32 ``[ROWS, BLOCK_H]`` each:
    pair ``i`` is lanes (2i, 2i+1) interleaved (GPT-J, DeepSeek) or (i, i + HALF) NeoX.

    Every load is contiguous along the row (no per-lane partner gather): interleaved rows are
    read whole and split into even/odd lanes in registers; NeoX rows as two contiguous halves.
    """
    o_h = tl.arange(0, BLOCK_H)
    if IS_NEOX:
        m = m_rows[:, None] & (o_h < HALF)[None, :]
        x_a = tl.load(p_rows[:, None] + o_h[None, :], mask=m, other=0.0).to(tl.float32)
        x_b = tl.load(p_rows[:, None] + HALF + o_h[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        o_r = tl.arange(0, 2 * BLOCK_H)
        m = m_rows[:, None] & (o_r < 2 * HALF)[None, :]
        x = tl.load(p_rows[:, None] + o_r[None, :], mask=m, other=0.0).to(tl.float32)
        x_a, x_b = tl.split(tl.reshape(x, (x.shape[0], BLOCK_H, 2)))
    return x_a, x_b


@triton.jit
def rotate_halves(
    x_a, x_b, pos, m_rows, p_cos, s_cos, p_sin, s_sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr
):
    """Rotate pairs (x_a, x_b) ([ROWS, BLOCK_H] fp32) by the angles of positions ``pos``
    ([ROWS] int64): ``(a cos - b sin, b cos + a sin)``, cos/sin rows read contiguously."""
    o_h = tl.arange(0, BLOCK_H)
    m = m_rows[:, None] & (o_h < HALF)[None, :]
    c = tl.load(p_cos + pos[:, None] * s_cos + o_h[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(p_sin + pos[:, None] * s_sin + o_h[None, :], mask=m, other=0.0).to(tl.float32)
    return x_a * c - x_b * s, x_b * c + x_a * s


@triton.jit
def store_rope_halves(
    p_rows, y_a, y_b, m_rows, HALF: tl.constexpr, BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr
):
    """Store pairs (y_a, y_b) (already in the destination dtype) back into rows ``p_rows`` in
    the layout :func:`load_rope_halves` reads (rows off ``m_rows`` store nothing)."""
    o_h = tl.arange(0, BLOCK_H)
    if IS_NEOX:
        m = m_rows[:, None] & (o_h < HALF)[None, :]
        tl.store(p_rows[:, None] + o_h[None, :], y_a, mask=m)
        tl.store(p_rows[:, None] + HALF + o_h[None, :], y_b, mask=m)
    else:
        o_r = tl.arange(0, 2 * BLOCK_H)
        m = m_rows[:, None] & (o_r < 2 * HALF)[None, :]
        y = tl.reshape(tl.join(y_a, y_b), (y_a.shape[0], 2 * BLOCK_H))
        tl.store(p_rows[:, None] + o_r[None, :], y, mask=m)


@triton.jit
def fp8_max(CODE: tl.constexpr):
    """The largest finite value of FP8 format CODE (1: e4m3fn, 448; 2: e4m3fnuz, 240)."""
    if CODE == 1:
        return 448.0
    return 240.0


@triton.jit
def round_to_fp8_grid(x, CODE: tl.constexpr):
    """Round fp32 ``x`` onto the e4m3 grid (3 mantissa bits), ties to even, saturating.

    ``CODE`` is the format code of :data:`fusemla.dtypes.FP8_FORMATS` (1: e4m3fn, max 448,
    smallest normal exponent -6, has -0; 2: e4m3fnuz, max 240, exponent -7, no -0); every
    constant of the format is derived from it here. The result is an fp32 value that the
    format represents exactly, so any later cast is exact; this sidesteps Triton's
    fp32 -> fp8 downcast, which loses the rounding carry under the interpreter (triton #8322).
    Below the smallest normal the grid spacing stays 2**(MIN_EXP - 3) (subnormals).
    NaN stays NaN.
    """
    if CODE == 1:
        FP8_MAX: tl.constexpr = 448.0
        MIN_EXP: tl.constexpr = -6
    else:
        FP8_MAX: tl.constexpr = 240.0
        MIN_EXP: tl.constexpr = -7
    a = tl.minimum(tl.abs(x), FP8_MAX)
    bits = a.to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) - 127, MIN_EXP)
    # grid spacing 2**(e - 3) and its inverse, built from exponent bits (exact powers of two)
    quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_quantum = ((127 + 3 - e) << 23).to(tl.float32, bitcast=True)
    m = a * inv_quantum  # < 16, exact
    r = (m + 8388608.0) - 8388608.0  # round half to even onto the integers (fp32 RNE add)
    y = r * quantum
    # the sign goes back on as a bit: compilers may treat the sign of a float zero as
    # insignificant, so ``-y`` for y == 0 can lose it
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000
    if CODE != 1:
        sign = tl.where(y > 0, sign, 0)  # e4m3fnuz has no -0 (its byte is NaN)
    y = (y.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, y)


@triton.jit
def round_to_bf16_grid(x):
    """Round fp32 ``x`` to the nearest bf16 value, ties to even, returned as fp32.

    Triton's interpreter truncates in its fp32 -> bf16 cast; rounding first makes that cast
    exact, so CPU runs agree with torch (and with the GPU, whose cast already rounds).
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def cast_rne(x, ty: tl.constexpr, FIX_BF16: tl.constexpr):
    """``x.to(ty)`` rounding to nearest even also where the backend's bf16 cast does not."""
    if FIX_BF16:
        if ty == tl.bfloat16:
            x = round_to_bf16_grid(x)
    return x.to(ty)


@triton.jit
def divide_exact(x, d, inv_d):
    """``x / d`` rounded to nearest even, exactly as an IEEE fp32 division, from ``inv_d`` (the
    caller's IEEE ``1 / d``, computed once for many ``x``): a multiply and two fused
    multiply-adds per element. ``q = x * inv_d`` is within an ulp of the quotient, its residual
    ``x - q * d`` is exact in one fma, and ``q + residual * inv_d`` rounds to the correctly
    rounded quotient (Markstein's theorem: ``inv_d`` correctly rounded, no underflow or
    overflow on the way). Where ``q`` overflows it is kept (the quotient is then beyond fp32 too,
    an infinity either way), and where it is zero too (the correction would turn ``-0`` into
    ``+0``, another FP8 byte); quotients in fp32's subnormal range may differ from IEEE's, which
    no FP8 code can tell (the smallest FP8 step is 2**-9). ``tl.math.div_rn``
    per element costs more than the rest of the prologue at decode batch sizes (docs/results.md)."""
    q = x * inv_d
    r = tl.math.fma(-q, d, x)
    return tl.where((tl.abs(q) < float("inf")) & (q != 0.0), tl.math.fma(r, inv_d, q), q)


@triton.jit
def quantize_value(x, scale, inv_scale, CODE: tl.constexpr):
    """fp32 ``x`` -> the fp32 value an output of FP8 format CODE stores: unchanged for CODE 0
    (not FP8), else ``saturate(x / scale)`` on the e4m3 grid, the IEEE quotient
    (:func:`divide_exact`; ``inv_scale`` is the caller's ``1 / scale``, computed once)."""
    if CODE != 0:
        x = round_to_fp8_grid(divide_exact(x, scale, inv_scale), CODE)
    return x


@triton.jit
def inverse(scale, CODE: tl.constexpr):
    """The IEEE ``1 / scale`` that :func:`quantize_value` wants where an output of FP8 format
    CODE needs it (one division, once per program), else 1."""
    inv = tl.full((), 1.0, tl.float32)
    if CODE != 0:  # one return: a block of scales gives a block of inverses
        inv = tl.math.div_rn(inv, scale)
    return inv


@triton.jit
def e2m1_to_f32(code):
    """4-bit e2m1 codes (sign, 2 exponent bits, 1 mantissa bit) -> fp32 in {0, ±0.5, ..., ±6}."""
    mag = code & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    pow2 = ((e + 126) << 23).to(tl.float32, bitcast=True)  # 2**(e - 1), for e >= 1
    v = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * pow2)
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def e8m0_to_f32(s):
    """e8m0 scale bytes -> 2**(s - 127) (s = 0 reads as 0: the quantizer's all-zero blocks)."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
