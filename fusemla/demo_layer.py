"""The demo's second part: a few engine steps of :class:`fusemla.MLAAttention`, fused vs unfused.

Random DeepSeek-style weights (small dims under the interpreter, DeepSeek-V3 attention dims with
16 heads on a GPU), three requests prefilled in a shuffled paged cache, then mixed steps in which
some requests decode while another prefills. Each step runs the same layer twice on copies of
the cache: fused (one prologue launch per step) and unfused (``MLAConfig(False, False)``: the
reference prologue); outputs and caches are compared. Used by ``python -m fusemla demo``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

_YARN = dict(
    type="yarn",
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)


def deepseek_v3_config(num_heads: int = 128) -> dict:
    """DeepSeek-V3's attention config with ``num_heads`` heads (16: one tensor-parallel-8 shard)."""
    return dict(
        hidden_size=7168,
        num_attention_heads=num_heads,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_interleave=True,
        rope_scaling=dict(_YARN),
    )


def layer_config(device: str) -> dict:
    """A DeepSeek-V3-style attention config: small under the interpreter, V3 dims (16 heads,
    one tensor-parallel-8 shard) on a GPU."""
    if device == "cuda":
        return deepseek_v3_config(16)
    return dict(
        hidden_size=64,
        num_attention_heads=4,
        q_lora_rank=48,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_interleave=True,
        rope_scaling=dict(_YARN),
    )


def random_weights(cfg: dict, g, dtype, device) -> dict:
    import torch

    H, hid = cfg["num_attention_heads"], cfg["hidden_size"]
    P, R, V = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    L, QL = cfg["kv_lora_rank"], cfg["q_lora_rank"]

    def w(n_out, n_in):
        return (torch.randn(n_out, n_in, generator=g) * n_in**-0.5).to(dtype).to(device)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(device)

    return {
        "q_a_proj.weight": w(QL, hid),
        "q_a_layernorm.weight": norm(QL),
        "q_b_proj.weight": w(H * (P + R), QL),
        "kv_a_proj_with_mqa.weight": w(L + R, hid),
        "kv_a_layernorm.weight": norm(L),
        "kv_b_proj.weight": w(H * (P + V), L),
        "o_proj.weight": w(hid, H * V),
    }


#: (request id, context tokens, new tokens) per step: step 0 prefills three prompts; later
#: steps mix decodes with a fourth request's chunked prefill
SCHEDULE = [
    [("a", 0, 7), ("b", 0, 19), ("c", 0, 4)],
    [("a", 7, 1), ("b", 19, 1), ("c", 4, 1), ("d", 0, 12)],
    [("a", 8, 1), ("c", 5, 1), ("d", 12, 9), ("b", 20, 1)],
    [("a", 9, 1), ("b", 21, 1), ("c", 6, 1), ("d", 21, 1)],
]


@dataclass
class LayerDemoResult:
    lines: list = field(default_factory=list)
    problems: list = field(default_factory=list)


def run(device: str, seed: int, kv_fp8: bool) -> LayerDemoResult:
    """Run :data:`SCHEDULE` fused and unfused; report per-step agreement and wall time."""
    import torch

    from fusemla.config import MLAConfig
    from fusemla.layers.mla import MLAAttention
    from fusemla.metadata import BlockAllocator, RequestStep, build_metadata
    from fusemla.testing import poisoned_cache

    res = LayerDemoResult()
    cfg = layer_config(device)
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16
    layer = MLAAttention.from_state_dict(
        random_weights(cfg, g, dtype, device), cfg, max_position=4096
    )
    L, R = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    block_size = 16
    alloc = BlockAllocator(32, block_size, seed=seed)
    kv_dtype = torch.float8_e4m3fn if kv_fp8 else dtype
    kv_scale = 0.05 if kv_fp8 else None
    caches = {c: poisoned_cache(32, block_size, L + R, kv_dtype, device) for c in ("f", "u")}
    flags = {
        "f": MLAConfig(fused_decode=True, fused_prefill=True),
        "u": MLAConfig(fused_decode=False, fused_prefill=False),
    }
    kv_name = "fp8e4m3" if kv_fp8 else "bf16"
    show_progress = sys.stdout.isatty()
    for i, step in enumerate(SCHEDULE):
        if show_progress:
            print(f"  layer step {i + 1}/{len(SCHEDULE)} ...", end="\r", flush=True)
        md, order = build_metadata([RequestStep(r, c, n) for r, c, n in step], alloc, device=device)
        x = torch.randn(md.num_tokens, cfg["hidden_size"], generator=g).to(dtype).to(device)
        out, wall = {}, {}
        for c in ("f", "u"):
            layer.config = flags[c]
            t0 = time.perf_counter()
            out[c] = layer(x, md.positions, md, caches[c], kv_scale).float()
            if device == "cuda":
                torch.cuda.synchronize()
            wall[c] = time.perf_counter() - t0
        rel = float((out["f"] - out["u"]).norm() / out["u"].norm().clamp_min(1e-30))
        a, b = caches["f"].view(torch.uint8), caches["u"].view(torch.uint8)
        diff_bytes = int((a != b).sum())
        ok = rel < 2e-2 and bool(torch.isfinite(out["f"]).all())
        # the two caches may differ only where the kernel's RoPE rounds differently (<= 1 code)
        close = diff_bytes <= max(1, a.numel() // 1000)
        D, N = md.num_decode_tokens, md.num_tokens
        res.lines.append(
            f"  step {i}: {D} decode + {N - D} prefill tokens, {kv_name} cache: "
            f"out relL2 fused vs unfused {rel:.1e}, cache bytes differing "
            f"{diff_bytes}, wall {wall['f'] * 1e3:.1f} / {wall['u'] * 1e3:.1f} ms  "
            + ("OK" if ok and close else "DISAGREE")
        )
        if not (ok and close):
            res.problems.append(
                f"layer step {i} ({kv_name}): rel {rel:.3g}, {diff_bytes} cache bytes differ"
            )
    if show_progress:
        print(" " * 40, end="\r")
    return res
