"""Where does the small-batch prologue's time go? Time the kernel with parts of its grid left out.

Same method as bench_prologue (8-layer CUDA graph, cold weights, PDL off). For each variant
(``prologue_sweep.STAGE_VARIANTS``):

- ``full``: the whole grid, checked against the reference on the captured graph first;
- ``bmm_only``: the BMM programs alone (RoPE and cache programs left out: NOT a correct
  prologue, timed only);
- ``aux_only``: the RoPE and cache programs alone (no BMM: timed only);
- ``weight_read``: bench_sections' weight-read floor at this weight size in bytes (each grid's
  partial sums checked, then timed).

Two more stages ran once at 82bdabc, whose kernel had two experimental flags since removed
(they changed nothing measurable, ``h200_stage_probe_82bdabc.json``): the RoPE and cache
programs dispatched first, and the weights loaded with ``cache_modifier=".cg"``.

Usage: ``python -m benchmarks.probes.stage_probe --out stages.json``. ``--smoke``: the CPU under
the Triton interpreter, small dims, one shape, three variants.
"""

from __future__ import annotations

import dataclasses
import os

import torch

import fusemla.ops.prologue.launch as launch_mod
from benchmarks.bench_core import Bench, empty_cache, fused_runner, prologue_check
from benchmarks.bench_sections import weight_read_floor
from benchmarks.common import (
    CheckFailed,
    ensure_interpreter,
    parser,
    run_header,
    verdict,
    write_json,
)
from benchmarks.prologue_sweep import STAGE_VARIANTS
from fusemla.ops.prologue import configs

STAGES = ("full", "bmm_only", "aux_only")


def staged_plan(real_plan, stage: str):
    """``launch.plan`` with the programs of ``stage`` only ("full": all of them)."""

    def plan(args, info=None, cfg=None):
        p = real_plan(args, info, cfg)
        if stage == "bmm_only":
            return dataclasses.replace(p, n_rope_d=0, n_rope_p=0, n_cache=0)
        if stage == "aux_only":
            return dataclasses.replace(p, n_bmm=0, bmm_items=0)
        return p

    return plan


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--shapes", nargs="+", default=None, help="HxB, e.g. 128x1")
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    ap.add_argument("--no-floor", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        ensure_interpreter()
    a.shapes = a.shapes or (["2x5"] if a.smoke else ["128x1", "16x1", "128x8"])
    variants = STAGE_VARIANTS
    if a.smoke:  # one per weight format, tiles cut to the small dims
        variants = [v for i, v in enumerate(STAGE_VARIANTS) if i in (0, 2, 4)]
    os.environ["FUSEMLA_PDL"] = "off"
    b = Bench.for_run(a.smoke, 8)
    b.num_blocks = 4  # as in the 82bdabc runs
    P, R, L = b.dims["P"], b.dims["R"], b.dims["L"]
    header = run_header(a.smoke)
    real_plan = launch_mod.plan
    recs, fails = [], []
    for shape in a.shapes:
        H, B = map(int, shape.split("x"))
        layers = b.inputs(B, H, torch.bfloat16, seed=8000 + H + B)
        for fmt, layout, bl, nw in variants:
            if a.smoke:
                bl, nw = min(bl, L // 2), 1
            base = configs.launch_config(
                H, P, R, L, b.backend, True, w_format="plain" if fmt == "bf16" else fmt
            )
            cfg = dict(base, BLOCK_L=bl, num_warps=nw, num_stages=1, programs_per_sm=0.0)
            for stage in a.stages:
                rec = dict(H=H, B=B, fmt=fmt, layout=layout, BLOCK_L=bl, num_warps=nw, stage=stage)
                launch_mod.plan = staged_plan(real_plan, stage)
                try:
                    outs = [
                        torch.empty(B, H, L + R, dtype=torch.bfloat16, device=b.device)
                        for _ in layers
                    ]
                    rs = [fused_runner(x, o, fmt, cfg, layout) for x, o in zip(layers, outs)]
                    check = prologue_check(layers[0], rs[0]) if stage == "full" else None
                    us = b.time([r.run for r in rs], rep=60, check=check)
                except CheckFailed as e:
                    fails.append(dict(rec, problems=e.problems))
                    print("!! FAILED", rec, e.problems[:2], flush=True)
                    continue
                finally:
                    launch_mod.plan = real_plan
                rec.update(us=round(us, 3), checked=stage == "full")
                if stage == "full":
                    rec["correct"] = True
                recs.append(rec)
                print(rec, flush=True)
        # the weight-read floor at the FP8 weight's bytes (bf16 elements, half as many)
        for wbytes, name in () if a.no_floor else ((1, "fp8"), (2, "bf16")):
            ws = [
                torch.randn(H, P, L * wbytes // 2, device=b.device).to(torch.bfloat16)
                for _ in range(b.layers)
            ]
            rec = dict(H=H, B=B, fmt=name, stage="weight_read_floor", bytes=H * P * L * wbytes)
            best = weight_read_floor(b, ws, dict(rec))
            if best is not None:
                recs.append(dict(rec, us=round(best[0], 3), checked=True, correct=True))
                print(recs[-1], flush=True)
        del layers
        empty_cache(b)
        write_json(a.out, dict(header=header, records=recs, failures=fails + b.failures))
    print_table(recs, a.stages)
    return verdict([r for r in recs if r.get("checked")], fails + b.failures, a.smoke, "records")


def print_table(recs: list, stages) -> None:
    print(
        f"\n{'H':>4} {'B':>3} {'fmt':<8} lay {'BL':>4} "
        + " ".join(s[:6] for s in stages)
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
            + " ".join(f"{got.get(s, float('nan')):5.2f}" for s in (*stages, "weight_read_floor"))
        )


if __name__ == "__main__":
    raise SystemExit(main())
