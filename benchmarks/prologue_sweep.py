"""The fused kernel's tile-config grids: bench_prologue.py's sweep (``--sweep``) and the probes'.

:func:`sweep_space` is the sweep's grid: a list of override dicts applied on top of the config the
launcher itself would pick for the shape (:func:`fusemla.ops.prologue.configs.launch_config`
with its batch bucket and weight format), the shipped config first. Every config is checked
against the reference (q and every cache byte, after NaN-poisoning) on the captured graph before
it is timed; a wrong one goes to ``failures`` (a kernel bug), one whose launch raises (out of
shared memory, registers...) to ``sweep_skipped``. :func:`best_configs_literal` prints the winners
as a Python dict literal to paste into ``configs.py``.

The probes (``benchmarks/probes/``) take their grids from here too: :func:`probe_grid` (a few
tiles of the sweep's grid per batch bucket), :data:`PROBE_FORMATS` x :data:`LAYOUTS` (weight
formats and weight layouts), :data:`STAGE_VARIANTS` (the stage probe's tiles).
"""

from __future__ import annotations

import itertools

from fusemla.ops.prologue.configs import SMALL_BATCH

#: the config keys of the kernel (``fusemla.ops.prologue.configs``)
CONFIG_KEYS = (
    "BLOCK_P",
    "BLOCK_L",
    "BLOCK_T",
    "BLOCK_R",
    "BLOCK_LC",
    "ROPE_ROWS",
    "CACHE_ROWS",
    "num_warps",
    "num_stages",
    "programs_per_sm",
)


#: large-batch BMM tiles (BLOCK_L, BLOCK_T, num_warps, num_stages, programs_per_sm): the best
#: of the first (broad) H200 sweep, crossed with RoPE/cache tiles below
LARGE_BMM = (
    (128, 64, 8, 2, 1),
    (128, 64, 8, 2, 2),
    (128, 128, 8, 3, 1),
    (128, 64, 4, 3, 2),
    (256, 64, 8, 2, 2),
    (256, 128, 8, 2, 1),
    (128, 64, 4, 2, 2),
    (128, 64, 8, 3, 1),
)


def sweep_space(B: int) -> list[dict]:
    """Override dicts to time for ``B`` decode tokens (one grid for every head count and weight
    format): first ``{}`` (the shipped config itself), then the grids of the H200 sweeps the
    shipped tiles came from (``benchmarks/results/h200_explore_v2_phase*.json``): for
    B <= SMALL_BATCH, BLOCK_L x num_warps x (one program per item with 1-3 stages |
    persistent, pipelined); above, the best large-batch BMM tiles x RoPE/cache tiles."""
    if B <= SMALL_BATCH:
        grid = [
            dict(BLOCK_L=bl, BLOCK_T=16, num_warps=nw, programs_per_sm=pps, num_stages=ns)
            for bl, nw, (pps, ns) in itertools.product(
                (64, 128, 256), (4, 8), ((0, 1), (0, 2), (0, 3), (2, 3))
            )
        ]
    else:
        tiles = [(t, 64, 4) for t in LARGE_BMM]
        tiles += [
            (t, rr, cr) for rr, cr in ((32, 4), (128, 4), (64, 8), (128, 8)) for t in LARGE_BMM[:3]
        ]
        grid = [
            dict(
                BLOCK_L=bl,
                BLOCK_T=bt,
                num_warps=nw,
                num_stages=ns,
                programs_per_sm=pps,
                ROPE_ROWS=rr,
                CACHE_ROWS=cr,
            )
            for (bl, bt, nw, ns, pps), rr, cr in tiles
        ]
    return [{}] + grid


#: the probes' weight formats ("fp8xfp8": FP8 weights with ``act_quant="fp8"``)
PROBE_FORMATS = ("bf16", "fp8", "fp8xfp8")
#: weight layouts: "l" L-contiguous ``[H, P, L]``, "k" K-major (``[H, L, P]`` storage)
LAYOUTS = ("l", "k")
#: the stage probe's variants: (weight format, layout, BLOCK_L, num_warps)
STAGE_VARIANTS = (
    ("bf16", "l", 64, 4),
    ("bf16", "k", 64, 4),
    ("fp8", "k", 128, 4),
    ("fp8", "l", 64, 4),
    ("fp8xfp8", "k", 256, 4),
    ("fp8xfp8", "k", 128, 4),
)
#: the layout probe's small-batch tiles (BLOCK_L, num_warps): one program per item, one stage
_PROBE_SMALL = ((64, 4), (64, 8), (128, 4), (128, 8), (256, 4))


def probe_grid(B: int) -> list[dict]:
    """The layout probe's override dicts for ``B`` decode tokens (the shipped config not
    included): five one-program-per-item, one-stage tiles of :func:`sweep_space`'s small grid
    for B <= SMALL_BATCH, else three of :data:`LARGE_BMM`."""
    if B <= SMALL_BATCH:
        return [
            dict(BLOCK_L=bl, BLOCK_T=16, num_warps=nw, num_stages=1, programs_per_sm=0.0)
            for bl, nw in _PROBE_SMALL
        ]
    return [
        dict(BLOCK_L=bl, BLOCK_T=bt, num_warps=nw, num_stages=ns, programs_per_sm=float(pps))
        for bl, bt, nw, ns, pps in (LARGE_BMM[3], LARGE_BMM[1], LARGE_BMM[2])
    ]


def smoke_subset(space: list[dict], dims: dict, n: int = 3) -> list[dict]:
    """``n`` configs spread over ``space`` with tiles clamped to tiny interpreter dims (the
    ``--smoke`` run exercises the sweep's code path, not the grid)."""
    if not space:
        return []
    picks = [space[round(i * (len(space) - 1) / max(n - 1, 1))] for i in range(n)]
    out = []
    for o in picks:
        o = dict(o)
        half = max(16, dims["L"] // 2)
        if "BLOCK_L" in o:
            o["BLOCK_L"] = min(o["BLOCK_L"], half)
        if "BLOCK_T" in o:
            o["BLOCK_T"] = 16
        if "ROPE_ROWS" in o:
            o["ROPE_ROWS"] = min(o["ROPE_ROWS"], 16)
        if "num_warps" in o:
            o["num_warps"] = 1
        if "num_stages" in o:
            o["num_stages"] = 1
        if o not in out:
            out.append(o)
    return out


def best_configs(sweep_rows: list[dict]) -> dict:
    """{(H, B, w_dtype): the fastest correct row's full config}."""
    best: dict = {}
    for r in sweep_rows:
        key = (r["H"], r["B"], r["w_dtype"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return {k: dict(v["config"], us=v["us"]) for k, v in sorted(best.items())}


def best_configs_literal(sweep_rows: list[dict]) -> str:
    """The best config per (H, B, w_format) as a Python dict literal (``us`` included)."""
    lines = ["BEST_CONFIGS = {  # (H, B, w_format): config (fastest correct one; us = its time)"]
    for key, cfg in best_configs(sweep_rows).items():
        lines.append(f"    {key!r}: {cfg!r},")
    lines.append("}")
    return "\n".join(lines)
