"""The fused MLA decode epilogue kernel: the W_UV up-projection of the latent attention output,
written straight into o_proj's input ``[N, H*V]``, in the activations' dtype or as FP8 codes with
one fp32 scale per token and group of ``GROUP`` columns, in one launch.

Program ``pid`` of the flat grid owns one (token tile, V tile, head) item, token tile fastest
(neighbouring programs share a weight tile in L2 at large batch):
``acc[BLOCK_T, BLOCK_V] = attn_out[t-tile, h, :] @ W_UV[h, :, v-tile]``, a loop over the latent
in chunks of ``BLOCK_K`` on the tensor cores, fp32 accumulation. FP8 weights are upcast to the
activations' dtype in registers (exact); their scale multiplies the accumulator (per tensor or
head), or each chunk's partial product per column (block scales: a chunk lies inside one block
of ``W_BK`` rows, each column's scale is that of its ``W_BN``-wide block; with ``GEMV`` the
scales apply before the products instead, so a chunk may span blocks: to the activations per
latent row where the V tile lies inside one column block, else to each weight element).

``OUT_FP8`` (an FP8 format code of :data:`fusemla.dtypes.FP8_FORMATS`, 0: not FP8): a V tile
holds whole groups, so each program quantizes its own: per row and group, ``absmax =
max(max |acc|, EPS)``, ``s = absmax * (1 / FMAX)``, rounded up to a power of two with
``UE8M0``, codes ``clamp(acc / s, +-FMAX)`` (the IEEE quotient, from one reciprocal per row and
group) on the e4m3 grid, ties to even;
:mod:`fusemla.reference.epilogue` states the same rule in PyTorch.

``SPLIT`` > 1: each item's latent is cut among SPLIT programs. ``VSUB`` > 1 (an FP8 output
whose group is wider than the V tile): a group's VSUB V tiles are computed by VSUB programs.
Either way the programs of one finishing tile (a token tile x ``BLOCK_V * VSUB`` columns of one
head) each write their fp32 partial product to a workspace ``[SPLIT, N, H*V]``, then bump the
tile's arrival counter (acquire / release); the last of the SPLIT x VSUB to arrive adds each
column's SPLIT partials in split order (so the sum does not depend on which program is last),
sets the counter back to 0 and finishes the whole tile. The counters are a buffer the launcher
keeps per device and stream, zero between launches: no memset per launch.

``GEMV``: each chunk's product on the CUDA cores instead of the tensor cores (fp32 products
summed over the chunk), for a few tokens, where the MMA pads a token tile to 16 rows and
stages its operands in its own layout: tiles of any power-of-two BLOCK_T, a chunk as long as
the latent (read whole before ``gdc_wait``). A tile of several tokens takes one 3-D product
and reduction, or with ``GEMV_ROWS`` its tokens take turns (:func:`gemv_product`): each row's
product 2-D, in the layout the weight chunk was loaded in.

``USE_PDL`` (sm_90+): the first weight chunk is loaded before ``gdc_wait`` (weights are never
written by the kernel before, so they overlap it); the activations only after it.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fusemla.ops.triton_helpers import cast_rne, divide_exact, inverse, round_to_fp8_grid


@triton.jit
def w_chunk(p_w, s_w_k, s_w_v, o_k, m_k, o_v, m_v, DOT_TY: tl.constexpr):
    """The [BLOCK_K, BLOCK_V] weight chunk of one head, in the dot's operand type."""
    b_w = tl.load(
        p_w + o_k[:, None] * s_w_k + o_v[None, :] * s_w_v,
        mask=m_k[:, None] & m_v[None, :],
        other=0.0,
    )
    return b_w.to(DOT_TY)


@triton.jit
def x_chunk(p_x, o_t64, m_t, s_x_t, o_k, m_k, DOT_TY: tl.constexpr):
    """The [BLOCK_T, BLOCK_K] activation chunk of one head."""
    b_x = tl.load(
        p_x + o_t64[:, None] * s_x_t + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0
    )
    return b_x.to(DOT_TY)


@triton.jit
def gemv_product(
    p_xh,
    s_x_t,
    t0,
    N,
    o_k,
    m_k,
    b_w,
    b_sk,
    ROW_SCALES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """GEMV's product of one chunk for the token tile's rows ``t0 .. t0 + BLOCK_T`` (those at
    or beyond ``N`` read zeros): ``x[rows, chunk] @ b_w`` [BLOCK_T, BLOCK_V] in fp32 on the CUDA
    cores, the activations times each latent row's block scale ``b_sk`` with ``ROW_SCALES``.
    One token, or ``ROWS``: a row at a time, each a 2-D product reduced over the chunk with the
    weight in the layout it was loaded in (the row read from memory); else the tile's 3-D
    product ``[BLOCK_T, BLOCK_K, BLOCK_V]`` reduced over the chunk."""
    if BLOCK_T == 1 or ROWS:
        acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
        for j in tl.static_range(BLOCK_T):
            row = (t0 + j).to(tl.int64)
            m_x = m_k & (tl.full((1,), 0, tl.int64) + row < N)  # [BLOCK_K] (the row broadcast)
            b_x = tl.load(p_xh + row * s_x_t + o_k, mask=m_x, other=0.0).to(tl.float32)
            if ROW_SCALES:
                b_x = b_x * b_sk
            r = tl.sum(b_w * b_x[:, None], axis=0)
            if BLOCK_T == 1:
                acc = r[None, :]
            else:
                acc = tl.where((tl.arange(0, BLOCK_T) == j)[:, None], r[None, :], acc)
    else:
        o_t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        b_x = x_chunk(p_xh, o_t, o_t < N, s_x_t, o_k, m_k, tl.float32)
        if ROW_SCALES:
            b_x = b_x * b_sk[None, :]
        acc = tl.sum(b_x[:, :, None] * b_w[None, :, :], axis=1)
    return acc


@triton.jit
def block_scales(p_ws, s_ws_k, s_ws_v, k0, o_v, m_v, W_BK: tl.constexpr, W_BN: tl.constexpr):
    """Each column's block scale for the chunk starting at latent row ``k0``: [BLOCK_V] fp32."""
    return tl.load(p_ws + (k0 // W_BK) * s_ws_k + (o_v // W_BN) * s_ws_v, mask=m_v, other=0.0)


@triton.jit
def row_scales(p_ws, s_ws_k, s_ws_v, o_k, m_k, i_bn, W_BK: tl.constexpr):
    """The block scale of each latent row ``o_k`` [BLOCK_K] in column block ``i_bn``: GEMV's
    block-FP8 scales when the V tile lies inside one column block, applied to the activations'
    chunk (a few values per head, read from cache)."""
    return tl.load(p_ws + (o_k // W_BK) * s_ws_k + i_bn * s_ws_v, mask=m_k, other=0.0)


@triton.jit
def dequantized(
    b_w, p_ws, s_ws_k, s_ws_v, o_k, m_k, o_v, m_v, W_BK: tl.constexpr, W_BN: tl.constexpr
):
    """A block-FP8 weight chunk [BLOCK_K, BLOCK_V] (fp32) times each element's block scale:
    GEMV's block scales when the V tile spans column blocks (a chunk may span blocks of rows:
    the whole latent)."""
    b_s = tl.load(
        p_ws + (o_k // W_BK)[:, None] * s_ws_k + (o_v // W_BN)[None, :] * s_ws_v,
        mask=m_k[:, None] & m_v[None, :],
        other=0.0,
    )
    return b_w * b_s


@triton.jit
def program_item(
    pid, N, V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, SPLIT: tl.constexpr
):
    """Program ``pid``'s (token tile, V tile, head) item, token tile fastest, and its share
    ``i_s`` of the latent: ``(i_s, i_t, i_v, i_h, n_t, o_t, m_t, o_t64, o_v, m_v)``, the
    tiles' token rows and V columns with their masks (rows also as int64)."""
    NV: tl.constexpr = (V + BLOCK_V - 1) // BLOCK_V
    i_s = pid % SPLIT
    item = pid // SPLIT
    n_t = tl.cdiv(N, BLOCK_T)
    i_t = item % n_t
    i_v = item // n_t % NV
    i_h = (item // n_t // NV).to(tl.int64)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    return i_s, i_t, i_v, i_h, n_t, o_t, o_t < N, o_t.to(tl.int64), o_v, o_v < V


@triton.jit
def _pow2_ceil(s):
    """``2**ceil(log2 s)`` for positive normal fp32 ``s``, exactly (from the bits)."""
    bits = s.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exp << 23).to(tl.float32, bitcast=True)


@triton.jit
def _finish(
    acc,
    i_h,
    i_v,
    o_t64,
    m_t,
    o_c,
    m_o,
    p_wsh,
    p_o,
    s_o_t,
    p_os,
    s_os_t,
    s_os_g,
    V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    W_FMT: tl.constexpr,
    OUT_FP8: tl.constexpr,
    FMAX: tl.constexpr,
    GROUP: tl.constexpr,
    UE8M0: tl.constexpr,
    EPS: tl.constexpr,
    FIX_BF16: tl.constexpr,
):
    """The item's whole fp32 product ``acc`` [BLOCK_T, BLOCK_V] -> o_proj's input: the
    per-tensor / per-head weight scale, then the activations' dtype, or FP8 codes and one
    scale per row and group."""
    if W_FMT == 1:
        acc = acc * tl.load(p_wsh).to(tl.float32)
    p_out = p_o + o_t64[:, None] * s_o_t + o_c[None, :]
    if OUT_FP8 != 0:
        NG: tl.constexpr = BLOCK_V // GROUP
        g = tl.reshape(acc, (BLOCK_T, NG, GROUP))
        absmax = tl.maximum(tl.max(tl.abs(g), axis=2), EPS)
        s = absmax * (1.0 / FMAX)
        if UE8M0:
            s = _pow2_ceil(s)
        # the IEEE quotient g / s: one division per (row, group), two fma per element
        inv = inverse(s, OUT_FP8)
        y = divide_exact(
            g,
            tl.broadcast_to(s[:, :, None], (BLOCK_T, NG, GROUP)),
            tl.broadcast_to(inv[:, :, None], (BLOCK_T, NG, GROUP)),
        )
        y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
        y = tl.reshape(round_to_fp8_grid(y, OUT_FP8), (BLOCK_T, BLOCK_V))
        tl.store(p_out, y.to(p_o.dtype.element_ty), mask=m_o)
        o_g = (i_h * V + i_v * BLOCK_V) // GROUP + tl.arange(0, NG)
        m_g = (i_v * BLOCK_V + tl.arange(0, NG) * GROUP) < V
        tl.store(
            p_os + o_t64[:, None] * s_os_t + o_g[None, :] * s_os_g,
            s,
            mask=m_t[:, None] & m_g[None, :],
        )
    else:
        tl.store(p_out, cast_rne(acc, p_o.dtype.element_ty, FIX_BF16), mask=m_o)


@triton.jit(do_not_specialize=["N"])  # one binary per tile bucket, whatever the token count
def mla_epilogue_kernel(
    p_x,
    s_x_t,
    s_x_h,
    p_w,
    s_w_h,
    s_w_k,
    s_w_v,
    p_ws,
    s_ws_h,
    s_ws_k,
    s_ws_v,
    p_o,
    s_o_t,
    p_os,
    s_os_t,
    s_os_g,
    p_wk,
    s_wk_s,
    s_wk_t,
    p_cnt,
    N,
    L: tl.constexpr,
    V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_FMT: tl.constexpr,
    W_BK: tl.constexpr,
    W_BN: tl.constexpr,
    OUT_FP8: tl.constexpr,
    FMAX: tl.constexpr,
    GROUP: tl.constexpr,
    UE8M0: tl.constexpr,
    EPS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FIX_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
    SPLIT: tl.constexpr,
    VSUB: tl.constexpr,
    GEMV: tl.constexpr,
    GEMV_ROWS: tl.constexpr,
):
    """``W_FMT``: 0 plain weights (the activations' dtype), 1 FP8 with a per-tensor / per-head
    scale (``s_ws_h`` 0 for per tensor), 2 FP8 with ``[H, cdiv(L, W_BK), cdiv(V, W_BN)]`` block
    scales. ``GEMV``: the chunks' products on the CUDA cores (:func:`gemv_product`; a row at a
    time with ``GEMV_ROWS``)."""
    if USE_PDL and PDL_TRIGGER:  # FUSEMLA_PDL_TRIGGER: the next kernel may launch now
        gdc_launch_dependents()
    if DOT_FP32 or GEMV:  # the interpreter's dot, or the CUDA cores' products, in fp32
        DOT_TY: tl.constexpr = tl.float32
    else:
        DOT_TY: tl.constexpr = p_x.dtype.element_ty
    NV: tl.constexpr = (V + BLOCK_V - 1) // BLOCK_V
    NK: tl.constexpr = (L + BLOCK_K - 1) // BLOCK_K
    NKS: tl.constexpr = NK // SPLIT  # latent chunks per split (the plan makes SPLIT divide NK)
    pid = tl.program_id(0)
    i_s, i_t, i_v, i_h, n_t, o_t, m_t, o_t64, o_v, m_v = program_item(
        pid, N, V, BLOCK_T, BLOCK_V, SPLIT
    )
    o_k = tl.arange(0, BLOCK_K)
    p_wh = p_w + i_h * s_w_h
    p_xh = p_x + i_h * s_x_h
    p_wsh = p_ws + i_h * s_ws_h

    # the first chunk peeled: its weights are read before waiting on the kernel before (PDL)
    k0 = i_s * NKS * BLOCK_K
    o_k0 = k0 + o_k
    # GEMV's block scales: per latent row on the activations when the V tile lies inside one
    # column block, else per element on the weights
    ROW_SCALES: tl.constexpr = GEMV and W_FMT == 2 and W_BN % BLOCK_V == 0
    i_bn = (i_v * BLOCK_V) // W_BN if W_FMT == 2 else 0  # the V tile's column block
    b_w = w_chunk(p_wh, s_w_k, s_w_v, o_k0, o_k0 < L, o_v, m_v, DOT_TY)
    b_sk = 1.0  # GEMV's per-row block scales (ROW_SCALES only)
    if ROW_SCALES:  # scales are weights too: read before the wait
        b_sk = row_scales(p_wsh, s_ws_k, s_ws_v, o_k0, o_k0 < L, i_bn, W_BK)
    elif GEMV and W_FMT == 2:
        b_w = dequantized(b_w, p_wsh, s_ws_k, s_ws_v, o_k0, o_k0 < L, o_v, m_v, W_BK, W_BN)
    if USE_PDL:
        gdc_wait()
    t0 = i_t * BLOCK_T
    if GEMV:
        acc = gemv_product(
            p_xh, s_x_t, t0, N, o_k0, o_k0 < L, b_w, b_sk, ROW_SCALES, GEMV_ROWS, BLOCK_T, BLOCK_V
        )
    else:
        acc = tl.dot(x_chunk(p_xh, o_t64, m_t, s_x_t, o_k0, o_k0 < L, DOT_TY), b_w)
        if W_FMT == 2:
            acc = acc * block_scales(p_wsh, s_ws_k, s_ws_v, k0, o_v, m_v, W_BK, W_BN)[None, :]
    for i_k in range(i_s * NKS + 1, (i_s + 1) * NKS):
        o_kk = i_k * BLOCK_K + o_k
        m_k = o_kk < L
        b_w = w_chunk(p_wh, s_w_k, s_w_v, o_kk, m_k, o_v, m_v, DOT_TY)
        if GEMV:
            if ROW_SCALES:
                b_sk = row_scales(p_wsh, s_ws_k, s_ws_v, o_kk, m_k, i_bn, W_BK)
            elif W_FMT == 2:
                b_w = dequantized(b_w, p_wsh, s_ws_k, s_ws_v, o_kk, m_k, o_v, m_v, W_BK, W_BN)
            acc += gemv_product(
                p_xh, s_x_t, t0, N, o_kk, m_k, b_w, b_sk, ROW_SCALES, GEMV_ROWS, BLOCK_T, BLOCK_V
            )
        else:
            b_x = x_chunk(p_xh, o_t64, m_t, s_x_t, o_kk, m_k, DOT_TY)
            if W_FMT == 2:
                b_s = block_scales(p_wsh, s_ws_k, s_ws_v, i_k * BLOCK_K, o_v, m_v, W_BK, W_BN)
                acc += tl.dot(b_x, b_w) * b_s[None, :]
            else:
                acc = tl.dot(b_x, b_w, acc=acc)
    o_c = i_h * V + o_v  # the output's columns (h * V + v)
    m_o = m_t[:, None] & m_v[None, :]
    # the finishing tile: VSUB V tiles of one head (this program's own tile when VSUB is 1)
    BLOCK_F: tl.constexpr = BLOCK_V * VSUB
    i_f = i_v // VSUB
    o_vf = i_f * BLOCK_F + tl.arange(0, BLOCK_F)
    o_cf = i_h * V + o_vf
    m_of = m_t[:, None] & (o_vf < V)[None, :]
    last = True  # this program finishes the tile (the only one, or the last to arrive)
    fin = acc  # the tile's whole fp32 product
    if SPLIT * VSUB > 1:
        # the tile's SPLIT x VSUB partial products meet in the workspace; the last to arrive
        # adds each column's SPLIT parts in split order (the same sum whichever program is
        # last: deterministic) and finishes the whole tile
        tile = i_t + n_t * (i_f + (NV // VSUB) * i_h)  # the tile's arrival counter
        tl.store(p_wk + o_t64[:, None] * s_wk_t + o_c[None, :] + i_s * s_wk_s, acc, mask=m_o)
        tl.debug_barrier()  # every thread's partial is written before the release below
        last = tl.atomic_add(p_cnt + tile, 1, sem="acq_rel") == SPLIT * VSUB - 1
        fin = tl.zeros((BLOCK_T, BLOCK_F), tl.float32)
        if last:
            # no other program touches this counter again in this launch: back to 0 for the
            # next launch that shares the buffer (the launcher zeroes it only when it makes it)
            tl.atomic_xchg(p_cnt + tile, 0, sem="relaxed")
            p_part = p_wk + o_t64[:, None] * s_wk_t + o_cf[None, :]
            for j in tl.static_range(SPLIT):
                fin += tl.load(p_part + j * s_wk_s, mask=m_of, other=0.0, cache_modifier=".cg")
    if last:
        _finish(
            fin,
            i_h,
            i_f,
            o_t64,
            m_t,
            o_cf,
            m_of,
            p_wsh,
            p_o,
            s_o_t,
            p_os,
            s_os_t,
            s_os_g,
            V,
            BLOCK_T,
            BLOCK_F,
            W_FMT,
            OUT_FP8,
            FMAX,
            GROUP,
            UE8M0,
            EPS,
            FIX_BF16,
        )
