"""A tiny random Hugging Face ``DeepseekV3Attention`` as an independent reference for MLA.

Used by ``tests/layers/test_mla_vs_hf.py`` (and reusable by the demo and the benchmark): it builds
a small DeepSeek-V3 attention layer with random weights in fp32 and runs it over a request's whole
sequence, causally, the way transformers would. Nothing here imports fusemla's kernels or layer.

- :func:`tiny_deepseek_v3_config`: a ``DeepseekV3Config`` with the small dims (H=4, P=32, R=16,
  L=64, V=32, hidden 64) and DeepSeek-V3's YaRN RoPE settings (both from
  :mod:`fusemla.testing.dims`), ``rope_interleave=True``, eager attention.
- :func:`make_hf_attention`: an fp32 ``DeepseekV3Attention`` with random weights and its
  ``DeepseekV3RotaryEmbedding``. The weights are bf16-representable (drawn in fp32 and rounded
  through bf16), so a bf16 copy of the layer holds exactly the same numbers: what differs between
  a bf16 implementation and this fp32 reference is then its arithmetic, not the weights.
- :func:`hf_attention_outputs`: HF's outputs at positions ``start .. S-1`` of one request whose
  hidden states at positions ``0 .. S-1`` are given (causal mask, positions from 0).
- :class:`LatentRoundTrip`: passed to HF as its ``past_key_values``; HF hands it exactly the
  latents a paged MLA cache holds (``kv_a_layernorm`` output and the rotated ``k_pe``) and
  attends over what it returns. It returns them round-tripped through an FP8 cache
  (``fp8(saturate(x / kv_scale)) * kv_scale``) or unchanged, and records them.

Layout note: transformers 5.x's ``apply_rotary_pos_emb_interleave`` rotates DeepSeek's interleaved
pairs ``(x[2i], x[2i+1])`` but returns them de-interleaved (``[rotated evens, rotated odds]``),
for q and k alike. The q.k products (hence the attention output) are the same as with the
interleaved layout engines keep in their caches; compare at the attention-output level, or
re-interleave with :func:`interleave_rope` before comparing cache rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from fusemla.testing.dims import DEEPSEEK_V3_YARN, SMALL_LAYER, hf_config

__all__ = [
    "DEEPSEEK_V3_YARN",
    "TINY_DIMS",
    "HFAttention",
    "LatentRoundTrip",
    "causal_mask",
    "deinterleave_rope",
    "fp8_round_trip",
    "hf_attention_outputs",
    "interleave_rope",
    "make_hf_attention",
    "tiny_deepseek_v3_config",
]

#: the small MLA dims as DeepseekV3Config keywords (:data:`fusemla.testing.dims.SMALL_LAYER`:
#: hidden 64, H=4 heads, P=32 (qk_nope), R=16 (qk_rope), L=64 (kv_lora), V=32)
TINY_DIMS = {
    k: v
    for k, v in hf_config(SMALL_LAYER).items()
    if k not in ("q_lora_rank", "max_position_embeddings", "rope_interleave", "rope_parameters")
}


def tiny_deepseek_v3_config(
    *, q_lora_rank: int | None = 48, max_position_embeddings: int = 4096 * 40, **overrides
) -> DeepseekV3Config:
    """A tiny ``DeepseekV3Config`` (:data:`TINY_DIMS`, DeepSeek YaRN, interleaved RoPE, eager
    attention, no attention bias). ``q_lora_rank=None`` gives the ``q_proj`` variant
    (DeepSeek-V2-Lite style). ``overrides`` replace any config field."""
    kw = hf_config(
        SMALL_LAYER.replace(q_lora=q_lora_rank),
        max_position=max_position_embeddings,
        rope=DEEPSEEK_V3_YARN,
    )
    kw.update(
        attention_bias=False,
        attention_dropout=0.0,
        num_hidden_layers=1,
        vocab_size=128,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
    )
    kw.update(overrides)
    config = DeepseekV3Config(**kw)
    config._attn_implementation = "eager"
    return config


@dataclass
class HFAttention:
    """An fp32 ``DeepseekV3Attention`` (``attn``), its rotary embedding and its config."""

    config: DeepseekV3Config
    attn: DeepseekV3Attention
    rotary: DeepseekV3RotaryEmbedding

    def outputs(
        self, hidden_seq: torch.Tensor, start: int = 0, cache: LatentRoundTrip | None = None
    ) -> torch.Tensor:
        """:func:`hf_attention_outputs` with this module."""
        return hf_attention_outputs(self.attn, self.rotary, hidden_seq, start, cache=cache)

    def random_hidden(
        self, length: int, generator: torch.Generator, scale: float = 1.0
    ) -> torch.Tensor:
        """``[length, hidden]`` fp32 N(0, scale^2) hidden states, bf16-representable (so a bf16
        layer receives exactly what this fp32 reference receives)."""
        x = torch.randn(length, self.config.hidden_size, generator=generator) * scale
        return x.to(torch.bfloat16).float()


def _bf16_exact(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def make_hf_attention(
    config: DeepseekV3Config | None = None, *, seed: int = 0, norm_weight_spread: float = 0.1
) -> HFAttention:
    """An fp32 ``DeepseekV3Attention`` with random, bf16-representable weights.

    Each linear weight is N(0, 1/fan_in) (activations stay O(1): q and k entries ~N(0, 1), so the
    softmax is neither flat nor one-hot); RMSNorm weights are ``1 + N(0, norm_weight_spread^2)``
    (not all ones, so a layer that skips a norm weight fails). Deterministic in ``seed``.
    """
    config = config if config is not None else tiny_deepseek_v3_config()
    g = torch.Generator().manual_seed(seed)
    attn = DeepseekV3Attention(config, layer_idx=0).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in sorted(attn.named_parameters()):
            if name.endswith("layernorm.weight"):
                v = 1.0 + norm_weight_spread * torch.randn(p.shape, generator=g)
            elif name.endswith("bias"):
                v = 0.1 * torch.randn(p.shape, generator=g)
            else:
                v = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
            p.copy_(_bf16_exact(v))
    rotary = DeepseekV3RotaryEmbedding(config)
    return HFAttention(config, attn, rotary)


def fp8_round_trip(
    x: torch.Tensor, kv_scale: float, dtype: torch.dtype = torch.float8_e4m3fn
) -> torch.Tensor:
    """What an FP8 cache gives back for ``x``: ``fp8(saturate(x / kv_scale)) * kv_scale``.

    ``x`` is divided by the fp32 scale in fp32 (IEEE division), clamped to the format's finite
    range (saturation; torch's cast alone would turn overflow into NaN), rounded to nearest even
    by torch's cast, and scaled back in fp32. Returns ``x``'s dtype.
    """
    scale = torch.tensor(kv_scale, dtype=torch.float32)
    fmax = torch.finfo(dtype).max
    q = (x.float() / scale).clamp(-fmax, fmax).to(dtype)
    return (q.float() * scale).to(x.dtype)


@dataclass
class LatentRoundTrip:
    """A stand-in for HF's ``past_key_values`` that sees the cached latents of one forward call.

    ``DeepseekV3Attention.forward`` calls ``past_key_values.update(kv_nope, k_rot, layer_idx)``
    with the ``kv_a_layernorm`` output ``[B, 1, S, L]`` and the rotated ``k_pe`` ``[B, 1, S, R]``
    (de-interleaved, see the module note) and attends over what it returns. With ``kv_dtype`` an
    FP8 dtype both come back through :func:`fp8_round_trip`; with None, unchanged; with
    ``replace = (kv_c [S, L], k_pe [S, R])`` (k_pe interleaved, as in an engine's cache), those
    instead. The latents as HF computed them (before any of this) are kept in ``kv_c`` and
    ``k_pe`` (HF's layout: ``[1, 1, S, L]``, ``[1, 1, S, R]`` de-interleaved).
    """

    kv_dtype: torch.dtype | None = None
    kv_scale: float | None = None
    kv_c: torch.Tensor | None = None
    k_pe: torch.Tensor | None = None
    calls: int = field(default=0)
    #: ``(kv_c [S, L], k_pe [S, R] interleaved)``: latents HF attends over instead of its own
    #: (e.g. the rows another implementation wrote to its cache, dequantized)
    replace: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, kv_nope: torch.Tensor, k_rot: torch.Tensor, layer_idx: int = 0, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        self.kv_c, self.k_pe = kv_nope.detach().clone(), k_rot.detach().clone()
        if self.replace is not None:
            kv_c, k_pe = self.replace
            if kv_c.shape != kv_nope.shape[2:] or k_pe.shape != k_rot.shape[2:]:
                raise ValueError(
                    f"LatentRoundTrip.replace: expected kv_c "
                    f"{list(kv_nope.shape[2:])} and k_pe {list(k_rot.shape[2:])}, "
                    f"got {list(kv_c.shape)} and {list(k_pe.shape)}"
                )
            return (
                kv_c.to(kv_nope.dtype).expand_as(kv_nope),
                deinterleave_rope(k_pe).to(k_rot.dtype).expand_as(k_rot),
            )
        if self.kv_dtype is None:
            return kv_nope, k_rot
        if self.kv_scale is None:
            raise ValueError("LatentRoundTrip: an FP8 kv_dtype needs a kv_scale")
        return (
            fp8_round_trip(kv_nope, self.kv_scale, self.kv_dtype),
            fp8_round_trip(k_rot, self.kv_scale, self.kv_dtype),
        )


def causal_mask(length: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[1, 1, S, S]`` additive mask: 0 where key <= query, -inf above the diagonal."""
    blocked = torch.ones(length, length, dtype=torch.bool).triu(1)
    mask = torch.zeros(length, length, dtype=dtype).masked_fill(blocked, float("-inf"))
    return mask[None, None]


@torch.no_grad()
def hf_attention_outputs(
    attn: DeepseekV3Attention,
    rotary: DeepseekV3RotaryEmbedding,
    hidden_seq: torch.Tensor,
    start: int = 0,
    *,
    cache: LatentRoundTrip | None = None,
) -> torch.Tensor:
    """HF's attention output (after ``o_proj``) at positions ``start .. S-1`` of one request.

    ``hidden_seq [S, hidden]``: the request's hidden states at positions ``0 .. S-1``; they are
    run in ``attn``'s dtype as one causal sequence (the output at position ``p`` depends only on
    positions ``<= p``, so this equals what incremental decoding with a KV cache gives).
    ``cache``: a :class:`LatentRoundTrip` (e.g. to round-trip the latents through FP8).
    Returns ``[S - start, hidden]`` in ``attn``'s dtype.
    """
    S = hidden_seq.shape[0]
    if not 0 <= start <= S:
        raise ValueError(f"start: expected 0 <= start <= {S}, got {start}")
    dtype = next(attn.parameters()).dtype
    x = hidden_seq.to(dtype)[None]  # [1, S, hidden]
    position_ids = torch.arange(S)[None]
    cos, sin = rotary(x, position_ids)
    out, _ = attn(
        x,
        position_embeddings=(cos, sin),
        attention_mask=causal_mask(S, dtype),
        past_key_values=cache,
    )
    return out[0, start:]


def interleave_rope(x: torch.Tensor) -> torch.Tensor:
    """HF's de-interleaved rotated rope dims ``[evens, odds]`` back to DeepSeek's interleaved
    order ``(x[0], x[R/2], x[1], x[R/2 + 1], ...)`` (the engines' cache layout)."""
    half = x.shape[-1] // 2
    return torch.stack((x[..., :half], x[..., half:]), dim=-1).flatten(-2)


def deinterleave_rope(x: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`interleave_rope`: DeepSeek's interleaved rope dims to HF's
    ``[evens, odds]`` layout."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
