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
from dataclasses import dataclass, field
from typing import Any

#: dims for the interpreter run (no GPU): small enough to finish in about a second
SMALL_DIMS = {"H": 4, "P": 32, "R": 16, "L": 64}
CPU_BATCHES = (1, 3, 16)
GPU_HEADS = (128, 16)  # DeepSeek-V3 with all heads, and one tensor-parallel shard (TP=8)
GPU_BATCHES = (1, 64, 512)
#: the authoritative timing (CUDA graphs, cold L2, many shapes); the demo's timing is a glance
BENCH_SCRIPT = "benchmarks/bench_decode_prologue.py"

_KERNEL_MODULE = "fusemla.ops.decode_prologue"


# --------------------------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------------------------


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception as exc:  # noqa: BLE001 - report any import failure as the version
        return f"not importable ({type(exc).__name__}: {exc})"
    return str(getattr(mod, "__version__", "unknown"))


def info_lines() -> list[str]:
    """What ``fusemla info`` prints: versions, the accelerator, the Triton mode."""
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
    lines.append("TRITON_INTERPRET: " + ("not set" if interp is None else repr(interp)))
    return lines


def cmd_info(args: argparse.Namespace) -> int:
    for line in info_lines():
        print(line)
    return 0


# --------------------------------------------------------------------------------------------
# comparison (kept free of Triton so the tests can call it on any tensors)
# --------------------------------------------------------------------------------------------


@dataclass
class Comparison:
    """Result of :func:`compare`: numbers worth printing, and what disagreed (empty = agreed)."""

    metrics: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# relative L2 error vs the float64 model: one rounding of the output + bf16/fp16 operands
REL_TOL = {"bfloat16": 8e-3, "float16": 1e-3}
# an FP8 e4m3 value is within 2^-4 (half an ulp at 3 mantissa bits) of what it rounds
FP8_REL_TOL = 2.0 ** -4


def _rel_err(x, ref) -> float:
    x, ref = x.double().cpu(), ref.double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def _scale_value(scale) -> float:
    import torch

    if isinstance(scale, torch.Tensor):
        return float(scale.float().cpu().reshape(-1)[0])
    return 1.0 if scale is None else float(scale)


def _rope_magnitude(x, cos, sin, is_neox: bool):
    """Per output element, an upper bound of sum |term| of RoPE's two products (fp32)."""
    import torch

    x = x.abs().float()
    half = x.shape[-1] // 2
    w = cos.abs().float() + sin.abs().float()
    if is_neox:
        m = (x[..., :half] + x[..., half:]) * w
        return torch.cat([m, m], dim=-1)
    m = (x[..., 0::2] + x[..., 1::2]) * w
    return torch.stack([m, m], dim=-1).flatten(-2)


def _fp8_ordinal(codes):
    """FP8 bytes -> integers in value order (+0 and -0 both 0; adjacent values differ by 1).

    Valid for both e4m3 formats: sign-magnitude with the sign in bit 7.
    """
    c = _bits(codes).int()
    mag = c & 0x7F
    return mag.where(c < 0x80, -mag)


def _bits(x):
    """The raw bits of a tensor, as integers of the same width."""
    import torch

    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _within_ulp(got, want, dtype, slack):
    """Elementwise: |got - want| <= 1 ulp of the larger, plus ``slack`` (False for NaN)."""
    import torch

    got, want = got.float(), want.float()
    fi = torch.finfo(dtype)
    bound = fi.eps * torch.maximum(got.abs(), want.abs()) + fi.tiny + slack
    return (got - want).abs() <= bound


def compare(inp, q, q_ref, cache, cache_ref, cache_before, *, is_neox: bool = False
            ) -> Comparison:
    """Check the fused result (``q``, ``cache``) against the reference (``q_ref``, ``cache_ref``).

    ``inp`` is the :class:`fusemla.testing.PrologueInputs` both ran on (before: ``cache_before``).
    Agreement means:

    - q: no NaN, and every value within 1 ulp of the reference's (plus the fp32 accumulation
      error bound ``2 * K * 2^-24 * sum|products|``, which only matters under cancellation);
      relative L2 error vs the float64 model below ``REL_TOL``.
    - cache rows of the valid slots: bf16/fp16 within 1 ulp of the reference's (the latent part
      bit-equal); FP8 codes equal or one code apart; dequantized rows close to the float64 model.
    - every other cache row byte-identical to ``cache_before``.
    """
    import torch

    from fusemla.testing import prologue_model_f64

    res = Comparison()
    m, problems = res.metrics, res.problems
    dtype = inp.q_nope.dtype
    B, H, P = inp.q_nope.shape
    L = inp.kv_c.shape[1]
    R = inp.q_pe.shape[-1]
    if tuple(q.shape) != (B, H, L + R) or q.dtype != dtype:
        problems.append(f"q has shape {tuple(q.shape)} {q.dtype}, expected {(B, H, L + R)} {dtype}")
        return res
    q64, rows64 = prologue_model_f64(inp, is_neox)

    # ---- q ----------------------------------------------------------------------------------
    qc, qr = q.detach().float().cpu(), q_ref.detach().float().cpu()
    n_nan = int(torch.isnan(qc).sum())
    if n_nan:
        problems.append(f"q: {n_nan} of {qc.numel()} values are NaN (not written?)")
    diff = (qc - qr).abs().nan_to_num(nan=float("inf"))
    m["q_max_abs_diff"] = float(diff.max()) if diff.numel() else 0.0
    # fp32 accumulation error bound, from the magnitudes of the summed products
    acc = 2.0 ** -24
    s_nope = torch.bmm(inp.q_nope.abs().float().transpose(0, 1),
                       inp.w_uk_t.abs().float()).transpose(0, 1).cpu()
    pos = inp.positions.long().clamp(0, inp.cos_cache.shape[0] - 1)
    cos, sin = inp.cos_cache[pos].float(), inp.sin_cache[pos].float()
    s_rope = _rope_magnitude(inp.q_pe, cos[:, None], sin[:, None], is_neox).cpu()
    slack = torch.cat([2 * P * acc * s_nope, 4 * acc * s_rope], dim=-1)
    bad = ~_within_ulp(qc, qr, dtype, slack)
    n_bad = int(bad.sum()) - n_nan
    if n_bad > 0:
        problems.append(f"q: {n_bad} of {qc.numel()} values differ from the reference by more "
                        f"than 1 ulp (max |fused - ref| = {m['q_max_abs_diff']:.3g})")
    tol = REL_TOL.get(str(dtype).replace("torch.", ""), 8e-3)
    for part, sl in (("nope", slice(0, L)), ("rope", slice(L, L + R))):
        m[f"q_rel_{part}"] = _rel_err(qc[..., sl], q64[..., sl])
        m[f"q_rel_{part}_ref"] = _rel_err(qr[..., sl], q64[..., sl])
        if not m[f"q_rel_{part}"] < tol:
            problems.append(f"q[..., {part}]: relative L2 error vs float64 "
                            f"{m[f'q_rel_{part}']:.3g} >= {tol:g}")

    # ---- cache ------------------------------------------------------------------------------
    width = cache.shape[-1]
    flat = cache.reshape(-1, width).cpu()
    flat_ref = cache_ref.reshape(-1, width).cpu()
    flat_before = cache_before.reshape(-1, width).cpu()
    n_rows = flat.shape[0]
    slots_all = inp.slot_mapping.long().cpu()
    valid = (slots_all >= 0) & (slots_all < n_rows)
    slots = slots_all[valid]
    written = torch.zeros(n_rows, dtype=torch.bool)
    written[slots] = True
    m["rows_valid"] = int(slots.numel())
    m["rows_padding"] = int((~valid).sum())
    stray = (flat[~written].view(torch.uint8) != flat_before[~written].view(torch.uint8))
    n_stray = int(stray.any(dim=-1).sum())
    if n_stray:
        problems.append(f"cache: {n_stray} rows outside the valid slots were modified")
    fp8 = cache.element_size() == 1
    m["cache_kind"] = "fp8" if fp8 else "float"
    if slots.numel() == 0:
        m["rows_agree"] = 0
        return res
    got, want = flat[slots], flat_ref[slots]
    ref_rows = rows64[valid]
    if fp8:
        scale = _scale_value(inp.kv_scale)
        if torch.isnan(got.float()).any():
            problems.append("cache: NaN codes in written rows (not written?)")
        step = (_fp8_ordinal(got) - _fp8_ordinal(want)).abs()
        row_ok = (step <= 1).all(dim=-1) & ~torch.isnan(got.float()).any(dim=-1)
        m["fp8_codes_equal"] = int((step == 0).sum())
        m["fp8_codes_off_by_one"] = int((step == 1).sum())
        m["fp8_codes_total"] = int(step.numel())
        fmax = torch.finfo(cache.dtype).max * scale
        m["cache_rel"] = _rel_err(got.float() * scale, ref_rows.clamp(-fmax, fmax))
        cache_tol = FP8_REL_TOL
    else:
        k_pe = inp.k_pe.reshape(B, -1)
        s_k = _rope_magnitude(k_pe, cos, sin, is_neox).cpu()[valid]
        slack = torch.cat([torch.zeros(s_k.shape[0], L), 4 * acc * s_k], dim=-1)
        ok = _within_ulp(got, want, cache.dtype, slack)
        ok[:, :L] = _bits(got[:, :L]) == _bits(want[:, :L])  # the latent part is a plain copy
        row_ok = ok.all(dim=-1)
        m["cache_rel"] = _rel_err(got, ref_rows)
        cache_tol = REL_TOL.get(str(cache.dtype).replace("torch.", ""), 8e-3)
    m["rows_agree"] = int(row_ok.sum())
    n_bad_rows = int((~row_ok).sum())
    if n_bad_rows:
        what = "more than 1 FP8 code" if fp8 else "more than 1 ulp (or latent part not exact)"
        first = int(slots[~row_ok][0])
        problems.append(f"cache: {n_bad_rows} of {slots.numel()} written rows differ from the "
                        f"reference by {what} (first: slot {first})")
    if not m["cache_rel"] < cache_tol:
        problems.append(f"cache: relative L2 error of the written rows vs float64 "
                        f"{m['cache_rel']:.3g} >= {cache_tol:g}")
    return res


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
        is_interp = type(mod.mla_decode_prologue_kernel).__name__ == "InterpretedFunction"
        if is_interp != want_interp:
            have = "the interpreter" if is_interp else "the compiler"
            raise RuntimeError(f"{_KERNEL_MODULE} was already imported for {have} in this "
                               "process; run the demo in a fresh process")


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


def _label(H: int, B: int, kv_name: str) -> str:
    return f"H={H} B={B} {kv_name} cache"


def run_case(B: int, dims: dict, kv_dtype, device: str, seed: int, timed: bool) -> CaseResult:
    """Run fused and reference on identical poisoned caches, compare, and (GPU) time both."""
    import torch

    from fusemla.ops.decode_prologue import mla_decode_prologue
    from fusemla.reference import mla_decode_prologue_ref
    from fusemla.testing import make_inputs

    kv_name = "bf16" if kv_dtype is None else "fp8e4m3"
    label = _label(dims["H"], B, kv_name)
    g = torch.Generator().manual_seed(seed)
    inp = make_inputs(B, **dims, dtype=torch.bfloat16, kv_dtype=kv_dtype,
                      pad_fraction=0.1 if B > 1 else 0.0, device=device, generator=g)
    cache_before = inp.kv_cache.clone()
    cache_ref = inp.kv_cache.clone()
    ref_args = list(inp.args())
    ref_args[8] = cache_ref

    def fused(out=None):
        return mla_decode_prologue(*inp.args(), kv_scale=inp.kv_scale, out=out)

    def reference(out=None):
        return mla_decode_prologue_ref(*ref_args, kv_scale=inp.kv_scale, out=out)

    t0 = time.perf_counter()
    q = fused()
    if device == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    q_ref = reference()
    if device == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    result = CaseResult(label, compare(inp, q, q_ref, inp.kv_cache, cache_ref, cache_before))
    if not timed:
        result.time_fused, result.time_ref, result.timing = t1 - t0, t2 - t1, "interpreter"
    elif result.comparison.ok:
        # rewriting the same rows with the same values: the checked results stay valid
        q_buf, q_ref_buf = torch.empty_like(q), torch.empty_like(q_ref)
        result.time_fused, how = _gpu_time_ms(lambda: fused(q_buf))
        result.time_ref, how_ref = _gpu_time_ms(lambda: reference(q_ref_buf))
        result.timing = how if how == how_ref else f"{how}/{how_ref}"
    return result


def _format_row(r: CaseResult) -> str:
    m = r.comparison.metrics
    if "q_max_abs_diff" not in m:
        return f"  {r.label:<26} {'; '.join(r.comparison.problems)}"
    if m.get("cache_kind") == "fp8":
        rows = (f"{m['rows_agree']}/{m['rows_valid']} rows, codes "
                f"{m.get('fp8_codes_equal', 0)} equal, {m.get('fp8_codes_off_by_one', 0)} +-1")
    else:
        rows = f"{m['rows_agree']}/{m['rows_valid']} rows <= 1 ulp"
    text = (f"  {r.label:<26} {m['q_max_abs_diff']:9.2e}  "
            f"{m['q_rel_nope']:.1e}/{m['q_rel_rope']:.1e}{'':<2}  "
            f"{m.get('cache_rel', float('nan')):.1e}  {rows:<36}")
    if r.time_fused is not None and r.timing == "interpreter":
        text += f" {r.time_fused:.2f}s / {r.time_ref:.3f}s"
    elif r.time_fused is not None:
        text += (f" {r.time_fused * 1e3:8.1f} {r.time_ref * 1e3:8.1f}"
                 f"  x{r.time_ref / r.time_fused:.2f} ({r.timing})")
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
        batches = GPU_BATCHES
    else:
        print(f"fusemla demo: {why} - running the Triton interpreter on the CPU at small dims")
        dim_sets = [dict(SMALL_DIMS)]
        batches = CPU_BATCHES
    import triton

    dims_txt = ", ".join(f"{k}={v}" for k, v in dim_sets[0].items() if k != "H")
    heads = "/".join(str(d["H"]) for d in dim_sets)
    print(f"torch {torch.__version__}, triton {triton.__version__}; bf16 activations, "
          f"interleaved RoPE; H={heads}, {dims_txt}; seed {args.seed}; "
          "~10% of tokens padded (slot -1)")
    print("fused = fusemla.mla_decode_prologue (one Triton launch), "
          "ref = fusemla.mla_decode_prologue_ref (unfused PyTorch)")
    header = (f"  {'case':<26} {'q max|f-r|':>9}  {'q relL2 nope/rope':<17}  "
              f"{'cacheL2':<7}  {'cache rows vs ref':<36}")
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
            for B in batches:
                seed += 1
                try:
                    r = run_case(B, dims, kv, device, seed, timed=device == "cuda")
                except Exception as exc:  # noqa: BLE001 - a crash is a disagreement
                    traceback.print_exc()
                    kv_name = "bf16" if kv is None else "fp8e4m3"
                    r = CaseResult(_label(dims["H"], B, kv_name),
                                   Comparison(problems=[f"raised {type(exc).__name__}: {exc}"]))
                results.append(r)
                print(_format_row(r), flush=True)

    failed = [r for r in results if not r.comparison.ok]
    if device == "cuda":
        print("timing: median per call (CUDA-graph replay where capture works, else eager "
              f"incl. Python overhead); a glance only - {BENCH_SCRIPT} is the authoritative "
              "measure")
    else:
        print("timing: none - the interpreter's wall time says nothing about GPU speed; "
              f"{BENCH_SCRIPT} on a GPU is the authoritative measure")
    if failed:
        print(f"DISAGREEMENT in {len(failed)} of {len(results)} cases:")
        for r in failed:
            for p in r.comparison.problems:
                print(f"  {r.label}: {p}")
        return 1
    print(f"all {len(results)} cases agree: q within 1 ulp of the reference, cache rows within "
          "1 ulp (bf16) / 1 code (fp8), other rows untouched")
    return 0


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fusemla", description="Fused MLA decode prologue for DeepSeek models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo", help="run the fused prologue against the reference and report agreement",
        description="Fused vs unfused prologue: DeepSeek-V3 dims on a GPU, small dims through "
                    "the Triton interpreter without one. Exit 0 if all agreed, 1 if not.")
    demo.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                      help="auto: the GPU if there is one, else the CPU interpreter")
    demo.add_argument("--seed", type=int, default=0, help="random seed for the inputs")
    demo.set_defaults(func=cmd_demo)
    info = sub.add_parser("info", help="versions, the accelerator, the Triton mode")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args))
