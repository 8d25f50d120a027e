"""The fused MLA decode epilogue (:func:`fusemla.mla_epilogue`) vs the unfused reference
(:func:`fusemla.mla_epilogue_ref`) vs float64 models written here.

``o[n, h*V + v] = sum_l attn_out[n, h, l] * W_UV[h, l, v]`` (fp32 accumulation), in the
activations' dtype or as FP8 codes with one fp32 scale per token and group (vLLM's
``per_token_group_quant_fp8``). ``--device=cpu``: Triton's interpreter at small dims (2 heads,
L = 64, V = 64), whose tiles (16 tokens, 32-wide V tiles, 32-row latent chunks) give several
token tiles, V tiles and chunks per head. ``--device=cuda``: DeepSeek-V3's dims (16 and 128
heads, L = 512, V = 128, groups of 128, 128 x 128 block scales). Every run uses fresh random data
(seeded by :func:`fusemla.testing.stable_seed`).

What "agrees" means (:func:`_check_act_out`, :func:`_check_fp8_out`):

- an output in the activations' dtype: every element within one ulp of the reference's, plus
  the bound of two fp32 summation orders (``3 (L + 4) 2^-24 sum |products|``); within half an
  ulp (plus that bound) of a float64 model, and a small relative L2 error against it;
- FP8 output: scales equal the reference's up to fp32 rounding (relative 1e-6, times L / 64
  above L = 64: summation order); with ``scale_ue8m0`` exactly equal, except where the group's
  absmax sits within fp32 rounding of a power of two; codes at most one FP8 step from the
  reference's and fewer than 1 % off; every decoded value within half an FP8 step of the
  float64 product.

``test_v_below_16`` and ``test_fp8_output_group_512`` (GPU) hold two bugs they found fixed: a
V below one 16-wide tile, and a group so wide its tiles overflowed shared memory.
"""

from __future__ import annotations

import math

import pytest
import torch

import fusemla
import fusemla.ops.epilogue.launch as launch_mod
from fusemla.contracts.epilogue import EPS, MIN_GROUP, EpilogueSpec, fp8_group_max, prepare
from fusemla.errors import FuseMLAError, FuseMLATypeError, FuseMLAValueError
from fusemla.ops.epilogue import configs
from fusemla.platform import platform_from
from fusemla.quant import (
    QuantizedWeight,
    quantize_fp8_weight,
    quantize_mxfp4_weight,
    split_kv_b_proj_fp8,
)
from fusemla.reference.epilogue import group_quant_fp8
from fusemla.testing import (
    DEEPSEEK_V3,
    exact_w_uv,
    fp8_ordinal,
    poisoned,
    pow2_ceil64,
    stable_seed,
    w_uv_f64,
)
from fusemla.testing.spy import KernelSpy

FP8 = torch.float8_e4m3fn
FNUZ = torch.float8_e4m3fnuz
BF16, FP16 = torch.bfloat16, torch.float16
#: the smallest normal exponent of each FP8 format (grid spacing 2**(e - 3) at exponent e)
MIN_EXP = {FP8: -6, FNUZ: -7}


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(stable_seed("epilogue", *parts))


def _dims(device: str) -> dict:
    """(H, L, V): the interpreter's small dims on CPU, DeepSeek-V3's (16 heads: TP8) on GPU."""
    if device == "cuda":
        return dict(H=16, L=DEEPSEEK_V3["L"], V=128)
    return dict(H=2, L=64, V=64)


def _act(N: int, H: int, L: int, g, dtype=BF16, device="cpu") -> torch.Tensor:
    return torch.randn(N, H, L, generator=g).to(device, dtype)


def _plain_w(H, L, V, g, dtype=BF16, device="cpu", layout="contiguous") -> torch.Tensor:
    """A plain ``[H, L, V]`` W_UV: contiguous, K-major, or vLLM's (a transposed view of a
    contiguous ``[L, H, V]``)."""
    if layout == "vllm":
        w = torch.randn(L, H, V, generator=g).div(math.sqrt(L)).to(device, dtype).transpose(0, 1)
        assert w.stride() == (V, H * V, 1)
        return w
    w = torch.randn(H, L, V, generator=g).div(math.sqrt(L)).to(device, dtype)
    if layout == "kmajor":
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
        assert w.stride() == (L * V, 1, L)
    return w


def _block_scales(shape, g) -> torch.Tensor:
    """Positive fp32 scales spread over two octaves either way (a block whose scale is applied
    to the wrong columns or rows shows)."""
    octave = torch.randint(-2, 3, shape, generator=g).float()
    return torch.rand(shape, generator=g).add(0.5) * torch.exp2(octave)


def _kv_b_proj_w_uv(H, P, L, V, block, g, device="cpu", share=False) -> QuantizedWeight:
    """W_UV of a random block-FP8 ``kv_b_proj`` ``[H * (P + V), L]`` as a DeepSeek-V3
    checkpoint stores it (``block_size = (bn, bk)``), split by :func:`split_kv_b_proj_fp8`
    (``share``: its codes as views of the checkpoint's, heads ``(P + V) * L`` apart)."""
    bn, bk = block
    R = H * (P + V)
    codes = (torch.randn(R, L, generator=g) * 96).clamp(-448, 448).to(FP8)
    scale = _block_scales((R // bn, -(-L // bk)), g) / (96 * math.sqrt(L))
    _, w_uv = split_kv_b_proj_fp8(
        codes.to(device),
        scale.to(device),
        num_heads=H,
        qk_nope_head_dim=P,
        v_head_dim=V,
        block_size=block,
        share=share,
    )
    assert w_uv.shape == (H, L, V) and w_uv.block == (bk, bn) and w_uv.k_major
    assert w_uv.data.stride(0) == (P + V) * L if share else V * L
    return w_uv


def _hand_block_w_uv(H, L, V, block, g, device="cpu") -> QuantizedWeight:
    """A hand-built FP8 W_UV with ``block = (rows along L, columns along V)`` scales: partial
    edge blocks where L or V is not a multiple."""
    bk, bn = block
    codes = (torch.randn(H, L, V, generator=g) * 96).clamp(-448, 448).to(FP8)
    scale = _block_scales((H, -(-L // bk), -(-V // bn)), g) / (96 * math.sqrt(L))
    return QuantizedWeight(codes.to(device), scale.to(device), "fp8", block=block)


# ----------------------------------------------------------------------------- float64 models


def _model64(x: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, mag)`` ``[N, H*V]`` float64 on the CPU: the product and ``sum_l |x w|`` (the scale
    of fp32 summation errors)."""
    x64, w64 = x.double(), w_uv_f64(w)
    y = torch.einsum("nhl,hlv->nhv", x64, w64)
    mag = torch.einsum("nhl,hlv->nhv", x64.abs(), w64.abs())
    N = x.shape[0]
    return y.reshape(N, -1).cpu(), mag.reshape(N, -1).cpu()


def _ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of ``dtype`` at float64 magnitudes ``v >= 0`` (the spacing of its binade)."""
    fi = torch.finfo(dtype)
    _, e = torch.frexp(v)  # v = m * 2**e, m in [0.5, 1): the binade starts at 2**(e - 1)
    ulp = torch.ldexp(torch.full_like(v, fi.eps), e - 1)
    return ulp.clamp_min(fi.tiny * fi.eps)


def _acc_slack(mag: torch.Tensor, L: int) -> torch.Tensor:
    """What two fp32 summation orders of L products (and a scale multiply) may differ by."""
    return 3 * (L + 4) * 2.0**-24 * mag


def _quant_f64(x: torch.Tensor, group: int, dtype: torch.dtype, ue8m0: bool):
    """vLLM's ``per_token_group_quant_fp8`` of fp32 ``x`` ``[N, C]``, written independently in
    float64: ``(codes [N, C] in dtype, scales [N, C / group] fp32)``.

    Every fp32 operation of the rule is done exactly in float64 and rounded once to fp32: the
    product of two fp32 values is exact in float64, and a quotient rounded first to float64
    then to fp32 equals the IEEE fp32 quotient (53 >= 2 * 24 + 2 bits). Codes: the quotient
    clamped to +-fmax, rounded onto the e4m3 grid (3 mantissa bits, spacing ``2**(e - 3)``,
    subnormal below the format's smallest normal) half to even, computed in float64, then
    cast (exactly: the value is on the grid)."""
    fmax = {FP8: 448.0, FNUZ: 224.0}[dtype]
    N, C = x.shape
    g = x.double().reshape(N, C // group, group)
    eps32 = torch.tensor(1e-10, dtype=torch.float32).double()
    inv32 = torch.tensor(1.0 / fmax, dtype=torch.float32).double()
    absmax = torch.maximum(g.abs().amax(dim=2), eps32)
    s = (absmax * inv32).float().double()
    if ue8m0:
        s = pow2_ceil64(s)
    q = (g / s[..., None]).float().double().clamp(-fmax, fmax)
    _, e = torch.frexp(q)  # |q| in [2**(e - 1), 2**e)
    exp = torch.clamp(e - 1, min=MIN_EXP[dtype])
    quantum = torch.ldexp(torch.ones_like(q), exp - 3)
    r = torch.round(q / quantum) * quantum  # torch.round: half to even; exact in float64
    return r.reshape(N, C).to(dtype), s.float()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (same-size integer view: any strides)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


# ----------------------------------------------------------------------------- comparisons


def _check_act_out(o: torch.Tensor, r: torch.Tensor, x: torch.Tensor, w) -> None:
    """An output in the activations' dtype against the reference's and the float64 model."""
    dtype = o.dtype
    assert r.dtype == dtype and o.shape == r.shape
    N, H, L = x.shape
    y64, mag = _model64(x, w)
    of, rf = o.double().cpu(), r.double().cpu()
    assert not torch.isnan(of).any(), "NaN in the output"
    slack = _acc_slack(mag, L)
    bound = _ulp(torch.maximum(of.abs(), rf.abs()), dtype) + slack
    off = (of - rf).abs() > bound
    assert not off.any(), (
        f"{int(off.sum())} of {off.numel()} elements more than 1 ulp from the reference, e.g. "
        f"{of[off][:4].tolist()} vs {rf[off][:4].tolist()}"
    )
    u = torch.finfo(dtype).eps / 2  # one rounding of the fp32 accumulator
    off64 = (of - y64).abs() > u * (y64.abs() + slack) + slack + torch.finfo(dtype).tiny
    assert not off64.any(), f"{int(off64.sum())} elements more than half an ulp from float64"
    rel = float((of - y64).norm() / y64.norm())
    assert rel < {BF16: 4e-3, FP16: 5e-4}[dtype], rel


def _check_fp8_out(codes, scales, ref_codes, ref_scales, x, w, *, group: int, ue8m0: bool) -> None:
    """FP8 codes and scales against the reference's and the float64 product."""
    dtype = codes.dtype
    N, C = codes.shape
    G = C // group
    assert ref_codes.dtype == dtype and scales.dtype == ref_scales.dtype == torch.float32
    assert scales.shape == ref_scales.shape == (N, G)
    codes, ref_codes = codes.cpu(), ref_codes.cpu()
    s, rs = scales.double().cpu(), ref_scales.double().cpu()
    fmax = fp8_group_max(dtype)
    c = codes.double()
    assert not torch.isnan(c).any(), "NaN codes"
    assert float(c.abs().max()) <= fmax
    assert bool(torch.isfinite(s).all() and (s > 0).all()), "a scale is not a positive number"
    y64, mag = _model64(x, w)
    absmax64 = y64.reshape(N, G, group).abs().amax(dim=2).clamp_min(EPS)
    same_group = torch.ones(N, G, dtype=torch.bool)
    if ue8m0:
        assert torch.equal(pow2_ceil64(s), s), "ue8m0 scales are not powers of two"
        diff = s != rs
        if diff.any():  # only where absmax's fp32 rounding crosses a power of two
            ratio = s[diff] / rs[diff]
            assert bool(((ratio == 2) | (ratio == 0.5)).all()), ratio
            lo = torch.minimum(s[diff], rs[diff])
            raw = absmax64[diff] / fmax
            assert bool(((raw / lo - 1).abs() < 1e-5).all()), raw / lo - 1
        same_group = ~diff
    else:
        # fp32 rounding of absmax: 1e-6 at L = 64 (the interpreter's dims); two summation
        # orders drift apart linearly in L at worst (1.5e-6 seen at L = 512 on an H200)
        tol = 1e-6 * max(1.0, x.shape[2] / 64)
        rel = ((s - rs).abs() / rs).max()
        assert float(rel) <= tol, f"scales differ from the reference's by {float(rel):.3g}"
        # and they are the rule's scale of the float64 absmax, up to fp32 accumulation error
        raw = absmax64 / fmax
        assert float(((s - raw).abs() / raw).max()) < 1e-4
    steps = (fp8_ordinal(codes) - fp8_ordinal(ref_codes)).abs()
    steps = steps[same_group.repeat_interleave(group, dim=1)]
    assert int(steps.max()) <= 1, f"codes up to {int(steps.max())} FP8 steps from the reference"
    share = float((steps != 0).double().mean())
    assert share < 0.01, f"{share:.2%} of the codes differ from the reference's"
    # every decoded value within half an FP8 step of the float64 product
    s_el = s.repeat_interleave(group, dim=1)
    deq = c * s_el
    slack = _acc_slack(mag, x.shape[2])
    bound = (2.0**-4 + 2.0**-20) * (y64.abs() + slack) + slack + s_el * 2.0 ** (MIN_EXP[dtype] - 3)
    off = (deq - y64).abs() > bound
    assert not off.any(), f"{int(off.sum())} decoded values more than half a step from float64"
    assert float((deq - y64).norm() / y64.norm()) < 0.05


def _run_both(x, w, **kw):
    """(fused, reference) results of the same call."""
    return fusemla.mla_epilogue(x, w, **kw), fusemla.mla_epilogue_ref(x, w, **kw)


def _check(x, w, fused, ref, *, group: int = 128, ue8m0: bool = False) -> None:
    if isinstance(fused, tuple):
        _check_fp8_out(*fused, *ref, x, w, group=group, ue8m0=ue8m0)
    else:
        _check_act_out(fused, ref, x, w)


def _fnuz_on_nvidia(device: str) -> bool:
    return device == "cuda" and torch.version.hip is None


# ----------------------------------------------------------------------------- 1. the rule


def _rule_input(N: int, C: int, group: int, g) -> torch.Tensor:
    """fp32 ``[N, C]`` with group magnitudes spread over 16 decades."""
    x = torch.randn(N, C, generator=g)
    decades = torch.randint(-8, 9, (N, C // group), generator=g).float()
    return x * torch.pow(10.0, decades).repeat_interleave(group, dim=1)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scale", "ue8m0"])
@pytest.mark.parametrize("dtype", [FP8, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("group", [16, 32, 128])
def test_group_quant_is_the_float64_rule(group, dtype, ue8m0):
    """The reference quantizer against the rule written independently in float64: scales
    (torch.equal) and every code byte; ue8m0 scales are powers of two in [raw, 2 * raw)."""
    g = _gen("rule", group, dtype, ue8m0)
    x = _rule_input(7, 4 * group, group, g)
    codes, scales = group_quant_fp8(x, group, dtype, ue8m0=ue8m0)
    want_codes, want_scales = _quant_f64(x, group, dtype, ue8m0)
    assert codes.dtype == dtype and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (7, 4)
    assert torch.equal(scales, want_scales)
    assert torch.equal(_bytes(codes), _bytes(want_codes))
    raw = _quant_f64(x, group, dtype, False)[1]
    if ue8m0:
        m, _ = torch.frexp(scales)
        assert bool((m == 0.5).all()), "ue8m0 scales are not powers of two"
        assert bool((scales >= raw).all() and (scales < 2 * raw).all())
    else:
        assert torch.equal(scales, raw)
    # nothing maps beyond the output's fmax (224 for e4m3fnuz, not the format's 240)
    assert float(codes.float().abs().max()) <= fp8_group_max(dtype)


@pytest.mark.parametrize("dtype", [FP8, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
def test_group_quant_zero_and_tiny_groups_use_eps(dtype):
    """An all-zero group: scale ``fp32(1e-10) * fp32(1 / fmax)``, codes 0; a group whose absmax
    is below 1e-10: the same scale (eps clamps absmax, not the scale), codes x / s."""
    g = _gen("rule-eps", dtype)
    x = torch.randn(3, 64, generator=g)
    x[0, :16] = 0.0
    x[1, 16:32] = torch.randn(16, generator=g) * 1e-12
    x[2, 48:] = 0.0
    eps_scale = torch.tensor(1e-10, dtype=torch.float32) * torch.tensor(
        1 / fp8_group_max(dtype), dtype=torch.float32
    )
    codes, scales = group_quant_fp8(x, 16, dtype)
    for n, gi in ((0, 0), (1, 1), (2, 3)):
        assert scales[n, gi] == eps_scale, (n, gi, float(scales[n, gi]))
    assert torch.equal(codes[0, :16].float(), torch.zeros(16))
    assert torch.equal(codes[2, 48:].float(), torch.zeros(16))
    want_codes, want_scales = _quant_f64(x, 16, dtype, False)
    assert torch.equal(scales, want_scales)
    assert torch.equal(_bytes(codes), _bytes(want_codes))
    assert float(codes[1, 16:32].float().abs().max()) > 1  # 1e-12 / (1e-10 / 448) ~ 4.5
    # ue8m0: the eps scale rounded up to a power of two
    _, s8 = group_quant_fp8(x, 16, dtype, ue8m0=True)
    assert float(s8[0, 0]) == 2.0 ** math.ceil(math.log2(float(eps_scale)))


@pytest.mark.parametrize("dtype", [FP8, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
def test_group_quant_absmax_saturates_to_fmax(dtype):
    """Each group's absmax element encodes to exactly +-fmax (448, or 224 for e4m3fnuz, never
    its 240), for 2**16 absmax values over 8 decades; the others stay inside."""
    g = _gen("rule-sat", dtype)
    M, group = 1 << 16, 16
    absmax = torch.pow(10.0, torch.rand(M, generator=g) * 8 - 4)
    sign = torch.randint(0, 2, (M,), generator=g).float() * 2 - 1
    rest = (torch.rand(M, group - 1, generator=g) * 2 - 1) * absmax[:, None]
    x = torch.cat([(absmax * sign)[:, None], rest], dim=1)
    codes, _ = group_quant_fp8(x, group, dtype)
    fmax = fp8_group_max(dtype)
    assert torch.equal(codes[:, 0].float(), sign * fmax)
    assert float(codes[:, 1:].float().abs().max()) <= fmax
    assert fp8_group_max(FP8) == 448.0 and fp8_group_max(FNUZ) == 224.0
    with pytest.raises(FuseMLATypeError, match="dtype"):
        fp8_group_max(BF16)


def test_group_quant_ties_round_to_even():
    """Hand-computed codes with a power-of-two (ue8m0) scale of 1: halfway values go to the
    even mantissa, subnormal ones too."""
    vals = [300.0, 1.0625, 1.1875, -1.0625, 17.0, 3 * 2.0**-10, 2.0**-10, 5 * 2.0**-10]
    want = [288.0, 1.0, 1.25, -1.0, 16.0, 2.0**-8, 0.0, 2.0**-8]
    x = torch.tensor(vals + [0.0] * 8).view(1, 16)
    codes, scales = group_quant_fp8(x, 16, FP8, ue8m0=True)
    assert float(scales) == 1.0
    assert codes.float()[0, :8].tolist() == want


# ----------------------------------------------------------------------------- 2. kernel vs ref


@pytest.mark.parametrize("out", ["act", "fp8"])
@pytest.mark.parametrize("layout", ["contiguous", "kmajor", "vllm"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_plain_weights_match_reference(device, dtype, layout, out):
    d = _dims(device)
    g = _gen("plain", dtype, layout, out)
    x = _act(17, d["H"], d["L"], g, dtype, device)
    w = _plain_w(d["H"], d["L"], d["V"], g, dtype, device, layout)
    kw = dict(out_dtype=FP8, group_size=32) if out == "fp8" else {}
    fused, ref = _run_both(x, w, **kw)
    _check(x, w, fused, ref, group=32)


@pytest.mark.parametrize("out", ["act", "fp8", "fp8-ue8m0"])
@pytest.mark.parametrize(
    "gran", ["tensor", "head-kmajor", "head-contiguous", "head-fnuz"], ids=lambda s: f"fp8-{s}"
)
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_fp8_weights_per_tensor_and_head_match_reference(device, dtype, gran, out):
    d = _dims(device)
    g = _gen("fp8w", dtype, gran, out)
    x = _act(17, d["H"], d["L"], g, dtype, device)
    w32 = _plain_w(d["H"], d["L"], d["V"], g, torch.float32, device)
    w32 = w32 * torch.linspace(0.25, 4.0, d["H"], device=device).view(-1, 1, 1)  # heads differ
    w = quantize_fp8_weight(
        w32,
        per_head=gran != "tensor",
        k_major=gran != "head-contiguous",
        dtype=FNUZ if gran == "head-fnuz" else FP8,
    )
    assert w.granularity == gran.split("-")[0]
    kw = {} if out == "act" else dict(out_dtype=FP8, group_size=16, scale_ue8m0=out != "fp8")
    if gran == "head-fnuz" and _fnuz_on_nvidia(device):
        with pytest.raises(FuseMLATypeError, match=r"w_uv.data: float8_e4m3fnuz"):
            fusemla.mla_epilogue(x, w, **kw)
        return
    fused, ref = _run_both(x, w, **kw)
    _check(x, w, fused, ref, group=16, ue8m0=out == "fp8-ue8m0")


#: block-FP8 kv_b_proj: id -> ((P, V, L, block_size) on the CPU, (P, V, L, block_size) on a GPU)
KV_B_PROJ_BLOCKS = {
    "32x32-L96": ((32, 32, 96, (32, 32)), (128, 128, 512, (128, 128))),
    "32x32-V64-L128": ((64, 64, 128, (32, 32)), (128, 128, 512, (128, 128))),
    "16x32-L96": ((64, 64, 96, (16, 32)), (128, 128, 512, (64, 128))),
    "32x16-L80": ((32, 32, 80, (32, 16)), (128, 128, 512, (128, 64))),
}


@pytest.mark.parametrize("out", ["act", "fp8"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(KV_B_PROJ_BLOCKS))
def test_block_fp8_kv_b_proj_matches_reference(device, case, dtype, out):
    """W_UV split out of a random block-FP8 kv_b_proj as stored (K-major codes, block
    scales in W_UV's [H, L-blocks, V-blocks] orientation), square and non-square blocks."""
    P, V, L, block = KV_B_PROJ_BLOCKS[case][device == "cuda"]
    H = _dims(device)["H"]
    g = _gen("kvb", case, dtype, out)
    w = _kv_b_proj_w_uv(H, P, L, V, block, g, device)
    x = _act(21, H, L, g, dtype, device)
    group = 32 if device == "cpu" else 128
    kw = {} if out == "act" else dict(out_dtype=FP8, group_size=group)
    fused, ref = _run_both(x, w, **kw)
    _check(x, w, fused, ref, group=group)


@pytest.mark.parametrize("case", ["32x32-V64-L128", "32x16-L80"])
def test_block_fp8_kv_b_proj_views(device, case):
    """W_UV whose codes are views of the checkpoint's kv_b_proj (split_kv_b_proj_fp8 with
    share=True, what the vLLM plugin reads): heads (P + V) * L apart. Both outputs match the
    reference, and byte for byte the same weight copied into its own memory."""
    P, V, L, block = KV_B_PROJ_BLOCKS[case][device == "cuda"]
    H = _dims(device)["H"]
    shared = _kv_b_proj_w_uv(H, P, L, V, block, _gen("kvb-views", case), device, share=True)
    copied = QuantizedWeight(
        shared.data.transpose(1, 2).contiguous().transpose(1, 2),
        shared.scale,
        "fp8",
        block=shared.block,
    )
    assert copied.data.stride(0) == V * L and copied.data.data_ptr() != shared.data.data_ptr()
    x = _act(21, H, L, _gen("kvb-views-x", case), BF16, device)
    group = 32 if device == "cpu" else 128
    for kw in ({}, dict(out_dtype=FP8, group_size=group)):
        fused, ref = _run_both(x, shared, **kw)
        _check(x, shared, fused, ref, group=group)
        again = fusemla.mla_epilogue(x, copied, **kw)
        pairs = zip(fused, again) if isinstance(fused, tuple) else [(fused, again)]
        for a, b in pairs:  # codes compared as bytes; bf16 outputs and fp32 scales as values
            assert a.dtype == b.dtype and a.shape == b.shape
            assert (
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                if a.dtype == FP8
                else (torch.equal(a, b))
            )


#: hand-built block scales: (L, V, (rows along L, columns along V)); L or V not a multiple
HAND_BLOCKS = {
    "L80-32x32": (80, 64, (32, 32)),
    "L80-48x32": (80, 64, (48, 32)),  # 48 rows: 16-row chunks, three per block
    "L96-32x48-V64": (96, 64, (32, 48)),  # a partial block of columns
}


@pytest.mark.parametrize("out", ["act", "fp8"])
@pytest.mark.parametrize("case", list(HAND_BLOCKS))
def test_hand_built_block_scales_with_partial_blocks(device, case, out):
    L, V, block = HAND_BLOCKS[case]
    if device == "cuda":
        L, V = 496, V * 2  # 496 latent rows: a partial block of 16 rows at the end
    H = _dims(device)["H"]
    g = _gen("hand-block", case, out)
    w = _hand_block_w_uv(H, L, V, block, g, device)
    assert L % block[0] != 0 or V % block[1] != 0
    x = _act(19, H, L, g, BF16, device)
    kw = {} if out == "act" else dict(out_dtype=FP8, group_size=32)
    fused, ref = _run_both(x, w, **kw)
    _check(x, w, fused, ref, group=32)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scale", "ue8m0"])
@pytest.mark.parametrize("dtype", [FP8, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("group", [16, 32, 64, "V"])
def test_fp8_output_group_sizes(device, group, dtype, ue8m0):
    """V = 64 (128 on a GPU) with groups of 16, 32, 64 and the whole head; e4m3fnuz (fmax 224)
    runs under the interpreter and is refused, before anything is written, on NVIDIA."""
    d = _dims(device)
    V = d["V"]
    group = V if group == "V" else group
    g = _gen("groups", group, dtype, ue8m0)
    x = _act(18, d["H"], d["L"], g, BF16, device)
    w = _plain_w(d["H"], d["L"], V, g, BF16, device)
    kw = dict(out_dtype=dtype, group_size=group, scale_ue8m0=ue8m0)
    if dtype == FNUZ and _fnuz_on_nvidia(device):
        out = poisoned((18, d["H"] * V), FNUZ, device)
        before = out.clone()
        with pytest.raises(FuseMLATypeError, match=r"out: float8_e4m3fnuz"):
            fusemla.mla_epilogue(x, w, out=out, **kw)
        assert torch.equal(_bytes(out), _bytes(before))
        return
    fused, ref = _run_both(x, w, **kw)
    assert fused[1].shape == (18, d["H"] * V // group)
    _check(x, w, fused, ref, group=group, ue8m0=ue8m0)
    if not ue8m0:  # each group's absmax encodes to fmax: 224 for e4m3fnuz, not its 240
        assert float(fused[0].float().abs().max()) == fp8_group_max(dtype)


def test_fp8_output_v48_group16(device):
    """V = 48 (not a power of two): a V tile with a masked group past the head's end."""
    H, L = _dims(device)["H"], _dims(device)["L"]
    g = _gen("v48")
    x = _act(17, H, L, g, BF16, device)
    w = _plain_w(H, L, 48, g, BF16, device)
    for ue8m0 in (False, True):
        fused, ref = _run_both(x, w, out_dtype=FP8, group_size=16, scale_ue8m0=ue8m0)
        assert fused[1].shape == (17, H * 3)
        _check(x, w, fused, ref, group=16, ue8m0=ue8m0)


@pytest.mark.parametrize(
    "out,dtype,ue8m0",
    [
        ("act", None, False),
        ("fp8", FP8, False),
        ("fp8", FP8, True),
        ("fp8", FNUZ, False),
        ("fp8", FNUZ, True),
    ],
    ids=["bf16", "e4m3fn", "e4m3fn-ue8m0", "e4m3fnuz", "e4m3fnuz-ue8m0"],
)
def test_exact_products_match_reference_bit_for_bit(device, out, dtype, ue8m0):
    """Products exact in fp32 (one +-2**k weight per column): outputs, codes and scales must
    equal the reference's byte for byte, and the codes the float64 rule's."""
    if dtype == FNUZ and _fnuz_on_nvidia(device):
        pytest.skip("e4m3fnuz is MI300's (refusal tested in test_fp8_output_group_sizes)")
    d = _dims(device)
    g = _gen("exact", out, dtype, ue8m0)
    x = _act(20, d["H"], d["L"], g, BF16, device)
    x[3] = 0.0  # a token whose groups are all zero: the eps scale
    w = exact_w_uv(d["H"], d["L"], d["V"], g, BF16, device)
    if out == "act":
        o, r = _run_both(x, w)
        assert torch.equal(_bytes(o), _bytes(r))
        y64, _ = _model64(x, w)
        assert torch.equal(o.cpu().double(), y64.to(BF16).double())
        return
    group = 16
    (c, s), (rc, rs) = _run_both(x, w, out_dtype=dtype, group_size=group, scale_ue8m0=ue8m0)
    assert torch.equal(s, rs)
    assert torch.equal(_bytes(c), _bytes(rc))
    y64, _ = _model64(x, w)
    want_c, want_s = _quant_f64(y64.float(), group, dtype, ue8m0)
    assert torch.equal(s.cpu(), want_s)
    assert torch.equal(_bytes(c.cpu()), _bytes(want_c))
    eps_scale = torch.tensor(EPS, dtype=torch.float32) * torch.tensor(
        1 / fp8_group_max(dtype), dtype=torch.float32
    )
    if ue8m0:
        eps_scale = torch.tensor(2.0 ** math.ceil(math.log2(float(eps_scale))))
    assert bool((s[3].cpu() == eps_scale).all())
    assert not bool(c[3].float().any())


def test_fp8_ties_in_the_kernel_round_to_even(device):
    """The rule's halfway cases through the kernel: identity weights make the product the
    (bf16) input itself; with a ue8m0 scale of 1 the codes are hand-computed."""
    d = _dims(device)
    H, L, V = d["H"], d["L"], d["V"]
    vals = [300.0, 1.0625, 1.1875, -1.0625, 17.0, 3 * 2.0**-10, 2.0**-10, 5 * 2.0**-10]
    want = [288.0, 1.0, 1.25, -1.0, 16.0, 2.0**-8, 0.0, 2.0**-8]
    x = torch.zeros(2, H, L)
    x[:, :, : len(vals)] = torch.tensor(vals)
    x[:, :, len(vals) : 16] = 0.5
    x = x.to(device, BF16)
    w = torch.eye(L, V).expand(H, L, V).contiguous().to(device, BF16)
    c, s = fusemla.mla_epilogue(x, w, out_dtype=FP8, group_size=16, scale_ue8m0=True)
    assert bool((s[:, 0 :: V // 16] == 1.0).all())  # each head's first group
    for n in range(2):
        for h in range(H):
            assert c[n, h * V : h * V + len(vals)].float().tolist() == want, (n, h)
            assert bool((c[n, h * V + len(vals) : h * V + 16].float() == 0.5).all())


def test_scale_col_major(device):
    """``scale_col_major``: scales [N, G] with strides (1, N), values as the reference's (which
    lays them out the same way)."""
    d = _dims(device)
    g = _gen("colmajor")
    N = 21
    x = _act(N, d["H"], d["L"], g, BF16, device)
    w = _plain_w(d["H"], d["L"], d["V"], g, BF16, device)
    kw = dict(out_dtype=FP8, group_size=32, scale_col_major=True)
    fused, ref = _run_both(x, w, **kw)
    G = d["H"] * d["V"] // 32
    assert fused[1].shape == (N, G) and fused[1].stride() == (1, N)
    assert ref[1].stride() == (1, N)
    _check(x, w, fused, ref, group=32)
    row_major = fusemla.mla_epilogue(x, w, out_dtype=FP8, group_size=32)
    assert row_major[1].stride() == (G, 1)
    assert torch.equal(row_major[1], fused[1]) and torch.equal(
        _bytes(row_major[0]), _bytes(fused[0])
    )


def _align4(n: int) -> int:
    return -(-n // 4) * 4


@pytest.mark.parametrize("layout", ["tma-col-major", "padded-rows"])
def test_given_scale_out_with_arbitrary_strides(device, layout):
    """A caller's scales buffer: a TMA-aligned column-major one (stride (1, align4(N))) or a
    column slice of a wider row-major one; padding bytes stay as they were."""
    d = _dims(device)
    g = _gen("scale-out", layout)
    N = 13
    G = d["H"] * d["V"] // 32
    x = _act(N, d["H"], d["L"], g, BF16, device)
    w = _plain_w(d["H"], d["L"], d["V"], g, BF16, device)
    if layout == "tma-col-major":
        base = torch.full((G, _align4(N) + 4), float("nan"), device=device)
        scale_out = base[:, :N].t()
        assert scale_out.stride() == (1, _align4(N) + 4)
    else:
        base = torch.full((N, G + 5), float("nan"), device=device)
        scale_out = base[:, 2 : 2 + G]
    before = base.clone()
    c, s = fusemla.mla_epilogue(x, w, out_dtype=FP8, group_size=32, scale_out=scale_out)
    assert s.data_ptr() == scale_out.data_ptr() and s.stride() == scale_out.stride()
    assert not torch.isnan(s).any()
    ref = fusemla.mla_epilogue_ref(x, w, out_dtype=FP8, group_size=32)
    _check(x, w, (c, s), ref, group=32)
    written = torch.zeros_like(base, dtype=torch.bool)
    if layout == "tma-col-major":
        written[:, :N] = True
    else:
        written[:, 2 : 2 + G] = True
    assert torch.equal(base[~written].isnan(), before[~written].isnan())
    assert bool(base[~written].isnan().all())


@pytest.mark.parametrize("out", ["act", "fp8"])
def test_given_out_is_a_column_slice_of_a_poisoned_buffer(device, out):
    """``out`` a column slice of a wider buffer full of NaN (0x7F bytes for FP8): the written
    region holds the result (no NaN left), every byte around it is untouched."""
    d = _dims(device)
    g = _gen("out-slice", out)
    N, HV = 19, d["H"] * d["V"]
    x = _act(N, d["H"], d["L"], g, BF16, device)
    w = _plain_w(d["H"], d["L"], d["V"], g, BF16, device)
    lo = 16
    dtype = FP8 if out == "fp8" else BF16
    wide = poisoned((N, lo + HV + 48), dtype, device)
    before = _bytes(wide).clone()
    dest = wide[:, lo : lo + HV]
    kw = dict(out_dtype=FP8, group_size=32) if out == "fp8" else {}
    res = fusemla.mla_epilogue(x, w, out=dest, **kw)
    got = res[0] if out == "fp8" else res
    assert got.data_ptr() == dest.data_ptr()
    assert not torch.isnan(got.float()).any()
    after = _bytes(wide)
    assert torch.equal(after[:, :lo], before[:, :lo])
    assert torch.equal(after[:, lo + HV :], before[:, lo + HV :])
    ref = fusemla.mla_epilogue_ref(x, w, **kw)
    _check(x, w, res, ref, group=32)
    plain = fusemla.mla_epilogue(x, w, **kw)
    plain = plain[0] if out == "fp8" else plain
    assert torch.equal(_bytes(got.contiguous()), _bytes(plain))


def test_forced_tiles_match_reference(device):
    """Other tiles than the table's (wider token and V tiles, 16-row chunks) still agree."""
    d = _dims(device)
    g = _gen("forced")
    x = _act(37, d["H"], d["L"], g, BF16, device)
    w = _kv_b_proj_w_uv(d["H"], 32 if device == "cpu" else 128, d["L"], d["V"], (32, 32), g, device)
    with configs.override(BLOCK_T=32, BLOCK_V=64, BLOCK_K=16):
        fused = fusemla.mla_epilogue(x, w, out_dtype=FP8, group_size=32)
        fused_act = fusemla.mla_epilogue(x, w)
    _check(x, w, fused, fusemla.mla_epilogue_ref(x, w, out_dtype=FP8, group_size=32), group=32)
    _check(x, w, fused_act, fusemla.mla_epilogue_ref(x, w))


def _split_test_w(weights: str, H: int, L: int, V: int, g, device: str):
    """W_UV for the split tests: "plain" bf16, "head" FP8 per head, "block" a block-FP8
    kv_b_proj's W_UV as stored (32 x 32 blocks on the CPU, DeepSeek's 128 x 128 on GPU)."""
    if weights == "plain":
        return _plain_w(H, L, V, g, BF16, device)
    if weights == "head":
        return quantize_fp8_weight(_plain_w(H, L, V, g, torch.float32, device), per_head=True)
    blk = (32, 32) if device == "cpu" else (128, 128)
    return _kv_b_proj_w_uv(H, blk[0], L, V, blk, g, device)


def _launch_poisoned(x, w, kw: dict, cfg: dict):
    """One launch with tiles ``cfg`` into freshly poisoned outputs: ``(plan, result)``."""
    a = prepare(x, w, **kw)
    for t in (a.out, a.scale_out):
        if t is not None:
            t.copy_(poisoned(t.shape, t.dtype, t.device))
    pl = launch_mod.plan(a, cfg=cfg)
    launch_mod.launch(a, cfg)
    return pl, a.result


def _same_bytes(r1, r2) -> bool:
    first = r1 if isinstance(r1, tuple) else (r1,)
    second = r2 if isinstance(r2, tuple) else (r2,)
    return all(torch.equal(_bytes(t1), _bytes(t2)) for t1, t2 in zip(first, second))


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("weights", ["plain", "head", "block"])
def test_split_latent_matches_reference_and_repeats_bit_for_bit(device, weights, split):
    """SPLIT programs per item, their partial sums meeting in a workspace: the result agrees
    with the reference, is bit-identical from run to run (the last program adds the parts in
    split order): a second launch on the same arguments gives the same bytes."""
    d = _dims(device)
    g = _gen("split", weights, split)
    H, L, V = d["H"], d["L"], d["V"]
    x = _act(21, H, L, g, BF16, device)
    w = _split_test_w(weights, H, L, V, g, device)
    bk = 16 if device == "cpu" else 64  # several chunks per split
    for kw, group in ((dict(out_dtype=FP8, group_size=32), 32), ({}, 128)):
        ref = fusemla.mla_epilogue_ref(x, w, **kw)
        runs = []
        for _ in range(2):
            plan, result = _launch_poisoned(x, w, kw, dict(BLOCK_K=bk, SPLIT=split))
            assert plan.split == split and plan.grid == (plan.n_items * split,)
            runs.append(result)
        _check(x, w, runs[0], ref, group=group)
        assert _same_bytes(*runs)


def test_split_counters_are_zero_after_every_launch_and_shared_across_splits(device):
    """The split launches' arrival counters live in one buffer per device and stream, never
    zeroed by the launcher after it is made: each item's last program sets its counter back
    to 0. Launches of different SPLIT (and a 2-chunk latent, the shortest split) one after the
    other on that buffer all match the reference, and leave every counter at 0."""
    d = _dims(device)
    g = _gen("split-counters")
    H, L, V = d["H"], d["L"], d["V"]
    x = _act(19, H, L, g, BF16, device)
    w = _plain_w(H, L, V, g, BF16, device)
    bk = 16 if device == "cpu" else 64
    kw = dict(out_dtype=FP8, group_size=32)
    ref = fusemla.mla_epilogue_ref(x, w, **kw)
    for split in (2, 4, 2, L // bk):
        a = prepare(x, w, **kw)
        for t in (a.out, a.scale_out):
            t.copy_(poisoned(t.shape, t.dtype, t.device))
        cfg = dict(BLOCK_K=bk, SPLIT=split)
        pl = launch_mod.plan(a, cfg=cfg)
        cnt = launch_mod.split_counters(x.device, pl.n_items)
        assert cnt.numel() >= pl.n_items
        cnt[: pl.n_items].fill_(0)  # what a fresh buffer holds; a stale count would show below
        launch_mod.launch(a, cfg)
        assert launch_mod.split_counters(x.device, pl.n_items).data_ptr() == cnt.data_ptr()
        assert int(cnt.count_nonzero()) == 0, f"SPLIT={split}: counters left non-zero"
        _check(x, w, a.result, ref, group=32)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("weights", ["plain", "head", "block"])
@pytest.mark.parametrize("layout", ["row", "col"])
def test_group_wider_than_the_v_tile_meets_in_the_workspace(device, weights, split, layout):
    """An FP8 output whose group is wider than BLOCK_V: the group's GROUP / BLOCK_V programs
    (x SPLIT of the latent) meet in the workspace and the last quantizes the whole group; codes
    and scales agree with the reference (UE8M0 and plain scales, row- and column-major scale
    outputs, two token tiles, every group of each head), the counters are left at 0, and a
    second launch gives the same bytes."""
    d = _dims(device)
    g = _gen("vsub", weights, split, layout)
    H, L, V = d["H"], d["L"], d["V"]
    N = 21 if device == "cpu" else 37
    x = _act(N, H, L, g, BF16, device)
    w = _split_test_w(weights, H, L, V, g, device)
    bk = 16 if device == "cpu" else 64
    cases = [(V, V // 4), (V // 2, 16)] if device == "cpu" else [(128, 32), (128, 64)]
    for group, bv in cases:
        for ue8m0 in (False, True):
            kw = dict(
                out_dtype=FP8, group_size=group, scale_ue8m0=ue8m0, scale_col_major=layout == "col"
            )
            ref = fusemla.mla_epilogue_ref(x, w, **kw)
            cfg = dict(BLOCK_K=bk, BLOCK_V=bv, SPLIT=split)
            runs = []
            for _ in range(2):
                a = prepare(x, w, **kw)
                for t in (a.out, a.scale_out):
                    t.copy_(poisoned(t.shape, t.dtype, t.device))
                pl = launch_mod.plan(a, cfg=cfg)
                assert pl.vsub == group // bv and pl.split == split
                launch_mod.launch(a, cfg)
                cnt = launch_mod.split_counters(x.device, pl.n_items)
                assert int(cnt.count_nonzero()) == 0, "arrival counters left non-zero"
                runs.append(a.result)
            _check(x, w, runs[0], ref, group=group, ue8m0=ue8m0)
            for t1, t2 in zip(runs[0], runs[1]):
                assert torch.equal(_bytes(t1), _bytes(t2))


@pytest.mark.parametrize("weights", ["plain", "head", "block"])
def test_gemv_chunks_match_the_reference(device, weights):
    """GEMV: each chunk's product on the CUDA cores (fp32 products summed over the chunk), for
    a few tokens: token tiles of 1, 2 and 4 rows, as one 3-D product or a row at a time
    (GEMV_ROWS), a chunk as long as the latent (read whole before the PDL wait) or several,
    with SPLIT and with an FP8 group wider than the V tile (both meet in the workspace). bf16 and FP8 outputs agree with the reference (within the
    accumulation order's one step), every output byte written, the counters left at 0, and a
    second launch gives the same bytes."""
    d = _dims(device)
    g = _gen("gemv", weights)
    H, L, V = d["H"], d["L"], d["V"]
    w = _split_test_w(weights, H, L, V, g, device)
    cfgs = [
        dict(BLOCK_T=1, BLOCK_V=V, BLOCK_K=L, SPLIT=1),  # block weights: a chunk of all blocks
        dict(BLOCK_T=2, BLOCK_V=16, BLOCK_K=16, SPLIT=2),
        dict(BLOCK_T=4, BLOCK_V=32, BLOCK_K=16, SPLIT=1),
        # the tile's tokens one at a time (GEMV_ROWS): a tile wider than the batch (rows
        # beyond N read zeros), whole-latent chunks, a split
        dict(BLOCK_T=4, BLOCK_V=16, BLOCK_K=L, SPLIT=1, GEMV_ROWS=True),
        dict(BLOCK_T=2, BLOCK_V=32, BLOCK_K=16, SPLIT=2, GEMV_ROWS=True),
    ]
    for N in (1, 3):
        x = _act(N, H, L, g, BF16, device)
        for kw, group in ((dict(out_dtype=FP8, group_size=32), 32), ({}, 128)):
            ref = fusemla.mla_epilogue_ref(x, w, **kw)
            for cfg in cfgs:
                cfg = dict(cfg, GEMV=True, num_warps=4, num_stages=1)
                runs = []
                for _ in range(2):
                    pl, result = _launch_poisoned(x, w, kw, cfg)
                    assert pl.constexprs["GEMV"] is True
                    assert pl.constexprs["BLOCK_T"] == cfg["BLOCK_T"]
                    assert pl.constexprs["GEMV_ROWS"] is cfg.get("GEMV_ROWS", False)
                    if pl.split * pl.vsub > 1:
                        cnt = launch_mod.split_counters(x.device, pl.n_items)
                        assert int(cnt.count_nonzero()) == 0, "arrival counters left non-zero"
                    runs.append(result)
                _check(x, w, runs[0], ref, group=group)
                assert _same_bytes(*runs), cfg


def test_gemv_tiles_are_checked(device):
    """A token tile below 16 rows only with GEMV (the MMA needs 16); GEMV and GEMV_ROWS bools,
    GEMV_ROWS only with GEMV."""
    d = _dims(device)
    g = _gen("gemv-bad")
    x, w = _act(3, d["H"], d["L"], g, BF16, device), _plain_w(d["H"], d["L"], d["V"], g)
    a = prepare(x, w.to(device))
    with pytest.raises(ValueError, match="BLOCK_T: expected a power of two >= 16"):
        launch_mod.plan(a, cfg=dict(BLOCK_T=4))
    with pytest.raises(ValueError, match="BLOCK_T: expected a power of two >= 1"):
        launch_mod.plan(a, cfg=dict(BLOCK_T=3, GEMV=True))
    with pytest.raises(ValueError, match="GEMV: expected a bool"):
        launch_mod.plan(a, cfg=dict(GEMV=1))
    with pytest.raises(ValueError, match="GEMV_ROWS: expected a bool"):
        launch_mod.plan(a, cfg=dict(GEMV=True, GEMV_ROWS=1))
    with pytest.raises(ValueError, match="a form of GEMV"):
        launch_mod.plan(a, cfg=dict(GEMV_ROWS=True))
    # a chunk across blocks of scale rows: the dot path refuses it, GEMV scales each element
    wb = _split_test_w("block", d["H"], d["L"], d["V"], g, device)
    ab = prepare(x, wb)
    blk = wb.block[0]
    with pytest.raises(ValueError, match="straddles"):
        launch_mod.plan(ab, cfg=dict(BLOCK_K=2 * blk))
    assert (
        launch_mod.plan(ab, cfg=dict(BLOCK_K=2 * blk, GEMV=True)).constexprs["BLOCK_K"] == 2 * blk
    )
    assert launch_mod.plan(a, cfg=dict(BLOCK_T=1, GEMV=True)).constexprs["GEMV"] is True
    # no explicit tiles: the table's GEMV rule decides (CUDA at 16 heads: one token per program
    # at 2-8 tokens), never on the interpreter
    pl = launch_mod.plan(a)
    rule = configs.gemv_rule(3, d["H"], d["L"], d["V"], 2, False, pl.backend)
    assert pl.constexprs["GEMV"] is (rule is not None)
    if device == "cpu":
        assert rule is None


def test_split_that_does_not_divide_the_latent_is_refused(device):
    d = _dims(device)
    g = _gen("split-bad")
    x, w = _act(3, d["H"], d["L"], g, BF16, device), _plain_w(d["H"], d["L"], d["V"], g)
    a = prepare(x, w.to(device))
    chunks = d["L"] // 16
    with pytest.raises(ValueError, match="SPLIT=.* does not divide"):
        launch_mod.plan(a, cfg=dict(BLOCK_K=16, SPLIT=2 * chunks))
    with pytest.raises(ValueError, match="SPLIT: expected a power of two"):
        launch_mod.plan(a, cfg=dict(SPLIT=3))


@pytest.mark.gpu
@pytest.mark.parametrize("out", ["act", "fp8", "fp8-ue8m0"])
@pytest.mark.parametrize("N", [1, 8, 64, 300])
@pytest.mark.parametrize("H", [16, 128])
def test_deepseek_v3_dims_block_fp8(device, H, N, out):
    """DeepSeek-V3 (L = 512, V = 128, 128 x 128 block scales from kv_b_proj, groups of 128)
    with 16 (TP8) and 128 heads; all three batch buckets."""
    g = _gen("dsv3", H, N, out)
    w = _kv_b_proj_w_uv(H, 128, 512, 128, (128, 128), g, device)
    x = _act(N, H, 512, g, BF16, device)
    kw = {} if out == "act" else dict(out_dtype=FP8, group_size=128, scale_ue8m0=out != "fp8")
    fused, ref = _run_both(x, w, **kw)
    _check(x, w, fused, ref, group=128, ue8m0=out == "fp8-ue8m0")


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 200])
def test_fp8_output_group_512(device, N):
    """V = 512 quantized in one group per head (small and large batch buckets)."""
    g = _gen("group512", N)
    x = _act(N, 2, 512, g, BF16, device)
    w = _plain_w(2, 512, 512, g, BF16, device)
    fused, ref = _run_both(x, w, out_dtype=FP8, group_size=512)
    _check(x, w, fused, ref, group=512)


# ----------------------------------------------------------------------------- 3. shapes


@pytest.fixture
def kernel_spy(monkeypatch):
    spy = KernelSpy(launch_mod.mla_epilogue_kernel)
    monkeypatch.setattr(launch_mod, "mla_epilogue_kernel", spy)
    return spy


@pytest.mark.parametrize("out", ["act", "fp8"])
@pytest.mark.parametrize("N", [0, 1, 5, 17, 40])
def test_token_counts(device, N, out, kernel_spy):
    """N = 0 returns empty results without a launch; 1 to 40 tokens (up to three 16-token
    tiles under the interpreter) run one launch each."""
    d = _dims(device)
    g = _gen("tokens", N, out)
    x = _act(N, d["H"], d["L"], g, BF16, device)
    w = _plain_w(d["H"], d["L"], d["V"], g, BF16, device)
    kw = dict(out_dtype=FP8, group_size=32) if out == "fp8" else {}
    fused, ref = _run_both(x, w, **kw)
    assert len(kernel_spy.calls) == (1 if N else 0)
    HV = d["H"] * d["V"]
    if N == 0:
        if out == "fp8":
            assert fused[0].shape == (0, HV) and fused[0].dtype == FP8
            assert fused[1].shape == (0, HV // 32) and fused[1].dtype == torch.float32
        else:
            assert fused.shape == (0, HV) and fused.dtype == BF16
        return
    _check(x, w, fused, ref, group=32)


@pytest.mark.parametrize("out", ["act", "fp8"])
def test_latent_not_a_multiple_of_the_chunk(device, out):
    """L = 80 (two full 32-row chunks and a masked half chunk; 272 on a GPU)."""
    H = _dims(device)["H"]
    L, V = (80, 64) if device == "cpu" else (272, 128)
    g = _gen("L80", out)
    x = _act(17, H, L, g, BF16, device)
    w = _plain_w(H, L, V, g, BF16, device)
    kw = dict(out_dtype=FP8, group_size=16) if out == "fp8" else {}
    fused, ref = _run_both(x, w, **kw)
    _check(x, w, fused, ref, group=16)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_v_not_a_power_of_two(device, dtype):
    """V = 48 (96 on a GPU), output in the activations' dtype: a masked V tile tail."""
    H, L = _dims(device)["H"], _dims(device)["L"]
    V = 48 if device == "cpu" else 96
    g = _gen("V48", dtype)
    x = _act(9, H, L, g, dtype, device)
    w = _plain_w(H, L, V, g, dtype, device, "kmajor")
    fused, ref = _run_both(x, w)
    assert fused.shape == (9, H * V)
    _check(x, w, fused, ref)


@pytest.mark.parametrize("V", [8, 1])
def test_v_below_16(device, V):
    """V = 8 or 1 with an output in the activations' dtype: the contract accepts it (groups
    only constrain FP8 outputs) and the reference computes it; so must the fused op."""
    H, L = _dims(device)["H"], _dims(device)["L"]
    g = _gen("V-small", V)
    x = _act(5, H, L, g, BF16, device)
    w = _plain_w(H, L, V, g, BF16, device)
    ref = fusemla.mla_epilogue_ref(x, w)
    assert ref.shape == (5, H * V)
    fused = fusemla.mla_epilogue(x, w)
    _check(x, w, fused, ref)


@pytest.mark.parametrize("view", ["latent-slice", "head-strided", "head-major"])
@pytest.mark.parametrize("out", ["act", "fp8"])
def test_non_contiguous_attn_out(device, view, out):
    """attn_out a view: ``x[:, :, :L]`` of ``[N, H, L + 64]``, every other head of
    ``[N, 2H, L]``, or ``[H, N, L].transpose(0, 1)`` (what a bmm over heads writes)."""
    d = _dims(device)
    H, L = d["H"], d["L"]
    N = 18
    g = _gen("views", view, out)
    if view == "latent-slice":
        x = _act(N, H, L + 64, g, BF16, device)[:, :, :L]
    elif view == "head-strided":
        x = _act(N, 2 * H, L, g, BF16, device)[:, 1::2]
    else:
        x = torch.randn(H, N, L, generator=g).to(device, BF16).transpose(0, 1)
    assert not x.is_contiguous() and x.stride(-1) == 1 and x.shape == (N, H, L)
    w = _plain_w(H, L, d["V"], g, BF16, device)
    kw = dict(out_dtype=FP8, group_size=32) if out == "fp8" else {}
    fused, ref = _run_both(x, w, **kw)
    _check(x, w, fused, ref, group=32)
    again = fusemla.mla_epilogue(x.contiguous(), w, **kw)  # the layout changes nothing
    for a, b in zip(fused if out == "fp8" else (fused,), again if out == "fp8" else (again,)):
        assert torch.equal(_bytes(a), _bytes(b))


# ----------------------------------------------------------------------------- 4. spec / step

STEP_CASES = {
    "plain-bf16": (lambda d, g, dev: _plain_w(d["H"], d["L"], d["V"], g, BF16, dev), {}),
    "plain-vllm-fp8-colmajor": (
        lambda d, g, dev: _plain_w(d["H"], d["L"], d["V"], g, BF16, dev, "vllm"),
        dict(out_dtype=FP8, group_size=32, scale_col_major=True),
    ),
    "fp8-head-ue8m0": (
        lambda d, g, dev: quantize_fp8_weight(
            _plain_w(d["H"], d["L"], d["V"], g, torch.float32, dev), per_head=True
        ),
        dict(out_dtype=FP8, group_size=16, scale_ue8m0=True),
    ),
    "fp8-block-explicit-act": (
        lambda d, g, dev: _kv_b_proj_w_uv(d["H"], 32, d["L"], d["V"], (32, 32), g, dev),
        dict(out_dtype=BF16),
    ),
}


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_step_on_a_spec_equals_the_one_call(device, case):
    """``mla_epilogue_step(epilogue_spec(w, ...), x)`` is ``mla_epilogue(x, w, ...)`` bit for
    bit (results, layouts of the scales), with fresh and with given outputs."""
    d = _dims(device)
    g = _gen("step", case)
    make_w, kw = STEP_CASES[case]
    w = make_w(d, g, device)
    spec = fusemla.epilogue_spec(w, **kw)
    assert isinstance(spec, EpilogueSpec) and isinstance(spec, fusemla.EpilogueSpec)
    assert spec.w_uv is w and (spec.H, spec.L, spec.V) == (d["H"], d["L"], d["V"])
    for N in (5, 17):
        x = _act(N, d["H"], d["L"], g, BF16, device)
        one = fusemla.mla_epilogue(x, w, **kw)
        step = fusemla.mla_epilogue_step(spec, x)
        ones, steps = (one, step) if isinstance(one, tuple) else ((one,), (step,))
        assert len(ones) == len(steps)
        for a, b in zip(ones, steps):
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            assert torch.equal(_bytes(a), _bytes(b))
        # into given buffers
        outs = {"out": torch.empty_like(ones[0])}
        if len(ones) == 2:
            outs["scale_out"] = torch.empty_like(ones[1])
        got = fusemla.mla_epilogue_step(spec, x, **outs)
        got = got if isinstance(got, tuple) else (got,)
        assert got[0].data_ptr() == outs["out"].data_ptr()
        for a, b in zip(ones, got):
            assert torch.equal(_bytes(a), _bytes(b))


# ----------------------------------------------------------------------------- 5. errors


def _error_cases():
    """(id, fp8 output?, mutate(kw, ctx), exception, match): each host-side check. ``kw`` is a
    valid ``mla_epilogue`` call (2 heads, L = V = 64, 3 tokens) with poisoned ``out`` (and
    ``scale_out``); ``ctx`` has the device and a generator."""

    def set_(**new):
        return lambda kw, ctx: kw.update(new)

    def replace(name, fn):
        return lambda kw, ctx: kw.update({name: fn(kw[name], ctx)})

    def strided_last(x, ctx):
        return torch.stack([x, x], dim=-1)[..., 0]

    def mxfp4(w, ctx):
        return quantize_mxfp4_weight(w.float())

    def fp8_w(w, ctx):
        return quantize_fp8_weight(w.float(), per_head=True)

    def block_w(rows):
        def make(w, ctx):
            H, L, V = w.shape
            data = w.float().mul(64).to(FP8)
            scale = torch.ones(H, -(-L // rows), -(-V // 32), device=w.device)
            return QuantizedWeight(data, scale, "fp8", block=(rows, 32))

        return make

    def meta_like(x, ctx):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")

    E, T = FuseMLAValueError, FuseMLATypeError
    return [
        ("attn_out list", False, set_(attn_out=[[1.0]]), T, r"attn_out.*Tensor"),
        (
            "attn_out rank",
            False,
            replace("attn_out", lambda x, c: x[0]),
            E,
            r"attn_out.*\[N, H, L\]",
        ),
        (
            "attn_out fp32",
            False,
            replace("attn_out", lambda x, c: x.float()),
            T,
            r"attn_out.*dtype",
        ),
        ("attn_out int", False, replace("attn_out", lambda x, c: x.int()), T, r"attn_out.*dtype"),
        ("attn_out layout", False, replace("attn_out", strided_last), E, r"attn_out.*contiguous"),
        ("attn_out no heads", False, replace("attn_out", lambda x, c: x[:, :0]), E, r"attn_out"),
        ("w_uv heads", False, replace("w_uv", lambda w, c: w[:1]), E, r"w_uv.*shape.*H=2"),
        ("w_uv latent", False, replace("w_uv", lambda w, c: w[:, :32]), E, r"w_uv.*L=64"),
        ("w_uv rank", False, replace("w_uv", lambda w, c: w[0]), E, r"w_uv.*shape"),
        ("w_uv fp16", False, replace("w_uv", lambda w, c: w.half()), T, r"w_uv.*bfloat16"),
        ("w_uv fp32", False, replace("w_uv", lambda w, c: w.float()), T, r"w_uv.*dtype"),
        ("w_uv layout", False, replace("w_uv", strided_last), E, r"w_uv: expected stride 1"),
        ("w_uv list", False, set_(w_uv=[1.0]), T, r"w_uv.*Tensor"),
        ("w_uv mxfp4", False, replace("w_uv", mxfp4), E, r"w_uv.*mxfp4"),
        ("w_uv fp8 heads", False, replace("w_uv", lambda w, c: fp8_w(w[:1], c)), E, r"w_uv.*shape"),
        ("w_uv 8-row blocks", False, replace("w_uv", block_w(8)), E, r"w_uv.*8 rows"),
        ("out shape", False, replace("out", lambda o, c: o[:, :64]), E, r"out.*shape.*H\*V=128"),
        ("out rows", False, replace("out", lambda o, c: o[:2]), E, r"out.*shape.*N=3"),
        ("out fp16", False, replace("out", lambda o, c: o.half()), T, r"out.*dtype"),
        ("out fp8 for act", False, replace("out", lambda o, c: o.to(FP8)), T, r"out.*dtype"),
        (
            "out bf16 for fp8",
            True,
            replace("out", lambda o, c: o.float().bfloat16()),
            T,
            r"out.*dtype",
        ),
        (
            "out fnuz for fn",
            True,
            replace("out", lambda o, c: o.view(torch.uint8).view(FNUZ)),
            T,
            r"out.*dtype",
        ),
        ("out layout", False, replace("out", strided_last), E, r"out.*contiguous"),
        ("out list", False, set_(out=[0.0]), T, r"out.*Tensor"),
        ("scale_out for act", False, set_(scale_out="fresh"), E, r"scale_out.*only FP8"),
        (
            "scale_out shape",
            True,
            replace("scale_out", lambda s, c: s[:, :2]),
            E,
            r"scale_out.*shape",
        ),
        (
            "scale_out bf16",
            True,
            replace("scale_out", lambda s, c: s.bfloat16()),
            T,
            r"scale_out.*dtype",
        ),
        ("scale_out list", True, set_(scale_out=[1.0]), T, r"scale_out.*Tensor"),
        ("group 24", True, set_(group_size=24), E, r"group_size.*power of two"),
        ("group 8", True, set_(group_size=8), E, r"group_size.*>= 16"),
        ("group 128 > V", True, set_(group_size=128), E, r"group_size.*V=64"),
        ("group bool", True, set_(group_size=True), T, r"group_size"),
        ("group float", True, set_(group_size=32.0), T, r"group_size"),
        ("group 0 act", False, set_(group_size=0), E, r"group_size"),
        ("out_dtype fp32", False, set_(out_dtype=torch.float32), T, r"out_dtype"),
        ("out_dtype int8", False, set_(out_dtype=torch.int8), T, r"out_dtype"),
        ("out_dtype int", False, set_(out_dtype=5), T, r"out_dtype"),
        ("out_dtype str", False, set_(out_dtype="fp8"), T, r"out_dtype"),
        ("out_dtype fp16", False, set_(out_dtype=FP16), T, r"out_dtype.*bfloat16"),
        ("ue8m0 int", True, set_(scale_ue8m0=1), T, r"scale_ue8m0.*bool"),
        ("col_major str", True, set_(scale_col_major="yes"), T, r"scale_col_major.*bool"),
        ("attn_out device", False, replace("attn_out", meta_like), T, r"attn_out.*device"),
        ("out device", False, replace("out", meta_like), T, r"out.*device"),
        ("scale_out device", True, replace("scale_out", meta_like), T, r"scale_out.*device"),
    ]


_ERRORS = _error_cases()


@pytest.mark.parametrize("case", range(len(_ERRORS)), ids=[c[0] for c in _ERRORS])
def test_bad_argument_raises_before_writing(device, case):
    name, fp8, mutate, exc, pattern = _ERRORS[case]
    g = _gen("bad", name)
    N, H, L, V = 3, 2, 64, 64
    x = _act(N, H, L, g, BF16, device)
    w = _plain_w(H, L, V, g, BF16, device)
    kw = dict(attn_out=x, w_uv=w, out=poisoned((N, H * V), FP8 if fp8 else BF16, device))
    if fp8:
        kw.update(
            out_dtype=FP8,
            group_size=32,
            scale_out=poisoned((N, H * V // 32), torch.float32, device),
        )
    mutate(kw, dict(device=device, g=g))
    if kw.get("scale_out") == "fresh":
        kw["scale_out"] = poisoned((N, H * V // 32), torch.float32, device)
    buffers = [kw[k] for k in ("out", "scale_out") if isinstance(kw.get(k), torch.Tensor)]
    buffers = [b for b in buffers if b.device.type != "meta"]
    before = [_bytes(b).clone() if b.element_size() <= 2 else b.clone() for b in buffers]
    for fn in (fusemla.mla_epilogue, fusemla.mla_epilogue_ref):
        with pytest.raises(exc, match=pattern) as info:
            fn(**kw)
        assert isinstance(info.value, FuseMLAError), name
        if name != "w_uv 8-row blocks":  # that message says "blocks of 8 rows", no "got"
            assert "got" in str(info.value), name
    for b, b0 in zip(buffers, before):
        if b.element_size() <= 2:
            assert torch.equal(_bytes(b), b0), f"{name}: a buffer was written"
        else:
            assert torch.equal(b.isnan(), b0.isnan()) and bool(b.isnan().all()), name


def test_outputs_over_the_input_or_each_other_are_refused(device):
    """An output that shares memory with attn_out or with the other output would be written
    while the kernel still reads (or writes) there: refused, naming both, before any byte
    changes; by the kernel and the reference alike. Views of one buffer are compared by address
    range, so interleaved rows are refused too; disjoint slices of one buffer are fine."""
    g = _gen("overlap")
    N, H, L, V = 3, 2, 64, 64
    w = _plain_w(H, L, V, g, BF16, device)
    for fn in (fusemla.mla_epilogue, fusemla.mla_epilogue_ref):
        # o_proj's input cut from attn_out's own storage
        x = _act(N, H, L, g, BF16, device)
        x0 = _bytes(x).clone()
        with pytest.raises(FuseMLAValueError, match=r"out: expected memory apart from attn_out"):
            fn(x, w, out=x.view(N, H * L)[:, : H * V])
        assert torch.equal(_bytes(x), x0)
        # FP8 scales laid over the codes' bytes
        codes = poisoned((N, H * V), FP8, device)
        c0 = _bytes(codes).clone()
        over = codes.view(torch.uint8)[:, : 4 * (H * V // 32)].view(torch.float32)
        with pytest.raises(FuseMLAValueError, match=r"out: .*apart from scale_out"):
            fn(x, w, out=codes, out_dtype=FP8, group_size=32, scale_out=over)
        assert torch.equal(_bytes(codes), c0)
        # interleaved rows of one buffer: no element shared, the address ranges are
        buf = torch.randn(2 * N, H * L, generator=g).to(device, BF16)
        b0 = _bytes(buf).clone()
        with pytest.raises(FuseMLAValueError, match=r"out: expected memory apart from attn_out"):
            fn(buf[0::2].unflatten(1, (H, L)), w, out=buf[1::2])
        assert torch.equal(_bytes(buf), b0)
        # disjoint halves of one buffer: computed as from separate tensors
        x2 = buf[:N].unflatten(1, (H, L))
        want = fn(x2.clone(), w)
        got = fn(x2, w, out=buf[N:])
        assert got.data_ptr() == buf[N:].data_ptr()
        assert torch.equal(_bytes(got), _bytes(want)) and torch.equal(_bytes(buf[:N]), b0[:N])


def test_spec_and_step_errors(device):
    """The per-layer checks in ``epilogue_spec``, the step's against its spec."""
    d = dict(H=2, L=64, V=64)
    g = _gen("spec-errors")
    w = _plain_w(d["H"], d["L"], d["V"], g, BF16, device)
    x = _act(3, d["H"], d["L"], g, BF16, device)
    with pytest.raises(FuseMLAValueError, match=r"group_size.*power of two"):
        fusemla.epilogue_spec(w, out_dtype=FP8, group_size=48)
    with pytest.raises(FuseMLAValueError, match=r"w_uv.*mxfp4"):
        fusemla.epilogue_spec(quantize_mxfp4_weight(w.float()))
    with pytest.raises(FuseMLATypeError, match=r"out_dtype.*bfloat16"):
        fusemla.epilogue_spec(w, out_dtype=FP16)
    with pytest.raises(FuseMLATypeError, match=r"scale_ue8m0"):
        fusemla.epilogue_spec(w, out_dtype=FP8, scale_ue8m0=None)
    with pytest.raises(FuseMLAValueError, match=r"w_uv.*shape"):
        fusemla.epilogue_spec(w[0])
    out = poisoned((3, 128), BF16, device)
    before = _bytes(out).clone()
    spec = fusemla.epilogue_spec(w)
    with pytest.raises(FuseMLATypeError, match=r"spec.*EpilogueSpec"):
        fusemla.mla_epilogue_step(w, x, out=out)
    with pytest.raises(FuseMLATypeError, match=r"spec.*EpilogueSpec"):
        fusemla.mla_epilogue_step(dict(w_uv=w), x, out=out)
    with pytest.raises(FuseMLAValueError, match=r"attn_out.*H=2, L=64"):
        fusemla.mla_epilogue_step(spec, _act(3, 2, 32, g, BF16, device), out=out)
    with pytest.raises(FuseMLATypeError, match=r"attn_out.*bfloat16.*w_uv"):
        fusemla.mla_epilogue_step(spec, x.half(), out=out)
    with pytest.raises(FuseMLATypeError, match=r"attn_out.*device"):
        fusemla.mla_epilogue_step(spec, x.to("meta"), out=out)
    with pytest.raises(FuseMLAValueError, match=r"scale_out.*only FP8"):
        fusemla.mla_epilogue_step(spec, x, out=out, scale_out=torch.empty(3, 4, device=device))
    fp8_spec = fusemla.epilogue_spec(quantize_fp8_weight(w.float()), out_dtype=BF16)
    with pytest.raises(FuseMLATypeError, match=r"attn_out.*out_dtype"):
        fusemla.mla_epilogue_step(fp8_spec, x.half(), out=out.half())
    with pytest.raises(FuseMLAValueError, match=r"out.*shape"):
        fusemla.mla_epilogue_step(fp8_spec, x, out=out[:, :100])
    assert torch.equal(_bytes(out), before)
    assert MIN_GROUP == 16


# ----------------------------------------------------------------------------- 6. the plan

PLAN_CASES = {
    "plain-act-small": ("plain", None, 5),
    "plain-fp8-medium": ("plain", dict(out_dtype=FP8, group_size=64), 17),
    "head-fp8-ue8m0": ("head", dict(out_dtype=FP8, group_size=16, scale_ue8m0=True), 9),
    "tensor-act-fp16": ("tensor", None, 20),
    "block-fp8-large": ("block", dict(out_dtype=FP8, group_size=32), 130),
    "block16-act": ("block16", None, 3),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_the_launch_runs_what_the_plan_returned(device, case, kernel_spy):
    """The launch's grid and every constexpr are ``launch.plan(args)``'s; pointers and strides
    are the arguments'; the plan's fields say what it chose."""
    gran, kw, N = PLAN_CASES[case]
    kw = kw or {}
    d = _dims(device)
    H, L, V = d["H"], d["L"], d["V"]
    g = _gen("plan", case)
    dtype = FP16 if case == "tensor-act-fp16" else BF16
    x = _act(N, H, L, g, dtype, device)
    if gran == "plain":
        w = _plain_w(H, L, V, g, dtype, device, "vllm")
    elif gran in ("head", "tensor"):
        w = quantize_fp8_weight(
            _plain_w(H, L, V, g, torch.float32, device), per_head=gran == "head"
        )
    else:
        block = (16, 32) if gran == "block16" else (32, 32)
        w = _kv_b_proj_w_uv(H, 32, L, V, block, g, device)
    args = prepare(x, w, **kw)
    expected = launch_mod.plan(args)
    res = fusemla.mla_epilogue_step(args.spec, x, out=args.out, scale_out=args.scale_out)
    assert len(kernel_spy.calls) == 1
    grid, kwargs = kernel_spy.calls[0]
    assert grid == expected.grid
    for key, value in expected.constexprs.items():
        assert kwargs[key] == value, key
    assert kwargs["N"] == N
    # pointers and strides: the arguments'
    assert kwargs["p_x"] is x and (kwargs["s_x_t"], kwargs["s_x_h"]) == x.stride()[:2]
    data = w if gran == "plain" else w.data
    assert kwargs["p_w"] is data
    assert (kwargs["s_w_h"], kwargs["s_w_k"], kwargs["s_w_v"]) == data.stride()
    assert kwargs["p_o"] is args.out and kwargs["s_o_t"] == args.out.stride(0)
    if gran == "block" or gran == "block16":
        assert kwargs["p_ws"] is w.scale
        assert (kwargs["s_ws_h"], kwargs["s_ws_k"], kwargs["s_ws_v"]) == w.scale.stride()
    elif gran == "head":
        assert kwargs["p_ws"] is w.scale and kwargs["s_ws_h"] == 1
    elif gran == "tensor":
        assert kwargs["p_ws"] is w.scale and kwargs["s_ws_h"] == 0
    if args.scale_out is not None:
        assert kwargs["p_os"] is args.scale_out
        assert (kwargs["s_os_t"], kwargs["s_os_g"]) == args.scale_out.stride()
    # what the plan says it chose
    pl, c = expected, expected.constexprs
    interp = device == "cpu"
    assert pl.backend == ("interpreter" if interp else "cuda")
    assert pl.weight_format == ("plain" if gran == "plain" else "fp8")
    assert pl.granularity == {"block16": "block"}.get(gran, gran)
    fp8_out = "out_dtype" in kw
    assert pl.out_format == ("float8_e4m3fn" if fp8_out else "act")
    assert pl.bucket == ("small" if N <= 16 else "large" if N >= 128 else "medium")
    assert c["W_FMT"] == {"plain": 0, "tensor": 1, "head": 1}.get(gran, 2)
    if gran.startswith("block"):
        assert (c["W_BK"], c["W_BN"]) == w.block
        # an MMA chunk lies inside one block of rows (GEMV scales each element: any chunk)
        assert c["GEMV"] or w.block[0] % c["BLOCK_K"] == 0
    else:
        assert (c["W_BK"], c["W_BN"]) == (0, 0)
    assert (c["L"], c["V"]) == (L, V)
    if fp8_out:
        assert c["OUT_FP8"] == 1 and c["FMAX"] == 448.0 and c["GROUP"] == kw["group_size"]
        assert c["BLOCK_V"] % kw["group_size"] == 0  # a V tile holds whole groups
        assert c["UE8M0"] is kw.get("scale_ue8m0", False)
    else:
        assert c["OUT_FP8"] == 0 and c["GROUP"] == 0 and c["UE8M0"] is False
    assert c["EPS"] == EPS
    assert c["DOT_FP32"] is interp and c["FIX_BF16"] is interp
    assert c["USE_PDL"] is pl.pdl and ("launch_pdl" in kwargs) is pl.pdl
    if interp:
        assert (c["BLOCK_T"], c["BLOCK_K"]) == (16, 32)
    assert pl.n_items == -(-N // c["BLOCK_T"]) * -(-V // c["BLOCK_V"]) * H
    assert pl.split == c["SPLIT"] and pl.n_programs == pl.n_items * pl.split  # SPLIT: few items
    assert {k: pl.cfg[k] for k in ("BLOCK_T", "BLOCK_V", "BLOCK_K")} == {
        k: c[k] for k in ("BLOCK_T", "BLOCK_V", "BLOCK_K")
    }
    # and the result is right
    ref = fusemla.mla_epilogue_ref(x, w, **kw)
    _check(x, w, res, ref, group=kw.get("group_size", 128), ue8m0=kw.get("scale_ue8m0", False))


def test_plan_buckets_and_tiles(device):
    """The three buckets are fixed by N alone (never the token count itself), and FP8 outputs
    widen the V tile to a whole group (on CUDA a few tokens at 16 heads take the GEMV rule's
    32-wide V tiles instead, a group's tiles meeting: VSUB)."""
    d = _dims(device)
    g = _gen("buckets")
    w = _plain_w(d["H"], d["L"], d["V"], g, BF16, device)
    plans = {}
    for N in (1, 2, 16, 17, 127, 128, 1000):
        x = _act(N, d["H"], d["L"], g, BF16, device)
        plans[N] = launch_mod.plan(prepare(x, w, out_dtype=FP8, group_size=d["V"]))
    assert [plans[N].bucket for N in plans] == ["small"] * 3 + ["medium"] * 2 + ["large"] * 2
    for N, pl in plans.items():
        assert pl.constexprs["GROUP"] == d["V"]
        if pl.constexprs["GEMV"]:
            assert pl.cfg["BLOCK_V"] * pl.vsub == d["V"] and pl.constexprs["VSUB"] == pl.vsub
        else:
            assert pl.cfg["BLOCK_V"] >= d["V"] and pl.vsub == 1
        assert pl.n_items == -(-N // pl.cfg["BLOCK_T"]) * -(-d["V"] // pl.cfg["BLOCK_V"]) * d["H"]
        assert pl.n_programs == pl.n_items * pl.constexprs["SPLIT"]

    # the same bucket: the same constexprs (one compiled variant), but for the latent split and
    # the stages the GPU tables pick for FP8 outputs of few items (configs._FP8_OUT_FEW)
    def tiles(pl):
        return {k: v for k, v in pl.constexprs.items() if k not in ("SPLIT", "num_stages")}

    # (on CUDA 1-8 tokens at 16 heads may take the GEMV rule's tiles instead: configs._GEMV_FEW)
    for n in (1, 2):
        assert plans[n].constexprs["GEMV"] or tiles(plans[n]) == tiles(plans[16])
    if device == "cpu":  # the interpreter: never the GEMV rule
        assert not any(pl.constexprs["GEMV"] for pl in plans.values())
    assert tiles(plans[17]) == tiles(plans[127])
    assert tiles(plans[128]) == tiles(plans[1000])


def test_bf16_output_of_few_items_takes_narrow_tiles():
    """A bf16 output in the medium bucket at few items (16 heads up to 64 tokens: the bucket's
    32 x 128 tiles give 16 heads one program per head and 32 tokens) takes 16-token, 64-wide
    tiles on CUDA, as the a85ce66 sweep measured faster (configs._BF16_OUT_FEW); the small and
    large buckets, 128 heads, FP8 outputs, ROCm and the interpreter keep the bucket's tiles."""

    def cfg(N, H=16, group=None, backend="cuda"):
        return configs.tiles(512, 128, N, backend, group=group, block_k=None, H=H)[1]

    few = dict(BLOCK_T=16, BLOCK_V=64, BLOCK_K=128, num_warps=4, num_stages=3, SPLIT=1)
    for N in (17, 32, 64):
        assert cfg(N) == few, N
    assert cfg(32, H=8) == few  # fewer heads: fewer items still
    medium = cfg(65)  # 48 items at the bucket's tiles: its own
    assert (medium["BLOCK_T"], medium["BLOCK_V"]) == (32, 128)
    assert cfg(32, H=128) == medium  # 128 items
    for other in (cfg(1), cfg(16), cfg(128), cfg(32, backend="rocm"), cfg(32, group=128)):
        assert (other["BLOCK_T"], other["BLOCK_V"]) != (16, 64), other
    assert cfg(32, backend="interpreter")["BLOCK_V"] == 32
    # a sweep's explicit tiles still win
    with configs.override(BLOCK_T=32, BLOCK_V=128):
        assert (cfg(32)["BLOCK_T"], cfg(32)["BLOCK_V"]) == (32, 128)


def test_fuse_token_spans_follow_the_measured_crossovers():
    """Where an engine's own W_UV bmm (+ its FP8 quant) is faster, the plugin keeps it: the
    table is per output kind, W_UV format and head count, conservative between head counts,
    and the interpreter (tests) always fuses. Measured in vLLM at 16 heads with an FP8 output:
    with the checkpoint's block-FP8 W_UV faster at 1, 16 and 32 tokens (ead800d, H100); with
    vLLM's bf16 W_UV faster at 1 (4698b24, fa9192d, H100), not at 8 (4698b24), nor at 32 or
    64 (fa9192d, both engine orders, where 9804a32's H200 engine with an older kernel had it
    faster)."""
    f = configs.fuse_token_spans
    at = configs.fuses_at
    bf16_w = f(16, True, "cuda")
    assert at(1, bf16_w)
    assert not any(at(n, bf16_w) for n in (0, 2, 8, 16, 31, 32, 64, 65, 128))
    assert configs.describe_spans(bf16_w) == "1"
    stored = f(16, True, "cuda", True)
    assert at(1, stored) and at(16, stored) and at(32, stored)
    assert not at(64, stored)  # not measured in the engine (the benchmark: slower)
    for H, fp8, w in (
        (128, True, False),
        (128, True, True),
        (16, False, False),
        (128, False, True),
    ):
        assert f(H, fp8, "cuda", w) == (), (H, fp8, w)  # nowhere measured faster
    for fp8 in (True, False):
        for w in (True, False):
            assert f(8, fp8, "cuda", w) == f(16, fp8, "cuda", w)
            assert f(32, fp8, "cuda", w) == f(64, fp8, "cuda", w) == f(128, fp8, "cuda", w)
            assert f(256, fp8, "cuda", w) == f(128, fp8, "cuda", w)
            assert f(16, fp8, "rocm", w) == f(16, fp8, "cuda", w)  # CUDA's until measured
            every = f(128, fp8, "interpreter", w)
            assert at(1, every) and at(1 << 40, every) and not at(0, every)
    # every entry: spans in order, apart, none empty (a step size is in at most one span)
    for key, spans in configs._FUSE_TOKENS.items():
        assert all(1 <= lo <= hi for lo, hi in spans), key
        assert all(a[1] + 1 < b[0] for a, b in zip(spans, spans[1:])), key
    # some step size of either W_UV: the plugin's layers keep the epilogue (an FP8 handoff)
    assert configs.fuses_anywhere(16, True, "cuda") and configs.fuses_anywhere(16, True, "rocm")
    assert not configs.fuses_anywhere(128, True, "cuda")
    assert not configs.fuses_anywhere(16, False, "cuda")
    assert configs.fuses_anywhere(128, False, "interpreter")
    assert configs.describe_spans(((1, 1), (32, 64))) == "1+32-64"
    assert configs.describe_spans(((1, 32),)) == "1-32"
    assert configs.describe_spans(()) == "none"
    assert configs.describe_spans(f(16, True, "interpreter")) == "all"


def test_few_tokens_take_the_gemv_tiles_where_measured():
    """Where a GPU measured the GEMV variant faster (16 heads; configs._GEMV_FEW: one token on
    the H200, two and eight on an H100 and the H200, four on the H200) the CUDA table picks it:
    a one-row token tile, one token per program, 32-wide V tiles up to two tokens (an FP8
    group's four meet), a whole group from five to eight (from three with an FP8 output); a
    bf16 output takes two-row tiles in turn (GEMV_ROWS) at three and four tokens. More tokens,
    more heads (128), ROCm and the interpreter keep the MMA tables' tiles, and explicit tiles
    (a sweep's cfg, override) replace keys of the MMA pick, not of GEMV's."""

    def cfg(N=1, H=16, group=None, w_bytes=2, backend="cuda", L=512, V=128, block_k=None):
        kw = dict(group=group, block_k=block_k, w_bytes=w_bytes, H=H)
        return configs.tiles(L, V, N, backend, **kw)[1]

    gemv = dict(BLOCK_T=1, BLOCK_V=32, BLOCK_K=512, num_warps=4, num_stages=1, SPLIT=1, GEMV=True)
    assert cfg() == gemv
    assert cfg(H=8) == gemv  # fewer heads still
    assert cfg(L=80, V=48, H=3) == dict(gemv, BLOCK_K=128)  # fitted to the latent
    assert cfg(group=128) == dict(gemv, num_warps=8)  # FP8 out, bf16 W_UV: 4 V tiles per group
    fp8_w = dict(gemv, BLOCK_K=128, num_warps=8, SPLIT=2)
    assert cfg(group=128, w_bytes=1, block_k=128) == fp8_w
    # a latent of one 128-row chunk cannot be split: SPLIT falls to what divides its chunks
    assert cfg(group=128, w_bytes=1, block_k=128, L=128) == dict(fp8_w, SPLIT=1)
    assert cfg(group=128, w_bytes=1, block_k=128, L=384)["SPLIT"] == 1  # 3 chunks
    # two tokens: one per program, the whole latent
    two = dict(gemv, num_warps=8)
    assert cfg(N=2) == two
    assert cfg(N=2, group=128) == gemv
    assert cfg(N=2, group=128, w_bytes=1, block_k=128) == two
    assert cfg(N=2, w_bytes=1, block_k=128) == cfg(N=1, w_bytes=1, block_k=128) == two
    # a bf16 output at three and four tokens: two-row tiles, their rows in turn
    rows = dict(gemv, BLOCK_T=2, GEMV_ROWS=True)
    for N in (3, 4):
        assert cfg(N=N) == rows, N
        assert cfg(N=N, w_bytes=1, block_k=128) == dict(rows, num_warps=8), N
    # then to eight (an FP8 output from three): one token per program, a whole group each
    group = dict(two, BLOCK_V=128)
    for N in (3, 4, 5, 8):
        assert cfg(N=N, group=128) == group, N
        assert cfg(N=N, group=128, w_bytes=1, block_k=128) == group, N
    for N in (5, 8):
        assert cfg(N=N) == cfg(N=N, w_bytes=1, block_k=128) == group, N
    assert cfg(N=8, V=48) == dict(group, BLOCK_V=64)  # fitted to V
    assert cfg(N=4, V=48) == dict(rows, BLOCK_V=32)
    for other in (
        cfg(N=9),
        cfg(N=9, group=128),
        cfg(N=16, group=128, w_bytes=1, block_k=128),
        cfg(N=9, w_bytes=1, block_k=128),
        cfg(H=17),
        cfg(H=128),
        cfg(N=2, H=128, group=128, w_bytes=1, block_k=128),
        cfg(backend="rocm"),
        cfg(N=2, backend="rocm"),
        cfg(backend="interpreter"),
        configs.tiles(512, 128, 1, "cuda", group=None, block_k=None, H=16, rules=False)[1],
    ):
        assert not other.get("GEMV", False) and other["BLOCK_T"] >= 16, other
    with configs.override(SPLIT=1):
        assert not cfg().get("GEMV", False)
    # the launcher: the table's pick unless tiles are given, which replace the MMA pick's keys
    for n, rows_ in ((1, False), (4, True), (8, False)):
        x = torch.randn(n, 16, 512).to(BF16)
        w = torch.randn(16, 512, 128).to(BF16)
        a = prepare(x, w)
        cuda = platform_from("cuda", "sm_90")
        picked = launch_mod.plan(a, info=cuda).constexprs
        assert picked["GEMV"] is True and picked["GEMV_ROWS"] is rows_
        assert picked["BLOCK_T"] == (2 if rows_ else 1)
        forced = launch_mod.plan(a, info=cuda, cfg=dict(SPLIT=2))
        assert forced.constexprs["GEMV"] is False and forced.constexprs["BLOCK_T"] == 16


def test_table_split_follows_the_sweep():
    """The GPU tables change the bucket's tiles only where the d1a0cb0 / de9c208 sweeps
    measured it faster: an FP8 output of few items (16 heads, B <= 64): bf16 W_UV split in 4 at
    16 items and 5 stages up to 64, 1-byte W_UV split in 4 up to 64 items; never a bf16 output,
    128 heads, the large bucket, ROCm, the interpreter, or a SPLIT that leaves latent chunks
    over. Nine tokens stand for the smallest batch: 16 heads of up to eight take the GEMV rule
    (the test above)."""

    def cfg(N, H=16, w_bytes=2, group=128, backend="cuda", L=512, block_k=None):
        return configs.tiles(
            L, 128, N, backend, group=group, block_k=block_k, w_bytes=w_bytes, H=H
        )[1]

    def split(*a, **k):
        return cfg(*a, **k)["SPLIT"]

    base = dict(cfg(2, H=128))  # 128 items: the bucket's own tiles
    assert split(9) == split(16) == 4 and cfg(9)["num_stages"] == base["num_stages"]
    assert split(32) == 1 and cfg(32)["num_stages"] == cfg(64)["num_stages"] == 5
    assert split(65) == 1 and cfg(65)["num_stages"] == cfg(65, H=128)["num_stages"] == 3
    fp8w = dict(w_bytes=1, block_k=128)
    assert split(9, **fp8w) == split(32, **fp8w) == split(64, **fp8w) == 4
    assert split(65, **fp8w) == 1  # 80 items
    assert cfg(64, **fp8w)["num_stages"] == cfg(64, H=128, **fp8w)["num_stages"]
    assert split(9, group=None) == 1 and cfg(32, group=None)["num_stages"] == 3  # bf16 out
    assert split(2, H=128) == split(2, H=128, **fp8w) == 1
    assert split(9, backend="interpreter") == 1
    # ROCm keeps the bucket's tiles (its LDS would cut the 5 stages' latent chunks: unmeasured)
    assert split(9, backend="rocm") == 1 and cfg(32, backend="rocm")["num_stages"] == 3
    assert split(128, **fp8w) == 1  # the large bucket's 64-token tiles: not swept
    assert split(9, L=256) == 2  # two 128-row chunks: the largest power of two dividing them
    with configs.override(SPLIT=1, num_stages=3):
        assert split(9) == 1 and cfg(32)["num_stages"] == 3  # a sweep's explicit tiles win
