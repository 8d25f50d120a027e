"""The epilogue's FP8 output against vLLM's own input quantization of o_proj, on the same product.

Without fusemla, vLLM's decode writes ``attn_out @ W_UV`` in bf16 (its bmm) and o_proj's
block-FP8 linear quantizes that with ``QuantFP8`` (dynamic, one fp32 scale per token and group of
128): ``per_token_group_quant_fp8``. The epilogue quantizes the fp32 product inside the kernel
instead. Here vLLM quantizes the product of the same operands (float64, rounded to fp32 as an
accumulator would hold it, then to bf16 as vLLM's bmm writes it), and fusemla's codes and scales
must agree with vLLM's:

- scales within the bf16 rounding of the group's absmax (relative 2^-8) and one fp32 ulp (a
  division against a multiply by the reciprocal); with UE8M0 scales equal, except in groups
  whose absmax sits within that rounding of a power of two (a factor of 2 there);
- codes at most one FP8 step from vLLM's in every other group;
- products that are exact in bf16 (one +-2**k weight per column): fusemla's scales are
  ``absmax * fl(1/448)`` bit for bit (the rule as vLLM's Triton kernel computes it), vLLM's
  either that or ``absmax / 448`` (its CUDA kernel and its CPU path divide); codes byte for
  byte equal in every group whose scales are bit-equal (a quarter of the groups at least).

``--device=cpu`` (CI's vLLM venv): vLLM's ``QuantFP8.forward_native`` (vLLM's CPU build has no
Triton, so its fused kernels do not run there), fusemla's kernel in Triton's interpreter, small
dims. ``--device=cuda`` (the H200 through the offline bundle: ``tests/vllm/h200.sh vtests
tests/vllm/test_epilogue_vllm_quant.py``): vLLM's CUDA kernel
(``torch.ops._C.per_token_group_fp8_quant``, through ``QuantFP8.forward_cuda`` and through
``per_token_group_quant_fp8`` with its row-major, column-major and TMA-aligned scales), DeepSeek-V3's
dims at 16 and 128 heads. Planted bugs (another head's product, a scale 2^-7 off) must fail the
check.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import fusemla  # noqa: E402
from fusemla.testing import (  # noqa: E402
    block_fp8_w_uv,
    exact_w_uv,
    fp8_ordinal,
    poisoned,
    pow2_ceil64,
    stable_seed,
    vllm_w_uv,
    w_uv_f64,
)

_MISSING = harness.vllm_missing()
if _MISSING is not None and os.environ.get("FUSEMLA_REQUIRE_VLLM") == "1":
    raise RuntimeError(f"FUSEMLA_REQUIRE_VLLM=1 but {_MISSING}")
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
FMAX = 448.0
#: scales: the bf16 rounding of the absmax (2^-8 relative) and one fp32 ulp either way
SCALE_TOL = 2.0**-8 + 2.0**-22


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(stable_seed("epilogue-vllm-quant", *parts))


def _dims(device: str, heads: int) -> dict:
    if device == "cuda":
        return dict(H=heads, L=512, V=128, P=128, block=(128, 128), groups=(128,))
    return dict(H=2, L=64, V=64, P=32, block=(32, 32), groups=(32, 64))


def _w_uv(kind: str, d: dict, g, device: str):
    """bf16 W_UV as vLLM holds it (a transposed view of ``[L, H, V]``), or W_UV split out of a
    random block-FP8 ``kv_b_proj`` as a DeepSeek-V3 checkpoint stores it."""
    H, L, V = d["H"], d["L"], d["V"]
    if kind == "bf16":
        return vllm_w_uv(H, L, V, g, BF16, device)
    return block_fp8_w_uv(H, d["P"], L, V, d["block"], g, device)


def _product64(x: torch.Tensor, w) -> torch.Tensor:
    """``[N, H*V]`` float64: the product of the operands the kernel reads."""
    y = torch.einsum("nhl,hlv->nhv", x.double(), w_uv_f64(w))
    return y.reshape(x.shape[0], -1)


class _Vllm:
    """vLLM's quantization of o_proj's input: ``QuantFP8`` as the block-FP8 linear builds it
    (``forward_cuda`` on a GPU: vLLM's CUDA kernel; ``forward_native`` on the CPU)."""

    def __init__(self, device: str):
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.quantization import input_quant_fp8

        self.device = device
        # GroupShape as QuantFP8's own module names it (wherever a vLLM version defines it)
        self._cls, self._shape = input_quant_fp8.QuantFP8, input_quant_fp8.GroupShape
        self._config, self._within = VllmConfig(), set_current_vllm_config
        if device == "cuda":
            from vllm.model_executor.layers.quantization.utils import fp8_utils

            assert hasattr(torch.ops._C, "per_token_group_fp8_quant"), "vLLM's CUDA kernel"
            self.fn = fp8_utils.per_token_group_quant_fp8

    def quant(self, y: torch.Tensor, group: int, *, ue8m0: bool, col_major: bool):
        with self._within(self._config):
            q = self._cls(
                static=False,
                group_shape=self._shape(1, group),
                column_major_scales=col_major,
                use_ue8m0=ue8m0,
            )
            if self.device == "cpu":
                return q.forward_native(y)
            # o_proj's CUTLASS path on Hopper, not DeepGEMM's packed UE8M0 scales (Blackwell)
            q.use_deep_gemm_supported = False
            return q.forward_cuda(y)


@pytest.fixture(scope="module")
def vllm_quant(device):
    return _Vllm(device)


def _fused(x, w, group, *, ue8m0, scale_like: torch.Tensor):
    """fusemla's epilogue into a poisoned output and a poisoned scale buffer laid out as vLLM's
    (its strides, and whatever padding they leave)."""
    N = x.shape[0]
    C = x.shape[1] * w.shape[2]
    out = poisoned((N, C), FP8, x.device)
    store = poisoned((scale_like.untyped_storage().nbytes() // 4,), torch.float32, x.device)
    s_out = store.as_strided(scale_like.shape, scale_like.stride(), 0)
    c, s = fusemla.mla_epilogue(
        x, w, out=out, out_dtype=FP8, group_size=group, scale_ue8m0=ue8m0, scale_out=s_out
    )
    assert c.data_ptr() == out.data_ptr() and s.data_ptr() == s_out.data_ptr()
    used = torch.zeros(store.numel(), dtype=torch.bool, device=x.device)
    used.as_strided(s_out.shape, s_out.stride(), 0).fill_(True)
    assert bool(store[~used].isnan().all()), "a byte outside the scales' elements was written"
    return c, s


def check_agrees(c, s, vc, vs, y64: torch.Tensor, group: int, *, ue8m0: bool) -> dict:
    """fusemla's ``(codes, scales)`` against vLLM's on the same product ``y64``: the rules in
    the module docstring. Returns counts (groups, boundary groups, codes one step off)."""
    N, C = c.shape
    G = C // group
    assert vc.shape == c.shape and vs.shape == s.shape == (N, G)
    assert c.dtype == vc.dtype == FP8 and s.dtype == vs.dtype == torch.float32
    s64, vs64 = s.double().cpu(), vs.double().cpu()
    assert bool(torch.isfinite(s64).all() and (s64 > 0).all()), "a scale is not a positive number"
    absmax = y64.reshape(N, G, group).abs().amax(dim=2).cpu()
    if ue8m0:
        diff = s64 != vs64
        ratio = s64[diff] / vs64[diff]
        assert bool(((ratio == 2) | (ratio == 0.5)).all()), f"UE8M0 scales apart: {ratio[:4]}"
        lo = torch.minimum(s64[diff], vs64[diff])
        near = (absmax[diff] / FMAX / lo - 1).abs() <= SCALE_TOL
        assert bool(near.all()), "UE8M0 scales differ where the absmax is not at a power of two"
        boundary = diff
    else:
        rel = (s64 / vs64 - 1).abs()
        assert float(rel.max()) <= SCALE_TOL, f"scales {float(rel.max()):.3g} apart (relative)"
        boundary = torch.zeros(N, G, dtype=torch.bool)
    steps = (fp8_ordinal(c.cpu()) - fp8_ordinal(vc.cpu())).abs().reshape(N, G, group)
    far = steps[~boundary] > 1
    assert not bool(far.any()), f"{int(far.sum())} codes more than one FP8 step from vLLM's"
    return dict(
        groups=N * G,
        boundary=int(boundary.sum()),
        off=int((steps[~boundary] == 1).sum()),
        codes=int((~boundary).sum()) * group,
        equal_scales=int((s64 == vs64).sum()),
    )


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32", "ue8m0"])
@pytest.mark.parametrize("kind", ["bf16", "fp8_block"])
def test_random_products_within_one_step_of_vllm(device, vllm_quant, kind, ue8m0):
    """Random operands, bf16 and block-FP8 W_UV (16 and 128 heads on a GPU): fusemla's FP8
    output against vLLM's quantization of the bf16-rounded product, scales column-major as
    o_proj's CUTLASS GEMM reads them, and row-major."""
    seen = []
    for heads, group, N in itertools.product(
        (16, 128) if device == "cuda" else (2,),
        _dims(device, 0)["groups"],
        (1, 8, 32, 64, 200) if device == "cuda" else (1, 7, 33),
    ):
        d = _dims(device, heads)
        g = _gen("random", kind, heads, ue8m0, group, N)
        x = torch.randn(N, d["H"], d["L"], generator=g).to(device, BF16)
        w = _w_uv(kind, d, g, device)
        y64 = _product64(x, w)
        y_vllm = y64.float().to(BF16)  # fp32 accumulator, then the bmm's bf16 output
        for col_major in (True, False):
            vc, vs = vllm_quant.quant(y_vllm, group, ue8m0=ue8m0, col_major=col_major)
            c, s = _fused(x, w, group, ue8m0=ue8m0, scale_like=vs)
            seen.append(check_agrees(c, s, vc, vs, y64, group, ue8m0=ue8m0))
    codes = sum(r["codes"] for r in seen)
    off = sum(r["off"] for r in seen)
    groups = sum(r["groups"] for r in seen)
    boundary = sum(r["boundary"] for r in seen)
    # the bf16 rounding moves a code across a rounding boundary now and then, never often
    assert off <= 0.1 * codes, f"{off} of {codes} codes one step off"
    assert boundary <= max(2, 0.02 * groups), f"{boundary} of {groups} groups at a power of two"


def _scale_rules(y: torch.Tensor, group: int, ue8m0: bool) -> tuple[torch.Tensor, ...]:
    """The fp32 scales of ``y``'s groups: fusemla's ``absmax * fl(1 / 448)`` (the issue's rule,
    as vLLM's Triton kernel computes it), and vLLM's two: that product or ``absmax / 448``
    (its CUDA kernel and CPU path divide). For UE8M0 each is rounded up to a power of two,
    vLLM's after flooring the scale itself at 1e-10 (all its kernels do, by their source: a
    group whose absmax is below 448e-10, a token of zeros, gets 2^-33 there, 2^-42 here).
    Returns ``(fusemla's, vLLM's product rule, vLLM's quotient rule)``."""
    N, C = y.shape
    a = y.float().cpu().reshape(N, C // group, group).abs().amax(dim=2)
    a = torch.maximum(a, torch.tensor(1e-10, dtype=torch.float32))
    mul, div = a * torch.tensor(1 / FMAX, dtype=torch.float32), a / FMAX
    if not ue8m0:
        return mul, mul, div
    ours = pow2_ceil64(mul).float()
    mul, div = (pow2_ceil64(t.clamp_min(1e-10)).float() for t in (mul, div))
    return ours, mul, div


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32", "ue8m0"])
def test_exact_products_equal_vllm_byte_for_byte(device, vllm_quant, ue8m0):
    """Products exact in bf16: the same numbers on both sides. fusemla's scales follow the
    multiply-by-reciprocal rule bit for bit; vLLM's equal them or, where they differ, are the
    quotient ``absmax / 448`` (one fp32 ulp away); every group whose scales are bit-equal
    (a quarter of the groups at least) has byte-equal codes. A token of zeros takes the eps
    scale and zero codes on both sides (on the GPU; vLLM's CPU path clamps the scale at
    1 / (448 * 512) instead): the eps rule's ``1e-10 / 448``, or with UE8M0 fusemla's
    ``2^-42`` (the issue's rule) against vLLM's ``2^-33`` (:func:`_scale_rules`)."""
    heads = 16 if device == "cuda" else 2
    d = _dims(device, heads)
    group = d["groups"][-1]
    g = _gen("exact", ue8m0)
    N = 40
    x = torch.randn(N, d["H"], d["L"], generator=g).to(device, BF16)
    x[5] = 0.0
    w = exact_w_uv(d["H"], d["L"], d["V"], g, BF16, device)
    y64 = _product64(x, w)
    y = y64.float().to(BF16)
    assert torch.equal(y.double(), y64.to(y.device)), "products not exact in bf16"
    vc, vs = vllm_quant.quant(y, group, ue8m0=ue8m0, col_major=True)
    c, s = _fused(x, w, group, ue8m0=ue8m0, scale_like=vs)
    ours, mul, div = _scale_rules(y, group, ue8m0)
    assert torch.equal(s.cpu(), ours), "fusemla's scales are not absmax * fl(1/448)"
    # the token of zeros: zero codes on both sides on the GPU, its scales by the rules (on the
    # CPU vLLM clamps them otherwise); no code comparison where the scales differ (UE8M0)
    keep = torch.ones(N, dtype=torch.bool)
    if device == "cpu" or ue8m0:
        keep[5] = False
    rules_hold = torch.ones(N, dtype=torch.bool) if device == "cuda" else keep
    if device == "cuda":
        assert not bool(c[5].float().any()) and not bool(vc[5].float().any())
    vs_ = vs.cpu()
    follows = (vs_ == mul) | (vs_ == div)
    assert bool(follows[rules_hold].all()), "vLLM's scales follow neither rule"
    k = keep.to(y64.device)
    r = check_agrees(c[k], s[k], vc[k], vs[k], y64[k], group, ue8m0=ue8m0)
    same = (s.cpu() == vs_)[keep].repeat_interleave(group, dim=1)
    cb, vb = c.cpu()[keep].view(torch.uint8), vc.cpu()[keep].view(torch.uint8)
    assert torch.equal(cb[same], vb[same]), "codes differ where the scales are bit-equal"
    assert r["equal_scales"] >= 0.25 * r["groups"], r


def test_planted_bugs_fail_the_check(device, vllm_quant):
    """The check itself: another head's product in one head's columns, and a scale 2^-7 off,
    must both fail it."""
    d = _dims(device, 16 if device == "cuda" else 2)
    group = d["groups"][-1]
    g = _gen("planted")
    x = torch.randn(9, d["H"], d["L"], generator=g).to(device, BF16)
    w = _w_uv("bf16", d, g, device)
    y64 = _product64(x, w)
    vc, vs = vllm_quant.quant(y64.float().to(BF16), group, ue8m0=False, col_major=True)
    c, s = _fused(x, w, group, ue8m0=False, scale_like=vs)
    check_agrees(c, s, vc, vs, y64, group, ue8m0=False)  # the unbugged pair passes
    V = d["V"]
    swapped = y64.clone()
    swapped[:, :V], swapped[:, V : 2 * V] = y64[:, V : 2 * V], y64[:, :V]
    bc, bs = vllm_quant.quant(swapped.float().to(BF16), group, ue8m0=False, col_major=True)
    with pytest.raises(AssertionError):
        check_agrees(c, s, bc, bs, y64, group, ue8m0=False)
    with pytest.raises(AssertionError, match="scales"):
        check_agrees(c, s * (1 + 2.0**-7), vc, vs, y64, group, ue8m0=False)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["row", "col", "tma"])
def test_vllm_function_and_its_scale_layouts(device, vllm_quant, layout):
    """``per_token_group_quant_fp8`` called directly (vLLM's CUDA kernel), its three scale
    layouts given to the epilogue as ``scale_out`` (TMA-aligned: padding rows left alone)."""
    d = _dims(device, 128)
    group = 128
    g = _gen("layouts", layout)
    for N in (1, 5, 64):
        x = torch.randn(N, d["H"], d["L"], generator=g).to(device, BF16)
        w = _w_uv("fp8_block", d, g, device)
        y64 = _product64(x, w)
        vc, vs = vllm_quant.fn(
            y64.float().to(BF16),
            group,
            dtype=FP8,
            column_major_scales=layout != "row",
            tma_aligned_scales=layout == "tma",
            use_ue8m0=False,
        )
        c, s = _fused(x, w, group, ue8m0=False, scale_like=vs)
        assert s.stride() == vs.stride()
        check_agrees(c, s, vc, vs, y64, group, ue8m0=False)
