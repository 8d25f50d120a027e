"""The command line: ``python -m fusemla demo`` / ``info`` in a fresh process, and the demo's checker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fusemla.cli import main
from fusemla.reference.prologue import mla_prologue_ref


def _run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the CLI must choose the interpreter by itself
    return subprocess.run(
        [sys.executable, "-m", "fusemla", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


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
    assert "bench_prologue.py" in out
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


def test_demo_exits_1_when_the_fused_result_disagrees(device, monkeypatch, capsys):
    """End to end through main(): a fused op that corrupts one value makes the demo fail."""
    if device != "cpu":
        pytest.skip("the in-process demo runs the interpreter's small dims")
    import fusemla.ops.prologue.api as api

    def broken(*args, **kwargs):
        out = mla_prologue_ref(*args, **kwargs)
        out.q[0, 0, 0] += 1.0
        return out

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # restored afterwards
    monkeypatch.setattr(api, "mla_prologue", broken)
    assert main(["demo", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "DISAGREE" in out and "differ from the reference by more than 1 ulp" in out
