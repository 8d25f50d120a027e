"""Random DeepSeek MLA attention weights for the tests, the demo and the benchmarks.

:func:`random_state_dict` gives a checkpoint's ``self_attn.*`` tensors for a Hugging Face style
config (a mapping such as :func:`fusemla.testing.dims.hf_config` returns, or a config object),
what :meth:`fusemla.MLAAttention.from_state_dict` loads. (The tiny Hugging Face reference module
with its own random weights is :mod:`fusemla.testing.hf`.) The epilogue's W_UV: as vLLM holds it
(:func:`vllm_w_uv`), split out of a block-FP8 ``kv_b_proj`` as a checkpoint stores it
(:func:`block_fp8_w_uv`), with products exact in bf16 (:func:`exact_w_uv`), and in float64
(:func:`w_uv_f64`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fusemla.quant import QuantizedWeight, split_kv_b_proj_fp8

__all__ = ["block_fp8_w_uv", "exact_w_uv", "random_state_dict", "vllm_w_uv", "w_uv_f64"]


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


def vllm_w_uv(
    H: int, L: int, V: int, generator: torch.Generator, dtype=torch.bfloat16, device="cpu"
) -> torch.Tensor:
    """A random ``[H, L, V]`` W_UV (N(0, 1/L)) laid out as vLLM holds it: a transposed view of a
    contiguous ``[L, H, V]``."""
    w = torch.randn(L, H, V, generator=generator).div(math.sqrt(L))
    return w.to(device, dtype).transpose(0, 1)


def block_fp8_w_uv(
    H: int,
    P: int,
    L: int,
    V: int,
    block: tuple[int, int],
    generator: torch.Generator,
    device="cpu",
) -> QuantizedWeight:
    """W_UV split out of a random block-FP8 ``kv_b_proj`` ``[H * (P + V), L]`` as a DeepSeek-V3
    checkpoint stores it (``block = (bn, bk)``, :func:`fusemla.quant.split_kv_b_proj_fp8`): e4m3
    codes spread over most of the format (N(0, 96^2), clamped), ``weight_scale_inv`` uniform in
    ``[0.5, 1.5) / (96 sqrt L)``, so the dequantized weight is about N(0, 1/L)."""
    bn, bk = block
    rows = H * (P + V)
    codes = (torch.randn(rows, L, generator=generator) * 96).clamp(-448, 448)
    scale = torch.rand(-(-rows // bn), -(-L // bk), generator=generator).add(0.5)
    _, w_uv = split_kv_b_proj_fp8(
        codes.to(torch.float8_e4m3fn).to(device),
        (scale / (96 * math.sqrt(L))).to(device),
        num_heads=H,
        qk_nope_head_dim=P,
        v_head_dim=V,
        block_size=block,
    )
    return w_uv


def exact_w_uv(
    H: int, L: int, V: int, generator: torch.Generator, dtype=torch.bfloat16, device="cpu"
) -> torch.Tensor:
    """A ``[H, L, V]`` W_UV whose products are exact in fp32 and in bf16: each column v of each
    head picks one latent row (distinct within the head) times ``+-2**k``, ``k`` in -2..2, so
    ``o[n, h*V + v] = attn_out[n, h, row] * (+-2**k)`` in any summation order. Needs V <= L."""
    if V > L:
        raise ValueError(f"exact_w_uv needs V <= L (V = {V}, L = {L})")
    w = torch.zeros(H, L, V)
    for h in range(H):
        rows = torch.randperm(L, generator=generator)[:V]
        mult = torch.exp2(torch.randint(-2, 3, (V,), generator=generator).float())
        sign = torch.randint(0, 2, (V,), generator=generator).float() * 2 - 1
        w[h, rows, torch.arange(V)] = mult * sign
    return w.to(device, dtype)


def w_uv_f64(w: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """The real ``[H, L, V]`` weight in float64 (FP8: codes times their scales, exact in
    float64), computed from the tensors here, not with :meth:`QuantizedWeight.dequantize`."""
    if not isinstance(w, QuantizedWeight):
        return w.double()
    data, s = w.data.double(), w.scale.double()
    if w.block is not None:
        bk, bn = w.block
        _, K, N = w.shape
        rows = torch.arange(K, device=s.device) // bk
        cols = torch.arange(N, device=s.device) // bn
        return data * s[:, rows][:, :, cols]
    return data * (s.view(-1, 1, 1) if s.numel() > 1 else s)
