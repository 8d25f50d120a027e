"""Shared by the benchmark scripts: the commit id for the JSON header, and timing.

:func:`time_graph` is the method of every GPU number (docs/method.md): all calls captured in one
CUDA graph, the graph replayed by ``triton.testing.do_bench`` (median), the time divided by the
number of calls. :func:`time_eager` is the CPU stand-in of ``--smoke`` runs (one timed eager pass;
the number says nothing about speed). Both take an optional ``check(replay)`` that runs after
capture and before any timing: it poisons what it wants, calls ``replay()`` (the captured graph,
or the calls eagerly), compares, and returns a list of problems; a non-empty list raises
:class:`CheckFailed` and nothing is timed.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence

import torch
import triton


def commit_id() -> str:
    """``FUSEMLA_COMMIT`` if set (where the tree's .git is not current), else git's HEAD."""
    commit = os.environ.get("FUSEMLA_COMMIT")
    if commit:
        return commit
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
    except Exception:  # noqa: BLE001 - no git: say so in the header
        return "unknown"


class CheckFailed(Exception):
    """A correctness check before timing found problems (``.problems``)."""

    def __init__(self, problems: Sequence[str]):
        super().__init__("; ".join(problems))
        self.problems = list(problems)


Check = Callable[[Callable[[], None]], Sequence[str]]


def _run_check(check: Check | None, replay: Callable[[], None]) -> None:
    if check is None:
        return
    problems = list(check(replay))
    if problems:
        raise CheckFailed(problems)


def time_graph(calls, rep: int = 250, warmup: int = 25, check: Check | None = None) -> float:
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
    try:
        _run_check(check, g.replay)
        ms = triton.testing.do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median")
    finally:
        del g
    return ms * 1e3 / len(calls)


def time_eager(calls, rep: int = 0, warmup: int = 0, check: Check | None = None) -> float:
    """CPU stand-in for :func:`time_graph` (``--smoke``): one untimed pass (compiles), the check
    on an eager pass, then one timed pass; µs per call of wall time."""
    del rep, warmup
    for c in calls:
        c()

    def replay() -> None:
        for c in calls:
            c()

    _run_check(check, replay)
    t0 = time.perf_counter()
    replay()
    return (time.perf_counter() - t0) * 1e6 / len(calls)
