"""bench_prologue.py's PDL chains (``--chain``), floors (``--floors``) and the self-test of its
checks (negative controls, run first in every mode)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import torch

from benchmarks.bench_core import (
    BLOCK_SIZE,
    KV_NAMES,
    Q_LORA_RANK,
    W_FORMATS,
    Bench,
    Runner,
    decode_runner,
    empty_cache,
    fused_runner,
    poison_,
    prologue_check,
)
from benchmarks.common import CheckFailed, sync
from benchmarks.peers import empty_launch, rotary, weight_read, weight_read_programs
from fusemla.ops.prologue.api import mla_prologue
from fusemla.testing import check_against_reference, make_inputs, rel_err
from fusemla.testing.pdl_probe import produce

# --------------------------------------------------------------------------------- chains


def chain_layers(b: Bench, B: int, H: int, seed: int) -> list:
    """Per layer: the prologue's inputs fed by a q_b_proj GEMM (x @ W_qb) and by Triton
    producers (src -> base), the prologue's output, and the next kernel's output."""
    P, R, L = b.dims["P"], b.dims["R"], b.dims["L"]
    layers = b.inputs(B, H, torch.bfloat16, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for x in layers:
        dev = x.q_nope.device
        e = x.extra
        e["x"] = torch.randn(B, Q_LORA_RANK, generator=g).to(torch.bfloat16).to(dev)
        e["w_qb"] = (
            (torch.randn(Q_LORA_RANK, H * (P + R), generator=g) * Q_LORA_RANK**-0.5)
            .to(torch.bfloat16)
            .to(dev)
        )
        e["qbuf"] = torch.empty(B, H * (P + R), dtype=torch.bfloat16, device=dev)
        e["q_base"], e["kv_base"] = x.q_nope._base, x.kv_c._base
        e["q_src"], e["kv_src"] = e["q_base"].clone(), e["kv_base"].clone()
        e["out"] = torch.zeros(B, H, L + R, dtype=torch.bfloat16, device=dev)
        e["dst"] = torch.empty(B * H * (L + R), dtype=torch.bfloat16, device=dev)
    return layers


def chain_call(x, chain: str, pdl: bool, with_prologue: bool, P: int, H: int):
    e = x.extra
    B = x.q_nope.shape[0]
    if chain == "qb_gemm_chain":
        q3 = e["qbuf"].view(B, H, -1)
        q_nope, q_pe = q3[..., :P], q3[..., P:]
    else:
        q_nope, q_pe = x.q_nope, x.q_pe
    args = list(x.args())
    args[0], args[1] = q_nope, q_pe

    def run():
        if chain == "qb_gemm_chain":
            torch.mm(e["x"], e["w_qb"], out=e["qbuf"])
        else:
            produce(e["q_src"], e["q_base"], 1.0, pdl=pdl)
            produce(e["kv_src"], e["kv_base"], 1.0, pdl=pdl)
        if with_prologue:
            mla_prologue(*args, kv_scale=x.kv_scale, out=e["out"])
        produce(e["out"].view(-1), e["dst"], 1.0, pdl=pdl)

    return run, q_nope, q_pe


def chain_check(
    layers, chain: str, with_prologue: bool, P: int, H: int, rounds: int = 1
) -> Callable:
    """Poison every layer's intermediates (the producers' outputs), the prologue's output and
    cache and the next kernel's output; replay; compare every layer; ``rounds`` times (a race
    need not show on the first replay)."""

    def check(replay):
        for _ in range(rounds):
            probs = one_round(replay)
            if probs:
                return probs
        return []

    def one_round(replay):
        befores = []
        for x in layers:
            e = x.extra
            produced = [e["qbuf"]] if chain == "qb_gemm_chain" else [e["q_base"], e["kv_base"]]
            # without the prologue nothing writes out: it keeps its zeros for the dst check
            for t in produced + [e["dst"]] + ([e["out"]] if with_prologue else []):
                poison_(t)
            poison_(x.kv_cache)
            befores.append(x.kv_cache.clone())
        replay()
        sync(layers[0].q_nope.device)
        probs = []
        for i, (x, before) in enumerate(zip(layers, befores)):
            e = x.extra
            if chain == "qb_gemm_chain":
                want = torch.mm(e["x"], e["w_qb"])
                if not (
                    torch.equal(e["qbuf"], want) or rel_err(e["qbuf"].float(), want.float()) < 1e-2
                ):
                    probs.append(f"layer {i}: q_b_proj output wrong")
            else:
                for src, dst in (("q_src", "q_base"), ("kv_src", "kv_base")):
                    if not torch.equal(e[src], e[dst]):
                        probs.append(f"layer {i}: producer output {dst} wrong")
            if with_prologue:
                view = x
                if chain == "qb_gemm_chain":
                    q3 = e["qbuf"].view(x.q_nope.shape[0], H, -1)
                    view = type(x)(**{**x.__dict__, "q_nope": q3[..., :P], "q_pe": q3[..., P:]})
                res = check_against_reference(view, e["out"], before)
                probs += [f"layer {i}: {p}" for p in res.problems]
            if not torch.equal(e["dst"].view(torch.int16), e["out"].view(-1).view(torch.int16)):
                probs.append(
                    f"layer {i}: the next kernel's output differs from the prologue's "
                    "q (stale read?)"
                )
        return probs

    return check


def chain_rows(b: Bench, a) -> None:
    P = b.dims["P"]
    for H, B in itertools.product(a.heads, a.chain_batches):
        layers = chain_layers(b, B, H, seed=9000 + H + B)
        for chain in ("qb_gemm_chain", "triton_producer_chain"):
            for variant, pdl, with_prologue in (
                ("producers_only", False, False),
                ("pdl_off", False, True),
                ("pdl_on", True, True),
            ):
                impl = f"{chain}_{variant}"
                key = dict(op="pdl_chain", impl=impl, w_dtype="bf16", kv_dtype="bf16", H=H, B=B)
                if pdl and b.smoke:
                    b.skip(f"{impl} H={H} B={B}: PDL needs an sm_90+ GPU (not the interpreter)")
                    continue
                os.environ["FUSEMLA_PDL"] = "on" if pdl else "off"
                try:
                    calls = [chain_call(x, chain, pdl, with_prologue, P, H)[0] for x in layers]
                    runners = [Runner(c, None) for c in calls]
                    check = chain_check(layers, chain, with_prologue, P, H, rounds=3 if pdl else 1)
                    b.measure(
                        key,
                        runners,
                        check,
                        pdl=pdl,
                        prologue=with_prologue,
                        producer="cuBLAS q_b_proj GEMM"
                        if chain == "qb_gemm_chain"
                        else "two Triton producers (pdl_probe.produce)",
                        consumer="pdl_probe.produce reading q",
                    )
                finally:
                    os.environ["FUSEMLA_PDL"] = "off"
        del layers
        empty_cache(b)
        b.save()


def floor_rows(b: Bench, a) -> None:
    dev = b.device
    flags = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(b.layers)]

    def empty_check(replay):
        for f in flags:
            f.zero_()
        replay()
        sync(dev)
        return [] if all(int(f.item()) == 1 for f in flags) else ["empty kernel did not run"]

    b.measure(
        dict(op="floor", impl="empty_launch", w_dtype=None, kv_dtype=None, H=None, B=None),
        [Runner(lambda f=f: empty_launch(f), None) for f in flags],
        empty_check,
        note="one 1-program Triton kernel per layer (stores one int32)",
    )
    P, L = b.dims["P"], b.dims["L"]
    for H in a.heads:
        torch.manual_seed(H)
        ws = [torch.randn(H, P, L, device=dev).to(torch.bfloat16) for _ in range(b.layers)]
        key = dict(op="floor", impl="weight_read", w_dtype="bf16", kv_dtype=None, H=H, B=None)
        best = weight_read_floor(b, ws, key)
        if best:
            nbytes = H * P * L * 2
            gbps = nbytes / (best[0] * 1e-6) / 1e9
            b.rows.append(
                dict(
                    key,
                    us=round(best[0], 3),
                    gbps=round(gbps, 1),
                    pct_copy_bw=round(100 * gbps / b.copy_bw, 1),
                    min_bytes=nbytes,
                    correct=True,
                    config=best[1],
                    note=f"best of {len(WEIGHT_READ_GRIDS)} grids; reads W_UK_T once, one fp32 "
                    "per program",
                )
            )
            print(f"   floor weight_read H={H}: best {best[0]:.2f} us {best[1]}")
        ws = None
        empty_cache(b)
    b.save()


#: the weight-read floor's grids: (programs per multiprocessor, elements per block)
WEIGHT_READ_GRIDS = ((2, 1024), (4, 2048), (8, 1024), (16, 512))


def weight_read_floor(b: Bench, ws: list, key: dict) -> tuple[float, dict] | None:
    """The fastest of :data:`WEIGHT_READ_GRIDS` reading every weight in ``ws`` (one per layer)
    once: ``(us, config)``, or None when none ran. Each grid's partial sums are checked (their
    sum is the weight's) before it is timed; a wrong or failing grid goes to ``b.fail``."""
    dev = b.device
    best = None
    for pps, block in WEIGHT_READ_GRIDS:
        grid, per = weight_read_programs(ws[0].numel(), pps * b.num_sms, block)
        parts = [torch.empty(grid, dtype=torch.float32, device=dev) for _ in ws]

        def check(replay, parts=parts):
            for p in parts:
                poison_(p)
            replay()
            sync(dev)
            probs = []
            for i, (w, p) in enumerate(zip(ws, parts)):
                want = float(w.double().sum())
                tol = 1e-4 * float(w.double().abs().sum())
                if not abs(float(p.double().sum()) - want) <= tol:
                    probs.append(f"layer {i}: sum of partial sums wrong")
            return probs

        calls = [
            lambda w=w, p=p, n=pps * b.num_sms, blk=block: weight_read(w, p, n, blk)
            for w, p in zip(ws, parts)
        ]
        cfg = dict(programs=grid, programs_per_sm=pps, block=block, elements_per_program=per)
        try:
            us = b.time(calls, check=check)
        except CheckFailed as e:
            b.fail(dict(key, config=cfg), e.problems)
            continue
        except Exception as e:  # noqa: BLE001
            b.fail(dict(key, config=cfg), [f"raised {type(e).__name__}: {e}"])
            continue
        print(f"   floor weight_read H={ws[0].shape[0]} programs={grid} block={block}: {us:.2f} us")
        if best is None or us < best[0]:
            best = (us, cfg)
    return best


# --------------------------------------------------------------------------------- self-test


def self_test(b: Bench) -> None:
    """Negative controls of the checks (a check that cannot fail proves nothing): a NaN in q, a
    changed cache byte of a quantized-weight run, a stray cache write must each be caught; the
    engine's rotary kernel agrees with fusemla.rope.apply_rope in both pair styles."""
    from fusemla.rope import apply_rope

    H, B = (2, 5) if b.smoke else (16, 5)
    problems = []
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        x = make_inputs(
            B,
            H=H,
            **b.dims,
            kv_dtype=kv,
            block_size=BLOCK_SIZE,
            kv_scale="tensor",
            device=b.device,
            generator=torch.Generator().manual_seed(1),
        )
        L, R = x.kv_c.shape[1], x.q_pe.shape[-1]
        for fmt in W_FORMATS:
            out = torch.empty(B, H, L + R, dtype=torch.bfloat16, device=b.device)
            r = fused_runner(x, out, fmt)
            check = prologue_check(x, r)
            base = list(check(r.run))
            if base:
                problems.append(
                    f"self-test {fmt} kv={KV_NAMES[kv]}: the fused kernel failed: {base}"
                )
                continue
            slot = int(x.slot_mapping[0])
            row = (slot // BLOCK_SIZE, slot % BLOCK_SIZE)
            free = next(
                s
                for s in range(x.kv_cache.shape[0] * BLOCK_SIZE)
                if s not in set(x.slot_mapping.tolist())
            )

            def nan_q():
                r.run()
                out[0, 0, 0] = float("nan")

            def bad_cache_byte():
                r.run()
                c = (
                    x.kv_cache.view(torch.uint8)
                    if x.kv_cache.element_size() == 1
                    else x.kv_cache.view(torch.int16)
                )
                c[row[0], row[1], L + 1] += 3  # rope part, beyond any slack

            def stray_write():
                r.run()
                bits = x.kv_cache.view(torch.uint8)  # FP8 or bf16: a byte pattern, not NaN
                bits[free // BLOCK_SIZE, free % BLOCK_SIZE, :2] = 0

            for name, corrupt in (
                ("NaN in q", nan_q),
                ("changed cache byte", bad_cache_byte),
                ("stray cache write", stray_write),
            ):
                if not check(corrupt):
                    problems.append(f"self-test {fmt} kv={KV_NAMES[kv]}: the check missed a {name}")
    # padding slots (-1, as CUDA-graph padding): the fused kernel and the engine's cache kernel
    # skip them (the timed rows have none)
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        x = make_inputs(
            8,
            H=H,
            **b.dims,
            kv_dtype=kv,
            block_size=BLOCK_SIZE,
            pad_fraction=0.4,
            kv_scale="tensor",
            device=b.device,
            generator=torch.Generator().manual_seed(3),
        )
        L, R = x.kv_c.shape[1], x.q_pe.shape[-1]
        for name in ("fused", "engine_4kernel"):
            r = decode_runner(name, x, H, b)
            p = list(prologue_check(x, r)(r.run))
            problems += [f"self-test {name} with padding slots kv={KV_NAMES[kv]}: {q}" for q in p]
    # the engine's rotary kernel vs fusemla.rope, both pair styles, fp32 caches; 40 heads: three
    # head blocks of 16, the last one masked
    g = torch.Generator().manual_seed(2)
    R, Hr = b.dims["R"], 40
    qp = torch.randn(B, Hr, R, generator=g).to(torch.bfloat16).to(b.device)
    kp = torch.randn(B, R, generator=g).to(torch.bfloat16).to(b.device)
    pos = torch.randint(0, 64, (B,), generator=g).to(b.device)
    ang = torch.rand(64, R // 2, generator=g, dtype=torch.float64) * 6.3
    cos, sin = ang.cos().float().to(b.device), ang.sin().float().to(b.device)
    for neox in (False, True):
        qo = torch.full_like(qp, float("nan"))
        ko = torch.full_like(kp, float("nan"))
        rotary(pos, cos, sin, qp, kp, qo, ko, is_neox=neox)
        sync(b.device)
        wq = apply_rope(qp, cos[pos][:, None], sin[pos][:, None], neox).to(torch.bfloat16)
        wk = apply_rope(kp, cos[pos], sin[pos], neox).to(torch.bfloat16)
        for name, got, want in (("q", qo, wq), ("k", ko, wk)):
            d = (got.float() - want.float()).abs()
            if not bool((d <= 2**-7 * want.float().abs() + 1e-6).all()):
                problems.append(
                    f"self-test rotary is_neox={neox}: {name} differs from "
                    f"fusemla.rope.apply_rope by up to {float(d.max()):.3g}"
                )
    for p in problems:
        b.fail(dict(op="self_test", impl="checks"), [p])
    print(
        f"   self-test: {'ok' if not problems else f'{len(problems)} problems'} (negative "
        "controls of the checks, rotary kernel vs fusemla.rope)",
        flush=True,
    )
