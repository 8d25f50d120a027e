"""Tests of fusemla.rope: cache splitting, YaRN tables (vs Hugging Face) and the reference rotation."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fusemla.errors import FuseMLAError, FuseMLATypeError, FuseMLAValueError
from fusemla.rope import (
    apply_rope,
    deepseek_yarn_cos_sin_cache,
    deepseek_yarn_inv_freq,
    rope_cache_from_hf_config,
    rope_cos_sin_cache,
    rope_inv_freq,
    split_cos_sin_cache,
    yarn_get_mscale,
)
from fusemla.testing import DEEPSEEK_V3_YARN

# DeepSeek-V3's RoPE settings (config.json of deepseek-ai/DeepSeek-V3), shared by the tests
V3_ROPE = dict(DEEPSEEK_V3_YARN)
# Positions compared against Hugging Face: the whole first 8K plus far-out ones.
LARGE_POSITIONS = [16383, 65535, 100000, 131071, 160000, 163839]


# --------------------------------------------------------------------------------------------
# split_cos_sin_cache
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_split_round_trips(dtype: torch.dtype) -> None:
    cache = torch.randn(37, 64).to(dtype)
    cos, sin = split_cos_sin_cache(cache)
    assert cos.shape == (37, 32) and sin.shape == (37, 32)
    assert cos.dtype == dtype and sin.dtype == dtype
    assert cos.device == cache.device
    assert torch.equal(torch.cat((cos, sin), dim=-1), cache)
    # views into the cache: no copy (an engine's one RoPE cache serves every layer)
    assert cos.data_ptr() == cache.data_ptr()
    assert sin.data_ptr() == cache.data_ptr() + 32 * cache.element_size()
    assert cos.stride() == sin.stride() == (64, 1)


def test_split_views_follow_the_cache() -> None:
    cache = torch.randn(9, 8)
    cos, sin = split_cos_sin_cache(cache)
    cache[3, 1], cache[5, 6] = 7.0, -3.0  # e.g. an engine recomputing its cache in place
    assert cos[3, 1] == 7.0 and sin[5, 2] == -3.0


def test_split_of_non_contiguous_cache_is_contiguous() -> None:
    cache = torch.randn(64, 40).t()  # [40, 64] with stride (1, 40): rows not contiguous
    cos, sin = split_cos_sin_cache(cache)
    assert cos.is_contiguous() and sin.is_contiguous()
    assert torch.equal(cos, cache[:, :32]) and torch.equal(sin, cache[:, 32:])


def test_split_of_generated_cache() -> None:
    cache = deepseek_yarn_cos_sin_cache(max_position=100)
    cos, sin = split_cos_sin_cache(cache)
    assert cos.shape == (100, 32)
    assert torch.allclose(cos[0], torch.ones(32)) and torch.allclose(sin[0], torch.zeros(32))


@pytest.mark.parametrize(
    "bad, exc, words",
    [
        (torch.randn(4, 8, 64), FuseMLAValueError, "2-D"),
        (torch.randn(64), FuseMLAValueError, "2-D"),
        (torch.randn(4, 63), FuseMLAValueError, "even"),
        (torch.randn(4, 0), FuseMLAValueError, "even"),
        (torch.zeros(4, 64, dtype=torch.int32), FuseMLATypeError, "floating"),
        (torch.zeros(4, 64, dtype=torch.bool), FuseMLATypeError, "floating"),
        ([[1.0, 2.0]], FuseMLATypeError, "Tensor"),
    ],
)
def test_split_rejects_bad_input(bad: object, exc: type[Exception], words: str) -> None:
    with pytest.raises(exc) as info:
        split_cos_sin_cache(bad)  # type: ignore[arg-type]
    message = str(info.value)
    assert "cos_sin_cache" in message
    assert words in message
    assert isinstance(info.value, FuseMLAError)
    if isinstance(bad, torch.Tensor):  # names what was given
        assert str(tuple(bad.shape)) in message


# --------------------------------------------------------------------------------------------
# apply_rope vs complex-number rotation
# --------------------------------------------------------------------------------------------


def _complex_rotation(x: torch.Tensor, angles: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """float64 oracle: pair i as a complex number times exp(1j * angle_i), same layout out."""
    x = x.double()
    half = x.shape[-1] // 2
    if is_neox:
        z = torch.complex(x[..., :half], x[..., half:])
    else:
        z = torch.complex(x[..., 0::2], x[..., 1::2])
    z = z * torch.polar(torch.ones_like(angles, dtype=torch.float64), angles.double())
    if is_neox:
        return torch.cat((z.real, z.imag), dim=-1)
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)


@pytest.mark.parametrize("is_neox", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_matches_complex_rotation(is_neox: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, heads, rope_dim = 7, 5, 64
    x = torch.randn(tokens, heads, rope_dim, generator=gen).to(dtype)
    angles = torch.rand(tokens, 1, rope_dim // 2, generator=gen, dtype=torch.float64) * 20 - 10
    out = apply_rope(x, angles.cos().float(), angles.sin().float(), is_neox=is_neox)
    assert out.dtype == torch.float32
    assert out.shape == x.shape
    expected = _complex_rotation(x, angles, is_neox)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-6)


def test_apply_rope_styles_differ_and_preserve_norm_of_pairs() -> None:
    x = torch.randn(3, 8)
    angles = torch.rand(3, 4)
    a = apply_rope(x, angles.cos(), angles.sin(), is_neox=False)
    b = apply_rope(x, angles.cos(), angles.sin(), is_neox=True)
    assert not torch.allclose(a, b)
    torch.testing.assert_close(a.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(b.norm(dim=-1), x.norm(dim=-1))


def test_apply_rope_rejects_mismatched_shapes() -> None:
    with pytest.raises(FuseMLAValueError, match="cos"):
        apply_rope(torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 4), is_neox=False)
    with pytest.raises(FuseMLAValueError, match="x"):
        apply_rope(torch.randn(2, 7), torch.randn(2, 3), torch.randn(2, 3), is_neox=True)


# --------------------------------------------------------------------------------------------
# YaRN tables: formulas we can check without transformers
# --------------------------------------------------------------------------------------------


def test_yarn_get_mscale() -> None:
    assert yarn_get_mscale(1.0, 0.707) == 1.0
    assert yarn_get_mscale(0.5) == 1.0
    assert yarn_get_mscale(40.0, 1.0) == pytest.approx(0.1 * math.log(40.0) + 1.0)
    assert yarn_get_mscale(40.0, 0.707) == pytest.approx(0.0707 * math.log(40.0) + 1.0)


def test_yarn_inv_freq_regions() -> None:
    plain = rope_inv_freq(64, 10000.0)
    yarn = deepseek_yarn_inv_freq()
    assert yarn.dtype == torch.float32 and yarn.shape == (32,)
    # DeepSeek-V3 correction range: floor(10.47) = 10, ceil(22.5) = 23 (dims of the R/2 ramp).
    assert torch.equal(yarn[:10], plain[:10])  # high frequencies: extrapolated (unchanged)
    torch.testing.assert_close(yarn[23:], plain[23:] / 40.0)  # low: interpolated
    mid = yarn[11:23]
    assert torch.all(mid < plain[11:23]) and torch.all(mid > plain[11:23] / 40.0)


def test_yarn_cache_values_and_attention_factor() -> None:
    cache = deepseek_yarn_cos_sin_cache(max_position=300, mscale=1.0, mscale_all_dim=0.8)
    m = yarn_get_mscale(40.0, 1.0) / yarn_get_mscale(40.0, 0.8)
    assert m > 1.0
    # Angles are float32 products (as in every engine); cos/sin and the scale are checked in f64.
    angles = (torch.arange(300, dtype=torch.float32)[:, None] * deepseek_yarn_inv_freq()).double()
    expected = torch.cat((angles.cos(), angles.sin()), dim=-1) * m
    assert cache.shape == (300, 64) and cache.dtype == torch.float32
    torch.testing.assert_close(cache.double(), expected, atol=2e-6, rtol=0)
    half = deepseek_yarn_cos_sin_cache(max_position=300, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16


def test_plain_rope_cache() -> None:
    cache = rope_cos_sin_cache(16, 50, base=500.0)
    inv = 1.0 / 500.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    torch.testing.assert_close(rope_inv_freq(16, 500.0).double(), inv, atol=0, rtol=1e-6)
    angles = (torch.arange(50, dtype=torch.float32)[:, None] * rope_inv_freq(16, 500.0)).double()
    torch.testing.assert_close(
        cache.double(), torch.cat((angles.cos(), angles.sin()), -1), atol=1e-6, rtol=0
    )


def test_cache_from_v4_style_config() -> None:
    """transformers 4.x keeps the dict in ``rope_scaling`` (``type`` key) and ``rope_theta`` apart."""
    scaling = dict(V3_ROPE, mscale_all_dim=0.8)
    scaling["type"] = scaling.pop("rope_type")
    config = SimpleNamespace(
        qk_rope_head_dim=64,
        rope_theta=10000.0,
        rope_scaling=scaling,
        max_position_embeddings=163840,
    )
    got = rope_cache_from_hf_config(config, max_position=512)
    want = deepseek_yarn_cos_sin_cache(max_position=512, mscale=1.0, mscale_all_dim=0.8)
    assert torch.equal(got, want)
    # Default size: original_max_position_embeddings * factor.
    assert rope_cache_from_hf_config(config).shape == (163840, 64)


def test_cache_from_config_without_scaling_is_plain_rope() -> None:
    config = SimpleNamespace(
        qk_rope_head_dim=64, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128
    )
    assert torch.equal(rope_cache_from_hf_config(config), rope_cos_sin_cache(64, 128))


def test_cache_from_config_rejects_unknown_rope_type() -> None:
    config = SimpleNamespace(
        qk_rope_head_dim=64,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4},
        max_position_embeddings=128,
    )
    with pytest.raises(FuseMLAValueError, match="rope_type"):
        rope_cache_from_hf_config(config)


# --------------------------------------------------------------------------------------------
# Against Hugging Face transformers
# --------------------------------------------------------------------------------------------


def _hf_modeling():
    pytest.importorskip("transformers")
    return pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")


def _hf_config(mscale: float, mscale_all_dim: float):
    from transformers import DeepseekV3Config

    rope = dict(V3_ROPE, mscale=mscale, mscale_all_dim=mscale_all_dim)
    # Tiny non-RoPE dims: the rotary embedding reads only the RoPE fields; no weights are built.
    kwargs = {
        "hidden_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "kv_lora_rank": 64,
        "q_lora_rank": None,
        "max_position_embeddings": 163840,
    }
    try:  # transformers >= 5: theta lives inside rope_parameters
        return DeepseekV3Config(rope_parameters=dict(rope, rope_theta=10000.0), **kwargs)
    except TypeError:  # transformers 4.x
        rope["type"] = rope.pop("rope_type")
        return DeepseekV3Config(rope_scaling=rope, rope_theta=10000.0, **kwargs)


@pytest.mark.parametrize(
    "mscale, mscale_all_dim",
    [(1.0, 1.0), (0.707, 0.707), (1.0, 0.8), (0.707, 1.0)],
)
def test_yarn_cache_matches_hugging_face(mscale: float, mscale_all_dim: float) -> None:
    hf = _hf_modeling()
    config = _hf_config(mscale, mscale_all_dim)
    rotary = hf.DeepseekV3RotaryEmbedding(config=config)
    expected_m = yarn_get_mscale(40.0, mscale) / yarn_get_mscale(40.0, mscale_all_dim)
    assert rotary.attention_scaling == pytest.approx(expected_m, rel=1e-12)

    positions = torch.cat((torch.arange(8192), torch.tensor(LARGE_POSITIONS)))
    x = torch.zeros(1, dtype=torch.float32)  # only its dtype/device are used
    with torch.no_grad():
        hf_cos, hf_sin = rotary(x, positions[None, :])
    hf_cos, hf_sin = hf_cos[0], hf_sin[0]
    assert hf_cos.shape == (positions.numel(), 64)
    # HF duplicates the R/2 frequencies as cat(freqs, freqs) (NeoX layout of the angles).
    assert torch.equal(hf_cos[:, :32], hf_cos[:, 32:])
    assert torch.equal(hf_sin[:, :32], hf_sin[:, 32:])

    ours = deepseek_yarn_cos_sin_cache(
        max_position=max(LARGE_POSITIONS) + 1, mscale=mscale, mscale_all_dim=mscale_all_dim
    )
    cos, sin = split_cos_sin_cache(ours)
    torch.testing.assert_close(cos[positions], hf_cos[:, :32], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[positions], hf_sin[:, :32], atol=1e-6, rtol=0)
    torch.testing.assert_close(deepseek_yarn_inv_freq(), rotary.inv_freq.float(), atol=0, rtol=1e-6)

    from_config = rope_cache_from_hf_config(config, max_position=max(LARGE_POSITIONS) + 1)
    torch.testing.assert_close(from_config, ours, atol=1e-7, rtol=0)


def test_cache_from_hf_config_default_size_and_plain() -> None:
    _hf_modeling()
    from transformers import DeepseekV3Config

    config = _hf_config(1.0, 1.0)
    assert config.max_position_embeddings == 163840
    full = rope_cache_from_hf_config(config, dtype=torch.bfloat16)
    assert full.shape == (163840, 64) and full.dtype == torch.bfloat16

    plain = DeepseekV3Config(max_position_embeddings=256)  # no scaling: rope_type "default"
    torch.testing.assert_close(
        rope_cache_from_hf_config(plain), rope_cos_sin_cache(64, 256), atol=0, rtol=0
    )


# What the installed transformers does for DeepSeek-V3's interleaved RoPE (checked on 5.24):
#
# * DeepseekV3RotaryEmbedding.forward returns cos/sin of width R built from cat(freqs, freqs),
#   times `attention_scaling` (the yarn mscale ratio) -- i.e. NeoX-shaped tables.
# * With config.rope_interleave=True (the default), DeepseekV3Attention calls
#   apply_rotary_pos_emb_interleave(q, k, cos, sin). It takes the first R/2 columns of cos/sin,
#   splits x into evens x[0::2] and odds x[1::2], rotates each (even, odd) pair by angle i and
#   returns cat([even*c - odd*s, odd*c + even*s]): the *de-interleaved* (NeoX) layout. Earlier
#   versions (4.x) did the same by permuting dims with view(.., R/2, 2).transpose(-1, -2)
#   .reshape(.., R) and then calling the NeoX rotate_half path. Either way, HF's output equals
#   DeepSeek/vLLM's interleaved output (our is_neox=False) with its dims permuted by
#   [0, 2, 4, ..., R-2, 1, 3, ..., R-1]. Because q and k get the same permutation, q.k is
#   unchanged; but a KV cache written from HF's k_rot is in the permuted layout, whereas vLLM
#   (is_neox_style=False) and fusemla keep the interleaved layout.


def test_interleaved_apply_rope_matches_hugging_face_up_to_layout() -> None:
    hf = _hf_modeling()
    config = _hf_config(1.0, 1.0)
    assert config.rope_interleave is True
    rotary = hf.DeepseekV3RotaryEmbedding(config=config)

    gen = torch.Generator().manual_seed(1)
    batch, heads, seq, rope_dim = 2, 3, 5, 64
    q = torch.randn(batch, heads, seq, rope_dim, generator=gen)
    k = torch.randn(batch, 1, seq, rope_dim, generator=gen)
    position_ids = torch.tensor([[0, 1, 4095, 100000, 163839], [7, 8, 9, 5000, 160000]])
    with torch.no_grad():
        cos, sin = rotary(q, position_ids)  # [batch, seq, R]
        hf_q, hf_k = hf.apply_rotary_pos_emb_interleave(q, k, cos, sin)

    c = cos[:, None, :, : rope_dim // 2]
    s = sin[:, None, :, : rope_dim // 2]
    our_q = apply_rope(q, c, s, is_neox=False)
    our_k = apply_rope(k, c, s, is_neox=False)
    perm = torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))
    torch.testing.assert_close(our_q[..., perm], hf_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(our_k[..., perm], hf_k, atol=1e-6, rtol=0)
    # Not equal without the permutation (the layouts really differ) ...
    assert not torch.allclose(our_q, hf_q, atol=1e-3)
    # ... yet attention scores agree.
    torch.testing.assert_close(our_q @ our_k.transpose(-1, -2), hf_q @ hf_k.transpose(-1, -2))

    # Equivalently: de-interleave x first, then the NeoX rotation (HF's non-interleave path,
    # and our is_neox=True) gives the same result.
    q_perm = q.view(batch, heads, seq, rope_dim // 2, 2).transpose(-1, -2).reshape(q.shape)
    torch.testing.assert_close(q_perm, q[..., perm])
    hf_neox_q, _ = hf.apply_rotary_pos_emb(q_perm, k[..., perm], cos, sin)
    torch.testing.assert_close(hf_neox_q, hf_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(apply_rope(q_perm, c, s, is_neox=True), hf_q, atol=1e-6, rtol=0)


def test_neox_apply_rope_matches_hugging_face_rotate_half() -> None:
    hf = _hf_modeling()
    rotary = hf.DeepseekV3RotaryEmbedding(config=_hf_config(0.707, 1.0))
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 6, 64, generator=gen)
    position_ids = torch.randint(0, 163840, (2, 6), generator=gen)
    with torch.no_grad():
        cos, sin = rotary(q, position_ids)
        hf_q, _ = hf.apply_rotary_pos_emb(q, q, cos, sin)
    ours = apply_rope(q, cos[:, None, :, :32], sin[:, None, :, :32], is_neox=True)
    torch.testing.assert_close(ours, hf_q, atol=1e-6, rtol=0)
