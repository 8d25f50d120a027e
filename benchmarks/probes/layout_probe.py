"""Does the weight's memory layout decide the small-batch gap to AITER? One H200 run.

fusemla's kernel read ``W_UK_T`` ``[H, P, L]`` L-contiguous (stride 1 along the output dim);
AITER's benchmark rows read it K-contiguous (``[H, L, P]`` storage, a transposed view): every
output column is one 128-byte run of FP8 codes, the layout the tensor cores take an FP8 B
operand in. This probe times both layouts for both kernels on the same inputs, with
bench_prologue's method (8-layer CUDA graph, cold weights, PDL off, every config checked against
the reference on the captured graph before it is timed):

- fusemla: weight formats bf16, fp8 (bf16 activations), fp8xfp8 (``act_quant="fp8"``) in the
  "l" (L-contiguous) and "k" (K-major) layouts, over a small tile grid per batch bucket
  (``prologue_sweep.probe_grid``);
- AITER (``aiter_peer``; its source carried in ``.peers/``): the configs that won the 0e54a86
  sweep, in its own ("k") and our ("l") layout.

Usage: ``python -m benchmarks.probes.layout_probe --out probe.json [--heads 16 128] [--batches 1
8 64 512]``. Prints a table of the best time per (H, B, impl, layout) at the end. ``--smoke``:
the CPU under the Triton interpreter, small dims, two configs per format and layout, no AITER.
"""

from __future__ import annotations

import itertools
import os
import time

import torch

from benchmarks.bench_core import (
    SMOKE_BATCHES,
    SMOKE_HEADS,
    Bench,
    CheckFailed,
    aiter_check,
    aiter_peers,
    empty_cache,
    fused_runner,
    prologue_check,
)
from benchmarks.common import ensure_interpreter, parser, run_header, verdict, write_json
from benchmarks.prologue_sweep import LAYOUTS, PROBE_FORMATS, probe_grid, smoke_subset
from fusemla.ops.prologue import configs

#: the config keys a record shows
SHOWN = ("BLOCK_L", "BLOCK_T", "num_warps", "num_stages", "programs_per_sm")


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--heads", type=int, nargs="+", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--formats", nargs="+", default=list(PROBE_FORMATS))
    ap.add_argument("--no-aiter", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        ensure_interpreter()
    a.heads = a.heads or (SMOKE_HEADS if a.smoke else [16, 128])
    a.batches = a.batches or (SMOKE_BATCHES[-1:] if a.smoke else [1, 8, 64, 512])
    os.environ["FUSEMLA_PDL"] = "off"
    b = Bench.for_run(a.smoke, max(a.batches))
    P, R, L = b.dims["P"], b.dims["R"], b.dims["L"]
    header = run_header(
        a.smoke,
        method="bench_prologue's: 8-layer CUDA graph, PDL off, "
        "checked on the captured graph before timing, do_bench median / 8",
    )
    recs, fails = [], []
    t0 = time.perf_counter()
    # batch outer: the small-batch rows (the question) first, should the run be cut short
    for B, H in itertools.product(a.batches, sorted(a.heads, reverse=True)):
        layers = b.inputs(B, H, torch.bfloat16, seed=7000 + H + B)
        bucket = configs.batch_bucket(B)
        # fp8xfp8 above the small bucket: known slow (0e54a86), not the question here
        fmts = [f for f in a.formats if bucket == "small" or f != "fp8xfp8"]
        grid = smoke_subset(probe_grid(B), b.dims, n=1) if a.smoke else probe_grid(B)
        for fmt, layout in itertools.product(fmts, LAYOUTS):
            _, base = configs.tiles(H, P, R, L, B, b.backend, "plain" if fmt == "bf16" else fmt)
            for i, o in enumerate([{}] + grid):
                cfg = {**base, **o}
                key = dict(
                    H=H,
                    B=B,
                    impl="fused",
                    fmt=fmt,
                    layout=layout,
                    shipped=i == 0,
                    config={k: cfg[k] for k in SHOWN},
                )
                try:
                    outs = [
                        torch.empty(B, H, L + R, dtype=torch.bfloat16, device=b.device)
                        for _ in layers
                    ]
                    rs = [fused_runner(x, o_, fmt, cfg, layout) for x, o_ in zip(layers, outs)]
                    us = b.time([r.run for r in rs], rep=40, check=prologue_check(layers[0], rs[0]))
                except CheckFailed as e:
                    fails.append(dict(key, problems=e.problems))
                    print("!! FAILED", key, e.problems[:2], flush=True)
                    continue
                except Exception as e:  # noqa: BLE001
                    fails.append(dict(key, error=f"{type(e).__name__}: {str(e)[:200]}"))
                    print("!! ERROR", key, str(e)[:200], flush=True)
                    if "CUDA error" in str(e):
                        raise
                    continue
                recs.append(dict(key, us=round(us, 3), correct=True))
                print(f"H={H} B={B} {fmt}/{layout} {key['config']}: {us:.2f}", flush=True)
        if not a.no_aiter and not a.smoke and B <= 64:
            aiter(b, layers, H, B, recs, fails)
        del layers
        empty_cache(b)
        write_json(a.out, dict(header=header, records=recs, failures=fails))
    header["wall_s"] = round(time.perf_counter() - t0, 1)
    write_json(a.out, dict(header=header, records=recs, failures=fails))
    print_best(recs)
    print(f"{len(recs)} timed, {len(fails)} failed")
    return verdict(recs, fails, a.smoke, "configs")


def print_best(recs: list) -> None:
    """The best time per (H, B, impl, fmt, layout) and the shipped config's beside it."""
    best: dict = {}
    for r in recs:
        k = (r["H"], r["B"], r["impl"], r["fmt"], r["layout"])
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
    print(
        f"\n{'H':>4} {'B':>4} {'impl':<6} {'fmt':<8} {'lay':<3} {'best us':>8} "
        f"{'shipped':>8}  best config"
    )
    for k in sorted(best):
        shipped = [
            r["us"]
            for r in recs
            if r.get("shipped") and (r["H"], r["B"], r["impl"], r["fmt"], r["layout"]) == k
        ]
        print(
            f"{k[0]:>4} {k[1]:>4} {k[2]:<6} {k[3]:<8} {k[4]:<3} {best[k]['us']:>8.2f} "
            f"{(shipped[0] if shipped else float('nan')):>8.2f}  {best[k]['config']}"
        )


def aiter(b: Bench, layers, H: int, B: int, recs: list, fails: list) -> None:
    from benchmarks import aiter_peer as ap

    why = ap.available()
    if why is not None:
        print("aiter unavailable:", why)
        return
    for cfg, layout in itertools.product(ap.quick_configs(), ("k", "l")):
        key = dict(H=H, B=B, impl="aiter", fmt="fp8xfp8", layout=layout, shipped=False, config=cfg)
        try:
            peers = aiter_peers(layers, cfg, "aiter" if layout == "k" else "ours")
            us = b.time(peers, check=aiter_check(peers[0], layers[0]), rep=40)
        except CheckFailed as e:
            fails.append(dict(key, problems=e.problems))
            continue
        except Exception as e:  # noqa: BLE001
            fails.append(dict(key, error=f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        recs.append(dict(key, us=round(us, 3), correct=True))
        print(
            f"H={H} B={B} aiter/{layout} {cfg['BLOCK_SIZE_N']},{cfg['num_stages']}: {us:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    raise SystemExit(main())
