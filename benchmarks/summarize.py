"""Print the README's benchmark tables (markdown) from the benchmarks' JSON files.

    python benchmarks/summarize.py benchmarks/results/h200_prologue.json \
        [benchmarks/results/h200_mla_layer.json]
    python benchmarks/summarize.py --smoke   # the committed results: every table has rows

Every table's numbers come from one run (one JSON file). Every row in a bench_prologue.py JSON
was checked against the reference before it was timed; a JSON with ``failures`` is reported
first (the failed shapes have no rows). Older JSONs (impl ``unfused`` = the eager reference,
``chain_no_pdl`` / ``chain_pdl``, FP8-activation rows) still print.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

#: impl names of older bench_prologue JSONs -> today's (the layer's rows keep "unfused")
ALIASES = {"unfused": "reference_eager"}
ALIASED_OPS = ("decode_prologue", "mixed_prologue")
#: what ``--smoke`` summarizes: committed results of each kind of table
SMOKE_FILES = (
    "benchmarks/results/h200_prologue.json",
    "benchmarks/results/h200_mla_layer.json",
    "benchmarks/results/h200_pdl_chain.json",
    "benchmarks/results/h200_rows_aiter_dfbba2c.json",
)


def _load(path: str) -> tuple[dict, list]:
    with open(path) as f:
        d = json.load(f)
    h = d["header"]
    bw = f", copy bandwidth {h['copy_bw_gbps']:.0f} GB/s" if "copy_bw_gbps" in h else ""
    print(
        f"{path}: {h['gpu']}, torch {h['torch']}, triton {h['triton']}, commit "
        f"{h['commit'][:7]}{bw}; {h['method']}.\n"
    )
    failures = d.get("failures") or []
    if failures:
        print(
            f"**WARNING: this run has {len(failures)} failed correctness checks or errors; "
            "those implementations/shapes have no rows:**"
        )
        for f in failures:
            what = " ".join(
                str(f.get(k))
                for k in ("op", "impl", "w_dtype", "kv_dtype", "H", "B")
                if f.get(k) is not None
            )
            print(f"- {what}: {'; '.join(f.get('problems', []))[:200]}")
        print()
    rows = [
        dict(r, impl=ALIASES.get(r["impl"], r["impl"])) if r.get("op") in ALIASED_OPS else r
        for r in d["rows"]
    ]
    return h, rows


def _pick(rows: list, **key) -> dict | None:
    m = [r for r in rows if all(r.get(k) == v for k, v in key.items())]
    return m[0] if m else None


def _f(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(num, den) -> str:
    return f"{num / den:.2f}x" if num and den else "-"


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
        if "floor" in ops:
            print_floors(rows)
        print()


def print_baselines(rows: list) -> None:
    """Per kv cache dtype: fused (bf16 W) vs the peers an NVIDIA user would run instead."""
    kvs = sorted({r["kv_dtype"] for r in rows if r["op"] == "decode_prologue"})
    for kv in kvs:

        def us(impl, H, B, kv=kv):
            r = _pick(rows, op="decode_prologue", impl=impl, H=H, B=B, w_dtype="bf16", kv_dtype=kv)
            return r["us"] if r else None

        print(f"\nDecode prologue, bf16 weights, {kv} cache, µs per layer:\n")
        print(
            "| H | B | fused | vLLM-style 4 kernels | unfused, torch.compile (batch dynamic) "
            "| cuBLAS bmm alone | fused vs 4 kernels | fused vs compiled | fused % copy BW "
            "| reference, eager |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        pairs = sorted(
            {(r["H"], r["B"]) for r in rows if r["op"] == "decode_prologue" and r["kv_dtype"] == kv}
        )
        for H, B in pairs:
            f, e, c, b, ref = (
                us(i, H, B)
                for i in (
                    "fused",
                    "engine_4kernel",
                    "unfused_compiled",
                    "cublas_bmm_only",
                    "reference_eager",
                )
            )
            fr = _pick(
                rows, op="decode_prologue", impl="fused", H=H, B=B, w_dtype="bf16", kv_dtype=kv
            )
            pct = f"{fr['pct_copy_bw']}%" if fr and "pct_copy_bw" in fr else "-"
            print(
                f"| {H} | {B} | {_f(f)} | {_f(e)} | {_f(c)} | {_f(b)} | {_ratio(e, f)} | "
                f"{_ratio(c, f)} | {pct} | {_f(ref, 1)} |"
            )


def print_formats(rows: list) -> None:
    def us(H, B, w, kv):
        r = _pick(rows, op="decode_prologue", impl="fused", H=H, B=B, w_dtype=w, kv_dtype=kv)
        return r["us"] if r else None

    quant = [
        r
        for r in rows
        if r["op"] == "decode_prologue" and r["impl"] == "fused" and r["w_dtype"] != "bf16"
    ]
    if not quant:
        return
    # fp8_act: rows of JSONs from before 0.3.0, which had the FP8-activation variant
    formats = [w for w in ("fp8", "fp8_act", "mxfp4") if any(r["w_dtype"] == w for r in quant)]
    names = {"fp8": "FP8 W", "fp8_act": "FP8 W, FP8 act", "mxfp4": "MXFP4 W"}
    print("\nFused kernel by weight format, µs per layer (x the bf16-weight time):\n")
    print("| cache | H | B | bf16 W | " + " | ".join(names[w] for w in formats) + " |")
    print("|---|---|---|---|" + "---|" * len(formats))
    for kv, H, B in sorted({(r["kv_dtype"], r["H"], r["B"]) for r in quant}):
        ref = us(H, B, "bf16", kv)
        cells = []
        for w in formats:
            x = us(H, B, w, kv)
            cells.append(f"{x:.2f} ({x / ref:.2f}x)" if x and ref else _f(x))
        print(f"| {kv} | {H} | {B} | {_f(ref)} | " + " | ".join(cells) + " |")


def print_mixed(rows: list) -> None:
    impls = ("fused", "fused_two_launches", "engine_4kernel", "unfused_compiled", "reference_eager")
    print(
        "\n| H | cache | tokens | one launch | two launches | vLLM-style 4 kernels "
        "| unfused, torch.compile | reference, eager |"
    )
    print("|---|---|---|---|---|---|---|---|")
    keys = sorted({(r["H"], r["kv_dtype"]) for r in rows if r["op"] == "mixed_prologue"})
    for H, kv in keys:
        cell, tokens = {}, "-"
        for impl in impls:
            r = _pick(rows, op="mixed_prologue", impl=impl, H=H, kv_dtype=kv)
            cell[impl] = f"{r['us']:.2f}" if r else "-"
            if r:
                tokens = f"{r['decode_tokens']} decode + {r['prefill_tokens']} prefill"
        print(f"| {H} | {kv} | {tokens} | " + " | ".join(cell[i] for i in impls) + " |")


def print_layer(rows: list) -> None:
    print(
        "\n| H | B | context | decode step, fused | unfused | saved | latent part, fused "
        "| unfused |"
    )
    print("|---|---|---|---|---|---|---|---|")
    keys = sorted({(r["H"], r["B"], r["context"]) for r in rows if r["op"] == "mla_decode_step"})
    for H, B, ctx in keys:
        v = {
            (op, impl): _pick(rows, op=op, impl=impl, H=H, B=B, context=ctx)
            for op in ("mla_decode_step", "mla_decode_latent")
            for impl in ("fused", "unfused")
        }
        if any(x is None for x in v.values()):
            continue
        f, u = v["mla_decode_step", "fused"]["us"], v["mla_decode_step", "unfused"]["us"]
        print(
            f"| {H} | {B} | {ctx} | {f:.1f} | {u:.1f} | {u - f:.1f} | "
            f"{v['mla_decode_latent', 'fused']['us']:.1f} | "
            f"{v['mla_decode_latent', 'unfused']['us']:.1f} |"
        )


def print_pdl(rows: list) -> None:
    chains = {
        "qb_gemm_chain": "cuBLAS q_b_proj GEMM -> prologue -> next kernel",
        "triton_producer_chain": "two Triton producers -> prologue -> next kernel",
    }
    pdl = [r for r in rows if r["op"] == "pdl_chain"]
    for chain, what in chains.items():
        keys = sorted({(r["H"], r["B"]) for r in pdl if r["impl"].startswith(chain)})
        if not keys:
            continue
        print(f"\nPDL, {what}, µs per layer:\n")
        print(
            "| H | B | producers + next kernel alone | with the prologue, PDL off | PDL on "
            "| saved |"
        )
        print("|---|---|---|---|---|---|")
        for H, B in keys:
            v = {
                i: _pick(pdl, impl=f"{chain}_{i}", H=H, B=B)
                for i in ("producers_only", "pdl_off", "pdl_on")
            }
            u = {i: (r["us"] if r else None) for i, r in v.items()}
            saved = (
                _f(u["pdl_off"] - u["pdl_on"])
                if u["pdl_off"] is not None and u["pdl_on"] is not None
                else "-"
            )
            print(
                f"| {H} | {B} | {_f(u['producers_only'])} | {_f(u['pdl_off'])} | "
                f"{_f(u['pdl_on'])} | {saved} |"
            )
    old = sorted({(r["H"], r["B"]) for r in pdl if r["impl"] == "chain_pdl"})
    if old:  # JSONs before the chains got names
        print(
            "\n| H | B | two Triton producers alone | producers + prologue, PDL off | PDL on "
            "| saved |"
        )
        print("|---|---|---|---|---|---|")
        for H, B in old:
            v = {
                i: _pick(pdl, impl=i, H=H, B=B)
                for i in ("producers_only", "chain_no_pdl", "chain_pdl")
            }
            if any(x is None for x in v.values()):
                continue
            off, on = v["chain_no_pdl"]["us"], v["chain_pdl"]["us"]
            print(
                f"| {H} | {B} | {v['producers_only']['us']:.2f} | {off:.2f} | {on:.2f} | "
                f"{off - on:.2f} |"
            )


def print_floors(rows: list) -> None:
    print("\nFloors, µs per layer (8-layer graph):\n")
    print("| floor | H | µs | GB/s | % copy BW | config |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["op"] != "floor":
            continue
        cfg = r.get("config")
        cfg = ", ".join(f"{k}={v}" for k, v in cfg.items()) if cfg else "1 program"
        print(
            f"| {r['impl']} | {r.get('H') or '-'} | {r['us']:.2f} | "
            f"{_f(r.get('gbps'), 0)} | {r.get('pct_copy_bw', '-')} | {cfg} |"
        )


def table_rows(text: str) -> list[int]:
    """The data rows of each markdown table in ``text``, table by table."""
    lines = text.splitlines()
    counts = []
    for i, line in enumerate(lines):
        if line.startswith("|---"):
            n = 0
            for x in lines[i + 1 :]:
                if not x.startswith("| "):
                    break
                n += 1
            counts.append(n)
    return counts


def smoke() -> int:
    """Summarize :data:`SMOKE_FILES`; exit status 1 unless every file prints tables and every
    table has a row."""
    bad = []
    for path in SMOKE_FILES:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            main([path])
        counts = table_rows(buf.getvalue())
        print(f"{path}: {len(counts)} tables, rows {counts}")
        if not counts or not all(counts):
            bad.append(path)
            print(buf.getvalue())
    print("summarize smoke:", "ok" if not bad else f"tables without rows from {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--smoke"]:
        sys.exit(smoke())
    main(sys.argv[1:])
