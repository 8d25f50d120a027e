"""Benchmark the MLA decode prologue: the fused kernel against what an engine runs instead.

Method (docs/method.md): every implementation runs 8 layers inside one CUDA graph, each layer
with its own weights, activations, outputs and cache, so W_UK (16 MiB per layer at H=128) is not
L2-resident; the graph is replayed (``triton.testing.do_bench``, median) and the time divided by
8. PDL is off (``FUSEMLA_PDL=off``) except in the chain rows that measure it.

Correctness first, everywhere: every timed implementation, every weight format and every sweep
config is checked against the unfused reference (``fusemla.testing``: q within 1 ulp, every
cache byte, untouched rows untouched) at the timed shape (DeepSeek dims P=128, R=64, L=512,
block size 64, fresh random data) on the captured graph itself: outputs and cache are
NaN-poisoned, the graph replayed, the results compared. A wrong implementation goes into
``failures`` and gets no row; the script then exits with status 1.

Usage (on a GPU, from the repository root; ``python -m benchmarks run bench_prologue ARGS`` is
the same)::

    python -m benchmarks.bench_prologue --out results.json          # = --all: the final table
    python -m benchmarks.bench_prologue --rows --heads 128 --batches 1 64   # a subset
    python -m benchmarks.bench_prologue --sweep [--sweep-batches 1 8 64 512] [--sweep-formats bf16]
        [--sweep-max 50]                     # grid: prologue_sweep.sweep_space
    python -m benchmarks.bench_prologue [modes...] --plan   # rows/compiles/configs, no GPU needed
    python -m benchmarks.bench_prologue --smoke --out /tmp/smoke.json  # CPU, TRITON_INTERPRET=1

A plan (rows, torch.compile compiles, sweep configs, a rough GPU time) is printed first.

Modes (no mode flag = ``--all`` = rows + chain + floors + mixed; ``--sweep`` only when asked;
``--smoke`` runs every mode, the sweep with 2-3 configs, at tiny dims in the Triton interpreter,
one timed eager pass instead of a CUDA graph, PDL off):

``--rows`` (``op="decode_prologue"``): all-decode batches, H x B x kv cache dtype. ``impl``:

- ``fused``: ``fusemla.mla_decode_prologue``, one launch; ``w_dtype`` bf16, fp8 (per-tensor
  scale) and mxfp4 weights (the quantized ones with a bf16 cache).
- ``engine_4kernel``: what vLLM runs today (``peers.EnginePrologue``): cuBLAS ``torch.bmm``,
  one Triton rotary kernel for q_pe and k_pe, one ``torch.cat`` into the 576-wide q, one Triton
  cache-write kernel (FP8: saturate(x / scale) exactly as the reference; k_pe rotated to bf16
  first, as vLLM, so its FP8 rope codes may be one off: checked with that slack).
- ``unfused_compiled``: ``torch.compile`` (``dynamic=False``) of the reference's four steps with
  only the batch dim dynamic (``torch._dynamo.mark_dynamic(t, 0)`` on the per-token tensors; B=1
  compiles once more, dynamo specializes sizes 0/1). See ``peers.make_compiled_body``.
- ``reference_eager``: ``fusemla.reference.prologue.mla_decode_prologue_ref`` eager (~48 ATen
  ops): the project's correctness reference, NOT an engine baseline.
- ``cublas_bmm_only``: ``torch.bmm`` alone (no RoPE, no cache), bf16 cache rows only; its
  ``min_bytes`` are the BMM's own (weights + q_nope + ql).

``--chain`` (``op="pdl_chain"``, PDL off vs on, H x ``--chain-batches``): per layer
``qb_gemm_chain_*``: cuBLAS x[B,1536] @ W_qb[1536, H*192] whose q_nope / q_pe views feed the
prologue, then the prologue, then the next kernel (``fusemla.testing.pdl_probe.produce`` reading the
prologue's q; with PDL it waits with ``gdc_wait`` first). ``triton_producer_chain_*``: two Triton
producers write the prologue's inputs (as torch.compile's kv_c RMSNorm kernel would), the
prologue, the same next kernel. ``*_producers_only``: the chain without the prologue. Chain
rows are checked on all 8 layers after NaN-poisoning the producers' outputs, the prologue's
output and cache and the next kernel's output (PDL on: three such replays), so a stale read
fails the row.

``--floors`` (``op="floor"``): ``empty_launch`` (a 1-program Triton kernel per layer in the
8-layer graph) and ``weight_read`` (a Triton kernel reading each layer's W_UK_T, bf16, with
enough programs to fill the GPU, one value per program; best of a few grids, in ``config``).

``--mixed`` (``op="mixed_prologue"``): 32 decode tokens + one 512-token prefill: ``fused`` (one
launch), ``fused_two_launches`` (decode tokens, then prefill tokens), ``engine_4kernel``,
``unfused_compiled``, ``reference_eager``.

``--aiter`` (``op="decode_prologue"``, ``w_dtype="fp8xfp8"``): AMD AITER's fused FP8 kernel
(``aiter_peer.py``; its source is carried in the git-ignored ``.peers/``, never committed) on
the same inputs, AITER's default config and the best of 36, each checked first; rows
``aiter_fp8_default`` / ``aiter_fp8_best``. Not in ``--smoke`` (the interpreter's bf16 bugs).

``--sweep``: times :func:`prologue_sweep.sweep_space`'s tile configs per (H, B, weight format),
the shipped config first (``shipped: true``), each checked first; rows in ``"sweep"``; prints
the best config per shape as a dict literal. PDL is off, as in every row but the chains.

Output: tables (µs per layer, GB/s of each row's ``min_bytes``, % of the device-to-device copy
bandwidth measured first) and JSON ``{"header", "rows", "sweep", "sweep_skipped", "failures",
"skipped"}`` (written after every section), read by ``summarize.py``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import torch

from benchmarks.bench_core import (
    BLOCK_SIZE,
    COMPILED_NOTE,
    DECODE_IMPLS,
    ENGINE_NOTE,
    KV_DTYPES,
    KV_NAMES,
    MIXED_IMPLS,
    SMOKE_BATCHES,
    SMOKE_DIMS,
    SMOKE_HEADS,
    W_BYTES,
    W_FORMATS,
    Bench,
    Runner,
    aiter_check,
    aiter_peers,
    bmm_check,
    copy_bandwidth_gbps,
    decode_runner,
    empty_cache,
    fmt_key,
    fused_runner,
    min_bytes,
    prologue_check,
)
from benchmarks.bench_sections import chain_rows, floor_rows, self_test
from benchmarks.common import CheckFailed, ensure_interpreter, run_header, verdict
from benchmarks.peers import EnginePrologue
from benchmarks.prologue_sweep import best_configs_literal, smoke_subset, sweep_space
from fusemla.ops.prologue import configs
from fusemla.ops.prologue.api import mla_prologue
from fusemla.reference.prologue import mla_prologue_ref

# rough cost model of the GPU run for the estimate printed at the start (seconds)
COST_ROW, COST_COMPILE, COST_SWEEP_CONFIG = 0.8, 2.0, 3.0

# --------------------------------------------------------------------------------- sections


def decode_rows(b: Bench, a) -> None:
    P, R, L = b.dims["P"], b.dims["R"], b.dims["L"]
    for kv_name, H, B in itertools.product(a.kv, a.heads, a.batches):
        kv_dtype = KV_DTYPES[kv_name]
        t0 = time.perf_counter()
        layers = b.inputs(B, H, kv_dtype, seed=1000 * H + B + (7 if kv_name == "fp8" else 0))
        kv_bytes = 1 if kv_name == "fp8" else 2
        base = dict(op="decode_prologue", kv_dtype=KV_NAMES[kv_dtype], H=H, B=B)
        for impl in a.impls:
            if impl == "cublas_bmm_only" and kv_name != "bf16":
                continue
            if impl == "unfused_compiled" and a.no_compile:
                continue
            key = dict(base, impl=impl, w_dtype="bf16")
            try:
                runners = [decode_runner(impl, x, H, b) for x in layers]
            except Exception as e:  # noqa: BLE001
                b.fail(key, [f"setup raised {type(e).__name__}: {e}"])
                continue
            if impl == "cublas_bmm_only":
                nb = H * P * L * 2 + B * H * (P + L) * 2
                b.measure(
                    key,
                    runners,
                    bmm_check(layers[0], runners[0]),
                    nb,
                    note="torch.bmm alone; min_bytes = weights + q_nope + ql",
                )
                continue
            extra = {}
            if impl == "engine_4kernel":
                extra["note"] = ENGINE_NOTE
            elif impl == "unfused_compiled":
                extra["note"] = COMPILED_NOTE
            elif impl == "reference_eager":
                extra["note"] = "the project's correctness reference (~48 ATen ops), eager"
            b.measure(
                key,
                runners,
                prologue_check(layers[0], runners[0]),
                min_bytes(B, H, P, R, L, 2, 2, kv_bytes),
                **extra,
            )
        if "fused" in a.impls and kv_name == "fp8" and a.q_fp8:
            # an FP8 query as well (vLLM's FLASHMLA with an FP8 cache): per-tensor scale 1.0,
            # vLLM's default q scale; checked against the reference's single rounding
            key = dict(base, impl="fused", w_dtype="bf16", q_dtype="fp8")
            try:
                scale = torch.ones((), dtype=torch.float32, device=b.device)
                runners = [
                    fused_runner(
                        x,
                        torch.empty(B, H, L + R, dtype=kv_dtype, device=b.device),
                        q_scale=scale,
                    )
                    for x in layers
                ]
            except Exception as e:  # noqa: BLE001
                b.fail(key, [f"setup raised {type(e).__name__}: {e}"])
            else:
                b.measure(
                    key,
                    runners,
                    prologue_check(layers[0], runners[0]),
                    min_bytes(B, H, P, R, L, 2, 2, kv_bytes),
                    note="FP8 query out (scale 1.0) and FP8 cache; min_bytes counts a bf16 query",
                )
        if "fused" in a.impls and (kv_name == "bf16" or a.formats_all_kv):
            for fmt in a.formats:
                if fmt == "bf16":
                    continue
                key = dict(base, impl="fused", w_dtype=fmt)
                try:
                    runners = [
                        fused_runner(
                            x, torch.empty(B, H, L + R, dtype=torch.bfloat16, device=b.device), fmt
                        )
                        for x in layers
                    ]
                except Exception as e:  # noqa: BLE001
                    b.fail(key, [f"setup raised {type(e).__name__}: {e}"])
                    continue
                b.measure(
                    key,
                    runners,
                    prologue_check(layers[0], runners[0]),
                    min_bytes(B, H, P, R, L, 2, W_BYTES[fmt], kv_bytes),
                )
        del layers
        empty_cache(b)
        print(f"   ({time.perf_counter() - t0:.1f} s for kv={kv_name} H={H} B={B})", flush=True)
        b.save()


def mixed_rows(b: Bench, a) -> None:
    D, PF = (3, 9) if b.smoke else (32, 512)
    N = D + PF
    P, R, L = b.dims["P"], b.dims["R"], b.dims["L"]
    for kv_name, H in itertools.product(a.kv, a.heads):
        kv_dtype = KV_DTYPES[kv_name]
        kv_bytes = 1 if kv_name == "fp8" else 2
        layers = b.inputs(
            N, H, kv_dtype, seed=7000 + H + (7 if kv_name == "fp8" else 0), num_decode_tokens=D
        )
        nbytes = min_bytes(D, H, P, R, L, 2, 2, kv_bytes) + PF * (
            2 * H * R * 2 + (L + R) * 2 + R * 2 + (L + R) * kv_bytes + 16
        )

        def outs_of(x):
            dev = x.q_nope.device
            return dict(
                out=torch.empty(D, H, L + R, dtype=torch.bfloat16, device=dev),
                q_pe_out=torch.empty(PF, H, R, dtype=torch.bfloat16, device=dev),
                k_pe_out=torch.empty(PF, R, dtype=torch.bfloat16, device=dev),
            )

        def runner(impl, x):
            o = outs_of(x)
            res = (o["out"], o["q_pe_out"], o["k_pe_out"])
            if impl == "fused":
                return Runner(lambda: x.run(mla_prologue, **o), res, list(res))
            if impl == "reference_eager":
                return Runner(lambda: x.run(mla_prologue_ref, **o), res, list(res))
            if impl == "fused_two_launches":
                args = list(x.args())
                per_token = (0, 1, 2, 3, 5, 9)
                dec = [t[:D] if i in per_token else t for i, t in enumerate(args)]
                pre = [t[D:] if i in per_token else t for i, t in enumerate(args)]

                def run():
                    mla_prologue(*dec, kv_scale=x.kv_scale, out=o["out"])
                    mla_prologue(
                        *pre,
                        num_decode_tokens=0,
                        kv_scale=x.kv_scale,
                        q_pe_out=o["q_pe_out"],
                        k_pe_out=o["k_pe_out"],
                    )

                return Runner(run, res, list(res))
            if impl == "engine_4kernel":
                e = EnginePrologue(x, o["out"], D)
                return Runner(e.run, (e.out, e.q_rot[D:], e.k_rot[D:]), e.buffers, code_slack=1)
            if impl == "unfused_compiled":
                fn = b.compiled_fn("mixed")
                return Runner(
                    lambda: fn(
                        *x.args(),
                        x.kv_scale,
                        o["out"],
                        o["q_pe_out"],
                        o["k_pe_out"],
                        num_decode_tokens=D,
                    ),
                    res,
                    list(res),
                )
            raise ValueError(impl)

        for impl in MIXED_IMPLS:
            if impl not in a.mixed_impls or (impl == "unfused_compiled" and a.no_compile):
                continue
            key = dict(
                op="mixed_prologue",
                impl=impl,
                w_dtype="bf16",
                kv_dtype=KV_NAMES[kv_dtype],
                H=H,
                B=N,
            )
            try:
                runners = [runner(impl, x) for x in layers]
            except Exception as e:  # noqa: BLE001
                b.fail(key, [f"setup raised {type(e).__name__}: {e}"])
                continue
            extra = dict(decode_tokens=D, prefill_tokens=PF)
            if impl == "engine_4kernel":
                extra["note"] = ENGINE_NOTE
            elif impl == "unfused_compiled":
                extra["note"] = "torch.compile(dynamic=False) of the reference's prologue_into"
            b.measure(key, runners, prologue_check(layers[0], runners[0]), nbytes, **extra)
        del layers
        empty_cache(b)
        b.save()


def aiter_rows(b: Bench, a) -> None:
    """AMD AITER's fused FP8 kernel (FP8 weights, per-tensor scale, in-kernel FP8 activations)
    on the same inputs, each config checked (``aiter_peer.check``: BMM within 8 % relative of
    the bf16-activation reference, RoPE and cache rows within 1 ulp, untouched rows untouched)
    on the captured graph before it is timed; rows ``aiter_fp8_default`` (AITER's own tuned
    table) and ``aiter_fp8_best`` (best of ``aiter_peer.config_space()``), bf16 cache."""
    from benchmarks import aiter_peer as ap

    why = ap.available()
    if why is not None:
        b.skipped.append(dict(op="decode_prologue", impl="aiter_fp8", reason=why))
        print(f"   aiter: skipped ({why})", flush=True)
        return
    P, R, L = b.dims["P"], b.dims["R"], b.dims["L"]
    full = ap.config_space()
    # above SMALL_BATCH only the 4-warp, <= 2-stage, 64/128-column tiles (the region that won
    # there in a first sweep on this H200), to keep the run short
    large = [
        c for c in full if c["num_warps"] == 4 and c["num_stages"] <= 2 and c["BLOCK_SIZE_N"] >= 64
    ]
    for H, B in itertools.product(a.heads, a.batches):
        layers = b.inputs(B, H, torch.bfloat16, seed=1000 * H + B)
        base = dict(op="decode_prologue", kv_dtype="bf16", H=H, B=B, w_dtype="fp8xfp8")
        results = []
        if a.aiter_quick:  # AITER's default and the winners of the full sweep (0e54a86)
            space = ap.quick_configs()
        else:
            space = full if B <= configs.SMALL_BATCH else large
        for cfg in [None] + space:
            key = dict(base, impl="aiter_fp8", config=cfg or "default")
            try:
                peers = aiter_peers(layers, cfg)
                us = b.time(
                    peers, check=aiter_check(peers[0], layers[0]), rep=250 if cfg is None else 40
                )
            except CheckFailed as e:
                b.fail(key, e.problems)
                continue
            except Exception as e:  # noqa: BLE001 - a config that cannot launch: skip it
                b.sweep_skipped.append(dict(key, error=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            results.append((us, cfg))
        if results:
            nbytes = min_bytes(B, H, P, R, L, 2, 1, 2)
            default = [r for r in results if r[1] is None]
            best = min(results, key=lambda r: r[0])
            for name, (us, cfg) in (
                ("aiter_fp8_default", default[0] if default else None),
                ("aiter_fp8_best", best),
            ):
                if us is None:
                    continue
                gbps = nbytes / (us * 1e-6) / 1e9
                row = dict(
                    base,
                    impl=name,
                    us=round(us, 3),
                    gbps=round(gbps, 1),
                    pct_copy_bw=round(100 * gbps / b.copy_bw, 1),
                    min_bytes=int(nbytes),
                    correct=True,
                    config=cfg or "AITER default (gfx950 table)",
                    configs_timed=len(results),
                    note=f"AITER {ap.AITER_COMMIT[:12]}; FP8 W (per-tensor) x FP8 act",
                )
                b.rows.append(row)
                print(f"   {fmt_key(row)}: {us:9.2f} us  {cfg}", flush=True)
        del layers
        empty_cache(b)
        b.save()


def sweep_rows(b: Bench, a) -> None:
    P, R, L = b.dims["P"], b.dims["R"], b.dims["L"]
    aborted = False
    for H, B, fmt in itertools.product(a.heads, a.sweep_batches, a.sweep_formats):
        if aborted:
            break
        layers = b.inputs(B, H, torch.bfloat16, seed=5000 + H + B)
        # the config the launcher itself would pick
        _, base_cfg = configs.tiles(H, P, R, L, B, b.backend, "plain" if fmt == "bf16" else fmt)
        # (fp8xfp8 tiles fall back to fp8's until the table has their own: configs.py)
        space = sweep_space(B)
        if b.smoke:
            space = smoke_subset(space, b.dims)
        elif a.sweep_max and len(space) > a.sweep_max:
            step = len(space) / a.sweep_max
            space = [space[int(i * step)] for i in range(a.sweep_max)]
        print(f"   sweep H={H} B={B} w={fmt}: {len(space)} configs", flush=True)
        best = None
        for override in space:
            cfg = {**base_cfg, **override}
            key = dict(op="sweep", impl="fused", w_dtype=fmt, kv_dtype="bf16", H=H, B=B)
            try:
                outs = [
                    torch.empty(B, H, L + R, dtype=torch.bfloat16, device=b.device) for _ in layers
                ]
                runners = [fused_runner(x, o, fmt, cfg) for x, o in zip(layers, outs)]
                us = b.time(
                    [r.run for r in runners], rep=40, check=prologue_check(layers[0], runners[0])
                )
            except CheckFailed as e:
                b.fail(dict(key, config=cfg), e.problems)
                continue
            except Exception as e:  # noqa: BLE001 - a config that cannot launch: skip it
                msg = f"{type(e).__name__}: {str(e)[:300]}"
                b.sweep_skipped.append(dict(key, config=cfg, error=msg))
                print(f"   skip {override}: {msg[:120]}")
                if "CUDA error" in msg or "illegal" in msg.lower():
                    b.fail(dict(key, config=cfg), [f"CUDA context error, sweep aborted: {msg}"])
                    aborted = True
                    break
                continue
            rec = dict(
                H=H,
                B=B,
                w_dtype=fmt,
                kv_dtype="bf16",
                config=cfg,
                us=round(us, 3),
                correct=True,
                shipped=not override,
            )
            b.sweep.append(rec)
            if best is None or us < best["us"]:
                best = rec
        print(f"   sweep H={H} B={B} w={fmt}: best {best}", flush=True)
        del layers
        empty_cache(b)
        b.save()
    if b.sweep:
        print("\n" + best_configs_literal(b.sweep))


# --------------------------------------------------------------------------------- main


def estimate(a, modes: set) -> str:
    """What the run will do and a rough GPU time (the cost model is a guess: COST_ROW s per
    checked + timed row, COST_COMPILE per torch.compile, COST_SWEEP_CONFIG per swept config
    including its Triton JIT compile)."""
    n_rows = n_compiles = n_sweep = 0
    if "rows" in modes:
        per_shape = sum(1 for i in a.impls if i not in ("cublas_bmm_only", "unfused_compiled"))
        n_rows += len(a.kv) * len(a.heads) * len(a.batches) * per_shape
        if "cublas_bmm_only" in a.impls and "bf16" in a.kv:
            n_rows += len(a.heads) * len(a.batches)
        if "unfused_compiled" in a.impls and not a.no_compile:
            n_rows += len(a.kv) * len(a.heads) * len(a.batches)
            n_compiles += (
                len(a.kv) * len(a.heads) * ((1 in a.batches) + any(x > 1 for x in a.batches))
            )
        if "fused" in a.impls:
            kvs = len(a.kv) if a.formats_all_kv else ("bf16" in a.kv)
            n_rows += kvs * len(a.heads) * len(a.batches) * sum(f != "bf16" for f in a.formats)
    if "mixed" in modes:
        n_rows += len(a.kv) * len(a.heads) * len(a.mixed_impls)
        if "unfused_compiled" in a.mixed_impls and not a.no_compile:
            n_compiles += len(a.kv) * len(a.heads)
    if "chain" in modes:
        n_rows += len(a.heads) * len(a.chain_batches) * 6
    if "floors" in modes:
        n_rows += 1 + 4 * len(a.heads)
    if "aiter" in modes:
        n_rows += 2 * len(a.heads) * len(a.batches)
        n_sweep += 36 * len(a.heads) * len(a.batches)
    if "sweep" in modes:
        for _H, B, _fmt in itertools.product(a.heads, a.sweep_batches, a.sweep_formats):
            space = sweep_space(B)
            k = len(smoke_subset(space, SMOKE_DIMS)) if a.smoke else len(space)
            n_sweep += min(k, a.sweep_max) if a.sweep_max else k
    secs = n_rows * COST_ROW + n_compiles * COST_COMPILE + n_sweep * COST_SWEEP_CONFIG
    when = (
        "smoke: CPU, tiny dims"
        if a.smoke
        else f"rough GPU estimate {secs / 60:.1f} min + Triton JIT compiles"
    )
    return (
        f"plan: modes {sorted(modes)}; {n_rows} checked+timed rows, {n_compiles} "
        f"torch.compile compiles, {n_sweep} sweep configs (each checked, then timed); "
        f"{when}"
    )


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--all",
        action="store_true",
        help="rows + chain + floors + mixed (the default when no mode is given)",
    )
    ap.add_argument("--rows", action="store_true", help="decode rows (op decode_prologue)")
    ap.add_argument("--chain", action="store_true", help="PDL chains (op pdl_chain)")
    ap.add_argument("--floors", action="store_true", help="launch and weight-read floors")
    ap.add_argument(
        "--mixed", action="store_true", help="32 decode + 512 prefill tokens (op mixed_prologue)"
    )
    ap.add_argument("--sweep", action="store_true", help="sweep fused tile configs")
    ap.add_argument(
        "--aiter",
        action="store_true",
        help="AMD AITER's fused FP8 kernel, default and best config (needs .peers/)",
    )
    ap.add_argument(
        "--aiter-quick",
        action="store_true",
        help="with --aiter: its default and 3 configs (the winners of a full sweep)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU: every mode at tiny dims under TRITON_INTERPRET=1, eager timing",
    )
    ap.add_argument("--heads", type=int, nargs="+", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--kv", nargs="+", default=["bf16", "fp8"], choices=list(KV_DTYPES))
    ap.add_argument("--impls", nargs="+", default=list(DECODE_IMPLS), choices=DECODE_IMPLS)
    ap.add_argument(
        "--q-fp8",
        action="store_true",
        help="with an FP8 cache, a fused row with an FP8 query too (vLLM's FLASHMLA path)",
    )
    ap.add_argument("--mixed-impls", nargs="+", default=list(MIXED_IMPLS), choices=MIXED_IMPLS)
    ap.add_argument(
        "--formats",
        nargs="+",
        default=list(W_FORMATS),
        choices=W_FORMATS,
        help="weight formats of the fused rows",
    )
    ap.add_argument(
        "--formats-all-kv",
        action="store_true",
        help="quantized-weight rows with every --kv (default: bf16 cache only)",
    )
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--chain-batches", type=int, nargs="+", default=None)
    ap.add_argument("--sweep-batches", type=int, nargs="+", default=None)
    ap.add_argument("--sweep-formats", nargs="+", default=list(W_FORMATS), choices=W_FORMATS)
    ap.add_argument(
        "--sweep-max",
        type=int,
        default=0,
        help="at most this many configs per shape (evenly spread; 0 = all)",
    )
    ap.add_argument("--out", default=None, help="JSON path (written after every section)")
    ap.add_argument(
        "--plan",
        action="store_true",
        help="print what the run would do (rows, compiles, sweep configs) and exit",
    )
    a = ap.parse_args(argv)
    modes = {m for m in ("rows", "chain", "floors", "mixed", "sweep", "aiter") if getattr(a, m)}
    if a.smoke:  # not aiter: its kernel meets the interpreter's bf16 bugs (aiter_peer.py)
        modes = {"rows", "chain", "floors", "mixed", "sweep"}
        a.q_fp8 = True  # the FP8-query row is checked too
    elif a.all or not modes:
        modes |= {"rows", "chain", "floors", "mixed"}
    small = a.smoke
    a.heads = a.heads or (SMOKE_HEADS if small else [16, 128])
    a.batches = a.batches or (SMOKE_BATCHES if small else [1, 8, 32, 64, 128, 256, 512])
    a.chain_batches = a.chain_batches or (SMOKE_BATCHES if small else [1, 8, 64])
    a.sweep_batches = a.sweep_batches or (SMOKE_BATCHES if small else [1, 8, 64, 512])
    return a, modes


def main(argv=None) -> int:
    a, modes = parse(argv)
    print(estimate(a, modes), flush=True)
    if a.plan:
        return 0
    if a.smoke:
        ensure_interpreter()
    elif not torch.cuda.is_available():
        print("bench_prologue: needs a GPU (or --smoke, on the CPU under the Triton interpreter)")
        return 2
    os.environ["FUSEMLA_PDL"] = "off"  # the chain rows switch it on where they measure it
    torch._dynamo.config.cache_size_limit = 256
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256
    max_tokens = max([*a.batches, *a.chain_batches, *a.sweep_batches, 12 if a.smoke else 544])
    b = Bench.for_run(a.smoke, max_tokens, out_path=a.out)
    b.copy_bw = copy_bandwidth_gbps(b.device)
    b.header = run_header(
        a.smoke,
        copy_bw_gbps=round(b.copy_bw, 1),
        layers_per_graph=b.layers,
        dims=b.dims,
        block_size=BLOCK_SIZE,
        modes=sorted(modes),
        pdl="FUSEMLA_PDL=off everywhere except the pdl_chain rows named *_pdl_on",
        method=(
            "one eager pass timed with time.perf_counter (smoke: not a speed)"
            if a.smoke
            else f"CUDA graph of {b.layers} layers (distinct weights/activations/outputs/"
            "caches), do_bench median of replays / layers; every row checked against the "
            "reference on the captured graph (NaN-poisoned outputs and cache) before "
            "timing"
        ),
    )
    print(
        f"# {b.header['gpu']}  torch {b.header['torch']}  triton {b.header['triton']}  "
        f"commit {b.header['commit'][:12]}  copy bandwidth {b.copy_bw:.0f} GB/s",
        flush=True,
    )
    t_start = time.perf_counter()
    self_test(b)
    sections = (
        ("floors", floor_rows),
        ("rows", decode_rows),
        ("aiter", aiter_rows),
        ("mixed", mixed_rows),
        ("chain", chain_rows),
        ("sweep", sweep_rows),
    )
    for name, fn in sections:
        if name not in modes:
            continue
        t0 = time.perf_counter()
        print(f"\n== {name}", flush=True)
        try:
            fn(b, a)
        except Exception as e:  # noqa: BLE001 - keep the other sections and the JSON
            b.fail(dict(op=name, impl="section"), [f"section raised {type(e).__name__}: {e}"])
        print(f"== {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        b.save()
    print_tables(b.rows)
    b.header["wall_s"] = round(time.perf_counter() - t_start, 1)
    b.header["torch_compile_graphs"] = int(
        torch._dynamo.utils.counters["stats"].get("unique_graphs", 0)
    )
    b.save()
    if a.out:
        print(f"wrote {a.out}")
    for f in b.failures:
        print(f"  FAILED {fmt_key(f)}: {'; '.join(f['problems'])[:300]}")
    if a.smoke and "sweep" in modes and not b.sweep:
        b.failures.append(dict(op="sweep", impl="smoke", problems=["no sweep config checked"]))
    return verdict(b.rows + b.sweep, b.failures, a.smoke, "rows and sweep configs")


def print_tables(rows: list) -> None:
    impls = [i for i in DECODE_IMPLS if any(r["impl"] == i for r in rows)]
    dec = [r for r in rows if r["op"] == "decode_prologue"]
    if dec:
        print("\nDecode prologue, bf16 weights, us per layer (GB/s of min_bytes):")
        print(f"{'kv':>8} {'H':>4} {'B':>4} | " + " | ".join(f"{i:>18}" for i in impls))
        for kv, H, B in sorted({(r["kv_dtype"], r["H"], r["B"]) for r in dec}):
            cells = []
            for i in impls:
                m = [
                    r
                    for r in dec
                    if (r["impl"], r["kv_dtype"], r["H"], r["B"], r["w_dtype"])
                    == (i, kv, H, B, "bf16")
                ]
                cells.append(f"{m[0]['us']:9.2f} {m[0]['gbps']:7.0f}" if m else f"{'-':>18}")
            print(f"{kv:>8} {H:>4} {B:>4} | " + " | ".join(cells))
        fused = [r for r in dec if r["impl"] == "fused"]
        shapes = sorted({(r["kv_dtype"], r["H"], r["B"]) for r in fused if r["w_dtype"] != "bf16"})
        if shapes:
            print("\nFused by weight format, us per layer (x the bf16-weight time):")
            print(f"{'kv':>8} {'H':>4} {'B':>4} | " + " | ".join(f"{w:>15}" for w in W_FORMATS))
            for kv, H, B in shapes:
                by = {
                    r["w_dtype"]: r["us"]
                    for r in fused
                    if (r["kv_dtype"], r["H"], r["B"]) == (kv, H, B)
                }
                ref = by.get("bf16")
                cells = [
                    f"{by[w]:7.2f} ({by[w] / ref:4.2f}x)" if w in by and ref else f"{'-':>15}"
                    for w in W_FORMATS
                ]
                print(f"{kv:>8} {H:>4} {B:>4} | " + " | ".join(cells))
    for op in ("mixed_prologue", "pdl_chain", "floor"):
        sel = [r for r in rows if r["op"] == op]
        if sel:
            print(f"\n{op}:")
            for r in sel:
                print(
                    f"  {r['impl']:>38} kv={r.get('kv_dtype')} H={r.get('H')} B={r.get('B')}:"
                    f" {r['us']:9.2f} us"
                )


if __name__ == "__main__":
    raise SystemExit(main())
