"""One-call exploration of prologue kernel v2 tile configs on a GPU (every config checked first).

For each (H, B, weight format) a small grid of launch configs is checked against the reference
at DeepSeek-V3 dims (q and every cache byte) and, if correct, timed in the 8-layer CUDA graph.
Also two floors: an empty Triton kernel and a Triton kernel that only reads W_UK_T.
Writes JSON to --out and prints the best config per shape.

PDL is off (``FUSEMLA_PDL=off`` unless set): the targets are judged with PDL off, and with it on
each prologue in the graph overlaps the one before it, which favours other small-batch tiles.
The committed phase 1-2 JSONs (``benchmarks/results/h200_explore_v2_phase*.json``) were taken
before this default, with PDL on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import commit_id, time_graph  # noqa: E402

from fusemla.ops.prologue.args import prepare  # noqa: E402
from fusemla.ops.prologue.configs import SMALL_BATCH, launch_config  # noqa: E402
from fusemla.ops.prologue.launch import launch  # noqa: E402
from fusemla.quant import quantize_fp8_weight, quantize_mxfp4_weight  # noqa: E402
from fusemla.testing import DEEPSEEK_V3, check_against_reference, make_inputs  # noqa: E402

LAYERS = 8
DEVICE = "cuda"
PHASE = 1
DIMS = {k: DEEPSEEK_V3[k] for k in ("P", "R", "L")}


@triton.jit
def _empty_kernel(p):
    pass


@triton.jit
def _read_kernel(p_w, p_o, n, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(p_w + o, mask=o < n, other=0.0).to(tl.float32)
    tl.store(p_o + tl.program_id(0), tl.sum(x, axis=0))


def floors(H):
    n = H * DIMS["P"] * DIMS["L"]
    ws = [torch.randn(n, device=DEVICE, dtype=torch.bfloat16) for _ in range(LAYERS)]
    block = 8192
    outs = [torch.empty(triton.cdiv(n, block), device=DEVICE) for _ in range(LAYERS)]
    rows = [dict(op="floor", impl="empty_kernel", H=H,
                 us=time_graph([lambda w=w: _empty_kernel[(1,)](w) for w in ws]))]
    for blk, nw in ((8192, 8), (4096, 4), (16384, 8)):
        outs = [torch.empty(triton.cdiv(n, blk), device=DEVICE) for _ in range(LAYERS)]
        us = time_graph([lambda w=w, o=o: _read_kernel[(triton.cdiv(n, blk),)](
            w, o, n, BLOCK=blk, num_warps=nw) for w, o in zip(ws, outs)])
        rows.append(dict(op="floor", impl=f"read_w_{blk}_{nw}w", H=H, us=us,
                         gbps=n * 2 / us / 1e3))
    return rows


LARGE_BMM = [(128, 64, 8, 2, 1), (128, 64, 8, 2, 2), (128, 128, 8, 3, 1), (128, 64, 4, 3, 2),
             (256, 64, 8, 2, 2), (256, 128, 8, 2, 1), (128, 64, 4, 2, 2), (128, 64, 8, 3, 1)]


def space2(H, B, fmt):
    """Phase 2 (after the vectorized RoPE): the best BMM tiles of phase 1 x RoPE/cache tiles."""
    if B <= SMALL_BATCH:
        return [dict(BLOCK_L=bl, BLOCK_T=16, num_warps=nw, programs_per_sm=pps, num_stages=ns,
                     ROPE_ROWS=rr)
                for (bl, nw, pps, ns), rr in itertools.product(
                    ((128, 4, 2, 3), (256, 4, 0, 2), (256, 8, 0, 2), (128, 8, 0, 2)), (32, 64))]
    out = [dict(BLOCK_L=bl, BLOCK_T=bt, num_warps=nw, num_stages=ns, programs_per_sm=pps,
                ROPE_ROWS=64, CACHE_ROWS=4) for bl, bt, nw, ns, pps in LARGE_BMM]
    for rr, cr in ((32, 4), (128, 4), (64, 8), (128, 8)):
        out += [dict(BLOCK_L=bl, BLOCK_T=bt, num_warps=nw, num_stages=ns, programs_per_sm=pps,
                     ROPE_ROWS=rr, CACHE_ROWS=cr) for bl, bt, nw, ns, pps in LARGE_BMM[:3]]
    return out


def space3(H, B, fmt):
    """Phase 3: small batches with PDL off (phases 1-2 ran with PDL on)."""
    return [dict(BLOCK_L=bl, BLOCK_T=16, num_warps=nw, programs_per_sm=pps, num_stages=ns)
            for bl, nw, (pps, ns) in itertools.product((64, 128, 256), (4, 8),
                                                       ((0, 2), (2, 3)))]


def space(H, B, fmt):
    if PHASE == 3:
        return space3(H, B, fmt)
    if PHASE == 2:
        return space2(H, B, fmt)
    small = B <= SMALL_BATCH
    out = []
    if small and H <= 32:
        return [dict(BLOCK_L=bl, BLOCK_T=16, num_warps=nw, programs_per_sm=0, num_stages=2)
                for bl, nw in itertools.product((32, 64, 128), (2, 4, 8))]
    if small:
        return [dict(BLOCK_L=bl, BLOCK_T=16, num_warps=nw, programs_per_sm=pps, num_stages=ns)
                for bl, nw, (pps, ns) in itertools.product(
                    (64, 128, 256), (4, 8), ((0, 2), (1, 3), (2, 3), (1, 4)))]
    for bl, bt, nw, pps, ns in itertools.product((128, 256), (64, 128), (4, 8), (1, 2),
                                                 (2, 3)):
        if nw == 4 and (bl, bt) != (128, 64):
            continue
        out.append(dict(BLOCK_L=bl, BLOCK_T=bt, num_warps=nw, programs_per_sm=pps,
                        num_stages=ns, ROPE_ROWS=64, CACHE_ROWS=4))
    out += [dict(BLOCK_L=128, BLOCK_T=64, num_warps=8, programs_per_sm=0, num_stages=2,
                 ROPE_ROWS=rr, CACHE_ROWS=cr) for rr, cr in ((64, 1), (256, 4), (512, 8))]
    return out


def weights(inp, fmt):
    if fmt == "bf16":
        return inp.w_uk_t
    c = inp.extra.setdefault("qw", {})
    if fmt not in c:
        c[fmt] = (quantize_fp8_weight(inp.w_uk_t) if fmt == "fp8"
                  else quantize_mxfp4_weight(inp.w_uk_t))
    return c[fmt]


def main():
    os.environ.setdefault("FUSEMLA_PDL", "off")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--phase", type=int, default=1, choices=[1, 2, 3])
    a = ap.parse_args()
    t_start = time.time()
    torch.manual_seed(0)
    global PHASE
    PHASE = a.phase
    rows = []
    for H in ((16, 128) if PHASE == 1 else ()):
        for r in floors(H):
            rows.append(r)
            print(r, flush=True)
    shapes = [(H, B, "bf16") for H in (16, 128) for B in (1, 8, 64, 512)]
    if PHASE == 1:
        shapes += [(128, B, f) for f in ("fp8", "mxfp4") for B in (1, 8, 64)]
        shapes += [(16, 1, "fp8"), (16, 512, "fp8"), (128, 512, "fp8")]
    elif PHASE == 3:
        shapes = [(16, 1, "bf16"), (128, 1, "bf16"), (16, 8, "bf16"), (128, 8, "bf16"),
                  (128, 1, "fp8")]
    else:
        shapes = [(128, 512, "bf16"), (16, 512, "bf16"), (128, 64, "bf16"), (16, 64, "bf16"),
                  (128, 1, "bf16"), (128, 8, "bf16"), (16, 1, "bf16"), (128, 512, "fp8"),
                  (128, 1, "fp8"), (128, 1, "mxfp4")]
    shapes = [s for s in shapes if s[1] in a.batches]
    best = {}
    for H, B, fmt in shapes:
        if time.time() - t_start > a.budget_s:
            print("!! budget spent, stopping")
            break
        g = torch.Generator().manual_seed(1000 * H + B)
        layers = []
        for _ in range(LAYERS):
            inp = make_inputs(B, H=H, **DIMS, dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                              block_size=64, device=DEVICE, generator=g)
            inp.extra["out"] = torch.empty(B, H, DIMS["L"] + DIMS["R"], dtype=torch.bfloat16,
                                           device=DEVICE)
            layers.append(inp)
        small = B <= SMALL_BATCH
        base = launch_config(H, DIMS["P"], DIMS["R"], DIMS["L"], "cuda", small)
        cands = [dict(base)] + [dict(base, **o) for o in space(H, B, fmt)]
        for cfg in cands:
            chk = layers[0]
            try:
                chk.extra["out"].fill_(float("nan"))
                before = chk.kv_cache.clone()
                args = prepare(*chk.args()[:4], weights(chk, fmt), *chk.args()[5:],
                               kv_scale=chk.kv_scale, out=chk.extra["out"])
                launch(args, cfg)
                probs = check_against_reference(chk, chk.extra["out"], before,
                                                 w_uk_t=weights(chk, fmt)).problems
                chk.kv_cache.copy_(before)
            except Exception as e:  # noqa: BLE001
                probs = [f"raised {type(e).__name__}: {str(e)[:200]}"]
            keys = {k: cfg[k] for k in ("BLOCK_L", "BLOCK_T", "num_warps", "num_stages",
                                        "programs_per_sm", "ROPE_ROWS", "CACHE_ROWS")}
            rec = dict(op="sweep", H=H, B=B, w=fmt, cfg=keys, correct=not probs,
                       default=cfg is cands[0])
            if probs:
                rec["problems"] = probs[:3]
                rows.append(rec)
                print("!!", rec, flush=True)
                continue
            argsl = [prepare(*x.args()[:4], weights(x, fmt), *x.args()[5:],
                             kv_scale=x.kv_scale, out=x.extra["out"]) for x in layers]
            try:
                rec["us"] = round(time_graph([lambda p=p: launch(p, cfg) for p in argsl],
                                             rep=60), 3)
            except Exception as e:  # noqa: BLE001
                rec["problems"] = [f"timing raised {type(e).__name__}: {str(e)[:200]}"]
                rec["correct"] = None
            rows.append(rec)
            print(rec, flush=True)
            k = (H, B, fmt)
            if "us" in rec and (k not in best or rec["us"] < best[k]["us"]):
                best[k] = rec
        del layers
        torch.cuda.empty_cache()
    print("\n# best per shape (default in brackets)")
    for k, r in best.items():
        d = [x for x in rows if x.get("op") == "sweep" and (x["H"], x["B"], x["w"]) == k
             and x.get("default") and "us" in x]
        print(k, r["us"], f"[default {d[0]['us'] if d else '-'}]", r["cfg"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(header=dict(gpu=torch.cuda.get_device_name(),
                                       triton=triton.__version__, torch=torch.__version__,
                                       commit=commit_id()), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
