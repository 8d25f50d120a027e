"""The benchmarks' registry and runner (``benchmarks/registry.py``, ``python -m benchmarks``):
every benchmark script is an entry with a smoke, and the runner's summary and exit status say
which smokes passed, were skipped (and why) or failed.

The runner runs in a subprocess from the repository root (the benchmarks package is not
installed; ``python -c`` puts the working directory on the path). The smokes themselves run in
CI through ``python -m benchmarks smoke``, not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _py(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _registry() -> dict:
    r = _py(
        """
        import json
        from benchmarks.registry import BENCHMARKS, HELPERS
        print(json.dumps(dict(
            helpers=list(HELPERS),
            entries=[dict(name=b.name, path=str(b.path), smoke=list(b.smoke), needs=list(b.needs))
                     for b in BENCHMARKS],
        )))
        """
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_every_benchmark_script_is_an_entry_with_a_smoke():
    reg = _registry()
    entries = {Path(e["path"]).resolve(): e for e in reg["entries"]}
    helpers = {(ROOT / h).resolve() for h in reg["helpers"]}
    assert len(entries) == len(reg["entries"]), "two entries run the same file"
    for p in entries:
        assert p.is_file(), f"registered {p} does not exist"
    for h in helpers:
        assert h.is_file(), f"helper {h} does not exist"
    files = {p.resolve() for p in (ROOT / "benchmarks").rglob("*.py") if "results" not in p.parts}
    unlisted = sorted(str(p.relative_to(ROOT)) for p in files - set(entries) - helpers)
    assert not unlisted, f"benchmark files neither registered nor helpers: {unlisted}"
    for p, e in entries.items():
        assert e["smoke"], f"{e['name']}: no smoke arguments"
        for arg in e["smoke"]:
            assert arg in p.read_text(), f"{e['name']}: {p.name} does not take {arg}"
    assert {n for e in reg["entries"] for n in e["needs"]} <= {"vllm", "aiter"}


def test_runner_reports_passed_skipped_failed_and_fails_the_run(tmp_path):
    (tmp_path / "ok.py").write_text("print('row ok')\n")
    (tmp_path / "bad.py").write_text("print('row WRONG')\nraise SystemExit(1)\n")
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(30)\n")
    code = f"""
        import sys
        from benchmarks import registry, runner
        B = registry.Benchmark
        runner.BENCHMARKS = (
            B("ok", "tool", "passes", script={str(tmp_path / "ok.py")!r}, smoke=()),
            B("bad", "tool", "fails", script={str(tmp_path / "bad.py")!r}, smoke=()),
            B("slow", "tool", "times out", script={str(tmp_path / "slow.py")!r}, smoke=(),
              timeout=1),
            B("peer", "peer", "needs AITER", script={str(tmp_path / "ok.py")!r}, smoke=(),
              needs=("aiter",)),
        )
        sys.exit(runner.main(["smoke", "--log-dir", {str(tmp_path / "logs")!r}] + sys.argv[1:]))
    """
    env = dict(os.environ, AITER_PEER_DIR=str(tmp_path / "no_aiter"))
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    out = r.stdout
    assert r.returncode == 1, out + r.stderr
    assert "1 passed, 1 skipped, 2 failed" in out, out
    lines = {x.split()[1]: x for x in out.splitlines() if x.startswith("  ")}
    assert lines["ok"].split()[0] == "passed"
    assert lines["bad"].split()[0] == "failed" and "exit status 1" in lines["bad"]
    assert lines["slow"].split()[0] == "failed" and "timed out" in lines["slow"]
    assert lines["peer"].split()[0] == "skipped" and "no_aiter" in lines["peer"]
    assert "row WRONG" in out, "a failed smoke's log tail is printed"
    assert (tmp_path / "logs" / "ok.log").read_text() == "row ok\n"
    # only the passing one: exit status 0; an unknown name: 2
    r_ok = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), "ok"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r_ok.returncode == 0 and "1 passed, 0 skipped, 0 failed" in r_ok.stdout, r_ok.stdout
    r_bad = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), "nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r_bad.returncode == 2 and "no benchmark 'nope'" in r_bad.stderr


def test_only_vllm_fails_where_vllm_is_missing(tmp_path):
    (tmp_path / "ok.py").write_text("pass\n")
    code = f"""
        import sys
        from benchmarks import registry, runner
        runner.BENCHMARKS = (
            registry.Benchmark("eng", "engine", "needs vLLM", script={str(tmp_path / "ok.py")!r},
                               smoke=(), needs=("vllm",)),
            registry.Benchmark("cpu", "tool", "no vLLM", script={str(tmp_path / "ok.py")!r},
                               smoke=()),
        )
        sys.exit(runner.main(["smoke", "--vllm-python", {str(tmp_path / "no_python")!r}]
                             + sys.argv[1:]))
    """
    plain = _py(code + "\n", timeout=60)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "1 passed, 1 skipped, 0 failed" in plain.stdout
    assert "needs vLLM (not importable in" in plain.stdout
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), "--only-vllm"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "0 passed, 0 skipped, 1 failed" in r.stdout, r.stdout
