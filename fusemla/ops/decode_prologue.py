"""The fused MLA decode prologue: absorbed W_UK BMM + RoPE + 576-wide concat + paged KV-cache write.

One launch, one flat grid with three kinds of program:

* BMM programs, ``H * cdiv(L, BLOCK_L) * n_chunks`` of them. Program (h, l-tile, chunk) loads its
  ``[P, BLOCK_L]`` slice of ``W_UK_T[h]`` once, then walks its chunk of tokens ``BLOCK_T`` at a
  time: ``q[t, h, l-tile] = q_nope[t, h, :] @ W`` on the tensor cores, stored straight into the
  query buffer (zero-copy concat). With one chunk every weight byte is read once per launch;
  large batches split the tokens into a few chunks so the grid fills the GPU.
* RoPE programs, ``cdiv(B * H, ROPE_ROWS)`` of them: each rotates a ``[ROPE_ROWS, R]`` tile of
  (token, head) rows of ``q_pe`` into ``q[t, h, L:]`` (no loop, so no serial latency chain).
* Cache programs, one per token: rotate ``k_pe`` and write ``[kv_c, k_pe_rot]`` (quantized for
  an FP8 cache) into the token's slot. Their token range is independent of the BMM's, which is
  what decode-first mixed batches need (prefill tokens get RoPE and the cache write, no BMM).

Out-of-range values the host cannot see without a device sync never cause an out-of-bounds
access: positions are clamped into ``[0, max_position)``; slots that are negative or
``>= num_blocks * block_size`` write nothing. ``FUSEMLA_DEBUG_CHECKS=1`` turns both into errors
(see :mod:`fusemla.config`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional, Union

import torch
import triton
import triton.language as tl

from fusemla import config
from fusemla.ops import checks
from fusemla.ops.triton_helpers import (
    cast_rne, e2m1_to_f32, e8m0_to_f32, quantize_value, rope_indices, round_to_fp8_grid,
)

if TYPE_CHECKING:  # pragma: no cover
    from fusemla.quant import QuantizedWeight

# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _q_scale(p_qs, q_scale_value, Q_FP8: tl.constexpr, Q_SCALE_FROM_PTR: tl.constexpr):
    if Q_FP8 != 0 and Q_SCALE_FROM_PTR:
        return tl.load(p_qs).to(tl.float32)
    return q_scale_value


@triton.jit
def _rope_q_program(
    j, B, max_pos,
    p_qp, s_qp_t, s_qp_h, p_pos, s_pos, p_cos, s_cos, p_sin, s_sin,
    p_q, s_q_t, s_q_h, p_qs, q_scale_value,
    H: tl.constexpr, R: tl.constexpr, L: tl.constexpr, BLOCK_R: tl.constexpr,
    ROPE_ROWS: tl.constexpr, IS_NEOX: tl.constexpr, Q_FP8: tl.constexpr,
    Q_FP8_MAX: tl.constexpr, Q_FP8_MIN_EXP: tl.constexpr, Q_SCALE_FROM_PTR: tl.constexpr,
    FIX_BF16: tl.constexpr,
):
    """q[t, h, L:L+R] = rope(q_pe[t, h]) for ROPE_ROWS consecutive (token, head) rows."""
    o_row = j.to(tl.int64) * ROPE_ROWS + tl.arange(0, ROPE_ROWS)
    m_row = o_row < B * H
    o_t = o_row // H
    o_h = o_row % H
    o_r = tl.arange(0, BLOCK_R)
    o_partner, o_col, sign = rope_indices(o_r, R, IS_NEOX)
    m = m_row[:, None] & (o_r < R)[None, :]
    pos = tl.load(p_pos + o_t * s_pos, mask=m_row, other=0).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
    # [ROPE_ROWS, BLOCK_R]
    p_x = p_qp + o_t[:, None] * s_qp_t + o_h[:, None] * s_qp_h
    b_x = tl.load(p_x + o_r[None, :], mask=m, other=0.0).to(tl.float32)
    b_y = tl.load(p_x + o_partner[None, :], mask=m, other=0.0).to(tl.float32)
    b_cos = tl.load(p_cos + pos[:, None] * s_cos + o_col[None, :], mask=m, other=0.0)
    b_sin = tl.load(p_sin + pos[:, None] * s_sin + o_col[None, :], mask=m, other=0.0)
    b_out = b_x * b_cos.to(tl.float32) + b_y * (b_sin.to(tl.float32) * sign[None, :])
    q_scale = _q_scale(p_qs, q_scale_value, Q_FP8, Q_SCALE_FROM_PTR)
    b_out = quantize_value(b_out, q_scale, Q_FP8, Q_FP8_MAX, Q_FP8_MIN_EXP)
    p_o = p_q + o_t[:, None] * s_q_t + o_h[:, None] * s_q_h + L + o_r[None, :]
    tl.store(p_o, cast_rne(b_out, p_q.dtype.element_ty, FIX_BF16), mask=m)


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
    pid, B, tokens_per_chunk, n_chunks,
    p_qn, s_qn_t, s_qn_h,
    p_w, s_w_h, s_w_p, p_ws, s_ws_h, s_ws_p,
    p_q, s_q_t, s_q_h, p_qs, q_scale_value,
    P: tl.constexpr, L: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_T: tl.constexpr,
    W_FMT: tl.constexpr, MX_NATIVE: tl.constexpr, ACT_FP8: tl.constexpr,
    W_FP8_MAX: tl.constexpr, W_FP8_MIN_EXP: tl.constexpr, W_FP8_CODE: tl.constexpr,
    Q_FP8: tl.constexpr, Q_FP8_MAX: tl.constexpr, Q_FP8_MIN_EXP: tl.constexpr,
    Q_SCALE_FROM_PTR: tl.constexpr, A_FMT: tl.constexpr,
    DOT_FP32: tl.constexpr, FIX_BF16: tl.constexpr,
):
    """q[t, h, l-tile] = q_nope[t, h] @ W_UK_T[h][:, l-tile] for the chunk's tokens, as
    tensor-core dots of [BLOCK_T, P] x [P, BLOCK_L] tiles (BLOCK_T >= 16).

    W_FMT 0: weights in the activations' dtype. 1: FP8 weights with a per-tensor or per-head
    scale, upcast in registers (ACT_FP8 False) or dotted against activations quantized to FP8
    per (token, head) in the kernel (ACT_FP8 True). 2: MXFP4 weights, dequantized in registers
    or (MX_NATIVE) fed to tl.dot_scaled.
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
    q_scale = _q_scale(p_qs, q_scale_value, Q_FP8, Q_SCALE_FROM_PTR)

    # the chunk's tokens; the last chunk's tail is masked (bounds stay scalar arithmetic)
    t_start = i_c * tokens_per_chunk
    for t0 in range(t_start, t_start + tokens_per_chunk, BLOCK_T):
        o_t = t0 + tl.arange(0, BLOCK_T)
        m_t = o_t < B
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
            b_aq = round_to_fp8_grid(tl.math.div_rn(b_af, a_scale[:, None]), W_FP8_MAX,
                                     W_FP8_MIN_EXP, W_FP8_CODE == 1)
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
        b_o = quantize_value(b_o, q_scale, Q_FP8, Q_FP8_MAX, Q_FP8_MIN_EXP)
        p_o = p_q + o_t64[:, None] * s_q_t + i_h * s_q_h + o_l[None, :]
        tl.store(p_o, cast_rne(b_o, p_q.dtype.element_ty, FIX_BF16),
                 mask=m_t[:, None] & m_l[None, :])


@triton.jit
def _cache_program(
    t, max_pos, num_slots, block_size,
    p_kvc, s_kvc_t,
    p_kpe, s_kpe_t,
    p_pos, s_pos,
    p_cos, s_cos, p_sin, s_sin,
    p_slot, s_slot,
    p_scale, scale_value,
    p_cache, s_cache_b, s_cache_s,
    R: tl.constexpr, L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_LC: tl.constexpr,
    IS_NEOX: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr, SCALE_FROM_PTR: tl.constexpr, FIX_BF16: tl.constexpr,
):
    """kv_cache[slot] = [kv_c[t], rope(k_pe[t])] for one token; nothing for a skipped slot.

    Branch-free: every load is issued up front and the stores are masked, so the token's
    dependent loads (position -> cos/sin) are the only round trips in series.
    """
    t64 = t.to(tl.int64)
    pos = tl.load(p_pos + t64 * s_pos).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
    slot = tl.load(p_slot + t64 * s_slot).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    n_store = tl.where(valid, L + R, 0)  # columns to store: all, or none for a skipped slot
    if SCALE_FROM_PTR:
        scale = tl.load(p_scale).to(tl.float32)
    else:
        scale = scale_value

    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < R
    o_partner, o_col, sign = rope_indices(o_r, R, IS_NEOX)
    p_k = p_kpe + t64 * s_kpe_t
    b_k = tl.load(p_k + o_r, mask=m_r, other=0.0).to(tl.float32)
    b_kp = tl.load(p_k + o_partner, mask=m_r, other=0.0).to(tl.float32)
    b_cos = tl.load(p_cos + pos * s_cos + o_col, mask=m_r, other=0.0).to(tl.float32)
    b_sin = tl.load(p_sin + pos * s_sin + o_col, mask=m_r, other=0.0).to(tl.float32)

    cache_ty = p_cache.dtype.element_ty
    p_row = p_cache + (slot // block_size) * s_cache_b + (slot % block_size) * s_cache_s
    for l0 in range(0, L, BLOCK_LC):
        o_c = l0 + tl.arange(0, BLOCK_LC)
        m_c = o_c < L
        b_c = tl.load(p_kvc + t64 * s_kvc_t + o_c, mask=m_c, other=0.0).to(tl.float32)
        b_c = quantize_value(b_c, scale, KV_FP8, FP8_MAX, FP8_MIN_EXP)
        tl.store(p_row + o_c, cast_rne(b_c, cache_ty, FIX_BF16), mask=o_c < tl.minimum(n_store, L))
    b_k = b_k * b_cos + b_kp * (b_sin * sign)
    b_k = quantize_value(b_k, scale, KV_FP8, FP8_MAX, FP8_MIN_EXP)
    tl.store(p_row + L + o_r, cast_rne(b_k, cache_ty, FIX_BF16), mask=(L + o_r) < n_store)


@triton.jit(do_not_specialize=["B", "n_bmm", "n_rope", "tokens_per_chunk", "n_chunks", "num_slots",
                               "max_pos", "scale_value", "q_scale_value"])
def mla_decode_prologue_kernel(
    p_qn, s_qn_t, s_qn_h,
    p_qp, s_qp_t, s_qp_h,
    p_kvc, s_kvc_t,
    p_kpe, s_kpe_t,
    p_w, s_w_h, s_w_p, p_ws, s_ws_h, s_ws_p,
    p_pos, s_pos,
    p_cos, s_cos, p_sin, s_sin,
    p_slot, s_slot,
    p_scale, scale_value,
    p_q, s_q_t, s_q_h, p_qs, q_scale_value,
    p_cache, s_cache_b, s_cache_s,
    B, n_bmm, n_rope, tokens_per_chunk, n_chunks, max_pos, num_slots, block_size,
    H: tl.constexpr, P: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_LC: tl.constexpr, ROPE_ROWS: tl.constexpr,
    IS_NEOX: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr, SCALE_FROM_PTR: tl.constexpr,
    W_FMT: tl.constexpr, MX_NATIVE: tl.constexpr, ACT_FP8: tl.constexpr,
    W_FP8_MAX: tl.constexpr, W_FP8_MIN_EXP: tl.constexpr, W_FP8_CODE: tl.constexpr,
    Q_FP8: tl.constexpr, Q_FP8_MAX: tl.constexpr, Q_FP8_MIN_EXP: tl.constexpr,
    Q_SCALE_FROM_PTR: tl.constexpr, A_FMT: tl.constexpr,
    DOT_FP32: tl.constexpr, FIX_BF16: tl.constexpr,
):
    """Programs [0, n_bmm): BMM tiles; the next n_rope: q RoPE rows; the last B: cache rows."""
    pid = tl.program_id(0)
    if pid < n_bmm:
        _bmm_program(
            pid, B, tokens_per_chunk, n_chunks,
            p_qn, s_qn_t, s_qn_h, p_w, s_w_h, s_w_p, p_ws, s_ws_h, s_ws_p,
            p_q, s_q_t, s_q_h, p_qs, q_scale_value,
            P, L, BLOCK_P, BLOCK_L, BLOCK_T, W_FMT, MX_NATIVE, ACT_FP8,
            W_FP8_MAX, W_FP8_MIN_EXP, W_FP8_CODE, Q_FP8, Q_FP8_MAX, Q_FP8_MIN_EXP,
            Q_SCALE_FROM_PTR, A_FMT, DOT_FP32, FIX_BF16,
        )
    elif pid < n_bmm + n_rope:
        _rope_q_program(
            pid - n_bmm, B, max_pos,
            p_qp, s_qp_t, s_qp_h, p_pos, s_pos, p_cos, s_cos, p_sin, s_sin,
            p_q, s_q_t, s_q_h, p_qs, q_scale_value, H, R, L, BLOCK_R, ROPE_ROWS, IS_NEOX,
            Q_FP8, Q_FP8_MAX, Q_FP8_MIN_EXP, Q_SCALE_FROM_PTR, FIX_BF16,
        )
    else:
        _cache_program(
            pid - n_bmm - n_rope, max_pos, num_slots, block_size,
            p_kvc, s_kvc_t, p_kpe, s_kpe_t, p_pos, s_pos,
            p_cos, s_cos, p_sin, s_sin, p_slot, s_slot, p_scale, scale_value,
            p_cache, s_cache_b, s_cache_s,
            R, L, BLOCK_R, BLOCK_LC, IS_NEOX, KV_FP8, FP8_MAX, FP8_MIN_EXP,
            SCALE_FROM_PTR, FIX_BF16,
        )


# --------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------

_FP8_FORMATS = {  # FP8 dtype (cache, weight or q) -> (format code, max, smallest normal exponent)
    torch.float8_e4m3fn: (1, 448.0, -6),
    torch.float8_e4m3fnuz: (2, 240.0, -7),
}


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


#: decode batches up to this size use the small-batch tile config (one extra compiled variant)
SMALL_BATCH = 8


@functools.lru_cache(maxsize=None)
def launch_config(H: int, P: int, R: int, L: int, backend: str, small: bool = False) -> dict:
    """Tile sizes for one model shape on one backend ("cuda", "hip" or "interpreter").

    Keyed on the model dims and on one batch bucket (``small``: B <= SMALL_BATCH), so a
    serving loop compiles at most two variants; the token count itself is a runtime argument.
    ``programs_per_sm`` sets how finely large batches are split into token chunks (each chunk
    re-reads its weight slice once). The CUDA values are the best of a sweep on an H200
    (benchmarks/results/, ``--sweep``); ROCm uses them until measured there.
    """
    common = dict(BLOCK_P=triton.next_power_of_2(P), BLOCK_R=triton.next_power_of_2(R),
                  BLOCK_LC=min(512, triton.next_power_of_2(L)), ROPE_ROWS=64, BLOCK_T=16)
    lmax = triton.next_power_of_2(L)
    if backend == "interpreter":
        # few, fat programs: the interpreter's cost is per program and per op
        return dict(common, BLOCK_L=lmax, BLOCK_LC=lmax, num_warps=1, num_stages=1,
                    programs_per_sm=0.0)
    if small:
        return dict(common, BLOCK_L=min(128 if H <= 32 else 256, lmax), num_warps=8,
                    num_stages=2, programs_per_sm=1.0)
    if H <= 32:
        return dict(common, BLOCK_L=min(128, lmax), BLOCK_T=64, num_warps=8, num_stages=3,
                    programs_per_sm=1.0)
    return dict(common, BLOCK_L=min(256, lmax), BLOCK_T=64, num_warps=8, num_stages=2,
                programs_per_sm=1.0)


def _split_tokens(B: int, n_hl: int, cfg: dict, num_sms: int) -> tuple[int, int]:
    """(tokens_per_chunk, n_chunks): one chunk unless the (head, L-tile) grid underfills the GPU."""
    block_t = cfg["BLOCK_T"]
    n_tiles = triton.cdiv(max(B, 1), block_t)
    want = int(cfg["programs_per_sm"] * num_sms) // max(n_hl, 1)
    n_chunks = max(1, min(n_tiles, want))
    tiles_per_chunk = triton.cdiv(n_tiles, n_chunks)
    tokens_per_chunk = tiles_per_chunk * block_t
    return tokens_per_chunk, triton.cdiv(max(B, 1), tokens_per_chunk)


def _backend(device: torch.device) -> str:
    if config.interpreting():
        return "interpreter"
    return "hip" if torch.version.hip is not None else "cuda"


def _scale_args(scale, fallback: torch.Tensor) -> tuple[torch.Tensor, float, bool]:
    """(pointer argument, value argument, read-from-pointer) for a float/tensor/None scale."""
    if isinstance(scale, torch.Tensor):
        return scale, 1.0, True
    return fallback, 1.0 if scale is None else float(scale), False


def weight_path(args: checks.PrologueArgs) -> tuple[int, bool, bool]:
    """(W_FMT, ACT_FP8, MX_NATIVE) for these arguments on their device's platform."""
    w = args.w_uk_t
    if isinstance(w, torch.Tensor):
        return 0, False, False
    if w.format == "fp8":
        return 1, checks.resolve_fp8_activations(args), False
    from fusemla import platform

    info = platform.detect(args.q_nope.device)
    return 2, False, platform.choose_mxfp4_path(info) == "dot_scaled"


def launch(args: checks.PrologueArgs, q: torch.Tensor, cfg: Optional[dict] = None) -> None:
    """Launch the kernel on validated arguments, writing ``q`` and ``args.kv_cache``."""
    B, H, P, R, L = args.B, args.H, args.P, args.R, args.L
    if B == 0:
        return
    backend = _backend(q.device)
    if cfg is None:
        cfg = launch_config(H, P, R, L, backend, B <= SMALL_BATCH)
    n_hl = H * triton.cdiv(L, cfg["BLOCK_L"])
    num_sms = 1 if backend == "interpreter" else _num_sms(q.device.index or 0)
    tokens_per_chunk, n_chunks = _split_tokens(B, n_hl, cfg, num_sms)
    n_bmm = n_hl * n_chunks
    n_rope = triton.cdiv(B * H, cfg["ROPE_ROWS"])

    kv_cache = args.kv_cache
    kv_fp8, fp8_max, fp8_min_exp = _FP8_FORMATS.get(kv_cache.dtype, (0, 0.0, 0))
    p_scale, scale_value, scale_from_ptr = _scale_args(args.kv_scale, args.slot_mapping)
    q_fp8, q_fp8_max, q_fp8_min_exp = _FP8_FORMATS.get(q.dtype, (0, 0.0, 0))
    p_qs, q_scale_value, q_scale_from_ptr = _scale_args(args.q_scale, args.slot_mapping)
    interp = backend == "interpreter"  # work around the interpreter's bf16 dot and cast

    w_fmt, act_fp8, mx_native = weight_path(args)
    w = args.w_uk_t
    if w_fmt == 0:
        w_data, p_ws, s_ws_h, s_ws_p = w, args.slot_mapping, 0, 0
        w_code, w_max, w_min_exp = 0, 0.0, 0
    else:
        w_data, p_ws = w.data, w.scale
        s_ws_h = w.scale.stride(0) if w.scale.numel() > 1 else 0
        s_ws_p = w.scale.stride(1) if w.scale.dim() > 1 else 0
        w_code, w_max, w_min_exp = _FP8_FORMATS.get(w_data.dtype, (0, 0.0, 0))
        if mx_native and (cfg["BLOCK_P"] != P or L % cfg["BLOCK_L"] != 0):
            mx_native = False  # tl.dot_scaled takes whole, unmasked tiles

    qn, qp, kvc, kpe = args.q_nope, args.q_pe, args.kv_c, args.k_pe
    grid = (n_bmm + n_rope + B,)
    mla_decode_prologue_kernel[grid](
        qn, qn.stride(0), qn.stride(1),
        qp, qp.stride(0), qp.stride(1),
        kvc, kvc.stride(0),
        kpe, kpe.stride(0),
        w_data, w_data.stride(0), w_data.stride(1), p_ws, s_ws_h, s_ws_p,
        args.positions, args.positions.stride(0),
        args.cos_cache, args.cos_cache.stride(0), args.sin_cache, args.sin_cache.stride(0),
        args.slot_mapping, args.slot_mapping.stride(0),
        p_scale, scale_value,
        q, q.stride(0), q.stride(1), p_qs, q_scale_value,
        kv_cache, kv_cache.stride(0), kv_cache.stride(1),
        B, n_bmm, n_rope, tokens_per_chunk, n_chunks, args.cos_cache.shape[0],
        kv_cache.shape[0] * kv_cache.shape[1], kv_cache.shape[1],
        H=H, P=P, R=R, L=L,
        BLOCK_P=cfg["BLOCK_P"], BLOCK_L=cfg["BLOCK_L"], BLOCK_T=cfg["BLOCK_T"],
        BLOCK_R=cfg["BLOCK_R"], BLOCK_LC=cfg["BLOCK_LC"], ROPE_ROWS=cfg["ROPE_ROWS"],
        IS_NEOX=args.is_neox, KV_FP8=kv_fp8, FP8_MAX=fp8_max, FP8_MIN_EXP=fp8_min_exp,
        SCALE_FROM_PTR=scale_from_ptr,
        W_FMT=w_fmt, MX_NATIVE=mx_native, ACT_FP8=act_fp8,
        W_FP8_MAX=w_max, W_FP8_MIN_EXP=w_min_exp, W_FP8_CODE=w_code,
        Q_FP8=q_fp8, Q_FP8_MAX=q_fp8_max, Q_FP8_MIN_EXP=q_fp8_min_exp,
        Q_SCALE_FROM_PTR=q_scale_from_ptr,
        A_FMT="bf16" if qn.dtype == torch.bfloat16 else "fp16",
        DOT_FP32=interp, FIX_BF16=interp,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


# --------------------------------------------------------------------------------------------
# torch.library registration (torch.compile / CUDA graphs see one opaque, mutating op)
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("fusemla::mla_decode_prologue", mutates_args=("q_out", "kv_cache"))
def _prologue_op(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
    w_data: torch.Tensor, w_scale: Optional[torch.Tensor], w_format: str,
    positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, is_neox: bool,
    kv_scale_tensor: Optional[torch.Tensor], kv_scale_value: float,
    q_scale_tensor: Optional[torch.Tensor], q_scale_value: float,
    fp8_activations: int, q_out: torch.Tensor,
) -> None:
    if w_format:
        from fusemla.quant import QuantizedWeight

        w = QuantizedWeight(w_data, w_scale, w_format)
    else:
        w = w_data
    kv_scale = kv_scale_tensor if kv_scale_tensor is not None else kv_scale_value
    q_scale = q_scale_tensor if q_scale_tensor is not None else q_scale_value
    args = checks.validate(q_nope, q_pe, kv_c, k_pe, w, positions, cos_cache, sin_cache,
                           kv_cache, slot_mapping, is_neox, kv_scale, q_out, q_out.dtype,
                           q_scale, None if fp8_activations < 0 else bool(fp8_activations))
    _run(args, q_out)


@_prologue_op.register_fake
def _(q_nope, q_pe, kv_c, k_pe, w_data, w_scale, w_format, positions, cos_cache, sin_cache,
      kv_cache, slot_mapping, is_neox, kv_scale_tensor, kv_scale_value, q_scale_tensor,
      q_scale_value, fp8_activations, q_out) -> None:
    return None


def _call_op(args: checks.PrologueArgs, q: torch.Tensor) -> None:
    """The same launch through the registered op (what torch.compile traces)."""
    w = args.w_uk_t
    w_data, w_scale, w_format = (w, None, "") if isinstance(w, torch.Tensor) else (
        w.data, w.scale, w.format)

    def split(scale):
        if isinstance(scale, torch.Tensor):
            return scale, 1.0
        return None, 1.0 if scale is None else float(scale)

    kv_t, kv_v = split(args.kv_scale)
    q_t, q_v = split(args.q_scale)
    act = -1 if args.fp8_activations is None else int(args.fp8_activations)
    _prologue_op(args.q_nope, args.q_pe, args.kv_c, args.k_pe, w_data, w_scale, w_format,
                 args.positions, args.cos_cache, args.sin_cache, args.kv_cache,
                 args.slot_mapping, args.is_neox, kv_t, kv_v, q_t, q_v, act, q)


def _run(args: checks.PrologueArgs, q: torch.Tensor) -> None:
    if config.debug_checks():
        checks.check_device_values(args)
    if q.device.type == "cpu" and not config.interpreting():
        # No Triton backend for CPU tensors: run the unfused path (same semantics).
        from fusemla.reference import prologue_into

        prologue_into(args, q)
        return
    launch(args, q)


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------


def mla_decode_prologue(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk_t: Union[torch.Tensor, "QuantizedWeight"],
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    is_neox: bool = False,
    kv_scale: Union[float, torch.Tensor, None] = None,
    out: Optional[torch.Tensor] = None,
    q_out_dtype: Optional[torch.dtype] = None,
    q_scale: Union[float, torch.Tensor, None] = None,
    fp8_activations: Optional[bool] = None,
) -> torch.Tensor:
    """Fused MLA decode prologue: ``q = [q_nope @ W_UK_T[h], rope(q_pe)]`` and the cache write.

    Shapes (B tokens, H heads, P = qk_nope_head_dim, R = qk_rope_head_dim, L = kv_lora_rank):

    - ``q_nope [B, H, P]``, ``q_pe [B, H, R]``: bf16 or fp16; any strides, last dim contiguous
      (slices of the q_b_proj output ``[B, H, P + R]`` work as they are).
    - ``kv_c [B, L]``: the normalized latent; ``k_pe [B, R]`` or ``[B, 1, R]``, not yet rotated.
    - ``w_uk_t [H, P, L]``: the absorbed key up-projection, in the activations' dtype, or a
      :class:`fusemla.quant.QuantizedWeight` (FP8 with a per-tensor/per-head scale, or MXFP4).
      FP8 weights run with bf16/fp16 activations (upcast in registers) or, when
      ``fp8_activations`` is True (None: :func:`fusemla.platform.choose_fp8_activations`),
      with activations quantized to FP8 per (token, head) in the kernel.
    - ``positions [B]`` (int32/int64); ``cos_cache``, ``sin_cache [max_position, R/2]``
      (fp32/bf16/fp16; :func:`fusemla.rope.split_cos_sin_cache` splits an engine's cache).
    - ``kv_cache [num_blocks, block_size, L + R]``: bf16/fp16, or float8_e4m3fn/float8_e4m3fnuz
      with ``kv_scale`` (a positive float, rounded to fp32, or a 1-element fp32 tensor read on
      the device, so a CUDA graph replays with its current value).
      Row ``slot`` is ``kv_cache[slot // block_size, slot % block_size]``; it receives
      ``[kv_c, rope(k_pe)]``, for FP8 as ``saturate(x / kv_scale)`` rounded to nearest even.
      ``kv_scale`` is ignored for a bf16/fp16 cache.
    - ``slot_mapping [B]`` (int32/int64): a negative slot (or one past the cache) writes nothing.
    - ``is_neox``: False = interleaved pairs (2i, 2i+1), DeepSeek's; True = pairs (i, i + R/2).
    - ``q_out_dtype``: None (the activations' dtype) or an FP8 dtype, with ``q_scale``: both
      halves of q are stored as ``saturate(q / q_scale)``.

    Returns ``q [B, H, L + R]`` (``out`` if given): ``q[..., :L] = q_nope @ w_uk_t[h]`` (fp32
    accumulation, one rounding) and ``q[..., L:] = rope(q_pe)``. Positions outside the RoPE
    cache are clamped to its ends.

    Raises :class:`~fusemla.errors.FuseMLAValueError` / :class:`~fusemla.errors.FuseMLATypeError`
    on bad input, before anything is launched or written. No device sync unless
    ``FUSEMLA_DEBUG_CHECKS=1``.
    """
    args = checks.validate(q_nope, q_pe, kv_c, k_pe, w_uk_t, positions, cos_cache, sin_cache,
                           kv_cache, slot_mapping, is_neox, kv_scale, out, q_out_dtype,
                           q_scale, fp8_activations)
    q = out if out is not None else q_nope.new_empty((args.B, args.H, args.L + args.R),
                                                     dtype=args.q_dtype)
    if torch.compiler.is_compiling():
        _call_op(args, q)
    else:
        _run(args, q)
    return q
