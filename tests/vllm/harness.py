"""Shared by the vLLM end-to-end tests (CPU and GPU) and ``benchmarks/bench_vllm.py``: engine runs
in their own processes (``engine_run.py``), and the comparison of two runs.

The comparison (docs/method.md): greedy tokens only up to each request's first near tie in the
reference run; the numbers (per-layer outputs, next-token logprobs, used KV-cache rows) over the
steps before the first token that differs; the cache-write accounting always.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "engine_run.py"
# a greedy pick whose top-1/top-2 logprob margin is below this is a near tie: vLLM's logits are
# bf16, and a logit of 256..512 moves in steps of 2 (engine_run's models put margins far above)
TIE_MARGIN = 4.0


def vllm_missing() -> str | None:
    """Why vLLM tests cannot run here (None: vLLM imports)."""
    spec = importlib.util.find_spec("vllm")
    # (a namespace package without an origin is the folder tests/vllm itself, on sys.path)
    if spec is None or spec.origin is None:
        return "vLLM is not installed (these tests run in a venv with vLLM: see README)"
    try:
        from vllm import LLM  # noqa: F401
    except Exception as e:  # a broken install must not break the main suite
        return f"import vllm failed: {type(e).__name__}: {e}"
    return None


def cpu_has_amx() -> bool:
    """The test host's CPU has AMX tiles (vLLM's CPU build then prefers its AMX_MLA backend)."""
    import torch

    fn = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(fn()) if fn is not None else False


# ------------------------------------------------------------------------------ engine runs


@dataclass
class Spec:
    """One engine run. ``env`` adds to the environment (FUSEMLA_* flags and the like)."""

    name: str
    shape: str
    plugin: bool
    mode: str = "eager"
    schedule: str = "small"
    tp: int = 1
    kv_cache_dtype: str = "auto"
    backend: str | None = None
    inject: str = "none"
    capture: bool = False
    profile: bool = False
    interpret: bool | None = None  # TRITON_INTERPRET (default: = plugin, on the CPU)
    seed: int = 0
    prompt_seed: int = 1234  # the prompts' random tokens
    max_model_len: int = 1024
    env: dict = field(default_factory=dict)
    emulate_fp8: bool = False  # CPU: block-FP8 linears through fp8_emulation.py
    speculative: int = 0  # speculative decoding with this many draft tokens (0: off)
    spec_method: str = "ngram"  # or "deepseek_mtp" (a -mtp shape)


class Runner:
    """Runs :class:`Spec` s (each once per session, cached by name), in parallel on a GPU host.

    ``gpus``: GPU indices to spread single-GPU runs over (each run sees one through
    CUDA_VISIBLE_DEVICES, ``per_gpu`` at a time); empty on the CPU (runs one at a time).
    """

    def __init__(
        self,
        root: Path,
        on_gpu: bool = False,
        gpus: tuple = (),
        per_gpu: int = 1,
        timeout: int = 900,
    ):
        self.root = Path(root)
        self.on_gpu = on_gpu
        self.gpus = list(gpus)
        self.per_gpu = per_gpu
        self.timeout = timeout
        self.results: dict[str, dict] = {}
        self.failures: dict[str, str] = {}
        self._models: dict[str, Path] = {}
        self._building: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._free = [g for g in self.gpus for _ in range(per_gpu)]

    def model(self, shape: str) -> Path:
        """The saved model of ``shape`` (built once; several shapes may build at once)."""
        with self._lock:
            if shape in self._models:
                return self._models[shape]
            ev = self._building.get(shape)
            if ev is None:
                ev = self._building[shape] = threading.Event()
                mine = True
            else:
                mine = False
        path = self.root / "models" / shape.replace(":", "-")
        if mine:
            try:
                subprocess.run(
                    [sys.executable, str(SCRIPT), "make-model", str(path), "--shape", shape],
                    check=True,
                    env=self._base_env(),
                    timeout=600,
                )
                with self._lock:
                    self._models[shape] = path
            finally:
                ev.set()
        else:
            ev.wait()
        if shape not in self._models:
            raise AssertionError(f"building the model of shape {shape} failed")
        return path

    def _base_env(self) -> dict:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("FUSEMLA_", "TRITON_INTERPRET", "VLLM_"))
        }
        env["PYTHONUNBUFFERED"] = "1"
        if not self.on_gpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        return env

    def _env(self, s: Spec) -> dict:
        env = self._base_env()
        env["FUSEMLA_VLLM"] = "1" if s.plugin else "0"
        interpret = (s.plugin and not self.on_gpu) if s.interpret is None else s.interpret
        if interpret:
            env["TRITON_INTERPRET"] = "1"
        env["VLLM_CACHE_ROOT"] = str(self.root / "vllm-cache" / s.name)  # no shared compile cache
        # the engine core in this process: each engine.step() of the driver is one scheduler
        # step, so requests arrive at the same step in every run (with the core in its own
        # process, arrival depends on timing and step compositions differ between runs)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if s.tp > 1 and not self.on_gpu:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(s.tp))
        env.update(s.env)
        return env

    def _cmd(self, s: Spec, out: Path) -> list:
        cmd = [
            sys.executable,
            str(SCRIPT),
            "run",
            str(self.model(s.shape)),
            str(out),
            "--tp",
            str(s.tp),
            "--mode",
            s.mode,
            "--schedule",
            s.schedule,
            "--seed",
            str(s.seed),
            "--prompt-seed",
            str(s.prompt_seed),
            "--kv-cache-dtype",
            s.kv_cache_dtype,
            "--inject",
            s.inject,
            "--max-model-len",
            str(s.max_model_len),
        ]
        if s.backend:
            cmd += ["--backend", s.backend]
        if s.capture:
            cmd.append("--capture")
        if s.profile:
            cmd.append("--profile")
        if s.emulate_fp8:
            cmd.append("--emulate-fp8-linear")
        if s.speculative:
            cmd += ["--speculative", str(s.speculative), "--spec-method", s.spec_method]
        return cmd

    def run(self, s: Spec) -> dict:
        """The run's results (raises AssertionError with the log's tail if it failed)."""
        if s.name in self.results:
            return self.results[s.name]
        if s.name in self.failures:
            raise AssertionError(self.failures[s.name])
        out = self.root / "runs" / s.name
        out.mkdir(parents=True, exist_ok=True)
        env = self._env(s)
        gpu = None
        if self.on_gpu and s.tp == 1 and self.gpus:
            with self._lock:
                gpu = self._free.pop(0) if self._free else self.gpus[0]
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        log = self.root / "runs" / f"{s.name}.log"
        try:
            with open(log, "w") as f:
                p = subprocess.run(
                    self._cmd(s, out),
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env=env,
                    timeout=self.timeout,
                )
        except subprocess.TimeoutExpired:
            p = None
        finally:
            if gpu is not None:
                with self._lock:
                    self._free.append(gpu)
        if p is None or p.returncode != 0:
            tail = log.read_text()[-5000:]
            msg = f"engine run {s.name} failed (rc={p and p.returncode}):\n{tail}"
            self.failures[s.name] = msg
            raise AssertionError(msg)
        res = load(out)
        res["name"] = s.name
        res["log"] = log.read_text()
        self.results[s.name] = res
        return res

    def run_many(self, specs: list, workers: int | None = None) -> None:
        """Run every spec not yet run, ``workers`` at a time (failures kept for :meth:`run`)."""
        todo = list(
            {
                s.name: s
                for s in specs  # once per name
                if s.name not in self.results and s.name not in self.failures
            }.values()
        )
        shapes = sorted({s.shape for s in todo})
        with cf.ThreadPoolExecutor(max(1, min(len(shapes), os.cpu_count() or 1))) as ex:
            list(ex.map(self.model, shapes))  # the models first, in parallel
        n = workers or (len(self._free) if self.on_gpu else 1)
        with cf.ThreadPoolExecutor(max(1, n)) as ex:
            for f in [ex.submit(self.run, s) for s in todo]:
                try:
                    f.result()
                except AssertionError:
                    pass


def load(out: Path) -> dict:
    res = json.loads((out / "tokens.json").read_text())
    res["ranks"] = []
    for s in res["summaries"]:
        r = s["rank"]
        res["ranks"].append(
            {
                "summary": json.loads((out / f"rank{r}.json").read_text()),
                "arrays": dict(np.load(out / f"rank{r}.npz")),
            }
        )
    return res


# ------------------------------------------------------------------------------ comparison


def first_ties(ref: dict, margin: float = TIE_MARGIN) -> dict[str, int]:
    """Per request, the index of its first generated token that was a near tie in ``ref``
    (len(tokens) if none)."""
    out = {}
    for rid, ms in ref["margins"].items():
        out[rid] = next((i for i, m in enumerate(ms) if m < margin), len(ms))
    return out


def noise_tie_margin(noisy: dict, ref: dict, margin: float = TIE_MARGIN) -> float:
    """The near-tie margin a model's own noise calls for: the largest margin (in ``ref``) of a
    greedy token that bf16-sized noise in vLLM's own path (``noisy``) flipped before a
    ``margin`` near tie, else ``margin``. A block-FP8 model's activation quantization turns a
    rounding difference into code steps, so its noise flips tokens of wider margins than a
    bf16 model's does; a fused run may flip what its noise flips, and nothing wider."""
    wide = margin
    for rid, tie in first_ties(ref, margin).items():
        a, b = noisy["tokens"][rid][:tie], ref["tokens"][rid][:tie]
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is not None:
            wide = max(wide, float(ref["margins"][rid][i]) + 1e-6)
    return wide


def token_problems(run: dict, ref: dict, margin: float = TIE_MARGIN) -> list[str]:
    """Greedy tokens that differ before the request's first near tie (the tie's own token may
    flip; nothing before it may)."""
    problems = []
    if set(run["tokens"]) != set(ref["tokens"]):
        return [f"requests differ: {sorted(run['tokens'])} vs {sorted(ref['tokens'])}"]
    for rid, tie in first_ties(ref, margin).items():
        a, b = run["tokens"][rid][:tie], ref["tokens"][rid][:tie]
        if a != b:
            i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            problems.append(
                f"request {rid}: token {i} differs ({a[i]} vs {b[i]}) before its "
                f"first near tie at {tie} (margin {ref['margins'][rid][i]:.3f})"
            )
    return problems


def divergence(run: dict, ref: dict) -> tuple[int | None, int]:
    """(the first engine step whose output token differs between the runs, or None; the number of
    generated positions compared before it, over all requests)."""
    first = None
    positions = 0
    for rid, b in ref["tokens"].items():
        a = run["tokens"][rid]
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        positions += len(b) if i is None else i
        if i is not None:
            s = ref["token_steps"][rid][i]
            first = s if first is None else min(first, s)
    return first, positions


def _rel(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.abs(x - y).max() / max(float(np.abs(y).max()), 1e-6)) if x.size else 0.0


def _is_finite(x: np.ndarray) -> bool:
    return bool(np.isfinite(x).all())


def deviation(run: dict, ref: dict, max_steps: int | None = None) -> dict:
    """How far ``run`` is from ``ref`` (numbers only, over the steps before the first token that
    differs, and the first ``max_steps`` steps if given: a noise floor is measured over the
    steps of the run it judges, since noise grows with the steps it has had to compound;
    block-FP8 models, whose activation quantization turns any rounding difference into code
    steps, need it): ``out`` max relative error of a per-layer output (eager runs with --capture),
    ``logprob`` max |difference| of a next-token logprob over the tokens both top-k lists hold
    (``logprob_rel``: relative to the largest |logprob| compared),
    ``cache`` max relative error of a layer's used KV-cache rows (only if no token differs:
    otherwise the rows of diverged requests hold other tokens), and what was compared."""
    first, positions = divergence(run, ref)
    # with asynchronous scheduling a token reported at engine step s was sampled by forward s-1
    # or s and is input to forward s or later: forwards before s-1 saw identical inputs
    cutoff = None if first is None else max(first - 1, 0)
    d = {
        "out": 0.0,
        "logprob": 0.0,
        "cache": None,
        "steps_compared": 0,
        "layers": 0,
        "positions_compared": 0,
        "first_diverged_step": first,
        "problems": [],
    }
    # next-token logprobs at every position up to and including the first differing token
    # (its distribution is still computed from identical inputs)
    scale = 0.0
    for rid, b in ref["logprobs"].items():
        a = run["logprobs"][rid]
        ta, tb = run["tokens"][rid], ref["tokens"][rid]
        i = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(tb))
        for la, lb in zip(a[: i + 1], b[: i + 1]):
            common = set(la) & set(lb)
            if not common:
                d["problems"].append(f"request {rid}: no common top-k token")
                continue
            d["logprob"] = max(d["logprob"], max(abs(la[k] - lb[k]) for k in common))
            scale = max(scale, max(abs(lb[k]) for k in common))
            d["positions_compared"] += 1
    # vLLM's logits are bf16: logprobs move in steps of a bf16 ulp of the largest logit, so
    # they are also reported relative to the largest |logprob| compared
    d["logprob_rel"] = d["logprob"] / max(scale, 1e-6)
    for r_run, r_ref in zip(run["ranks"], ref["ranks"], strict=True):
        a, b = r_run["arrays"], r_ref["arrays"]
        outs = sorted(k for k in b if k.startswith("out/"))
        layers = {k.split("/")[1] for k in outs}
        d["layers"] = max(d["layers"], len(layers))
        for k in outs:
            i = int(k.rsplit("/", 1)[1])
            if (cutoff is not None and i >= cutoff) or (max_steps is not None and i >= max_steps):
                continue
            if k not in a or a[k].shape != b[k].shape:
                d["problems"].append(f"{k}: missing or of another shape in the run")
                continue
            if not _is_finite(a[k]):
                d["problems"].append(f"{k}: not finite")
                continue
            d["out"] = max(d["out"], _rel(a[k], b[k]))
            d["steps_compared"] = max(d["steps_compared"], i + 1)
        for k in sorted(k for k in b if k.startswith("slots/")):
            if k not in a or not np.array_equal(a[k], b[k]):
                d["problems"].append(f"{k}: other cache rows used")
        if first is None:
            d["cache"] = 0.0
            for k in sorted(k for k in b if k.startswith("cache/")):
                if k in a and a[k].shape == b[k].shape:
                    if not _is_finite(a[k]):
                        d["problems"].append(f"{k}: not finite")
                    else:
                        d["cache"] = max(d["cache"], _rel(a[k], b[k]))
    return d


def accounting_problems(run: dict, ref: dict) -> list[str]:
    """Each cache row written exactly once per layer, as many rows as the reference run wrote."""
    problems = []
    for r_run, r_ref in zip(run["ranks"], ref["ranks"], strict=True):
        s_run, s_ref = r_run["summary"], r_ref["summary"]
        # vLLM itself rewrites a few rows in some schedules (one per request in "wide"): the
        # run must rewrite exactly those, no more
        for layer, n in s_run["rows_written_twice"].items():
            if n != s_ref["rows_written_twice"].get(layer, 0):
                problems.append(
                    f"{layer}: {n} cache rows written more than once (vLLM's own "
                    f"path: {s_ref['rows_written_twice'].get(layer, 0)})"
                )
        if s_run["rows_written"] != s_ref["rows_written"]:
            problems.append(f"rows written {s_run['rows_written']} vs {s_ref['rows_written']}")
    return problems


def judge(dev: dict, floor: dict, factor: float = 3.0, atol: dict | None = None) -> list[str]:
    """Problems of a deviation ``dev`` against a noise floor ``floor`` (both from
    :func:`deviation`): every measured number within ``factor`` x its floor (or its absolute
    allowance ``atol``, whichever is larger)."""
    atol = atol or {"out": 0.02, "logprob_rel": 0.02, "cache": 0.02}
    problems = list(dev["problems"])
    for k in ("out", "logprob_rel", "cache"):
        if dev[k] is None or floor.get(k) is None:
            continue
        limit = max(factor * floor[k], atol[k])
        if dev[k] > limit:
            problems.append(
                f"{k} deviation {dev[k]:.4g} > {limit:.4g} ({factor} x noise floor {floor[k]:.4g})"
            )
    return problems


def stats(res: dict, rank: int = 0) -> dict:
    return res["ranks"][rank]["summary"]["plugin_stats"]
