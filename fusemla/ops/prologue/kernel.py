"""The fused MLA prologue kernel: absorbed W_UK BMM + RoPE + 576-wide concat + paged cache write,
for a whole decode-first batch (decode tokens ``[0, D)``, prefill tokens ``[D, N)``) in one launch.

One flat grid with four kinds of program:

* BMM programs over the decode tokens only. The work is cut into
  ``H * cdiv(L, BLOCK_L) * cdiv(D, BLOCK_T)`` items (head, L-tile, token tile); item
  ``(h, l, t)`` is ``q[t-tile, h, l-tile] = q_nope[t-tile, h, :] @ W_UK_T[h][:, l-tile]`` on the
  tensor cores, stored straight into the query buffer (zero-copy concat). With one program per
  item every program makes one load -> dot -> store trip (small batches); with fewer programs
  (persistent) each walks its items in a software-pipelined loop, the next item's tiles in
  flight while this one's dot and store run (large batches).
* decode RoPE programs: each rotates ``ROPE_ROWS`` (token, head) rows of ``q_pe`` into
  ``q[t, h, L:]``;
* prefill RoPE programs: the same into ``q_pe_out[t - D, h, :]`` (prefill runs the
  non-absorbed attention: no BMM, no concat);
* cache programs, ``CACHE_ROWS`` tokens each: rotate ``k_pe`` and write ``[kv_c, k_pe_rot]``
  (quantized for an FP8 cache) into the token's slot; prefill tokens also store ``k_pe_rot`` into
  ``k_pe_out[t - D]``.

An FP8 query (both halves) is ``saturate(q / q_scale)`` and an FP8 cache row ``saturate(x /
kv_scale)``, both the IEEE quotient, computed from one reciprocal per program and a multiply and two
fused multiply-adds per element (``triton_helpers.divide_exact``; a division per element cost more
than the rest of the kernel, docs/results.md).

``APPLY_ROPE`` False (the caller already rotated q_pe and k_pe) copies them unrotated.
Out-of-range values the host cannot see without a device sync never cause an out-of-bounds
access: positions are clamped into ``[0, max_position)``; slots that are negative or
``>= num_blocks * block_size`` write nothing.

Format codes (``KV_FP8``, ``Q_FP8``) are those of :data:`fusemla.dtypes.FP8_FORMATS`
(0 = not FP8); every FP8 constant is derived from them in
:func:`fusemla.ops.triton_helpers.round_to_fp8_grid`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fusemla.ops.triton_helpers import (
    cast_rne,
    e2m1_to_f32,
    e8m0_to_f32,
    fp8_max,
    inverse,
    load_rope_halves,
    quantize_value,
    rotate_halves,
    round_to_fp8_grid,
    store_rope_halves,
)


@triton.jit
def _scale(p_scale, scale_value, FROM_PTR: tl.constexpr):
    if FROM_PTR:
        return tl.load(p_scale).to(tl.float32)
    return scale_value


@triton.jit
def _rope_q_program(
    j,
    tok0,
    n_tok,
    max_pos,
    p_qp,
    s_qp_t,
    s_qp_h,
    p_pos,
    s_pos,
    p_cos,
    s_cos,
    p_sin,
    s_sin,
    p_o,
    s_o_t,
    s_o_h,
    o_col0,
    p_os,
    os_value,
    H: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROPE_ROWS: tl.constexpr,
    IS_NEOX: tl.constexpr,
    APPLY_ROPE: tl.constexpr,
    O_FP8: tl.constexpr,
    OS_FROM_PTR: tl.constexpr,
    FIX_BF16: tl.constexpr,
):
    """out[i, h, o_col0:o_col0+R] = rope(q_pe[tok0 + i, h]) for ROPE_ROWS (token, head) rows
    ``i * H + h`` of the ``n_tok`` tokens starting at ``tok0``."""
    o_row = j.to(tl.int64) * ROPE_ROWS + tl.arange(0, ROPE_ROWS)
    m_row = o_row < n_tok * H
    o_i = o_row // H  # token index within the range (the output's row)
    o_t = tok0 + o_i  # token index in the batch (the inputs' row)
    o_h = o_row % H
    x_a, x_b = load_rope_halves(
        p_qp + o_t * s_qp_t + o_h * s_qp_h, m_row, R // 2, BLOCK_R // 2, IS_NEOX
    )
    if APPLY_ROPE:
        pos = tl.load(p_pos + o_t * s_pos, mask=m_row, other=0).to(tl.int64)
        pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
        x_a, x_b = rotate_halves(
            x_a, x_b, pos, m_row, p_cos, s_cos, p_sin, s_sin, R // 2, BLOCK_R // 2
        )
    scale = _scale(p_os, os_value, OS_FROM_PTR)
    inv = inverse(scale, O_FP8)
    ty = p_o.dtype.element_ty
    store_rope_halves(
        p_o + o_i * s_o_t + o_h * s_o_h + o_col0,
        cast_rne(quantize_value(x_a, scale, inv, O_FP8), ty, FIX_BF16),
        cast_rne(quantize_value(x_b, scale, inv, O_FP8), ty, FIX_BF16),
        m_row,
        R // 2,
        BLOCK_R // 2,
        IS_NEOX,
    )


@triton.jit
def _bmm_weights(
    i_h,
    i_l,
    p_w,
    s_w_h,
    s_w_p,
    s_w_l,
    p_ws,
    s_ws_h,
    s_ws_p,
    P: tl.constexpr,
    L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_L: tl.constexpr,
    W_FMT: tl.constexpr,
    MX_NATIVE: tl.constexpr,
    DOT_TY: tl.constexpr,
    W_BN: tl.constexpr,
):
    """Head ``i_h``'s weights for L-tile ``i_l``, ready for tl.dot: ``(b_w, b_w2, w_scale)``.

    Strides ``s_w_h, s_w_p, s_w_l``: any layout (Triton specializes the stride that is 1, so an
    L-contiguous and a K-major weight each get their own vectorized load; K-major is the FP8
    tensor cores' operand layout and the fastest at decode batch sizes).

    W_FMT 0: ``b_w`` = the [P, BLOCK_L] slice. 1 (FP8): the slice upcast to DOT_TY (exact),
    ``w_scale`` its per-tensor or per-head scale; 3 (FP8, block scales whose rows cover all of
    P): ``w_scale`` the [BLOCK_L] scales of each column's ``W_BN``-wide block. 2 (MXFP4),
    dequantized: ``b_w`` / ``b_w2`` =
    the even / odd rows of the slice, [P/2, BLOCK_L] each, one nibble of each packed byte (every
    byte read once); native (MX_NATIVE): the packed [P/2, BLOCK_L] codes and their
    [BLOCK_L, P/32] e8m0 scales for tl.dot_scaled.
    """
    h64 = i_h.to(tl.int64)
    o_l = i_l * BLOCK_L + tl.arange(0, BLOCK_L)
    m_l = o_l < L
    w_scale = 1.0
    # one return statement: compiled Triton wants the same return types on every path
    if W_FMT == 2:
        o_p2 = tl.arange(0, BLOCK_P // 2)
        if MX_NATIVE:
            o_pb = tl.arange(0, BLOCK_P // 32)
            b_w = tl.load(p_w + h64 * s_w_h + o_p2[:, None] * s_w_p + o_l[None, :] * s_w_l)
            b_w2 = tl.load(p_ws + h64 * s_ws_h + o_pb[None, :] * s_ws_p + o_l[:, None])
        else:
            m_w = (o_p2 < P // 2)[:, None] & m_l[None, :]
            b_byte = tl.load(
                p_w + h64 * s_w_h + o_p2[:, None] * s_w_p + o_l[None, :] * s_w_l, mask=m_w, other=0
            ).to(tl.int32)
            # rows 2i and 2i+1 share scale block (2i) // 32 = i // 16 (scale bytes: L1 hits)
            b_sc = e8m0_to_f32(
                tl.load(
                    p_ws + h64 * s_ws_h + (o_p2 // 16)[:, None] * s_ws_p + o_l[None, :],
                    mask=m_w,
                    other=0,
                )
            )
            b_w = (e2m1_to_f32(b_byte & 0xF) * b_sc).to(DOT_TY)  # exact in bf16/fp16
            b_w2 = (e2m1_to_f32(b_byte >> 4) * b_sc).to(DOT_TY)
    else:
        o_p = tl.arange(0, BLOCK_P)
        b_w = tl.load(
            p_w + h64 * s_w_h + o_p[:, None] * s_w_p + o_l[None, :] * s_w_l,
            mask=(o_p < P)[:, None] & m_l[None, :],
            other=0.0,
        ).to(DOT_TY)
        if W_FMT == 1:
            w_scale = tl.load(p_ws + h64 * s_ws_h).to(tl.float32)
        elif W_FMT == 3:
            w_scale = tl.load(p_ws + h64 * s_ws_h + o_l // W_BN, mask=m_l, other=0.0)
        b_w2 = b_w
    return b_w, b_w2, w_scale


@triton.jit
def _bmm_tile(
    i_h,
    i_l,
    i_t,
    b_w,
    b_w2,
    w_scale,
    q_scale,
    q_inv,
    D,
    p_qn,
    s_qn_t,
    s_qn_h,
    p_q,
    s_q_t,
    s_q_h,
    P: tl.constexpr,
    L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_T: tl.constexpr,
    W_FMT: tl.constexpr,
    MX_NATIVE: tl.constexpr,
    Q_FP8: tl.constexpr,
    A_FMT: tl.constexpr,
    A_QUANT: tl.constexpr,
    DOT_TY: tl.constexpr,
    FIX_BF16: tl.constexpr,
):
    """q[t, i_h, l-tile] = q_nope[t, i_h] @ W for the BLOCK_T tokens of token tile ``i_t``
    (rows >= D masked), weights from :func:`_bmm_weights`.

    ``A_QUANT`` (FP8 weights; the FP8 format code of the weight): each token's row is quantized
    to that format with its own scale ``s = amax / fp8_max`` (1 for an all-zero row), codes
    ``saturate(x * (1 / s))`` rounded to nearest even, and the dot runs FP8 x FP8 with exact
    fp32 accumulation, its result multiplied back by ``s``. An FP8 query (``Q_FP8``) stores
    ``saturate(q / q_scale)``, the IEEE quotient from ``q_inv = 1 / q_scale`` (computed once by
    the program)."""
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < D
    o_t64 = o_t.to(tl.int64)
    o_l = i_l * BLOCK_L + tl.arange(0, BLOCK_L)
    p_a = p_qn + o_t64[:, None] * s_qn_t + i_h * s_qn_h
    if W_FMT == 2 and not MX_NATIVE:
        # [BLOCK_T, P/2] even and odd columns against the even and odd weight rows
        o_p2 = tl.arange(0, BLOCK_P // 2)
        m_a = m_t[:, None] & (o_p2 < P // 2)[None, :]
        b_ae = tl.load(p_a + 2 * o_p2[None, :], mask=m_a, other=0.0).to(DOT_TY)
        b_ao = tl.load(p_a + 2 * o_p2[None, :] + 1, mask=m_a, other=0.0).to(DOT_TY)
        b_o = tl.dot(b_ao, b_w2, acc=tl.dot(b_ae, b_w))
    else:
        o_p = tl.arange(0, BLOCK_P)
        b_a = tl.load(p_a + o_p[None, :], mask=m_t[:, None] & (o_p < P)[None, :], other=0.0)
        if W_FMT == 2:
            b_o = tl.dot_scaled(b_a, None, A_FMT, b_w, b_w2, "e2m1")
        elif A_QUANT != 0:
            # one IEEE division per row, a multiply per element (the reference does the same)
            b_af = b_a.to(tl.float32)
            a_scale = tl.math.div_rn(tl.max(tl.abs(b_af), axis=1), fp8_max(A_QUANT))
            a_scale = tl.where(a_scale > 0, a_scale, 1.0)
            a_inv = tl.math.div_rn(tl.full(a_scale.shape, 1.0, tl.float32), a_scale)
            b_aq = round_to_fp8_grid(b_af * a_inv[:, None], A_QUANT)
            # sm_90's FP8 MMA accumulates imprecisely unless told not to (Triton's default
            # there): exact fp32 accumulation, as the reference's
            b_o = tl.dot(b_aq.to(DOT_TY), b_w, max_num_imprecise_acc=0) * a_scale[:, None]
        else:
            b_o = tl.dot(b_a.to(DOT_TY), b_w)
    if W_FMT == 1:
        b_o = b_o * w_scale
    elif W_FMT == 3:
        b_o = b_o * w_scale[None, :]
    b_o = quantize_value(b_o, q_scale, q_inv, Q_FP8)
    p_o = p_q + o_t64[:, None] * s_q_t + i_h * s_q_h + o_l[None, :]
    tl.store(
        p_o, cast_rne(b_o, p_q.dtype.element_ty, FIX_BF16), mask=m_t[:, None] & (o_l < L)[None, :]
    )


@triton.jit
def _bmm_program(
    pid,
    n_bmm,
    D,
    p_qn,
    s_qn_t,
    s_qn_h,
    p_w,
    s_w_h,
    s_w_p,
    s_w_l,
    p_ws,
    s_ws_h,
    s_ws_p,
    p_q,
    s_q_t,
    s_q_h,
    p_qs,
    q_scale_value,
    P: tl.constexpr,
    L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_T: tl.constexpr,
    W_FMT: tl.constexpr,
    W_BN: tl.constexpr,
    MX_NATIVE: tl.constexpr,
    Q_FP8: tl.constexpr,
    Q_SCALE_PTR: tl.constexpr,
    A_FMT: tl.constexpr,
    A_QUANT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FIX_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,
    H: tl.constexpr,
):
    """BMM program ``pid`` of ``n_bmm``: work items ``pid, pid + n_bmm, ...`` of the
    ``H * cdiv(L, BLOCK_L) * cdiv(D, BLOCK_T)`` (head, L-tile, token-tile) items, token tile
    fastest (neighbouring programs share a weight tile in L2 at large batch). Each item is a
    tensor-core dot of [BLOCK_T, P] x [P, BLOCK_L] (BLOCK_T >= 16) stored straight into the
    query buffer (zero-copy concat).

    The first item is peeled off the loop so that its weights are loaded before ``gdc_wait``
    (PDL: they overlap the kernel before); the loop over the rest is software-pipelined
    (``num_stages``): the next item's tiles are in flight while this one's dot and store run.
    """
    NL: tl.constexpr = (L + BLOCK_L - 1) // BLOCK_L
    # the dot's operand type: fp32 under the interpreter; the weight's FP8 type for FP8 x FP8
    if DOT_FP32:
        DOT_TY: tl.constexpr = tl.float32
    elif A_QUANT != 0:
        DOT_TY: tl.constexpr = p_w.dtype.element_ty
    else:
        DOT_TY: tl.constexpr = p_qn.dtype.element_ty
    n_t = tl.cdiv(D, BLOCK_T)
    n_items = H * NL * n_t

    i_t = pid % n_t
    i_h = pid // n_t // NL
    i_l = pid // n_t % NL
    b_w, b_w2, w_scale = _bmm_weights(
        i_h=i_h,
        i_l=i_l,
        p_w=p_w,
        s_w_h=s_w_h,
        s_w_p=s_w_p,
        s_w_l=s_w_l,
        p_ws=p_ws,
        s_ws_h=s_ws_h,
        s_ws_p=s_ws_p,
        P=P,
        L=L,
        BLOCK_P=BLOCK_P,
        BLOCK_L=BLOCK_L,
        W_FMT=W_FMT,
        MX_NATIVE=MX_NATIVE,
        DOT_TY=DOT_TY,
        W_BN=W_BN,
    )
    if USE_PDL:
        # weights are never written by the kernel before us: they were loaded while it ran;
        # everything else (activations, scales, outputs) only after it has completed
        gdc_wait()
    q_scale = _scale(p_qs, q_scale_value, Q_SCALE_PTR)
    q_inv = inverse(q_scale, Q_FP8)
    _bmm_tile(
        i_h=i_h,
        i_l=i_l,
        i_t=i_t,
        b_w=b_w,
        b_w2=b_w2,
        w_scale=w_scale,
        q_scale=q_scale,
        q_inv=q_inv,
        D=D,
        p_qn=p_qn,
        s_qn_t=s_qn_t,
        s_qn_h=s_qn_h,
        p_q=p_q,
        s_q_t=s_q_t,
        s_q_h=s_q_h,
        P=P,
        L=L,
        BLOCK_P=BLOCK_P,
        BLOCK_L=BLOCK_L,
        BLOCK_T=BLOCK_T,
        W_FMT=W_FMT,
        MX_NATIVE=MX_NATIVE,
        Q_FP8=Q_FP8,
        A_FMT=A_FMT,
        A_QUANT=A_QUANT,
        DOT_TY=DOT_TY,
        FIX_BF16=FIX_BF16,
    )
    for item in range(pid + n_bmm, n_items, n_bmm):
        i_t = item % n_t
        i_h = item // n_t // NL
        i_l = item // n_t % NL
        b_w, b_w2, w_scale = _bmm_weights(
            i_h=i_h,
            i_l=i_l,
            p_w=p_w,
            s_w_h=s_w_h,
            s_w_p=s_w_p,
            s_w_l=s_w_l,
            p_ws=p_ws,
            s_ws_h=s_ws_h,
            s_ws_p=s_ws_p,
            P=P,
            L=L,
            BLOCK_P=BLOCK_P,
            BLOCK_L=BLOCK_L,
            W_FMT=W_FMT,
            MX_NATIVE=MX_NATIVE,
            DOT_TY=DOT_TY,
            W_BN=W_BN,
        )
        _bmm_tile(
            i_h=i_h,
            i_l=i_l,
            i_t=i_t,
            b_w=b_w,
            b_w2=b_w2,
            w_scale=w_scale,
            q_scale=q_scale,
            q_inv=q_inv,
            D=D,
            p_qn=p_qn,
            s_qn_t=s_qn_t,
            s_qn_h=s_qn_h,
            p_q=p_q,
            s_q_t=s_q_t,
            s_q_h=s_q_h,
            P=P,
            L=L,
            BLOCK_P=BLOCK_P,
            BLOCK_L=BLOCK_L,
            BLOCK_T=BLOCK_T,
            W_FMT=W_FMT,
            MX_NATIVE=MX_NATIVE,
            Q_FP8=Q_FP8,
            A_FMT=A_FMT,
            A_QUANT=A_QUANT,
            DOT_TY=DOT_TY,
            FIX_BF16=FIX_BF16,
        )


@triton.jit
def _cache_program(
    j,
    N,
    D,
    max_pos,
    num_slots,
    block_size,
    p_kvc,
    s_kvc_t,
    p_kpe,
    s_kpe_t,
    p_pos,
    s_pos,
    p_cos,
    s_cos,
    p_sin,
    s_sin,
    p_slot,
    s_slot,
    p_kvs,
    kv_scale_value,
    p_cache,
    s_cache_b,
    s_cache_s,
    p_kpo,
    s_kpo_t,
    R: tl.constexpr,
    L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_LC: tl.constexpr,
    CACHE_ROWS: tl.constexpr,
    IS_NEOX: tl.constexpr,
    APPLY_ROPE: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_SCALE_PTR: tl.constexpr,
    FIX_BF16: tl.constexpr,
):
    """kv_cache[slot[t]] = [kv_c[t], rope(k_pe[t])] for the CACHE_ROWS tokens
    ``t = j * CACHE_ROWS + i`` (nothing for a skipped slot); a prefill token (t >= D) also gets
    k_pe_out[t - D] = rope(k_pe[t]).

    Branch-free: every load is issued up front and the stores are masked, so the tokens'
    dependent loads (position -> cos/sin) are the only round trips in series.
    """
    o_t = j.to(tl.int64) * CACHE_ROWS + tl.arange(0, CACHE_ROWS)
    m_t = o_t < N
    slot = tl.load(p_slot + o_t * s_slot, mask=m_t, other=-1).to(tl.int64)
    valid = m_t & (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    scale = _scale(p_kvs, kv_scale_value, KV_SCALE_PTR)
    inv = inverse(scale, KV_FP8)

    # [CACHE_ROWS, BLOCK_R / 2] each: the two lanes of every rotary pair of k_pe
    k_a, k_b = load_rope_halves(p_kpe + o_t * s_kpe_t, m_t, R // 2, BLOCK_R // 2, IS_NEOX)
    if APPLY_ROPE:
        pos = tl.load(p_pos + o_t * s_pos, mask=m_t, other=0).to(tl.int64)
        pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
        k_a, k_b = rotate_halves(
            k_a, k_b, pos, m_t, p_cos, s_cos, p_sin, s_sin, R // 2, BLOCK_R // 2
        )

    cache_ty = p_cache.dtype.element_ty
    p_row = p_cache + (slot // block_size) * s_cache_b + (slot % block_size) * s_cache_s
    for l0 in range(0, L, BLOCK_LC):
        o_c = l0 + tl.arange(0, BLOCK_LC)
        m_c = m_t[:, None] & (o_c < L)[None, :]
        b_c = tl.load(p_kvc + o_t[:, None] * s_kvc_t + o_c[None, :], mask=m_c, other=0.0).to(
            tl.float32
        )
        b_c = quantize_value(b_c, scale, inv, KV_FP8)
        tl.store(
            p_row[:, None] + o_c[None, :],
            cast_rne(b_c, cache_ty, FIX_BF16),
            mask=valid[:, None] & (o_c < L)[None, :],
        )
    # prefill tokens: the rotated k_pe for the prefill attention (decode tokens store nothing)
    kpo_ty = p_kpo.dtype.element_ty
    store_rope_halves(
        p_kpo + (o_t - D) * s_kpo_t,
        cast_rne(k_a, kpo_ty, FIX_BF16),
        cast_rne(k_b, kpo_ty, FIX_BF16),
        m_t & (o_t >= D),
        R // 2,
        BLOCK_R // 2,
        IS_NEOX,
    )
    store_rope_halves(
        p_row + L,
        cast_rne(quantize_value(k_a, scale, inv, KV_FP8), cache_ty, FIX_BF16),
        cast_rne(quantize_value(k_b, scale, inv, KV_FP8), cache_ty, FIX_BF16),
        valid,
        R // 2,
        BLOCK_R // 2,
        IS_NEOX,
    )


@triton.heuristics(
    {
        "KV_SCALE_PTR": lambda a: a["p_kv_scale"] is not None,
        "Q_SCALE_PTR": lambda a: a["p_q_scale"] is not None,
    }
)
@triton.jit(
    do_not_specialize=[
        "N",
        "D",
        "n_bmm",
        "n_rope_d",
        "n_rope_p",
        "num_slots",
        "max_pos",
        "kv_scale_value",
        "q_scale_value",
    ]
)
def mla_prologue_kernel(
    p_qn,
    s_qn_t,
    s_qn_h,
    p_qp,
    s_qp_t,
    s_qp_h,
    p_kvc,
    s_kvc_t,
    p_kpe,
    s_kpe_t,
    p_w,
    s_w_h,
    s_w_p,
    s_w_l,
    p_ws,
    s_ws_h,
    s_ws_p,
    p_pos,
    s_pos,
    p_cos,
    s_cos,
    p_sin,
    s_sin,
    p_slot,
    s_slot,
    p_kv_scale,
    kv_scale_value,
    p_q,
    s_q_t,
    s_q_h,
    p_q_scale,
    q_scale_value,
    p_qpo,
    s_qpo_t,
    s_qpo_h,
    p_kpo,
    s_kpo_t,
    p_cache,
    s_cache_b,
    s_cache_s,
    N,
    D,
    n_bmm,
    n_rope_d,
    n_rope_p,
    max_pos,
    num_slots,
    block_size,
    H: tl.constexpr,
    P: tl.constexpr,
    R: tl.constexpr,
    L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_LC: tl.constexpr,
    ROPE_ROWS: tl.constexpr,
    CACHE_ROWS: tl.constexpr,
    IS_NEOX: tl.constexpr,
    APPLY_ROPE: tl.constexpr,
    KV_FP8: tl.constexpr,
    Q_FP8: tl.constexpr,
    W_FMT: tl.constexpr,
    W_BN: tl.constexpr,
    MX_NATIVE: tl.constexpr,
    A_FMT: tl.constexpr,
    A_QUANT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FIX_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
    KV_SCALE_PTR: tl.constexpr,
    Q_SCALE_PTR: tl.constexpr,
):
    """Programs in order: n_bmm BMM programs (decode tokens; persistent when there are more
    work items than programs), n_rope_d decode q-RoPE row tiles, n_rope_p prefill q-RoPE row
    tiles, cdiv(N, CACHE_ROWS) cache row tiles (every token).

    ``USE_PDL`` (programmatic dependent launch, sm_90+): the kernel may start while the kernel
    before it still runs; BMM programs load their first weight tile first and every program
    waits (``gdc_wait``) before reading anything else or writing. ``PDL_TRIGGER``
    (``FUSEMLA_PDL_TRIGGER``, off by default): the kernel after it may be launched at once
    (``gdc_launch_dependents``) and must wait for this one's results itself; off, it starts
    when this one completes, as after a plain launch (vLLM's FlashMLA dense decode kernel is
    launched for PDL and reads its query and cache without waiting).
    """
    pid = tl.program_id(0)
    if USE_PDL:
        if PDL_TRIGGER:
            gdc_launch_dependents()
        if pid >= n_bmm:
            gdc_wait()
    if pid < n_bmm:
        _bmm_program(
            pid=pid,
            n_bmm=n_bmm,
            D=D,
            p_qn=p_qn,
            s_qn_t=s_qn_t,
            s_qn_h=s_qn_h,
            p_w=p_w,
            s_w_h=s_w_h,
            s_w_p=s_w_p,
            s_w_l=s_w_l,
            p_ws=p_ws,
            s_ws_h=s_ws_h,
            s_ws_p=s_ws_p,
            p_q=p_q,
            s_q_t=s_q_t,
            s_q_h=s_q_h,
            p_qs=p_q_scale,
            q_scale_value=q_scale_value,
            P=P,
            L=L,
            BLOCK_P=BLOCK_P,
            BLOCK_L=BLOCK_L,
            BLOCK_T=BLOCK_T,
            W_FMT=W_FMT,
            W_BN=W_BN,
            MX_NATIVE=MX_NATIVE,
            Q_FP8=Q_FP8,
            Q_SCALE_PTR=Q_SCALE_PTR,
            A_FMT=A_FMT,
            A_QUANT=A_QUANT,
            DOT_FP32=DOT_FP32,
            FIX_BF16=FIX_BF16,
            USE_PDL=USE_PDL,
            H=H,
        )
    elif pid < n_bmm + n_rope_d:
        # decode tokens [0, D): rotated q_pe into the query's last R columns
        _rope_q_program(
            j=pid - n_bmm,
            tok0=0,
            n_tok=D,
            max_pos=max_pos,
            p_qp=p_qp,
            s_qp_t=s_qp_t,
            s_qp_h=s_qp_h,
            p_pos=p_pos,
            s_pos=s_pos,
            p_cos=p_cos,
            s_cos=s_cos,
            p_sin=p_sin,
            s_sin=s_sin,
            p_o=p_q,
            s_o_t=s_q_t,
            s_o_h=s_q_h,
            o_col0=L,
            p_os=p_q_scale,
            os_value=q_scale_value,
            H=H,
            R=R,
            BLOCK_R=BLOCK_R,
            ROPE_ROWS=ROPE_ROWS,
            IS_NEOX=IS_NEOX,
            APPLY_ROPE=APPLY_ROPE,
            O_FP8=Q_FP8,
            OS_FROM_PTR=Q_SCALE_PTR,
            FIX_BF16=FIX_BF16,
        )
    elif pid < n_bmm + n_rope_d + n_rope_p:
        # prefill tokens [D, N): rotated q_pe into q_pe_out, unquantized
        _rope_q_program(
            j=pid - n_bmm - n_rope_d,
            tok0=D,
            n_tok=N - D,
            max_pos=max_pos,
            p_qp=p_qp,
            s_qp_t=s_qp_t,
            s_qp_h=s_qp_h,
            p_pos=p_pos,
            s_pos=s_pos,
            p_cos=p_cos,
            s_cos=s_cos,
            p_sin=p_sin,
            s_sin=s_sin,
            p_o=p_qpo,
            s_o_t=s_qpo_t,
            s_o_h=s_qpo_h,
            o_col0=0,
            p_os=p_q_scale,
            os_value=q_scale_value,
            H=H,
            R=R,
            BLOCK_R=BLOCK_R,
            ROPE_ROWS=ROPE_ROWS,
            IS_NEOX=IS_NEOX,
            APPLY_ROPE=APPLY_ROPE,
            O_FP8=0,
            OS_FROM_PTR=False,
            FIX_BF16=FIX_BF16,
        )
    else:
        _cache_program(
            j=pid - n_bmm - n_rope_d - n_rope_p,
            N=N,
            D=D,
            max_pos=max_pos,
            num_slots=num_slots,
            block_size=block_size,
            p_kvc=p_kvc,
            s_kvc_t=s_kvc_t,
            p_kpe=p_kpe,
            s_kpe_t=s_kpe_t,
            p_pos=p_pos,
            s_pos=s_pos,
            p_cos=p_cos,
            s_cos=s_cos,
            p_sin=p_sin,
            s_sin=s_sin,
            p_slot=p_slot,
            s_slot=s_slot,
            p_kvs=p_kv_scale,
            kv_scale_value=kv_scale_value,
            p_cache=p_cache,
            s_cache_b=s_cache_b,
            s_cache_s=s_cache_s,
            p_kpo=p_kpo,
            s_kpo_t=s_kpo_t,
            R=R,
            L=L,
            BLOCK_R=BLOCK_R,
            BLOCK_LC=BLOCK_LC,
            CACHE_ROWS=CACHE_ROWS,
            IS_NEOX=IS_NEOX,
            APPLY_ROPE=APPLY_ROPE,
            KV_FP8=KV_FP8,
            KV_SCALE_PTR=KV_SCALE_PTR,
            FIX_BF16=FIX_BF16,
        )
