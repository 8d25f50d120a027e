"""Random DeepSeek MLA attention weights for the tests, the demo and the benchmarks.

:func:`random_state_dict` gives a checkpoint's ``self_attn.*`` tensors for a Hugging Face style
config (a mapping such as :func:`fusemla.testing.dims.hf_config` returns, or a config object),
what :meth:`fusemla.MLAAttention.from_state_dict` loads. (The tiny Hugging Face reference module
with its own random weights is :mod:`fusemla.testing.hf`.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["random_state_dict"]


def _get(cfg: Any, key: str) -> Any:
    return cfg.get(key) if isinstance(cfg, Mapping) else getattr(cfg, key, None)


def random_state_dict(
    cfg: Any,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Random ``self_attn.*`` tensors (keys without the prefix) of the attention ``cfg``.

    Each linear weight ``[out, in]`` is N(0, 1/in), so activations stay O(1); RMSNorm weights
    are ``1 + N(0, 0.1^2)`` (not all ones: a layer that skips a norm weight fails). A
    ``q_lora_rank`` of None gives ``q_proj.weight`` instead of the ``q_a`` / ``q_b`` pair. Drawn
    in fp32 on the CPU from ``generator`` (deterministic in its seed), then cast to ``dtype``
    and moved to ``device``.
    """
    H, hid = _get(cfg, "num_attention_heads"), _get(cfg, "hidden_size")
    P, R, V = _get(cfg, "qk_nope_head_dim"), _get(cfg, "qk_rope_head_dim"), _get(cfg, "v_head_dim")
    L, q_lora = _get(cfg, "kv_lora_rank"), _get(cfg, "q_lora_rank")

    def w(n_out: int, n_in: int) -> torch.Tensor:
        return torch.randn(n_out, n_in, generator=generator) * n_in**-0.5

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=generator)

    sd = {
        "kv_a_proj_with_mqa.weight": w(L + R, hid),
        "kv_a_layernorm.weight": norm(L),
        "kv_b_proj.weight": w(H * (P + V), L),
        "o_proj.weight": w(hid, H * V),
    }
    if q_lora:
        sd["q_a_proj.weight"] = w(q_lora, hid)
        sd["q_a_layernorm.weight"] = norm(q_lora)
        sd["q_b_proj.weight"] = w(H * (P + R), q_lora)
    else:
        sd["q_proj.weight"] = w(H * (P + R), hid)
    return {k: v.to(dtype).to(device) for k, v in sd.items()}
