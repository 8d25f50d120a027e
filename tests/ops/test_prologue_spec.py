"""The two-part call shape: a layer's :func:`fusemla.prologue_spec` built once, then
:func:`fusemla.mla_prologue_step` per step; and the registered op's flattened arguments.

``mla_prologue`` is built on the two, so every other prologue test exercises them too; here:
a spec reused across steps of different sizes gives what the one-call form gives, bit for bit,
each side checks what it owns and names it, and the op's pack/unpack loses nothing.
"""

from __future__ import annotations

import pytest
import torch

import fusemla
from fusemla.contracts.prologue import PrologueSpec, prepare
from fusemla.errors import FuseMLATypeError, FuseMLAValueError
from fusemla.ops.custom_ops import pack, unpack
from fusemla.quant import quantize_fp8_weight
from fusemla.testing import DEEPSEEK_V3, SMALL_DIMS, make_inputs, stable_seed

FP8 = torch.float8_e4m3fn


def _dims(device: str, H: int) -> dict:
    return dict(DEEPSEEK_V3 if device == "cuda" else SMALL_DIMS, H=H)


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(stable_seed(*parts))


def _step_args(inp):
    """The per-step positional arguments of mla_prologue_step, from a PrologueInputs."""
    return (inp.q_nope, inp.q_pe, inp.kv_c, inp.k_pe, inp.positions, inp.kv_cache, inp.slot_mapping)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("weights", ["plain", "fp8", "fp8xfp8"])
def test_spec_reused_across_steps_equals_one_call(device, kv, weights):
    """One spec, three steps (all decode, mixed, all prefill) of different sizes: outputs and
    caches equal the one-call mla_prologue's byte for byte; the reference's step form agrees
    with its one-call form too."""
    first = make_inputs(5, **_dims(device, 4), device=device, generator=_gen("spec", kv, weights))
    w = first.w_uk_t if weights == "plain" else quantize_fp8_weight(first.w_uk_t, per_head=True)
    act_quant = "fp8" if weights == "fp8xfp8" else None
    spec = fusemla.prologue_spec(w, first.cos_cache, first.sin_cache, act_quant=act_quant)
    assert isinstance(spec, PrologueSpec) and spec.act_quant == act_quant
    for i, (N, D) in enumerate([(5, 5), (9, 4), (6, 0)]):
        inp = make_inputs(
            N,
            **_dims(device, 4),
            num_decode_tokens=D,
            kv_dtype=FP8 if kv == "fp8" else None,
            kv_scale="tensor",
            pad_fraction=0.25,
            device=device,
            generator=_gen("step", kv, i),
        )
        inp.w_uk_t, inp.cos_cache, inp.sin_cache = first.w_uk_t, first.cos_cache, first.sin_cache
        cache_one = inp.kv_cache.clone()
        one = inp.run(fusemla.mla_prologue, kv_cache=cache_one, w_uk_t=w, act_quant=act_quant)
        step = fusemla.mla_prologue_step(
            spec, *_step_args(inp), num_decode_tokens=D, kv_scale=inp.kv_scale
        )
        for a, b in zip(step, one):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(inp.kv_cache.view(torch.uint8), cache_one.view(torch.uint8))
        ref_one = inp.run(
            fusemla.mla_prologue_ref, kv_cache=cache_one.clone(), w_uk_t=w, act_quant=act_quant
        )
        ref_step = fusemla.mla_prologue_step_ref(
            spec,
            inp.q_nope,
            inp.q_pe,
            inp.kv_c,
            inp.k_pe,
            inp.positions,
            cache_one.clone(),
            inp.slot_mapping,
            num_decode_tokens=D,
            kv_scale=inp.kv_scale,
        )
        for a, b in zip(ref_step, ref_one):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_step_checks_against_the_spec(device):
    inp = make_inputs(3, **_dims(device, 4), device=device, generator=_gen("step-checks"))
    spec = fusemla.prologue_spec(inp.w_uk_t, inp.cos_cache, inp.sin_cache)
    args = list(_step_args(inp))
    before = inp.kv_cache.clone()
    cases = [  # {argument index: replacement}
        ({0: inp.q_nope[:, :2]}, FuseMLAValueError, r"^q_pe: expected shape"),  # H differs
        (
            {0: inp.q_nope[:, :2], 1: inp.q_pe[:, :2]},
            FuseMLAValueError,
            r"^q_nope: expected shape \[N, H=4, P=.*the spec's w_uk_t",
        ),
        (
            {1: inp.q_pe[..., :-2], 3: inp.k_pe[..., :-2]},
            FuseMLAValueError,
            r"^q_pe: expected shape.*R=.*RoPE tables",
        ),
        ({2: inp.kv_c[:, :-2]}, FuseMLAValueError, r"^kv_c: expected shape.*L=.*w_uk_t"),
        ({0: inp.q_nope.half()}, FuseMLATypeError, r"^q_pe: expected dtype torch.float16"),
    ]
    for change, exc, pattern in cases:
        a = list(args)
        for i, bad in change.items():
            a[i] = bad
        with pytest.raises(exc, match=pattern):
            fusemla.mla_prologue_step(spec, *a)
    # every activation half: the weight fixes bf16
    half = [
        t.half() if t.dtype == torch.bfloat16 and t.dim() > 1 and j < 4 else t
        for j, t in enumerate(args)
    ]
    with pytest.raises(FuseMLATypeError, match=r"^q_nope: expected dtype torch.bfloat16"):
        fusemla.mla_prologue_step(spec, *half)
    with pytest.raises(FuseMLATypeError, match=r"^spec: expected a PrologueSpec"):
        fusemla.mla_prologue_step(inp.w_uk_t, *args)
    # nothing was launched by the failed calls
    assert torch.equal(inp.kv_cache.view(torch.uint8), before.view(torch.uint8))


def test_spec_checks_its_own_arguments(device):
    inp = make_inputs(2, **_dims(device, 4), device=device, generator=_gen("spec-checks"))
    w, cos, sin = inp.w_uk_t, inp.cos_cache, inp.sin_cache
    cases = [
        (dict(w_uk_t=w[0]), FuseMLAValueError, r"^w_uk_t: expected shape \[H, P, L\]"),
        (dict(w_uk_t=w.float()), FuseMLATypeError, r"^w_uk_t: expected dtype"),
        (dict(sin_cache=sin[:-1]), FuseMLAValueError, r"^sin_cache: expected shape"),
        (dict(cos_cache=cos[:, :0], sin_cache=sin[:, :0]), FuseMLAValueError, r"^cos_cache"),
        (dict(act_quant="int8"), FuseMLAValueError, r"^act_quant: expected None or 'fp8'"),
        (dict(act_quant="fp8"), FuseMLAValueError, r"^act_quant: 'fp8'.*needs FP8 weights"),
        (dict(q_out_dtype=FP8), FuseMLAValueError, r"^q_scale: .*needs q_scale"),
        (dict(q_out_dtype=torch.float16), FuseMLATypeError, r"^q_out_dtype: expected"),
        (dict(is_neox=1), FuseMLATypeError, r"^is_neox: expected a bool"),
    ]
    for change, exc, pattern in cases:
        kw = dict(w_uk_t=w, cos_cache=cos, sin_cache=sin)
        kw.update(change)
        with pytest.raises(exc, match=pattern):
            fusemla.prologue_spec(kw.pop("w_uk_t"), kw.pop("cos_cache"), kw.pop("sin_cache"), **kw)


@pytest.mark.parametrize("case", ["plain-float-scales", "fp8xfp8-tensor-scales"])
def test_op_arguments_pack_and_unpack(device, case):
    """What the registered op receives comes back as the same PrologueArgs."""
    inp = make_inputs(
        6,
        **_dims(device, 2),
        num_decode_tokens=4,
        kv_dtype=FP8,
        kv_scale="tensor" if "tensor" in case else "auto",
        device=device,
        generator=_gen("pack", case),
    )
    w = inp.w_uk_t
    kw = {}
    if case.startswith("fp8xfp8"):
        w = quantize_fp8_weight(w, per_head=True)
        kw = dict(act_quant="fp8", q_out_dtype=FP8, q_scale=torch.tensor([0.02], device=device))
    args = prepare(
        *list(inp.args())[:4],
        w,
        *list(inp.args())[5:],
        num_decode_tokens=4,
        is_neox=True,
        rope_applied=True,
        kv_scale=inp.kv_scale,
        **kw,
    )
    back = unpack(*pack(args))
    for name in (
        "q_nope",
        "q_pe",
        "kv_c",
        "k_pe",
        "positions",
        "kv_cache",
        "slot_mapping",
        "q",
        "q_pe_out",
        "k_pe_out",
        "cos_cache",
        "sin_cache",
    ):
        assert getattr(back, name) is getattr(args, name), name
    assert (back.num_decode_tokens, back.apply_rope, back.is_neox, back.act_quant) == (
        4,
        False,
        True,
        kw.get("act_quant"),
    )
    for name in ("kv_scale", "q_scale"):
        a, b = getattr(args, name), getattr(back, name)
        assert (a is b) if isinstance(a, torch.Tensor) else (a or 1.0) == b, name
    if isinstance(w, torch.Tensor):
        assert back.w_uk_t is w
    else:
        assert back.w_uk_t.data is w.data and back.w_uk_t.scale is w.scale


@pytest.mark.parametrize("is_neox", [False, True])
def test_rope_tables_as_views_of_the_engine_cache(device, is_neox):
    """An engine's one ``[max_position, R]`` cos_sin_cache, split into views (no copy, rows of
    stride R) by :func:`fusemla.rope.split_cos_sin_cache`, as the vLLM plugin passes it: the
    kernel gives the bytes it gives with contiguous ``[max_position, R/2]`` tables."""
    from fusemla.rope import split_cos_sin_cache

    inp = make_inputs(
        7, **_dims(device, 4), num_decode_tokens=4, device=device, generator=_gen("views", is_neox)
    )
    engine_cache = torch.cat((inp.cos_cache, inp.sin_cache), dim=-1)
    cos_v, sin_v = split_cos_sin_cache(engine_cache)
    assert cos_v.data_ptr() == engine_cache.data_ptr() and not cos_v.is_contiguous()
    outs = []
    for cos, sin in ((inp.cos_cache, inp.sin_cache), (cos_v, sin_v)):
        spec = fusemla.prologue_spec(inp.w_uk_t, cos, sin, is_neox=is_neox)
        cache = inp.kv_cache.clone()
        res = fusemla.mla_prologue_step(
            spec,
            inp.q_nope,
            inp.q_pe,
            inp.kv_c,
            inp.k_pe,
            inp.positions,
            cache,
            inp.slot_mapping,
            num_decode_tokens=4,
        )
        outs.append((res, cache))
    (a, cache_a), (b, cache_b) = outs
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert torch.equal(cache_a.view(torch.uint8), cache_b.view(torch.uint8))
    # and the rotation is real: a wrong row stride would read other positions' angles
    ref = fusemla.mla_prologue_ref(
        inp.q_nope,
        inp.q_pe,
        inp.kv_c,
        inp.k_pe,
        inp.w_uk_t,
        inp.positions,
        inp.cos_cache,
        inp.sin_cache,
        inp.kv_cache.clone(),
        inp.slot_mapping,
        num_decode_tokens=4,
        is_neox=is_neox,
    )
    assert torch.allclose(b.q_pe.float(), ref.q_pe.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(b.k_pe.float(), ref.k_pe.float(), atol=2e-2, rtol=2e-2)


def test_block_scales_that_do_not_cover_p_refused_before_anything_runs():
    """The prologue reads FP8 block scales whose rows span all of P (DeepSeek's 128 x 128 at
    P = 128); blocks of fewer rows are refused, in the spec and in the one-call API, with the
    cache and outputs untouched."""
    from fusemla.quant import QuantizedWeight

    H, P, L, R = 2, 128, 256, 64
    codes = torch.randn(H, P, L).clamp(-4, 4).to(torch.float8_e4m3fn)
    qw = QuantizedWeight(codes, torch.ones(H, 2, 2), "fp8", block=(64, 128))
    cos = torch.randn(64, R // 2)
    with pytest.raises(
        FuseMLAValueError, match=r"^w_uk_t: FP8 block scales of 64 rows cannot cover P=128"
    ):
        fusemla.prologue_spec(qw, cos, cos.clone())
    inp = make_inputs(3, H=H, P=P, R=R, L=L)
    before = inp.kv_cache.clone()
    with pytest.raises(FuseMLAValueError, match="^w_uk_t: FP8 block scales of 64 rows"):
        inp.run(fusemla.mla_prologue, w_uk_t=qw)
    assert torch.equal(inp.kv_cache.view(torch.uint8), before.view(torch.uint8))
    ok = QuantizedWeight(codes, torch.ones(H, 1, 2), "fp8", block=(128, 128))
    assert fusemla.prologue_spec(ok, cos, cos.clone()).w_uk_t is ok  # one block row: read
