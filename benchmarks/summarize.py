"""Print the README's benchmark tables (markdown) from a bench_decode_prologue JSON file.

    python benchmarks/summarize.py benchmarks/results/h200_decode_prologue.json \
        [benchmarks/results/h200_decode_prologue_quant.json]
"""

from __future__ import annotations

import json
import sys


def _load(path: str) -> tuple[dict, list]:
    with open(path) as f:
        d = json.load(f)
    h = d["header"]
    print(f"{path}: {h['gpu']}, torch {h['torch']}, triton {h['triton']}, commit {h['commit']}, "
          f"copy bandwidth {h['copy_bw_gbps']:.0f} GB/s; {h['method']}.\n")
    return h, d["rows"]


def main(paths: list[str]) -> None:
    """Baselines table from the first file; weight-format table from the last file (each
    table's numbers come from one run)."""
    _, rows = _load(paths[0])
    print_baselines(rows)
    if len(paths) > 1:
        _, rows = _load(paths[-1])
    print_formats(rows)


def print_baselines(rows: list) -> None:
    def us(impl, H, B, w="bf16", kv="bf16"):
        m = [r["us"] for r in rows if (r["impl"], r["H"], r["B"], r["w_dtype"], r["kv_dtype"])
             == (impl, H, B, w, kv)]
        return m[0] if m else None

    def pct(H, B):
        m = [r["pct_copy_bw"] for r in rows if (r["impl"], r["H"], r["B"], r["w_dtype"],
                                                r["kv_dtype"]) == ("fused", H, B, "bf16", "bf16")]
        return m[0] if m else None

    print("| H | B | fused | unfused (eager) | unfused, torch.compile | cuBLAS bmm alone "
          "| fused vs compiled | fused % copy BW |")
    print("|---|---|---|---|---|---|---|---|")
    pairs = sorted({(r["H"], r["B"]) for r in rows if r["impl"] == "unfused"})
    for H, B in pairs:
        f, u, c, b = (us(i, H, B) for i in ("fused", "unfused", "unfused_compiled",
                                           "cublas_bmm_only"))
        speed = f"{c / f:.1f}x" if f and c else "-"
        print(f"| {H} | {B} | {f:.2f} | {u:.1f} | {c:.1f} | {b:.2f} | {speed} | {pct(H, B)}% |")


def print_formats(rows: list) -> None:
    def us(H, B, w):
        m = [r["us"] for r in rows if (r["impl"], r["H"], r["B"], r["w_dtype"], r["kv_dtype"])
             == ("fused", H, B, w, "bf16")]
        return m[0] if m else None

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


if __name__ == "__main__":
    main(sys.argv[1:])
