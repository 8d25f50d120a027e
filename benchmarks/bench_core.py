"""Shared machinery of bench_prologue.py and the probes: the run's state (:class:`Bench`: rows,
failures, JSON), one implementation on one layer (:class:`Runner`), the checks run on the captured
graph before timing (:func:`prologue_check`, :func:`bmm_check`, :func:`aiter_check`) and the
decode-row runners (:func:`fused_runner` with any weight format, tile config and weight layout).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import triton

from benchmarks.common import CheckFailed, sync, timer, write_json
from benchmarks.peers import EnginePrologue, make_compiled_body
from fusemla.contracts.prologue import prepare
from fusemla.ops.prologue.api import mla_decode_prologue
from fusemla.ops.prologue.launch import launch
from fusemla.quant import QuantizedWeight, quantize_fp8_weight, quantize_mxfp4_weight
from fusemla.reference.prologue import mla_decode_prologue_ref, mla_prologue_ref
from fusemla.testing import (
    DEEPSEEK_V3,
    FP8_NAN_BYTE,
    SMALL_DIMS,
    check_against_reference,
    compare,
    make_inputs,
    rel_err,
)

LAYERS = 8
SMOKE_LAYERS = 2
SMOKE_DIMS = {k: SMALL_DIMS[k] for k in ("P", "R", "L")}
FULL_DIMS = {k: DEEPSEEK_V3[k] for k in ("P", "R", "L")}
SMOKE_HEADS = [2]
SMOKE_BATCHES = [1, 5]
BLOCK_SIZE = 64
Q_LORA_RANK = 1536  # DeepSeek-V3 q_lora_rank: q_b_proj is [q_lora_rank, H * (P + R)]
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
KV_NAMES = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4m3"}
#: weight formats of the fused rows: "fp8xfp8" = FP8 weights with act_quant="fp8" (FP8 x FP8 dot)
W_FORMATS = ("bf16", "fp8", "fp8xfp8", "mxfp4")
W_BYTES = {"bf16": 2, "fp8": 1, "fp8xfp8": 1, "mxfp4": 0.5 + 1 / 32}
DECODE_IMPLS = ("fused", "engine_4kernel", "unfused_compiled", "reference_eager", "cublas_bmm_only")
MIXED_IMPLS = (
    "fused",
    "fused_two_launches",
    "engine_4kernel",
    "unfused_compiled",
    "reference_eager",
)
ENGINE_NOTE = (
    "cuBLAS bmm + Triton rotary (q_pe, k_pe) + torch.cat + Triton cache write; "
    "k_pe rotated to bf16 before the FP8 quantization (as vLLM), so FP8 rope codes "
    "are checked within 1 code"
)
COMPILED_NOTE = (
    "torch.compile(dynamic=False) of the reference's prologue_into, batch dim "
    "marked dynamic (B=1 its own compile); prepare() outside the compiled fn"
)

# --------------------------------------------------------------------------------- helpers


def poison_(t: torch.Tensor) -> None:
    """Fill with NaN (NaN bytes for FP8)."""
    if t.dtype in FP8_NAN_BYTE:
        t.view(torch.uint8).fill_(FP8_NAN_BYTE[t.dtype])
    else:
        t.fill_(float("nan"))


def min_bytes(
    B: int, H: int, P: int, R: int, L: int, act_bytes: int, w_bytes: float, kv_bytes: int
) -> int:
    """Each input read once, each output written once."""
    weights = H * P * L * w_bytes
    reads = B * H * (P + R) * act_bytes + B * (L + R) * act_bytes + B * 16 + B * R * 4
    writes = B * H * (L + R) * act_bytes + B * (L + R) * kv_bytes
    return int(weights + reads + writes)


@dataclass
class Runner:
    """One implementation on one layer: ``run()`` launches it; ``result`` holds its outputs
    (a tensor or the (q, q_pe_out, k_pe_out) tuple) after a run; ``outs`` are poisoned before
    the check; ``weight`` is the QuantizedWeight it ran with; ``code_slack`` the FP8 codes the
    rope part of a cache row may differ by (None: the comparison's default)."""

    run: Callable[[], Any]
    result: Any
    outs: list = field(default_factory=list)
    weight: Any = None
    code_slack: int | None = None
    ref_kw: dict = field(default_factory=dict)  # the reference's extra keywords (act_quant)


def prologue_check(inp, r: Runner) -> Callable:
    """check(replay): poison r's outputs and the layer's cache, replay, compare with the
    reference run from the poisoned cache (q, prefill outputs, every cache byte)."""

    def check(replay):
        for t in r.outs:
            poison_(t)
        poison_(inp.kv_cache)
        before = inp.kv_cache.clone()
        replay()
        sync(inp.q_nope.device)
        if r.code_slack is None:
            return check_against_reference(
                inp, r.result, before, w_uk_t=r.weight, **r.ref_kw
            ).problems
        cache_ref = before.clone()
        out_ref = inp.run(mla_prologue_ref, kv_cache=cache_ref, w_uk_t=r.weight)
        return compare(
            inp,
            r.result,
            out_ref,
            inp.kv_cache,
            cache_ref,
            before,
            w_uk_t=r.weight,
            fp8_code_slack=r.code_slack,
        ).problems

    return check


@dataclass
class Bench:
    smoke: bool
    device: str
    dims: dict
    layers: int
    num_blocks: int
    out_path: str | None
    header: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)
    sweep: list = field(default_factory=list)
    sweep_skipped: list = field(default_factory=list)
    failures: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    compiled: dict = field(default_factory=dict)
    copy_bw: float = 0.0

    @classmethod
    def for_run(
        cls, smoke: bool, max_tokens: int, layers: int | None = None, out_path: str | None = None
    ) -> Bench:
        """A smoke's (CPU, small dims, 2 layers) or a GPU run's (DeepSeek-V3 dims, 8 layers)
        state, with cache blocks for ``max_tokens`` tokens per layer."""
        return cls(
            smoke=smoke,
            device="cpu" if smoke else "cuda",
            dims=dict(SMOKE_DIMS if smoke else FULL_DIMS),
            layers=layers or (SMOKE_LAYERS if smoke else LAYERS),
            num_blocks=max(2, (2 * max_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE + 1),
            out_path=out_path,
        )

    @property
    def backend(self) -> str:
        return "interpreter" if self.smoke else "cuda"

    @property
    def num_sms(self) -> int:
        """The GPU's multiprocessors (1 under the interpreter)."""
        if self.smoke:
            return 1
        return torch.cuda.get_device_properties(torch.device(self.device)).multi_processor_count

    def time(self, calls, check=None, rep: int = 250) -> float:
        return timer(self.smoke)(calls, rep=rep, check=check)

    def fail(self, key: dict, problems: list) -> None:
        self.failures.append(dict(key, problems=list(problems)))
        print(f"!! FAILED {fmt_key(key)}: {'; '.join(problems)[:800]}", flush=True)

    def skip(self, what: str) -> None:
        self.skipped.append(what)
        print(f"   skipped: {what}", flush=True)

    def measure(
        self,
        key: dict,
        runners: list[Runner],
        check,
        nbytes: int | None = None,
        rep: int = 250,
        **extra,
    ) -> dict | None:
        """Check (on the captured graph), then time; a row only if the check passed."""
        try:
            us = self.time([r.run for r in runners], check=check, rep=rep)
        except CheckFailed as e:
            self.fail(key, e.problems)
            return None
        except Exception as e:  # noqa: BLE001 - report it, keep the other rows
            self.fail(key, [f"raised {type(e).__name__}: {str(e)[:600]}"])
            return None
        row = dict(key, us=round(us, 3))
        if nbytes:
            gbps = nbytes / (us * 1e-6) / 1e9
            row.update(
                gbps=round(gbps, 1),
                pct_copy_bw=round(100 * gbps / self.copy_bw, 1),
                min_bytes=int(nbytes),
            )
        row.update(correct=True, **extra)
        self.rows.append(row)
        print(f"   {fmt_key(key)}: {us:9.2f} us", flush=True)
        return row

    def save(self) -> None:
        if not self.out_path:
            return
        result = dict(header=self.header, rows=self.rows)
        if self.sweep:
            result["sweep"] = self.sweep
        if self.sweep_skipped:
            result["sweep_skipped"] = self.sweep_skipped
        if self.failures:
            result["failures"] = self.failures
        if self.skipped:
            result["skipped"] = self.skipped
        write_json(self.out_path, result)

    def inputs(self, B: int, H: int, kv_dtype, seed: int, num_decode_tokens=None) -> list:
        g = torch.Generator().manual_seed(seed)
        return [
            make_inputs(
                B,
                H=H,
                **self.dims,
                num_decode_tokens=num_decode_tokens,
                dtype=torch.bfloat16,
                kv_dtype=kv_dtype,
                block_size=BLOCK_SIZE,
                num_blocks=self.num_blocks,
                kv_scale="tensor",
                device=self.device,
                generator=g,
            )
            for _ in range(self.layers)
        ]

    def compiled_fn(self, name: str):
        if name not in self.compiled:
            self.compiled[name] = torch.compile(make_compiled_body(), dynamic=False, fullgraph=True)
        return self.compiled[name]


def fmt_key(key: dict) -> str:
    parts = [key.get("op", ""), key.get("impl", "")]
    for k in ("w_dtype", "kv_dtype", "q_dtype", "H", "B"):
        if key.get(k) is not None:
            parts.append(f"{k}={key[k]}")
    return " ".join(str(p) for p in parts)


def empty_outs(x, H: int) -> tuple:
    R = x.q_pe.shape[-1]
    dev = x.q_nope.device
    return (
        torch.empty(0, H, R, dtype=torch.bfloat16, device=dev),
        torch.empty(0, R, dtype=torch.bfloat16, device=dev),
    )


def quantized(x, fmt: str):
    """This layer's W_UK_T in ``fmt`` (made once per layer); bf16 -> the plain tensor."""
    if fmt == "bf16":
        return x.w_uk_t
    fmt = "fp8" if fmt == "fp8xfp8" else fmt  # the same weights, FP8 activations
    cache = x.extra.setdefault("qw", {})
    if fmt not in cache:
        cache[fmt] = (
            quantize_fp8_weight(x.w_uk_t) if fmt == "fp8" else quantize_mxfp4_weight(x.w_uk_t)
        )
    return cache[fmt]


def mark_batch_dynamic(x, out) -> None:
    """Only the batch dim dynamic, on every per-token tensor and the bases of the views (dynamo
    sees q_nope / q_pe / kv_c / k_pe through their base)."""
    ts = [x.q_nope, x.q_pe, x.kv_c, x.k_pe, x.positions, x.slot_mapping, out]
    ts += [t._base for t in (x.q_nope, x.kv_c) if t._base is not None]
    for t in ts:
        torch._dynamo.mark_dynamic(t, 0)


# --------------------------------------------------------------------------------- runners


def laid_out(w, layout: str):
    """The same weight stored L-contiguous ("l") or K-major ("k": ``[H, L, P]`` storage seen as
    ``[H, P, L]``)."""
    if isinstance(w, QuantizedWeight):
        return QuantizedWeight(laid_out(w.data, layout), w.scale, w.format)
    return w.contiguous() if layout == "l" else w.transpose(1, 2).contiguous().transpose(1, 2)


def fused_runner(x, out, fmt="bf16", cfg=None, layout: str | None = None, q_scale=None) -> Runner:
    """The fused kernel on layer ``x`` with its weight in ``fmt``: through the public op
    (``cfg`` None), or prepared once and launched with tile config ``cfg``; ``layout`` "l" /
    "k" re-stores the weight (:func:`laid_out`; None: as quantized); ``q_scale``: the FP8
    query's scale when ``out`` is FP8 (vLLM's FLASHMLA decode query)."""
    w = quantized(x, fmt)
    if layout is not None:
        w = laid_out(w, layout)
    args = list(x.args())
    args[4] = w
    weight = None if fmt == "bf16" else w
    ref_kw = {"act_quant": "fp8"} if fmt == "fp8xfp8" else {}
    if q_scale is not None:
        ref_kw.update(q_scale=q_scale, q_out_dtype=out.dtype)
    if cfg is None:

        def run():
            return mla_decode_prologue(*args, kv_scale=x.kv_scale, out=out, **ref_kw)
    else:
        prepared = prepare(*args, kv_scale=x.kv_scale, out=out, **ref_kw)

        def run():
            launch(prepared, cfg)

    return Runner(run, out, [out], weight, ref_kw=ref_kw)


def decode_runner(impl: str, x, H: int, b: Bench) -> Runner:
    B = x.q_nope.shape[0]
    L, R = x.kv_c.shape[1], x.q_pe.shape[-1]
    out = torch.empty(B, H, L + R, dtype=torch.bfloat16, device=x.q_nope.device)
    if impl == "fused":
        return fused_runner(x, out)
    if impl == "engine_4kernel":
        e = EnginePrologue(x, out)
        return Runner(e.run, out, e.buffers, code_slack=1)
    if impl == "reference_eager":
        return Runner(
            lambda: mla_decode_prologue_ref(*x.args(), kv_scale=x.kv_scale, out=out), out, [out]
        )
    if impl == "unfused_compiled":
        fn = b.compiled_fn("decode")
        qpo, kpo = empty_outs(x, H)
        if B > 1:
            mark_batch_dynamic(x, out)
        return Runner(lambda: fn(*x.args(), x.kv_scale, out, qpo, kpo), out, [out])
    if impl == "cublas_bmm_only":
        ql = torch.empty(H, B, L, dtype=torch.bfloat16, device=x.q_nope.device)
        return Runner(lambda: torch.bmm(x.q_nope.transpose(0, 1), x.w_uk_t, out=ql), ql, [ql])
    raise ValueError(impl)


def aiter_peers(layers: list, cfg: dict | None, weight_layout: str = "aiter") -> list:
    """AMD AITER's fused kernel (``aiter_peer.AiterPrologue``) on each layer's inputs with the
    layer's FP8 weight (``cfg`` None: AITER's default config), each launched once so it is
    compiled outside the graph."""
    from benchmarks import aiter_peer as ap

    peers = []
    for x in layers:
        w = quantized(x, "fp8")
        peers.append(
            ap.AiterPrologue(
                w.data,
                w.scale,
                x.q_nope,
                x.q_pe,
                x.kv_c,
                x.k_pe,
                x.positions,
                x.cos_cache,
                x.sin_cache,
                x.kv_cache,
                x.slot_mapping,
                kv_scale=x.kv_scale,
                is_neox=False,
                config=cfg,
                weight_layout=weight_layout,
            )
        )
        peers[-1]()
    return peers


def aiter_check(p, x) -> Callable:
    """check(replay) for AITER peer ``p`` on layer ``x``: poison its q and the cache, replay,
    compare with ``aiter_peer.reference`` (``aiter_peer.check``'s tolerances)."""
    from benchmarks import aiter_peer as ap

    def check(replay):
        poison_(p.q_out)
        poison_(x.kv_cache)
        before = x.kv_cache.clone()
        replay()
        sync(x.q_nope.device)
        ref_q, ref_cache = ap.reference(p, before)
        return ap.check(p, ref_q, ref_cache)

    return check


def bmm_check(x, r: Runner) -> Callable:
    def check(replay):
        poison_(r.result)
        replay()
        sync(x.q_nope.device)
        got = r.result.transpose(0, 1).float()
        want = torch.einsum("bhp,hpl->bhl", x.q_nope.double(), x.w_uk_t.double())
        probs = []
        if torch.isnan(got).any():
            probs.append("bmm output has NaN (not written?)")
        err = rel_err(got, want)
        if not err < 8e-3:
            probs.append(f"bmm output: relative L2 error vs float64 {err:.3g} >= 8e-3")
        return probs

    return check


# --------------------------------------------------------------------------------- device


def copy_bandwidth_gbps(device: str) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s), median of many."""
    if torch.device(device).type != "cuda":
        n = 1 << 26
        src = torch.randn(n // 4)
        dst = torch.empty_like(src)
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        return 2 * n * 5 / (time.perf_counter() - t0) / 1e9
    n = 1 << 30
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * n / (ms * 1e-3) / 1e9


def empty_cache(b: Bench) -> None:
    if not b.smoke:
        torch.cuda.empty_cache()
