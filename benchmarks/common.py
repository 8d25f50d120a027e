"""Shared by the benchmark scripts: the commit id for the JSON header, and graph timing."""

from __future__ import annotations

import os
import subprocess

import torch
import triton


def commit_id() -> str:
    """``FUSEMLA_COMMIT`` if set (where the tree's .git is not current), else git's HEAD."""
    commit = os.environ.get("FUSEMLA_COMMIT")
    if commit:
        return commit
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001 - no git: say so in the header
        return "unknown"


def time_graph(calls, rep: int = 250, warmup: int = 25) -> float:
    """µs per call: capture all calls in one CUDA graph, replay, median, divide."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median")
    del g
    return ms * 1e3 / len(calls)
