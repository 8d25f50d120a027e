"""The fused MLA prologue kernel: absorbed W_UK BMM + RoPE + 576-wide concat + paged cache write,
for a whole decode-first batch (decode tokens ``[0, D)``, prefill tokens ``[D, N)``) in one launch.

One flat grid with four kinds of program:

* BMM programs, ``H * cdiv(L, BLOCK_L) * n_chunks`` of them, over the decode tokens only.
  Program (h, l-tile, chunk) loads its ``[P, BLOCK_L]`` slice of ``W_UK_T[h]`` once, then walks
  its chunk of tokens ``BLOCK_T`` at a time: ``q[t, h, l-tile] = q_nope[t, h, :] @ W`` on the
  tensor cores, stored straight into the query buffer (zero-copy concat).
* decode RoPE programs: each rotates ``ROPE_ROWS`` (token, head) rows of ``q_pe`` into
  ``q[t, h, L:]``;
* prefill RoPE programs: the same into ``q_pe_out[t - D, h, :]`` (prefill runs the
  non-absorbed attention: no BMM, no concat);
* cache programs, one per token: rotate ``k_pe`` and write ``[kv_c, k_pe_rot]`` (quantized
  for an FP8 cache) into the token's slot; prefill tokens also store ``k_pe_rot`` into
  ``k_pe_out[t - D]``.

``APPLY_ROPE`` False (the caller already rotated q_pe and k_pe) copies them unrotated.
Out-of-range values the host cannot see without a device sync never cause an out-of-bounds
access: positions are clamped into ``[0, max_position)``; slots that are negative or
``>= num_blocks * block_size`` write nothing.

Format codes (``KV_FP8``, ``Q_FP8``, ``W_CODE``) are those of :data:`fusemla.dtypes.FP8_FORMATS`
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
    quantize_value,
    rope_indices,
    round_to_fp8_grid,
)


@triton.jit
def _scale(p_scale, scale_value, FROM_PTR: tl.constexpr):
    if FROM_PTR:
        return tl.load(p_scale).to(tl.float32)
    return scale_value


@triton.jit
def _rope_q_program(
    j, tok0, n_tok, max_pos,
    p_qp, s_qp_t, s_qp_h, p_pos, s_pos, p_cos, s_cos, p_sin, s_sin,
    p_o, s_o_t, s_o_h, o_col0, p_os, os_value,
    H: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, ROPE_ROWS: tl.constexpr,
    IS_NEOX: tl.constexpr, APPLY_ROPE: tl.constexpr, O_FP8: tl.constexpr,
    OS_FROM_PTR: tl.constexpr, FIX_BF16: tl.constexpr,
):
    """out[i, h, o_col0:o_col0+R] = rope(q_pe[tok0 + i, h]) for ROPE_ROWS (token, head) rows
    ``i * H + h`` of the ``n_tok`` tokens starting at ``tok0``."""
    o_row = j.to(tl.int64) * ROPE_ROWS + tl.arange(0, ROPE_ROWS)
    m_row = o_row < n_tok * H
    o_i = o_row // H  # token index within the range (the output's row)
    o_t = tok0 + o_i  # token index in the batch (the inputs' row)
    o_h = o_row % H
    o_r = tl.arange(0, BLOCK_R)
    o_partner, o_col, sign = rope_indices(o_r, R, IS_NEOX)
    m = m_row[:, None] & (o_r < R)[None, :]
    # [ROPE_ROWS, BLOCK_R]
    p_x = p_qp + o_t[:, None] * s_qp_t + o_h[:, None] * s_qp_h
    b_x = tl.load(p_x + o_r[None, :], mask=m, other=0.0).to(tl.float32)
    if APPLY_ROPE:
        pos = tl.load(p_pos + o_t * s_pos, mask=m_row, other=0).to(tl.int64)
        pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
        b_y = tl.load(p_x + o_partner[None, :], mask=m, other=0.0).to(tl.float32)
        b_cos = tl.load(p_cos + pos[:, None] * s_cos + o_col[None, :], mask=m, other=0.0)
        b_sin = tl.load(p_sin + pos[:, None] * s_sin + o_col[None, :], mask=m, other=0.0)
        b_x = b_x * b_cos.to(tl.float32) + b_y * (b_sin.to(tl.float32) * sign[None, :])
    b_x = quantize_value(b_x, _scale(p_os, os_value, OS_FROM_PTR), O_FP8)
    p_out = p_o + o_i[:, None] * s_o_t + o_h[:, None] * s_o_h + o_col0 + o_r[None, :]
    tl.store(p_out, cast_rne(b_x, p_o.dtype.element_ty, FIX_BF16), mask=m)


@triton.jit
def _load_w_tile(
    p_w, s_w_h, s_w_p, p_ws, s_ws_h, s_ws_p, i_h, o_p, o_l, m_w,
    W_FMT: tl.constexpr, MX_NATIVE: tl.constexpr, ACT_FP8: tl.constexpr,
    DOT_TY: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """This head's [P, BLOCK_L] weight slice, ready for tl.dot (or, for native MXFP4, the
    packed [P/2, BLOCK_L] codes and their [BLOCK_L, P/32] scales for tl.dot_scaled)."""
    h64 = i_h.to(tl.int64)
    # one return statement: compiled Triton wants the same return types on every path
    if W_FMT == 2:
        if MX_NATIVE:
            o_p2 = tl.arange(0, BLOCK_P // 2)
            o_pb = tl.arange(0, BLOCK_P // 32)
            b_w = tl.load(p_w + h64 * s_w_h + o_p2[:, None] * s_w_p + o_l[None, :])
            b_s = tl.load(p_ws + h64 * s_ws_h + o_pb[None, :] * s_ws_p + o_l[:, None])
        else:
            # dequantize in registers: each packed byte is read for both nibbles (L1 hits)
            b_byte = tl.load(p_w + h64 * s_w_h + (o_p // 2)[:, None] * s_w_p + o_l[None, :],
                             mask=m_w, other=0).to(tl.int32)
            b_code = tl.where((o_p % 2 == 0)[:, None], b_byte & 0xF, b_byte >> 4)
            b_sc = tl.load(p_ws + h64 * s_ws_h + (o_p // 32)[:, None] * s_ws_p + o_l[None, :],
                           mask=m_w, other=0)
            b_w = (e2m1_to_f32(b_code) * e8m0_to_f32(b_sc)).to(DOT_TY)  # exact in bf16/fp16
            b_s = b_w
    else:
        b_w = tl.load(p_w + h64 * s_w_h + o_p[:, None] * s_w_p + o_l[None, :], mask=m_w,
                      other=0.0)
        if W_FMT == 1 and not ACT_FP8:
            b_w = b_w.to(DOT_TY)  # e4m3 -> bf16/fp16 is exact
        elif DOT_TY == tl.float32:
            b_w = b_w.to(tl.float32)
        b_s = b_w
    return b_w, b_s


@triton.jit
def _bmm_program(
    pid, D, tokens_per_chunk, n_chunks,
    p_qn, s_qn_t, s_qn_h,
    p_w, s_w_h, s_w_p, p_ws, s_ws_h, s_ws_p,
    p_q, s_q_t, s_q_h, p_qs, q_scale_value,
    P: tl.constexpr, L: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_T: tl.constexpr,
    W_FMT: tl.constexpr, W_CODE: tl.constexpr, MX_NATIVE: tl.constexpr, ACT_FP8: tl.constexpr,
    Q_FP8: tl.constexpr, Q_SCALE_PTR: tl.constexpr, A_FMT: tl.constexpr,
    DOT_FP32: tl.constexpr, FIX_BF16: tl.constexpr, USE_PDL: tl.constexpr,
):
    """q[t, h, l-tile] = q_nope[t, h] @ W_UK_T[h][:, l-tile] for the chunk's decode tokens, as
    tensor-core dots of [BLOCK_T, P] x [P, BLOCK_L] tiles (BLOCK_T >= 16).

    W_FMT 0: weights in the activations' dtype. 1: FP8 weights (format W_CODE) with a
    per-tensor or per-head scale, upcast in registers (ACT_FP8 False) or dotted against
    activations quantized to FP8 per (token, head) in the kernel (ACT_FP8 True). 2: MXFP4
    weights, dequantized in registers or (MX_NATIVE) fed to tl.dot_scaled.
    """
    NL: tl.constexpr = (L + BLOCK_L - 1) // BLOCK_L
    DOT_TY: tl.constexpr = tl.float32 if DOT_FP32 else p_qn.dtype.element_ty
    i_c = pid % n_chunks
    i_hl = pid // n_chunks
    i_h = i_hl // NL
    i_l = i_hl % NL

    o_p = tl.arange(0, BLOCK_P)
    o_l = i_l * BLOCK_L + tl.arange(0, BLOCK_L)
    m_p = o_p < P
    m_l = o_l < L
    # [BLOCK_P, BLOCK_L]: this head's weight slice, read once for all of the chunk's tokens
    b_w, b_ws = _load_w_tile(p_w, s_w_h, s_w_p, p_ws, s_ws_h, s_ws_p, i_h, o_p, o_l,
                             m_p[:, None] & m_l[None, :], W_FMT, MX_NATIVE, ACT_FP8, DOT_TY,
                             BLOCK_P, BLOCK_L)
    w_scale = 1.0
    if W_FMT == 1:
        w_scale = tl.load(p_ws + i_h * s_ws_h).to(tl.float32)
    if USE_PDL:
        # weights are never written by the kernel before us: they were loaded while it ran;
        # everything else (activations, scales, outputs) only after it has completed
        gdc_wait()
    q_scale = _scale(p_qs, q_scale_value, Q_SCALE_PTR)
    if W_CODE == 1:
        W_FP8_MAX: tl.constexpr = 448.0
    else:
        W_FP8_MAX: tl.constexpr = 240.0

    # the chunk's tokens; the last chunk's tail is masked (bounds stay scalar arithmetic)
    t_start = i_c * tokens_per_chunk
    for t0 in range(t_start, t_start + tokens_per_chunk, BLOCK_T):
        o_t = t0 + tl.arange(0, BLOCK_T)
        m_t = o_t < D
        o_t64 = o_t.to(tl.int64)
        # [BLOCK_T, BLOCK_P]
        p_a = p_qn + o_t64[:, None] * s_qn_t + i_h * s_qn_h + o_p[None, :]
        b_a = tl.load(p_a, mask=m_t[:, None] & m_p[None, :], other=0.0)
        # [BLOCK_T, BLOCK_L]
        if W_FMT == 1 and ACT_FP8:
            # per (token, head): a = a_scale * fp8(a / a_scale), a_scale = amax / FP8_MAX
            b_af = b_a.to(tl.float32)
            amax = tl.max(tl.abs(b_af), axis=1)
            a_scale = tl.where(amax > 0, tl.math.div_rn(amax, W_FP8_MAX), 1.0)
            b_aq = round_to_fp8_grid(tl.math.div_rn(b_af, a_scale[:, None]), W_CODE)
            if DOT_FP32:
                b_o = tl.dot(b_aq, b_w.to(tl.float32))
            else:
                b_o = tl.dot(b_aq.to(p_w.dtype.element_ty), b_w)
            b_o = b_o * a_scale[:, None]
        elif W_FMT == 2 and MX_NATIVE:
            b_o = tl.dot_scaled(b_a, None, A_FMT, b_w, b_ws, "e2m1")
        else:
            b_o = tl.dot(b_a.to(DOT_TY), b_w)
        if W_FMT == 1:
            b_o = b_o * w_scale
        b_o = quantize_value(b_o, q_scale, Q_FP8)
        p_o = p_q + o_t64[:, None] * s_q_t + i_h * s_q_h + o_l[None, :]
        tl.store(p_o, cast_rne(b_o, p_q.dtype.element_ty, FIX_BF16),
                 mask=m_t[:, None] & m_l[None, :])


@triton.jit
def _cache_program(
    t, D, max_pos, num_slots, block_size,
    p_kvc, s_kvc_t, p_kpe, s_kpe_t, p_pos, s_pos,
    p_cos, s_cos, p_sin, s_sin, p_slot, s_slot,
    p_kvs, kv_scale_value, p_cache, s_cache_b, s_cache_s, p_kpo, s_kpo_t,
    R: tl.constexpr, L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_LC: tl.constexpr,
    IS_NEOX: tl.constexpr, APPLY_ROPE: tl.constexpr, KV_FP8: tl.constexpr,
    KV_SCALE_PTR: tl.constexpr, FIX_BF16: tl.constexpr,
):
    """kv_cache[slot] = [kv_c[t], rope(k_pe[t])] for one token (nothing for a skipped slot);
    a prefill token (t >= D) also gets k_pe_out[t - D] = rope(k_pe[t]).

    Branch-free: every load is issued up front and the stores are masked, so the token's
    dependent loads (position -> cos/sin) are the only round trips in series.
    """
    t64 = t.to(tl.int64)
    slot = tl.load(p_slot + t64 * s_slot).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    n_store = tl.where(valid, L + R, 0)  # columns to store: all, or none for a skipped slot
    scale = _scale(p_kvs, kv_scale_value, KV_SCALE_PTR)

    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < R
    p_k = p_kpe + t64 * s_kpe_t
    b_k = tl.load(p_k + o_r, mask=m_r, other=0.0).to(tl.float32)
    if APPLY_ROPE:
        pos = tl.load(p_pos + t64 * s_pos).to(tl.int64)
        pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
        o_partner, o_col, sign = rope_indices(o_r, R, IS_NEOX)
        b_kp = tl.load(p_k + o_partner, mask=m_r, other=0.0).to(tl.float32)
        b_cos = tl.load(p_cos + pos * s_cos + o_col, mask=m_r, other=0.0).to(tl.float32)
        b_sin = tl.load(p_sin + pos * s_sin + o_col, mask=m_r, other=0.0).to(tl.float32)

    cache_ty = p_cache.dtype.element_ty
    p_row = p_cache + (slot // block_size) * s_cache_b + (slot % block_size) * s_cache_s
    for l0 in range(0, L, BLOCK_LC):
        o_c = l0 + tl.arange(0, BLOCK_LC)
        m_c = o_c < L
        b_c = tl.load(p_kvc + t64 * s_kvc_t + o_c, mask=m_c, other=0.0).to(tl.float32)
        b_c = quantize_value(b_c, scale, KV_FP8)
        tl.store(p_row + o_c, cast_rne(b_c, cache_ty, FIX_BF16), mask=o_c < tl.minimum(n_store, L))
    if APPLY_ROPE:
        b_k = b_k * b_cos + b_kp * (b_sin * sign)
    # prefill tokens: the rotated k_pe for the prefill attention (masked off for decode tokens)
    n_kpo = tl.where(t >= D, R, 0)
    tl.store(p_kpo + (t64 - D) * s_kpo_t + o_r, cast_rne(b_k, p_kpo.dtype.element_ty, FIX_BF16),
             mask=o_r < n_kpo)
    b_k = quantize_value(b_k, scale, KV_FP8)
    tl.store(p_row + L + o_r, cast_rne(b_k, cache_ty, FIX_BF16), mask=(L + o_r) < n_store)


@triton.heuristics({
    "KV_SCALE_PTR": lambda a: a["p_kv_scale"] is not None,
    "Q_SCALE_PTR": lambda a: a["p_q_scale"] is not None,
})
@triton.jit(do_not_specialize=["N", "D", "n_bmm", "n_rope_d", "n_rope_p", "tokens_per_chunk",
                               "n_chunks", "num_slots", "max_pos", "kv_scale_value",
                               "q_scale_value"])
def mla_prologue_kernel(
    p_qn, s_qn_t, s_qn_h,
    p_qp, s_qp_t, s_qp_h,
    p_kvc, s_kvc_t,
    p_kpe, s_kpe_t,
    p_w, s_w_h, s_w_p, p_ws, s_ws_h, s_ws_p,
    p_pos, s_pos,
    p_cos, s_cos, p_sin, s_sin,
    p_slot, s_slot,
    p_kv_scale, kv_scale_value,
    p_q, s_q_t, s_q_h, p_q_scale, q_scale_value,
    p_qpo, s_qpo_t, s_qpo_h,
    p_kpo, s_kpo_t,
    p_cache, s_cache_b, s_cache_s,
    N, D, n_bmm, n_rope_d, n_rope_p, tokens_per_chunk, n_chunks, max_pos, num_slots, block_size,
    H: tl.constexpr, P: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_LC: tl.constexpr, ROPE_ROWS: tl.constexpr,
    IS_NEOX: tl.constexpr, APPLY_ROPE: tl.constexpr, KV_FP8: tl.constexpr, Q_FP8: tl.constexpr,
    W_FMT: tl.constexpr, W_CODE: tl.constexpr, MX_NATIVE: tl.constexpr, ACT_FP8: tl.constexpr,
    A_FMT: tl.constexpr, DOT_FP32: tl.constexpr, FIX_BF16: tl.constexpr, USE_PDL: tl.constexpr,
    KV_SCALE_PTR: tl.constexpr, Q_SCALE_PTR: tl.constexpr,
):
    """Programs in order: n_bmm BMM tiles (decode tokens), n_rope_d decode q-RoPE row tiles,
    n_rope_p prefill q-RoPE row tiles, N cache rows (every token).

    ``USE_PDL`` (programmatic dependent launch, sm_90+): the kernel may start while the kernel
    before it still runs; BMM programs load their weight tile first and every program waits
    (``gdc_wait``) before reading anything else or writing; the kernel after it may be launched
    at once (``gdc_launch_dependents``) and must wait for this one's results itself.
    """
    pid = tl.program_id(0)
    if USE_PDL:
        gdc_launch_dependents()
        if pid >= n_bmm:
            gdc_wait()
    if pid < n_bmm:
        _bmm_program(
            pid, D, tokens_per_chunk, n_chunks,
            p_qn, s_qn_t, s_qn_h, p_w, s_w_h, s_w_p, p_ws, s_ws_h, s_ws_p,
            p_q, s_q_t, s_q_h, p_q_scale, q_scale_value,
            P, L, BLOCK_P, BLOCK_L, BLOCK_T, W_FMT, W_CODE, MX_NATIVE, ACT_FP8,
            Q_FP8, Q_SCALE_PTR, A_FMT, DOT_FP32, FIX_BF16, USE_PDL,
        )
    elif pid < n_bmm + n_rope_d:
        _rope_q_program(
            pid - n_bmm, 0, D, max_pos,
            p_qp, s_qp_t, s_qp_h, p_pos, s_pos, p_cos, s_cos, p_sin, s_sin,
            p_q, s_q_t, s_q_h, L, p_q_scale, q_scale_value,
            H, R, BLOCK_R, ROPE_ROWS, IS_NEOX, APPLY_ROPE, Q_FP8, Q_SCALE_PTR, FIX_BF16,
        )
    elif pid < n_bmm + n_rope_d + n_rope_p:
        _rope_q_program(
            pid - n_bmm - n_rope_d, D, N - D, max_pos,
            p_qp, s_qp_t, s_qp_h, p_pos, s_pos, p_cos, s_cos, p_sin, s_sin,
            p_qpo, s_qpo_t, s_qpo_h, 0, p_q_scale, q_scale_value,
            H, R, BLOCK_R, ROPE_ROWS, IS_NEOX, APPLY_ROPE, 0, False, FIX_BF16,
        )
    else:
        _cache_program(
            pid - n_bmm - n_rope_d - n_rope_p, D, max_pos, num_slots, block_size,
            p_kvc, s_kvc_t, p_kpe, s_kpe_t, p_pos, s_pos,
            p_cos, s_cos, p_sin, s_sin, p_slot, s_slot,
            p_kv_scale, kv_scale_value, p_cache, s_cache_b, s_cache_s, p_kpo, s_kpo_t,
            R, L, BLOCK_R, BLOCK_LC, IS_NEOX, APPLY_ROPE, KV_FP8, KV_SCALE_PTR, FIX_BF16,
        )
