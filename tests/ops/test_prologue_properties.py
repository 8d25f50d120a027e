"""Hypothesis property tests of the fused prologue (:func:`fusemla.mla_prologue`) against the
unfused reference, through the Triton interpreter at small dims (``--device=cpu``, CI) or on the
GPU (``--device=cuda``).

Each example draws a whole case (shapes, dtypes, strides, block sizes, padding patterns,
positions, the decode/prefill split, output buffers and a launch-config override), builds fresh
random data from a seed hypothesis draws, poisons the cache and every given output with NaN
(NaN bytes for FP8), runs the fused op and the reference, and checks:

- :func:`fusemla.testing.compare`: q, the prefill q_pe/k_pe outputs, and every cache byte (the
  valid slots' rows against the reference, all other rows unchanged);
- every tensor the op was handed is embedded in a larger poisoned allocation where its layout
  has gaps, and every byte of those allocations outside the op's outputs (inputs, gaps, the
  padding around a strided cache or output) is unchanged;
- given output buffers are the ones returned.

``configs.override`` forces the real tiling on small dims: several L-tiles, several passes of
the cache row loop, persistent BMM programs walking several (head, L-tile, token-tile) items
(``programs_per_sm`` 1-5 with up to 70 decode tokens) or one program per item, several RoPE
row tiles, cache tiles of 1-4 tokens. The deterministic tests at the end pin the tiling cases
that a kernel bug in tile offsets would break (the L-tile offset dropped, every token tile
starting at token 0, a persistent program stepping by the wrong stride).

Budget (``deadline=None``, ``derandomize=True``, 210 drawn + 5 explicit examples): about
70 s of CPU time; 2.5 minutes wall-clock on a 2-core machine busy with other work.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from fusemla.dtypes import FP8_DTYPES
from fusemla.ops.prologue import configs
from fusemla.ops.prologue.api import mla_prologue
from fusemla.reference.prologue import mla_prologue_ref
from fusemla.testing import (
    PrologueInputs,
    compare,
    make_inputs,
    poisoned,
    stable_seed,
)
from fusemla.testing.spy import recorded_launch_plans

BF16, FP16 = torch.bfloat16, torch.float16
E4M3, E4M3UZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz

# no database and no explain phase (its tracing is slow); failures print their Case
SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "print_blob": True,
    "phases": [Phase.explicit, Phase.generate, Phase.shrink],
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


# ---------------------------------------------------------------------------------------------
# One case: everything an example varies
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int = 0
    N: int = 8
    D: int | None = None  # None: all decode (num_decode_tokens not passed)
    H: int = 2
    P: int = 32
    R: int = 16
    L: int = 64
    dtype: torch.dtype = BF16
    cache: str = "same"  # "same", "bf16", "fp16", "e4m3fn", "e4m3fnuz"
    kv_scale: str = "float"  # FP8: "float" / "tensor"; other caches: "none" / "float" / "tensor"
    block_size: int = 16
    blocks: str = "enough"  # "enough" / "barely" (cdiv(N, block_size): every row may be hit)
    pad: str = "none"  # slot -1 for "none" / "random" / "all" tokens
    beyond: bool = False  # some slots past the cache (skipped)
    max_position: int = 4096
    wild_positions: bool = False  # some positions past the RoPE cache and negative (clamped)
    pos_dtype: torch.dtype = torch.int64
    slot_dtype: torch.dtype = torch.int64
    index_strided: bool = False  # positions / slot_mapping every other element of a buffer
    rope_dtype: torch.dtype = torch.float32
    rope_split: bool = False  # cos/sin as the two halves of one [max_position, R] table
    is_neox: bool = False
    rope_applied: bool = False
    q_layout: str = "engine"  # "engine", "rows2", "headpad", "separate"
    kv_layout: str = "engine"  # "engine", "rows2", "separate"
    k_pe_3d: bool = False  # k_pe as [N, 1, R]
    w_layout: str = "contig"  # "contig", "padlast", "permuted"
    cache_layout: str = "plain"  # "plain", "rowpad", "blocks2"
    outputs: str = "alloc"  # "alloc", "given", "strided", "inplace" (q_pe_out=q_pe[D:])
    cfg: tuple = ()  # configs.override(**dict(cfg))


# ---------------------------------------------------------------------------------------------
# Building a case: tensors embedded in poisoned allocations
# ---------------------------------------------------------------------------------------------


def _u8(x: torch.Tensor) -> torch.Tensor:
    """A byte-sized integer view (same element size, so as_strided geometry carries over)."""
    return x.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    )


class Watched:
    """Contiguous allocations handed to the op through views; checks that nothing outside the
    allowed views (the outputs) changed, byte for byte."""

    def __init__(self):
        self.bases: list = []  # (base, bytes before, [allowed views])

    def add(self, base: torch.Tensor, allowed=()) -> None:
        self.bases.append((base, _u8(base).clone(), list(allowed)))

    def allow(self, base: torch.Tensor, view: torch.Tensor) -> None:
        for b, _, allowed in self.bases:
            if b is base:
                allowed.append(view)
                return
        raise AssertionError("allow: unknown base")

    def problems(self) -> list:
        out = []
        for i, (base, before, allowed) in enumerate(self.bases):
            now = _u8(base).clone()
            for v in allowed:
                geo = (v.size(), v.stride(), v.storage_offset() - base.storage_offset())
                now.as_strided(*geo).copy_(before.as_strided(*geo))
            if not torch.equal(now, before):
                n = int((now != before).sum())
                out.append(
                    f"allocation {i} {tuple(base.shape)} {base.dtype}: {n} elements "
                    "outside the outputs changed"
                )
        return out


def _embed(x: torch.Tensor, kind: str, watch: Watched, fill=None) -> torch.Tensor:
    """``x``'s values in a fresh allocation laid out as ``kind``; the allocation is watched.

    "contig": as is. "rows2": every other row of a [2 * n0 + 1, ...] buffer (odd token
    stride, nonzero offset). "padlast": the first columns of [..., last + 8] rows.
    """
    poison = float("nan") if fill is None else fill
    if kind == "contig":
        base = x.clone().contiguous()
        view = base
    elif kind == "rows2":
        base = torch.full(
            (2 * x.shape[0] + 1, *x.shape[1:]), poison, dtype=x.dtype, device=x.device
        )
        view = base[1::2]
    elif kind == "padlast":
        base = torch.full((*x.shape[:-1], x.shape[-1] + 8), poison, dtype=x.dtype, device=x.device)
        view = base[..., : x.shape[-1]]
    else:
        raise ValueError(kind)
    view.copy_(x)
    watch.add(base)
    return view


def _poisoned_view(shape: tuple, dtype: torch.dtype, device, kind: str, watch: Watched):
    """A NaN-poisoned output buffer of ``shape`` laid out as ``kind``; the allocation is
    watched with the view allowed to change."""
    if kind == "strided":  # every other row, and padded rows: both strides non-standard
        base = poisoned((2 * shape[0] + 1, *shape[1:-1], shape[-1] + 8), dtype, device)
        view = base[1::2][..., : shape[-1]]
    else:
        base = poisoned(shape, dtype, device)
        view = base
    watch.add(base, [view])
    return view


def _cache_view(inp: PrologueInputs, kind: str, watch: Watched) -> torch.Tensor:
    c = inp.kv_cache  # poisoned [nb, bs, W]
    nb, bs, W = c.shape
    if kind == "plain":
        base, view = c, c
    elif kind == "rowpad":  # rows of a wider allocation (row stride W + 8)
        base = poisoned((nb, bs, W + 8), c.dtype, c.device)
        view = base[..., :W]
    elif kind == "blocks2":  # every other block (a layer-interleaved allocation)
        base = poisoned((2 * nb + 1, bs, W), c.dtype, c.device)
        view = base[1::2]
    else:
        raise ValueError(kind)
    watch.add(base, [view])
    return view


CACHE_DTYPE = {"bf16": BF16, "fp16": FP16, "e4m3fn": E4M3, "e4m3fnuz": E4M3UZ}


def build(case: Case, device: str):
    """(inputs for the fused op, pristine inputs for the reference, op keywords, watched)."""
    g = torch.Generator().manual_seed(case.seed)
    N, H, P, R, L = case.N, case.H, case.P, case.R, case.L
    kv_dtype = case.dtype if case.cache == "same" else CACHE_DTYPE[case.cache]
    fp8 = kv_dtype in FP8_DTYPES
    bs = case.block_size
    nb = max(1, -(-N // bs)) if case.blocks == "barely" else (2 * N + bs - 1) // bs + 1
    inp = make_inputs(
        N,
        H,
        P,
        R,
        L,
        num_decode_tokens=case.D,
        dtype=case.dtype,
        kv_dtype=kv_dtype,
        block_size=bs,
        num_blocks=nb,
        max_position=case.max_position,
        rope_dtype=case.rope_dtype,
        kv_scale="tensor" if case.kv_scale == "tensor" else "auto",
        generator=g,
        device=device,
    )
    n_slots = nb * bs
    D = inp.D

    # kv_scale on a non-FP8 cache: accepted and ignored, like the reference
    kv_scale = inp.kv_scale
    if not fp8:
        kv_scale = {"none": None, "float": 0.37, "tensor": torch.tensor([2.5], device=device)}[
            case.kv_scale
        ]

    # slots: distinct valid rows, then padding (-1) and slots past the cache
    slots = torch.randperm(n_slots, generator=g)[:N]
    if case.pad == "all":
        slots = torch.full_like(slots, -1)
    elif case.pad == "random":
        slots = torch.where(torch.rand(N, generator=g) < 0.3, -1, slots)
    if case.beyond and N:
        big = 2**31 - 1 if case.slot_dtype == torch.int32 else 2**40
        far = torch.tensor([n_slots, n_slots + 1, n_slots + bs, big, -(2**31)])
        pick = torch.rand(N, generator=g) < 0.3
        slots = torch.where(pick, far[torch.randint(0, len(far), (N,), generator=g)], slots)
    # positions: in range, or some beyond the RoPE cache and negative
    pos = inp.positions.long().cpu()
    if case.wild_positions and N:
        big = 2**31 - 1 if case.pos_dtype == torch.int32 else 2**40
        far = torch.tensor([case.max_position, case.max_position + 7, big, -1, -5, -(2**31)])
        pick = torch.rand(N, generator=g) < 0.4
        pos = torch.where(pick, far[torch.randint(0, len(far), (N,), generator=g)], pos)
    pos = pos.to(case.pos_dtype).to(device)
    slots = slots.to(case.slot_dtype).to(device)

    pristine = dataclasses.replace(
        inp,
        q_nope=inp.q_nope.clone(),
        q_pe=inp.q_pe.clone(),
        kv_c=inp.kv_c.clone(),
        k_pe=inp.k_pe.clone(),
        w_uk_t=inp.w_uk_t.clone(),
        positions=pos.clone(),
        slot_mapping=slots.clone(),
        cos_cache=inp.cos_cache.clone(),
        sin_cache=inp.sin_cache.clone(),
        kv_scale=kv_scale,
    )

    watch = Watched()
    # q_nope / q_pe: slices of one q_b_proj output [N, H, P + R], or separate tensors
    q_all = torch.cat([inp.q_nope, inp.q_pe], dim=-1)
    if case.q_layout == "separate":
        q_nope = _embed(inp.q_nope, "contig", watch)
        q_pe = _embed(inp.q_pe, "contig", watch)
    else:
        kind = {"engine": "contig", "rows2": "rows2", "headpad": "padlast"}[case.q_layout]
        q_buf = _embed(q_all, kind, watch)
        q_nope, q_pe = q_buf[..., :P], q_buf[..., P : P + R]
    # kv_c / k_pe: slices of one kv_a output [N, L + R], or separate tensors
    kv_all = torch.cat([inp.kv_c, inp.k_pe], dim=-1)
    if case.kv_layout == "separate":
        kv_c = _embed(inp.kv_c, "contig", watch)
        k_pe = _embed(inp.k_pe, "contig", watch)
    else:
        kv_buf = _embed(kv_all, "rows2" if case.kv_layout == "rows2" else "contig", watch)
        kv_c, k_pe = kv_buf[:, :L], kv_buf[:, L:]
    if case.k_pe_3d:
        k_pe = k_pe.unsqueeze(1)
    # W_UK_T [H, P, L]
    if case.w_layout == "permuted":  # stored [P, H, L]: head stride L, P stride H * L
        wb = inp.w_uk_t.transpose(0, 1).contiguous()
        watch.add(wb)
        w = wb.transpose(0, 1)
    else:
        w = _embed(inp.w_uk_t, case.w_layout, watch)
    idx_kind = "rows2" if case.index_strided else "contig"
    positions = _embed(pos, idx_kind, watch, fill=-7)
    slot_mapping = _embed(slots, idx_kind, watch, fill=-7)
    if case.rope_split:  # the engine's one [max_position, R] table, cos | sin halves
        table = torch.cat([inp.cos_cache, inp.sin_cache], dim=-1).contiguous()
        watch.add(table)
        cos, sin = table[:, : R // 2], table[:, R // 2 :]
    else:
        cos = _embed(inp.cos_cache, "contig", watch)
        sin = _embed(inp.sin_cache, "contig", watch)
    cache = _cache_view(inp, case.cache_layout, watch)

    fused = PrologueInputs(
        q_nope, q_pe, kv_c, k_pe, w, positions, cos, sin, cache, slot_mapping, kv_scale, case.D
    )

    kw: dict = {}
    if case.outputs in ("given", "strided", "inplace"):
        kind = "strided" if case.outputs == "strided" else "plain"
        kw["out"] = _poisoned_view((D, H, L + R), case.dtype, device, kind, watch)
        kw["k_pe_out"] = _poisoned_view((N - D, R), case.dtype, device, kind, watch)
        if case.outputs == "inplace":
            kw["q_pe_out"] = q_pe[D:]
            watch.allow(q_pe._base if q_pe._base is not None else q_pe, q_pe[D:])
        else:
            kw["q_pe_out"] = _poisoned_view((N - D, H, R), case.dtype, device, kind, watch)
    return fused, pristine, kw, watch


def check_case(case: Case, device: str) -> list:
    """Run ``case`` through the kernel and the reference and compare; returns the launch plans
    the launcher ran (one per kernel launch)."""
    with recorded_launch_plans() as plans:
        _check_case(case, device)
    if plans and device == "cpu" and currently_in_test_context():  # --hypothesis-show-statistics
        t = _tiles(plans)
        D = case.N if case.D is None else case.D
        per = t["items"] // max(t["programs"], 1)
        event(f"BMM items per program: {min(per, 3) if D else 0}{'+' * (per >= 3)}")
        event(f"L-tiles {min(t['l_tiles'], 3)}, cache-loop passes {min(t['lc_passes'], 3)}")
        event(
            "split: "
            + (
                "empty"
                if case.N == 0
                else "all decode"
                if D == case.N
                else "all prefill"
                if D == 0
                else "mixed"
            )
        )
    return plans


def _check_case(case: Case, device: str) -> None:
    fused, pristine, kw, watch = build(case, device)
    cache_before = fused.kv_cache.clone()
    cache_ref = cache_before.clone()
    flags = {"is_neox": case.is_neox, "rope_applied": case.rope_applied}
    out_ref = pristine.run(mla_prologue_ref, kv_cache=cache_ref, **flags)
    with configs.override(**dict(case.cfg)):
        out = fused.run(mla_prologue, **flags, **kw)
    problems = []
    for name, i in (("out", 0), ("q_pe_out", 1), ("k_pe_out", 2)):
        if name in kw and out[i] is not kw[name]:
            problems.append(f"{name}: the given buffer was not returned")
    if case.N > 0:
        problems += compare(
            pristine, out, out_ref, fused.kv_cache, cache_ref, cache_before, **flags
        ).problems
    else:  # compare() cannot take an empty batch (prologue_model_f64 reshapes k_pe [0, -1])
        H, R, L = case.H, case.R, case.L
        for got, want in zip(out, ((0, H, L + R), (0, H, R), (0, R))):
            if tuple(got.shape) != want:
                problems.append(f"empty batch: output of shape {tuple(got.shape)}, want {want}")
        if not torch.equal(_u8(fused.kv_cache), _u8(cache_before)):
            problems.append("empty batch: the cache changed")
    problems += watch.problems()
    assert not problems, f"{case}:\n  " + "\n  ".join(problems)


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------

SEEDS = st.integers(0, 2**31 - 1)


@st.composite
def tiling(draw, force: bool = False) -> tuple:
    """A launch-config override with valid power-of-two sizes (empty: the interpreter's own
    small config: two L-tiles, two cache-loop passes, BLOCK_T 16, three persistent BMM
    programs, two tokens per cache program)."""
    if not force and draw(st.sampled_from([True, False, False])):
        return ()
    cfg = {
        "BLOCK_L": draw(st.sampled_from([16, 32])),
        "BLOCK_LC": draw(st.sampled_from([16, 32, 64])),
        "BLOCK_T": draw(st.sampled_from([16, 16, 32])),
        "ROPE_ROWS": draw(st.sampled_from([16, 32])),
        "programs_per_sm": draw(st.sampled_from([0.0, 0.0, 1.0, 2.0, 5.0])),
        "CACHE_ROWS": draw(st.sampled_from([1, 2, 4])),
    }
    return tuple(sorted(cfg.items()))


@st.composite
def token_count(draw, N_max: int) -> int:
    """Spread over edges (empty, one token, around a 16-token tile), small and large batches
    (> 32 tokens: three or more 16-token tiles)."""
    mode = draw(st.sampled_from(["edge", "small", "large", "large"]))
    if mode == "edge":
        return draw(st.sampled_from([0, 1, 2, 15, 16, 17]))
    if mode == "small":
        return draw(st.integers(1, 32))
    return draw(st.integers(min(33, N_max), N_max))


@st.composite
def decode_split(draw, N: int) -> int | None:
    """num_decode_tokens: None or N (all decode), 0 (all prefill), or a mixed split."""
    mode = draw(st.sampled_from(["all", "all", "none", "mixed", "mixed"]))
    if mode == "all":
        return draw(st.sampled_from([None, N]))
    if mode == "none" or N < 2:
        return 0
    return draw(st.integers(1, N - 1))


@st.composite
def cases(
    draw,
    *,
    N_max: int = 70,
    vary_layout: bool = True,
    vary_slots: bool = True,
    vary_tiling: bool = True,
    force_tiling: bool = False,
    **fixed,
) -> Case:
    """A case; ``fixed`` pins fields."""
    N = fixed.pop("N", None)
    N = draw(token_count(N_max)) if N is None else N
    L = fixed.get("L") or draw(st.sampled_from([16, 48, 64]))
    dtype = draw(st.sampled_from([BF16, FP16]))
    cache = draw(st.sampled_from(["same", "same", "bf16", "fp16", "e4m3fn", "e4m3fnuz"]))
    fp8 = cache.startswith("e4m3")
    c = {
        "seed": draw(SEEDS),
        "N": N,
        "D": draw(decode_split(N)),
        "H": draw(st.sampled_from([1, 2, 3, 4])),
        "P": draw(st.sampled_from([16, 32, 48])),
        "R": draw(st.sampled_from([2, 8, 16])),
        "L": L,
        "dtype": dtype,
        "cache": cache,
        "kv_scale": draw(
            st.sampled_from(["float", "tensor"] if fp8 else ["none", "none", "float", "tensor"])
        ),
        "is_neox": draw(st.booleans()),
        "rope_applied": draw(st.sampled_from([False, False, True])),
        "rope_dtype": draw(st.sampled_from([torch.float32, torch.float32, BF16, FP16])),
    }
    if vary_slots:
        c.update(
            block_size=draw(st.sampled_from([1, 16, 64])),
            blocks=draw(st.sampled_from(["enough", "barely"])),
            pad=draw(st.sampled_from(["none", "random", "random", "all"])),
            beyond=draw(st.booleans()),
            max_position=draw(st.sampled_from([1, 3, 64, 4096])),
            wild_positions=draw(st.booleans()),
            pos_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
            slot_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        )
    if vary_layout:
        c.update(
            index_strided=draw(st.booleans()),
            rope_split=draw(st.booleans()),
            q_layout=draw(st.sampled_from(["engine", "rows2", "headpad", "separate"])),
            kv_layout=draw(st.sampled_from(["engine", "rows2", "separate"])),
            k_pe_3d=draw(st.booleans()),
            w_layout=draw(st.sampled_from(["contig", "padlast", "permuted"])),
            cache_layout=draw(st.sampled_from(["plain", "rowpad", "blocks2"])),
            outputs=draw(st.sampled_from(["alloc", "given", "strided", "inplace"])),
        )
    if vary_tiling:
        c["cfg"] = draw(tiling(force=force_tiling))
    c.update(fixed)
    return Case(**c)


# ---------------------------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------------------------


@settings(max_examples=80, **SETTINGS)
@given(case=cases())
@example(
    case=Case(
        seed=1,
        N=70,
        D=None,
        H=3,
        P=48,
        R=8,
        L=48,
        cache="e4m3fn",
        kv_scale="tensor",
        block_size=1,
        blocks="barely",
        pad="random",
        beyond=True,
        max_position=64,
        wild_positions=True,
        pos_dtype=torch.int32,
        index_strided=True,
        rope_split=True,
        q_layout="rows2",
        kv_layout="rows2",
        k_pe_3d=True,
        w_layout="permuted",
        cache_layout="blocks2",
        outputs="strided",
        cfg=(("BLOCK_L", 16), ("BLOCK_LC", 16), ("CACHE_ROWS", 4), ("programs_per_sm", 2.0)),
    )
)
@example(
    case=Case(
        seed=2,
        N=37,
        D=20,
        H=4,
        P=16,
        R=2,
        L=16,
        dtype=FP16,
        cache="e4m3fnuz",
        block_size=64,
        pad="all",
        is_neox=True,
        q_layout="headpad",
        outputs="inplace",
        cfg=(("ROPE_ROWS", 16), ("programs_per_sm", 0.0)),
    )
)
def test_everything_varies(device, case):
    """Every knob drawn at once: shapes, dtypes, layouts, slots, positions, splits, tiling."""
    check_case(case, device)


@settings(max_examples=50, **SETTINGS)
@given(case=cases(N_max=70, vary_layout=False, vary_slots=False, force_tiling=True))
@example(
    case=Case(
        seed=3,
        N=70,
        D=70,
        H=2,
        P=32,
        R=16,
        L=64,
        cfg=(
            ("BLOCK_L", 16),
            ("BLOCK_LC", 16),
            ("BLOCK_T", 16),
            ("programs_per_sm", 5.0),
            ("ROPE_ROWS", 16),
            ("CACHE_ROWS", 4),
        ),
    )
)
@example(
    case=Case(
        seed=4,
        N=70,
        D=51,
        H=3,
        P=48,
        R=8,
        L=48,
        cfg=(("BLOCK_L", 32), ("BLOCK_LC", 32), ("programs_per_sm", 64.0), ("CACHE_ROWS", 2)),
    )
)
def test_tiling_overrides(device, case):
    """Launch-config overrides (several L-tiles, cache-loop passes, token tiles, RoPE tiles,
    persistent or per-item BMM programs, cache tiles) on plain layouts: the tile arithmetic
    in isolation."""
    check_case(case, device)


@settings(max_examples=40, **SETTINGS)
@given(case=cases(N_max=40, vary_layout=False))
@example(
    case=Case(
        seed=5,
        N=33,
        D=10,
        block_size=1,
        blocks="barely",
        pad="none",
        beyond=True,
        max_position=1,
        wild_positions=True,
        pos_dtype=torch.int32,
        slot_dtype=torch.int32,
        cache="e4m3fnuz",
        kv_scale="float",
    )
)
def test_slots_positions_and_padding(device, case):
    """Padding patterns, slots past the cache, block sizes 1/16/64 with barely enough blocks,
    positions past the RoPE cache and negative, int32/int64 indices, FP8 caches."""
    check_case(case, device)


@settings(max_examples=40, **SETTINGS)
@given(case=cases(N_max=40, vary_slots=False, vary_tiling=False))
def test_layouts_and_output_buffers(device, case):
    """Strided inputs (token/head strides, permuted weights, split RoPE table, strided
    indices), k_pe [N, 1, R], strided caches, given/strided/in-place outputs."""
    check_case(case, device)


# ---------------------------------------------------------------------------------------------
# Deterministic regressions: the tiling is really exercised
# ---------------------------------------------------------------------------------------------


def _tiles(plans: list) -> dict:
    """What the launcher ran (the one launch recorded while the case ran): BMM work items and
    programs, L-tiles, cache-loop passes, decode RoPE tiles."""
    assert len(plans) == 1, plans
    p = plans[0]
    return {
        "items": p.bmm_items,
        "programs": p.n_bmm,
        "l_tiles": p.l_tiles,
        "lc_passes": p.lc_passes,
        "rope_tiles": p.n_rope_d,
    }


def test_persistent_programs_walk_their_own_items(device):
    """50 decode tokens in 16-token tiles (the last partial), 2 heads x 2 L-tiles: 16 items
    for 3 persistent programs. A kernel that started every item at token 0, or stepped by
    the wrong stride, leaves tokens or heads unwritten (NaN)."""
    case = Case(
        seed=stable_seed("chunks"),
        N=50,
        D=None,
        H=2,
        P=32,
        R=16,
        L=64,
        outputs="given",
        cfg=(("BLOCK_T", 16), ("BLOCK_L", 32), ("programs_per_sm", 3.0)),
    )
    t = _tiles(check_case(case, device))
    if device == "cpu":
        assert t["items"] == 16 and t["programs"] == 3, t


def test_program_per_item_with_prefill_tail(device):
    """One BMM program per item over 65 decode tokens (5 token tiles), then prefill tokens
    behind them and a cache tile straddling the end of the batch."""
    case = Case(
        seed=stable_seed("chunks-mixed"),
        N=70,
        D=65,
        H=3,
        P=16,
        R=8,
        L=48,
        cfg=(("BLOCK_T", 16), ("programs_per_sm", 0.0), ("CACHE_ROWS", 4)),
    )
    t = _tiles(check_case(case, device))
    assert t["programs"] == t["items"] == 3 * t["l_tiles"] * 5, t


@pytest.mark.parametrize("L,block_l", [(64, 16), (48, 32), (48, 16)])
def test_l_tiles_cover_the_whole_latent(device, L, block_l):
    """BLOCK_L < L: several L-tiles per head (the last one partial for L = 48). A kernel that
    dropped the tile offset writes only q[..., :BLOCK_L] (the rest stays NaN)."""
    case = Case(
        seed=stable_seed("ltiles", L, block_l),
        N=20,
        D=None,
        H=2,
        P=32,
        R=16,
        L=L,
        outputs="given",
        cfg=(("BLOCK_L", block_l), ("BLOCK_LC", 16)),
    )
    t = _tiles(check_case(case, device))
    assert t["l_tiles"] >= 2 and t["lc_passes"] >= 3, t


def test_default_interpreter_config_tiles(device):
    """The interpreter's own config (no override) already runs 2 L-tiles, 2 cache-loop
    passes, persistent programs over several items and several RoPE tiles at the small
    dims."""
    case = Case(
        seed=stable_seed("default-config"),
        N=40,
        D=36,
        H=4,
        P=32,
        R=16,
        L=64,
        pad="random",
        outputs="given",
    )
    t = _tiles(check_case(case, device))
    if device == "cpu":
        assert t == {
            "items": 24,
            "programs": 3,
            "l_tiles": 2,
            "lc_passes": 2,
            "rope_tiles": 9,
        }, t
