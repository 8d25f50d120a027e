"""Benchmark the MLA layer's decode step: fusemla.MLAAttention fused vs unfused (same layer,
MLAConfig(fused_decode=False)), at DeepSeek-V3 dims.

The decode step is ``MLAAttention.forward`` on B decode tokens (one per request, each with a
context of ``ctx`` tokens): projections, the prologue (fused: one Triton launch; unfused: the
four-step PyTorch reference), **paged latent attention in plain PyTorch** (both rows use the
same attention: a Triton paged decode-attention kernel is a later piece), W_UV and o_proj.
``op="mla_decode_step"`` rows time the whole layer; ``op="mla_decode_latent"`` rows time
``forward_latent`` (from the q_b_proj / kv_a outputs to the attention output before o_proj).

Method as bench_prologue.py: 8 layers (distinct weights and caches) in one CUDA graph, median
of replays / 8. Fused and unfused outputs are compared before anything is timed.

    python benchmarks/bench_mla_layer.py [--heads 16 128] [--batches 1 32 128]
        [--contexts 1024 4096] [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import commit_id, time_graph  # noqa: E402

from fusemla.config import MLAConfig  # noqa: E402
from fusemla.demo_layer import deepseek_v3_config, random_weights  # noqa: E402
from fusemla.layers.mla import MLAAttention  # noqa: E402
from fusemla.metadata import BlockAllocator, RequestStep, build_metadata  # noqa: E402

LAYERS = 8
BLOCK_SIZE = 64


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_mla_layer: needs a GPU")
        return 2
    commit = commit_id()
    header = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        commit=commit,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        layers_per_graph=LAYERS,
        attention="plain PyTorch paged latent attention "
        "(fusemla.reference.attention), the same in both rows",
        method="CUDA graph of 8 layers (distinct weights/caches), do_bench median / 8",
    )
    print(f"# {header['gpu']}  torch {header['torch']}  triton {header['triton']}")
    rows, failures = [], []
    fused_cfg, unfused_cfg = MLAConfig(True, True), MLAConfig(False, False)
    for H in a.heads:
        cfg = deepseek_v3_config(H)
        g = torch.Generator().manual_seed(H)
        layers = [
            MLAAttention.from_state_dict(
                random_weights(cfg, g, torch.bfloat16, "cuda"), cfg, max_position=8192
            )
            for _ in range(LAYERS)
        ]
        for B, ctx in itertools.product(a.batches, a.contexts):
            blocks = B * (ctx // BLOCK_SIZE + 2) + 4
            alloc = BlockAllocator(blocks, BLOCK_SIZE, seed=B + ctx)
            md, _ = build_metadata(
                [RequestStep(i, ctx - 1, 1) for i in range(B)], alloc, device="cuda"
            )
            steps = []
            for layer in layers:
                cache = (
                    (torch.randn(blocks, BLOCK_SIZE, 576, generator=g) * 0.5)
                    .to(torch.bfloat16)
                    .cuda()
                )
                x = (torch.randn(B, cfg["hidden_size"], generator=g)).to(torch.bfloat16).cuda()
                with torch.no_grad():
                    q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x))).view(B, H, 192)
                    kv_a = layer.kv_a_proj_with_mqa(x)
                    kv_c = layer.kv_a_layernorm(kv_a[:, :512])
                steps.append((layer, x, q, kv_c, kv_a[:, 512:], cache))
            # correctness first: fused vs unfused on the same input and cache
            layer, x, q, kv_c, k_pe, cache = steps[0]
            outs = []
            for c in (fused_cfg, unfused_cfg):
                layer.config = c
                outs.append(layer(x, md.positions, md, cache.clone()).float())
            rel = float((outs[0] - outs[1]).norm() / outs[1].norm())
            ok = rel < 2e-2 and bool(torch.isfinite(outs[0]).all())
            if not ok:
                failures.append(dict(H=H, B=B, ctx=ctx, rel=rel))
                print(f"!! H={H} B={B} ctx={ctx}: fused vs unfused rel {rel:.3g}")
            for impl, c in (("fused", fused_cfg), ("unfused", unfused_cfg)):
                for op in ("mla_decode_step", "mla_decode_latent"):

                    def make(s, c=c, op=op):
                        layer, x, q, kv_c, k_pe, cache = s

                        def run():
                            layer.config = c
                            if op == "mla_decode_step":
                                layer(x, md.positions, md, cache)
                            else:
                                layer.forward_latent(q, kv_c, k_pe, md.positions, md, cache)

                        return run

                    try:
                        with torch.no_grad():
                            us = time_graph([make(s) for s in steps], rep=100, warmup=10)
                    except Exception as e:  # report, keep the other rows
                        print(f"!! {op} {impl} H={H} B={B} ctx={ctx}: {type(e).__name__}: {e}")
                        continue
                    rows.append(
                        dict(
                            op=op,
                            impl=impl,
                            attention="pytorch",
                            w_dtype="bf16",
                            kv_dtype="bf16",
                            H=H,
                            B=B,
                            context=ctx,
                            us=round(us, 2),
                            correct=ok,
                            rel_fused_vs_unfused=round(rel, 5),
                        )
                    )
                    print(f"   {op:<18} H={H:<3} B={B:<4} ctx={ctx:<5} {impl:<8} {us:9.2f} us")
            del steps
            torch.cuda.empty_cache()
        del layers
        torch.cuda.empty_cache()

    print(f"\n{'op':<18} {'H':>4} {'B':>4} {'ctx':>5} | {'fused':>9} {'unfused':>9} {'saved':>8}")
    for r in rows:
        if r["impl"] != "fused":
            continue
        u = [
            x
            for x in rows
            if x["impl"] == "unfused" and all(x[k] == r[k] for k in ("op", "H", "B", "context"))
        ]
        if u:
            print(
                f"{r['op']:<18} {r['H']:>4} {r['B']:>4} {r['context']:>5} | {r['us']:9.2f} "
                f"{u[0]['us']:9.2f} {u[0]['us'] - r['us']:8.2f}"
            )
    result = dict(header=header, rows=rows)
    if failures:
        result["failures"] = failures
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {a.out}")
    print(
        "correctness:",
        "fused and unfused agree at every shape"
        if not failures
        else f"{len(failures)} shapes FAILED",
    )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
