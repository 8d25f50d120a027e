"""Tests of fusemla.quant.split_kv_b_proj_fp8: a block-FP8 DeepSeek-V3 ``kv_b_proj`` split into
``(W_UK_T, W_UV)`` QuantizedWeights as stored (byte-identical codes, the checkpoint's scales)."""

from __future__ import annotations

import pytest
import torch

from fusemla.errors import FuseMLATypeError, FuseMLAValueError
from fusemla.quant import (
    QuantizedWeight,
    dequantize_block_fp8,
    split_kv_b_proj,
    split_kv_b_proj_fp8,
)

E4M3FN, E4M3FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _codes(g: torch.Generator, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Random finite FP8 codes, mostly non-zero (normal values over the whole e4m3 range)."""
    fmax = torch.finfo(dtype).max
    x = (torch.randn(rows, cols, generator=g) * 64).clamp(-fmax, fmax).to(dtype)
    assert (x.float() != 0).float().mean().item() > 0.9 and torch.isfinite(x.float()).all()
    return x


def _scales(g: torch.Generator, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Random positive, pairwise distinct scales (so a wrong index cannot pass by chance)."""
    n = rows * cols
    if dtype == torch.float32:
        s = torch.rand(n, generator=g) * 0.01 + 1e-4
    else:  # distinct values exact in bf16 / fp16: a random permutation of k / 64
        s = (torch.randperm(n, generator=g) + 1).float() / 64
    s = s.view(rows, cols).to(dtype)
    assert torch.unique(s.float()).numel() == n and (s.float() > 0).all()
    return s


def _checkpoint(seed, H, P, V, L, dtype=E4M3FN, scale_dtype=torch.float32, block=(128, 128)):
    g = _gen(seed)
    bn, bk = block
    R = H * (P + V)
    return _codes(g, R, L, dtype), _scales(g, -(-R // bn), -(-L // bk), scale_dtype)


def _split(w, s, H, P, V, block=(128, 128)):
    return split_kv_b_proj_fp8(
        w, s, num_heads=H, qk_nope_head_dim=P, v_head_dim=V, block_size=block
    )


# (seed, H, P, V, L, weight dtype, scale dtype, block_size = (bn, bk))
CASES = [
    (11, 2, 128, 128, 512, E4M3FN, torch.float32, (128, 128)),  # DeepSeek-like
    (12, 3, 128, 128, 320, E4M3FN, torch.float32, (128, 128)),  # partial edge block along L
    (13, 4, 128, 128, 320, E4M3FNUZ, torch.float32, (128, 128)),
    (14, 2, 128, 128, 512, E4M3FN, torch.bfloat16, (128, 128)),
    (15, 3, 128, 128, 320, E4M3FNUZ, torch.float16, (128, 128)),
    (16, 2, 128, 64, 200, E4M3FN, torch.float32, (64, 128)),  # bn != bk: orientation matters
    (17, 3, 64, 128, 320, E4M3FN, torch.float32, (64, 48)),  # partial bk block, bn = 64
]
CASE_IDS = [f"H{c[1]}-P{c[2]}-V{c[3]}-L{c[4]}-{c[5]}-{c[6]}-{c[7]}" for c in CASES]


@pytest.mark.parametrize("seed, H, P, V, L, dtype, sdtype, block", CASES, ids=CASE_IDS)
def test_codes_are_the_checkpoint_bytes(seed, H, P, V, L, dtype, sdtype, block):
    w, s = _checkpoint(seed, H, P, V, L, dtype, sdtype, block)
    uk, uv = _split(w, s, H, P, V, block)
    assert uk.data.dtype == uv.data.dtype == dtype
    ckpt = w.view(torch.uint8).view(H, P + V, L)
    assert torch.equal(uk.data.view(torch.uint8), ckpt[:, :P, :])
    assert torch.equal(uv.data.view(torch.uint8), ckpt[:, P:, :].transpose(1, 2))
    # by hand: head h's W_UV column v is checkpoint row h * (P + V) + P + v
    raw = w.view(torch.uint8)
    for h, p, v, l_ in ((0, 0, 0, 0), (H - 1, P - 1, V - 1, L - 1), (1, 5, 3, L // 2)):
        assert uk.data.view(torch.uint8)[h, p, l_].item() == raw[h * (P + V) + p, l_].item()
        assert uv.data.view(torch.uint8)[h, l_, v].item() == raw[h * (P + V) + P + v, l_].item()


@pytest.mark.parametrize("dtype, seed", [(E4M3FN, 21), (E4M3FNUZ, 22)])
def test_every_byte_pattern_is_copied_not_cast(dtype, seed):
    """All 256 byte patterns, NaN encodings included, survive bit for bit."""
    H, P, V, L = 2, 128, 128, 320
    g = _gen(seed)
    raw = torch.randint(0, 256, (H * (P + V), L), generator=g, dtype=torch.uint8)
    raw[0, :256] = torch.arange(256, dtype=torch.uint8)  # in W_UK_T of head 0
    raw[P, :256] = torch.arange(256, dtype=torch.uint8)  # in W_UV of head 0
    w = raw.view(dtype)
    s = _scales(g, H * (P + V) // 128, 3, torch.float32)
    uk, uv = _split(w, s, H, P, V)
    assert torch.isnan(uk.data[0, 0, :256].float()).any()  # NaN codes really are in there
    ckpt = raw.view(H, P + V, L)
    assert torch.equal(uk.data.view(torch.uint8), ckpt[:, :P, :])
    assert torch.equal(uv.data.view(torch.uint8), ckpt[:, P:, :].transpose(1, 2))
    assert uv.data.view(torch.uint8)[0, :256, 0].tolist() == list(range(256))


@pytest.mark.parametrize("seed, H, P, V, L, dtype, sdtype, block", CASES, ids=CASE_IDS)
def test_scales_are_the_checkpoint_entries(seed, H, P, V, L, dtype, sdtype, block):
    w, s = _checkpoint(seed, H, P, V, L, dtype, sdtype, block)
    uk, uv = _split(w, s, H, P, V, block)
    bn, bk = block
    pb, vb, lb = P // bn, V // bn, -(-L // bk)
    assert uk.scale.dtype == uv.scale.dtype == torch.float32
    assert uk.scale.shape == (H, pb, lb) and uv.scale.shape == (H, lb, vb)
    sf = s.float()
    for h in range(H):
        for i in range(pb):  # W_UK_T: p-block i of head h is checkpoint row-block h*(P+V)/bn + i
            for j in range(lb):
                assert uk.scale[h, i, j].item() == sf[h * (P + V) // bn + i, j].item()
        for j in range(vb):  # W_UV: [h, l-block i, v-block j]
            for i in range(lb):
                assert uv.scale[h, i, j].item() == sf[(h * (P + V) + P) // bn + j, i].item()


def test_scale_mapping_by_hand():
    """DeepSeek-like H = 3, P = V = 128, L = 320: each head is two row-blocks (UK then UV),
    L has three column-blocks (the last one partial)."""
    w, s = _checkpoint(31, 3, 128, 128, 320)
    uk, uv = _split(w, s, 3, 128, 128)
    assert s.shape == (6, 3) and uk.scale.shape == (3, 1, 3) and uv.scale.shape == (3, 3, 1)
    assert uk.scale[0, 0, 0].item() == s[0, 0].item()
    assert uk.scale[1, 0, 2].item() == s[2, 2].item()
    assert uk.scale[2, 0, 1].item() == s[4, 1].item()
    assert uv.scale[0, 2, 0].item() == s[1, 2].item()
    assert uv.scale[2, 1, 0].item() == s[5, 1].item()
    assert uv.scale[1, 0, 0].item() == s[3, 0].item()
    assert torch.equal(uk.scale[:, 0, :], s[0::2]) and torch.equal(uv.scale[:, :, 0], s[1::2])


@pytest.mark.parametrize("seed, H, P, V, L, dtype, sdtype, block", CASES, ids=CASE_IDS)
def test_layouts_and_attributes(seed, H, P, V, L, dtype, sdtype, block):
    w, s = _checkpoint(seed, H, P, V, L, dtype, sdtype, block)
    uk, uv = _split(w, s, H, P, V, block)
    bn, bk = block
    assert isinstance(uk, QuantizedWeight) and isinstance(uv, QuantizedWeight)
    assert uk.format == uv.format == "fp8" and uk.granularity == uv.granularity == "block"
    assert uk.block == (bn, bk) and uv.block == (bk, bn)
    assert uk.shape == (H, P, L) and (uk.P, uk.L) == (P, L) and uv.shape == (H, L, V)
    assert uk.data.is_contiguous() and not uk.k_major
    assert uv.k_major and not uv.data.is_contiguous()
    assert uv.data.stride() == (V * L, 1, L)  # memory [H, V, L]
    assert uk.scale.is_contiguous() and uv.scale.is_contiguous()


@pytest.mark.parametrize("seed, H, P, V, L, dtype, sdtype, block", CASES, ids=CASE_IDS)
def test_dequantize_equals_the_fp32_split(seed, H, P, V, L, dtype, sdtype, block):
    w, s = _checkpoint(seed, H, P, V, L, dtype, sdtype, block)
    uk, uv = _split(w, s, H, P, V, block)
    ref_uk, ref_uv = split_kv_b_proj(dequantize_block_fp8(w, s, block), H, P, V)
    assert ref_uk.abs().max().item() > 0 and ref_uv.abs().max().item() > 0
    assert torch.equal(uk.dequantize(), ref_uk)
    assert torch.equal(uv.dequantize(), ref_uv)
    # one element by hand, in the last (possibly partial) L block of the last head
    bn, bk = block
    h, v, l_ = H - 1, V - 1, L - 1
    row = h * (P + V) + P + v
    want = w[row, l_].float().item() * s[row // bn, l_ // bk].float().item()
    assert uv.dequantize()[h, l_, v].item() == pytest.approx(want, rel=1e-6)


def test_non_contiguous_inputs_and_no_aliasing():
    """A transposed weight view and a strided scale give the same pieces; with H = 1 (where a
    slice could be a view) nothing shares memory with the checkpoint."""
    H, P, V, L = 1, 128, 128, 320
    w, s = _checkpoint(41, H, P, V, L)
    wt = w.T.contiguous().T  # same values, column-major
    st = s.T.contiguous().T
    assert not wt.is_contiguous() and not st.is_contiguous()
    uk, uv = _split(w, s, H, P, V)
    uk2, uv2 = _split(wt, st, H, P, V)
    for a, b in ((uk, uk2), (uv, uv2)):
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        assert torch.equal(a.scale, b.scale) and a.data.stride() == b.data.stride()
    ptrs = {t.untyped_storage().data_ptr() for t in (w, s)}
    for t in (uk.data, uk.scale, uv.data, uv.scale):
        assert t.untyped_storage().data_ptr() not in ptrs
    before = uk.data.view(torch.uint8).clone(), uv.scale.clone()
    w.view(torch.uint8).fill_(0x38)  # overwrite the checkpoint: the pieces keep their values
    s.fill_(7.0)
    assert torch.equal(uk.data.view(torch.uint8), before[0]) and torch.equal(uv.scale, before[1])


@pytest.mark.parametrize("seed, H, P, V, L, dtype, sdtype, block", CASES, ids=CASE_IDS)
def test_shared_codes_are_views_of_the_checkpoint(seed, H, P, V, L, dtype, sdtype, block):
    """share=True: the codes are the checkpoint's own memory (each head (P + V) * L elements
    after the last, the layouts of the copies), the same bytes and scales as the copies, and an
    in-place rewrite of the checkpoint shows in them; the scales are still copies."""
    w, s = _checkpoint(seed, H, P, V, L, dtype, sdtype, block)
    uk, uv = _split(w, s, H, P, V, block)
    suk, suv = split_kv_b_proj_fp8(
        w, s, num_heads=H, qk_nope_head_dim=P, v_head_dim=V, block_size=block, share=True
    )
    base = w.untyped_storage().data_ptr()
    assert suk.data.untyped_storage().data_ptr() == suv.data.untyped_storage().data_ptr() == base
    assert suk.data.data_ptr() == w.data_ptr() and suv.data.data_ptr() == w[P].data_ptr()
    assert suk.data.stride() == ((P + V) * L, L, 1) and not suk.k_major
    assert suv.data.stride() == ((P + V) * L, 1, L) and suv.k_major
    for a, b in ((uk, suk), (uv, suv)):
        assert a.shape == b.shape and a.block == b.block and a.data.dtype == b.data.dtype
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        assert torch.equal(a.scale, b.scale) and b.scale.is_contiguous()
        assert b.scale.untyped_storage().data_ptr() != s.untyped_storage().data_ptr()
        assert torch.equal(a.dequantize(), b.dequantize())
    byte = w.view(torch.uint8)[P + V - 1, L - 1].item()  # head 0's last W_UV row, last column
    w.view(torch.uint8)[P + V - 1, L - 1] = byte ^ 1  # rewritten in place
    assert suv.data.view(torch.uint8)[0, L - 1, V - 1].item() == byte ^ 1  # the view sees it
    assert uv.data.view(torch.uint8)[0, L - 1, V - 1].item() == byte  # the copy does not


def test_share_needs_a_contiguous_weight_and_a_bool():
    w, s = _checkpoint(42, 2, 128, 128, 320)
    wt = w.T.contiguous().T
    with pytest.raises(FuseMLAValueError, match=r"^weight: share=True views its codes per head"):
        _call(w=wt, s=s, share=True)
    uk, uv = _call(w=wt, s=s)  # copies: any strides
    assert uk.data.is_contiguous()
    with pytest.raises(FuseMLATypeError, match=r"^share: expected a bool, got int"):
        _call(w=w, s=s, share=1)


@pytest.mark.parametrize("k_major", [False, True], ids=["rows", "k_major"])
def test_quantized_weight_heads_apart(k_major):
    """QuantizedWeight takes FP8 data whose heads are each contiguous (or K-major) and any
    distance apart that keeps them from overlapping; overlapping heads, or a head that is not
    one contiguous block, are refused naming data."""
    H, K, N = 3, 16, 24

    def laid(gap: int, inner_step: int = 1) -> torch.Tensor:
        a, b = (N, K) if k_major else (K, N)
        buf = torch.zeros(H, a * b + gap + a * b * (inner_step - 1)).to(E4M3FN)
        x = buf[:, : a * b * inner_step].view(H, a, b * inner_step)[:, :, ::inner_step]
        return x.transpose(1, 2) if k_major else x

    scale = torch.ones(H)
    for gap in (0, 1, 40):
        w = QuantizedWeight(laid(gap), scale, "fp8")
        assert w.shape == (H, K, N) and w.k_major == k_major and w.data.stride(0) == K * N + gap
    overlap = laid(0).as_strided((H, K, N), (K * N - 1, *laid(0).stride()[1:]))
    with pytest.raises(
        FuseMLAValueError, match=r"^data: expected a contiguous tensor or a K-major"
    ):
        QuantizedWeight(overlap, scale, "fp8")
    with pytest.raises(FuseMLAValueError, match=r"heads not overlapping\), got"):
        QuantizedWeight(laid(8, inner_step=2), scale, "fp8")


def test_meta_tensors_shapes_only():
    """No value is read (no sync): the split runs on meta tensors and gives the right shapes."""
    w = torch.empty(2 * 256, 320, dtype=E4M3FN, device="meta")
    s = torch.empty(4, 3, dtype=torch.bfloat16, device="meta")
    uk, uv = _split(w, s, 2, 128, 128)
    assert uk.device.type == uv.device.type == "meta"
    assert uk.shape == (2, 128, 320) and uv.shape == (2, 320, 128) and uv.k_major
    assert uk.scale.shape == (2, 1, 3) and uv.scale.shape == (2, 3, 1)
    assert uk.scale.dtype == torch.float32


# ----------------------------------------------------------------------------- bad inputs


def _w(rows: int = 512, cols: int = 320, dtype: torch.dtype = E4M3FN) -> torch.Tensor:
    return torch.ones(rows, cols).to(dtype)


def _s(rows: int = 4, cols: int = 3, dtype: torch.dtype = torch.float32, **kw) -> torch.Tensor:
    return torch.ones(rows, cols, dtype=dtype, **kw)


def _call(w=None, s=None, H=2, P=128, V=128, block=(128, 128), **kw):
    w = _w() if w is None else w
    s = _s() if s is None else s
    return split_kv_b_proj_fp8(
        w, s, num_heads=H, qk_nope_head_dim=P, v_head_dim=V, block_size=block, **kw
    )


BAD = [
    # blocks straddling a boundary
    (lambda: _call(w=_w(2 * 192), s=_s(3), P=64), FuseMLAValueError,
     r"^block_size: a block of bn = 128 rows \(block_size = \(128, 128\)\) would straddle the "
     r"W_UK_T / W_UV split inside a head: qk_nope_head_dim = 64 is not a multiple of 128"),
    (lambda: _call(w=_w(2 * 320), s=_s(5), V=192), FuseMLAValueError,
     r"^block_size: .* would straddle the boundary between two heads: v_head_dim = 192"),
    (lambda: _call(w=_w(2 * 256), s=_s(8, 3), block=(64, 128), P=96, V=160), FuseMLAValueError,
     r"straddle the W_UK_T / W_UV split.*qk_nope_head_dim = 96 is not a multiple of 64"),
    # scale shape
    (lambda: _call(s=_s(4, 2)), FuseMLAValueError,  # floor(320 / 128) instead of ceil
     r"^weight_scale_inv: expected shape .* = \[4, 3\] for weight \[512, 320\] and block_size "
     r"\(128, 128\), got Tensor\(shape=\(4, 2\)"),
    (lambda: _call(s=_s(3, 4)), FuseMLAValueError, r"^weight_scale_inv: expected shape"),
    (lambda: _call(s=torch.ones(12)), FuseMLAValueError, r"^weight_scale_inv: expected shape"),
    (lambda: _call(s=_s(4, 3), block=(128, 64)), FuseMLAValueError,
     r"^weight_scale_inv: expected shape .* = \[4, 5\]"),
    # weight dtype / shape
    (lambda: _call(w=torch.ones(512, 320, dtype=torch.bfloat16)), FuseMLATypeError,
     r"^weight: expected dtype torch.float8_e4m3fn or torch.float8_e4m3fnuz"),
    (lambda: _call(w=torch.ones(512, 320, dtype=torch.uint8)), FuseMLATypeError, r"^weight: "),
    (lambda: _call(w=_w(768)), FuseMLAValueError,
     r"^weight: expected shape \[num_heads \* \(qk_nope_head_dim \+ v_head_dim\), L\] = "
     r"\[512, L\], got Tensor\(shape=\(768, 320\)"),
    (lambda: _call(w=_w(512), H=3), FuseMLAValueError, r"^weight: expected shape .* \[768, L\]"),
    (lambda: _call(w=torch.ones(2, 256, 320).to(E4M3FN)), FuseMLAValueError,
     r"^weight: expected a non-empty \[num_heads"),
    (lambda: _call(w=_w(512, 0), s=_s(4, 0)), FuseMLAValueError, r"^weight: expected a non-empty"),
    # scale dtype
    (lambda: _call(s=_s(dtype=torch.float64)), FuseMLATypeError,
     r"^weight_scale_inv: expected dtype"),
    (lambda: _call(s=torch.ones(4, 3).to(E4M3FN)), FuseMLATypeError, r"^weight_scale_inv: "),
    # non-tensors
    (lambda: _call(w=[[1.0]]), FuseMLATypeError, r"^weight: expected a torch.Tensor, got list"),
    (lambda: _call(s=1.0), FuseMLATypeError, r"^weight_scale_inv: expected a torch.Tensor"),
    # ints
    (lambda: _call(H=True), FuseMLATypeError, r"^num_heads: expected a positive int, got bool"),
    (lambda: _call(H=2.0), FuseMLATypeError, r"^num_heads: expected a positive int"),
    (lambda: _call(P=-128), FuseMLAValueError,
     r"^qk_nope_head_dim: expected a positive int, got -128"),
    (lambda: _call(V=0), FuseMLAValueError, r"^v_head_dim: expected a positive int, got 0"),
    (lambda: _call(V=False), FuseMLATypeError, r"^v_head_dim: expected a positive int"),
    # block_size
    (lambda: _call(block=(128,)), FuseMLAValueError, r"^block_size: expected two positive ints"),
    (lambda: _call(block=(128, 0)), FuseMLAValueError, r"^block_size: expected two positive ints"),
    (lambda: _call(block=(True, 128)), FuseMLAValueError, r"^block_size: expected two positive"),
    (lambda: _call(block=128), FuseMLAValueError, r"^block_size: expected two positive ints"),
    (lambda: _call(block=(-128, 128)), FuseMLAValueError, r"^block_size: expected two positive"),
    # device
    (lambda: _call(s=_s(device="meta")), FuseMLATypeError,
     r"^weight_scale_inv: expected device cpu \(that of weight\), got .*device=meta"),
]  # fmt: skip


@pytest.mark.parametrize("call, exc, match", BAD)
def test_bad_inputs(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_good_call_of_the_bad_inputs_baseline():
    """The defaults the bad cases perturb are themselves valid (each case fails for its one
    reason), list block sizes are accepted, and the result is the stored split."""
    uk, uv = _call(block=[128, 128])
    assert uk.block == (128, 128) and uv.block == (128, 128)
    assert torch.equal(uk.dequantize(), torch.ones(2, 128, 320))
    assert torch.equal(uv.dequantize(), torch.ones(2, 320, 128))
