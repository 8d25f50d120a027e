"""Launch each prologue variant once, for Nsight Compute: ``ncu --profile-from-start off``.

Every variant is launched (and compiled) once before ``cudaProfilerStart``, then once more inside
the profiled range, in the order printed, so ncu's kernels map to the variants by position.
Single layer, weights made cold by a 256 MiB write between launches. Each variant's first
launch is checked against the reference (q and every cache byte, after NaN-poisoning) before
the profiled range; a wrong one fails the run.

Usage on the GPU machine::

    ncu --clock-control none --profile-from-start off --csv --metrics <list> \\
        python -m benchmarks.probes.ncu_prologue --heads 128 --batch 1

``--smoke``: the CPU under the Triton interpreter, small dims: every variant launched and
checked; the profiled range (a CUDA GPU under ncu) is skipped, and says so.
"""

from __future__ import annotations

import itertools
import os

import torch

from benchmarks.bench_core import (
    BLOCK_SIZE,
    SMOKE_HEADS,
    Bench,
    aiter_peers,
    fused_runner,
    prologue_check,
)
from benchmarks.common import ensure_interpreter, parser, verdict
from benchmarks.prologue_sweep import LAYOUTS, PROBE_FORMATS
from fusemla.ops.prologue import configs

#: AITER's config in the profiled range (the best small-batch one of the 0e54a86 sweep)
AITER_CONFIG = dict(
    BLOCK_SIZE_M=16,
    BLOCK_SIZE_N=64,
    BLOCK_SIZE_K=128,
    GROUP_SIZE_M=1,
    num_warps=4,
    num_stages=1,
    cache_modifier=".cg",
)


def main(argv=None) -> int:
    ap = parser(__doc__, out=False)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args(argv)
    if a.smoke:
        ensure_interpreter()
    os.environ["FUSEMLA_PDL"] = "off"
    H, B = a.heads or (SMOKE_HEADS[0] if a.smoke else 128), a.batch
    b = Bench.for_run(a.smoke, B, layers=1)
    b.num_blocks = 2 * B // BLOCK_SIZE + 2
    P, R, L = b.dims["P"], b.dims["R"], b.dims["L"]
    x = b.inputs(B, H, torch.bfloat16, seed=11)[0]
    calls, rows, fails = [], [], []
    for fmt, layout in itertools.product(PROBE_FORMATS, LAYOUTS):
        _, cfg = configs.tiles(H, P, R, L, B, b.backend, "plain" if fmt == "bf16" else fmt)
        out = torch.empty(B, H, L + R, dtype=torch.bfloat16, device=b.device)
        r = fused_runner(x, out, fmt, cfg, layout)
        name = f"fused {fmt}/{layout}"
        problems = list(prologue_check(x, r)(r.run))
        if problems:
            fails.append(dict(variant=name, problems=problems))
            print(f"!! FAILED {name}: {'; '.join(problems)[:300]}", flush=True)
        else:
            rows.append(dict(variant=name, correct=True))
        calls.append((name, r.run))
    if not a.smoke:
        from benchmarks import aiter_peer as ap

        if ap.available() is None:
            for layout in ("k", "l"):
                p = aiter_peers([x], AITER_CONFIG, "aiter" if layout == "k" else "ours")[0]
                calls.append((f"aiter fp8xfp8/{layout}", p))
    print(f"checked before the profiled range: {[r['variant'] for r in rows]}")
    if a.smoke:
        print("profiled range skipped: it needs a CUDA GPU under Nsight Compute (ncu)")
    else:
        flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        for _, fn in calls:
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for i, (_name, fn) in enumerate(calls):
            flush.fill_(i)
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print("order (fill kernels between):", [n for n, _ in calls])
    return verdict(rows, fails, a.smoke, "variants")


if __name__ == "__main__":
    raise SystemExit(main())
