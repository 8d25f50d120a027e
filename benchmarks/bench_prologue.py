"""Benchmark the MLA prologue: fused kernel vs the unfused path vs torch.compile of it.

Method (KNOWLEDGE.md §5): every implementation runs 8 layers inside one CUDA graph, each layer
with its own weights, activations, query buffer and cache, so W_UK (16 MiB per layer at H=128)
is not L2-resident; the graph is replayed many times (triton.testing.do_bench, median) and the
time divided by 8. Correctness at full dims is checked for every shape before it is timed.

Usage (on a GPU):
    python benchmarks/bench_prologue.py [--out results.json] [--heads 16 128]
        [--batches 1 8 32 64 128 256 512] [--sweep] [--mixed-only]

Rows ``op="decode_prologue"``: all-decode batches of B tokens. Rows ``op="mixed_prologue"``:
32 decode tokens + one 512-token prefill (``--mixed``): one launch (``fused``), two launches
(``fused_two_launches``: decode tokens, then prefill tokens), and the unfused path.

``--sweep`` also times a grid of fused-kernel tile configs per shape and reports the best one
(used to choose the defaults in ``launch_config``).

Output: a table (µs per layer, GB/s of the minimum bytes, % of the device-to-device copy
bandwidth measured first) and JSON: ``{"header": {...}, "rows": [{"op", "impl", "w_dtype",
"kv_dtype", "H", "B", "us", "gbps", "pct_copy_bw", ...}]}``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import commit_id, time_graph  # noqa: E402

from fusemla.ops.prologue.api import mla_decode_prologue, mla_prologue  # noqa: E402
from fusemla.ops.prologue.args import prepare  # noqa: E402
from fusemla.ops.prologue.configs import SMALL_BATCH, launch_config  # noqa: E402
from fusemla.ops.prologue.launch import launch  # noqa: E402
from fusemla.quant import quantize_fp8_weight, quantize_mxfp4_weight  # noqa: E402
from fusemla.reference.prologue import mla_decode_prologue_ref, mla_prologue_ref  # noqa: E402
from fusemla.testing import (  # noqa: E402
    DEEPSEEK_V3, check_against_reference, make_inputs, run_and_compare)

LAYERS = 8
OP = "decode_prologue"
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4m3"}


def copy_bandwidth_gbps() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s), median of many."""
    n = 1 << 30
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300,
                                 return_mode="median")
    del src, dst
    return 2 * n / (ms * 1e-3) / 1e9


def min_bytes(B: int, H: int, P: int, R: int, L: int, act_bytes: int, w_bytes: float,
              kv_bytes: int) -> int:
    """Each input read once, each output written once."""
    weights = H * P * L * w_bytes
    reads = B * H * (P + R) * act_bytes + B * (L + R) * act_bytes + B * 16 + B * R * 4
    writes = B * H * (L + R) * act_bytes + B * (L + R) * kv_bytes
    return int(weights + reads + writes)


def layer_inputs(B, H, dims, kv_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        inp = make_inputs(B, H=H, **dims, dtype=torch.bfloat16, kv_dtype=kv_dtype,
                          block_size=64, kv_scale="tensor", device="cuda", generator=g)
        inp.extra["out"] = torch.empty(B, H, dims["L"] + dims["R"], dtype=torch.bfloat16,
                                       device="cuda")
        layers.append(inp)
    return layers


#: quantized-weight variants timed beside bf16: label -> (format, fp8 activations)
W_VARIANTS = {"fp8": ("fp8", False), "fp8_act": ("fp8", True), "mxfp4": ("mxfp4", None)}


def quantized(inp, label):
    """This layer's W_UK_T in a variant's format (made once per layer)."""
    cache = inp.extra.setdefault("qw", {})
    fmt = W_VARIANTS[label][0]
    if fmt not in cache:
        cache[fmt] = (quantize_fp8_weight(inp.w_uk_t) if fmt == "fp8"
                      else quantize_mxfp4_weight(inp.w_uk_t))
    return cache[fmt]


def variant_call(inp, label):
    args = list(inp.args())
    args[4] = quantized(inp, label)
    act = W_VARIANTS[label][1]
    return lambda: mla_decode_prologue(*args, kv_scale=inp.kv_scale, out=inp.extra["out"],
                                       fp8_activations=act)


def check_variant(inp, label) -> list:
    """Quantized variant vs the reference that quantizes the same way (every cache byte)."""
    res = run_and_compare(mla_prologue, inp, w_uk_t=quantized(inp, label),
                          fp8_activations=W_VARIANTS[label][1])
    return [f"{label}: {p}" for p in res.problems]


def fused_call(inp, cfg=None):
    if cfg is None:
        return lambda: mla_decode_prologue(*inp.args(), kv_scale=inp.kv_scale,
                                           out=inp.extra["out"])
    args = prepare(*inp.args(), kv_scale=inp.kv_scale, out=inp.extra["out"])
    return lambda: launch(args, cfg)


def pdl_rows(rows, failures, H, B, dims):
    """Per layer: a Triton producer writes the prologue's inputs (as torch.compile's RMSNorm
    kernel or a fused activation kernel would), then the prologue; PDL on vs off. The producer
    launches its dependents early, so with PDL the prologue loads W_UK while it runs."""
    from fusemla.ops.pdl_probe import produce

    g = torch.Generator().manual_seed(9000 + H + B)
    layers = []
    for _ in range(LAYERS):
        inp = make_inputs(B, H=H, **dims, block_size=64, device="cuda", generator=g)
        q_base, kv_base = inp.q_nope._base, inp.kv_c._base
        inp.extra.update(q_base=q_base, kv_base=kv_base, q_src=q_base.clone(),
                         kv_src=kv_base.clone(), out=torch.empty(
                             B, H, dims["L"] + dims["R"], dtype=torch.bfloat16, device="cuda"))
        layers.append(inp)

    def call(x, pdl, with_prologue=True):
        def run():
            produce(x.extra["q_src"], x.extra["q_base"], 1.0, pdl=pdl)
            produce(x.extra["kv_src"], x.extra["kv_base"], 1.0, pdl=pdl)
            if with_prologue:
                x.run(mla_prologue, out=x.extra["out"])
        return run

    for impl, pdl, full in (("producers_only", False, False), ("chain_no_pdl", False, True),
                            ("chain_pdl", True, True)):
        os.environ["FUSEMLA_PDL"] = "on" if pdl else "off"
        try:
            chk = layers[0]
            before = chk.kv_cache.clone()
            call(chk, pdl, full)()
            if full:
                probs = check_against_reference(chk, chk.extra["out"], before).problems
                if probs:
                    failures.append(("pdl", H, B, probs))
                    print(f"!! pdl chain H={H} B={B} {impl}: {probs}")
            us = time_graph([call(x, pdl, full) for x in layers])
        except Exception as e:  # report, keep the other rows
            print(f"!! pdl chain {impl} H={H} B={B}: {type(e).__name__}: {e}")
            continue
        finally:
            os.environ.pop("FUSEMLA_PDL", None)
        rows.append(dict(op="pdl_chain", impl=impl, w_dtype="bf16", kv_dtype="bf16", H=H, B=B,
                         us=round(us, 3)))
        print(f"   pdl chain H={H} B={B} {impl}: {us:.2f} us")
    del layers
    torch.cuda.empty_cache()


MIXED_DECODE, MIXED_PREFILL = 32, 512


def mixed_rows(rows, failures, H, dims, kv_name, copy_bw, compiled_ref):
    """32 decode tokens + one 512-token prefill: one launch vs two vs the unfused path."""
    D, N = MIXED_DECODE, MIXED_DECODE + MIXED_PREFILL
    kv_dtype = torch.bfloat16 if kv_name == "bf16" else torch.float8_e4m3fn
    g = torch.Generator().manual_seed(7000 + H)
    layers = []
    for _ in range(LAYERS):
        inp = make_inputs(N, H=H, **dims, num_decode_tokens=D, kv_dtype=kv_dtype, block_size=64,
                          kv_scale="tensor", device="cuda", generator=g)
        inp.extra["outs"] = dict(
            out=torch.empty(D, H, dims["L"] + dims["R"], dtype=torch.bfloat16, device="cuda"),
            q_pe_out=torch.empty(N - D, H, dims["R"], dtype=torch.bfloat16, device="cuda"),
            k_pe_out=torch.empty(N - D, dims["R"], dtype=torch.bfloat16, device="cuda"))
        layers.append(inp)
    chk = layers[0]
    probs = run_and_compare(mla_prologue, chk).problems
    if probs:
        failures.append((kv_name, H, N, probs))
        print(f"!! mixed H={H} kv={kv_name}: {probs}")

    def one(x):
        return lambda: x.run(mla_prologue, **x.extra["outs"])

    def two(x):
        a, o = list(x.args()), x.extra["outs"]
        dec = [t[:D] if i in (0, 1, 2, 3, 5, 9) else t for i, t in enumerate(a)]
        pre = [t[D:] if i in (0, 1, 2, 3, 5, 9) else t for i, t in enumerate(a)]

        def run():
            mla_prologue(*dec, kv_scale=x.kv_scale, out=o["out"])
            mla_prologue(*pre, num_decode_tokens=0, kv_scale=x.kv_scale,
                         q_pe_out=o["q_pe_out"], k_pe_out=o["k_pe_out"])
        return run

    impls = {"fused": [one(x) for x in layers], "fused_two_launches": [two(x) for x in layers],
             "unfused": [(lambda x=x: x.run(mla_prologue_ref, **x.extra["outs"]))
                         for x in layers],
             "unfused_compiled": [(lambda x=x: x.run(compiled_ref, **x.extra["outs"]))
                                  for x in layers]}
    kv_bytes = 1 if kv_name == "fp8" else 2
    # weights once + decode part + prefill tokens' q_pe/k_pe/kv reads and writes
    nbytes = min_bytes(D, H, dims["P"], dims["R"], dims["L"], 2, 2, kv_bytes) + (N - D) * (
        2 * H * dims["R"] * 2 + (dims["L"] + dims["R"]) * 2 + dims["R"] * 2
        + (dims["L"] + dims["R"]) * kv_bytes + 16)
    for impl, calls in impls.items():
        try:
            us = time_graph(calls)
        except Exception as e:  # report, keep the other rows
            print(f"!! mixed {impl} H={H} failed: {type(e).__name__}: {e}")
            continue
        gbps = nbytes / (us * 1e-6) / 1e9
        rows.append(dict(op="mixed_prologue", impl=impl, w_dtype="bf16",
                         kv_dtype=DTYPE_NAMES[kv_dtype], H=H, B=N, decode_tokens=D,
                         prefill_tokens=N - D, us=round(us, 3), gbps=round(gbps, 1),
                         pct_copy_bw=round(100 * gbps / copy_bw, 1), min_bytes=nbytes,
                         correct=not probs if impl == "fused" else None))
        print(f"   mixed H={H} kv={kv_name} {impl}: {us:.2f} us")
    del layers
    torch.cuda.empty_cache()


def sweep_configs(H, dims, B):
    small = B <= SMALL_BATCH
    base = launch_config(H, dims["P"], dims["R"], dims["L"], "cuda", small)
    if small:
        for bl, nw in itertools.product((64, 128, 256), (4, 8)):
            yield dict(base, BLOCK_L=bl, BLOCK_T=16, num_warps=nw, num_stages=2,
                       programs_per_sm=1.0)
        return
    for bl, bt, nw, ns, pps in itertools.product((64, 128, 256), (16, 32, 64), (4, 8), (2, 3),
                                                 (1.0, 2.0, 4.0)):
        if bl * bt > 128 * 64 and nw == 4:
            continue
        yield dict(base, BLOCK_L=bl, BLOCK_T=bt, num_warps=nw, num_stages=ns,
                   programs_per_sm=pps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512])
    ap.add_argument("--kv", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--no-quant", action="store_true", help="skip the FP8/MXFP4 weight rows")
    ap.add_argument("--only-fused", action="store_true",
                    help="time only the fused kernel (bf16 and quantized weights)")
    ap.add_argument("--sweep", action="store_true", help="also sweep fused tile configs")
    ap.add_argument("--sweep-batches", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--mixed", action="store_true",
                    help="also time 32 decode tokens + one 512-token prefill (op mixed_prologue)")
    ap.add_argument("--mixed-only", action="store_true", help="only the mixed rows")
    ap.add_argument("--pdl-chain", action="store_true",
                    help="only: producer kernel + prologue per layer, PDL on vs off (op pdl_chain)")
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    ap.add_argument("--plot", default=None, help="PNG path for a plot (needs matplotlib)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_prologue: needs a GPU (use `python -m fusemla demo` on a CPU)")
        return 2

    torch._dynamo.config.cache_size_limit = 256
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256
    dims = {k: DEEPSEEK_V3[k] for k in ("P", "R", "L")}
    copy_bw = copy_bandwidth_gbps()
    commit = commit_id()
    header = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, python=platform.python_version(), commit=commit,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  copy_bw_gbps=round(copy_bw, 1), layers_per_graph=LAYERS,
                  method="CUDA graph of 8 layers (distinct weights/activations/caches), "
                         "do_bench median of replays / 8")
    print(f"# {header['gpu']}  torch {header['torch']}  triton {header['triton']}  "
          f"copy bandwidth {copy_bw:.0f} GB/s")
    compiled_ref = torch.compile(mla_decode_prologue_ref, dynamic=True)
    compiled_ref_mixed = torch.compile(mla_prologue_ref, dynamic=True)
    rows, failures, sweep_rows = [], [], []

    if a.pdl_chain:
        for H, B in itertools.product(a.heads, a.batches):
            pdl_rows(rows, failures, H, B, dims)
        a.batches = []
    if a.mixed or a.mixed_only:
        for kv_name, H in itertools.product(a.kv, a.heads):
            mixed_rows(rows, failures, H, dims, kv_name, copy_bw, compiled_ref_mixed)
    if a.mixed_only:
        a.batches = []

    for kv_name, H, B in itertools.product(a.kv, a.heads, a.batches):
        kv_dtype = torch.bfloat16 if kv_name == "bf16" else torch.float8_e4m3fn
        layers = layer_inputs(B, H, dims, kv_dtype, seed=1000 * H + B)
        # correctness at full dims, fresh poisoned cache
        chk = layers[0]
        before = chk.kv_cache.clone()
        q = fused_call(chk)()
        probs = check_against_reference(chk, q, before).problems
        if probs:
            failures.append((kv_name, H, B, probs))
            print(f"!! H={H} B={B} kv={kv_name}: {probs}")
        nbytes = min_bytes(B, H, dims["P"], dims["R"], dims["L"], 2, 2,
                           1 if kv_name == "fp8" else 2)
        impls = {"fused": [fused_call(x) for x in layers],
                 "unfused": [(lambda x=x: mla_decode_prologue_ref(
                     *x.args(), kv_scale=x.kv_scale, out=x.extra["out"])) for x in layers]}
        if a.only_fused:
            del impls["unfused"]
        if not a.no_compile and not a.only_fused:
            impls["unfused_compiled"] = [(lambda x=x: compiled_ref(
                *x.args(), kv_scale=x.kv_scale, out=x.extra["out"])) for x in layers]
        variants = {}
        if kv_name == "bf16" and not a.no_quant:
            for label in W_VARIANTS:
                try:
                    p = check_variant(chk, label)
                except Exception as e:  # report it, keep the other rows
                    p = [f"{label}: raised {type(e).__name__}: {e}"]
                if p:
                    failures.append((kv_name, H, B, p))
                    print(f"!! H={H} B={B}: {p}")
                variants[label] = [variant_call(x, label) for x in layers]
        if kv_name == "bf16" and not a.only_fused:
            impls["cublas_bmm_only"] = [(lambda x=x: torch.bmm(
                x.q_nope.transpose(0, 1), x.w_uk_t,
                out=x.extra.setdefault("bmm_out", torch.empty(H, B, dims["L"], dtype=torch.bfloat16,
                                                              device="cuda")))) for x in layers]
        for impl, calls in impls.items():
            try:
                us = time_graph(calls)
            except Exception as e:  # report, keep the other rows
                print(f"!! {impl} H={H} B={B} kv={kv_name} failed: {type(e).__name__}: {e}")
                continue
            gbps = nbytes / (us * 1e-6) / 1e9
            rows.append(dict(op=OP, impl=impl, w_dtype="bf16", kv_dtype=DTYPE_NAMES[kv_dtype],
                             H=H, B=B, us=round(us, 3), gbps=round(gbps, 1),
                             pct_copy_bw=round(100 * gbps / copy_bw, 1), min_bytes=nbytes,
                             correct=not probs if impl == "fused" else None))
        for label, calls in variants.items():
            try:
                us = time_graph(calls)
            except Exception as e:
                print(f"!! fused {label} H={H} B={B} failed: {type(e).__name__}: {e}")
                continue
            wbytes = {"fp8": 1, "fp8_act": 1, "mxfp4": 0.5 + 1 / 32}[label]
            nb = min_bytes(B, H, dims["P"], dims["R"], dims["L"], 2, wbytes, 2)
            gbps = nb / (us * 1e-6) / 1e9
            rows.append(dict(op=OP, impl="fused", w_dtype=label, kv_dtype="bf16", H=H, B=B,
                             us=round(us, 3), gbps=round(gbps, 1),
                             pct_copy_bw=round(100 * gbps / copy_bw, 1), min_bytes=nb))
        if a.sweep and kv_name == "bf16" and B in a.sweep_batches:
            best = None
            for cfg in sweep_configs(H, dims, B):
                try:
                    us = time_graph([fused_call(x, cfg) for x in layers], rep=40)
                except Exception as e:  # a tile config that does not compile (shared memory)
                    print(f"   skip {cfg}: {type(e).__name__}")
                    continue
                keys = ("BLOCK_L", "BLOCK_T", "num_warps", "num_stages", "programs_per_sm")
                rec = dict(H=H, B=B, us=round(us, 3), **{k: cfg[k] for k in keys})
                sweep_rows.append(rec)
                if best is None or us < best["us"]:
                    best = rec
            print(f"   sweep H={H} B={B}: best {best}")
        del layers, impls
        torch.cuda.empty_cache()

    # table
    print_quant_table(rows, a)
    print(f"\n{'kv':>8} {'H':>4} {'B':>4} | " + " | ".join(
        f"{n:>24}" for n in ("fused", "unfused", "unfused_compiled", "cublas_bmm_only")))
    print(f"{'':>8} {'':>4} {'':>4} | " + " | ".join(f"{'us  GB/s  %bw':>24}" for _ in range(4)))
    for kv_name, H, B in itertools.product(a.kv, a.heads, a.batches):
        kvd = "bf16" if kv_name == "bf16" else "fp8e4m3"
        cells = []
        for impl in ("fused", "unfused", "unfused_compiled", "cublas_bmm_only"):
            r = [x for x in rows if x["impl"] == impl and x["H"] == H and x["B"] == B
                 and x["kv_dtype"] == kvd and x["w_dtype"] == "bf16"]
            cells.append(f"{r[0]['us']:8.2f} {r[0]['gbps']:7.0f} {r[0]['pct_copy_bw']:5.1f}%"
                         if r else f"{'-':>24}")
        print(f"{kvd:>8} {H:>4} {B:>4} | " + " | ".join(cells))
    result = dict(header=header, rows=rows)
    if sweep_rows:
        result["sweep"] = sweep_rows
    if failures:
        result["failures"] = [dict(kv=k, H=h, B=b, problems=p) for k, h, b, p in failures]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {a.out}")
    if a.plot:
        plot(rows, a.plot, header)
    print("correctness:", "all shapes agree with the reference" if not failures
          else f"{len(failures)} shapes FAILED")
    return 1 if failures else 0


def print_quant_table(rows, a):
    """µs per layer of the fused kernel by weight format (bf16 cache), and the ratio to bf16."""
    labels = ["bf16", *W_VARIANTS]
    print(f"\n{'H':>4} {'B':>4} | " + " | ".join(f"{x:>15}" for x in labels))
    for H, B in itertools.product(a.heads, a.batches):
        by = {r["w_dtype"]: r["us"] for r in rows if r["impl"] == "fused" and r["H"] == H
              and r["B"] == B and r["kv_dtype"] == "bf16"}
        if "bf16" not in by:
            continue
        cells = [f"{by[x]:7.2f} ({by[x] / by['bf16']:4.2f}x)" if x in by else f"{'-':>15}"
                 for x in labels]
        print(f"{H:>4} {B:>4} | " + " | ".join(cells))


def plot(rows, path, header):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: skipping the plot")
        return
    heads = sorted({r["H"] for r in rows})
    fig, axes = plt.subplots(1, len(heads), figsize=(6 * len(heads), 4), squeeze=False)
    for ax, H in zip(axes[0], heads):
        for impl in ("fused", "unfused", "unfused_compiled", "cublas_bmm_only"):
            rs = sorted((r for r in rows if r["H"] == H and r["impl"] == impl
                         and r["kv_dtype"] == "bf16" and r["w_dtype"] == "bf16"),
                        key=lambda r: r["B"])
            if rs:
                ax.plot([r["B"] for r in rs], [r["us"] for r in rs], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("decode tokens B")
        ax.set_ylabel("µs per layer")
        ax.set_title(f"MLA decode prologue, H={H}, bf16 W + cache")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(header["gpu"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
