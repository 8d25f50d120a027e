"""The plain-PyTorch paged attention (fusemla.reference.attention) vs dense float64 models.

Caches are poisoned (NaN, or a NaN byte for FP8) wherever no request wrote, blocks are handed
out in a shuffled order, and unused block-table entries point at block 0: any read that the
``seq_lens`` mask lets through shows up as NaN or as another request's data.
"""

from __future__ import annotations

import math

import pytest
import torch

from fusemla.errors import FuseMLAError, FuseMLATypeError, FuseMLAValueError
from fusemla.reference.attention import gather_latents, paged_decode_attention, prefill_attention
from fusemla.testing import SMALL_LAYER, poisoned_cache, rope_f64, stable_seed

FP8 = torch.float8_e4m3fn
H, P, R, L, V = (getattr(SMALL_LAYER, k) for k in "HPRLV")
SCALE = (P + R) ** -0.5
# fp32 computation vs float64: a few fp32 roundings per output element
ATOL, RTOL = 2e-5, 2e-5


def _paged(seq_lens, block_size, kv_dtype, gen, *, reserve_block0=True, kv_scale=None):
    """A poisoned cache holding random rows for each request (shuffled blocks), its block table
    (unused entries 0) and each request's rows as float64 (dequantized) for the dense model."""
    max_blocks = max(1, max(math.ceil(s / block_size) for s in seq_lens))
    need = sum(math.ceil(s / block_size) for s in seq_lens)
    num_blocks = need + 3
    cache = poisoned_cache(num_blocks, block_size, L + R, kv_dtype, "cpu")
    free = torch.randperm(num_blocks, generator=gen).tolist()
    if reserve_block0:  # block 0 holds nobody's data: a masked-out read of it is NaN poison
        free.remove(0)
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    dense = []
    for r, s in enumerate(seq_lens):
        rows = torch.randn(s, L + R, generator=gen) * 2
        if kv_dtype == FP8:
            codes = (rows / kv_scale).clamp(-448, 448).to(FP8)
            dense.append(codes.double() * kv_scale)
            stored = codes
        else:
            stored = rows.to(kv_dtype)
            dense.append(stored.double())
        for j in range(math.ceil(s / block_size)):
            b = free.pop()
            table[r, j] = b
            chunk = stored[j * block_size : (j + 1) * block_size]
            cache[b, : chunk.shape[0]] = chunk
    return cache, table, dense


def _decode_f64(q, dense, scale):
    out = torch.zeros(q.shape[0], q.shape[1], L, dtype=torch.float64)
    for d, rows in enumerate(dense):
        if rows.shape[0] == 0:
            continue
        p = torch.softmax(q[d].double() @ rows.T * scale, dim=-1)  # [H, S]
        out[d] = p @ rows[:, :L]
    return out


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("kv", ["bf16", "fp8-float-scale", "fp8-tensor-scale"])
def test_paged_decode_matches_dense_float64(block_size, kv):
    gen = torch.Generator().manual_seed(stable_seed("decode-f64", block_size, kv))
    kv_dtype = torch.bfloat16 if kv == "bf16" else FP8
    scale_value = 0.02
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 0, 3 * block_size + 5, 7]
    cache, table, dense = _paged(seq_lens, block_size, kv_dtype, gen, kv_scale=scale_value)
    kv_scale = (
        None
        if kv == "bf16"
        else (torch.tensor([scale_value]) if kv.endswith("tensor-scale") else scale_value)
    )
    q = torch.randn(len(seq_lens), H, L + R, generator=gen).to(torch.bfloat16)
    before = cache.clone()
    out = paged_decode_attention(
        q, cache, table, torch.tensor(seq_lens, dtype=torch.int32), SCALE, kv_scale, kv_lora_rank=L
    )
    assert out.dtype == torch.float32 and out.shape == (len(seq_lens), H, L)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _decode_f64(q, dense, SCALE), atol=ATOL, rtol=RTOL)
    assert torch.equal(out[4], torch.zeros(H, L))  # the padding request (seq_len 0)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))  # read only


def test_paged_decode_unused_entries_point_at_live_data():
    """Block 0 belongs to a request: the other requests' unused table entries (0) must not
    pull its rows in."""
    gen = torch.Generator().manual_seed(stable_seed("decode-live-block0"))
    seq_lens = [5, 40, 17, 0]
    cache, table, dense = _paged(seq_lens, 16, torch.bfloat16, gen, reserve_block0=False)
    cache[0] = torch.randn(16, L + R, generator=gen).to(torch.bfloat16) * 50  # loud if read
    for r, s in enumerate(seq_lens):  # give block 0 to whoever owns it, keep the model in sync
        for j in range(math.ceil(s / 16)):
            if int(table[r, j]) == 0:
                dense[r][j * 16 : (j + 1) * 16] = cache[0, : min(16, s - j * 16)].double()
    q = torch.randn(len(seq_lens), H, L + R, generator=gen)
    out = paged_decode_attention(q, cache, table, torch.tensor(seq_lens), SCALE, kv_lora_rank=L)
    torch.testing.assert_close(out.double(), _decode_f64(q, dense, SCALE), atol=ATOL, rtol=RTOL)


def test_paged_decode_default_rank_is_deepseek():
    """Without kv_lora_rank the rope width is DeepSeek's 64: L = 512 for 576-wide rows."""
    gen = torch.Generator().manual_seed(stable_seed("decode-default-rank"))
    cache = torch.randn(2, 16, 576, generator=gen).to(torch.bfloat16)
    q = torch.randn(1, 2, 576, generator=gen)
    out = paged_decode_attention(q, cache, torch.tensor([[1]]), torch.tensor([9]), 0.07)
    rows = cache[1, :9].double()
    p = torch.softmax(q[0].double() @ rows.T * 0.07, dim=-1)
    torch.testing.assert_close(out[0].double(), p @ rows[:, :512], atol=ATOL, rtol=RTOL)


def test_paged_decode_compiles_fullgraph():
    """No host reads, no data-dependent shapes: one graph, same numbers as eager."""
    gen = torch.Generator().manual_seed(stable_seed("decode-compile"))
    seq_lens = [3, 0, 20]
    cache, table, _ = _paged(seq_lens, 16, FP8, gen, kv_scale=0.02)
    q = torch.randn(3, H, L + R, generator=gen).to(torch.bfloat16)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    scale = torch.tensor([0.02])
    eager = paged_decode_attention(q, cache, table, sl, SCALE, scale, kv_lora_rank=L)
    fn = torch.compile(paged_decode_attention, fullgraph=True, backend="aot_eager")
    out = fn(q, cache, table, sl, SCALE, scale, kv_lora_rank=L)
    torch.testing.assert_close(out, eager, atol=0, rtol=0)


def test_gather_latents_dequantizes_in_table_order():
    gen = torch.Generator().manual_seed(stable_seed("gather"))
    cache = torch.randn(5, 4, L + R, generator=gen).to(FP8)
    table = torch.tensor([[3, 1], [0, 4]], dtype=torch.int32)
    rows = gather_latents(cache, table, 0.5, L)
    assert rows.shape == (2, 8, L + R) and rows.dtype == torch.float32
    torch.testing.assert_close(rows[0, 4:8], cache[1].float() * 0.5, atol=0, rtol=0)
    torch.testing.assert_close(rows[1, :4], cache[0].float() * 0.5, atol=0, rtol=0)
    bf = cache.float().to(torch.bfloat16)
    torch.testing.assert_close(gather_latents(bf, table, None, L)[0, :4], bf[3].float())


def _prefill_f64(q_nope, q_pe, rows, w_uk, w_uv, ctx, scale):
    rows = rows.double()
    lat, kpe = rows[:, :L], rows[:, L:]
    k_nope = torch.einsum("sl,hpl->hsp", lat, w_uk.double())
    v = torch.einsum("sl,hlv->hsv", lat, w_uv.double())
    T = q_nope.shape[0]
    out = torch.empty(T, H, V, dtype=torch.float64)
    for j in range(T):
        n = ctx + j + 1  # keys 0 .. ctx + j
        for h in range(H):
            s = (k_nope[h, :n] @ q_nope[j, h].double() + kpe[:n] @ q_pe[j, h].double()) * scale
            out[j, h] = torch.softmax(s, dim=0) @ v[h, :n]
    return out


def _prefill_inputs(T, S, gen):
    q_nope = torch.randn(T, H, P, generator=gen).to(torch.bfloat16)
    q_pe = torch.randn(T, H, R, generator=gen).to(torch.bfloat16)
    rows = torch.randn(S, L + R, generator=gen)
    w_uk = (torch.randn(H, P, L, generator=gen) * L**-0.5).to(torch.bfloat16)
    w_uv = (torch.randn(H, L, V, generator=gen) * L**-0.5).to(torch.bfloat16)
    return q_nope, q_pe, rows, w_uk, w_uv


@pytest.mark.parametrize(
    "T,ctx,extra", [(1, 0, 0), (6, 0, 0), (5, 11, 0), (1, 30, 0), (4, 3, 5)], ids=lambda v: str(v)
)
def test_prefill_causal_matches_dense_float64(T, ctx, extra):
    """``extra`` rows past the last query must never be read (they are NaN)."""
    gen = torch.Generator().manual_seed(stable_seed("prefill-f64", T, ctx, extra))
    q_nope, q_pe, rows, w_uk, w_uv = _prefill_inputs(T, ctx + T + extra, gen)
    rows[ctx + T :] = float("nan")
    out = prefill_attention(q_nope, q_pe, rows, w_uk, w_uv, ctx, SCALE)
    assert out.dtype == torch.float32 and out.shape == (T, H, V)
    want = _prefill_f64(q_nope, q_pe, rows, w_uk, w_uv, ctx, SCALE)
    torch.testing.assert_close(out.double(), want, atol=ATOL, rtol=RTOL)


def test_prefill_is_causal_and_nan_stays_forward():
    """Changing key j changes only the queries at positions >= j; a NaN key/value row
    poisons exactly the queries that attend to it."""
    gen = torch.Generator().manual_seed(stable_seed("prefill-causal"))
    T, ctx = 6, 4
    q_nope, q_pe, rows, w_uk, w_uv = _prefill_inputs(T, ctx + T, gen)
    base = prefill_attention(q_nope, q_pe, rows, w_uk, w_uv, ctx, SCALE)
    j = ctx + 2  # the third new token's row
    changed = rows.clone()
    changed[j] += 3.0
    out = prefill_attention(q_nope, q_pe, changed, w_uk, w_uv, ctx, SCALE)
    assert torch.equal(out[:2], base[:2])
    assert not torch.allclose(out[2:], base[2:])
    for col in (0, L + 1):  # a NaN in the latent (k_nope and v) or in the rope part (k only)
        bad = rows.clone()
        bad[j, col] = float("nan")
        out = prefill_attention(q_nope, q_pe, bad, w_uk, w_uv, ctx, SCALE)
        assert torch.equal(out[:2], base[:2])
        assert torch.isnan(out[2:]).all()


def test_prefill_rope_dims_enter_the_scores():
    """Rotating the keys' rope part changes the output (a model that drops the rope dims of
    the scores fails), except for the first query, whose only key gets weight 1 anyway."""
    gen = torch.Generator().manual_seed(stable_seed("prefill-rope"))
    T = 4
    q_nope, q_pe, rows, w_uk, w_uv = _prefill_inputs(T, T, gen)
    base = prefill_attention(q_nope, q_pe, rows, w_uk, w_uv, 0, SCALE)
    angles = torch.rand(T, R // 2, generator=gen, dtype=torch.float64) * 6
    rotated = rows.clone().double()
    rotated[:, L:] = rope_f64(rows[:, L:], angles.cos(), angles.sin(), False)
    out = prefill_attention(q_nope, q_pe, rotated.float(), w_uk, w_uv, 0, SCALE)
    assert torch.allclose(out[0], base[0], atol=1e-5)  # one key: softmax weight 1 regardless
    assert not torch.allclose(out[1:], base[1:], atol=1e-3)


def _bad_calls():
    q = torch.randn(2, H, L + R).to(torch.bfloat16)
    cache = torch.zeros(4, 16, L + R, dtype=FP8)
    table = torch.zeros(2, 1, dtype=torch.int32)
    sl = torch.tensor([1, 2])
    pre = _prefill_inputs(3, 3, torch.Generator().manual_seed(0))
    return {
        "fp8-cache-no-scale": (
            lambda: paged_decode_attention(q, cache, table, sl, SCALE, kv_lora_rank=L),
            FuseMLAValueError,
            "kv_scale",
        ),
        "fp8-q": (
            lambda: paged_decode_attention(q.to(FP8), cache, table, sl, SCALE, 1.0, kv_lora_rank=L),
            FuseMLATypeError,
            "q",
        ),
        "table-rows": (
            lambda: paged_decode_attention(q, cache, table[:1], sl, SCALE, 1.0, kv_lora_rank=L),
            FuseMLAValueError,
            "block_table",
        ),
        "seq-lens-shape": (
            lambda: paged_decode_attention(q, cache, table, sl[:1], SCALE, 1.0, kv_lora_rank=L),
            FuseMLAValueError,
            "seq_lens",
        ),
        "uint8-cache": (
            lambda: paged_decode_attention(
                q, cache.view(torch.uint8), table, sl, SCALE, 1.0, kv_lora_rank=L
            ),
            FuseMLATypeError,
            "kv_cache",
        ),
        "bad-rank": (
            lambda: paged_decode_attention(q, cache, table, sl, SCALE, 1.0, kv_lora_rank=L + R),
            FuseMLAValueError,
            "kv_lora_rank",
        ),
        "prefill-too-few-rows": (
            lambda: prefill_attention(*pre[:2], pre[2][:2], *pre[3:], 0, SCALE),
            FuseMLAValueError,
            "kv_rows",
        ),
        "prefill-w_uk": (
            lambda: prefill_attention(*pre[:3], pre[3][:, :4], pre[4], 0, SCALE),
            FuseMLAValueError,
            "w_uk",
        ),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_names_the_argument(case):
    fn, exc, name = _bad_calls()[case]
    with pytest.raises(exc, match=rf"^{name}:") as info:
        fn()
    assert isinstance(info.value, FuseMLAError)
