"""The command line: ``python -m fusemla demo`` / ``info`` in a fresh process, and the demo's checker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fusemla.cli import main
from fusemla.testing import compare
from fusemla.reference import mla_decode_prologue_ref
from fusemla.testing import make_inputs

SMALL = {"H": 4, "P": 32, "R": 16, "L": 64}


def _run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the CLI must choose the interpreter by itself
    return subprocess.run([sys.executable, "-m", "fusemla", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, check=False)


def test_demo_cpu_runs_the_interpreter_and_agrees(device):
    if device == "cuda":
        # the GPU machine's older Triton interpreter (3.6 with NumPy 2.x) cannot run the kernel;
        # CI runs this test with the pinned Triton on a CPU machine
        pytest.skip("the CPU demo is CI's test")
    proc = _run_cli("demo", "--device", "cpu")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    lines = out.splitlines()
    assert lines[0].startswith("fusemla demo:") and "Triton interpreter" in lines[0], lines[0]
    assert "cases agree" in out
    assert "DISAGREE" not in out
    assert "bench_decode_prologue.py" in out
    assert "bf16 cache" in out and "fp8e4m3 cache" in out


def test_info():
    proc = _run_cli("info")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for key in ("fusemla 0.", "torch ", "triton ", "python ", "GPU:", "TRITON_INTERPRET: not set"):
        assert key in out, (key, out)


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_demo_cuda_without_gpu_is_a_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["demo", "--device", "cuda"]) == 2
    assert "no CUDA/ROCm GPU" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# compare(): agreement passes, deliberate corruption is caught. The reference is used for both
# sides (the checker is what is under test, not the kernel), so no Triton kernel runs here.
# --------------------------------------------------------------------------------------------


def _pair(kv_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(8, **SMALL, kv_dtype=kv_dtype, pad_fraction=0.3, generator=g)
    before = inp.kv_cache.clone()
    cache_a, cache_b = inp.kv_cache.clone(), inp.kv_cache.clone()
    args = list(inp.args())
    args[8] = cache_a
    q_a = mla_decode_prologue_ref(*args, kv_scale=inp.kv_scale)
    args[8] = cache_b
    q_b = mla_decode_prologue_ref(*args, kv_scale=inp.kv_scale)
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
    q[..., SMALL["L"]:] = inp.q_pe
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
    col = int(((raw & 0x7F) < 0x7C).nonzero()[0])
    raw[col] += 1
    res = compare(inp, q, q_ref, cache, cache_ref, before)
    assert res.ok, res.problems
    assert res.metrics["fp8_codes_off_by_one"] == 1
    raw[col] += 1
    res = compare(inp, q, q_ref, cache, cache_ref, before)
    assert any(p.startswith("cache: 1 of") and "FP8 code" in p for p in res.problems), res.problems


def test_compare_fp8_signed_zeros_are_one_value():
    """+0 and -0 are the same value: bytes 0x00 and 0x80 count as equal codes."""
    inp, q, q_ref, cache, cache_ref, before = _pair(torch.float8_e4m3fn)
    slot = _written_slot(inp, cache)
    bs = cache.shape[1]
    cache.view(torch.uint8)[slot // bs, slot % bs, 0] = 0x00
    cache_ref.view(torch.uint8)[slot // bs, slot % bs, 0] = 0x80
    res = compare(inp, q, q_ref, cache, cache_ref, before)
    assert not any("FP8 code" in p for p in res.problems), res.problems


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


def test_demo_exits_1_when_the_fused_result_disagrees(device, monkeypatch, capsys):
    """End to end through main(): a fused op that corrupts one value makes the demo fail."""
    if device != "cpu":
        pytest.skip("the in-process demo runs the interpreter's small dims")
    import fusemla.ops.decode_prologue as dp

    def broken(*args, **kwargs):
        q = mla_decode_prologue_ref(*args, **kwargs)
        q[0, 0, 0] += 1.0
        return q

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # restored afterwards
    monkeypatch.setattr(dp, "mla_decode_prologue", broken)
    assert main(["demo", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "DISAGREE" in out and "differ from the reference by more than 1 ulp" in out
