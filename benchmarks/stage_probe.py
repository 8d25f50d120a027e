"""Where does the small-batch prologue's time go? Time the kernel with parts of its grid left out.

Same method as bench_prologue (8-layer CUDA graph, cold weights, PDL off). For each variant:

- ``full``: the whole grid, checked against the reference on the captured graph first;
- ``bmm_only``: the BMM programs alone (RoPE and cache programs left out: NOT a correct
  prologue, timed only);
- ``aux_only``: the RoPE and cache programs alone (no BMM: timed only);
- ``weight_read``: bench_sections' weight-read floor at this weight size in bytes (timed only).

Two more stages ran once at 82bdabc, whose kernel had two experimental flags since removed
(they changed nothing measurable, ``h200_stage_probe_82bdabc.json``): the RoPE and cache
programs dispatched first, and the weights loaded with ``cache_modifier=".cg"``.

Usage: ``python benchmarks/stage_probe.py --out stages.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from bench_core import Bench, prologue_check  # noqa: E402
from common import commit_id  # noqa: E402
from layout_probe import runner  # noqa: E402
from peers import weight_read, weight_read_programs  # noqa: E402

import fusemla.ops.prologue.launch as launch_mod  # noqa: E402
from fusemla.ops.prologue import configs  # noqa: E402
from fusemla.testing.inputs import DEEPSEEK_V3  # noqa: E402

VARIANTS = (  # fmt, layout, BLOCK_L, num_warps
    ("bf16", "l", 64, 4),
    ("bf16", "k", 64, 4),
    ("fp8", "k", 128, 4),
    ("fp8", "l", 64, 4),
    ("fp8xfp8", "k", 256, 4),
    ("fp8xfp8", "k", 128, 4),
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["128x1", "16x1", "128x8"])
    ap.add_argument("--stages", nargs="+", default=["full", "bmm_only", "aux_only"])
    ap.add_argument("--no-floor", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    os.environ["FUSEMLA_PDL"] = "off"
    dims = {k: DEEPSEEK_V3[k] for k in ("P", "R", "L")}
    P, R, L = dims["P"], dims["R"], dims["L"]
    b = Bench(smoke=False, device="cuda", dims=dims, layers=8, num_blocks=4, out_path=None)
    real_plan = launch_mod.plan
    recs = []
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in a.shapes:
        H, B = map(int, shape.split("x"))
        layers = b.inputs(B, H, torch.bfloat16, seed=8000 + H + B)
        for fmt, layout, bl, nw in VARIANTS:
            base = configs.launch_config(
                H, P, R, L, "cuda", True, w_format="plain" if fmt == "bf16" else fmt
            )
            cfg = dict(base, BLOCK_L=bl, num_warps=nw, num_stages=1, programs_per_sm=0.0)
            for stage in a.stages:
                c = cfg

                def plan(args, info=None, cfg=None, stage=stage):
                    p = real_plan(args, info, cfg)
                    if stage == "bmm_only":
                        return dataclasses.replace(p, n_rope_d=0, n_rope_p=0, n_cache=0)
                    if stage == "aux_only":
                        return dataclasses.replace(p, n_bmm=0, bmm_items=0)
                    return p

                launch_mod.plan = plan
                try:
                    outs = [
                        torch.empty(B, H, L + R, dtype=torch.bfloat16, device="cuda")
                        for _ in layers
                    ]
                    rs = [runner(x, o, fmt, layout, c) for x, o in zip(layers, outs)]
                    check = prologue_check(layers[0], rs[0]) if stage.startswith("full") else None
                    us = b.time([r.run for r in rs], rep=60, check=check)
                finally:
                    launch_mod.plan = real_plan
                rec = dict(
                    H=H,
                    B=B,
                    fmt=fmt,
                    layout=layout,
                    BLOCK_L=bl,
                    num_warps=nw,
                    stage=stage,
                    us=round(us, 3),
                    checked=stage.startswith("full"),
                )
                recs.append(rec)
                print(rec, flush=True)
        # the weight-read floor at the FP8 weight's bytes (bf16 elements, half as many)
        for wbytes, name in () if a.no_floor else ((1, "fp8"), (2, "bf16")):
            ws = [
                torch.randn(H, P, L * wbytes // 2, device="cuda").to(torch.bfloat16)
                for _ in range(8)
            ]
            best = None
            for pps, block in ((2, 1024), (4, 2048), (8, 1024), (16, 512)):
                grid, _ = weight_read_programs(ws[0].numel(), pps * num_sms, block)
                parts = [torch.empty(grid, dtype=torch.float32, device="cuda") for _ in ws]
                us = b.time(
                    [
                        lambda w=w, p=p, n=pps * num_sms, blk=block: weight_read(w, p, n, blk)
                        for w, p in zip(ws, parts)
                    ],
                    rep=60,
                )
                best = us if best is None else min(best, us)
            rec = dict(
                H=H,
                B=B,
                fmt=name,
                stage="weight_read_floor",
                us=round(best, 3),
                bytes=H * P * L * wbytes,
            )
            recs.append(rec)
            print(rec, flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(
                    dict(
                        header=dict(
                            commit=commit_id(),
                            gpu=torch.cuda.get_device_name(),
                            torch=torch.__version__,
                        ),
                        records=recs,
                    ),
                    f,
                    indent=1,
                )
    print(
        f"\n{'H':>4} {'B':>3} {'fmt':<8} lay {'BL':>4} "
        + " ".join(s[:6] for s in a.stages)
        + " floor"
    )
    keys = sorted(
        {(r["H"], r["B"], r["fmt"], r.get("layout", "-"), r.get("BLOCK_L", 0)) for r in recs}
    )
    for k in keys:
        got = {
            r["stage"]: r["us"]
            for r in recs
            if (r["H"], r["B"], r["fmt"], r.get("layout", "-"), r.get("BLOCK_L", 0)) == k
        }
        print(
            f"{k[0]:>4} {k[1]:>3} {k[2]:<8} {k[3]:<3} {k[4]:>4} "
            + " ".join(f"{got.get(s, float('nan')):5.2f}" for s in (*a.stages, "weight_read_floor"))
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
