"""The model dims and RoPE settings of the tests, the demo and the benchmarks, defined once.

- Prologue dims (``H`` heads, ``P`` = qk_nope_head_dim, ``R`` = qk_rope_head_dim, ``L`` =
  kv_lora_rank) as keyword dicts for :func:`fusemla.testing.make_inputs`: :data:`DEEPSEEK_V3` and
  :data:`SMALL_DIMS` (the interpreter's).
- A whole attention layer's dims (:class:`LayerDims`: hidden size, ``V`` = v_head_dim and
  q_lora_rank too): :data:`SMALL_LAYER` and :data:`DEEPSEEK_V3_LAYER`.
- DeepSeek-V3's YaRN RoPE settings (:func:`deepseek_yarn`) and a Hugging Face style attention
  config built from both (:func:`hf_config`), what :meth:`fusemla.MLAAttention.from_state_dict`
  and :func:`fusemla.testing.models.random_state_dict` read.

Plain data: no torch, no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = [
    "DEEPSEEK_V3",
    "DEEPSEEK_V3_LAYER",
    "DEEPSEEK_V3_YARN",
    "SMALL_DIMS",
    "SMALL_LAYER",
    "TP8_LAYER",
    "LayerDims",
    "deepseek_yarn",
    "hf_config",
]

#: DeepSeek-V3 dims: heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank
DEEPSEEK_V3 = dict(H=128, P=128, R=64, L=512)
#: small dims for the interpreter (CPU tests, demo)
SMALL_DIMS = dict(H=4, P=32, R=16, L=64)


@dataclass(frozen=True)
class LayerDims:
    """An MLA attention layer's dims: ``hidden`` size, ``H`` heads, ``P`` / ``R`` / ``L`` (as in
    :data:`SMALL_DIMS`), ``V`` = v_head_dim, ``q_lora`` = q_lora_rank (None: one ``q_proj``)."""

    hidden: int
    H: int
    P: int
    R: int
    L: int
    V: int
    q_lora: int | None

    def prologue(self) -> dict:
        """The prologue's dims, ``dict(H=, P=, R=, L=)``."""
        return dict(H=self.H, P=self.P, R=self.R, L=self.L)

    def replace(self, **changes) -> LayerDims:
        """A copy with ``changes`` (e.g. ``H=16``, ``q_lora=None``)."""
        return replace(self, **changes)


#: the small layer (interpreter): :data:`SMALL_DIMS`, hidden 64, V 32, q_lora_rank 48
SMALL_LAYER = LayerDims(hidden=64, **SMALL_DIMS, V=32, q_lora=48)
#: DeepSeek-V3's attention layer, all 128 heads
DEEPSEEK_V3_LAYER = LayerDims(hidden=7168, **DEEPSEEK_V3, V=128, q_lora=1536)
#: one tensor-parallel-8 shard of it (16 heads): what a GPU runs per rank
TP8_LAYER = DEEPSEEK_V3_LAYER.replace(H=16)


def deepseek_yarn(factor: float = 40.0, original_max_position_embeddings: int = 4096) -> dict:
    """DeepSeek-V3's YaRN RoPE settings (its config.json: factor 40 over 4096 positions,
    beta_fast 32, beta_slow 1, mscale = mscale_all_dim = 1, theta 10000) in transformers 5's
    ``rope_parameters`` form. A smaller ``factor`` and original length let a short table reach
    past the original length (YaRN's interpolated range) at test sizes. A fresh dict per call."""
    return {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": float(factor),
        "original_max_position_embeddings": int(original_max_position_embeddings),
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


#: DeepSeek-V3's own RoPE settings (copy before changing: ``dict(DEEPSEEK_V3_YARN)``)
DEEPSEEK_V3_YARN = deepseek_yarn()


def hf_config(
    dims: LayerDims,
    *,
    max_position: int = 163840,
    rope: dict | None = None,
    interleave: bool = True,
) -> dict:
    """A DeepSeek-V3-style attention config as a plain mapping of Hugging Face keys.

    ``max_position``: ``max_position_embeddings`` (DeepSeek-V3's by default); ``rope``: the
    ``rope_parameters`` (default :data:`DEEPSEEK_V3_YARN`); ``interleave``: DeepSeek's
    interleaved RoPE pairs (False: NeoX halves). ``dims.q_lora`` None gives the ``q_proj``
    variant (DeepSeek-V2-Lite style)."""
    return {
        "hidden_size": dims.hidden,
        "num_attention_heads": dims.H,
        "num_key_value_heads": dims.H,
        "q_lora_rank": dims.q_lora,
        "kv_lora_rank": dims.L,
        "qk_nope_head_dim": dims.P,
        "qk_rope_head_dim": dims.R,
        "v_head_dim": dims.V,
        "max_position_embeddings": max_position,
        "rope_interleave": interleave,
        "rope_parameters": dict(rope if rope is not None else DEEPSEEK_V3_YARN),
    }
