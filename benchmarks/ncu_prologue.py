"""Launch each prologue variant once, for Nsight Compute: ``ncu --profile-from-start off``.

Every variant is launched (and compiled) once before ``cudaProfilerStart``, then once more inside
the profiled range, in the order printed, so ncu's kernels map to the variants by position.
Single layer, weights made cold by a 256 MiB write between launches.

Usage on the GPU machine::

    ncu --clock-control none --profile-from-start off --csv --metrics <list> \\
        python benchmarks/ncu_prologue.py --heads 128 --batch 1
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from bench_core import BLOCK_SIZE, Bench, aiter_peers  # noqa: E402
from layout_probe import runner  # noqa: E402

from fusemla.ops.prologue import configs  # noqa: E402
from fusemla.testing.inputs import DEEPSEEK_V3  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    os.environ["FUSEMLA_PDL"] = "off"
    H, B = a.heads, a.batch
    dims = {k: DEEPSEEK_V3[k] for k in ("P", "R", "L")}
    P, R, L = dims["P"], dims["R"], dims["L"]
    b = Bench(
        smoke=False,
        device="cuda",
        dims=dims,
        layers=1,
        num_blocks=2 * B // BLOCK_SIZE + 2,
        out_path=None,
    )
    x = b.inputs(B, H, torch.bfloat16, seed=11)[0]
    calls = []
    for fmt, layout in (
        ("bf16", "l"),
        ("bf16", "k"),
        ("fp8", "l"),
        ("fp8", "k"),
        ("fp8xfp8", "l"),
        ("fp8xfp8", "k"),
    ):
        _, cfg = configs.tiles(H, P, R, L, B, "cuda", "plain" if fmt == "bf16" else fmt)
        out = torch.empty(B, H, L + R, dtype=torch.bfloat16, device="cuda")
        calls.append((f"fused {fmt}/{layout}", runner(x, out, fmt, layout, cfg).run))
    import aiter_peer as ap

    if ap.available() is None:
        cfg = dict(
            BLOCK_SIZE_M=16,
            BLOCK_SIZE_N=64,
            BLOCK_SIZE_K=128,
            GROUP_SIZE_M=1,
            num_warps=4,
            num_stages=1,
            cache_modifier=".cg",
        )
        for layout in ("k", "l"):
            p = aiter_peers([x], cfg, "aiter" if layout == "k" else "ours")[0]
            calls.append((f"aiter fp8xfp8/{layout}", p))
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
