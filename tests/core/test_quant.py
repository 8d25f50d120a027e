"""Tests of fusemla.quant: FP8 / MXFP4 weight quantization and DeepSeek-V3 checkpoint helpers."""

from __future__ import annotations

import os

import pytest
import torch

from fusemla.errors import FuseMLATypeError, FuseMLAValueError
from fusemla.quant import (
    QuantizedWeight,
    dequantize_block_fp8,
    dequantize_mxfp4,
    e2m1_values,
    prepare_w_uk_t,
    quantize_fp8_weight,
    quantize_mxfp4_weight,
    split_kv_b_proj,
    weight_format,
    weight_parts,
)

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.fixture
def gen() -> torch.Generator:
    seed = int.from_bytes(os.urandom(4), "little")  # fresh data each run, global RNG untouched
    print(f"seed = {seed}")  # shown on failure, to reproduce
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Pack [H, P, L] codes by hand, byte by byte (low nibble = even p)."""
    H, P, L = codes.shape
    out = torch.empty(H, P // 2, L, dtype=torch.uint8)
    for h in range(H):
        for i in range(P // 2):
            for l_ in range(L):
                out[h, i, l_] = int(codes[h, 2 * i, l_]) | (int(codes[h, 2 * i + 1, l_]) << 4)
    return out


def _block_exponents(qw: QuantizedWeight) -> torch.Tensor:
    """e per element [H, P, L] (int) from the scale bytes."""
    return qw.scale.to(torch.int32).repeat_interleave(32, dim=1) - 127


# ----------------------------------------------------------------------------- e2m1 / packing


def test_e2m1_values():
    v = e2m1_values()
    assert v.dtype == torch.float32 and v.shape == (16,)
    assert v.tolist() == GRID + [-x for x in GRID]
    for code in range(16):  # decode from the bit fields: sign, exponent (bias 1), mantissa
        s, e, m = code >> 3, (code >> 1) & 3, code & 1
        mag = (m * 0.5) if e == 0 else (1 + m * 0.5) * 2.0 ** (e - 1)
        assert v[code].item() == (-mag if s else mag)
        assert bool(torch.signbit(v[code])) == bool(s)


def test_dequantize_all_codes_and_nibble_order():
    codes = (torch.arange(64) % 16).to(torch.uint8).view(1, 64, 1)  # every code, both nibbles
    data = _pack(codes)
    assert data[0, 0, 0].item() == 0x10 and data[0, 7, 0].item() == 0xFE
    scale = torch.tensor([127, 129], dtype=torch.uint8).view(1, 2, 1)
    out = dequantize_mxfp4(data, scale)
    lut = e2m1_values()
    expected = lut[codes.long()] * torch.tensor([1.0] * 32 + [4.0] * 32).view(1, 64, 1)
    assert out.dtype == torch.float32 and out.shape == (1, 64, 1)
    assert torch.equal(out, expected)


def test_mxfp4_packing_byte_by_byte(gen):
    H, P, L = 2, 64, 3
    codes = torch.randint(0, 16, (H, P, L), generator=gen, dtype=torch.uint8)
    codes[:, 0, :] = 7  # +6 in every block so the shared exponent is 0 (scale byte 127)
    codes[:, 32, :] = 15  # -6
    w = e2m1_values()[codes.long()]
    qw = quantize_mxfp4_weight(w)
    assert qw.data.dtype == torch.uint8 and qw.data.shape == (H, P // 2, L)
    assert qw.data.is_contiguous() and qw.scale.is_contiguous()
    assert torch.equal(qw.scale, torch.full((H, P // 32, L), 127, dtype=torch.uint8))
    for h in range(H):
        for i in range(P // 2):
            for l_ in range(L):
                byte = int(qw.data[h, i, l_])
                assert byte & 0xF == int(codes[h, 2 * i, l_])
                assert byte >> 4 == int(codes[h, 2 * i + 1, l_])
    assert torch.equal(qw.data, _pack(codes))
    assert torch.equal(qw.dequantize(), w)


def test_mxfp4_rounding_ties_to_even_and_saturation():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    vals = mids + [-m for m in mids] + [7.5, -7.9, 6.5, 0.26, 0.24, 5.01, 4.99, 1.74, 1.76]
    exp = want + [-x for x in want] + [6.0, -6.0, 6.0, 0.5, 0.0, 6.0, 4.0, 1.5, 2.0]
    vals += [0.0] * (32 - len(vals))
    exp += [0.0] * (32 - len(exp))
    for e in (0, -5, 9):  # amax 7.9 -> e = 2 - 2 = 0, then rescaled blocks
        w = torch.tensor(vals).view(1, 32, 1) * 2.0**e
        qw = quantize_mxfp4_weight(w)
        assert qw.scale.item() == 127 + e
        assert qw.dequantize().flatten().tolist() == [x * 2.0**e for x in exp]


# ----------------------------------------------------------------------------- fp8


def _fp8_bound(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half an fp8 ulp at |w|: 2**-4 |w| for normals, 2**-4 * tiny * scale below."""
    tiny = torch.finfo(dtype).tiny
    return torch.maximum(w.abs(), tiny * scale) * 2.0**-4 * (1 + 1e-6)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_fp8_round_trip_per_tensor(gen, dtype, src):
    w = (_randn(gen, 4, 64, 32) * 0.05).to(src)
    qw = quantize_fp8_weight(w, dtype=dtype)
    fmax = 448.0 if dtype == torch.float8_e4m3fn else 240.0
    assert qw.format == "fp8" and qw.granularity == "tensor" and qw.shape == (4, 64, 32)
    assert qw.data.dtype == dtype and qw.scale.shape == (1,) and qw.scale.dtype == torch.float32
    assert qw.scale.item() == pytest.approx(w.float().abs().max().item() / fmax, rel=1e-6)
    assert qw.data.float().abs().max().item() == fmax
    dq = qw.dequantize()
    err = (dq - w.float()).abs()
    assert (err <= _fp8_bound(w.float(), qw.scale, dtype)).all()
    normal = w.float().abs() >= torch.finfo(dtype).tiny * qw.scale
    assert normal.any()
    assert (err[normal] <= 2.0**-4 * w.float().abs()[normal] * (1 + 1e-6)).all()
    assert qw.dequantize(torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_fp8_exact_on_grid(gen, dtype):
    fmax = torch.finfo(dtype).max
    codes = (_randn(gen, 2, 32, 16) * 40).clamp(-fmax, fmax).to(dtype).float()
    codes[0, 0, 0] = -fmax
    w = codes * 2.0**-9
    qw = quantize_fp8_weight(w, dtype=dtype)
    assert qw.scale.item() == 2.0**-9
    assert torch.equal(qw.data.float(), codes)
    assert torch.equal(qw.dequantize(), w)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_fp8_per_head(gen, dtype):
    mult = torch.tensor([0.01, 1.0, 30.0, 0.0, 2.0]).view(5, 1, 1)  # head 3 all zero
    w = _randn(gen, 5, 32, 24) * mult
    qw = quantize_fp8_weight(w, dtype=dtype, per_head=True)
    fmax = torch.finfo(dtype).max
    assert qw.granularity == "head" and qw.scale.shape == (5,)
    assert qw.scale[3].item() == 1.0 and torch.equal(qw.data[3].float(), torch.zeros(32, 24))
    live = [0, 1, 2, 4]
    assert len({qw.scale[h].item() for h in live}) == len(live)
    for h in live:
        assert qw.scale[h].item() == pytest.approx(w[h].abs().max().item() / fmax, rel=1e-6)
        assert qw.data[h].float().abs().max().item() == fmax
    dq = qw.dequantize()
    assert ((dq - w).abs() <= _fp8_bound(w, qw.scale.view(5, 1, 1), dtype)).all()


def test_fp8_layouts(gen):
    """K-major (the default) and contiguous FP8 data hold the same codes; both construct, keep
    their layout through the one weight-parts rule and dequantize the same."""
    w = _randn(gen, 3, 32, 24)
    km = quantize_fp8_weight(w, per_head=True)
    cont = quantize_fp8_weight(w, per_head=True, k_major=False)
    assert km.k_major and not cont.k_major
    assert km.data.transpose(1, 2).is_contiguous() and not km.data.is_contiguous()
    assert cont.data.is_contiguous() and km.shape == cont.shape == (3, 32, 24)
    assert torch.equal(km.data.view(torch.uint8), cont.data.view(torch.uint8))
    assert torch.equal(km.scale, cont.scale)
    assert torch.equal(km.dequantize(), cont.dequantize())
    assert weight_parts(km)[0] is km.data and weight_parts(km)[2] == "fp8"
    assert QuantizedWeight(km.data, km.scale, "fp8").k_major
    assert not quantize_mxfp4_weight(w).k_major


def test_fp8_all_zero_tensor():
    qw = quantize_fp8_weight(torch.zeros(2, 4, 8))
    assert qw.scale.tolist() == [1.0]
    assert torch.equal(qw.dequantize(), torch.zeros(2, 4, 8))


# ----------------------------------------------------------------------------- mxfp4


def test_mxfp4_round_trip_gaussian(gen):
    H, P, L = 4, 128, 48
    w = _randn(gen, H, P, L) * 0.02
    qw = quantize_mxfp4_weight(w)
    assert qw.format == "mxfp4" and qw.granularity == "block32" and qw.shape == (H, P, L)
    assert qw.scale.shape == (H, P // 32, L) and qw.scale.dtype == torch.uint8
    e = _block_exponents(qw)
    pe = torch.pow(2.0, e.double())
    # the shared exponent puts each block's amax in [4, 8) * 2**e
    amax = w.view(H, P // 32, 32, L).abs().amax(dim=2).double()
    ratio = amax / torch.pow(2.0, qw.scale.double() - 127)
    assert ((ratio >= 4) & (ratio < 8)).all()
    dq = qw.dequantize().double()
    a = w.double().abs() / pe  # |scaled|
    # half the grid step at that magnitude: 0.25 below 2, 0.5 in [2, 4), 1 in [4, 6];
    # above 6 the value saturates to 6, an error of a - 6 (< 2)
    half_step = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, torch.where(a <= 6, 1.0, a - 6)))
    assert ((dq - w.double()).abs() <= half_step * pe).all()
    assert (dq.abs() <= 6 * pe).all()
    rel = ((dq - w.double()).norm() / w.double().norm()).item()
    assert 0.02 < rel < 0.2


def test_mxfp4_exact_block_and_zero_block(gen):
    H, P, L = 2, 96, 8
    w = _randn(gen, H, P, L)
    codes = torch.randint(0, 16, (L, 32), generator=gen)
    codes[:, 5] = 15  # -6 sets the exponent
    exact = (e2m1_values()[codes] * 2.0**-3).T  # [32, L]
    w[1, 32:64, :] = exact
    w[0, 64:96, :] = 0.0
    qw = quantize_mxfp4_weight(w)
    dq = qw.dequantize()
    assert torch.equal(dq[1, 32:64], exact)
    assert torch.equal(qw.scale[1, 1], torch.full((L,), 127 - 3, dtype=torch.uint8))
    assert torch.equal(qw.scale[0, 2], torch.zeros(L, dtype=torch.uint8))  # e = -127
    assert torch.equal(dq[0, 64:96], torch.zeros(32, L))


def test_mxfp4_saturation_and_extremes(gen):
    w = _randn(gen, 1, 128, 4)
    w[0, 0:32, 0] = torch.linspace(-7.99, 7.99, 32)  # amax in [4, 8) -> e = 0: saturates
    w[0, 32:64, 1] *= 3e37  # near fp32 max
    w[0, 64:96, 2] *= 1e-38  # normal / subnormal magnitudes
    w[0, 96:128, 3] = 1e-45  # the smallest subnormal: e clamped to -127
    qw = quantize_mxfp4_weight(w)
    dq = qw.dequantize()
    assert torch.isfinite(dq).all() and (qw.scale != 255).all()
    assert qw.scale[0, 0, 0].item() == 127
    assert dq[0, 0:32, 0].abs().max().item() == 6.0
    assert (dq.abs() <= 6 * torch.pow(2.0, _block_exponents(qw).double())).all()
    assert qw.scale[0, 3, 3].item() == 0 and dq[0, 96:128, 3].abs().max().item() == 0.0
    big = w[0, 32:64, 1].double()  # fp32 norms would overflow
    assert ((dq[0, 32:64, 1].double() - big).norm() / big.norm()).item() < 0.2


def test_mxfp4_bf16_input_matches_fp32(gen):
    w = _randn(gen, 2, 64, 16).to(torch.bfloat16)
    a, b = quantize_mxfp4_weight(w), quantize_mxfp4_weight(w.float())
    assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)


# ----------------------------------------------------------------------------- checkpoints


def test_split_kv_b_proj(gen):
    H, P, V, L = 3, 16, 12, 40
    W = _randn(gen, H * (P + V), L).to(torch.bfloat16)
    uk, uv = split_kv_b_proj(W, H, P, V)
    assert uk.shape == (H, P, L) and uv.shape == (H, L, V)
    assert uk.dtype == uv.dtype == torch.bfloat16 and uk.is_contiguous() and uv.is_contiguous()
    for h in range(H):
        rows = W[h * (P + V) : (h + 1) * (P + V)]
        assert torch.equal(uk[h], rows[:P])
        assert torch.equal(uv[h], rows[P:].T)
    assert torch.equal(uk, W.T.reshape(L, H, P + V)[..., :P].permute(1, 2, 0))
    assert torch.equal(uv, W.T.reshape(L, H, P + V)[..., P:].permute(1, 0, 2))


def _block_quantize(w: torch.Tensor, bn: int = 128, bk: int = 128):
    """What a DeepSeek-V3 FP8 checkpoint holds: e4m3fn weight and per-block amax / 448."""
    N, K = w.shape
    s = torch.empty(-(-N // bn), -(-K // bk))
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            s[i, j] = blk.abs().max() / 448.0
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (blk / s[i, j]).to(
                torch.float8_e4m3fn
            )
    return q, s


def test_dequantize_block_fp8(gen):
    N, K = 300, 200
    w = _randn(gen, N, K) * torch.rand(N, 1, generator=gen) * 0.1
    q, s = _block_quantize(w)
    assert s.shape == (3, 2)
    dq = dequantize_block_fp8(q, s)
    assert dq.dtype == torch.float32 and dq.shape == (N, K)
    full = s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    assert ((dq - w).abs() <= _fp8_bound(w, full, torch.float8_e4m3fn)).all()
    # block mapping: ones times distinct per-block scales
    s2 = torch.arange(1, 7, dtype=torch.float32).view(3, 2)
    ones = torch.ones(N, K).to(torch.float8_e4m3fn)
    out = dequantize_block_fp8(ones, s2)
    for n in (0, 127, 128, 255, 256, 299):
        for k in (0, 127, 128, 199):
            assert out[n, k].item() == s2[n // 128, k // 128].item()
    out = dequantize_block_fp8(
        ones, torch.arange(10 * 7, dtype=torch.float32).view(10, 7), block_size=(32, 32)
    )
    assert out[299, 199].item() == 9 * 7 + 6 and out[31, 32].item() == 1


def test_prepare_w_uk_t_formats(gen):
    H, P, V, L = 2, 32, 16, 64
    W = _randn(gen, H * (P + V), L) * 0.05
    uk32, uv32 = split_kv_b_proj(W, H, P, V)
    dims = {"num_heads": H, "qk_nope_head_dim": P, "v_head_dim": V}

    uk, uv = prepare_w_uk_t(W.to(torch.bfloat16), **dims)
    assert uk.dtype == uv.dtype == torch.bfloat16
    assert torch.equal(uk, uk32.to(torch.bfloat16)) and torch.equal(uv, uv32.to(torch.bfloat16))

    uk, uv = prepare_w_uk_t(
        W, format="fp8", per_head=True, fp8_dtype=torch.float8_e4m3fnuz, dtype=torch.float16, **dims
    )
    ref = quantize_fp8_weight(uk32, dtype=torch.float8_e4m3fnuz, per_head=True)
    assert isinstance(uk, QuantizedWeight) and uk.granularity == "head"
    assert torch.equal(uk.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(uk.scale, ref.scale) and torch.equal(uv, uv32.half())

    uk, _ = prepare_w_uk_t(W, format="mxfp4", **dims)
    ref = quantize_mxfp4_weight(uk32)  # from fp32, not from a bf16 rounding
    assert torch.equal(uk.data, ref.data) and torch.equal(uk.scale, ref.scale)


def test_prepare_w_uk_t_fp8_checkpoint(gen):
    H, P, V, L = 4, 64, 32, 160  # N = 384, K = 160: a partial block along K
    W = _randn(gen, H * (P + V), L) * 0.05
    q, s = _block_quantize(W)
    real = dequantize_block_fp8(q, s)
    uk32, uv32 = split_kv_b_proj(real, H, P, V)
    dims = {"num_heads": H, "qk_nope_head_dim": P, "v_head_dim": V, "weight_scale_inv": s}
    uk, uv = prepare_w_uk_t(q, dtype=torch.float32, **dims)
    assert torch.equal(uk, uk32) and torch.equal(uv, uv32)
    qw, _ = prepare_w_uk_t(q, format="mxfp4", **dims)
    ref = quantize_mxfp4_weight(uk32)
    assert torch.equal(qw.data, ref.data) and torch.equal(qw.scale, ref.scale)
    qw, _ = prepare_w_uk_t(q, format="fp8", **dims)
    assert ((qw.dequantize() - uk32).abs() <= _fp8_bound(uk32, qw.scale, torch.float8_e4m3fn)).all()


# ----------------------------------------------------------------------------- bad inputs


def _u8(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.uint8)


def _f8(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape).to(torch.float8_e4m3fn)


BAD = [
    (lambda: QuantizedWeight(_u8(1, 16, 4), _u8(1, 1, 4), "int4"), FuseMLAValueError, "format"),
    (lambda: QuantizedWeight(_u8(1, 16, 4), _u8(1, 1, 4), 4), FuseMLATypeError, "format"),
    (lambda: QuantizedWeight(_u8(1, 8, 4), _u8(1, 1, 4), "mxfp4"), FuseMLAValueError, "data"),
    (lambda: QuantizedWeight(_u8(1, 16, 4), _u8(1, 2, 4), "mxfp4"), FuseMLAValueError, "scale"),
    (
        lambda: QuantizedWeight(_u8(1, 16, 4), torch.zeros(1, 1, 4), "mxfp4"),
        FuseMLATypeError,
        "scale",
    ),
    (lambda: QuantizedWeight(_f8(2, 16, 4), torch.ones(1), "mxfp4"), FuseMLATypeError, "data"),
    (lambda: QuantizedWeight(_u8(2, 16, 4), torch.ones(1), "fp8"), FuseMLATypeError, "data"),
    (lambda: QuantizedWeight(_f8(2, 16, 4), torch.ones(3), "fp8"), FuseMLAValueError, "scale"),
    (
        lambda: QuantizedWeight(_f8(2, 16, 4), torch.ones(2).half(), "fp8"),
        FuseMLATypeError,
        "scale",
    ),
    (
        lambda: QuantizedWeight(_f8(4, 2, 16).transpose(0, 1), torch.ones(1), "fp8"),
        FuseMLAValueError,
        "contiguous tensor or a K-major",
    ),
    (
        lambda: QuantizedWeight(_u8(1, 4, 16).transpose(1, 2), _u8(1, 1, 4), "mxfp4"),
        FuseMLAValueError,
        "data: expected a contiguous tensor, got",
    ),
    (lambda: quantize_fp8_weight(torch.ones(1, 4, 4), k_major=1), FuseMLATypeError, "k_major"),
    (lambda: QuantizedWeight("x", torch.ones(1), "fp8"), FuseMLATypeError, "data"),
    (lambda: quantize_fp8_weight(torch.ones(4, 4)), FuseMLAValueError, "w_uk_t"),
    (
        lambda: quantize_fp8_weight(torch.ones(1, 4, 4, dtype=torch.int32)),
        FuseMLATypeError,
        "w_uk_t",
    ),
    (
        lambda: quantize_fp8_weight(torch.ones(1, 4, 4), dtype=torch.bfloat16),
        FuseMLATypeError,
        "dtype",
    ),
    (lambda: quantize_fp8_weight(torch.ones(1, 4, 4), per_head=1), FuseMLATypeError, "per_head"),
    (
        lambda: quantize_fp8_weight(torch.tensor([[[1.0, float("inf")]]])),
        FuseMLAValueError,
        "w_uk_t",
    ),
    (lambda: quantize_mxfp4_weight(torch.ones(1, 48, 4)), FuseMLAValueError, "w_uk_t"),
    (
        lambda: quantize_mxfp4_weight(torch.full((1, 32, 1), float("nan"))),
        FuseMLAValueError,
        "finite",
    ),
    (lambda: split_kv_b_proj(torch.ones(10, 8), 2, 3, 3), FuseMLAValueError, "kv_b_proj_weight"),
    (lambda: split_kv_b_proj(_f8(12, 8), 2, 3, 3), FuseMLATypeError, "dequantize_block_fp8"),
    (lambda: split_kv_b_proj(torch.ones(12, 8), 2, 0, 6), FuseMLAValueError, "qk_nope_head_dim"),
    (lambda: split_kv_b_proj(torch.ones(12, 8), 2.0, 3, 3), FuseMLATypeError, "num_heads"),
    (
        lambda: dequantize_block_fp8(torch.ones(300, 200), torch.ones(3, 2)),
        FuseMLATypeError,
        "weight",
    ),
    (
        lambda: dequantize_block_fp8(_f8(300, 200), torch.ones(2, 2)),
        FuseMLAValueError,
        "weight_scale_inv",
    ),
    (
        lambda: dequantize_block_fp8(_f8(300, 200), torch.ones(3, 2), block_size=(128,)),
        FuseMLAValueError,
        "block_size",
    ),
    (
        lambda: prepare_w_uk_t(_f8(12, 8), num_heads=2, qk_nope_head_dim=3, v_head_dim=3),
        FuseMLAValueError,
        "weight_scale_inv",
    ),
    (
        lambda: prepare_w_uk_t(
            torch.ones(12, 8),
            num_heads=2,
            qk_nope_head_dim=3,
            v_head_dim=3,
            weight_scale_inv=torch.ones(1, 1),
        ),
        FuseMLAValueError,
        "weight_scale_inv",
    ),
    (
        lambda: prepare_w_uk_t(
            torch.ones(12, 8), num_heads=2, qk_nope_head_dim=3, v_head_dim=3, format="int8"
        ),
        FuseMLAValueError,
        "format",
    ),
    (
        lambda: prepare_w_uk_t(
            torch.ones(12, 8), num_heads=2, qk_nope_head_dim=3, v_head_dim=3, format="mxfp4"
        ),
        FuseMLAValueError,
        "w_uk_t",
    ),
    (
        lambda: prepare_w_uk_t(
            torch.ones(12, 8), num_heads=2, qk_nope_head_dim=3, v_head_dim=3, dtype=torch.int8
        ),
        FuseMLATypeError,
        "dtype",
    ),
]


@pytest.mark.parametrize("call,exc,name", BAD)
def test_bad_inputs(call, exc, name):
    with pytest.raises(exc, match=name):
        call()


def test_dequantize_bad_dtype():
    qw = quantize_fp8_weight(torch.ones(1, 4, 4))
    with pytest.raises(FuseMLATypeError, match="dtype"):
        qw.dequantize(torch.int32)


# --------------------------------------------------------------------------------------------
# the one weight type: format rule, parts, 128x128 block scales (W_UK_T and W_UV orientations)
# --------------------------------------------------------------------------------------------


def test_weight_format_is_the_one_rule(gen):
    w = _randn(gen, 2, 32, 16).to(torch.bfloat16)
    fp8, mx = quantize_fp8_weight(w), quantize_mxfp4_weight(w)
    assert [weight_format(x) for x in (w, fp8, mx)] == ["plain", "fp8", "mxfp4"]
    assert weight_parts(w) == (w, None, "plain")
    data, scale, fmt = weight_parts(fp8)
    assert data is fp8.data and scale is fp8.scale and fmt == "fp8"
    for bad in (None, 3, w.float().numpy()):
        with pytest.raises(FuseMLATypeError, match="^weight: expected a torch.Tensor or"):
            weight_format(bad)


@pytest.mark.parametrize("H, K, N", [(2, 256, 384), (3, 200, 130), (1, 128, 128)])
def test_block_scales_as_the_checkpoint_stores_them(gen, H, K, N):
    """A per-head block-FP8 weight [H, K, N] with scales [H, ceil(K/128), ceil(N/128)]
    dequantizes exactly as the checkpoint's [H*K, N] tensor with its [ceil(H*K/128),
    ceil(N/128)] weight_scale_inv does (where K is a multiple of 128 the per-head blocks are
    the checkpoint's own rows); edge blocks are partial; the transposed orientation (W_UV
    [H, L, V] from W_UV^T) takes the transposed scales."""
    codes = (_randn(gen, H, K, N) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    sk, sn = -(-K // 128), -(-N // 128)
    scale = torch.rand(H, sk, sn, generator=gen) + 0.01
    qw = QuantizedWeight(codes, scale, "fp8", block=(128, 128))
    assert qw.granularity == "block" and qw.shape == (H, K, N) and (qw.K, qw.N) == (qw.P, qw.L)
    rows = torch.arange(K) // 128
    cols = torch.arange(N) // 128
    expect = codes.float() * scale[:, rows][:, :, cols]
    assert torch.equal(qw.dequantize(), expect)
    if K % 128 == 0:  # the checkpoint's own layout: heads stacked along the rows
        ckpt = dequantize_block_fp8(codes.reshape(H * K, N), scale.reshape(H * sk, sn))
        assert torch.equal(qw.dequantize().reshape(H * K, N), ckpt)
    t = QuantizedWeight(codes.transpose(1, 2), scale.transpose(1, 2).contiguous(), "fp8",
                        block=(128, 128))  # fmt: skip
    assert t.k_major and t.shape == (H, N, K)
    assert torch.equal(t.dequantize(), expect.transpose(1, 2))


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda c, s: QuantizedWeight(c, s[:, :1], "fp8", block=(128, 128)), FuseMLAValueError,
         r"scale: expected shape \[H, ceil\(K / 128\), ceil\(N / 128\)\] = \[2, 2, 3\]"),
        (lambda c, s: QuantizedWeight(c, s, "fp8", block=(128, 0)), FuseMLAValueError,
         "block: expected a pair of positive ints"),
        (lambda c, s: QuantizedWeight(c, s, "fp8", block=[128, 128]), FuseMLAValueError,
         "block: expected a pair"),
        (lambda c, s: QuantizedWeight(c, s, "fp8"), FuseMLAValueError,
         r"scale: expected shape \[1\] \(per tensor\) or \[H=2\]"),
        (lambda c, s: QuantizedWeight(torch.zeros(2, 128, 128, dtype=torch.uint8),
                                      torch.zeros(2, 4, 128, dtype=torch.uint8), "mxfp4",
                                      block=(128, 128)), FuseMLAValueError,
         "block: block scales are FP8 weights'"),
    ],
)  # fmt: skip
def test_block_scales_rejected(make, exc, match):
    codes = torch.zeros(2, 256, 384, dtype=torch.float8_e4m3fn)
    scale = torch.ones(2, 2, 3)
    with pytest.raises(exc, match=match):
        make(codes, scale)
