"""Command line: ``fusemla demo`` (fused prologue vs the unfused reference) and ``fusemla info``.

``python -m fusemla demo`` picks the device first: with a GPU it runs DeepSeek-V3 dims compiled
for the GPU; without one it sets ``TRITON_INTERPRET=1`` *before* the kernel module is imported
(Triton picks interpreter or compiler when a kernel is decorated) and runs small dims through
the Triton interpreter on the CPU. Exit code 0 when the fused results agree with the reference,
1 when something disagreed, 2 on a usage error.

Torch and Triton are imported inside the functions, so ``import fusemla.cli`` stays cheap.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - the CLI imports torch only when a command needs it
    from fusemla.testing import Comparison

#: dims for the interpreter run (no GPU): small enough to finish in about a second
CPU_BATCHES = (1, 3, 16)
GPU_HEADS = (128, 16)  # DeepSeek-V3 with all heads, and one tensor-parallel shard (TP=8)
GPU_BATCHES = (1, 64, 512)
#: (tokens, decode tokens) of the mixed decode + prefill batch each run also checks
CPU_MIXED = (20, 6)
GPU_MIXED = (544, 32)
#: the authoritative timing (CUDA graphs, cold L2, many shapes); the demo's timing is a glance
BENCH_SCRIPT = "benchmarks/bench_prologue.py"

_KERNEL_MODULE = "fusemla.ops.prologue.kernel"


# --------------------------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------------------------


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception as exc:  # noqa: BLE001 - report any import failure as the version
        return f"not importable ({type(exc).__name__}: {exc})"
    return str(getattr(mod, "__version__", "unknown"))


def info_lines(all_env: bool = False) -> list[str]:
    """What ``fusemla info`` prints: versions, the accelerator, the Triton mode, the platform."""
    from fusemla import __version__

    lines = [
        f"fusemla {__version__}",
        f"python {platform.python_version()} ({sys.executable})",
        f"torch {_version('torch')}",
        f"triton {_version('triton')}",
    ]
    try:
        import torch

        hip = getattr(torch.version, "hip", None)
        cuda = getattr(torch.version, "cuda", None)
        runtime = f"ROCm/HIP {hip}" if hip else (f"CUDA {cuda}" if cuda else "CPU-only build")
        lines.append(f"torch build: {runtime}")
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            names = ", ".join(torch.cuda.get_device_name(i) for i in range(n))
            kind = "ROCm" if hip else "CUDA"
            lines.append(f"GPU: {kind} available, {n} device(s): {names}")
        else:
            lines.append("GPU: none (CUDA/ROCm not available)")
    except Exception as exc:  # noqa: BLE001
        lines.append(f"GPU: unknown (torch failed: {type(exc).__name__}: {exc})")
    interp = os.environ.get("TRITON_INTERPRET")
    try:
        from fusemla.config import interpreting

        seen = f" (Triton: {'interprets' if interpreting() else 'compiles'})"
    except Exception:  # noqa: BLE001 - info reports, it never fails
        seen = ""
    lines.append("TRITON_INTERPRET: " + ("not set" if interp is None else repr(interp)) + seen)
    # every FUSEMLA_* variable users set, with the value in force (fusemla.envs)
    from fusemla import envs

    lines.append("environment (fusemla.envs; python -m fusemla info --all-env adds the tests'):")
    lines.extend("  " + line for line in envs.report(None if all_env else "library"))
    # what the kernels would see on the default device, and the variants they would pick
    try:
        from fusemla.ops.prologue import policy
        from fusemla.platform import detect, report_lines

        info = detect()
        lines.extend(report_lines(info))
        lines.extend(policy.report_lines(info))
    except Exception as exc:  # noqa: BLE001 - info reports, it never fails
        lines.append(f"platform: unknown (detection failed: {type(exc).__name__}: {exc})")
        return lines
    try:
        lines.extend(plan_lines(info))
    except Exception as exc:  # noqa: BLE001
        lines.append(f"  launch plan: unknown ({type(exc).__name__}: {exc})")
    return lines


def plan_lines(info) -> list[str]:
    """What the launcher would run on the default device at DeepSeek-V3 dims (16 heads), per
    weight format and decode batch: the plan function's answer (:func:`launch.plan`), the one
    place that decides it."""
    import torch

    from fusemla import quant
    from fusemla.contracts.prologue import prepare
    from fusemla.ops.prologue import launch

    if info.backend == "cpu":
        return ["  launch plan: none (no Triton backend here: the PyTorch fallback runs)"]
    dev = torch.device("cuda") if info.backend in ("cuda", "rocm") else torch.device("cpu")
    H, P, R, L = 16, 128, 64, 512
    w = torch.randn(H, P, L, device=dev).to(torch.bfloat16)
    weights = {"bf16": w, "fp8": quant.quantize_fp8_weight(w, dtype=info.fp8_dtype)}
    out = [f"  launch plan at H={H}, P={P}, R={R}, L={L} (fusemla.ops.prologue.launch.plan):"]
    for name, wt in weights.items():
        for n in (1, 64, 512):
            e = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16, device=dev)  # noqa: E731
            cos = torch.empty(4096, R // 2, device=dev)
            idx = torch.zeros(n, dtype=torch.int64, device=dev)
            try:
                args = prepare(
                    e(n, H, P), e(n, H, R), e(n, L), e(n, R), wt, idx, cos, cos,
                    e(8, 64, L + R), idx, num_decode_tokens=n,
                )  # fmt: skip
                pl = launch.plan(args, info)
                c = pl.cfg
                out.append(
                    f"    {name} weights, {n:>3} decode tokens: {pl.bucket} tiles "
                    f"BLOCK_L={c['BLOCK_L']} BLOCK_T={c['BLOCK_T']} warps={c['num_warps']} "
                    f"stages={c['num_stages']}, grid {pl.grid[0]}, PDL {'on' if pl.pdl else 'off'}"
                )
            except Exception as exc:  # noqa: BLE001 - info reports, it never fails
                out.append(f"    {name} weights, {n} decode tokens: error: {exc}")
    return out + epilogue_plan_lines(info, dev)


#: the token counts `fusemla info` shows the epilogue's plan at: one, a few (the GEMV rule's
#: multi-row tiles on CUDA), and one of each larger bucket
EPILOGUE_INFO_TOKENS = (1, 4, 64, 512)


def epilogue_plan_lines(info, dev) -> list[str]:
    """The epilogue's plan (:func:`fusemla.ops.epilogue.launch.plan`) at DeepSeek-V3 dims
    (16 heads), for bf16 and block-FP8 W_UV, bf16 and FP8 outputs, per batch size."""
    import torch

    from fusemla import quant
    from fusemla.contracts.epilogue import prepare
    from fusemla.ops.epilogue import launch

    H, P, L, V = 16, 128, 512, 128
    kv_b = torch.zeros(H * (P + V), L, device=dev).to(info.fp8_dtype)
    scales = torch.ones(H * (P + V) // 128, L // 128, device=dev)
    _, w_block = quant.split_kv_b_proj_fp8(
        kv_b, scales, num_heads=H, qk_nope_head_dim=P, v_head_dim=V
    )
    weights = {"bf16": torch.empty(H, L, V, dtype=torch.bfloat16, device=dev), "fp8-block": w_block}
    out = [f"  epilogue plan at H={H}, L={L}, V={V} (fusemla.ops.epilogue.launch.plan):"]
    for name, wt in weights.items():
        for out_dtype in (None, info.fp8_dtype):
            for n in EPILOGUE_INFO_TOKENS:
                kind = "bf16 out" if out_dtype is None else "fp8 out"
                try:
                    x = torch.empty(n, H, L, dtype=torch.bfloat16, device=dev)
                    pl = launch.plan(prepare(x, wt, out_dtype=out_dtype), info)
                    c, k = pl.cfg, pl.constexprs
                    # the products: the tensor cores' (MMA) or the CUDA cores' (GEMV), a
                    # multi-row GEMV tile's rows in turn; the latent's split where there is one
                    form = "GEMV rows" if k["GEMV_ROWS"] else "GEMV" if k["GEMV"] else "MMA"
                    form += f" SPLIT={k['SPLIT']}" if k["SPLIT"] > 1 else ""
                    out.append(
                        f"    {name} W_UV, {kind}, {n:>3} tokens: {pl.bucket} tiles "
                        f"BLOCK_T={c['BLOCK_T']} BLOCK_V={c['BLOCK_V']} BLOCK_K={c['BLOCK_K']} "
                        f"warps={c['num_warps']} {form}, grid {pl.grid[0]}, "
                        f"PDL {'on' if pl.pdl else 'off'}"
                    )
                except Exception as exc:  # noqa: BLE001 - info reports, it never fails
                    out.append(f"    {name} W_UV, {kind}, {n} tokens: error: {exc}")
    # where the vLLM plugin runs the epilogue (measured faster in vLLM: configs._FUSE_TOKENS)
    from fusemla.ops.epilogue.configs import describe_spans, fuse_token_spans

    parts = [
        f"{h} heads {kind}{', stored W_UV' if w else ''} "
        f"{describe_spans(fuse_token_spans(h, kind == 'fp8 out', 'cuda', w))}"
        for h in (16, 128)
        for kind in ("bf16 out", "fp8 out")
        for w in (False, True)
    ]
    out.append(
        "  epilogue in vLLM, fused on steps of (tokens; CUDA and ROCm; "
        "FUSEMLA_VLLM_EPILOGUE_TOKENS=measured; elsewhere vLLM's bmm; where both W_UV say "
        "none, the layer runs as with the epilogue off): " + ", ".join(parts)
    )
    return out


def cmd_info(args: argparse.Namespace) -> int:
    for line in info_lines(all_env=getattr(args, "all_env", False)):
        print(line)
    return 0


# --------------------------------------------------------------------------------------------
# demo
# --------------------------------------------------------------------------------------------


def select_device(requested: str) -> tuple[str, str]:
    """('cuda' | 'cpu', why). Imports torch, never Triton. Raises ValueError for an impossible ask."""
    import torch

    has_gpu = torch.cuda.is_available()
    if requested == "cuda":
        if not has_gpu:
            raise ValueError("--device cuda, but torch sees no CUDA/ROCm GPU")
        return "cuda", "--device cuda"
    if requested == "cpu":
        return "cpu", "--device cpu" if has_gpu else "no GPU found"
    from fusemla import config

    if has_gpu and config.interpreting():
        return "cpu", "TRITON_INTERPRET is set"
    return ("cuda", "GPU found") if has_gpu else ("cpu", "no GPU found")


def prepare_triton(device: str) -> None:
    """Set TRITON_INTERPRET for ``device`` before the kernel module is imported.

    Raises RuntimeError when the kernel module was already imported in the other mode (it can
    only happen when :func:`main` is called inside a process that already used the kernels).
    """
    want_interp = device == "cpu"
    if want_interp:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    mod = sys.modules.get(_KERNEL_MODULE)
    if mod is not None:
        kernel = mod.mla_prologue_kernel
        kernel = getattr(kernel, "fn", kernel)  # under the heuristics wrapper
        is_interp = type(kernel).__name__ == "InterpretedFunction"
        if is_interp != want_interp:
            have = "the interpreter" if is_interp else "the compiler"
            raise RuntimeError(
                f"{_KERNEL_MODULE} was already imported for {have} in this "
                "process; run the demo in a fresh process"
            )


def _gpu_time_ms(fn: Callable[[], Any], reps_per_graph: int = 20) -> tuple[float, str]:
    """Median time of one call: CUDA-graph replay of ``reps_per_graph`` calls, else eager."""
    import torch
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps_per_graph):
                fn()
        ms = do_bench(graph.replay, return_mode="median") / reps_per_graph
        return ms, "graph"
    except Exception:  # noqa: BLE001 - capture unsupported here: fall back to eager timing
        torch.cuda.synchronize()
        return do_bench(fn, return_mode="median"), "eager"


@dataclass
class CaseResult:
    label: str
    comparison: Comparison
    time_fused: float | None = None  # ms (GPU) or s (interpreter wall time)
    time_ref: float | None = None
    timing: str = ""


def _label(H: int, B: int, kv_name: str, D: int | None = None) -> str:
    split = "" if D is None else f" ({D}d+{B - D}p)"
    return f"H={H} B={B}{split} {kv_name} cache"


def run_case(
    B: int, dims: dict, kv_dtype, device: str, seed: int, timed: bool, D: int | None = None
) -> CaseResult:
    """Run fused and reference on identical poisoned caches, compare, and (GPU) time both.

    ``D``: decode tokens of a mixed batch (the rest prefill); None = all decode."""
    import torch

    from fusemla.ops.prologue.api import mla_prologue
    from fusemla.reference.prologue import mla_prologue_ref
    from fusemla.testing import check_against_reference, make_inputs

    kv_name = "bf16" if kv_dtype is None else "fp8e4m3"
    label = _label(dims["H"], B, kv_name, D)
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(
        B,
        **dims,
        dtype=torch.bfloat16,
        kv_dtype=kv_dtype,
        num_decode_tokens=D,
        pad_fraction=0.1 if B > 1 else 0.0,
        device=device,
        generator=g,
    )
    cache_before = inp.kv_cache.clone()
    cache_ref = inp.kv_cache.clone()

    t0 = time.perf_counter()
    out = inp.run(mla_prologue)
    if device == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    inp.run(mla_prologue_ref, kv_cache=cache_ref)
    if device == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    result = CaseResult(label, check_against_reference(inp, out, cache_before))
    if not timed:
        result.time_fused, result.time_ref, result.timing = t1 - t0, t2 - t1, "interpreter"
    elif result.comparison.ok:
        # rewriting the same rows with the same values: the checked results stay valid
        bufs = dict(
            out=torch.empty_like(out.q),
            q_pe_out=torch.empty_like(out.q_pe),
            k_pe_out=torch.empty_like(out.k_pe),
        )
        result.time_fused, how = _gpu_time_ms(lambda: inp.run(mla_prologue, **bufs))
        result.time_ref, how_ref = _gpu_time_ms(
            lambda: inp.run(mla_prologue_ref, kv_cache=cache_ref, **bufs)
        )
        result.timing = how if how == how_ref else f"{how}/{how_ref}"
    return result


def _format_row(r: CaseResult) -> str:
    m = r.comparison.metrics
    if "q_max_abs_diff" not in m:
        return f"  {r.label:<32} {'; '.join(r.comparison.problems)}"
    if m.get("cache_kind") == "fp8":
        rows = (
            f"{m['rows_agree']}/{m['rows_valid']} rows, "
            f"{m.get('fp8_codes_off_by_one', 0)} codes +-1"
        )
    else:
        rows = f"{m['rows_agree']}/{m['rows_valid']} rows <= 1 ulp"
    text = (
        f"  {r.label:<32} {m['q_max_abs_diff']:9.2e}  "
        f"{m['q_rel_nope']:.1e}/{m['q_rel_rope']:.1e}{'':<2}  "
        f"{m.get('cache_rel', float('nan')):.1e}  {rows:<36}"
    )
    if r.time_fused is not None and r.timing == "interpreter":
        text += f" {r.time_fused:.2f}s / {r.time_ref:.3f}s"
    elif r.time_fused is not None:
        text += (
            f" {r.time_fused * 1e3:8.1f} {r.time_ref * 1e3:8.1f}"
            f"  x{r.time_ref / r.time_fused:.2f} ({r.timing})"
        )
    text += "  OK" if r.comparison.ok else "  DISAGREE"
    return text


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        device, why = select_device(args.device)
        prepare_triton(device)
    except (ValueError, RuntimeError) as exc:
        print(f"fusemla demo: {exc}", file=sys.stderr)
        return 2
    import torch

    if device == "cuda":
        name = torch.cuda.get_device_name()
        kind = "ROCm" if getattr(torch.version, "hip", None) else "CUDA"
        print(f"fusemla demo: {name} ({kind}), DeepSeek-V3 dims")
        from fusemla.testing import DEEPSEEK_V3

        dim_sets = [dict(DEEPSEEK_V3, H=h) for h in GPU_HEADS]
        cases = [(B, None) for B in GPU_BATCHES] + [GPU_MIXED]
    else:
        print(f"fusemla demo: {why} - running the Triton interpreter on the CPU at small dims")
        from fusemla.testing import SMALL_DIMS

        dim_sets = [dict(SMALL_DIMS)]
        cases = [(B, None) for B in CPU_BATCHES] + [CPU_MIXED]
    import triton

    dims_txt = ", ".join(f"{k}={v}" for k, v in dim_sets[0].items() if k != "H")
    heads = "/".join(str(d["H"]) for d in dim_sets)
    print(
        f"torch {torch.__version__}, triton {triton.__version__}; bf16 activations, "
        f"interleaved RoPE; H={heads}, {dims_txt}; seed {args.seed}; "
        "~10% of tokens padded (slot -1)"
    )
    print(
        "fused = fusemla.mla_prologue (one Triton launch per batch; 'Nd+Mp' = N decode + M "
        "prefill tokens), ref = fusemla.mla_prologue_ref (unfused PyTorch)"
    )
    header = (
        f"  {'case':<32} {'q max|f-r|':>9}  {'q relL2 nope/rope':<17}  "
        f"{'cacheL2':<7}  {'cache rows vs ref':<36}"
    )
    if device == "cuda":
        header += f" {'fused us':>8} {'ref us':>8}  speedup"
    else:
        header += " wall fused / ref (interpreter, not a benchmark)"
    print("  (relL2 = relative L2 error vs a float64 model)")
    print(header)

    results: list[CaseResult] = []
    kv_dtypes = (None, torch.float8_e4m3fn)
    seed = args.seed
    for dims in dim_sets:
        for kv in kv_dtypes:
            for B, D in cases:
                seed += 1
                try:
                    r = run_case(B, dims, kv, device, seed, timed=device == "cuda", D=D)
                except Exception as exc:  # noqa: BLE001 - a crash is a disagreement
                    from fusemla.testing import Comparison

                    traceback.print_exc()
                    kv_name = "bf16" if kv is None else "fp8e4m3"
                    r = CaseResult(
                        _label(dims["H"], B, kv_name, D),
                        Comparison(problems=[f"raised {type(exc).__name__}: {exc}"]),
                    )
                results.append(r)
                print(_format_row(r), flush=True)

    print(
        "layer: fusemla.MLAAttention, a few engine steps (decode-first mixed batches, shuffled "
        "paged cache), fused vs unfused (MLAConfig(False, False)); attention in PyTorch"
    )
    layer_problems = []
    from fusemla import demo_layer

    for kv_fp8 in (False, True):
        try:
            lr = demo_layer.run(device, args.seed, kv_fp8)
        except Exception as exc:  # noqa: BLE001 - a crash is a disagreement
            traceback.print_exc()
            lr = demo_layer.LayerDemoResult(problems=[f"raised {type(exc).__name__}: {exc}"])
        for line in lr.lines:
            print(line, flush=True)
        layer_problems += lr.problems

    failed = [r for r in results if not r.comparison.ok]
    if device == "cuda":
        print(
            "timing: median per call (CUDA-graph replay where capture works, else eager "
            f"incl. Python overhead); a glance only - {BENCH_SCRIPT} is the authoritative "
            "measure"
        )
    else:
        print(
            "timing: none - the interpreter's wall time says nothing about GPU speed; "
            f"{BENCH_SCRIPT} on a GPU is the authoritative measure"
        )
    if failed or layer_problems:
        print(
            f"DISAGREEMENT in {len(failed)} of {len(results)} prologue cases and "
            f"{len(layer_problems)} layer steps:"
        )
        for r in failed:
            for p in r.comparison.problems:
                print(f"  {r.label}: {p}")
        for p in layer_problems:
            print(f"  {p}")
        return 1
    print(
        f"all {len(results)} prologue cases agree: q within 1 ulp of the reference, cache rows "
        "within 1 ulp (bf16) / 1 code (fp8), other rows untouched; every layer step agrees"
    )
    return 0


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fusemla", description="Fused MLA decode prologue for DeepSeek models."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="run the fused prologue against the reference and report agreement",
        description="Fused vs unfused prologue: DeepSeek-V3 dims on a GPU, small dims through "
        "the Triton interpreter without one. Exit 0 if all agreed, 1 if not.",
    )
    demo.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: the GPU if there is one, else the CPU interpreter",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed for the inputs")
    demo.set_defaults(func=cmd_demo)
    info = sub.add_parser("info", help="versions, the accelerator, the Triton mode")
    info.add_argument(
        "--all-env", action="store_true", help="also the tests' and benchmarks' variables"
    )
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args))
