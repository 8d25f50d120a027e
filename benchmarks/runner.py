"""``python -m benchmarks``: list, run and smoke the benchmarks of :mod:`benchmarks.registry`.

From the repository root::

    python -m benchmarks list                      # the registry: name, kind, needs, command
    python -m benchmarks run NAME [ARGS ...]       # one benchmark with ARGS, in this Python
    python -m benchmarks smoke                     # every smoke; the vLLM ones are skipped, with
                                                   # the reason, where vLLM is not importable
    python -m benchmarks smoke --only-vllm         # only the vLLM ones (run it with the vLLM
                                                   # venv's python): a missing vLLM fails
    python -m benchmarks smoke [NAME ...] [--vllm-python PY] [--timeout S] [--log-dir D] [-v]

A smoke runs the entry's command with its smoke arguments in a process of its own (the
repository root as working directory, ``TRITON_INTERPRET=1`` for the entries that run kernels
in Triton's interpreter), its output in ``--log-dir`` (a temporary folder by default; the tail
is printed when it fails). Every smoke checks at least one row and exits non-zero otherwise.
The summary lists each one as passed, skipped (with the reason) or failed; the exit status is
1 when one failed, 2 for a usage error, else 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.registry import BENCHMARKS, ROOT, Benchmark, missing

TAIL_LINES = 40


@dataclass
class Outcome:
    name: str
    status: str  # "passed", "skipped" or "failed"
    seconds: float = 0.0
    detail: str = ""


def get(name: str) -> Benchmark:
    """The entry called ``name``; KeyError naming the known ones otherwise."""
    for b in BENCHMARKS:
        if b.name == name:
            return b
    raise KeyError(f"no benchmark {name!r}; known: {', '.join(b.name for b in BENCHMARKS)}")


def smoke_env(b: Benchmark) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if b.interpreter:
        env["TRITON_INTERPRET"] = "1"
    return env


def run_smoke(
    b: Benchmark, python: str, log_dir: Path, timeout: float, verbose: bool = False
) -> Outcome:
    """Run ``b``'s smoke once; its output to ``log_dir/NAME.log`` (and the terminal with
    ``verbose``)."""
    cmd = b.command(python, b.smoke)
    log = log_dir / f"{b.name}.log"
    print(f"[smoke] {b.name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        # a session of its own: on a timeout the whole tree (engine processes too) is killed
        p = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=smoke_env(b),
            stdout=None if verbose else f,
            stderr=None if verbose else subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = None
    dt = time.perf_counter() - t0
    if rc == 0:
        return Outcome(b.name, "passed", dt, f"log {log}" if not verbose else "")
    why = f"timed out after {timeout:.0f} s" if rc is None else f"exit status {rc}"
    if not verbose:
        tail = log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
        print(f"[smoke] {b.name} failed ({why}); the last lines of {log}:", flush=True)
        print("\n".join("    " + x for x in tail), flush=True)
    return Outcome(b.name, "failed", dt, why)


def smoke(args) -> int:
    try:
        chosen = [get(n) for n in args.names] if args.names else list(BENCHMARKS)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    if args.only_vllm:
        chosen = [b for b in chosen if "vllm" in b.needs]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="benchmarks_smoke_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    outcomes = []
    t_all = time.perf_counter()
    for b in chosen:
        python = args.vllm_python if ("vllm" in b.needs and args.vllm_python) else sys.executable
        reasons = [r for r in (missing(n, python) for n in b.needs) if r]
        if reasons:
            status = "failed" if args.only_vllm else "skipped"
            outcomes.append(Outcome(b.name, status, 0.0, "; ".join(reasons)))
            print(f"[smoke] {b.name}: {status}: {'; '.join(reasons)}", flush=True)
            continue
        o = run_smoke(b, python, log_dir, args.timeout or b.timeout, args.verbose)
        print(f"[smoke] {b.name}: {o.status} in {o.seconds:.1f} s", flush=True)
        outcomes.append(o)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("passed", "skipped", "failed")}
    print(
        f"\nbenchmark smokes: {counts['passed']} passed, {counts['skipped']} skipped, "
        f"{counts['failed']} failed in {time.perf_counter() - t_all:.0f} s (logs in {log_dir})"
    )
    for o in outcomes:
        took = f"{o.seconds:6.1f} s" if o.status != "skipped" else " " * 8
        print(f"  {o.status:<8} {o.name:<16} {took}  {o.detail}")
    if not outcomes:
        print("  (no benchmark selected)")
    return 1 if counts["failed"] else 0


def list_entries() -> int:
    print(f"{'name':<16} {'kind':<8} {'needs':<6} command / what")
    for b in BENCHMARKS:
        cmd = f"-m {b.module}" if b.module else b.script
        print(f"{b.name:<16} {b.kind:<8} {','.join(b.needs) or '-':<6} {cmd}")
        print(f"{'':<32} {b.what}")
    return 0


def run(name: str, rest: list[str]) -> int:
    try:
        b = get(name)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2
    env = smoke_env(b) if "--smoke" in rest else None
    return subprocess.call(b.command(sys.executable, rest), env=env)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) >= 2 and argv[0] == "run":  # everything after the name is the benchmark's
        return run(argv[1], argv[2:])
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks", description="the project's benchmarks (registry.py)"
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the registered benchmarks")
    r = sub.add_parser("run", help="run one benchmark with the arguments that follow")
    r.add_argument("name")
    s = sub.add_parser("smoke", help="run the smokes and print a summary")
    s.add_argument("names", nargs="*", help="these entries only (default: all)")
    s.add_argument(
        "--only-vllm",
        action="store_true",
        help="only the entries that need vLLM; a missing vLLM fails them instead of a skip",
    )
    s.add_argument("--vllm-python", default=None, help="the Python of the entries that need vLLM")
    s.add_argument(
        "--timeout", type=float, default=None, help="seconds per smoke (default: its own)"
    )
    s.add_argument("--log-dir", default=None)
    s.add_argument("-v", "--verbose", action="store_true", help="the smokes' output as it comes")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        return list_entries()
    if args.cmd == "run":
        return run(args.name, [])
    return smoke(args)
