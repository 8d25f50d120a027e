"""Shared by the benchmarks: the JSON header, timing, the smoke's interpreter, the verdict.

:func:`time_graph` is the method of every GPU number (docs/method.md): all calls captured in one
CUDA graph, the graph replayed by ``triton.testing.do_bench`` (median), the time divided by the
number of calls. :func:`time_eager` is the CPU stand-in of ``--smoke`` runs (one timed eager pass;
the number says nothing about speed); :func:`timer` picks one of the two. Both take an optional
``check(replay)`` that runs after capture and before any timing: it poisons what it wants, calls
``replay()`` (the captured graph, or the calls eagerly), compares, and returns a list of
problems; a non-empty list raises :class:`CheckFailed` and nothing is timed.

Every benchmark's ``--smoke`` runs on the CPU under Triton's interpreter
(:func:`ensure_interpreter`) at small dims and ends with :func:`verdict`: exit status 1 when a
check failed, and in a smoke also when no row was checked at all (a smoke that times nothing
proves nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

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


def run_header(smoke: bool, **extra: Any) -> dict:
    """The JSON header of a run: device, versions, commit, UTC date, then ``extra``."""
    return dict(
        gpu="cpu (smoke: Triton interpreter)" if smoke else torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        commit=commit_id(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        smoke=smoke,
        **extra,
    )


def write_json(path: str | None, obj: Any) -> None:
    """Write ``obj`` to ``path`` (nothing when None) through a temporary file, so a run cut
    short leaves the previous complete file, not half of one."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def parser(doc: str | None, out: bool = True) -> argparse.ArgumentParser:
    """An argument parser described by the first line of ``doc``, with ``--smoke`` (and
    ``--out``)."""
    ap = argparse.ArgumentParser(description=(doc or "").strip().split("\n")[0])
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU: small dims under TRITON_INTERPRET=1, eager timing, every row still checked",
    )
    if out:
        ap.add_argument("--out", default=None, help="JSON path")
    return ap


def ensure_interpreter() -> None:
    """For ``--smoke``: unless Triton already interprets, re-run this very command with
    ``TRITON_INTERPRET=1`` (Triton decides at a kernel's definition, so the variable must be
    set before any kernel module is imported). A module run with ``python -m`` is re-run the
    same way."""
    from fusemla.config import interpreting

    if interpreting():
        return
    print("--smoke runs the Triton interpreter: re-running with TRITON_INTERPRET=1", flush=True)
    os.environ["TRITON_INTERPRET"] = "1"
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    target = ["-m", spec.name] if spec is not None and spec.name else [sys.argv[0]]
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, *target, *sys.argv[1:]])


def verdict(rows: Sequence[dict], failures: Sequence[Any], smoke: bool, what: str = "rows") -> int:
    """Print the correctness line and return the exit status: 1 when a check failed or a row
    is not marked correct, and in a smoke when there is no row at all; else 0."""
    bad = [r for r in rows if r.get("correct", True) is not True]
    if failures or bad:
        print(
            f"correctness: {len(failures)} FAILED checks/errors"
            + (f", {len(bad)} {what} not correct" if bad else "")
            + "; exit status 1"
        )
        return 1
    if smoke and not rows:
        print(f"correctness: the smoke checked no {what}; exit status 1")
        return 1
    print(f"correctness: all {len(rows)} {what} checked and correct")
    return 0


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


def timer(smoke: bool) -> Callable[..., float]:
    """:func:`time_eager` in a smoke, else :func:`time_graph` (same arguments)."""
    return time_eager if smoke else time_graph


def sync(device) -> None:
    """Wait for the device (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
