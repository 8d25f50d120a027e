"""Compile the prologue kernel for the GPUs users run, on a machine without them (CI: CPU only).

Triton compiles for a target without its hardware. For each target (sm_90, sm_100, gfx942,
gfx950) this script plans a set of launches at DeepSeek-V3 dims (P=128, R=64, L=512, H=16 and
128) with :func:`fusemla.ops.prologue.launch.plan` on that target's
:func:`fusemla.platform.platform_from`, runs the real launcher up to the kernel call, and hands
the call's arguments to Triton's own launch path with ``warmup=True`` under a stand-in driver
that names the target: Triton binds and specializes them, builds the ``ASTSource`` and compiles
it as it would on the device, without launching. No second list of kernel arguments exists.

The variant set covers every pair of factor values (heads x tile bucket, weight format and
layout, activation dtype, cache dtype and its scale, query output, RoPE style, rotation, batch
kind, PDL, index and table dtypes) at least once per target, so every constexpr value the plan
can pick is compiled. A value the library refuses on a target (e4m3fnuz on NVIDIA, a forced
override the chip lacks) is recorded as refused, with the error. Registers, spills and shared
memory come from the binary: ``cuobjdump --dump-resource-usage`` (the one Triton ships) for
cubins, the AMDGCN metadata (``NumVgprs``, ``ScratchSize``, spill counts) for hsaco.

Exit status 1 if a variant the plan picks fails to compile or needs more shared memory than the
target has. Compiled for, not run on: nothing here says the kernel is right or fast there.

Usage (about 270 compiles of 1-3 s each on an idle core; the run prints its timing)::

    python benchmarks/targets.py --out benchmarks/results/targets_triton3.9.0.json \\
        --table benchmarks/results/targets_triton3.9.0.md       # full set, 2 processes
    python benchmarks/targets.py --smoke                          # one variant per target
    python benchmarks/targets.py --targets gfx942 --override num_stages=1   # try a tile change
    python benchmarks/targets.py --render results.json --table results.md   # re-render only
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from unittest import mock

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import commit_id  # noqa: E402

from fusemla import config  # noqa: E402
from fusemla import platform as fplatform  # noqa: E402
from fusemla.contracts.prologue import prepare  # noqa: E402
from fusemla.errors import FuseMLAError  # noqa: E402
from fusemla.ops.prologue import configs  # noqa: E402
from fusemla.ops.prologue import launch as launch_mod  # noqa: E402
from fusemla.quant import MX_BLOCK, QuantizedWeight  # noqa: E402
from fusemla.testing import DEEPSEEK_V3  # noqa: E402
from fusemla.testing.spy import recorded_launch_plans  # noqa: E402

DIMS = {k: DEEPSEEK_V3[k] for k in ("P", "R", "L")}


@dataclass(frozen=True)
class Target:
    name: str
    backend: str  # Triton's: "cuda" or "hip"
    arch: int | str  # GPUTarget's arch: 90, 100, "gfx942", ...
    warp_size: int
    chips: str
    num_sms: int  # for the plan's persistent program count (not a compile input)
    max_shared: int  # bytes a program may use (opt-in maximum); more cannot launch

    @property
    def info(self) -> fplatform.PlatformInfo:
        arch = f"sm_{self.arch}" if self.backend == "cuda" else self.arch
        return fplatform.platform_from(self.backend, arch, self.chips)

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)


TARGETS = {
    t.name: t
    for t in (
        Target("sm_90", "cuda", 90, 32, "NVIDIA H100/H200", 132, 232448),
        Target("sm_100", "cuda", 100, 32, "NVIDIA B200", 148, 232448),
        Target("gfx942", "hip", "gfx942", 64, "AMD MI300X/MI325X", 304, 65536),
        Target("gfx950", "hip", "gfx950", 64, "AMD MI350X/MI355X", 256, 163840),
    )
}

# ------------------------------------------------------------------------------ the variants

#: decode tokens per tile bucket (the bucket's edges come from configs)
BUCKET_D = {
    "small": configs.SMALL_BATCH,
    "medium": (configs.SMALL_BATCH + configs.LARGE_BATCH) // 2,
    "large": configs.LARGE_BATCH,
}
DTYPES = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32, i32=torch.int32)
DTYPES.update(i64=torch.int64, e4m3fn=torch.float8_e4m3fn, e4m3fnuz=torch.float8_e4m3fnuz)
#: weight variants: format[.granularity].layout[.fp8 dtype][+act_quant][@forced MXFP4 path]
#: (layout L: stride 1 along L; K: K-major, stride 1 along P, vLLM's view / FP8's default)
WEIGHTS = tuple(
    """plain.L plain.K fp8.tensor.K.e4m3fn fp8.head.K.e4m3fn fp8.head.L.e4m3fn
    fp8.tensor.L.e4m3fnuz fp8.head.K.e4m3fnuz fp8.head.K.e4m3fn+act_fp8
    fp8.tensor.L.e4m3fn+act_fp8 fp8.head.K.e4m3fnuz+act_fp8 mxfp4 mxfp4@dequant
    mxfp4@dot_scaled""".split()
)
FP8_OUT = ("e4m3fn/float", "e4m3fn/tensor", "e4m3fnuz/float", "e4m3fnuz/tensor")
#: every factor and its values; "cell" is (heads, tile bucket), whose pairs with the weights
#: give every tile table entry (configs.tiles) with every weight variant
FACTORS: dict[str, tuple] = dict(
    cell=tuple(f"H{h}.{b}" for h in (16, 128) for b in BUCKET_D),
    weights=WEIGHTS,
    act=("bf16", "fp16"),
    kv=("bf16", "fp16", *FP8_OUT),
    q_out=("act", *FP8_OUT),
    rope=("gptj", "neox"),
    rope_input=("rotate", "applied"),
    batch=("decode", "mixed"),
    pdl=("auto", "off", "on"),
    index=("i64", "i32"),
    tables=("fp32", "bf16", "fp16"),
)
BASE = {k: v[0] for k, v in FACTORS.items()}


def variant_id(v: dict) -> str:
    return "|".join(f"{k}={v[k]}" for k in FACTORS)


def _weight(H: int, act: str, spec: str):
    """The W_UK_T of weight variant ``spec``, in the layouts fusemla.quant documents (FP8
    K-major: ``[H, L, P]`` storage seen as ``[H, P, L]``); uninitialized: no value reaches the
    compiler."""
    fmt = spec.partition("+")[0].partition("@")[0]
    parts = fmt.split(".")
    P, L = DIMS["P"], DIMS["L"]
    if parts[0] == "mxfp4":
        data = torch.empty(H, P // 2, L, dtype=torch.uint8)
        return QuantizedWeight(data, torch.empty(H, P // MX_BLOCK, L, dtype=torch.uint8), "mxfp4")
    dtype = DTYPES[act] if parts[0] == "plain" else DTYPES[parts[-1]]
    k_major = parts[-1] == "K" if parts[0] == "plain" else parts[2] == "K"
    w = torch.empty(H, *((L, P) if k_major else (P, L)), dtype=dtype)
    w = w.transpose(1, 2) if k_major else w
    if parts[0] == "plain":
        return w
    return QuantizedWeight(w, torch.ones(H if parts[1] == "head" else 1), "fp8")


def _scale(spec: str):
    dtype, _, form = spec.partition("/")
    if dtype in ("bf16", "fp16", "act"):
        return DTYPES.get(dtype), None
    return DTYPES[dtype], torch.tensor([0.5]) if form == "tensor" else 0.5


def prologue_args(v: dict, D: int | None = None):
    """Validated :class:`PrologueArgs` for variant ``v``, laid out as an engine's (q_nope/q_pe
    slices of one q_b_proj output, kv_c/k_pe of one kv_a output): the shapes, dtypes and
    strides a launch sees; the values are never read. ``D``: decode tokens other than the
    cell's bucket's."""
    H, bucket = v["cell"][1:].split(".")
    H, D = int(H), BUCKET_D[bucket] if D is None else D
    N = D + (3 if v["batch"] == "mixed" else 0)
    P, R, L = DIMS["P"], DIMS["R"], DIMS["L"]
    act, idx, tab = DTYPES[v["act"]], DTYPES[v["index"]], DTYPES[v["tables"]]
    q = torch.empty(N, H, P + R, dtype=act)
    kv_a = torch.empty(N, L + R, dtype=act)
    kv_dtype, kv_scale = _scale(v["kv"])
    q_dtype, q_scale = _scale(v["q_out"])
    block_size, max_pos = 64, 4096
    return prepare(
        q[..., :P],
        q[..., P:],
        kv_a[:, :L],
        kv_a[:, L:],
        _weight(H, v["act"], v["weights"]),
        torch.zeros(N, dtype=idx),
        torch.empty(max_pos, R // 2, dtype=tab),
        torch.empty(max_pos, R // 2, dtype=tab),
        torch.empty(N // block_size + 2, block_size, L + R, dtype=kv_dtype),
        torch.zeros(N, dtype=idx),
        num_decode_tokens=D,
        is_neox=v["rope"] == "neox",
        rope_applied=v["rope_input"] == "applied",
        kv_scale=kv_scale,
        q_out_dtype=q_dtype,
        q_scale=q_scale,
        act_quant="fp8" if v["weights"].endswith("+act_fp8") else None,
    )


class _KernelCall:
    """Stands in for the kernel object in the launcher: records ``kernel[grid](**kwargs)``."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda **kwargs: self.calls.append((grid, kwargs))


@dataclass
class Captured:
    plan: launch_mod.LaunchPlan
    grid: tuple
    kwargs: dict  # exactly what the launcher passes to the kernel


def capture(
    target: Target, v: dict, D: int | None = None, overrides: dict | None = None
) -> Captured:
    """Run the real launcher for variant ``v`` as on ``target`` (its platform, its SM count,
    the variant's PDL / MXFP4 path overrides) up to the kernel call; return the plan and the
    call's arguments. Raises what the library raises (a :class:`FuseMLAError` for a refused
    variant). ``overrides``: tile keys forced (:func:`fusemla.ops.prologue.configs.override`)."""
    spy, info = _KernelCall(), target.info
    env = {config.PDL_ENV: v["pdl"], config.MXFP4_PATH_ENV: v["weights"].partition("@")[2]}
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, env))
        stack.enter_context(mock.patch.object(fplatform, "detect", lambda device=None: info))
        stack.enter_context(mock.patch.object(launch_mod, "_num_sms", lambda i: target.num_sms))
        stack.enter_context(mock.patch.object(launch_mod, "mla_prologue_kernel", spy))
        stack.enter_context(configs.override(**(overrides or {})))
        plans = stack.enter_context(recorded_launch_plans())
        launch_mod.launch(prologue_args(v, D))
    ((grid, kwargs),), (pl,) = spy.calls, plans
    return Captured(pl, grid, kwargs)


def pairwise(factors: dict[str, tuple]) -> list[dict]:
    """A deterministic greedy covering array: rows (dicts) such that every pair of values of
    two factors appears in some row. Each row starts from the first uncovered pair and takes,
    factor by factor, the value covering most uncovered pairs with the values already chosen
    (ties: the value used least so far, then the first)."""
    names = list(factors)
    pairs = [
        frozenset({(a, x), (b, y)})
        for a, b in itertools.combinations(names, 2)
        for x in factors[a]
        for y in factors[b]
    ]
    todo, rows = set(pairs), []
    used = {(n, x): 0 for n in names for x in factors[n]}

    def rank(row: dict, n: str, x) -> tuple:
        return (-sum(frozenset({(m, row[m]), (n, x)}) in todo for m in row), used[n, x])

    while todo:
        row = dict(next(p for p in pairs if p in todo))
        for n in names:
            if n not in row:
                row[n] = min(factors[n], key=lambda x: rank(row, n, x))
        todo -= {frozenset(p) for p in itertools.combinations(row.items(), 2)}
        used.update({(n, row[n]): used[n, row[n]] + 1 for n in names})
        rows.append({n: row[n] for n in names})
    return rows


def variant_set(
    target: Target, smoke: bool = False, overrides: dict | None = None
) -> tuple[list[dict], list[dict]]:
    """``(variants, refused)`` for ``target``: each factor value is first tried on the base
    variant; one the library refuses there goes to ``refused`` (with its error) and out of the
    pairwise set built from the others. ``smoke``: the base variant only."""
    if smoke:
        return [dict(BASE)], []
    allowed, refused = {}, []
    for name, values in FACTORS.items():
        allowed[name] = []
        for value in values:
            v = dict(BASE, **{name: value})
            try:
                capture(target, v, overrides=overrides)
            except FuseMLAError as exc:
                refused.append(dict(variant=v, error=f"{type(exc).__name__}: {exc}"))
                continue
            allowed[name].append(value)
    return pairwise({k: tuple(vals) for k, vals in allowed.items()}), refused


# ---------------------------------------------------------------------------- compiling


class _TargetDriver:
    """What Triton's launch path asks of a driver before it compiles, answered for a target
    without its hardware (warmup: compile, never launch)."""

    def __init__(self, target, device: int):
        self.target, self.device = target, device

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device=None):
        return 0


def compiled_kernel():
    """The launcher's kernel object; under the interpreter (``TRITON_INTERPRET=1``, the test
    suite) a compiled-mode copy of its module (and of the helpers it calls), imported apart."""
    from triton import knobs
    from triton.runtime.jit import JITFunction

    kernel = launch_mod.mla_prologue_kernel
    if isinstance(getattr(kernel, "fn", None), JITFunction):
        return kernel
    import importlib

    names = ("fusemla.ops.triton_helpers", "fusemla.ops.prologue.kernel")
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    try:
        with knobs.runtime.scope():
            knobs.runtime.interpret = False
            module = importlib.import_module(names[1])
    finally:
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
        for n, m in saved.items():
            parent, _, leaf = n.rpartition(".")
            setattr(sys.modules[parent], leaf, m)
    return module.mla_prologue_kernel


def compile_for(target: Target, cap: Captured, kernel=None, *, dry: bool = False):
    """Triton's own launch path for the captured call on ``target`` with ``warmup=True``:
    binding, specialization, ``ASTSource``, compile (never a launch). Returns the
    CompiledKernel; ``dry`` stops before compiling (Triton's ``jit_cache_hook``) and
    returns what it would compile: ``signature`` (parameter -> Triton type, "constexpr" for a
    constant), ``constants`` (parameter -> value) and ``options``."""
    from triton import knobs
    from triton.runtime import driver

    kernel = kernel or compiled_kernel()
    seen = {}

    def stop(*, compile, **_):
        seen.update(compile)
        return True  # skip the compile

    device = list(TARGETS).index(target.name) if target.name in TARGETS else 99
    previous = driver._active  # None on a machine without a GPU: nothing to create or reset
    previous_hook = knobs.runtime.jit_cache_hook
    driver.set_active(_TargetDriver(target.gpu_target(), device))
    if dry:
        knobs.runtime.jit_cache_hook = stop
    try:
        compiled = kernel.warmup(grid=cap.grid, **cap.kwargs)
    finally:
        driver._active = previous
        knobs.runtime.jit_cache_hook = previous_hook
        kernel.fn.device_caches[device][0].clear()  # the in-memory copy; the disk cache stays
    if not dry:
        return compiled
    names = list(seen["signature"])
    constants = {names[path[0]]: value for path, value in seen["constants"].items()}
    options = json.loads(seen["specialization_data"])["options"]
    return dict(signature=seen["signature"], constants=constants, options=options)


def _cuobjdump() -> str:
    import triton.backends.nvidia as nv

    return os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")


def resources(compiled) -> dict:
    """Registers, spills and shared memory of a compiled kernel, read from its binary."""
    res = dict(shared=int(compiled.metadata.shared))
    if "cubin" in compiled.asm:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            out = subprocess.check_output(
                [_cuobjdump(), "--dump-resource-usage", f.name], text=True
            )
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
        reg, stack, static_shared, local = map(int, m.groups())
        # spills as Triton's n_spills reports them: local memory per thread in 32-bit words
        res.update(regs=reg, spills=local // 4, stack=stack, local_bytes=local)
        res.update(static_shared=static_shared)
        res["arch"] = re.search(r"^\.target (\S+)", compiled.asm["ptx"], re.M).group(1)
    else:
        text = compiled.asm["amdgcn"]

        def field(pattern):
            m = re.search(pattern, text)
            return int(m.group(1)) if m else None

        res.update(
            regs=field(r"; NumVgprs: (\d+)"),
            agprs=field(r"; NumAgprs: (\d+)"),
            sgprs=field(r"; TotalNumSgprs: (\d+)"),
            scratch=field(r"; ScratchSize: (\d+)"),
            occupancy=field(r"; Occupancy: (\d+)"),
        )
        vs, ss = field(r"\.vgpr_spill_count:\s+(\d+)"), field(r"\.sgpr_spill_count:\s+(\d+)")
        res.update(spills=(vs or 0) + (ss or 0), vgpr_spills=vs, sgpr_spills=ss)
        res["arch"] = re.search(r'\.amdgcn_target "([^"]+)"', text).group(1)
    return res


def _specialization(compiled) -> dict:
    """The compiled signature in short: pointer types, and the parameters Triton turned into
    constants at this call (a stride of 1, a None tensor), beyond the declared constexprs."""
    src, params = compiled.src, compiled.src.fn.params
    names = [p.name for p in params]
    fixed = {names[path[0]]: v for path, v in src.constants.items()}
    return dict(
        pointers={k: t for k, t in src.signature.items() if str(t).startswith("*")},
        specialized={k: v for k, v in fixed.items() if not params[names.index(k)].is_constexpr},
    )


def compile_one(target_name: str, v: dict, overrides: dict | None = None) -> dict:
    """One record: the variant compiled for the target (or refused, or failed)."""
    target = TARGETS[target_name]
    rec = dict(target=target_name, variant=v)
    try:
        cap = capture(target, v, overrides=overrides)
    except FuseMLAError as exc:
        return dict(rec, status="refused", error=f"{type(exc).__name__}: {exc}")
    rec["constexprs"] = {k: _json(x) for k, x in cap.plan.constexprs.items()}
    rec["bucket"], rec["tile_format"] = cap.plan.bucket, cap.plan.tile_format
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = compile_for(target, cap)
    except Exception as exc:  # noqa: BLE001 - every compile error is a result to record
        msg = f"{type(exc).__name__}: {exc}"
        return dict(rec, status="failed", error=msg[-2000:], seconds=time.perf_counter() - t0)
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    rec["warnings"] = sorted({str(w.message) for w in caught if "FP_FUSION" not in str(w.message)})
    rec["hash"], rec["resources"] = compiled.hash, resources(compiled)
    rec.update(_specialization(compiled))
    problem = launch_problem(target, rec["resources"])
    return dict(rec, status="failed", error=problem) if problem else dict(rec, status="compiled")


def launch_problem(target: Target, res: dict) -> str | None:
    """Why a kernel that compiled for ``target`` could not launch there, or None."""
    if res["shared"] > target.max_shared:
        return (
            f"needs {res['shared']} bytes of shared memory per program, {target.name} has "
            f"{target.max_shared}: compiles, cannot launch (Triton raises OutOfResources)"
        )
    return None


def _json(x):
    return x if isinstance(x, (bool, int, float, str)) or x is None else str(x)


# ------------------------------------------------------------------------------ reporting


def summary(records: list[dict]) -> list[dict]:
    rows = []
    for name in dict.fromkeys(r["target"] for r in records):
        recs = [r for r in records if r["target"] == name]
        ok = [r for r in recs if r["status"] == "compiled"]
        res = [r["resources"] for r in ok]
        rows.append(
            dict(
                target=name,
                chips=TARGETS[name].chips,
                variants=len(recs),
                compiled=len(ok),
                binaries=len({r["hash"] for r in ok}),
                refused=sum(r["status"] == "refused" for r in recs),
                failed=sum(r["status"] == "failed" for r in recs),
                max_regs=max((x["regs"] for x in res), default=None),
                max_spills=max((x["spills"] for x in res), default=None),
                with_spills=sum(x["spills"] > 0 for x in res),
                max_shared=max((x["shared"] for x in res), default=None),
                shared_limit=TARGETS[name].max_shared,
                compile_s=round(sum(r.get("seconds", 0) for r in recs), 1),
            )
        )
    return rows


def _short(v: dict) -> str:
    rest = [f"{k}={v[k]}" for k in FACTORS if v[k] != BASE[k] and k not in ("cell", "weights")]
    return ", ".join([v["cell"], v["weights"], *rest])


def _note(r: dict) -> str:
    if r["status"] != "compiled":
        return r["error"].replace("|", "/").replace("\n", " ")[:300]
    return "; ".join(w.split(".")[0] for w in r.get("warnings", []))[:200]


def table(doc: dict) -> str:
    h = doc["header"]
    out = [
        f"# Prologue kernel compiled for GPU targets (Triton {h['triton']})",
        "",
        f"Compiled for, not run on: `{h['command']}` on a CPU-only machine (Triton "
        f"{h['triton']}, torch {h['torch']}, commit {h['commit'][:12]}, {h['date']}, "
        f"{h['wall_s']} s wall, {h['jobs']} processes). DeepSeek-V3 dims (P={DIMS['P']}, "
        f"R={DIMS['R']}, L={DIMS['L']}). regs: per thread (NVIDIA, cuobjdump) or VGPRs (AMD, "
        "NumVgprs); spills: local memory in 32-bit words (NVIDIA, as Triton's n_spills) or VGPR + "
        "SGPR spills (AMD); shared: bytes per program Triton launches with. A variant needing "
        "more shared memory than the target has counts as failed. Every record, with its "
        "constexprs and signature: the JSON file of the same name.",
        "",
        "| target | chips | variants | compiled | binaries | refused | failed | max regs "
        "| max spills | with spills | max shared (limit) | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in doc["summary"]:
        out.append(
            f"| {s['target']} | {s['chips']} | {s['variants']} | {s['compiled']} "
            f"| {s['binaries']} | {s['refused']} | {s['failed']} | {s['max_regs']} "
            f"| {s['max_spills']} | {s['with_spills']} | {s['max_shared']} "
            f"({s['shared_limit']}) | {s['compile_s']} |"
        )
    base = ", ".join(f"{k}={v}" for k, v in BASE.items())
    out += [
        "",
        f"Variants: cell (heads.bucket), weights, then each factor that differs from the base "
        f"({base}). Tiles: BLOCK_L, BLOCK_T, warps, stages.",
        "",
        "| target | status | variant | tiles | regs | spills | shared | s | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["records"]:
        c, x = r.get("constexprs"), r.get("resources") or {}
        tiles = f"{c['BLOCK_L']}, {c['BLOCK_T']}, {c['num_warps']}, {c['num_stages']}" if c else ""
        out.append(
            f"| {r['target']} | {r['status']} | {_short(r['variant'])} | {tiles} "
            f"| {x.get('regs', '')} | {x.get('spills', '')} | {x.get('shared', '')} "
            f"| {r.get('seconds', '')} | {_note(r)} |"
        )
    return "\n".join(out) + "\n"


def _override(text: str) -> tuple[str, int | float]:
    key, _, value = text.partition("=")
    return key, float(value) if "." in value else int(value)


def run(args, argv: list[str]) -> dict:
    """Plan, compile and measure every variant of ``args.targets``: the results document."""
    overrides = dict(args.override)
    cache = args.cache_dir or tempfile.mkdtemp(prefix="fusemla-targets-")
    os.environ["TRITON_CACHE_DIR"] = cache  # fresh by default: every variant really compiles
    t0 = time.perf_counter()
    tasks, refused = [], []
    for name in args.targets:
        variants, ref = variant_set(TARGETS[name], smoke=args.smoke, overrides=overrides)
        tasks += [(name, v, overrides) for v in variants]
        refused += [dict(target=name, variant=r["variant"], status="refused") | r for r in ref]
        print(f"{name}: {len(variants)} variants, {len(ref)} refused values", flush=True)
    print(
        f"planned in {time.perf_counter() - t0:.1f} s; compiling {len(tasks)} with {args.jobs} "
        f"processes (Triton {triton.__version__}, cache {cache})",
        flush=True,
    )
    order = sorted(range(len(tasks)), key=lambda i: (i % 97, i))  # targets and buckets mixed
    pool, jobs = None, [tasks[i] for i in order]
    if args.jobs > 1:
        import multiprocessing

        pool = ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"))
        results = pool.map(compile_one, *zip(*jobs))
    else:
        results = (compile_one(*job) for job in jobs)
    out = {}
    for n, (i, rec) in enumerate(zip(order, results), 1):
        out[i] = rec
        if rec["status"] != "compiled" or n % 25 == 0 or args.smoke:
            what = rec["resources"] if rec["status"] == "compiled" else rec["error"][:200]
            print(
                f"[{n}/{len(tasks)} {time.perf_counter() - t0:.0f} s] {rec['target']} "
                f"{rec['status']} {rec.get('seconds', '')} s: {what}",
                flush=True,
            )
    if pool is not None:
        pool.shutdown()
    records = [out[i] for i in range(len(tasks))] + refused
    header = dict(
        what="the prologue kernel compiled for GPU targets without their hardware",
        triton=triton.__version__,
        torch=torch.__version__,
        commit=commit_id(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command=" ".join(["python benchmarks/targets.py", *argv]),
        jobs=args.jobs,
        wall_s=round(time.perf_counter() - t0, 1),
        overrides=overrides,
        dims=DIMS,
        targets={n: dataclasses.asdict(TARGETS[n]) for n in args.targets},
        factors=FACTORS,
    )
    return dict(header=header, summary=summary(records), records=records)


def dump(doc: dict) -> str:
    """The results JSON: header and summary indented, one line per record."""
    head = json.dumps({k: v for k, v in doc.items() if k != "records"}, indent=1)[:-2]
    recs = ",\n".join(json.dumps(r) for r in doc["records"])
    return f'{head},\n "records": [\n{recs}\n]}}\n'


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON results file")
    ap.add_argument("--table", help="markdown table file")
    ap.add_argument("--smoke", action="store_true", help="one variant per target, quickly")
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--jobs", type=int, default=2, help="compiling processes (default 2)")
    ap.add_argument("--cache-dir", help="Triton cache (default: a fresh temporary one)")
    ap.add_argument("--render", metavar="JSON", help="write --out / --table from a results file")
    ap.add_argument(
        "--override",
        nargs="+",
        type=_override,
        default=[],
        metavar="KEY=VALUE",
        help="tile keys forced for every variant (configs.override), to try a tile change",
    )
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            doc = json.load(f)
    else:
        doc = run(args, argv)
    records = doc["records"]
    for s in doc["summary"]:
        print(json.dumps(s))
    problems = [r for r in records if r["status"] == "failed"]
    if args.smoke:  # the resource numbers must be there
        for r in records:
            x = r.get("resources") or {}
            if r["status"] == "compiled" and not (x.get("regs") and x.get("shared")):
                problems.append(r)
                print(f"SMOKE: {r['target']}: resource numbers missing: {x}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(dump(doc))
    if args.table:
        with open(args.table, "w") as f:
            f.write(table(doc))
    n_ok = sum(r["status"] == "compiled" for r in records)
    n_refused = sum(r["status"] == "refused" for r in records)
    wall = doc["header"]["wall_s"]
    print(f"{n_ok} compiled, {len(problems)} failed, {n_refused} refused in {wall} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
