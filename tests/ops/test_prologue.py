"""Fused prologue vs the unfused reference vs a float64 model (fusemla.testing.compare).

``--device=cpu`` (CI): Triton interpreter at small dims, with the interpreter's small tiles (two
L-tiles, two cache-loop passes, token chunks of at most two 16-token tiles), so the tile
arithmetic the GPU runs is exercised. ``--device=cuda``: the GPU at DeepSeek-V3 dims. Every run
uses fresh random data, poisons the outputs and the cache, and checks every cache byte.
"""

from __future__ import annotations

import pytest
import torch

from fusemla.errors import FuseMLAError, FuseMLATypeError, FuseMLAValueError
from fusemla.ops.prologue import configs, launch, policy
from fusemla.ops.prologue.api import mla_decode_prologue, mla_prologue
from fusemla.reference.prologue import mla_decode_prologue_ref, mla_prologue_ref
from fusemla.testing import (
    DEEPSEEK_V3,
    SMALL_DIMS,
    check_against_reference,
    compare,
    make_inputs,
    poisoned,
    run_and_compare,
    stable_seed,
)
from fusemla.testing.spy import recorded_launch_plans

FP8 = torch.float8_e4m3fn


def _dims(device: str, H: int) -> dict:
    dims = DEEPSEEK_V3 if device == "cuda" else SMALL_DIMS
    return dict(dims, H=H)


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(stable_seed(*parts))


KV_CASES = {
    "kv-same": (None, "auto"),
    "kv-fp8-float": (FP8, "auto"),
    "kv-fp8-tensor": (FP8, "tensor"),
}


@pytest.mark.parametrize("block_size", [16, 64], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("H", [1, 16], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("B", [1, 3, 64], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("kv", list(KV_CASES), ids=str)
@pytest.mark.parametrize("is_neox", [False, True], ids=["interleaved", "neox"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_matches_reference(device, dtype, is_neox, kv, B, H, block_size):
    kv_dtype, scale = KV_CASES[kv]
    inp = make_inputs(
        B,
        **_dims(device, H),
        dtype=dtype,
        kv_dtype=kv_dtype,
        kv_scale=scale,
        block_size=block_size,
        pad_fraction=0.25 if B > 1 else 0.0,
        device=device,
        generator=_gen(dtype, is_neox, kv, B, H, block_size),
    )
    out = None
    if B == 3:  # a given, poisoned output buffer
        out = poisoned((B, H, inp.kv_c.shape[1] + inp.q_pe.shape[2]), dtype, device)
    res = run_and_compare(mla_prologue, inp, is_neox=is_neox, out=out)
    res.assert_ok()


@pytest.mark.parametrize("split", ["all-prefill", "1+rest", "half", "33+7"])
@pytest.mark.parametrize("kv", ["kv-same", "kv-fp8-tensor"])
@pytest.mark.parametrize("rope_applied", [False, True], ids=["rope", "rope-applied"])
@pytest.mark.parametrize("is_neox", [False, True], ids=["interleaved", "neox"])
def test_mixed_batch_matches_reference(device, split, kv, rope_applied, is_neox):
    """Decode tokens first, then prefill tokens: one launch; every output and cache byte."""
    N = 40
    D = {"all-prefill": 0, "1+rest": 1, "half": 20, "33+7": 33}[split]
    kv_dtype, scale = KV_CASES[kv]
    inp = make_inputs(
        N,
        **_dims(device, 4),
        num_decode_tokens=D,
        kv_dtype=kv_dtype,
        kv_scale=scale,
        pad_fraction=0.2,
        device=device,
        generator=_gen("mixed", split, kv, rope_applied, is_neox),
    )
    dims = _dims(device, 4)
    outs = dict(
        out=poisoned((D, 4, dims["L"] + dims["R"]), torch.bfloat16, device),
        q_pe_out=poisoned((N - D, 4, dims["R"]), torch.bfloat16, device),
        k_pe_out=poisoned((N - D, dims["R"]), torch.bfloat16, device),
    )
    res = run_and_compare(mla_prologue, inp, is_neox=is_neox, rope_applied=rope_applied, **outs)
    res.assert_ok()


def test_prefill_q_pe_rotated_in_place(device):
    N, D = 12, 5
    inp = make_inputs(
        N, **_dims(device, 4), num_decode_tokens=D, device=device, generator=_gen("inplace")
    )
    before_q_pe = inp.q_pe.clone()
    cache_before = inp.kv_cache.clone()
    cache_ref = inp.kv_cache.clone()
    ref = inp.run(mla_prologue_ref, kv_cache=cache_ref)
    assert torch.equal(inp.q_pe, before_q_pe)  # the reference did not touch its input
    out = inp.run(mla_prologue, q_pe_out=inp.q_pe[D:])
    assert out.q_pe.data_ptr() == inp.q_pe[D:].data_ptr()
    assert torch.equal(out.q_pe, ref.q_pe)
    assert torch.equal(inp.q_pe[:D], before_q_pe[:D])  # decode rows untouched
    inp.q_pe = before_q_pe
    compare(inp, out, ref, inp.kv_cache, cache_ref, cache_before).assert_ok()


def _raw(x: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes over its whole storage (what a refused call must leave unchanged)."""
    return torch.empty(0, dtype=torch.uint8, device=x.device).set_(x.untyped_storage()).clone()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (NaN poison included)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_outputs_over_inputs_are_refused_rotating_in_place_is_not(device):
    """An output (or the cache) that shares memory with what the kernel reads would be written
    while another program still reads there: refused, naming both, before any byte changes;
    by the kernel and the reference alike. Allowed: vLLM's layout, where q_nope and q_pe are
    column slices of one q buffer and the prefill rows' q_pe / k_pe are rotated in place
    (q_pe_out = q_pe[D:], k_pe_out = k_pe[D:]); an output beside an input in disjoint columns
    of the same rows. Both computed as from separate tensors."""
    N, D, H = 6, 2, 2
    dims = _dims(device, H)
    P, R, L = dims["P"], dims["R"], dims["L"]
    inp = make_inputs(N, **dims, num_decode_tokens=D, device=device, generator=_gen("overlap"))
    bf16 = dict(dtype=inp.q_nope.dtype, device=device)
    cache_ref = inp.kv_cache.clone()
    want = inp.run(mla_prologue_ref, kv_cache=cache_ref)

    # vLLM's layout: q [N, H, P + R] (q_nope | q_pe), k_pe beside kv_c, rotated in place
    q = torch.cat([inp.q_nope, inp.q_pe], dim=2)
    kv = torch.cat([inp.kv_c, inp.k_pe], dim=1)
    for fn in (mla_prologue, mla_prologue_ref):
        qq, kk, cache = q.clone(), kv.clone(), inp.kv_cache.clone()
        args = list(inp.args())
        args[0:4] = qq[..., :P], qq[..., P:], kk[:, :L], kk[:, L:]
        args[8] = cache
        got = fn(*args, num_decode_tokens=D, q_pe_out=qq[D:, :, P:], k_pe_out=kk[D:, L:])
        assert got.q_pe.data_ptr() == qq[D:, :, P:].data_ptr()
        assert _same(got.q, want.q) and _same(cache, cache_ref)
        assert torch.equal(qq[D:, :, P:], want.q_pe) and torch.equal(kk[D:, L:], want.k_pe)
        # what is not an output is untouched: q_nope, the decode rows' q_pe and k_pe, kv_c
        assert torch.equal(qq[..., :P], inp.q_nope) and torch.equal(qq[:D, :, P:], inp.q_pe[:D])
        assert torch.equal(kk[:, :L], inp.kv_c) and torch.equal(kk[:D, L:], inp.k_pe[:D])

    # an output in other columns of q_nope's rows: apart, though the address ranges interleave
    wide = torch.randn(N, H, P + L + R, generator=_gen("overlap", "wide")).to(**bf16)
    wide[..., :P] = inp.q_nope
    for fn in (mla_prologue, mla_prologue_ref):
        buf = wide.clone()
        got = inp.run(fn, kv_cache=inp.kv_cache.clone(), out=buf[:D, :, P:])
        assert got.q.data_ptr() == buf[:D, :, P:].data_ptr() and torch.equal(got.q, want.q)
        assert torch.equal(buf[..., :P], inp.q_nope) and torch.equal(
            buf[D:, :, P:], wide[D:, :, P:]
        )

    # refused: (case, what to pass, message)
    over_q_nope = torch.cat([inp.q_nope.flatten(), torch.zeros(D * H * (L + R), **bf16)])
    cases = [
        (
            "out over q_nope",
            dict(
                q_nope=over_q_nope[: N * H * P].view(N, H, P),
                out=over_q_nope[P:][: D * H * (L + R)].view(D, H, L + R),
            ),
            r"out: expected memory apart from q_nope",
        ),
        (
            "q_pe_out shifted over q_pe",
            dict(q_pe_out=inp.q_pe[: N - D]),
            r"q_pe_out: .*apart from q_pe",
        ),
        ("k_pe_out over kv_c", dict(k_pe_out=inp.kv_c[D:, :R]), r"k_pe_out: .*apart from kv_c"),
        (
            "k_pe_out over k_pe's first rows",
            dict(k_pe_out=inp.k_pe[1 : N - D + 1]),
            r"k_pe_out: .*apart from k_pe",
        ),
        (
            "kv_c read from the cache",
            dict(kv_c=inp.kv_cache.view(-1, L + R)[:N, :L]),
            r"kv_cache: .*apart from kv_c",
        ),
    ]
    names = ["q_nope", "q_pe", "kv_c", "k_pe"]
    for name, kw, pattern in cases:
        args = list(inp.args())
        args[0:4] = [kw.get(n, getattr(inp, n)) for n in names]
        outs = {k: v for k, v in kw.items() if k not in names}
        watched = [*args[0:4], args[8], *outs.values()]
        for fn in (mla_prologue, mla_prologue_ref):
            before = [_raw(x) for x in watched]
            with pytest.raises(FuseMLAValueError, match=pattern) as info:
                fn(*args, num_decode_tokens=D, **outs)
            assert "got" in str(info.value), name
            for x, b in zip(watched, before):
                assert torch.equal(_raw(x), b), f"{name}: a buffer was written"


class _CountingKernel:
    """Stands in for the Triton kernel object: counts launches, then launches the real one."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def test_mixed_batch_is_one_launch(device, monkeypatch):
    counter = _CountingKernel(launch.mla_prologue_kernel)
    monkeypatch.setattr(launch, "mla_prologue_kernel", counter)
    inp = make_inputs(
        9, **_dims(device, 2), num_decode_tokens=4, device=device, generator=_gen("one-launch")
    )
    run_and_compare(mla_prologue, inp).assert_ok()
    assert counter.launches == 1


def test_compare_catches_double_rope_and_a_skipped_prefill_write(device):
    """The comparison the suite relies on fails for the bugs it must catch."""
    N, D = 10, 4
    inp = make_inputs(
        N, **_dims(device, 2), num_decode_tokens=D, device=device, generator=_gen("catch")
    )
    before = inp.kv_cache.clone()
    # rotated twice: the fused op given already-rotated inputs without rope_applied
    rotated = inp.run(mla_prologue_ref, kv_cache=before.clone())
    twice = make_inputs(
        N, **_dims(device, 2), num_decode_tokens=D, device=device, generator=_gen("catch")
    )
    twice.q_pe = torch.cat([rotated.q[..., twice.kv_c.shape[1] :], rotated.q_pe])
    out = twice.run(mla_prologue)
    res = check_against_reference(twice, out, before, rope_applied=True)
    assert not res.ok and any("q" in p for p in res.problems), res.problems
    # a prefill token whose cache row was not written
    out = inp.run(mla_prologue)
    slot = int(inp.slot_mapping[N - 1])
    if slot >= 0:
        bs = inp.kv_cache.shape[1]
        inp.kv_cache[slot // bs, slot % bs] = before[slot // bs, slot % bs]
        res = check_against_reference(inp, out, before)
        assert any(p.startswith("cache:") for p in res.problems), res.problems


@pytest.mark.parametrize(
    "variant",
    ["int32-bf16rope", "kpe-3d", "contiguous", "fp16-cache", "strided-cache", "e4m3fnuz-cache"],
)
def test_input_variants(device, variant):
    """index dtypes, bf16 RoPE caches, k_pe [N,1,R], contiguous copies, other cache dtypes."""
    kw = dict(
        dtype=torch.bfloat16,
        device=device,
        generator=_gen("variant", variant),
        pad_fraction=0.3,
        num_decode_tokens=3,
    )
    if variant == "int32-bf16rope":
        kw.update(index_dtype=torch.int32, rope_dtype=torch.bfloat16)
    if variant == "fp16-cache":
        kw.update(kv_dtype=torch.float16)
    if variant == "e4m3fnuz-cache":
        kw.update(kv_dtype=torch.float8_e4m3fnuz)
    inp = make_inputs(5, **_dims(device, 4), **kw)
    if variant == "kpe-3d":
        inp.k_pe = inp.k_pe.unsqueeze(1)  # [N, 1, R], as vLLM passes it
    elif variant == "strided-cache":  # every other slot row of a wider buffer
        wide = torch.cat([inp.kv_cache, inp.kv_cache.clone()], dim=1)
        inp.kv_cache = wide[:, ::2]
        assert not inp.kv_cache.is_contiguous()
    elif variant == "contiguous":
        for name in ("q_nope", "q_pe", "kv_c", "k_pe"):
            setattr(inp, name, getattr(inp, name).contiguous())
    if variant == "e4m3fnuz-cache" and device == "cuda" and torch.version.hip is None:
        before = inp.kv_cache.clone()
        with pytest.raises(FuseMLATypeError, match=r"kv_cache.*e4m3fnuz.*NVIDIA"):
            inp.run(mla_prologue)
        assert torch.equal(inp.kv_cache.view(torch.uint8), before.view(torch.uint8))
        return
    run_and_compare(mla_prologue, inp).assert_ok()


def test_out_of_range_positions_are_clamped_and_slots_skipped(device):
    inp = make_inputs(
        6,
        **_dims(device, 2),
        device=device,
        generator=_gen("oor"),
        max_position=64,
        num_decode_tokens=4,
    )
    n_slots = inp.kv_cache.shape[0] * inp.kv_cache.shape[1]
    inp.positions = torch.tensor([0, 63, 64, 10_000, -5, 7], device=device)
    inp.slot_mapping = torch.tensor([3, n_slots, n_slots + 1000, 5, -7, n_slots - 1], device=device)
    run_and_compare(mla_prologue, inp).assert_ok()
    # clamping means position 64 and 10_000 rotate like 63, -5 like 0
    L = inp.kv_c.shape[1]
    q = inp.run(mla_prologue).q
    inp.positions = torch.tensor([0, 63, 63, 63, 0, 7], device=device)
    q2 = inp.run(mla_prologue).q
    torch.testing.assert_close(q2[..., L:], q[..., L:], atol=0, rtol=0)


def test_debug_checks_raise(device, monkeypatch):
    monkeypatch.setenv("FUSEMLA_DEBUG_CHECKS", "1")
    inp = make_inputs(
        4, **_dims(device, 2), device=device, generator=_gen("debug"), max_position=32
    )
    before = inp.kv_cache.clone()
    inp.positions = torch.tensor([0, 1, 32, 2], device=device)
    with pytest.raises(FuseMLAValueError, match=r"positions.*\[0, 32\).*positions\[2\] = 32"):
        mla_decode_prologue(*inp.args())
    inp.positions = torch.tensor([0, 1, 2, 3], device=device)
    n_slots = inp.kv_cache.shape[0] * inp.kv_cache.shape[1]
    inp.slot_mapping = torch.tensor([0, -1, n_slots, 1], device=device)
    with pytest.raises(FuseMLAValueError, match=rf"slot_mapping.*< {n_slots}.*slot_mapping\[2\]"):
        mla_decode_prologue(*inp.args())
    assert torch.equal(inp.kv_cache.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("D", [None, 0])
def test_empty_batch(device, D):
    inp = make_inputs(0, **_dims(device, 2), device=device, num_decode_tokens=D)
    before = inp.kv_cache.clone()
    out = inp.run(mla_prologue)
    assert out.q.shape == (0, 2, inp.kv_c.shape[1] + inp.q_pe.shape[2])
    assert out.q_pe.shape == (0, 2, inp.q_pe.shape[2]) and out.k_pe.shape == (0, inp.q_pe.shape[2])
    assert torch.equal(inp.kv_cache.view(torch.uint8), before.view(torch.uint8))


def _bad_inputs(device):
    """(description, mutate(kwargs), exception class, message regex) for each host-side check."""

    def set_(**kw):
        return lambda d: d.update(kw)

    def replace(name, fn):
        return lambda d: d.update({name: fn(d[name])})

    def transposed(x):
        return x.transpose(1, 2).contiguous().transpose(1, 2)

    def zeros_u8(x):
        return torch.zeros(x.shape, dtype=torch.uint8, device=x.device)

    return [
        (
            "q_nope rank",
            replace("q_nope", lambda x: x[0]),
            FuseMLAValueError,
            r"q_nope.*\[N, H, P\]",
        ),
        (
            "q_nope dtype",
            replace("q_nope", lambda x: x.float()),
            FuseMLATypeError,
            r"q_nope.*dtype",
        ),
        ("q_pe heads", replace("q_pe", lambda x: x[:, :1]), FuseMLAValueError, r"q_pe.*shape"),
        ("q_pe odd R", replace("q_pe", lambda x: x[..., :-1]), FuseMLAValueError, r"q_pe"),
        ("q_pe dtype", replace("q_pe", lambda x: x.half()), FuseMLATypeError, r"q_pe.*bfloat16"),
        ("kv_c batch", replace("kv_c", lambda x: x[:1]), FuseMLAValueError, r"kv_c.*shape"),
        ("k_pe width", replace("k_pe", lambda x: x[:, :2]), FuseMLAValueError, r"k_pe.*shape"),
        (
            "w_uk_t shape",
            replace("w_uk_t", lambda x: x[:, :, :8]),
            FuseMLAValueError,
            r"w_uk_t.*shape",
        ),
        ("w_uk_t dtype", replace("w_uk_t", lambda x: x.half()), FuseMLATypeError, r"w_uk_t.*dtype"),
        (
            "w_uk_t layout",
            replace("w_uk_t", lambda x: torch.stack([x, x], -1)[..., 0]),
            FuseMLAValueError,
            r"w_uk_t: expected stride 1 along L .* or along P",
        ),
        ("q_nope layout", replace("q_nope", transposed), FuseMLAValueError, r"q_nope.*contiguous"),
        (
            "positions dtype",
            replace("positions", lambda x: x.float()),
            FuseMLATypeError,
            r"positions.*dtype",
        ),
        (
            "positions length",
            replace("positions", lambda x: x[:1]),
            FuseMLAValueError,
            r"positions.*shape",
        ),
        (
            "cos width",
            replace("cos_cache", lambda x: x[:, :2]),
            FuseMLAValueError,
            r"cos_cache.*shape",
        ),
        ("sin rows", replace("sin_cache", lambda x: x[:3]), FuseMLAValueError, r"sin_cache.*shape"),
        (
            "cache width",
            replace("kv_cache", lambda x: x[..., :4]),
            FuseMLAValueError,
            r"kv_cache.*shape",
        ),
        ("cache uint8", replace("kv_cache", zeros_u8), FuseMLATypeError, r"kv_cache.*view"),
        (
            "cache fp32",
            replace("kv_cache", lambda x: x.float()),
            FuseMLATypeError,
            r"kv_cache.*dtype",
        ),
        (
            "slot dtype",
            replace("slot_mapping", lambda x: x.float()),
            FuseMLATypeError,
            r"slot_mapping.*dtype",
        ),
        (
            "fp8 without scale",
            replace("kv_cache", lambda x: x.to(FP8)),
            FuseMLAValueError,
            r"kv_scale.*None",
        ),
        ("scale zero", set_(kv_scale=0.0), FuseMLAValueError, r"kv_scale.*> 0"),
        ("scale negative", set_(kv_scale=-1.0), FuseMLAValueError, r"kv_scale.*> 0"),
        ("scale nan", set_(kv_scale=float("nan")), FuseMLAValueError, r"kv_scale"),
        ("scale string", set_(kv_scale="1.0"), FuseMLATypeError, r"kv_scale"),
        (
            "scale 2 elems",
            set_(kv_scale=torch.ones(2, device=device)),
            FuseMLAValueError,
            r"kv_scale.*1-element",
        ),
        (
            "scale fp16",
            set_(kv_scale=torch.ones(1, dtype=torch.float16, device=device)),
            FuseMLATypeError,
            r"kv_scale.*dtype",
        ),
        ("out shape", set_(out="short"), FuseMLAValueError, r"out.*shape"),
        ("out dtype", set_(out="fp32"), FuseMLATypeError, r"out.*dtype"),
        ("not a tensor", set_(q_pe=[1, 2]), FuseMLATypeError, r"q_pe.*Tensor"),
        ("device", set_(positions="meta"), FuseMLATypeError, r"positions.*device"),
        (
            "num_decode too big",
            set_(num_decode_tokens=4),
            FuseMLAValueError,
            r"num_decode_tokens.*\[0, N=3\]",
        ),
        (
            "num_decode negative",
            set_(num_decode_tokens=-1),
            FuseMLAValueError,
            r"num_decode_tokens",
        ),
        ("num_decode float", set_(num_decode_tokens=1.0), FuseMLATypeError, r"num_decode_tokens"),
        (
            "k_pe_out shape",
            set_(num_decode_tokens=1, k_pe_out="short"),
            FuseMLAValueError,
            r"k_pe_out.*shape",
        ),
        (
            "q_pe_out dtype",
            set_(num_decode_tokens=1, q_pe_out="fp32"),
            FuseMLATypeError,
            r"q_pe_out.*dtype",
        ),
    ]


@pytest.mark.parametrize("case", range(35))
def test_bad_input_raises_before_writing(device, case):
    cases = _bad_inputs(device)
    assert len(cases) == 35
    name, mutate, exc, pattern = cases[case]
    inp = make_inputs(3, **_dims(device, 2), device=device, generator=_gen("bad", case))
    names = [
        "q_nope",
        "q_pe",
        "kv_c",
        "k_pe",
        "w_uk_t",
        "positions",
        "cos_cache",
        "sin_cache",
        "kv_cache",
        "slot_mapping",
    ]
    kw = dict(zip(names, inp.args()), kv_scale=None, out=None)
    mutate(kw)
    L, R = inp.kv_c.shape[1], inp.q_pe.shape[2]
    if kw["out"] == "short":
        kw["out"] = torch.empty(3, 2, 5, dtype=torch.bfloat16, device=device)
    elif kw["out"] == "fp32":
        kw["out"] = torch.empty(3, 2, L + R, dtype=torch.float32, device=device)
    if kw.get("k_pe_out") == "short":
        kw["k_pe_out"] = torch.empty(2, R - 2, dtype=torch.bfloat16, device=device)
    if kw.get("q_pe_out") == "fp32":
        kw["q_pe_out"] = torch.empty(2, 2, R, dtype=torch.float32, device=device)
        kw["out"] = torch.empty(1, 2, L + R, dtype=torch.bfloat16, device=device)
    if isinstance(kw["positions"], str):
        kw["positions"] = torch.zeros(3, dtype=torch.int64, device="meta")
    before = kw["kv_cache"].clone() if isinstance(kw["kv_cache"], torch.Tensor) else None
    for fn in (mla_prologue, mla_prologue_ref):
        with pytest.raises(exc, match=pattern) as info:
            fn(**kw)
        assert isinstance(info.value, FuseMLAError), name
        assert "got" in str(info.value), name
    if before is not None and before.dtype == kw["kv_cache"].dtype:
        assert torch.equal(kw["kv_cache"].view(torch.uint8), before.view(torch.uint8))


def test_validates_once_per_call_under_torch_compile(device, monkeypatch):
    """fullgraph compile sees one opaque op; validation runs once, at trace time: the op's
    implementation, which runs at every compiled call, never validates again."""
    from fusemla.contracts import prologue as args_mod
    from fusemla.ops.prologue import api

    runtime_validations = []

    def counting(real):
        def wrapper(*a, **k):
            if not torch.compiler.is_compiling():  # tracing: expected; run time: must not happen
                runtime_validations.append(1)
            return real(*a, **k)

        return wrapper

    monkeypatch.setattr(api, "prepare", counting(api.prepare))
    monkeypatch.setattr(args_mod, "prepare", counting(args_mod.prepare))
    inp = make_inputs(
        6,
        **_dims(device, 2),
        kv_dtype=FP8,
        kv_scale="tensor",
        device=device,
        generator=_gen("compile"),
        pad_fraction=0.3,
        num_decode_tokens=4,
    )
    cache_eager = inp.kv_cache.clone()
    eager = inp.run(mla_prologue, kv_cache=cache_eager)
    assert len(runtime_validations) == 1  # eager: exactly one validation

    def fn(*a, kv_scale):
        out = mla_prologue(*a, num_decode_tokens=4, kv_scale=kv_scale)
        return out.q * 1.0, out.q_pe * 1.0, out.k_pe * 1.0

    backend = "inductor" if device == "cuda" else "aot_eager"
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    got = compiled(*inp.args(), kv_scale=inp.kv_scale)
    compiled(*inp.args(), kv_scale=inp.kv_scale)
    assert len(runtime_validations) == 1  # the op ran twice without validating again
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert torch.equal(inp.kv_cache.view(torch.uint8), cache_eager.view(torch.uint8))


def test_forced_dot_scaled_that_cannot_run_raises(device, monkeypatch):
    """A forced FUSEMLA_MXFP4_PATH=dot_scaled whose tiles tl.dot_scaled cannot take raises,
    naming the variable; auto quietly uses the dequant path (a documented choice)."""
    from fusemla import platform
    from fusemla.quant import quantize_mxfp4_weight

    info = platform.detect(device)
    if device == "cuda" and not info.native_fp4:
        pytest.skip("forcing dot_scaled on a GPU without FP4 raises earlier (tested in core)")
    monkeypatch.setenv("FUSEMLA_MXFP4_PATH", "dot_scaled")
    inp = make_inputs(3, H=2, P=96, R=16, L=64, device=device, generator=_gen("mx"))
    qw = quantize_mxfp4_weight(inp.w_uk_t)
    with pytest.raises(FuseMLAValueError, match=r"FUSEMLA_MXFP4_PATH=dot_scaled.*P=96"):
        inp.run(mla_prologue, w_uk_t=qw)
    monkeypatch.setenv("FUSEMLA_MXFP4_PATH", "auto")
    v = policy.choose_prologue_variant(info, weight_format="mxfp4", P=96, L=64, block_l=32)
    assert v.mxfp4_path == "dequant"


@pytest.mark.parametrize(
    "cfg",
    [
        dict(BLOCK_T=16, programs_per_sm=0.02),
        dict(BLOCK_T=16, programs_per_sm=0, CACHE_ROWS=1),
        dict(BLOCK_L=16, BLOCK_LC=16, ROPE_ROWS=16, CACHE_ROWS=4),
    ],
    ids=["persistent", "program-per-item", "narrow-tiles"],
)
def test_forced_tiling(device, cfg):
    """Persistent BMM programs walking several work items, one program per item, several
    L-tiles, cache-loop passes and a cache tile with a tail, on CPU and GPU alike."""
    inp = make_inputs(
        50,
        **_dims(device, 3),
        num_decode_tokens=45,
        kv_dtype=FP8,
        device=device,
        generator=_gen("tiling", sorted(cfg.items())),
        pad_fraction=0.1,
    )
    with configs.override(**cfg), recorded_launch_plans() as plans:
        run_and_compare(mla_prologue, inp).assert_ok()
    # what the launcher ran: the forced tiles, and the program counts they imply
    assert len(plans) == 1, plans
    p = plans[0]
    assert {k: p.cfg[k] for k in cfg} == cfg
    if cfg.get("programs_per_sm"):
        assert 1 <= p.n_bmm < p.bmm_items  # programs loop over several items
    elif cfg.get("programs_per_sm") == 0:
        assert p.n_bmm == p.bmm_items
    if "BLOCK_L" in cfg:
        assert p.l_tiles >= 2 and p.lc_passes >= 2


@pytest.mark.gpu
def test_cuda_graph_replay_reads_new_inputs_and_scale(device):
    """Capture once; new tokens, positions, slots and kv_scale take effect on replay."""
    g = _gen("graph")
    N, D = 8, 5
    kw = dict(kv_dtype=FP8, kv_scale="tensor", device=device, num_blocks=8, num_decode_tokens=D)
    inp = make_inputs(N, **_dims(device, 16), generator=g, **kw)
    L, R = inp.kv_c.shape[1], inp.q_pe.shape[2]
    outs = dict(
        out=torch.empty(D, 16, L + R, dtype=inp.q_nope.dtype, device=device),
        q_pe_out=torch.empty(N - D, 16, R, dtype=inp.q_nope.dtype, device=device),
        k_pe_out=torch.empty(N - D, R, dtype=inp.q_nope.dtype, device=device),
    )
    inp.run(mla_prologue, **outs)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        inp.run(mla_prologue, **outs)
    for _step in range(3):
        fresh = make_inputs(N, **_dims(device, 16), generator=g, pad_fraction=0.3, **kw)
        for name in (
            "q_nope",
            "q_pe",
            "kv_c",
            "k_pe",
            "w_uk_t",
            "positions",
            "cos_cache",
            "sin_cache",
            "slot_mapping",
        ):
            getattr(inp, name).copy_(getattr(fresh, name))
        inp.kv_scale.copy_(fresh.kv_scale)
        inp.kv_cache.copy_(fresh.kv_cache)
        before = fresh.kv_cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        fresh.kv_cache = inp.kv_cache
        res = check_against_reference(
            fresh, (outs["out"], outs["q_pe_out"], outs["k_pe_out"]), before
        )
        res.assert_ok()


@pytest.mark.gpu
@pytest.mark.parametrize("H,B,D", [(128, 128, 128), (128, 512, 512), (16, 512, 512), (16, 544, 32)])
def test_large_batch(device, H, B, D):
    """Full heads, and H=16 with 512 tokens: several token chunks on the GPU's own config."""
    inp = make_inputs(
        B,
        **_dims(device, H),
        block_size=64,
        device=device,
        generator=_gen("large", H, B, D),
        pad_fraction=0.1,
        num_decode_tokens=D,
    )
    run_and_compare(mla_prologue, inp).assert_ok()


def test_decode_alias_equals_mla_prologue(device):
    inp = make_inputs(7, **_dims(device, 2), device=device, generator=_gen("alias"))
    c1, c2 = inp.kv_cache.clone(), inp.kv_cache.clone()
    q1 = mla_decode_prologue(*inp.args()[:8], c1, inp.slot_mapping)
    q2 = mla_prologue(*inp.args()[:8], c2, inp.slot_mapping).q
    q3 = mla_decode_prologue_ref(*inp.args()[:8], inp.kv_cache.clone(), inp.slot_mapping)
    assert torch.equal(q1, q2) and q1.shape == q3.shape
    assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_pdl_under_torch_compile(device, mode, monkeypatch):
    """PDL on inside a torch.compile'd step whose inductor kernels produce the prologue's
    inputs right before it (and, with reduce-overhead, CUDA graphs): several calls with new
    inputs, outputs poisoned, results against the reference every time."""
    from fusemla import platform

    if not platform.supports_pdl(platform.detect(device)):
        pytest.skip("no programmatic dependent launch here")
    monkeypatch.setenv("FUSEMLA_PDL", "on")
    assert policy.choose_pdl(platform.detect(device))
    g = _gen("pdl-compile", mode)
    N, D, H = 40, 32, 16
    inp = make_inputs(N, **_dims(device, H), num_decode_tokens=D, device=device, generator=g)
    src_q, src_kv = inp.q_nope.clone(), inp.kv_c.clone()
    scale = torch.ones((), device=device)

    def step(src_q, src_kv, scale):
        q_nope = src_q * scale  # inductor kernels writing the prologue's inputs
        kv_c = src_kv * scale
        return mla_prologue(
            q_nope,
            inp.q_pe,
            kv_c,
            inp.k_pe,
            inp.w_uk_t,
            inp.positions,
            inp.cos_cache,
            inp.sin_cache,
            inp.kv_cache,
            inp.slot_mapping,
            num_decode_tokens=D,
            kv_scale=inp.kv_scale,
        )

    compiled = torch.compile(step, fullgraph=True, mode=None if mode == "default" else mode)
    for _ in range(3):
        fresh = make_inputs(N, **_dims(device, H), num_decode_tokens=D, device=device, generator=g)
        for name in ("q_nope", "q_pe", "kv_c", "k_pe", "positions", "slot_mapping"):
            getattr(inp, name).copy_(getattr(fresh, name))
        src_q.copy_(inp.q_nope)
        src_kv.copy_(inp.kv_c)
        before = inp.kv_cache.clone()
        out = compiled(src_q, src_kv, scale)
        torch.cuda.synchronize()
        res = check_against_reference(inp, tuple(t.clone() for t in out), before)
        res.assert_ok()


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["on", "off"])
def test_pdl_behind_a_triton_producer_in_a_cuda_graph(device, pdl, monkeypatch):
    """A producer writes the prologue's inputs right before it, inside a CUDA graph; with PDL the
    prologue starts early. Replays with new inputs must never see stale ones."""
    from fusemla import platform
    from fusemla.testing.pdl_probe import produce

    if pdl == "on" and not platform.supports_pdl(platform.detect(device)):
        pytest.skip("no programmatic dependent launch here")
    monkeypatch.setenv("FUSEMLA_PDL", pdl)
    g = _gen("pdl", pdl)
    N, D, H = 96, 80, 16
    inp = make_inputs(N, **_dims(device, H), num_decode_tokens=D, device=device, generator=g)
    q_base = inp.q_nope._base if inp.q_nope._base is not None else inp.q_nope
    kv_base = inp.kv_c._base if inp.kv_c._base is not None else inp.kv_c
    srcs = [torch.empty_like(q_base), torch.empty_like(kv_base)]
    L, R = inp.kv_c.shape[1], inp.q_pe.shape[2]
    outs = dict(
        out=torch.empty(D, H, L + R, dtype=torch.bfloat16, device=device),
        q_pe_out=torch.empty(N - D, H, R, dtype=torch.bfloat16, device=device),
        k_pe_out=torch.empty(N - D, R, dtype=torch.bfloat16, device=device),
    )

    def step():
        produce(srcs[0], q_base, 1.0, pdl=pdl == "on")
        produce(srcs[1], kv_base, 1.0, pdl=pdl == "on")
        inp.run(mla_prologue, **outs)

    for s in srcs:
        s.copy_(torch.randn(s.shape, generator=g).to(s.dtype))
    step()  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        for s in srcs:
            s.copy_(torch.randn(s.shape, generator=g).to(s.dtype))
        q_base.fill_(float("nan"))  # stale inputs would show as NaN or old values
        kv_base.fill_(float("nan"))
        before = inp.kv_cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        res = check_against_reference(
            inp, (outs["out"], outs["q_pe_out"], outs["k_pe_out"]), before
        )
        res.assert_ok()
