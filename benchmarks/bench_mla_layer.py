"""Benchmark the MLA layer's decode step: fusemla.MLAAttention fused vs unfused (same layer,
MLAConfig(fused_decode=False)), at DeepSeek-V3 dims.

The decode step is ``MLAAttention.forward`` on B decode tokens (one per request, each with a
context of ``ctx`` tokens): projections, the prologue (fused: one Triton launch; unfused: the
four-step PyTorch reference), **paged latent attention in plain PyTorch** (both rows use the
same attention: a Triton paged decode-attention kernel is a later piece), W_UV and o_proj.
``op="mla_decode_step"`` rows time the whole layer; ``op="mla_decode_latent"`` rows time
``forward_latent`` (from the q_b_proj / kv_a outputs to the attention output before o_proj).

Method as bench_prologue.py: 8 layers (distinct weights and caches) in one CUDA graph, median
of replays / 8. Fused and unfused outputs are compared before anything is timed; a shape where
they disagree gets no rows and the run exits with status 1.

    python -m benchmarks.bench_mla_layer [--heads 16 128] [--batches 1 32 128]
        [--contexts 1024 4096] [--out results.json]
    python -m benchmarks.bench_mla_layer --smoke   # CPU: small layer, Triton interpreter
"""

from __future__ import annotations

import itertools

import torch

from benchmarks.common import ensure_interpreter, parser, run_header, timer, verdict, write_json
from fusemla.config import MLAConfig
from fusemla.layers.mla import MLAAttention
from fusemla.testing.dims import DEEPSEEK_V3_LAYER, SMALL_LAYER, hf_config
from fusemla.testing.models import random_state_dict
from fusemla.testing.scheduler import BlockAllocator, RequestStep, build_metadata

LAYERS = 8
SMOKE_LAYERS = 2
BLOCK_SIZE = 64


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--heads", type=int, nargs="+", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=None)
    a = ap.parse_args(argv)
    if a.smoke:
        ensure_interpreter()
    elif not torch.cuda.is_available():
        print("bench_mla_layer: needs a GPU (or --smoke, on the CPU under the Triton interpreter)")
        return 2
    a.heads = a.heads or ([2] if a.smoke else [16, 128])
    a.batches = a.batches or ([1, 3] if a.smoke else [1, 32, 128])
    a.contexts = a.contexts or ([70] if a.smoke else [1024, 4096])
    dev = "cpu" if a.smoke else "cuda"
    n_layers = SMOKE_LAYERS if a.smoke else LAYERS
    time_fn = timer(a.smoke)
    header = run_header(
        a.smoke,
        layers_per_graph=n_layers,
        attention="plain PyTorch paged latent attention "
        "(fusemla.reference.attention), the same in both rows",
        method="one eager pass (smoke: not a speed)"
        if a.smoke
        else "CUDA graph of 8 layers (distinct weights/caches), do_bench median / 8",
    )
    print(f"# {header['gpu']}  torch {header['torch']}  triton {header['triton']}")
    rows, failures = [], []
    fused_cfg, unfused_cfg = MLAConfig(True, True), MLAConfig(False, False)
    for H in a.heads:
        dims = (SMALL_LAYER if a.smoke else DEEPSEEK_V3_LAYER).replace(H=H)
        cfg = hf_config(dims)
        g = torch.Generator().manual_seed(H)
        layers = [
            MLAAttention.from_state_dict(
                random_state_dict(cfg, g, torch.bfloat16, dev), cfg, max_position=8192
            )
            for _ in range(n_layers)
        ]
        for B, ctx in itertools.product(a.batches, a.contexts):
            blocks = B * (ctx // BLOCK_SIZE + 2) + 4
            alloc = BlockAllocator(blocks, BLOCK_SIZE, seed=B + ctx)
            md, _ = build_metadata(
                [RequestStep(i, ctx - 1, 1) for i in range(B)], alloc, device=dev
            )
            steps = []
            for layer in layers:
                cache = (
                    (torch.randn(blocks, BLOCK_SIZE, dims.L + dims.R, generator=g) * 0.5)
                    .to(torch.bfloat16)
                    .to(dev)
                )
                x = torch.randn(B, dims.hidden, generator=g).to(torch.bfloat16).to(dev)
                with torch.no_grad():
                    q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x)))
                    q = q.view(B, H, dims.P + dims.R)
                    kv_a = layer.kv_a_proj_with_mqa(x)
                    kv_c = layer.kv_a_layernorm(kv_a[:, : dims.L])
                steps.append((layer, x, q, kv_c, kv_a[:, dims.L :], cache))
            # correctness first: fused vs unfused on the same input and cache
            layer, x, q, kv_c, k_pe, cache = steps[0]
            outs = []
            for c in (fused_cfg, unfused_cfg):
                layer.config = c
                with torch.no_grad():
                    outs.append(layer(x, md.positions, md, cache.clone()).float())
            rel = float((outs[0] - outs[1]).norm() / outs[1].norm())
            if not (rel < 2e-2 and bool(torch.isfinite(outs[0]).all())):
                failures.append(dict(H=H, B=B, ctx=ctx, rel=rel))
                print(f"!! H={H} B={B} ctx={ctx}: fused vs unfused rel {rel:.3g}: no rows")
                continue
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
                            us = time_fn([make(s) for s in steps], rep=100, warmup=10)
                    except Exception as e:  # noqa: BLE001 - report, keep the other rows
                        failures.append(dict(op=op, impl=impl, H=H, B=B, ctx=ctx, error=str(e)))
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
                            correct=True,
                            rel_fused_vs_unfused=round(rel, 5),
                        )
                    )
                    print(f"   {op:<18} H={H:<3} B={B:<4} ctx={ctx:<5} {impl:<8} {us:9.2f} us")
            del steps
            if not a.smoke:
                torch.cuda.empty_cache()
        del layers
        if not a.smoke:
            torch.cuda.empty_cache()
    print_table(rows)
    result = dict(header=header, rows=rows)
    if failures:
        result["failures"] = failures
    write_json(a.out, result)
    if a.out:
        print(f"wrote {a.out}")
    return verdict(rows, failures, a.smoke)


def print_table(rows: list) -> None:
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


if __name__ == "__main__":
    raise SystemExit(main())
