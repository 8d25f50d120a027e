"""Every benchmark of the project, in one table: what it measures, how it runs, what its smoke
needs.

One :class:`Benchmark` per runnable benchmark (helper modules such as ``bench_core`` or
``peers`` are not entries: :data:`HELPERS` names them). The runner (``python -m benchmarks``,
:mod:`benchmarks.runner`) reads only this table: ``run NAME`` starts the entry's command,
``smoke`` runs every entry's ``--smoke`` and skips, with the reason printed, an entry whose
:attr:`Benchmark.needs` this machine lacks. Adding a benchmark means adding its entry here,
with a smoke that checks at least one row (``tests/benchmarks/test_benchmark_registry.py`` fails
on a file under benchmarks/ that is neither an entry nor a helper, and on an entry whose file
does not take its smoke arguments).

Plain data and the standard library only: the runner must start in any Python (the vLLM venv
included) without importing torch.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: modules under benchmarks/ that are parts of the entries, not entries themselves
HELPERS = (
    "benchmarks/__init__.py",
    "benchmarks/__main__.py",
    "benchmarks/registry.py",
    "benchmarks/runner.py",
    "benchmarks/common.py",
    "benchmarks/bench_core.py",
    "benchmarks/bench_sections.py",
    "benchmarks/peers.py",
    "benchmarks/prologue_sweep.py",
    "benchmarks/probes/__init__.py",
)


@dataclass(frozen=True)
class Benchmark:
    """One runnable benchmark.

    ``module``: run as ``python -m MODULE`` (the package's modules), or ``script``: run as
    ``python SCRIPT`` (a path from the repository root, for the scripts an engine or a remote
    job starts by path; they import nothing of the package at their top). ``smoke``: the
    arguments of its CPU smoke, which checks at least one row and exits non-zero otherwise.
    ``needs``: what the smoke needs beyond the main test environment ("vllm": vLLM importable;
    "aiter": AITER's source carried in ``.peers/aiter``); ``interpreter``: the smoke runs under
    ``TRITON_INTERPRET=1`` (the runner sets it); ``timeout``: seconds a smoke may take.
    """

    name: str
    kind: str  # "kernel", "layer", "probe", "peer", "compile", "engine" or "tool"
    what: str
    module: str | None = None
    script: str | None = None
    smoke: tuple[str, ...] = ("--smoke",)
    needs: tuple[str, ...] = ()
    interpreter: bool = True
    timeout: int = 300
    results: str = ""  # where its committed results lie (glob under benchmarks/results/)

    @property
    def target(self) -> str:
        """What runs: the module's name or the script's path."""
        return self.module or str(self.script)

    @property
    def path(self) -> Path:
        """The file that runs."""
        if self.script:
            return ROOT / self.script
        return ROOT / (self.module.replace(".", "/") + ".py")

    def command(self, python: str, args: tuple[str, ...] | list[str] = ()) -> list[str]:
        """The command line that runs it with ``python`` and ``args``."""
        head = ["-m", self.module] if self.module else [str(self.path)]
        return [python, *head, *args]


BENCHMARKS = (
    Benchmark(
        "bench_prologue",
        "kernel",
        "the fused decode prologue against the engine's 4 kernels, torch.compile, cuBLAS, "
        "floors, PDL chains, mixed batches, the tile sweep, AITER (--aiter)",
        module="benchmarks.bench_prologue",
        timeout=600,
        results="h200_prologue.json, h200_rows_*, h200_sweep_*, h200_pdl_chain.json",
    ),
    Benchmark(
        "bench_epilogue",
        "kernel",
        "the fused decode epilogue (W_UV into o_proj's input, bf16 or FP8 + group scales) "
        "against cuBLAS bmm (+ vLLM's per_token_group_quant_fp8), the tile sweep",
        module="benchmarks.bench_epilogue",
        results="h200_epilogue_*.json",
    ),
    Benchmark(
        "bench_mla_layer",
        "layer",
        "MLAAttention's decode step, fused vs unfused prologue, same attention",
        module="benchmarks.bench_mla_layer",
        results="h200_mla_layer.json",
    ),
    Benchmark(
        "layout_probe",
        "probe",
        "weight layout (L-contiguous / K-major) x format, fusemla and AITER, small tile grid",
        module="benchmarks.probes.layout_probe",
        results="h200_layout_probe_*.json, h200_swap_probe_*.json",
    ),
    Benchmark(
        "stored_views_probe",
        "probe",
        "a block-FP8 checkpoint's codes read in place (views of kv_b_proj) vs copies, both kernels",
        module="benchmarks.probes.stored_views_probe",
        results="h100_stored_views_probe_*.json",
    ),
    Benchmark(
        "stage_probe",
        "probe",
        "the kernel with parts of its grid left out (BMM only, RoPE + cache only), read floor",
        module="benchmarks.probes.stage_probe",
        results="h200_stage_probe_*.json",
    ),
    Benchmark(
        "epilogue_stages",
        "probe",
        "the epilogue kernel beside variants that leave stages out (the split's meeting and "
        "finishing, everything but the launch), other SPLITs: where its small-batch time goes",
        module="benchmarks.probes.epilogue_stages",
        results="h200_epilogue_stages_*.json",
    ),
    Benchmark(
        "ncu_prologue",
        "probe",
        "each variant launched once in a cudaProfilerStart/Stop range for Nsight Compute "
        "(smoke: every variant checked, the profiled range skipped)",
        module="benchmarks.probes.ncu_prologue",
        results="h200_ncu_*",
    ),
    Benchmark(
        "aiter_peer",
        "peer",
        "AMD AITER's fused FP8 prologue kernel on our inputs, against its reference",
        script="benchmarks/aiter_peer.py",
        needs=("aiter",),
        results="h200_aiter_*.json",
    ),
    Benchmark(
        "targets",
        "compile",
        "the prologue and epilogue kernels compiled for sm_90, sm_100, gfx942, gfx950 without "
        "their hardware",
        script="benchmarks/targets.py",
        interpreter=False,
        results="targets_*",
    ),
    Benchmark(
        "bench_vllm",
        "engine",
        "vLLM's decode step, plugin off / on / FP8: TPOT and GPU time per kernel category",
        script="benchmarks/bench_vllm.py",
        needs=("vllm",),
        interpreter=False,
        timeout=600,
        results="h200_vllm*_bench_*.json",
    ),
    Benchmark(
        "vllm_depth",
        "engine",
        "the decode step at full depth: LLM.generate with vLLM's defaults, one engine at a time",
        script="benchmarks/vllm_depth.py",
        needs=("vllm",),
        interpreter=False,
        timeout=600,
        results="h200_vllm033_depth_*.json",
    ),
    Benchmark(
        "flashmla_graphs",
        "engine",
        "vLLM's own FLASHMLA decode under full CUDA graphs vs eager vs another backend",
        script="benchmarks/flashmla_graphs.py",
        needs=("vllm",),
        interpreter=False,
        timeout=600,
    ),
    Benchmark(
        "summarize",
        "tool",
        "the README's tables (markdown) from results JSON",
        script="benchmarks/summarize.py",
        interpreter=False,
        timeout=60,
    ),
)


# ------------------------------------------------------------------------------ needs


def aiter_dir() -> Path:
    """Where the AITER peer's source is carried (``aiter_peer.PEER_DIR``'s rule)."""
    return Path(os.environ.get("AITER_PEER_DIR", ROOT / ".peers" / "aiter"))


def missing(need: str, python: str) -> str | None:
    """None when ``need`` is met for ``python``, else the reason to skip."""
    if need == "vllm":
        if python == sys.executable:
            found = importlib.util.find_spec("vllm") is not None
        else:
            code = "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"
            try:
                found = subprocess.run([python, "-c", code], capture_output=True).returncode == 0
            except OSError:  # no such python
                found = False
        return None if found else f"needs vLLM (not importable in {python})"
    if need == "aiter":
        if (aiter_dir() / "COMMIT").is_file():
            return None
        return (
            f"needs AITER's source in {aiter_dir()} (git-ignored, never committed; "
            "carry '.peers' to the machine)"
        )
    raise ValueError(f"unknown need {need!r}")
