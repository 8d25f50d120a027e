"""The decode prologue with FP8 / MXFP4 weights and FP8 query output.

Each variant is held to a reference that quantizes the same way (exact up to accumulation
order) and to the bf16-weight float64 model (within the format's error). CPU: the Triton
interpreter at small dims; GPU (``--device=cuda``): DeepSeek-V3 dims.
"""

from __future__ import annotations

import pytest
import torch

from fusemla import platform
from fusemla.errors import FuseMLAValueError
from fusemla.ops.prologue.api import mla_decode_prologue, mla_prologue
from fusemla.quant import QuantizedWeight, quantize_fp8_weight, quantize_mxfp4_weight
from fusemla.reference.prologue import mla_decode_prologue_ref
from fusemla.testing import (
    DEEPSEEK_V3,
    SMALL_DIMS,
    TOL,
    make_inputs,
    rel_err,
    run_and_compare,
    stable_seed,
    weight_kind,
)

FP8 = torch.float8_e4m3fn


def _dims(device: str, H: int) -> dict:
    if device == "cuda":
        return dict(DEEPSEEK_V3, H=H)
    return dict(SMALL_DIMS, H=H, P=64)  # P = 64: two MXFP4 scale blocks per column


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(stable_seed(*parts))


def _quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    if fmt == "fp8-tensor":
        return quantize_fp8_weight(w, dtype=FP8)
    if fmt == "fp8-head":
        return quantize_fp8_weight(w, dtype=FP8, per_head=True)
    if fmt == "fp8-block":  # rows cover P; columns cut L into several blocks per BLOCK_L tile
        P, L = w.shape[1:]
        return quantize_fp8_weight(w, dtype=FP8, block=(P, 128 if P >= 128 else 16))
    return quantize_mxfp4_weight(w)


@pytest.mark.parametrize("B,D", [(1, 1), (3, 3), (40, 40), (40, 23)], ids=lambda x: str(x))
@pytest.mark.parametrize("fmt", ["fp8-tensor", "fp8-head", "fp8-block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp8_weights(device, dtype, fmt, B, D):
    inp = make_inputs(
        B,
        **_dims(device, 4),
        dtype=dtype,
        kv_dtype=FP8 if B == 3 else None,
        pad_fraction=0.25 if B > 1 else 0.0,
        device=device,
        num_decode_tokens=D,
        generator=_gen(dtype, fmt, B, D),
    )
    qw = _quantize(inp.w_uk_t, fmt)
    run_and_compare(mla_prologue, inp, w_uk_t=qw).assert_ok()


@pytest.mark.parametrize("D", [5, 40], ids=lambda d: f"D{d}")  # small / medium tile bucket
@pytest.mark.parametrize(
    "weights,layout",
    [
        ("bf16", "contiguous"),
        ("bf16", "k_major"),
        ("bf16", "vllm_view"),
        ("fp8-head", "contiguous"),
        ("fp8-head", "k_major"),
        ("fp8-head", "heads_apart"),
        ("fp8-head", "heads_apart_k_major"),
        ("fp8xfp8", "contiguous"),
        ("fp8xfp8", "k_major"),
    ],
)
def test_weight_layouts(device, weights, layout, D):
    """The kernel reads W_UK_T in any layout with stride 1 along L or P: contiguous, K-major
    (quantize_fp8_weight's default), each of those per head with NaN codes between the heads
    (a view of one side of a checkpoint's kv_b_proj: split_kv_b_proj_fp8(share=True)) and, for
    a plain weight, vLLM's permuted view of W_UK [L, H, P] (strides (P, 1, H * P)); every
    layout gives the bytes the contiguous one gives."""
    inp = make_inputs(
        D,
        **_dims(device, 4),
        dtype=torch.bfloat16,
        device=device,
        generator=_gen("layouts", weights, layout, D),
    )

    def laid_out(x: torch.Tensor) -> torch.Tensor:
        if layout == "contiguous":
            return x.contiguous()
        if layout == "k_major":
            return x.transpose(1, 2).contiguous().transpose(1, 2)
        if layout.startswith("heads_apart"):  # 3 rows of NaN codes after each head
            t = x.transpose(1, 2) if layout.endswith("k_major") else x
            buf = torch.empty(
                t.shape[0], t.shape[1] + 3, t.shape[2], dtype=x.dtype, device=x.device
            )
            buf.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN: a read past a head shows
            buf[:, : t.shape[1]].copy_(t)
            t = buf[:, : t.shape[1]]
            return t.transpose(1, 2) if layout.endswith("k_major") else t
        return x.permute(2, 0, 1).contiguous().permute(1, 2, 0)  # [L, H, P] storage

    kw = {"act_quant": "fp8"} if weights == "fp8xfp8" else {}
    if weights == "bf16":
        w, w_ref = laid_out(inp.w_uk_t), inp.w_uk_t.contiguous()
    else:
        q = quantize_fp8_weight(inp.w_uk_t, per_head=True, k_major=False)
        w, w_ref = QuantizedWeight(laid_out(q.data), q.scale, "fp8"), q
    along_p = layout in ("k_major", "heads_apart_k_major", "vllm_view")
    assert (w.stride() if weights == "bf16" else w.data.stride())[1 if along_p else 2] == 1
    cache0 = inp.kv_cache.clone()
    out = inp.run(mla_prologue, w_uk_t=w, **kw)
    cache = inp.kv_cache.clone()
    inp.kv_cache.copy_(cache0)
    want = inp.run(mla_prologue, w_uk_t=w_ref, **kw)
    assert torch.equal(out.q.view(torch.int16), want.q.view(torch.int16))
    assert torch.equal(cache.view(torch.uint8), inp.kv_cache.view(torch.uint8))
    run_and_compare(mla_prologue, inp, w_uk_t=w, **kw).assert_ok()


@pytest.mark.parametrize("path", ["dequant", "dot_scaled"])
@pytest.mark.parametrize("B", [1, 3, 40], ids=lambda b: f"B{b}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mxfp4_weights(device, dtype, B, path, monkeypatch):
    info = platform.detect(device)
    if path == "dot_scaled" and device == "cuda" and not info.native_fp4:
        pytest.skip(f"no native FP4 on {info.arch}")
    monkeypatch.setenv("FUSEMLA_MXFP4_PATH", path)  # the interpreter emulates tl.dot_scaled
    inp = make_inputs(
        B,
        **_dims(device, 4),
        dtype=dtype,
        pad_fraction=0.25 if B > 1 else 0.0,
        device=device,
        generator=_gen(dtype, B, path),
    )
    qw = _quantize(inp.w_uk_t, "mxfp4")
    run_and_compare(mla_prologue, inp, w_uk_t=qw).assert_ok()


@pytest.mark.parametrize("weights", ["bf16", "fp8-head", "mxfp4"])
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_fp8_query_output(device, weights, scale_kind):
    """One scale on both halves of q, saturating; dequantized q matches the bf16 result."""
    inp = make_inputs(
        5, **_dims(device, 4), device=device, generator=_gen(weights, scale_kind), pad_fraction=0.2
    )
    w = inp.w_uk_t if weights == "bf16" else _quantize(inp.w_uk_t, weights)
    q_scale = 2.5 / 448  # |q| reaches ~4-5: the largest values saturate
    scale_arg = torch.tensor([q_scale], device=device) if scale_kind == "tensor" else q_scale
    kw = dict(q_out_dtype=FP8, q_scale=scale_arg)
    run_and_compare(mla_prologue, inp, w_uk_t=w, **kw).assert_ok()
    args = list(inp.args())
    args[4] = w
    q = mla_decode_prologue(*args, kv_scale=inp.kv_scale, **kw)
    assert q.dtype == FP8
    # both halves are scaled: dequantized, q is close to the unquantized bf16 query
    q_bf16 = mla_decode_prologue_ref(*inp.args(), kv_scale=inp.kv_scale, out=None)
    deq = q.float().cpu() * q_scale
    ref = q_bf16.float().cpu().clamp(-448 * q_scale, 448 * q_scale)
    tol = TOL["fp8_q_dequant_rel_l2"][weight_kind(w)]
    L = inp.kv_c.shape[1]
    for part in (slice(0, L), slice(L, None)):
        assert rel_err(deq[..., part], ref[..., part]) < tol
    assert float(deq.abs().max()) <= 448 * q_scale * (1 + 1e-6)  # saturated, never inf/NaN


def test_fp8_query_and_cache_store_the_ieee_quotient(device):
    """Both FP8 outputs store ``saturate(x / scale)``, the IEEE quotient, which the kernel takes
    from one reciprocal per program (a multiply and an fma correction per element). A value where
    the plain multiply ``x * (1 / scale)`` gives the neighbouring code tells the two apart:
    x = 0.00439453125 (a bf16 value), scale 0.3, x / 0.3 next to an FP8 rounding midpoint. The
    rope halves carry x unrotated (``rope_applied``) and the latent's first 8 columns hold -x
    (the rest stays random), so the query's rope half, the cache's k_pe and those latent columns
    each see exactly +-x."""
    x, scale = 0.00439453125, 0.3
    s32 = torch.tensor(scale, dtype=torch.float32)
    xs = torch.tensor([x, -x])
    by_inverse = (xs * (torch.ones(()) / s32)).to(FP8).view(torch.uint8)
    by_division = (xs / s32).to(FP8).view(torch.uint8)
    assert (by_inverse != by_division).all()  # the value really separates the rules
    inp = make_inputs(
        3, **_dims(device, 4), kv_dtype=FP8, outliers=False, device=device, generator=_gen("rule")
    )
    inp.q_pe.fill_(x)
    inp.k_pe.fill_(x)
    inp.kv_c[:, :8] = -x
    inp.kv_scale = scale
    kw = dict(q_out_dtype=FP8, q_scale=scale, rope_applied=True)
    run_and_compare(mla_prologue, inp, **kw).assert_ok()
    q = mla_decode_prologue(*inp.args(), kv_scale=scale, **kw)
    L = inp.kv_c.shape[1]
    assert (q[..., L:].view(torch.uint8).cpu() == by_division[0]).all()
    cache = inp.kv_cache.view(-1, inp.kv_cache.shape[-1])[inp.slot_mapping.long()]
    assert (cache[:, L:].view(torch.uint8).cpu() == by_division[0]).all()
    assert (cache[:, :8].view(torch.uint8).cpu() == by_division[1]).all()


def test_quantized_weight_errors(device):
    inp = make_inputs(2, **_dims(device, 4), device=device)
    qw = _quantize(inp.w_uk_t, "fp8-tensor")
    other = _quantize(torch.cat([inp.w_uk_t, inp.w_uk_t]), "fp8-tensor")  # 8 heads, not 4
    args = list(inp.args())
    args[4] = other
    with pytest.raises(FuseMLAValueError, match=r"w_uk_t.*shape"):
        mla_decode_prologue(*args)
    args[4] = qw
    with pytest.raises(FuseMLAValueError, match=r"q_scale.*None"):
        mla_decode_prologue(*args, q_out_dtype=FP8)


def test_quantized_weight_and_fp8_query_under_torch_compile(device):
    """The custom op carries a QuantizedWeight and FP8 q output through fullgraph compile."""
    inp = make_inputs(4, **_dims(device, 2), device=device, generator=_gen("compile-quant"))
    qw = _quantize(inp.w_uk_t, "fp8-head")
    args = list(inp.args())
    args[4] = qw
    q_scale = torch.tensor([0.01], device=device)
    cache_eager = inp.kv_cache.clone()
    eager_args = list(args)
    eager_args[8] = cache_eager
    q_eager = mla_decode_prologue(*eager_args, q_out_dtype=FP8, q_scale=q_scale)

    def fn(*a):
        return mla_decode_prologue(*a, q_out_dtype=FP8, q_scale=q_scale)

    backend = "inductor" if device == "cuda" else "aot_eager"
    q = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    assert torch.equal(q.view(torch.uint8), q_eager.view(torch.uint8))
    assert torch.equal(inp.kv_cache.view(torch.uint8), cache_eager.view(torch.uint8))


@pytest.mark.parametrize("B,D", [(1, 1), (3, 3), (40, 23)], ids=lambda x: str(x))
@pytest.mark.parametrize("fmt", ["fp8-tensor", "fp8-head", "fp8-block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp8_activations(device, dtype, fmt, B, D):
    """act_quant="fp8": the kernel's FP8 x FP8 BMM against a reference that quantizes the
    activations the same way (per token and head), every cache byte, FP8 cache at B=3."""
    inp = make_inputs(
        B,
        **_dims(device, 4),
        dtype=dtype,
        kv_dtype=FP8 if B == 3 else None,
        pad_fraction=0.25 if B > 1 else 0.0,
        device=device,
        num_decode_tokens=D,
        generator=_gen("act", dtype, fmt, B, D),
    )
    qw = _quantize(inp.w_uk_t, fmt)
    run_and_compare(mla_prologue, inp, w_uk_t=qw, act_quant="fp8").assert_ok()


def test_fp8_activations_quantize_per_token_and_head(device):
    """The activations really are FP8 (the result differs from bf16 activations by the size an
    FP8 rounding makes, measured: TOL["act_fp8_rel_l2"]); one token's scale does not leak into
    another's (a token 1000x larger leaves the others' results as they were); an all-zero row
    gives zeros, not NaN; an FP8 query output works on top."""
    from fusemla.reference.prologue import mla_prologue_ref

    inp = make_inputs(6, **_dims(device, 4), device=device, generator=_gen("act-scale"))
    qw = _quantize(inp.w_uk_t, "fp8-head")
    args = list(inp.args())
    args[4] = qw
    q_bf16_act = mla_decode_prologue(*args, kv_scale=inp.kv_scale)
    q_fp8_act = mla_decode_prologue(*args, kv_scale=inp.kv_scale, act_quant="fp8")
    L = inp.kv_c.shape[1]
    err = rel_err(q_fp8_act[..., :L].float().cpu(), q_bf16_act[..., :L].float().cpu())
    assert 1e-3 < err < TOL["act_fp8_rel_l2"], err  # quantized, and no worse than FP8 rounding
    assert torch.equal(q_fp8_act[..., L:], q_bf16_act[..., L:])  # the RoPE half is untouched
    # per token: scale token 2 up by 1000 and zero token 4; the other tokens do not move
    qn = inp.q_nope.clone()
    qn[2] *= 1000
    qn[4] = 0
    args2 = list(args)
    args2[0] = qn
    q2 = mla_decode_prologue(*args2, kv_scale=inp.kv_scale, act_quant="fp8")
    for t in (0, 1, 3, 5):
        assert torch.equal(q2[t], q_fp8_act[t]), t
    assert torch.equal(q2[4, :, :L], torch.zeros_like(q2[4, :, :L]))
    big = mla_prologue_ref(*args2, kv_scale=inp.kv_scale, act_quant="fp8").q
    assert torch.isfinite(q2.float()).all()
    assert rel_err(q2[2].float().cpu(), big[2].float().cpu()) < 1e-2
    # FP8 query output on top of FP8 activations
    q_scale = torch.tensor([0.05], device=device)
    run_and_compare(
        mla_prologue, inp, w_uk_t=qw, act_quant="fp8", q_out_dtype=FP8, q_scale=q_scale
    ).assert_ok()


def test_fp8_activations_under_torch_compile(device):
    """act_quant travels through the registered op: compiled equals eager, byte for byte."""
    inp = make_inputs(
        5, **_dims(device, 2), device=device, num_decode_tokens=3, generator=_gen("act-compile")
    )
    qw = _quantize(inp.w_uk_t, "fp8-tensor")
    args = list(inp.args())
    args[4] = qw
    cache_eager = inp.kv_cache.clone()
    eager_args = list(args)
    eager_args[8] = cache_eager
    eager = mla_prologue(*eager_args, num_decode_tokens=3, act_quant="fp8")

    def fn(*a):
        return mla_prologue(*a, num_decode_tokens=3, act_quant="fp8")

    backend = "inductor" if device == "cuda" else "aot_eager"
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    for a, b in zip(got, eager):
        assert torch.equal(a, b)
    assert torch.equal(inp.kv_cache.view(torch.uint8), cache_eager.view(torch.uint8))
