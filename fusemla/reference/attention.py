"""Paged latent attention in plain PyTorch: decode (absorbed, over the cache) and prefill
(non-absorbed, per request). What the layer runs after the prologue, and the model the Triton
attention kernels will be tested against. Nothing here imports Triton.

Cache layout (see :mod:`fusemla.ops.prologue`): ``kv_cache [num_blocks, block_size, L + R]``,
row ``[kv_c (L), rope(k_pe) (R)]``; an FP8 cache holds ``saturate(x / kv_scale)`` and is read
back as ``code * kv_scale`` (in fp32). ``block_table[r, j]`` is the block holding request ``r``'s
positions ``[j * block_size, (j + 1) * block_size)``.

Decode (:func:`paged_decode_attention`) is static-shaped: it gathers every block of the table
and masks by ``seq_lens`` with ``torch.where`` (never a multiply, so NaN poison or another
request's data in an unused or partly filled block cannot leak in), so a decode step can be
captured in a CUDA graph and compiled with ``torch.compile(fullgraph=True)``. It costs
``D * max_blocks * block_size * (L + R)`` fp32 of gathered rows: a reference, not a kernel.
"""

from __future__ import annotations

import torch

from fusemla.dtypes import FP8_DTYPES
from fusemla.errors import FuseMLATypeError, FuseMLAValueError, describe

Scale = float | torch.Tensor | None

__all__ = ["gather_latents", "paged_decode_attention", "prefill_attention"]

_Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: qk_rope_head_dim of every DeepSeek-V2/V3 model: paged_decode_attention's default R
DEEPSEEK_ROPE_DIM = 64


def _tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise FuseMLATypeError(f"{name}: expected a torch.Tensor, got {describe(x)}")
    return x


def _check_cache(kv_cache: object, kv_scale: Scale) -> torch.Tensor:
    kv_cache = _tensor("kv_cache", kv_cache)
    if kv_cache.dim() != 3:
        raise FuseMLAValueError(
            f"kv_cache: expected shape [num_blocks, block_size, L+R], got {describe(kv_cache)}"
        )
    if kv_cache.dtype == torch.uint8:
        raise FuseMLATypeError(
            f"kv_cache: view a uint8 cache as its FP8 type first, got {describe(kv_cache)}"
        )
    if kv_cache.dtype in FP8_DTYPES and kv_scale is None:
        raise FuseMLAValueError(
            f"kv_scale: an FP8 kv_cache ({kv_cache.dtype}) needs kv_scale "
            "(a positive float or a 1-element fp32 tensor), got None"
        )
    if isinstance(kv_scale, torch.Tensor) and kv_scale.numel() != 1:
        raise FuseMLAValueError(f"kv_scale: expected a 1-element tensor, got {describe(kv_scale)}")
    return kv_cache


def gather_latents(
    kv_cache: torch.Tensor, block_table: torch.Tensor, kv_scale: Scale, L: int
) -> torch.Tensor:
    """Every cache row of the blocks in ``block_table``, dequantized to fp32.

    ``kv_cache [num_blocks, block_size, L + R]`` (bf16/fp16/fp32, or FP8 with ``kv_scale``);
    ``block_table [Q, max_blocks]`` int32/int64. Returns ``rows [Q, max_blocks * block_size,
    L + R]`` fp32 where ``rows[q, i] = kv_cache[block_table[q, i // bs], i % bs]`` (FP8: times
    ``kv_scale``). Row ``i`` of request ``q`` is its position ``i``; rows past its ``seq_len``
    hold whatever the table's blocks hold (mask them). Static shapes, no sync.
    """
    kv_cache = _check_cache(kv_cache, kv_scale)
    block_table = _tensor("block_table", block_table)
    if block_table.dim() != 2:
        raise FuseMLAValueError(
            f"block_table: expected shape [num_reqs, max_blocks], got {describe(block_table)}"
        )
    if block_table.dtype not in (torch.int32, torch.int64):
        raise FuseMLATypeError(
            f"block_table: expected dtype int32 or int64, got {describe(block_table)}"
        )
    width = kv_cache.shape[-1]
    if not 0 < L < width:
        raise FuseMLAValueError(f"L: expected 0 < L < kv_cache.shape[-1] = {width}, got {L}")
    Q, max_blocks = block_table.shape
    bs = kv_cache.shape[1]
    fp8 = kv_cache.dtype in FP8_DTYPES
    src = kv_cache.view(torch.uint8) if fp8 else kv_cache  # few ops take float8 dtypes
    rows = src.index_select(0, block_table.reshape(-1).long())  # [Q * max_blocks, bs, L+R]
    if fp8:
        rows = rows.view(kv_cache.dtype)
    rows = rows.float().reshape(Q, max_blocks * bs, width)
    if fp8:
        rows = rows * kv_scale  # fp32 code * fp32 scale (a float or a [1] tensor)
    return rows


def _masked_softmax_av(
    scores: torch.Tensor, mask: torch.Tensor, values: torch.Tensor, eq: str
) -> torch.Tensor:
    """``softmax(scores)`` over the keys where ``mask`` holds, then the weighted sum of
    ``values`` (``eq`` the einsum of weights and values). A query without any key gets zeros.

    Masked scores become -inf through ``torch.where`` (a NaN there stays out); the max of an
    all-masked row is replaced by 0 so ``exp`` gives 0, not NaN.
    """
    scores = torch.where(mask, scores, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(m == float("-inf"), 0.0, m)
    p = torch.exp(scores - m)  # exactly 0 where masked
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.einsum(eq, p, values)
    return out / torch.where(denom > 0, denom, 1.0)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_scale: Scale = None,
    *,
    kv_lora_rank: int | None = None,
) -> torch.Tensor:
    """Latent (absorbed, MQA-style) decode attention over a paged cache, in fp32.

    ``q [D, H, L + R]`` (bf16/fp16/fp32: the prologue's decode query ``[q_nope @ W_UK_T,
    rope(q_pe)]``), ``kv_cache [num_blocks, block_size, L + R]``, ``block_table [D, max_blocks]``,
    ``seq_lens [D]`` (int32/int64; 0 = padding request), ``softmax_scale`` (a float),
    ``kv_scale`` (FP8 cache), ``kv_lora_rank`` (L; None: ``L + R - 64``, DeepSeek's rope width
    R = 64 — pass it for other dims). For request ``d`` the keys are its cache rows at positions
    ``0 .. seq_lens[d] - 1`` (all ``L + R`` dims), the values their first ``L`` dims::

        out[d, h] = softmax_j(scale * q[d, h] . row[d, j]) @ row[d, j, :L],  j < seq_lens[d]

    Returns ``[D, H, L]`` fp32; a request with ``seq_len`` 0 gets zeros. Static shapes, no
    host reads of device values, no data-dependent control flow: capturable in a CUDA graph.
    """
    q = _tensor("q", q)
    if q.dim() != 3:
        raise FuseMLAValueError(f"q: expected shape [D, H, L+R], got {describe(q)}")
    if q.dtype not in _Q_DTYPES:
        raise FuseMLATypeError(
            f"q: expected dtype bfloat16, float16 or float32 (dequantize an "
            f"FP8 query first), got {describe(q)}"
        )
    kv_cache = _check_cache(kv_cache, kv_scale)
    D, _H, width = q.shape
    if kv_cache.shape[-1] != width:
        raise FuseMLAValueError(
            f"kv_cache: expected last dim L+R = {width} (that of q), got {describe(kv_cache)}"
        )
    block_table = _tensor("block_table", block_table)
    if block_table.dim() != 2 or block_table.shape[0] != D:
        raise FuseMLAValueError(
            f"block_table: expected shape [D={D}, max_blocks], got {describe(block_table)}"
        )
    seq_lens = _tensor("seq_lens", seq_lens)
    if tuple(seq_lens.shape) != (D,):
        raise FuseMLAValueError(f"seq_lens: expected shape [D={D}], got {describe(seq_lens)}")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise FuseMLATypeError(f"seq_lens: expected dtype int32 or int64, got {describe(seq_lens)}")
    L = width - DEEPSEEK_ROPE_DIM if kv_lora_rank is None else kv_lora_rank
    if isinstance(L, bool) or not isinstance(L, int) or not 0 < L < width:
        raise FuseMLAValueError(
            f"kv_lora_rank: expected an int in (0, L+R = {width}), got "
            f"{kv_lora_rank!r}" + (" (the default assumes R = 64)" if kv_lora_rank is None else "")
        )
    rows = gather_latents(kv_cache, block_table, kv_scale, L)  # [D, S, L+R]
    S = rows.shape[1]
    key_idx = torch.arange(S, device=q.device)
    valid = key_idx[None, :] < seq_lens.long()[:, None]  # [D, S]
    rows = torch.where(valid[:, :, None], rows, 0.0)  # NaN poison / stale rows stay out
    scores = torch.einsum("dhc,dsc->dhs", q.float(), rows) * softmax_scale
    return _masked_softmax_av(scores, valid[:, None, :], rows[..., :L], "dhs,dsl->dhl")


def prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_rows: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    context_len: int,
    softmax_scale: float,
) -> torch.Tensor:
    """Causal, non-absorbed MLA attention of one request's new tokens, in fp32.

    ``q_nope [T, H, P]``, ``q_pe [T, H, R]`` (already rotated), ``kv_rows [S, L + R]`` (the
    request's whole sequence, positions ``0 .. S - 1``, dequantized: e.g. from
    :func:`gather_latents`), ``w_uk [H, P, L]`` (``W_UK_T``: ``k_nope = latent @ w_uk[h]^T``),
    ``w_uv [H, L, V]`` (``v = latent @ w_uv[h]``), ``context_len`` (tokens before this step;
    query ``j`` sits at position ``context_len + j`` and sees keys ``0 .. context_len + j``),
    ``softmax_scale``. Keys are ``[k_nope[h], rope(k_pe)]`` (k_pe shared by the heads)::

        out[j, h] = softmax_s(scale * (q_nope[j, h] . k_nope[s, h] + q_pe[j, h] . k_pe[s]))
                    @ v[s, h],   s <= context_len + j

    Returns ``[T, H, V]`` fp32. Needs ``context_len + T <= S``. A query that attends to a
    non-finite key or value gets NaN; the other queries are unaffected.
    """
    for name, x, rank in (
        ("q_nope", q_nope, 3),
        ("q_pe", q_pe, 3),
        ("kv_rows", kv_rows, 2),
        ("w_uk", w_uk, 3),
        ("w_uv", w_uv, 3),
    ):
        _tensor(name, x)
        if x.dim() != rank:
            raise FuseMLAValueError(f"{name}: expected a {rank}-D tensor, got {describe(x)}")
    T, H, P = q_nope.shape
    R = q_pe.shape[2]
    if tuple(q_pe.shape[:2]) != (T, H):
        raise FuseMLAValueError(f"q_pe: expected shape [T={T}, H={H}, R], got {describe(q_pe)}")
    S, width = kv_rows.shape
    L = width - R
    if tuple(w_uk.shape) != (H, P, L):
        raise FuseMLAValueError(f"w_uk: expected shape [H={H}, P={P}, L={L}], got {describe(w_uk)}")
    if w_uv.shape[:2] != (H, L):
        raise FuseMLAValueError(f"w_uv: expected shape [H={H}, L={L}, V], got {describe(w_uv)}")
    if isinstance(context_len, bool) or not isinstance(context_len, int) or context_len < 0:
        raise FuseMLAValueError(f"context_len: expected an int >= 0, got {context_len!r}")
    if context_len + T > S:
        raise FuseMLAValueError(
            f"kv_rows: expected at least context_len + T = "
            f"{context_len + T} rows, got {describe(kv_rows)}"
        )
    rows = kv_rows.float()
    latent, k_pe = rows[:, :L], rows[:, L:]
    k_nope = torch.einsum("sl,hpl->shp", latent, w_uk.float())  # [S, H, P]
    v = torch.einsum("sl,hlv->shv", latent, w_uv.float())  # [S, H, V]
    scores = (
        torch.einsum("thp,shp->ths", q_nope.float(), k_nope)
        + torch.einsum("thr,sr->ths", q_pe.float(), k_pe)
    ) * softmax_scale
    q_pos = context_len + torch.arange(T, device=rows.device)
    causal = (torch.arange(S, device=rows.device)[None, :] <= q_pos[:, None])[:, None, :]
    # A weight of 0 times a non-finite value is NaN: keep such values out of the product and
    # poison exactly the queries that attend to them (a later token's NaN row must not reach
    # the earlier queries of the same request).
    v_ok = torch.isfinite(v).all(dim=-1)  # [S, H]
    v = torch.where(v_ok[..., None], v, 0.0)
    out = _masked_softmax_av(scores, causal, v, "ths,shv->thv")
    sees_bad = (causal & ~v_ok.t()[None]).any(dim=-1)  # [T, H]
    return torch.where(sees_bad[..., None], float("nan"), out)
