"""The GPU-target compile run (benchmarks/targets.py) kept honest on the CPU, in seconds.

CI compiles the prologue and the epilogue kernels for sm_90, sm_100, gfx942 and gfx950 without
their hardware. These tests check what that run rests on, for each kernel: the arguments it
compiles are exactly the kernel's parameters as the real launcher passes them (Triton's own
binding, stopped before the compile); its variant set holds every constexpr value and every
argument dtype the plan picks over a wider grid of inputs; its factors span the library's dtypes,
formats and overrides; what it records as refused is refused by the library with a typed error;
and variants really compile (prologue: gfx950; epilogue: sm_90 and gfx942).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusemla import config, envs
from fusemla.contracts.epilogue import MIN_GROUP
from fusemla.dtypes import ACT_DTYPES, CACHE_DTYPES, FP8_DTYPES, INDEX_DTYPES, ROPE_DTYPES
from fusemla.errors import FuseMLAError, FuseMLATypeError, FuseMLAValueError
from fusemla.ops.epilogue import configs as epilogue_configs
from fusemla.ops.prologue import configs
from fusemla.quant import FORMATS

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fusemla_targets", ROOT / "benchmarks/targets.py")
targets = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(targets)

TARGETS = list(targets.TARGETS)
OPS = list(targets.OPS)
#: Triton's signature strings of the dtypes the launcher passes
TRITON_TYPE = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.uint8: "*u8",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.float8_e4m3fnuz: "*fp8e4b8",
}
#: what the library refuses at run time on each target, as (factor, value): the prologue's
REFUSED = {
    "cuda": {
        ("weights", "fp8.tensor.L.e4m3fnuz"),
        ("weights", "fp8.head.K.e4m3fnuz"),
        ("weights", "fp8.head.K.e4m3fnuz+act_fp8"),
        ("weights", "fp8.block.L.e4m3fnuz"),
        ("weights", "fp8.block.K.e4m3fnuz+act_fp8"),
        ("kv", "e4m3fnuz/float"),
        ("kv", "e4m3fnuz/tensor"),
        ("q_out", "e4m3fnuz/float"),
        ("q_out", "e4m3fnuz/tensor"),
    },
    "sm_90": {("weights", "mxfp4@dot_scaled")},
    "gfx942": {("weights", "mxfp4@dot_scaled"), ("pdl", "on")},
    "gfx950": {("pdl", "on")},
}
#: the epilogue's: e4m3fnuz (weights, output) on NVIDIA, PDL forced on where there is none
EPILOGUE_REFUSED = {
    "cuda": {
        ("weights", "fp8.tensor.V.e4m3fnuz"),
        ("weights", "fp8.head.K.e4m3fnuz"),
        ("weights", "fp8.block.K.e4m3fnuz"),
        ("out", "e4m3fnuz"),
    },
    "rocm": {("pdl", "on")},
}
#: weight variants of the grid: every format, granularity, layout and FP8 dtype with and
#: without FP8 activations, every MXFP4 path (the factor's own list is checked against it)
WEIGHTS = [
    *("plain.L", "plain.K", "mxfp4", "mxfp4@dequant", "mxfp4@dot_scaled"),
    *(
        f"fp8.{g}.{layout}.{fp8}{aq}"
        for g in ("tensor", "head", "block")
        for layout in ("K", "L")
        for fp8 in ("e4m3fn", "e4m3fnuz")
        for aq in ("", "+act_fp8")
    ),
]
#: the epilogue's W_UV variants of the grid: every plain layout, FP8 per tensor and per head in
#: every layout and FP8 dtype, block scales (K-major, as split_kv_b_proj_fp8 gives them) in
#: every FP8 dtype (the factor's own list is checked against it)
EPILOGUE_WEIGHTS = [
    *("plain.V", "plain.K", "plain.vllm"),
    *(
        f"fp8.{g}.{layout}.{fp8}"
        for g in ("tensor", "head")
        for layout in ("K", "V")
        for fp8 in ("e4m3fn", "e4m3fnuz")
    ),
    *(f"fp8.block.K.{fp8}" for fp8 in ("e4m3fn", "e4m3fnuz")),
]
#: launch options the launcher may pass next to the kernel's parameters
OPTIONS = {"num_warps", "num_stages", "launch_pdl"}


@pytest.fixture(scope="module")
def kernels():
    """Each op's kernel object in compiled mode (the suite runs under the interpreter)."""
    return {op: targets.OPS[op].kernel() for op in OPS}


@pytest.fixture(scope="module")
def kernel(kernels):
    return kernels["prologue"]


@pytest.fixture(scope="module")
def variant_sets():
    return {
        (op, name): targets.variant_set(targets.TARGETS[name], op=op)
        for op in OPS
        for name in TARGETS
    }


def _expected_refusals(name: str, op: str = "prologue") -> set:
    t = targets.TARGETS[name]
    table = REFUSED if op == "prologue" else EPILOGUE_REFUSED
    return table.get("cuda" if t.backend == "cuda" else "rocm", set()) | table.get(name, set())


def _values(cap, kernel) -> set:
    """(name, value) of every constexpr, launch option and argument dtype the call carries:
    what decides the compiled binary."""
    kw = cap.kwargs
    out = {(k, kw[k]) for k in kw if k in OPTIONS or k in cap.plan.constexprs}
    out |= {(k, h(kw)) for k, h in kernel.values.items()}  # the kernel's heuristics
    out |= {(k, getattr(x, "dtype", x)) for k, x in kw.items() if k.startswith("p_")}
    # the integers Triton turns into constants (a stride of 1: the weight's layout)
    dns = set(kernel.fn.do_not_specialize)
    out |= {(k, "== 1") for k, x in kw.items() if type(x) is int and x == 1 and k not in dns}
    out.discard(("H", cap.plan.constexprs["H"]))  # heads: the set compiles 16 and 128
    # and what only shows together: each tile config with each kernel variant
    c = cap.plan.constexprs
    tiles = tuple(c[k] for k in ("BLOCK_L", "BLOCK_T", "ROPE_ROWS", "CACHE_ROWS"))
    variant = tuple(c[k] for k in ("W_FMT", "MX_NATIVE", "A_QUANT"))
    out |= {("variant", variant), ("tiles", tiles + (kw["num_warps"], kw["num_stages"], variant))}
    return out


@pytest.mark.parametrize("name", TARGETS)
@pytest.mark.parametrize(
    "change",
    [
        {},
        {"weights": "fp8.head.K.e4m3fn+act_fp8", "kv": "e4m3fn/tensor", "q_out": "e4m3fn/tensor"},
        {"weights": "mxfp4", "cell": "H128.large", "act": "fp16", "index": "i32"},
        {"weights": "plain.K", "rope_input": "applied", "batch": "mixed", "tables": "bf16"},
    ],
    ids=["base", "fp8", "mxfp4", "plain-kmajor"],
)
def test_the_compiled_signature_is_the_kernels_parameter_list(kernel, name, change):
    """Triton binds the launcher's own arguments (no second list): every parameter, in order,
    pointers typed by the tensors passed, the plan's constexprs as constants."""
    target = targets.TARGETS[name]
    cap = targets.capture(target, dict(targets.BASE, **change))
    params = list(kernel.fn.arg_names)
    passed = set(cap.kwargs) | set(kernel.values)
    assert passed - OPTIONS == set(params), (passed ^ set(params)) - OPTIONS
    got = targets.compile_for(target, cap, kernel, dry=True)
    assert list(got["signature"]) == params
    for k, x in cap.kwargs.items():
        if isinstance(x, torch.Tensor):
            assert got["signature"][k] == TRITON_TYPE[x.dtype], k
        elif x is None:  # an optional tensor left out: a None constant, its flag False
            assert got["signature"][k] == "constexpr" and got["constants"][k] is None, k
    for k, value in cap.plan.constexprs.items():
        if k in ("num_warps", "num_stages"):
            assert got["options"][k] == value
        else:
            assert got["constants"][k] == value, k
    assert got["options"].get("launch_pdl", False) is cap.plan.pdl  # HIP has no such option
    assert got["constants"]["KV_SCALE_PTR"] is (change.get("kv") == "e4m3fn/tensor")


@pytest.mark.parametrize("op, stride", [("prologue", "s_qn_"), ("epilogue", "s_x_")])
@pytest.mark.parametrize("broken", ["missing", "unknown"])
def test_an_argument_the_kernel_does_not_take_fails_the_derivation(kernels, op, stride, broken):
    target = targets.TARGETS["sm_90"]
    cap = targets.capture(target, targets.OPS[op].base, op=op)
    if broken == "missing":
        del cap.kwargs[stride + "t"]
    else:
        cap.kwargs[stride + "x"] = 1
    with pytest.raises((TypeError, KeyError), match=stride):
        targets.compile_for(target, cap, kernels[op], dry=True)


@pytest.mark.parametrize("name", TARGETS)
def test_the_variant_set_holds_every_value_the_plan_picks(kernel, variant_sets, name):
    """Over a wider grid (4 head counts x 6 decode counts incl. 0 and far past the large
    bucket x every weight variant, then every value the library lists for each other factor
    on its own), the set of (constexpr / option / argument dtype, value) the plan picks is
    inside the variant set's. What the library refuses is left out (tested below)."""
    target = targets.TARGETS[name]
    have = set().union(
        *(_values(targets.capture(target, v), kernel) for v in variant_sets["prologue", name][0])
    )
    grid = []
    for H, D in itertools.product((16, 32, 64, 128), (0, 1, 9, 255, 256, 4096)):
        cell, batch = f"H{H}.{configs.batch_bucket(D)}", "mixed" if D == 0 else "decode"
        grid += [(dict(targets.BASE, cell=cell, weights=w, batch=batch), D) for w in WEIGHTS]
    for k, values in {**targets.FACTORS, **_library_values()}.items():
        grid += [(dict(targets.BASE, **{k: value}), None) for value in values]
    want, n = set(), 0
    for v, D in grid:
        try:
            cap = targets.capture(target, v, D=D)
        except FuseMLAError:
            continue
        want |= _values(cap, kernel)
        n += 1
    assert n > 300  # the grid really ran
    assert want <= have, sorted(want - have, key=str)


# ------------------------------------------------------------------------------ the epilogue


def _epilogue_values(cap) -> set:
    """What decides the epilogue's binary, as :func:`_values` for the prologue: every
    constexpr, launch option and argument dtype, every integer Triton turns into a constant
    (== 1) or assumes divisible by 16 or not (the kernel specializes all of its integers, the
    token count N included), and what shows only together: each tile config with the
    weight's code path and with the output's (FP8 format and group) it is planned for (the
    tiles depend on the bucket, the output, the group and the weight's bytes), the weight's
    path with its dtype and layout (weights x act), the output with the weight's path and
    with ue8m0 (pairs of factors)."""
    kw, c = cap.kwargs, cap.plan.constexprs
    out = {(k, kw[k]) for k in kw if k in OPTIONS or k in c}
    out |= {(k, getattr(x, "dtype", x)) for k, x in kw.items() if k.startswith("p_")}
    ones = {k for k, x in kw.items() if type(x) is int and x == 1 and k not in c}
    out |= {(k, "== 1") for k in ones}
    # and the divisibility by 16 it assumes of the others (the token count N, strides)
    ints = {k: x for k, x in kw.items() if type(x) is int and k not in c and k not in ones}
    out |= {(k, "% 16 == 0" if x % 16 == 0 else "% 16 != 0") for k, x in ints.items()}
    tiles = tuple(c[k] for k in ("BLOCK_T", "BLOCK_V", "BLOCK_K", "num_warps", "num_stages"))
    tiles += (c["GEMV"], c["GEMV_ROWS"])
    layout = tuple(sorted(ones & {"s_w_k", "s_w_v"}))
    weight = (c["W_FMT"], c["W_BK"], c["W_BN"])
    out |= {
        ("tiles", tiles, "weight", weight),
        ("tiles", tiles, "output", c["OUT_FP8"], c["GROUP"]),
        ("weight", weight, kw["p_w"].dtype, layout),
        ("output", c["OUT_FP8"], weight),
        ("output", c["OUT_FP8"], "UE8M0", c["UE8M0"]),
    }
    return out


@pytest.mark.parametrize("name", TARGETS)
@pytest.mark.parametrize(
    "change",
    [
        {},
        {"weights": "fp8.block.K.e4m3fn", "out": "e4m3fn", "scales": "col", "ue8m0": "on"},
        {"weights": "fp8.head.V.e4m3fn", "act": "fp16", "out": "e4m3fn", "group": 16},
        {"weights": "plain.vllm", "act": "fp16", "heads": 128, "tokens": 300, "pdl": "off"},
        {"weights": "fp8.tensor.K.e4m3fn", "tokens": 32, "out": "e4m3fn"},
    ],
    ids=["base", "block-fp8", "head-fp8-g16", "plain-vllm", "tensor-fp8"],
)
def test_the_epilogue_signature_is_the_kernels_parameter_list(kernels, name, change):
    """The epilogue as the prologue: Triton binds the launcher's own arguments, every
    parameter in order, pointers typed by the tensors passed, the plan's constexprs as
    constants, and the integers Triton specializes (a stride of 1, N = 1) as constants."""
    kernel, target = kernels["epilogue"], targets.TARGETS[name]
    v = dict(targets.EPILOGUE_BASE, **change)
    cap = targets.capture(target, v, op="epilogue")
    params = list(kernel.arg_names)
    assert set(cap.kwargs) - OPTIONS == set(params), (set(cap.kwargs) ^ set(params)) - OPTIONS
    got = targets.compile_for(target, cap, kernel, dry=True)
    assert list(got["signature"]) == params
    for k, x in cap.kwargs.items():
        if isinstance(x, torch.Tensor):
            assert got["signature"][k] == TRITON_TYPE[x.dtype], k
        elif type(x) is int and x == 1 and k not in {*kernel.do_not_specialize, *OPTIONS}:
            assert got["signature"][k] == "constexpr" and got["constants"][k] == 1, k
    for k, value in cap.plan.constexprs.items():
        if k in ("num_warps", "num_stages"):
            assert got["options"][k] == value
        else:
            assert got["constants"][k] == value, k
    assert got["options"].get("launch_pdl", False) is cap.plan.pdl  # HIP has no such option
    c = got["constants"]
    fmt = v["weights"].split(".")
    assert c["W_FMT"] == (0 if fmt[0] == "plain" else 2 if fmt[1] == "block" else 1)
    assert (c["W_BK"], c["W_BN"]) == ((128, 128) if fmt[1:2] == ["block"] else (0, 0))
    assert c["OUT_FP8"] == (0 if v["out"] == "act" else 1)
    assert c["GROUP"] == (0 if v["out"] == "act" else v["group"])
    assert c["UE8M0"] is (v["out"] != "act" and v["ue8m0"] == "on")
    assert got["signature"]["p_o"] == ("*fp8e4nv" if v["out"] == "e4m3fn" else "*" + v["act"])
    # the weight's layout: a stride of 1 along V or along L (K-major), never both
    ones = {k for k in ("s_w_k", "s_w_v") if c.get(k) == 1}
    assert ones == ({"s_w_k"} if fmt[-1] == "K" or fmt[2:3] == ["K"] else {"s_w_v"})


@pytest.mark.parametrize("name", TARGETS)
def test_the_epilogue_variant_set_holds_every_value_the_plan_picks(kernels, variant_sets, name):
    """Over a wider grid (4 head counts x 12 token counts from 1 past the large bucket x
    every W_UV variant of the library; every token count with every W_UV variant, output kind
    and group, which decide the tiles together; every token count with every output kind,
    ue8m0 and scale layout; then every value the library lists for each other factor on its
    own), the set of (constexpr / option / argument dtype / constant, value) the epilogue's
    plan picks is inside the variant set's. N = 0 launches nothing; refused values are left
    out (tested below). Group sizes: 128 (DeepSeek's o_proj) and 16 (the smallest); 32 and
    64 are the same code with a group in between, not compiled."""
    target, base = targets.TARGETS[name], targets.EPILOGUE_BASE
    have = set().union(
        *(
            _epilogue_values(targets.capture(target, v, op="epilogue"))
            for v in variant_sets["epilogue", name][0]
        )
    )
    Ns = (1, 2, 3, 8, 9, 16, 17, 64, 127, 128, 300, 4096)
    grid = [
        (dict(base, heads=H, tokens=N, weights=w), N)
        for H, N, w in itertools.product((16, 32, 64, 128), Ns, EPILOGUE_WEIGHTS)
    ]
    f = targets.EPILOGUE_FACTORS
    grid += [  # what decides the tiles, together
        (dict(base, tokens=N, weights=w, out=o, group=g), N)
        for N, w, o, g in itertools.product(Ns, EPILOGUE_WEIGHTS, f["out"], f["group"])
    ]
    grid += [
        (dict(base, tokens=N, out=o, ue8m0=u, scales=s), N)
        for N, o, u, s in itertools.product(Ns, f["out"], f["ue8m0"], f["scales"])
    ]
    for k, values in {**f, **_epilogue_library_values()}.items():
        grid += [(dict(base, **{k: value}), None) for value in values]
    want, n = set(), 0
    for v, N in grid:
        try:
            cap = targets.capture(target, v, D=N, op="epilogue")
        except FuseMLAError:
            continue
        want |= _epilogue_values(cap)
        n += 1
    assert n > 600  # the grid really ran
    assert want <= have, sorted(want - have, key=str)


def _epilogue_library_values() -> dict:
    """The values the library lists for the epilogue, named as the variant set names them."""
    name = {v: k for k, v in targets.DTYPES.items()}
    return dict(
        act=[name[d] for d in ACT_DTYPES],
        out=["act", *(name[d] for d in FP8_DTYPES)],
        pdl=list(dict.fromkeys(envs.VARIABLES[config.PDL_ENV].values.values())),
    )


def test_the_epilogue_factors_span_the_librarys_choices():
    """A dtype, W_UV format or layout, output kind, override value or bucket the library gains
    must enter the epilogue's variant set, or this fails."""
    f = targets.EPILOGUE_FACTORS
    assert {targets.DTYPES[a] for a in f["act"]} == set(ACT_DTYPES)
    assert {targets.DTYPES.get(o) for o in f["out"]} == {None, *FP8_DTYPES}  # None: "act"
    assert set(f["weights"]) <= set(EPILOGUE_WEIGHTS)
    fmts = {w.split(".")[0] for w in f["weights"]}
    assert fmts == {"plain", "fp8"} and set(FORMATS) - fmts == {"mxfp4"}  # no MXFP4 W_UV
    assert {w.split(".")[1] for w in f["weights"] if w.startswith("plain.")} == {"V", "K", "vllm"}
    fp8 = [w.split(".")[1:] for w in f["weights"] if w.startswith("fp8.")]
    assert {g for g, _, _ in fp8} == {"tensor", "head", "block"}
    assert {d for _, _, d in fp8} == {str(d).removeprefix("torch.float8_") for d in FP8_DTYPES}
    for dtype in {d for _, _, d in fp8}:  # each FP8 dtype in each layout, and with block scales
        assert {lay for g, lay, d in fp8 if d == dtype and g != "block"} == {"K", "V"}
        assert ["block", "K", dtype] in fp8
    assert set(f["pdl"]) == set(envs.VARIABLES[config.PDL_ENV].values.values())
    buckets = {epilogue_configs.batch_bucket(N) for N in range(1, 4 * epilogue_configs.LARGE_BATCH)}
    assert {epilogue_configs.batch_bucket(N) for N in f["tokens"]} == buckets
    assert 1 in f["tokens"]  # a batch of one (specialized by Triton: its own binary)
    # each of the GEMV rule's token bounds (its entries for 1, 2 and up to 8 tokens)
    gemv = {most for rule in epilogue_configs._GEMV_FEW.values() for most, _, _ in rule}
    assert gemv <= set(f["tokens"]), gemv - set(f["tokens"])
    assert set(f["heads"]) == {16, 128}
    assert set(f["ue8m0"]) == {"off", "on"} and set(f["scales"]) == {"row", "col"}
    assert set(f["group"]) == {128, MIN_GROUP}


def _library_values() -> dict:
    """The values the library lists (its dtypes, the override choices), named as the variant
    set names them (a dtype without a name there is a KeyError: a failure)."""
    name = {v: k for k, v in targets.DTYPES.items()}
    fp8 = [f"{name[d]}/{form}" for d in FP8_DTYPES for form in ("float", "tensor")]
    return dict(
        act=[name[d] for d in ACT_DTYPES],
        kv=[name[d] for d in CACHE_DTYPES if d not in FP8_DTYPES] + fp8,
        q_out=["act", *fp8],
        index=[name[d] for d in INDEX_DTYPES],
        tables=[name[d] for d in ROPE_DTYPES],
        pdl=list(dict.fromkeys(envs.VARIABLES[config.PDL_ENV].values.values())),
    )


def _dtypes(factor: str) -> set:
    return {targets.DTYPES.get(v.partition("/")[0]) for v in targets.FACTORS[factor]}


def test_the_factors_span_the_librarys_choices():
    """A dtype, weight format, override value or tile bucket the library gains must enter the
    variant set, or this fails."""
    f = targets.FACTORS
    assert _dtypes("act") == set(ACT_DTYPES)
    assert _dtypes("kv") == set(CACHE_DTYPES)
    assert _dtypes("q_out") == {None, *FP8_DTYPES}  # None: the activations' dtype
    assert _dtypes("index") == set(INDEX_DTYPES)
    assert _dtypes("tables") == set(ROPE_DTYPES)
    assert {w.split(".")[0].partition("@")[0] for w in f["weights"]} == {"plain", *FORMATS}
    fp8 = [w for w in f["weights"] if w.startswith("fp8.")]
    assert {w.split(".")[1] for w in fp8} == {"tensor", "head", "block"}
    assert {w.split(".")[2] for w in fp8} == {"K", "L"}
    assert {w.split(".")[3].partition("+")[0] for w in fp8} == {"e4m3fn", "e4m3fnuz"}
    for fmt in FP8_DTYPES:  # FP8 x FP8 in each FP8 format
        assert any(str(fmt).removeprefix("torch.float8_") + "+act_fp8" in w for w in fp8)
    mx = {w.partition("@")[2] or "auto" for w in f["weights"] if w.startswith("mxfp4")}
    assert mx == set(envs.VARIABLES[config.MXFP4_PATH_ENV].values.values())
    assert set(f["pdl"]) == set(envs.VARIABLES[config.PDL_ENV].values.values())
    buckets = {configs.batch_bucket(D) for D in range(0, 4 * configs.LARGE_BATCH)}
    assert {c.split(".")[1] for c in f["cell"]} == buckets
    assert all(configs.batch_bucket(D) == b for b, D in targets.BUCKET_D.items())
    assert {c.split(".")[0] for c in f["cell"]} == {"H16", "H128"}  # one per tile-table class


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", TARGETS)
def test_refused_values_are_the_librarys_typed_errors(variant_sets, name, op):
    variants, refused = variant_sets[op, name]
    factors, base = targets.OPS[op].factors, targets.OPS[op].base
    got = {(k, r["variant"][k]) for r in refused for k in factors if r["variant"][k] != base[k]}
    assert got == _expected_refusals(name, op)
    for r in refused:
        assert r["error"].split(":")[0] in ("FuseMLATypeError", "FuseMLAValueError"), r["error"]
        with pytest.raises((FuseMLATypeError, FuseMLAValueError)):
            targets.capture(targets.TARGETS[name], r["variant"], op=op)
    for v in variants:  # none of the refused values is in the set to compile
        assert not {(k, v[k]) for k in v} & got


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", TARGETS)
def test_every_pair_of_values_is_in_some_variant(variant_sets, name, op):
    variants, refused = variant_sets[op, name]
    factors, base = targets.OPS[op].factors, targets.OPS[op].base
    allowed = {k: {v[k] for v in variants} for k in factors}
    bad = {(k, r["variant"][k]) for r in refused for k in factors}
    for k, values in factors.items():
        assert allowed[k] == {x for x in values if (k, x) not in bad or x == base[k]}
    seen = {(a, v[a], b, v[b]) for v in variants for a, b in itertools.combinations(factors, 2)}
    for a, b in itertools.combinations(factors, 2):
        for x, y in itertools.product(allowed[a], allowed[b]):
            assert (a, x, b, y) in seen, (a, x, b, y)
    assert len({targets.variant_id(v) for v in variants}) == len(variants)


@pytest.mark.parametrize("name", TARGETS)
def test_the_epilogue_set_stays_near_its_floor(variant_sets, name):
    """A pairwise set has at least as many rows as the two largest factors' values multiplied
    (here W_UV variants x token counts); the epilogue's stays near that with the few rows its
    joint keys add (on CUDA 48 of a floor of 30: the GEMV rule's tiles for 1, 2 and up to 8
    tokens at 16 heads, each for a bf16 or FP8 output of bf16 or FP8 W_UV, need rows beside the
    MMA tiles the same token counts take at 128 heads), so the CI run grows by a few small
    compiles per rule, not by a cross product."""
    variants, _ = variant_sets["epilogue", name]
    sizes = sorted(len({v[k] for v in variants}) for k in targets.EPILOGUE_FACTORS)
    assert len(variants) <= 1.75 * sizes[-1] * sizes[-2], len(variants)


def test_a_refused_value_raises_before_any_launch():
    """FuseMLAError, not Triton's: e4m3fnuz asked of an NVIDIA target names the argument."""
    target = targets.TARGETS["sm_100"]
    with pytest.raises(FuseMLATypeError, match="kv_cache: float8_e4m3fnuz"):
        targets.capture(target, dict(targets.BASE, kv="e4m3fnuz/tensor"))
    with pytest.raises(FuseMLAError):
        targets.capture(target, dict(targets.BASE, q_out="e4m3fnuz/float"))
    epilogue = targets.EPILOGUE_BASE
    with pytest.raises(FuseMLATypeError, match="out: float8_e4m3fnuz"):
        targets.capture(target, dict(epilogue, out="e4m3fnuz"), op="epilogue")
    with pytest.raises(FuseMLATypeError, match="w_uv.data: float8_e4m3fnuz"):
        targets.capture(target, dict(epilogue, weights="fp8.block.K.e4m3fnuz"), op="epilogue")


def test_a_kernel_needing_more_shared_memory_than_the_target_has_fails():
    """Triton compiles it; the first launch would raise OutOfResources: the run counts it as
    failed (exit status 1), never as compiled."""
    gfx942 = targets.TARGETS["gfx942"]
    assert targets.launch_problem(gfx942, {"shared": gfx942.max_shared}) is None
    problem = targets.launch_problem(gfx942, {"shared": gfx942.max_shared + 1})
    assert "65537 bytes of shared memory" in problem and "gfx942 has 65536" in problem


def _committed() -> dict:
    import triton

    path = ROOT / f"benchmarks/results/targets_triton{triton.__version__}.json"
    if not path.exists():
        pytest.skip(f"no committed target table for Triton {triton.__version__}")
    return json.loads(path.read_text())


def test_the_committed_table_is_whole():
    """Every op on every target, every record with its numbers, refusals with the library's
    errors; the markdown table is the rendering of the JSON, a section per op."""
    import triton

    doc = _committed()
    recs = doc["records"]
    assert {(r["op"], r["target"]) for r in recs} == set(itertools.product(OPS, TARGETS))
    assert {(s["op"], s["target"]) for s in doc["summary"]} == set(itertools.product(OPS, TARGETS))
    md = (ROOT / f"benchmarks/results/targets_triton{triton.__version__}.md").read_text()
    assert md == targets.table(doc)
    assert all(f"## {targets.OPS[op].title}" in md for op in OPS)
    for r in recs:
        if r["status"] == "refused":
            assert r["error"].split(":")[0] in ("FuseMLATypeError", "FuseMLAValueError")
        else:
            x = r["resources"]
            assert x["regs"] > 0 and x["shared"] > 0 and x["spills"] >= 0, targets.variant_id(
                r["variant"]
            )
            # compiled for the target itself: "sm_90a", "amdgpu9.42-amd-amdhsa-unknown-gfx942"
            assert x["arch"] == r["target"] + "a" or x["arch"].endswith("-" + r["target"])
    for s in doc["summary"]:
        mine = [r for r in recs if (r["op"], r["target"]) == (s["op"], s["target"])]
        assert s["variants"] == len(mine)
        assert s["failed"] == sum(r["status"] == "failed" for r in mine)


def test_rocm_large_batch_tiles_fit_amd_lds():
    """The CUDA large-batch tiles at H > 32 (128 x 128, 3 stages) needed 128-200 KiB of LDS on
    gfx942 / gfx950 (64 / 160 KiB): ROCm takes the medium tiles there, CUDA keeps its own."""
    from fusemla.ops.prologue import configs

    for fmt in ("plain", "mxfp4"):
        _, cuda = configs.tiles(128, 128, 64, 512, 4096, "cuda", fmt)
        _, rocm = configs.tiles(128, 128, 64, 512, 4096, "rocm", fmt)
        _, medium = configs.tiles(128, 128, 64, 512, 64, "rocm", fmt)
        assert (cuda["BLOCK_T"], cuda["num_stages"]) == (128, 3)
        assert {k: rocm[k] for k in ("BLOCK_L", "BLOCK_T", "num_warps", "num_stages")} == {
            k: medium[k] for k in ("BLOCK_L", "BLOCK_T", "num_warps", "num_stages")
        }


def test_nothing_the_plan_picks_failed_in_the_committed_table():
    failed = [r for r in _committed()["records"] if r["status"] == "failed"]
    for r in failed:  # the plan must have moved off the tiles that could not launch
        cap = targets.capture(targets.TARGETS[r["target"]], r["variant"], op=r["op"])
        keys = targets.OPS[r["op"]].tiles
        assert [cap.plan.constexprs[k] for k in keys] != [r["constexprs"][k] for k in keys]
    assert not failed, [(r["op"], r["target"], targets.variant_id(r["variant"])) for r in failed]


def _smoke(tmp_path, *args: str) -> list[dict]:
    """``targets.py --smoke ARGS`` in a fresh process without the interpreter (Triton's
    language is interpreted in this one): its records."""
    from triton.backends import backends

    if "amd" not in backends or "nvidia" not in backends:
        pytest.skip("this Triton lacks the AMD or the NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = tmp_path / "smoke.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/targets.py"), "--smoke", *args]
    run = subprocess.run(
        [*cmd, "--jobs", "1", "--out", str(out), "--cache-dir", env["TRITON_CACHE_DIR"]],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads(out.read_text())["records"]


def test_one_variant_compiles_for_an_amd_target(tmp_path):
    """The real thing, once: gfx950 (about 1 s of compile)."""
    (rec,) = _smoke(tmp_path, "--targets", "gfx950", "--ops", "prologue")
    assert rec["status"] == "compiled" and rec["target"] == "gfx950" and rec["op"] == "prologue"
    res = rec["resources"]
    assert res["arch"].endswith("gfx950") and res["regs"] > 0 and res["shared"] > 0
    assert res["spills"] == 0 and res["scratch"] == 0
    assert rec["pointers"]["p_qn"] == "*bf16" and rec["specialized"]["p_ws"] is None


def test_one_epilogue_variant_compiles_for_sm_90_and_gfx942(tmp_path):
    """The epilogue's base variant (bf16, plain W_UV, N = 1) really compiled for an NVIDIA and
    an AMD target (about 1 s each): registers and shared memory from the binaries, for the
    target itself, the launcher's pointers and Triton's constants in the record."""
    recs = _smoke(tmp_path, "--targets", "sm_90", "gfx942", "--ops", "epilogue")
    assert [(r["op"], r["target"], r["status"]) for r in recs] == [
        ("epilogue", "sm_90", "compiled"),
        ("epilogue", "gfx942", "compiled"),
    ]
    for rec in recs:
        res = rec["resources"]
        assert res["regs"] > 0 and res["shared"] > 0 and res["spills"] == 0
        assert res["arch"] == "sm_90a" or res["arch"].endswith("-gfx942")
        assert rec["variant"] == targets.EPILOGUE_BASE
        assert rec["pointers"]["p_x"] == rec["pointers"]["p_w"] == rec["pointers"]["p_o"] == "*bf16"
        assert rec["constexprs"]["USE_PDL"] is (rec["target"] == "sm_90")
        assert (
            rec["specialized"]["s_w_v"] == 1 and "N" not in rec["specialized"]
        )  # one binary per bucket
    assert recs[1]["resources"]["scratch"] == 0


_PDL_PTX = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("t", sys.argv[1])
t = sys.modules["t"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(t)
target, op = t.TARGETS["sm_90"], sys.argv[2]
cap = t.capture(target, t.OPS[op].base, op=op)
ptx = t.compile_for(target, cap).asm["ptx"]
print(json.dumps({"pdl": cap.plan.pdl, "trigger": cap.plan.constexprs["PDL_TRIGGER"],
                  "wait": "griddepcontrol.wait" in ptx,
                  "launch": "griddepcontrol.launch_dependents" in ptx}))
"""


@pytest.mark.parametrize("op", OPS)
def test_a_pdl_kernel_lets_the_next_one_launch_only_when_it_completes(op, tmp_path):
    """With PDL (sm_90) the kernels wait for their producer (griddepcontrol.wait) but, unless
    FUSEMLA_PDL_TRIGGER is on, never trigger their dependents early
    (griddepcontrol.launch_dependents): a kernel after them launched for PDL that reads without
    waiting (vLLM's FlashMLA dense decode) must not see their outputs half written. Compiled
    for sm_90 in a fresh process without the interpreter."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton lacks the NVIDIA backend")
    got = {}
    for trigger in ("0", "1"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update({config.PDL_TRIGGER_ENV: trigger, "TRITON_CACHE_DIR": str(tmp_path / trigger)})
        run = subprocess.run(
            [sys.executable, "-c", _PDL_PTX, str(ROOT / "benchmarks/targets.py"), op],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        got[trigger] = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["0"] == {"pdl": True, "trigger": False, "wait": True, "launch": False}, got
    assert got["1"] == {"pdl": True, "trigger": True, "wait": True, "launch": True}, got
