"""fusemla.testing.compare: agreement passes, deliberate corruption is caught. The reference is
used for both sides (the checker is under test, not the kernel), so no Triton kernel runs here."""

from __future__ import annotations

import pytest
import torch

from fusemla.reference.prologue import mla_prologue_ref
from fusemla.testing import SMALL_DIMS as SMALL
from fusemla.testing import compare, make_inputs


def _pair(kv_dtype=None, seed=0, D=None):
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(
        8, **SMALL, kv_dtype=kv_dtype, pad_fraction=0.3, generator=g, num_decode_tokens=D
    )
    before = inp.kv_cache.clone()
    cache_a, cache_b = inp.kv_cache.clone(), inp.kv_cache.clone()
    q_a = inp.run(mla_prologue_ref, kv_cache=cache_a)
    q_b = inp.run(mla_prologue_ref, kv_cache=cache_b)
    if D is None:
        q_a, q_b = q_a.q, q_b.q
    return inp, q_a, q_b, cache_a, cache_b, before


def _written_slot(inp, cache) -> int:
    n = cache.shape[0] * cache.shape[1]
    s = inp.slot_mapping.long()
    return int(s[(s >= 0) & (s < n)][0])


def _bits(x):
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.uint8)


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_compare_accepts_identical_results(kv_dtype):
    inp, q, q_ref, cache, cache_ref, before = _pair(kv_dtype)
    res = compare(inp, q, q_ref, cache, cache_ref, before)
    assert res.ok, res.problems
    assert res.metrics["q_max_abs_diff"] == 0.0
    assert res.metrics["rows_agree"] == res.metrics["rows_valid"] > 0


def test_compare_accepts_one_ulp():
    inp, q, q_ref, cache, cache_ref, before = _pair()
    q = q.clone()
    _bits(q)[0, 0, 0] += 1  # next bf16 value up (same sign)
    res = compare(inp, q, q_ref, cache, cache_ref, before)
    assert res.ok, res.problems
    assert res.metrics["q_max_abs_diff"] > 0


def test_compare_catches_corrupted_q():
    inp, q, q_ref, cache, cache_ref, before = _pair()
    q = q.clone()
    q[2, 1, 5] += 0.5
    res = compare(inp, q, q_ref, cache, cache_ref, before)
    assert not res.ok
    assert any(p.startswith("q: 1 of") for p in res.problems), res.problems
    assert res.metrics["q_max_abs_diff"] == pytest.approx(0.5, rel=0.05)


def test_compare_catches_unwritten_q():
    inp, q, q_ref, cache, cache_ref, before = _pair()
    q = q.clone()
    q[0, 0, -3:] = float("nan")
    res = compare(inp, q, q_ref, cache, cache_ref, before)
    assert any("NaN" in p for p in res.problems), res.problems


def test_compare_catches_wrong_rope_everywhere():
    """A systematic error (rope skipped) fails the float64 check as well as the elementwise one."""
    inp, q, q_ref, cache, cache_ref, before = _pair()
    q = q.clone()
    q[..., SMALL["L"] :] = inp.q_pe
    res = compare(inp, q, q_ref, cache, cache_ref, before)
    assert any("q[..., rope]" in p for p in res.problems), res.problems


def test_compare_catches_corrupted_bf16_cache_row():
    inp, q, q_ref, cache, cache_ref, before = _pair()
    slot = _written_slot(inp, cache)
    bs = cache.shape[1]
    cache[slot // bs, slot % bs, -1] += 1.0  # the rope part
    res = compare(inp, q, q_ref, cache, cache_ref, before)
    assert any(p.startswith("cache: 1 of") for p in res.problems), res.problems


def test_compare_catches_inexact_bf16_latent():
    """The latent part of a bf16 row is a plain copy: even one ulp there is a disagreement."""
    inp, q, q_ref, cache, cache_ref, before = _pair()
    slot = _written_slot(inp, cache)
    bs = cache.shape[1]
    _bits(cache)[slot // bs, slot % bs, 0] += 1
    res = compare(inp, q, q_ref, cache, cache_ref, before)
    assert any(p.startswith("cache: 1 of") for p in res.problems), res.problems


def test_compare_fp8_one_code_ok_two_codes_not():
    inp, q, q_ref, cache, cache_ref, before = _pair(torch.float8_e4m3fn)
    slot = _written_slot(inp, cache)
    bs = cache.shape[1]
    raw = cache.view(torch.uint8)[slot // bs, slot % bs]
    # a column whose code can move by two in magnitude without leaving the finite range
    col = SMALL["L"] + int(((raw[SMALL["L"] :] & 0x7F) < 0x7C).nonzero()[0])  # the rope part
    raw[col] += 1
    res = compare(inp, q, q_ref, cache, cache_ref, before, fp8_code_slack=1)  # the GPU's slack
    assert res.ok, res.problems
    assert res.metrics["fp8_codes_off_by_one"] == 1
    res = compare(inp, q, q_ref, cache, cache_ref, before)  # CPU: codes must be equal
    assert any(p.startswith("cache: 1 of") for p in res.problems), res.problems
    raw[col] += 1
    res = compare(inp, q, q_ref, cache, cache_ref, before, fp8_code_slack=1)
    assert any(p.startswith("cache: 1 of") for p in res.problems), res.problems


def test_compare_fp8_signed_zeros_are_one_value():
    """+0 and -0 are the same value: bytes 0x00 and 0x80 count as equal codes."""
    inp, q, q_ref, cache, cache_ref, before = _pair(torch.float8_e4m3fn)
    slot = _written_slot(inp, cache)
    bs = cache.shape[1]
    cache.view(torch.uint8)[slot // bs, slot % bs, 0] = 0x00
    cache_ref.view(torch.uint8)[slot // bs, slot % bs, 0] = 0x80
    res = compare(inp, q, q_ref, cache, cache_ref, before)
    assert not any("written rows differ" in p for p in res.problems), res.problems
    cache_ref.view(torch.uint8)[slot // bs, slot % bs, 0] = 0x01  # the smallest subnormal
    res = compare(inp, q, q_ref, cache, cache_ref, before)
    assert any("written rows differ" in p for p in res.problems), res.problems


def test_compare_catches_stray_and_missing_writes():
    inp, q, q_ref, cache, cache_ref, before = _pair()
    n = cache.shape[0] * cache.shape[1]
    s = inp.slot_mapping.long()
    written = set(s[(s >= 0) & (s < n)].tolist())
    unused = next(i for i in range(n) if i not in written)
    bs = cache.shape[1]
    cache[unused // bs, unused % bs, 3] = 0.0  # a stray write
    slot = _written_slot(inp, cache)
    cache[slot // bs, slot % bs] = before[slot // bs, slot % bs]  # a missing write (NaN poison)
    res = compare(inp, q, q_ref, cache, cache_ref, before)
    assert any("outside the valid slots were modified" in p for p in res.problems), res.problems
    assert any(p.startswith("cache: 1 of") for p in res.problems), res.problems


def test_compare_prefill_outputs():
    """Mixed batch: the prefill tokens' rotated q_pe / k_pe are checked too."""
    inp, out, out_ref, cache, cache_ref, before = _pair(D=3)
    assert compare(inp, out, out_ref, cache, cache_ref, before).ok
    bad_q_pe = out.q_pe.clone()
    bad_q_pe[1, 0, 2] += 0.25
    res = compare(inp, (out.q, bad_q_pe, out.k_pe), out_ref, cache, cache_ref, before)
    assert any(p.startswith("q_pe_out: 1 of") for p in res.problems), res.problems
    unrotated = inp.k_pe[3:].clone()
    res = compare(inp, (out.q, out.q_pe, unrotated), out_ref, cache, cache_ref, before)
    assert any(p.startswith("k_pe_out") for p in res.problems), res.problems


@pytest.mark.parametrize("D", [None, 0])
def test_compare_empty_batch(D):
    from fusemla.testing import run_and_compare

    res = run_and_compare(mla_prologue_ref, make_inputs(0, **SMALL, num_decode_tokens=D))
    assert res.ok, res.problems
    assert res.metrics["rows_valid"] == 0
