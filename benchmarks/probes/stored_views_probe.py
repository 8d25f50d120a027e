"""Does reading a block-FP8 checkpoint's codes in place cost the kernels anything? One GPU run.

``FUSEMLA_VLLM_W_UK=stored`` reads W_UK_T and W_UV straight out of vLLM's ``kv_b_proj`` weight
(``split_kv_b_proj_fp8(share=True)``: each head ``(P + V) * L`` codes after the last) instead of
copies of them (each head ``P * L`` or ``V * L`` after the last). Per head the kernels read the
same contiguous block either way; only the head stride differs. This probe times both for both
kernels on the same checkpoint: the prologue (bf16 activations, block-FP8 W_UK_T) and the
epilogue (FP8 out with 128-wide group scales, block-FP8 W_UV), 8 layers of distinct weights in
one CUDA graph (cold weights, KNOWLEDGE.md section 5), every graph's outputs checked byte for
byte against the copies' eager outputs before it is timed.

Usage: ``python -m benchmarks.probes.stored_views_probe --out probe.json [--heads 16 128]
[--batches 1 32 128]``. Prints a table (us per layer, views / copies) at the end. ``--smoke``:
the CPU under the Triton interpreter at small dims, eager timing, every row still checked.
"""

from __future__ import annotations

import os

import torch

import fusemla
from benchmarks.bench_core import SMOKE_BATCHES, SMOKE_HEADS, Bench
from benchmarks.common import ensure_interpreter, parser, run_header, verdict, write_json
from fusemla.ops.prologue.api import mla_prologue
from fusemla.quant import split_kv_b_proj_fp8
from fusemla.testing import make_inputs

FP8 = torch.float8_e4m3fn
VARIANTS = ("copies", "views")


def checkpoint(H: int, P: int, V: int, L: int, block: tuple[int, int], g, device) -> tuple:
    """A random block-FP8 ``kv_b_proj`` (codes over the e4m3 range, positive block scales)."""
    bn, bk = block
    rows = H * (P + V)
    codes = (torch.randn(rows, L, generator=g) * 96).clamp(-448, 448).to(FP8)
    scales = torch.rand(rows // bn, -(-L // bk), generator=g).add(0.5) / (96 * L**0.5)
    return codes.to(device), scales.to(device)


def same_bytes(got: list, want: list) -> list[str]:
    """Problems where a graph's outputs differ from the eager ones, byte for byte."""
    problems = []
    for i, (a, b) in enumerate(zip(got, want)):
        for j, (x, y) in enumerate(zip(a, b)):
            if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                problems.append(f"layer {i} output {j}: bytes differ from the copies' eager run")
    return problems


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--heads", type=int, nargs="+", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    a = ap.parse_args(argv)
    if a.smoke:
        ensure_interpreter()
    a.heads = a.heads or (SMOKE_HEADS if a.smoke else [16, 128])
    a.batches = a.batches or (SMOKE_BATCHES if a.smoke else [1, 32, 128])
    os.environ["FUSEMLA_PDL"] = "off"
    b = Bench.for_run(a.smoke, max(a.batches))
    P, R, L = (b.dims[k] for k in ("P", "R", "L"))
    V = P
    block = (P, 16 if a.smoke else 128)  # bn rows cover P (what the prologue reads), bk along L
    group = 32 if a.smoke else 128
    dev = b.device
    g = torch.Generator().manual_seed(20261207)
    rows: list[dict] = []
    failures: list[dict] = []
    for H in a.heads:
        ckpts = [checkpoint(H, P, V, L, block, g, dev) for _ in range(b.layers)]
        weights = {
            v: [
                split_kv_b_proj_fp8(
                    w, s, num_heads=H, qk_nope_head_dim=P, v_head_dim=V, block_size=block,
                    share=v == "views",
                )
                for w, s in ckpts
            ]
            for v in VARIANTS
        }  # fmt: skip
        assert weights["views"][0][0].data.stride(0) == (P + V) * L
        assert weights["copies"][0][0].data.stride(0) == P * L
        for B in a.batches:
            inp = make_inputs(B, H, P, R, L, device=dev, generator=g)
            x = torch.randn(B, H, L, generator=g).to(torch.bfloat16).to(dev)
            for op in ("prologue", "epilogue"):
                times = {}
                for v in VARIANTS:
                    outs = [
                        (
                            (torch.empty(B, H, L + R, dtype=torch.bfloat16, device=dev),)
                            if op == "prologue"
                            else (
                                torch.empty(B, H * V, dtype=FP8, device=dev),
                                torch.empty(B, H * V // group, device=dev),
                            )
                        )
                        for _ in range(b.layers)
                    ]

                    def call(i, v=v, outs=outs):
                        uk, uv = weights[v][i]
                        if op == "prologue":
                            inp.run(mla_prologue, w_uk_t=uk, out=outs[i][0])
                        else:
                            fusemla.mla_epilogue(
                                x, uv, out=outs[i][0], out_dtype=FP8, group_size=group,
                                scale_out=outs[i][1],
                            )  # fmt: skip

                    calls = [lambda i=i: call(i) for i in range(b.layers)]
                    if v == "copies":  # the eager outputs every graph must give
                        for c in calls:
                            c()
                        want = [tuple(t.clone() for t in o) for o in outs]

                    def check(replay, outs=outs, want=want):
                        replay()
                        return same_bytes(outs, want)

                    key = dict(op=op, H=H, B=B, variant=v)
                    try:
                        times[v] = b.time(calls, check=check)
                    except Exception as e:  # noqa: BLE001 - a failed check or launch: recorded
                        failures.append(dict(key, problems=[str(e)[:800]]))
                        print(f"!! FAILED {key}: {str(e)[:800]}", flush=True)
                        continue
                    rows.append(dict(key, us_per_layer=round(times[v], 3), correct=True))
                    print(f"   {op} H={H} B={B} {v}: {times[v]:.3f} us", flush=True)
                write_json(a.out, dict(header=run_header(a.smoke), rows=rows, failures=failures))
    print("\n| op | H | B | copies us | views us | views / copies |\n|---|---|---|---|---|---|")
    by = {(r["op"], r["H"], r["B"], r["variant"]): r["us_per_layer"] for r in rows}
    for op in ("prologue", "epilogue"):
        for H in a.heads:
            for B in a.batches:
                c, w = by.get((op, H, B, "copies")), by.get((op, H, B, "views"))
                ratio = f"{w / c:.3f}" if c and w else "-"
                print(f"| {op} | {H} | {B} | {c} | {w} | {ratio} |")
    return verdict(rows, failures, a.smoke)


if __name__ == "__main__":
    raise SystemExit(main())
