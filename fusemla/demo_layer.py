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

from fusemla.testing.dims import DEEPSEEK_V3_LAYER, SMALL_LAYER, TP8_LAYER, hf_config
from fusemla.testing.models import random_state_dict

#: the demo's old name of :func:`fusemla.testing.models.random_state_dict`
random_weights = random_state_dict


def deepseek_v3_config(num_heads: int = 128) -> dict:
    """DeepSeek-V3's attention config with ``num_heads`` heads (16: one tensor-parallel-8 shard)."""
    return hf_config(DEEPSEEK_V3_LAYER.replace(H=num_heads))


def layer_config(device: str) -> dict:
    """A DeepSeek-V3-style attention config: small under the interpreter, V3 dims (16 heads,
    one tensor-parallel-8 shard) on a GPU."""
    return hf_config(TP8_LAYER if device == "cuda" else SMALL_LAYER)


#: (request id, new tokens) per step: step 0 prefills three prompts; later steps mix decodes
#: with a fourth request's chunked prefill
SCHEDULE = [
    [("a", 7), ("b", 19), ("c", 4)],
    [("a", 1), ("b", 1), ("c", 1), ("d", 12)],
    [("a", 1), ("c", 1), ("d", 9), ("b", 1)],
    [("a", 1), ("b", 1), ("c", 1), ("d", 1)],
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
    from fusemla.testing import BlockAllocator, Scheduler, poisoned_cache

    res = LayerDemoResult()
    cfg = layer_config(device)
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16
    layer = MLAAttention.from_state_dict(
        random_state_dict(cfg, g, dtype, device), cfg, max_position=4096
    )
    L, R = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    block_size = 16
    scheduler = Scheduler(BlockAllocator(32, block_size, seed=seed), device=device)
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
        md, _ = scheduler.step(step)
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
