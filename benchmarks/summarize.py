"""Print the README's benchmark tables (markdown) from the benchmarks' JSON files.

    python benchmarks/summarize.py benchmarks/results/h200_prologue.json \
        [benchmarks/results/h200_mla_layer.json]

Every table's numbers come from one run (one JSON file).
"""

from __future__ import annotations

import json
import sys


def _load(path: str) -> tuple[dict, list]:
    with open(path) as f:
        d = json.load(f)
    h = d["header"]
    bw = f", copy bandwidth {h['copy_bw_gbps']:.0f} GB/s" if "copy_bw_gbps" in h else ""
    print(f"{path}: {h['gpu']}, torch {h['torch']}, triton {h['triton']}, commit "
          f"{h['commit'][:7]}{bw}; {h['method']}.\n")
    return h, d["rows"]


def _pick(rows: list, **key) -> dict | None:
    m = [r for r in rows if all(r.get(k) == v for k, v in key.items())]
    return m[0] if m else None


def main(paths: list[str]) -> None:
    for path in paths:
        _, rows = _load(path)
        ops = {r["op"] for r in rows}
        if "decode_prologue" in ops:
            print_baselines(rows)
            print_formats(rows)
        if "mixed_prologue" in ops:
            print_mixed(rows)
        if "mla_decode_step" in ops:
            print_layer(rows)
        if "pdl_chain" in ops:
            print_pdl(rows)
        print()


def print_baselines(rows: list) -> None:
    def us(impl, H, B):
        r = _pick(rows, op="decode_prologue", impl=impl, H=H, B=B, w_dtype="bf16",
                  kv_dtype="bf16")
        return r["us"] if r else None

    print("| H | B | fused | unfused (eager) | unfused, torch.compile | cuBLAS bmm alone "
          "| fused vs compiled | fused % copy BW |")
    print("|---|---|---|---|---|---|---|---|")
    pairs = sorted({(r["H"], r["B"]) for r in rows
                    if r["op"] == "decode_prologue" and r["impl"] == "unfused"})
    for H, B in pairs:
        f, u, c, b = (us(i, H, B) for i in ("fused", "unfused", "unfused_compiled",
                                           "cublas_bmm_only"))
        pct = _pick(rows, op="decode_prologue", impl="fused", H=H, B=B, w_dtype="bf16",
                    kv_dtype="bf16")["pct_copy_bw"]
        speed = f"{c / f:.1f}x" if f and c else "-"
        print(f"| {H} | {B} | {f:.2f} | {u:.1f} | {c:.1f} | {b:.2f} | {speed} | {pct}% |")


def print_formats(rows: list) -> None:
    def us(H, B, w):
        r = _pick(rows, op="decode_prologue", impl="fused", H=H, B=B, w_dtype=w,
                  kv_dtype="bf16")
        return r["us"] if r else None

    quant = sorted({(r["H"], r["B"]) for r in rows if r["w_dtype"] == "mxfp4"})
    if quant:
        print("\n| H | B | bf16 W | FP8 W, bf16 act | FP8 W, FP8 act | MXFP4 W (dequant) |")
        print("|---|---|---|---|---|---|")
        for H, B in quant:
            ref = us(H, B, "bf16")
            cells = []
            for w in ("fp8", "fp8_act", "mxfp4"):
                x = us(H, B, w)
                cells.append(f"{x:.2f} ({x / ref:.2f}x)" if x and ref else "-")
            print(f"| {H} | {B} | {ref:.2f} | " + " | ".join(cells) + " |")


def print_mixed(rows: list) -> None:
    print("\n| H | cache | tokens | one launch | two launches | unfused (eager) "
          "| unfused, torch.compile |")
    print("|---|---|---|---|---|---|---|")
    keys = sorted({(r["H"], r["kv_dtype"]) for r in rows if r["op"] == "mixed_prologue"})
    for H, kv in keys:
        cell = {}
        for impl in ("fused", "fused_two_launches", "unfused", "unfused_compiled"):
            r = _pick(rows, op="mixed_prologue", impl=impl, H=H, kv_dtype=kv)
            cell[impl] = f"{r['us']:.2f}" if r else "-"
            if r:
                tokens = f"{r['decode_tokens']} decode + {r['prefill_tokens']} prefill"
        print(f"| {H} | {kv} | {tokens} | {cell['fused']} | {cell['fused_two_launches']} | "
              f"{cell['unfused']} | {cell['unfused_compiled']} |")


def print_layer(rows: list) -> None:
    print("\n| H | B | context | decode step, fused | unfused | saved | latent part, fused "
          "| unfused |")
    print("|---|---|---|---|---|---|---|---|")
    keys = sorted({(r["H"], r["B"], r["context"]) for r in rows if r["op"] == "mla_decode_step"})
    for H, B, ctx in keys:
        v = {(op, impl): _pick(rows, op=op, impl=impl, H=H, B=B, context=ctx)
             for op in ("mla_decode_step", "mla_decode_latent") for impl in ("fused", "unfused")}
        if any(x is None for x in v.values()):
            continue
        f, u = v["mla_decode_step", "fused"]["us"], v["mla_decode_step", "unfused"]["us"]
        print(f"| {H} | {B} | {ctx} | {f:.1f} | {u:.1f} | {u - f:.1f} | "
              f"{v['mla_decode_latent', 'fused']['us']:.1f} | "
              f"{v['mla_decode_latent', 'unfused']['us']:.1f} |")


def print_pdl(rows: list) -> None:
    print("\n| H | B | two Triton producers alone | producers + prologue, PDL off | PDL on "
          "| saved |")
    print("|---|---|---|---|---|---|")
    for H, B in sorted({(r["H"], r["B"]) for r in rows if r["op"] == "pdl_chain"}):
        v = {i: _pick(rows, op="pdl_chain", impl=i, H=H, B=B)
             for i in ("producers_only", "chain_no_pdl", "chain_pdl")}
        if any(x is None for x in v.values()):
            continue
        off, on = v["chain_no_pdl"]["us"], v["chain_pdl"]["us"]
        print(f"| {H} | {B} | {v['producers_only']['us']:.2f} | {off:.2f} | {on:.2f} | "
              f"{off - on:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
