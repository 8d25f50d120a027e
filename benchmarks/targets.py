"""Compile fusemla's kernels (the MLA prologue and the decode epilogue) for the GPUs users run,
on a machine without them (CI: CPU only).

Triton compiles for a target without its hardware. For each target (sm_90, sm_100, gfx942,
gfx950) and each kernel this script plans a set of launches at DeepSeek-V3 dims (P=128, R=64,
L=512, V=128, H=16 and 128) with the op's own ``plan`` (:func:`fusemla.ops.prologue.launch.plan`,
:func:`fusemla.ops.epilogue.launch.plan`) on that target's :func:`fusemla.platform.platform_from`,
runs the op's real launcher up to the kernel call, and hands the call's arguments to Triton's
own launch path with ``warmup=True`` under a stand-in driver that names the target: Triton binds
and specializes them, builds the ``ASTSource`` and compiles it as it would on the device,
without launching. No second list of kernel arguments exists; capture, compile and the resource
readout are one code path for both kernels (per op: its variants, its launch module, its kernel).

Each op's variant set covers every pair of its factor values at least once per target (the
epilogue's completed with a row for each tile config its plan picks with a weight path or an
output kind that no pair row holds: its tiles follow the token count, the output, the group and
the weight's bytes together), so every constexpr value its plan can pick is compiled. The
prologue's factors: heads x tile bucket, weight format and layout, activation dtype, cache
dtype and its scale, query output, RoPE style, rotation, batch kind, PDL, index and table
dtypes. The epilogue's: heads, tokens (N = 1, 2, 8: the small bucket's GEMV rules; 32, 300:
the medium and large buckets), W_UV format and layout (plain V-contiguous / K-major / vLLM's view,
FP8 per tensor / per head / block scales in both FP8 dtypes), activation dtype, output (the
activations' dtype, FP8 e4m3fn, e4m3fnuz), the FP8 scales' layout, ue8m0 scales, the group size
(128, DeepSeek's; 16, the smallest), PDL. A value the library refuses on a target (e4m3fnuz on
NVIDIA, a forced override the chip lacks) is recorded as refused, with the error. Registers,
spills and shared memory come from the binary: ``cuobjdump --dump-resource-usage`` (the one
Triton ships) for cubins, the AMDGCN metadata (``NumVgprs``, ``ScratchSize``, spill counts) for
hsaco. Every record names its op (``"op"``: "prologue" or "epilogue"); the table has a section
per op.

Exit status 1 if a variant a plan picks fails to compile or needs more shared memory than the
target has. Compiled for, not run on: nothing here says a kernel is right or fast there.

Usage (about 270 prologue compiles of 1-10 s and 190 epilogue compiles of 1-5 s each on an
idle core; the run prints its timing)::

    python benchmarks/targets.py --out benchmarks/results/targets_triton3.9.0.json \\
        --table benchmarks/results/targets_triton3.9.0.md       # full set, 2 processes
    python benchmarks/targets.py --smoke                   # one variant of each op per target
    python benchmarks/targets.py --ops prologue --targets gfx942 --override num_stages=1
                                                           # try a tile change (that op's keys)
    python benchmarks/targets.py --render results.json --table results.md   # re-render only
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from unittest import mock

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import commit_id  # noqa: E402

from fusemla import config  # noqa: E402
from fusemla import platform as fplatform  # noqa: E402
from fusemla.contracts import epilogue as epilogue_contract  # noqa: E402
from fusemla.contracts.prologue import prepare  # noqa: E402
from fusemla.errors import FuseMLAError  # noqa: E402
from fusemla.ops.epilogue import configs as epilogue_configs  # noqa: E402
from fusemla.ops.epilogue import launch as epilogue_launch  # noqa: E402
from fusemla.ops.prologue import configs  # noqa: E402
from fusemla.ops.prologue import launch as launch_mod  # noqa: E402
from fusemla.quant import (  # noqa: E402
    MX_BLOCK,
    QuantizedWeight,
    quantize_fp8_weight,
    split_kv_b_proj_fp8,
)
from fusemla.testing import DEEPSEEK_V3  # noqa: E402

#: DeepSeek-V3's dims; V: v_head_dim (the epilogue's W_UV columns per head)
DIMS = {**{k: DEEPSEEK_V3[k] for k in ("P", "R", "L")}, "V": 128}


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

# ------------------------------------------------------------------- the prologue's variants

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
    fp8.tensor.L.e4m3fn+act_fp8 fp8.head.K.e4m3fnuz+act_fp8 fp8.block.K.e4m3fn
    fp8.block.L.e4m3fnuz fp8.block.K.e4m3fn+act_fp8
    fp8.block.K.e4m3fnuz+act_fp8 mxfp4 mxfp4@dequant mxfp4@dot_scaled""".split()
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
    """The variant as one string, its factors in their order (either op's)."""
    return "|".join(f"{k}={v[k]}" for k in v)


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
    if parts[1] == "block":  # DeepSeek's 128 x 128 block scales (one block row spans P)
        return QuantizedWeight(
            w, torch.ones(H, -(-P // 128), -(-L // 128)), "fp8", block=(128, 128)
        )
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


# ------------------------------------------------------------------- the epilogue's variants

#: the epilogue's token counts: one per tile pick of the plan (epilogue configs: small <= 16 <
#: medium < 128 <= large; in the small bucket the GEMV rule's 1, 2, 3-4 and 5-8 tokens); as Triton
#: specializes the token count N (the kernel leaves it specializable), 1, a multiple of 16 and
#: neither
EPILOGUE_TOKENS = (1, 2, 4, 8, 32, 300)
#: W_UV variants: format[.granularity].layout[.fp8 dtype], made as the library makes them.
#: Layouts: V (contiguous [H, L, V], stride 1 along V), K (K-major, stride 1 along L:
#: quantize_fp8_weight's default and the layout split_kv_b_proj_fp8 gives block-FP8 W_UV), vllm
#: (vLLM's W_UV, a transposed view of a contiguous [L, H, V]: stride 1 along V, head stride V).
#: Each FP8 dtype with each FP8 layout, and with per-tensor, per-head and block scales.
EPILOGUE_WEIGHTS = tuple(
    """plain.V plain.K plain.vllm fp8.tensor.K.e4m3fn fp8.head.V.e4m3fn fp8.block.K.e4m3fn
    fp8.tensor.V.e4m3fnuz fp8.head.K.e4m3fnuz fp8.block.K.e4m3fnuz""".split()
)
#: the epilogue's factors; out: "act" (the activations' dtype) or the FP8 output's dtype;
#: scales: the FP8 scales' layout (row-major, or vLLM's column-major); ue8m0: scales rounded
#: up to powers of two; group: the FP8 output's group (128: DeepSeek's o_proj, 16: the
#: smallest, the most groups per V tile). scales / ue8m0 / group mean nothing for out=act.
EPILOGUE_FACTORS: dict[str, tuple] = dict(
    heads=(16, 128),
    tokens=EPILOGUE_TOKENS,
    weights=EPILOGUE_WEIGHTS,
    act=("bf16", "fp16"),
    out=("act", "e4m3fn", "e4m3fnuz"),
    scales=("row", "col"),
    ue8m0=("off", "on"),
    group=(128, 16),
    pdl=("auto", "off", "on"),
)
EPILOGUE_BASE = {k: v[0] for k, v in EPILOGUE_FACTORS.items()}


@functools.lru_cache(maxsize=64)
def _w_uv(H: int, act: str, spec: str):
    """The W_UV ``[H, L, V]`` of epilogue weight variant ``spec``: plain tensors as engines
    hold them, FP8 weights from the library's own constructors (per tensor / head:
    :func:`fusemla.quant.quantize_fp8_weight`; block scales: a checkpoint's kv_b_proj split by
    :func:`fusemla.quant.split_kv_b_proj_fp8`). Zeros or uninitialized: no value reaches the
    compiler; cached (read-only: only shapes, dtypes and strides matter)."""
    parts = spec.split(".")
    P, L, V = DIMS["P"], DIMS["L"], DIMS["V"]
    if parts[0] == "plain":
        dtype, layout = DTYPES[act], parts[1]
        if layout == "V":
            return torch.empty(H, L, V, dtype=dtype)
        if layout == "K":
            return torch.empty(H, V, L, dtype=dtype).transpose(1, 2)
        if layout == "vllm":
            return torch.empty(L, H, V, dtype=dtype).transpose(0, 1)
        raise ValueError(f"weight layout {layout!r}")
    _, granularity, layout, fp8 = parts
    if granularity == "block":  # DeepSeek-V3's 128 x 128 weight_scale_inv
        if layout != "K":
            raise ValueError("block-FP8 W_UV comes K-major from split_kv_b_proj_fp8")
        kv_b = torch.empty(H * (P + V), L, dtype=DTYPES[fp8])
        scale = torch.ones(H * (P + V) // 128, L // 128)
        _, w_uv = split_kv_b_proj_fp8(kv_b, scale, num_heads=H, qk_nope_head_dim=P, v_head_dim=V)
        return w_uv
    return quantize_fp8_weight(
        torch.zeros(H, L, V),
        dtype=DTYPES[fp8],
        per_head=granularity == "head",
        k_major=layout == "K",
    )


def epilogue_args(v: dict, N: int | None = None):
    """Validated :class:`EpilogueArgs` for epilogue variant ``v`` (attn_out ``[N, H, L]``
    contiguous, the outputs the contract allocates): what a launch sees; values never read.
    ``N``: tokens other than the variant's."""
    H, N = int(v["heads"]), int(v["tokens"]) if N is None else N
    return epilogue_contract.prepare(
        torch.empty(N, H, DIMS["L"], dtype=DTYPES[v["act"]]),
        _w_uv(H, v["act"], v["weights"]),
        out_dtype=None if v["out"] == "act" else DTYPES[v["out"]],
        group_size=int(v["group"]),
        scale_ue8m0=v["ue8m0"] == "on",
        scale_col_major=v["scales"] == "col",
    )


def _epilogue_joint(c: dict) -> set:
    """Each tile config the epilogue plans (its latent split included) with the weight's code
    path it is planned for, and with the output's (FP8 format, group)."""
    tiles = tuple(c[k] for k in ("BLOCK_T", "BLOCK_V", "BLOCK_K", "num_warps", "num_stages"))
    tiles += (c["GEMV"], c["GEMV_ROWS"])  # the CUDA cores' products (a row at a time) or the MMA
    tiles += (c["SPLIT"],)  # the latent's split: picked with the tiles (few items, FP8 out)
    return {("weight", tiles, c["W_FMT"]), ("output", tiles, c["OUT_FP8"], c["GROUP"])}


# ------------------------------------------------------------------------------- the ops


@dataclass(frozen=True)
class Op:
    """What differs between the kernels this script compiles; the rest is one code path."""

    name: str
    title: str
    launch: ModuleType  # the launcher: plan(), launch(), the kernel under kernel_name
    configs: ModuleType  # its tiles: override()
    kernel_module: str
    kernel_name: str
    factors: dict[str, tuple]
    args: Callable  # (variant, tokens or None) -> the op's validated args
    env: Callable[[dict], dict]  # the variant's environment (PDL, forced paths)
    patches: Callable  # target -> {launcher attribute: stand-in} (device queries)
    lead: tuple[str, ...]  # the factors the table always shows, first
    tiles: tuple[str, ...]  # the constexprs / options the table shows as tiles
    plan_fields: Callable  # plan -> what a record keeps of it beyond the constexprs
    #: what a plan decides jointly that a pairwise set can miss (the tiles with each kernel
    #: path), as keys of its constexprs, and the factors deciding it: variant_set adds a row
    #: for each key a combination of those factors' values plans that no pairwise row shows
    joint: Callable | None = None  # constexprs -> set of keys
    joint_factors: tuple[str, ...] = ()

    @property
    def base(self) -> dict:
        return {k: v[0] for k, v in self.factors.items()}

    def kernel(self):
        """The launcher's kernel object, compiled mode (see :func:`compiled_kernel`)."""
        return compiled_kernel(self.kernel_module, self.kernel_name)

    def label(self, v: dict) -> str:
        """The variant in short: its lead factors, then each factor unlike the base."""
        lead = [f"H{v[k]}" if k == "heads" else str(v[k]) for k in self.lead]
        rest = [f"{k}={v[k]}" for k in self.factors if v[k] != self.base[k] and k not in self.lead]
        return ", ".join(lead + rest)


OPS = {
    op.name: op
    for op in (
        Op(
            name="prologue",
            title="Prologue kernel (fusemla.ops.prologue)",
            launch=launch_mod,
            configs=configs,
            kernel_module="fusemla.ops.prologue.kernel",
            kernel_name="mla_prologue_kernel",
            factors=FACTORS,
            args=prologue_args,
            env=lambda v: {
                config.PDL_ENV: v["pdl"],
                config.MXFP4_PATH_ENV: v["weights"].partition("@")[2],
            },
            patches=lambda target: {"_num_sms": lambda i: target.num_sms},
            lead=("cell", "weights"),
            tiles=("BLOCK_L", "BLOCK_T", "num_warps", "num_stages"),
            plan_fields=lambda pl: dict(bucket=pl.bucket, tile_format=pl.tile_format),
        ),
        Op(
            name="epilogue",
            title="Epilogue kernel (fusemla.ops.epilogue)",
            launch=epilogue_launch,
            configs=epilogue_configs,
            kernel_module="fusemla.ops.epilogue.kernel",
            kernel_name="mla_epilogue_kernel",
            factors=EPILOGUE_FACTORS,
            args=epilogue_args,
            env=lambda v: {config.PDL_ENV: v["pdl"]},
            patches=lambda target: {},
            lead=("heads", "tokens", "weights"),
            tiles=("BLOCK_T", "BLOCK_V", "BLOCK_K", "num_warps", "num_stages", "GEMV", "GEMV_ROWS"),
            plan_fields=lambda pl: dict(
                bucket=pl.bucket, granularity=pl.granularity, out_format=pl.out_format
            ),
            # the tiles are the token count's, the output's (a V tile holds whole groups; an FP8
            # output's accumulator takes shared memory), the weight's (its bytes) and the
            # heads' (the few-items and GEMV rules count programs) together
            joint=_epilogue_joint,
            joint_factors=("heads", "tokens", "weights", "out", "group"),
        ),
    )
}


class _KernelCall:
    """Stands in for the kernel object in the launcher: records ``kernel[grid](**kwargs)``."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda **kwargs: self.calls.append((grid, kwargs))


@dataclass
class Captured:
    plan: object  # the op's plan (prologue LaunchPlan, EpiloguePlan)
    grid: tuple
    kwargs: dict  # exactly what the launcher passes to the kernel
    op: str = "prologue"


def capture(
    target: Target,
    v: dict,
    D: int | None = None,
    overrides: dict | None = None,
    op: str = "prologue",
) -> Captured:
    """Run op ``op``'s real launcher for variant ``v`` as on ``target`` (its platform, its SM
    count, the variant's PDL / MXFP4 path overrides) up to the kernel call; return the plan it
    ran and the call's arguments. Raises what the library raises (a :class:`FuseMLAError` for
    a refused variant). ``D``: tokens other than the bucket's (the prologue's decode tokens,
    the epilogue's N); ``overrides``: tile keys forced (the op's ``configs.override``)."""
    o, spy, info, plans = OPS[op], _KernelCall(), target.info, []
    real_plan = o.launch.plan

    def plan(*a, **kw):
        plans.append(real_plan(*a, **kw))
        return plans[-1]

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, o.env(v)))
        stack.enter_context(mock.patch.object(fplatform, "detect", lambda device=None: info))
        for name, value in {**o.patches(target), o.kernel_name: spy, "plan": plan}.items():
            stack.enter_context(mock.patch.object(o.launch, name, value))
        stack.enter_context(o.configs.override(**(overrides or {})))
        o.launch.launch(o.args(v, D))
    ((grid, kwargs),), (pl,) = spy.calls, plans
    return Captured(pl, grid, kwargs, op)


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
    target: Target, smoke: bool = False, overrides: dict | None = None, op: str = "prologue"
) -> tuple[list[dict], list[dict]]:
    """``(variants, refused)`` of op ``op`` for ``target``: each factor value is first tried
    on the op's base variant; one the library refuses there goes to ``refused`` (with its
    error) and out of the pairwise set built from the others, completed with the rows its
    joint keys need (:func:`_joint_rows`). ``smoke``: the base variant only."""
    base, factors = OPS[op].base, OPS[op].factors
    if smoke:
        return [dict(base)], []
    allowed, refused = {}, []
    for name, values in factors.items():
        allowed[name] = []
        for value in values:
            v = dict(base, **{name: value})
            try:
                capture(target, v, overrides=overrides, op=op)
            except FuseMLAError as exc:
                refused.append(dict(variant=v, error=f"{type(exc).__name__}: {exc}"))
                continue
            allowed[name].append(value)
    rows = pairwise({k: tuple(vals) for k, vals in allowed.items()})
    return rows + _joint_rows(target, rows, allowed, overrides, op), refused


def _joint_rows(
    target: Target, rows: list[dict], allowed: dict, overrides: dict | None, op: str
) -> list[dict]:
    """The rows op ``op``'s variant set needs beyond the pairwise ``rows``: every combination
    of its ``joint_factors``' allowed values (the other factors at the base) is planned, and
    one that plans a :attr:`Op.joint` key no row has yet is added (the first, in order)."""
    o = OPS[op]
    if o.joint is None:
        return []

    def keys(v: dict) -> set:
        return o.joint(capture(target, v, overrides=overrides, op=op).plan.constexprs)

    have, extra = set().union(*(keys(v) for v in rows)), []
    for values in itertools.product(*(allowed[k] for k in o.joint_factors)):
        v = dict(o.base, **dict(zip(o.joint_factors, values)))
        try:
            new = keys(v) - have
        except FuseMLAError:  # refused together (each value alone is allowed)
            continue
        if new:
            extra.append(v)
            have |= new
    return extra


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


def _jit(kernel):
    """The :class:`JITFunction` inside a kernel object (itself, or what a heuristics wrapper
    holds as ``fn``); None for an interpreted one."""
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):
        kernel = getattr(kernel, "fn", None)
        if kernel is None:
            return None
    return kernel


def compiled_kernel(module: str = "fusemla.ops.prologue.kernel", name: str = "mla_prologue_kernel"):
    """The kernel object ``name`` of ``module`` (the one its launcher calls); under the
    interpreter (``TRITON_INTERPRET=1``, the test suite) a compiled-mode copy of that module
    (and of the helpers it calls), imported apart."""
    from triton import knobs

    kernel = getattr(importlib.import_module(module), name)
    if _jit(kernel) is not None:
        return kernel
    names = ("fusemla.ops.triton_helpers", module)
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    try:
        with knobs.runtime.scope():
            knobs.runtime.interpret = False
            copy = importlib.import_module(module)
    finally:
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
        for n, m in saved.items():
            parent, _, leaf = n.rpartition(".")
            setattr(sys.modules[parent], leaf, m)
    return getattr(copy, name)


def compile_for(target: Target, cap: Captured, kernel=None, *, dry: bool = False):
    """Triton's own launch path for the captured call on ``target`` with ``warmup=True``:
    binding, specialization, ``ASTSource``, compile (never a launch). ``kernel``: the captured
    op's compiled-mode kernel object by default. Returns the CompiledKernel; ``dry`` stops
    before compiling (Triton's ``jit_cache_hook``) and returns what it would compile:
    ``signature`` (parameter -> Triton type, "constexpr" for a constant), ``constants``
    (parameter -> value) and ``options``."""
    from triton import knobs
    from triton.runtime import driver

    kernel = kernel or OPS[cap.op].kernel()
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
        _jit(kernel).device_caches[device][0].clear()  # the in-memory copy; the disk cache stays
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


def compile_one(
    target_name: str, v: dict, overrides: dict | None = None, op: str = "prologue"
) -> dict:
    """One record: op ``op``'s variant compiled for the target (or refused, or failed)."""
    target = TARGETS[target_name]
    rec = dict(op=op, target=target_name, variant=v)
    try:
        cap = capture(target, v, overrides=overrides, op=op)
    except FuseMLAError as exc:
        return dict(rec, status="refused", error=f"{type(exc).__name__}: {exc}")
    rec["constexprs"] = {k: _json(x) for k, x in cap.plan.constexprs.items()}
    rec.update(OPS[op].plan_fields(cap.plan))
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


def _op(r: dict) -> str:
    return r.get("op", "prologue")  # results files from before the epilogue name no op


def summary(records: list[dict]) -> list[dict]:
    """One row per op and target."""
    rows = []
    for op, name in dict.fromkeys((_op(r), r["target"]) for r in records):
        recs = [r for r in records if (_op(r), r["target"]) == (op, name)]
        ok = [r for r in recs if r["status"] == "compiled"]
        res = [r["resources"] for r in ok]
        rows.append(
            dict(
                op=op,
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


def _note(r: dict) -> str:
    if r["status"] != "compiled":
        return r["error"].replace("|", "/").replace("\n", " ")[:300]
    return "; ".join(w.split(".")[0] for w in r.get("warnings", []))[:200]


def _section(doc: dict, op: Op) -> list[str]:
    """One op's part of the table: its summary per target, then every record."""
    out = [
        "",
        f"## {op.title}",
        "",
        "| target | chips | variants | compiled | binaries | refused | failed | max regs "
        "| max spills | with spills | max shared (limit) | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in doc["summary"]:
        if _op(s) == op.name:
            out.append(
                f"| {s['target']} | {s['chips']} | {s['variants']} | {s['compiled']} "
                f"| {s['binaries']} | {s['refused']} | {s['failed']} | {s['max_regs']} "
                f"| {s['max_spills']} | {s['with_spills']} | {s['max_shared']} "
                f"({s['shared_limit']}) | {s['compile_s']} |"
            )
    base = ", ".join(f"{k}={v}" for k, v in op.base.items())
    names = {"num_warps": "warps", "num_stages": "stages"}
    out += [
        "",
        f"Variants: {', '.join(op.lead)}, then each factor that differs from the base ({base}). "
        f"Tiles: {', '.join(names.get(k, k) for k in op.tiles)}.",
        "",
        "| target | status | variant | tiles | regs | spills | shared | s | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["records"]:
        if _op(r) != op.name:
            continue
        c, x = r.get("constexprs"), r.get("resources") or {}
        tiles = ", ".join(str(c[k]) for k in op.tiles) if c else ""
        out.append(
            f"| {r['target']} | {r['status']} | {op.label(r['variant'])} | {tiles} "
            f"| {x.get('regs', '')} | {x.get('spills', '')} | {x.get('shared', '')} "
            f"| {r.get('seconds', '')} | {_note(r)} |"
        )
    return out


def table(doc: dict) -> str:
    h = doc["header"]
    ops = [o for o in OPS.values() if any(_op(r) == o.name for r in doc["records"])]
    out = [
        f"# Kernels compiled for GPU targets (Triton {h['triton']})",
        "",
        f"The {' and '.join(o.name for o in ops)} kernel{'s' * (len(ops) > 1)}, compiled for, "
        f"not run on: "
        f"`{h['command']}` on a CPU-only machine (Triton "
        f"{h['triton']}, torch {h['torch']}, commit {h['commit'][:12]}, {h['date']}, "
        f"{h['wall_s']} s wall, {h['jobs']} processes). DeepSeek-V3 dims (P={DIMS['P']}, "
        f"R={DIMS['R']}, L={DIMS['L']}, V={DIMS['V']}). regs: per thread (NVIDIA, cuobjdump) or "
        "VGPRs (AMD, NumVgprs); spills: local memory in 32-bit words (NVIDIA, as Triton's "
        "n_spills) or VGPR + SGPR spills (AMD); shared: bytes per program Triton launches with. "
        "A variant needing more shared memory than the target has counts as failed. Every "
        "record, with its op, constexprs and signature: the JSON file of the same name.",
    ]
    for op in ops:
        out += _section(doc, op)
    return "\n".join(out) + "\n"


def _override(text: str) -> tuple[str, int | float | bool]:
    key, _, value = text.partition("=")
    if value in ("True", "False"):  # GEMV=True
        return key, value == "True"
    return key, float(value) if "." in value else int(value)


def run(args, argv: list[str]) -> dict:
    """Plan, compile and measure every variant of ``args.ops`` for ``args.targets``: the
    results document."""
    overrides = dict(args.override)
    cache = args.cache_dir or tempfile.mkdtemp(prefix="fusemla-targets-")
    os.environ["TRITON_CACHE_DIR"] = cache  # fresh by default: every variant really compiles
    t0 = time.perf_counter()
    tasks, refused = [], []
    for op, name in itertools.product(args.ops, args.targets):
        target = TARGETS[name]
        variants, ref = variant_set(target, smoke=args.smoke, overrides=overrides, op=op)
        tasks += [(name, v, overrides, op) for v in variants]
        refused += [
            dict(op=op, target=name, variant=r["variant"], status="refused") | r for r in ref
        ]
        print(f"{op} {name}: {len(variants)} variants, {len(ref)} refused values", flush=True)
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
                f"[{n}/{len(tasks)} {time.perf_counter() - t0:.0f} s] {rec['op']} {rec['target']} "
                f"{rec['status']} {rec.get('seconds', '')} s: {what}",
                flush=True,
            )
    if pool is not None:
        pool.shutdown()
    records = [out[i] for i in range(len(tasks))] + refused
    header = dict(
        what="fusemla's kernels (prologue, epilogue) compiled for GPU targets without their "
        "hardware",
        ops=list(args.ops),
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
        factors={op: OPS[op].factors for op in args.ops},
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
    ap.add_argument(
        "--smoke", action="store_true", help="one variant of each op per target, quickly"
    )
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS), help="kernels")
    ap.add_argument("--jobs", type=int, default=2, help="compiling processes (default 2)")
    ap.add_argument("--cache-dir", help="Triton cache (default: a fresh temporary one)")
    ap.add_argument("--render", metavar="JSON", help="write --out / --table from a results file")
    ap.add_argument(
        "--override",
        nargs="+",
        type=_override,
        default=[],
        metavar="KEY=VALUE",
        help="tile keys forced for every variant of --ops (their configs.override), to try a "
        "tile change",
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
                print(f"SMOKE: {_op(r)} {r['target']}: resource numbers missing: {x}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(dump(doc))
    if args.table:
        with open(args.table, "w") as f:
            f.write(table(doc))
    for op in dict.fromkeys(_op(r) for r in records):
        mine = [r for r in records if _op(r) == op]
        n_ok = sum(r["status"] == "compiled" for r in mine)
        n_refused = sum(r["status"] == "refused" for r in mine)
        n_bad = sum(_op(r) == op for r in problems)
        print(f"{op}: {n_ok} compiled, {n_bad} failed, {n_refused} refused")
    n_ok = sum(r["status"] == "compiled" for r in records)
    n_refused = sum(r["status"] == "refused" for r in records)
    wall = doc["header"]["wall_s"]
    print(f"{n_ok} compiled, {len(problems)} failed, {n_refused} refused in {wall} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
