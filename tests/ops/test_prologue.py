"""Fused decode prologue vs the unfused reference vs a float64 model.

``--device=cpu`` (CI): Triton interpreter at small dims. ``--device=cuda``: the GPU at DeepSeek-V3
dims. Every run uses fresh random data, poisons the output and the cache, and checks every cache
byte: the rows of the given slots against the reference, all others unchanged.
"""

from __future__ import annotations

import pytest
import torch

from fusemla.errors import FuseMLAError, FuseMLATypeError, FuseMLAValueError
from fusemla.ops.decode_prologue import mla_decode_prologue
from fusemla.reference import mla_decode_prologue_ref, quantize_fp8
from fusemla.testing import (
    DEEPSEEK_V3, fp8_ordinal, make_inputs, prologue_model_f64, rel_err, scale_value,
)

SMALL = dict(P=32, R=16, L=64)
FULL = dict(P=DEEPSEEK_V3["P"], R=DEEPSEEK_V3["R"], L=DEEPSEEK_V3["L"])

# relative L2 error vs the float64 model (one rounding of the output + bf16/fp16 operands)
REL_TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3}
# kernel vs unfused reference, elementwise: one output ulp (accumulation order may differ)
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}

FP8 = torch.float8_e4m3fn


def _dims(device: str, H: int) -> dict:
    return dict(H=H, **(FULL if device == "cuda" else SMALL))


def _valid_slots(slot_mapping: torch.Tensor, n_slots: int) -> torch.Tensor:
    s = slot_mapping.long().cpu()
    return (s >= 0) & (s < n_slots)


def _run_both(inp, is_neox, use_out=False):
    """Run kernel and reference on identical poisoned copies; return (q, q_ref, cache, cache_ref)."""
    cache_ref = inp.kv_cache.clone()
    cache_before = inp.kv_cache.clone()
    out = None
    if use_out:
        B, H = inp.q_nope.shape[:2]
        width = inp.kv_c.shape[1] + inp.q_pe.shape[2]
        out = torch.full((B, H, width), float("nan"), dtype=inp.q_nope.dtype,
                         device=inp.q_nope.device)
    q = mla_decode_prologue(*inp.args(), is_neox=is_neox, kv_scale=inp.kv_scale, out=out)
    if use_out:
        assert q.data_ptr() == out.data_ptr()
    args = list(inp.args())
    args[8] = cache_ref
    q_ref = mla_decode_prologue_ref(*args, is_neox=is_neox, kv_scale=inp.kv_scale)
    return q, q_ref, inp.kv_cache, cache_ref, cache_before


def _check_cache(inp, cache, cache_ref, cache_before, rows64, is_neox):
    """Every byte of the cache: valid slots hold the reference row, all others are unchanged."""
    L = inp.kv_c.shape[1]
    flat = cache.view(-1, cache.shape[-1]).cpu()
    flat_ref = cache_ref.view(-1, cache.shape[-1]).cpu()
    flat_before = cache_before.view(-1, cache.shape[-1]).cpu()
    valid = _valid_slots(inp.slot_mapping, flat.shape[0])
    slots = inp.slot_mapping.long().cpu()[valid]
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    written[slots] = True
    # untouched rows: byte-identical to the poison
    assert torch.equal(flat[~written].view(torch.uint8), flat_before[~written].view(torch.uint8))
    if slots.numel() == 0:
        return
    got, want = flat[slots], flat_ref[slots]
    if cache.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        # the latent part is a pure scaled copy: byte-equal to torch's saturating cast
        exact = quantize_fp8(inp.kv_c.cpu()[valid].float(), scale_value(inp.kv_scale), cache.dtype)
        assert torch.equal(got[:, :L].view(torch.uint8), exact.view(torch.uint8))
        # the rope part: same bytes as the reference's cast, or (FMA on the GPU) one FP8 step away
        step = (fp8_ordinal(got[:, L:]) - fp8_ordinal(want[:, L:])).abs()
        assert int(step.max()) <= (0 if inp.q_nope.device.type == "cpu" else 1)
        assert not torch.isnan(got.float()).any()
        deq = got.float() * scale_value(inp.kv_scale)
        ref64 = rows64[valid]
        fmax = torch.finfo(cache.dtype).max * scale_value(inp.kv_scale)
        err = (deq.double() - ref64.clamp(-fmax, fmax)).abs()
        assert bool((err <= ref64.abs().clamp(-fmax, fmax) * 2 ** -4 + 2e-9 + 2 ** -9 * scale_value(inp.kv_scale)).all())
    else:
        assert not torch.isnan(got.float()).any()
        # latent part: exact copy
        assert torch.equal(got[:, :L], inp.kv_c.cpu()[valid].to(cache.dtype))
        # rope part: one ulp, plus fp32 rounding under cancellation where the GPU contracts FMAs
        atol = 0.0 if inp.q_nope.device.type == "cpu" else 1e-6
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=ULP[cache.dtype])
        assert rel_err(got, rows64[valid]) < REL_TOL[cache.dtype]


def _check_q(inp, q, q_ref, q64):
    dtype = inp.q_nope.dtype
    L = inp.kv_c.shape[1]
    assert q.dtype == dtype and q.shape == q64.shape
    assert not torch.isnan(q.float()).any(), "some of q was not written"
    assert rel_err(q[..., :L], q64[..., :L]) < REL_TOL[dtype]
    assert rel_err(q[..., L:], q64[..., L:]) < REL_TOL[dtype]
    torch.testing.assert_close(q.float().cpu(), q_ref.float().cpu(), atol=1e-3,
                               rtol=ULP[dtype])


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
def test_matches_reference(device, dtype, is_neox, kv, B, H, block_size):
    kv_dtype, scale = KV_CASES[kv]
    g = torch.Generator().manual_seed(hash((str(dtype), is_neox, kv, B, H, block_size)) % 2**31)
    inp = make_inputs(B, **_dims(device, H), dtype=dtype, kv_dtype=kv_dtype, kv_scale=scale,
                      block_size=block_size, pad_fraction=0.25 if B > 1 else 0.0,
                      device=device, generator=g)
    q, q_ref, cache, cache_ref, before = _run_both(inp, is_neox, use_out=(B == 3))
    q64, rows64 = prologue_model_f64(inp, is_neox)
    _check_q(inp, q, q_ref, q64)
    _check_cache(inp, cache, cache_ref, before, rows64, is_neox)


@pytest.mark.parametrize("variant", ["int32-bf16rope", "kpe-2d", "contiguous", "fp16-cache",
                                     "strided-cache"])
def test_input_variants(device, variant):
    """index dtypes, bf16 RoPE caches, k_pe without the head dim, contiguous copies, mixed cache dtype."""
    g = torch.Generator().manual_seed(7)
    kw = dict(dtype=torch.bfloat16, device=device, generator=g, pad_fraction=0.3)
    if variant == "int32-bf16rope":
        kw.update(index_dtype=torch.int32, rope_dtype=torch.bfloat16)
    if variant == "fp16-cache":
        kw.update(kv_dtype=torch.float16)
    inp = make_inputs(5, **_dims(device, 4), **kw)
    if variant == "kpe-2d":
        inp.k_pe = inp.k_pe.reshape(5, -1)
    elif variant == "strided-cache":  # every other slot row of a wider buffer
        wide = torch.cat([inp.kv_cache, inp.kv_cache.clone()], dim=1)
        inp.kv_cache = wide[:, ::2]
        assert not inp.kv_cache.is_contiguous()
    elif variant == "contiguous":
        for name in ("q_nope", "q_pe", "kv_c", "k_pe"):
            setattr(inp, name, getattr(inp, name).contiguous())
    else:
        inp.k_pe = inp.k_pe.unsqueeze(1)  # [B, 1, R], as vLLM passes it
    q, q_ref, cache, cache_ref, before = _run_both(inp, is_neox=False)
    q64, rows64 = prologue_model_f64(inp, False)
    _check_q(inp, q, q_ref, q64)
    _check_cache(inp, cache, cache_ref, before, rows64, False)


def test_out_of_range_positions_are_clamped_and_slots_skipped(device):
    g = torch.Generator().manual_seed(11)
    inp = make_inputs(6, **_dims(device, 2), device=device, generator=g, max_position=64)
    n_slots = inp.kv_cache.shape[0] * inp.kv_cache.shape[1]
    inp.positions = torch.tensor([0, 63, 64, 10_000, -5, 7], device=device)
    inp.slot_mapping = torch.tensor([3, n_slots, n_slots + 1000, 5, -7, n_slots - 1],
                                    device=device)
    q, q_ref, cache, cache_ref, before = _run_both(inp, is_neox=False)
    q64, rows64 = prologue_model_f64(inp, False)  # the model clamps positions too
    _check_q(inp, q, q_ref, q64)
    _check_cache(inp, cache, cache_ref, before, rows64, False)
    # clamping means position 64 and 10_000 rotate like 63, -5 like 0
    L = inp.kv_c.shape[1]
    inp2 = make_inputs(6, **_dims(device, 2), device=device, generator=g, max_position=64)
    inp2.q_pe = inp.q_pe.clone()
    inp2.cos_cache, inp2.sin_cache = inp.cos_cache, inp.sin_cache
    inp2.positions = torch.tensor([0, 63, 63, 63, 0, 7], device=device)
    q2 = mla_decode_prologue(*inp2.args())
    torch.testing.assert_close(q2[..., L:], q[..., L:], atol=0, rtol=0)


def test_debug_checks_raise(device, monkeypatch):
    monkeypatch.setenv("FUSEMLA_DEBUG_CHECKS", "1")
    g = torch.Generator().manual_seed(3)
    inp = make_inputs(4, **_dims(device, 2), device=device, generator=g, max_position=32)
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


def test_empty_batch(device):
    inp = make_inputs(0, **_dims(device, 2), device=device)
    before = inp.kv_cache.clone()
    q = mla_decode_prologue(*inp.args())
    assert q.shape == (0, 2, inp.kv_c.shape[1] + inp.q_pe.shape[2])
    assert torch.equal(inp.kv_cache.view(torch.uint8), before.view(torch.uint8))


def _bad_inputs(device):
    """(description, mutate(kwargs), exception class, message regex) for each host-side check."""
    def set_(**kw):
        return lambda d: d.update(kw)

    def replace(name, fn):
        return lambda d: d.update({name: fn(d[name])})

    return [
        ("q_nope rank", replace("q_nope", lambda x: x[0]), FuseMLAValueError, r"q_nope.*\[B, H, P\]"),
        ("q_nope dtype", replace("q_nope", lambda x: x.float()), FuseMLATypeError, r"q_nope.*dtype"),
        ("q_pe heads", replace("q_pe", lambda x: x[:, :1]), FuseMLAValueError, r"q_pe.*shape"),
        ("q_pe odd R", replace("q_pe", lambda x: x[..., :-1]), FuseMLAValueError, r"q_pe"),
        ("q_pe dtype", replace("q_pe", lambda x: x.half()), FuseMLATypeError, r"q_pe.*bfloat16"),
        ("kv_c batch", replace("kv_c", lambda x: x[:1]), FuseMLAValueError, r"kv_c.*shape"),
        ("k_pe width", replace("k_pe", lambda x: x[:, :2]), FuseMLAValueError, r"k_pe.*shape"),
        ("w_uk_t shape", replace("w_uk_t", lambda x: x[:, :, :8]), FuseMLAValueError, r"w_uk_t.*shape"),
        ("w_uk_t dtype", replace("w_uk_t", lambda x: x.half()), FuseMLATypeError, r"w_uk_t.*dtype"),
        ("w_uk_t layout", replace("w_uk_t", lambda x: x.transpose(1, 2).contiguous().transpose(1, 2)),
         FuseMLAValueError, r"w_uk_t.*contiguous"),
        ("q_nope layout", replace("q_nope", lambda x: x.transpose(1, 2).contiguous().transpose(1, 2)),
         FuseMLAValueError, r"q_nope.*contiguous"),
        ("positions dtype", replace("positions", lambda x: x.float()), FuseMLATypeError, r"positions.*dtype"),
        ("positions length", replace("positions", lambda x: x[:1]), FuseMLAValueError, r"positions.*shape"),
        ("cos width", replace("cos_cache", lambda x: x[:, :2]), FuseMLAValueError, r"cos_cache.*shape"),
        ("sin rows", replace("sin_cache", lambda x: x[:3]), FuseMLAValueError, r"sin_cache.*shape"),
        ("cache width", replace("kv_cache", lambda x: x[..., :4]), FuseMLAValueError, r"kv_cache.*shape"),
        ("cache uint8", replace("kv_cache", lambda x: torch.zeros(x.shape, dtype=torch.uint8, device=x.device)),
         FuseMLATypeError, r"kv_cache.*view"),
        ("cache fp32", replace("kv_cache", lambda x: x.float()), FuseMLATypeError, r"kv_cache.*dtype"),
        ("slot dtype", replace("slot_mapping", lambda x: x.float()), FuseMLATypeError, r"slot_mapping.*dtype"),
        ("fp8 without scale", replace("kv_cache", lambda x: x.to(FP8)), FuseMLAValueError, r"kv_scale.*None"),
        ("scale zero", set_(kv_scale=0.0), FuseMLAValueError, r"kv_scale.*> 0"),
        ("scale negative", set_(kv_scale=-1.0), FuseMLAValueError, r"kv_scale.*> 0"),
        ("scale nan", set_(kv_scale=float("nan")), FuseMLAValueError, r"kv_scale"),
        ("scale string", set_(kv_scale="1.0"), FuseMLATypeError, r"kv_scale"),
        ("scale 2 elems", set_(kv_scale=torch.ones(2, device=device)), FuseMLAValueError, r"kv_scale.*1-element"),
        ("scale fp16", set_(kv_scale=torch.ones(1, dtype=torch.float16, device=device)), FuseMLATypeError, r"kv_scale.*dtype"),
        ("out shape", set_(out="short"), FuseMLAValueError, r"out.*shape"),
        ("out dtype", set_(out="fp32"), FuseMLATypeError, r"out.*dtype"),
        ("not a tensor", set_(q_pe=[1, 2]), FuseMLATypeError, r"q_pe.*Tensor"),
        ("device", set_(positions="meta"), FuseMLATypeError, r"positions.*device"),
    ]


@pytest.mark.parametrize("case", range(30))
def test_bad_input_raises_before_writing(device, case):
    cases = _bad_inputs(device)
    if case >= len(cases):
        pytest.skip("no such case")
    name, mutate, exc, pattern = cases[case]
    inp = make_inputs(3, **_dims(device, 2), device=device, generator=torch.Generator().manual_seed(case))
    names = ["q_nope", "q_pe", "kv_c", "k_pe", "w_uk_t", "positions", "cos_cache", "sin_cache",
             "kv_cache", "slot_mapping"]
    kw = dict(zip(names, inp.args()), kv_scale=None, out=None)
    mutate(kw)
    if kw["out"] == "short":
        kw["out"] = torch.empty(3, 2, 5, dtype=torch.bfloat16, device=device)
    elif kw["out"] == "fp32":
        L, R = inp.kv_c.shape[1], inp.q_pe.shape[2]
        kw["out"] = torch.empty(3, 2, L + R, dtype=torch.float32, device=device)
    if isinstance(kw["positions"], str):
        kw["positions"] = kw["positions"] = torch.zeros(3, dtype=torch.int64, device="meta")
    before = kw["kv_cache"].clone() if isinstance(kw["kv_cache"], torch.Tensor) else None
    for fn in (mla_decode_prologue, mla_decode_prologue_ref):
        with pytest.raises(exc, match=pattern) as info:
            fn(**kw)
        assert isinstance(info.value, FuseMLAError), name
        assert "got" in str(info.value), name
    if before is not None and before.dtype == kw["kv_cache"].dtype:
        assert torch.equal(kw["kv_cache"].view(torch.uint8), before.view(torch.uint8))


def test_custom_op_under_torch_compile(device):
    """fullgraph compile sees one opaque op that mutates q and the cache."""
    g = torch.Generator().manual_seed(5)
    inp = make_inputs(4, **_dims(device, 2), kv_dtype=FP8, kv_scale="tensor", device=device,
                      generator=g, pad_fraction=0.3)
    cache_eager = inp.kv_cache.clone()
    args = list(inp.args())
    args[8] = cache_eager
    q_eager = mla_decode_prologue(*args, kv_scale=inp.kv_scale)

    def fn(*a, kv_scale):
        return mla_decode_prologue(*a, kv_scale=kv_scale) * 1.0

    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    q = compiled(*inp.args(), kv_scale=inp.kv_scale)
    torch.testing.assert_close(q, q_eager, atol=0, rtol=0)
    assert torch.equal(inp.kv_cache.view(torch.uint8), cache_eager.view(torch.uint8))


@pytest.mark.gpu
def test_cuda_graph_replay_reads_new_inputs_and_scale(device):
    """Capture once; new tokens, positions, slots and kv_scale take effect on replay."""
    g = torch.Generator().manual_seed(9)
    B = 8
    inp = make_inputs(B, **_dims(device, 16), kv_dtype=FP8, kv_scale="tensor", device=device,
                      generator=g, num_blocks=8)
    out = torch.empty(B, 16, inp.kv_c.shape[1] + inp.q_pe.shape[2], dtype=inp.q_nope.dtype,
                      device=device)
    mla_decode_prologue(*inp.args(), kv_scale=inp.kv_scale, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_prologue(*inp.args(), kv_scale=inp.kv_scale, out=out)
    fresh = make_inputs(B, **_dims(device, 16), kv_dtype=FP8, kv_scale="tensor", device=device,
                        generator=g, num_blocks=8, pad_fraction=0.3)
    for name in ("q_nope", "q_pe", "kv_c", "k_pe", "w_uk_t", "positions", "cos_cache",
                 "sin_cache", "slot_mapping"):
        getattr(inp, name).copy_(getattr(fresh, name))
    inp.kv_scale.copy_(fresh.kv_scale)
    inp.kv_cache.copy_(fresh.kv_cache)
    graph.replay()
    torch.cuda.synchronize()
    cache_ref = fresh.kv_cache.clone()
    args = list(fresh.args())
    args[8] = cache_ref
    q_ref = mla_decode_prologue_ref(*args, kv_scale=fresh.kv_scale)
    q64, rows64 = prologue_model_f64(fresh, False)
    _check_q(fresh, out, q_ref, q64)
    _check_cache(fresh, inp.kv_cache, cache_ref, fresh.kv_cache, rows64, False)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [128, 512])
def test_large_batch_full_heads(device, B):
    g = torch.Generator().manual_seed(B)
    inp = make_inputs(B, **_dims(device, 128), block_size=64, device=device, generator=g,
                      pad_fraction=0.1)
    q, q_ref, cache, cache_ref, before = _run_both(inp, is_neox=False)
    q64, rows64 = prologue_model_f64(inp, False)
    _check_q(inp, q, q_ref, q64)
    _check_cache(inp, cache, cache_ref, before, rows64, False)
