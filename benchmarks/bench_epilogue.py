"""The fused MLA decode epilogue against what engines run: cuBLAS bmm into o_proj's input
(vLLM's ``_v_up_proj``), and bmm + ``per_token_group_quant_fp8`` for a block-FP8 o_proj.

Rows: heads x batch x W_UV format (bf16; FP8 with DeepSeek's 128 x 128 block scales, read as
the checkpoint stores them) x output (bf16; FP8 codes + per-128 group scales). Every row is
checked on the captured graph before it is timed (outputs poisoned, replayed, compared with
the fp32 reference: bf16 within one ulp, FP8 scales to fp32 rounding and codes within one
step); with vLLM importable, the FP8 rows are also compared with vLLM's own quantization of
the bf16-rounded product, and the baseline's quantization is vLLM's kernel (else a Triton
stand-in written here, named so in the JSON). Timing: docs/method.md (at least eight layers of
weights and enough that their W_UV exceeds 3x the L2, one CUDA graph, median). ``--sweep``: the
tile configs at a few batches (``--sweep-grid split``: the small-batch study of more programs
per head, a split latent and FP8 groups cut among programs, in a few minutes).
``--smoke``: the CPU run (Triton's interpreter, small dims, every row still checked; the times
mean nothing).

    python -m benchmarks run bench_epilogue --out benchmarks/results/h200_epilogue.json
    python -m benchmarks.bench_epilogue --heads 16 --no-rows --sweep --sweep-grid split \
        --sweep-batches 1 32 --sweep-kinds fp8/bf16 fp8/fp8_block --out D/h200_epilogue_split.json
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.bench_core import Bench, Runner, copy_bandwidth_gbps, poison_
from benchmarks.common import ensure_interpreter, parser, run_header, sync, verdict
from fusemla.contracts.epilogue import prepare
from fusemla.ops.epilogue import configs
from fusemla.ops.epilogue.launch import launch, plan
from fusemla.quant import QuantizedWeight, split_kv_b_proj_fp8
from fusemla.reference.epilogue import group_quant_fp8, product_f32
from fusemla.testing import stable_seed
from fusemla.testing.compare import fp8_ordinal

FP8 = torch.float8_e4m3fn
FULL = dict(P=128, L=512, V=128)
SMOKE = dict(P=32, L=64, V=32)
HEADS, BATCHES = [16, 128], [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
SWEEP_BATCHES = [1, 16, 64, 256]
#: the sweep's (output, W_UV) kinds: bf16 out of bf16 W (vLLM's own W_UV) and of block-FP8 W
#: (the layer's bf16 o_proj with W_UV as stored), FP8 out of bf16 W (the plugin's default FP8
#: handoff) and of block-FP8 W (FUSEMLA_VLLM_W_UK=stored)
KINDS = (("bf16", "bf16"), ("bf16", "fp8_block"), ("fp8", "bf16"), ("fp8", "fp8_block"))
GROUP = 128
SMOKE_GROUP = 16


# ----------------------------------------------------------------------------- the baseline's quant


@triton.jit
def _group_quant_stand_in(p_x, p_q, p_s, s_x, s_s_t, s_s_g, G: tl.constexpr, NG: tl.constexpr):
    """Per token and group FP8 quantization (vLLM's rule), one program per (token, group)."""
    pid = tl.program_id(0)
    t, g = pid // NG, pid % NG
    o = tl.arange(0, G)
    x = tl.load(p_x + t * s_x + g * G + o).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x)), 1e-10) * (1.0 / 448.0)
    y = tl.minimum(tl.maximum(x / s, -448.0), 448.0)
    tl.store(p_q + t * s_x + g * G + o, y.to(p_q.dtype.element_ty))
    tl.store(p_s + t * s_s_t + g * s_s_g, s)


def _vllm_quant():
    """vLLM's ``per_token_group_quant_fp8``, or None where vLLM is not importable."""
    try:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (
            per_token_group_quant_fp8,
        )
    except Exception:  # noqa: BLE001 - no vLLM here: the stand-in times the quant
        return None
    return per_token_group_quant_fp8


def quant_fn(vllm_quant, group: int):
    """(name, fn(x [N, C] bf16, q, s) -> scales) of the baseline's group quantization: the
    scales tensor it wrote (vLLM's function allocates its own, as it does inside o_proj; the
    baseline is charged for nothing vLLM does not run)."""
    if vllm_quant is not None:

        def run(x, q, s):
            return vllm_quant(x, group, out_q=q, use_ue8m0=False)[1]

        return "vllm.per_token_group_quant_fp8", run

    def run(x, q, s):
        N, C = x.shape
        _group_quant_stand_in[(N * (C // group),)](
            x, q, s, x.stride(0), s.stride(0), s.stride(1), G=group, NG=C // group
        )
        return s

    return "triton stand-in (bench_epilogue._group_quant_stand_in)", run


# ----------------------------------------------------------------------------- inputs


def layer_weights(H: int, dims: dict, device: str, seed: int):
    """(bf16 W_UV [H, L, V] as vLLM holds it, block-FP8 W_UV as the checkpoint stores it) from
    a random block-FP8 kv_b_proj."""
    P, L, V = dims["P"], dims["L"], dims["V"]
    g = torch.Generator().manual_seed(seed)
    blk = 128 if P % 128 == 0 else 16
    w = (torch.randn(H * (P + V), L, generator=g) * 0.5).to(FP8)
    s = torch.rand(H * (P + V) // blk, -(-L // blk), generator=g) * 0.02 + 0.005
    w, s = w.to(device), s.to(device)
    _, w_uv = split_kv_b_proj_fp8(
        w, s, num_heads=H, qk_nope_head_dim=P, v_head_dim=V, block_size=(blk, blk)
    )
    bf16 = w_uv.dequantize(torch.bfloat16)
    # vLLM's layout: a transposed view of [L, H, V]
    return bf16.transpose(0, 1).contiguous().transpose(0, 1), w_uv


#: the layers' bf16 W_UV together are at least this many times the GPU's L2 (60 MB on the
#: H200): at 16 heads a layer's W_UV is 2 MiB, so the prologue's 8 layers (16 MiB) would sit
#: in L2 and flatter the kernel that streams it from fewer programs (H200, 9804a32: 6.5 us in
#: the 8-layer graph, 6.7 us in vLLM at 61 layers, where cuBLAS's bmm took 3.3 us, not 4.4)
L2_MULTIPLE = 3


def layer_count(b: Bench, H: int) -> int:
    """How many layers' weights the graph rotates through at ``H`` heads: ``b.layers``, or
    more where their W_UV would fit :data:`L2_MULTIPLE` times in the GPU's L2."""
    if b.smoke:
        return b.layers
    per_layer = H * b.dims["L"] * b.dims["V"] * 2
    l2 = torch.cuda.get_device_properties(torch.device(b.device)).L2_cache_size
    return max(b.layers, -(-L2_MULTIPLE * l2 // per_layer))


def all_layer_weights(b: Bench, H: int) -> list:
    """Every layer's (bf16, block-FP8) W_UV, seeded per head count and layer."""
    n = layer_count(b, H)
    b.header.setdefault("layers_per_heads", {})[str(H)] = n
    return [layer_weights(H, b.dims, b.device, stable_seed("epi-w", H, i)) for i in range(n)]


def attention_outputs(b: Bench, H: int, B: int) -> list:
    """Every layer's attention output [B, H, L] bf16, seeded per head count and batch."""
    g = torch.Generator().manual_seed(stable_seed("epi-x", H, B))
    return [
        torch.randn(B, H, b.dims["L"], generator=g).to(torch.bfloat16).to(b.device)
        for _ in range(layer_count(b, H))
    ]


def fused_runner(x, w, out_fp8: bool, group: int, cfg=None) -> Runner:
    args = prepare(x, w, out_dtype=FP8 if out_fp8 else None, group_size=group)
    outs = [args.out] + ([args.scale_out] if out_fp8 else [])
    return Runner(lambda: launch(args, cfg), outs=outs, result=args, weight=w)


def bmm_runner(x, w_bf16, quant=None, group: int = GROUP) -> Runner:
    N, H, L = x.shape
    V = w_bf16.shape[2]
    out = torch.empty(N, H * V, dtype=x.dtype, device=x.device)
    xt = x.transpose(0, 1)
    ot = out.view(N, H, V).transpose(0, 1)
    if quant is None:
        return Runner(lambda: torch.bmm(xt, w_bf16, out=ot), outs=[out], result=out)
    q = torch.empty(N, H * V, dtype=FP8, device=x.device)
    s = torch.empty(N, H * V // group, dtype=torch.float32, device=x.device)
    r = Runner(None, outs=[out, q, s], result=(q, s))

    def run():
        torch.bmm(xt, w_bf16, out=ot)
        # the scales of the last call: the captured call's live in the graph's pool and every
        # replay rewrites them, so the check poisons and reads those
        r.result = (q, quant(out, q, s))
        r.outs[2] = r.result[1]

    r.run = run
    return r


# ----------------------------------------------------------------------------- checks


def fused_check(runners: list[Runner], vllm_quant, key: dict):
    """check(replay): poison, replay, compare every layer with the fp32 reference."""

    def check(replay):
        for r in runners:
            for t in r.outs:
                poison_(t)
        replay()
        sync(runners[0].outs[0].device)
        problems = []
        for r in runners:
            problems += compare_fused(r.result, vllm_quant, key)
        return problems

    return check


def compare_fused(args, vllm_quant, key: dict) -> list[str]:
    spec = args.spec
    y = product_f32(args)
    if not spec.fp8_out:
        # one bf16 ulp of the result, plus what two fp32 summation orders can differ by
        # (3 (L + 4) 2^-24 sum |x w|, the tests' bound)
        want = y.to(args.out.dtype)
        diff = (args.out.float() - want.float()).abs()
        ulp = want.float().abs().clamp_min(1e-30) * 2.0**-7
        w = args.w_uv
        absw = w.dequantize() if isinstance(w, QuantizedWeight) else w.float()
        mag = torch.bmm(args.attn_out.float().abs().transpose(0, 1), absw.abs())
        mag = mag.transpose(0, 1).reshape(diff.shape)
        bound = ulp + 3 * (spec.L + 4) * 2.0**-24 * mag
        bad = int((diff > bound).sum())
        return (
            [f"{bad} bf16 outputs off the fp32 reference beyond one ulp + fp32 order"]
            if bad
            else []
        )
    codes, s = group_quant_fp8(y, spec.group_size, args.out.dtype)
    problems = []
    srel = float(((args.scale_out - s).abs() / s).max())
    if srel > 1e-5:
        problems.append(f"scales {srel:.2e} relative from the reference's")
    steps = (fp8_ordinal(args.out) - fp8_ordinal(codes)).abs()
    if int(steps.max()) > 1 or float((steps > 0).float().mean()) > 0.01:
        problems.append(
            f"codes: max {int(steps.max())} steps, {float((steps > 0).float().mean()):.3%} differ"
        )
    key["codes_off_by_one"] = float((steps > 0).float().mean())
    if vllm_quant is not None:  # vLLM's own quantization of the bf16-rounded product
        vq, vs = vllm_quant(y.to(torch.bfloat16).contiguous(), spec.group_size, use_ue8m0=False)
        vsteps = (fp8_ordinal(args.out) - fp8_ordinal(vq)).abs()
        key["vs_vllm_max_steps"] = int(vsteps.max())
        key["vs_vllm_share_off"] = float((vsteps > 0).float().mean())
        key["vs_vllm_scale_rel"] = float(((args.scale_out - vs).abs() / vs).max())
        if int(vsteps.max()) > 1:
            problems.append(f"codes {int(vsteps.max())} steps from vLLM's quantization")
    return problems


def bmm_check(runners: list[Runner], xs, ws, group: int):
    def check(replay):
        for r in runners:
            for t in r.outs:
                poison_(t)
        replay()
        sync(xs[0].device)
        problems = []
        for r, x, w in zip(runners, xs, ws):
            res = r.result[0].float() if isinstance(r.result, tuple) else r.result
            if isinstance(r.result, tuple):
                res = res * r.result[1].repeat_interleave(group, dim=1)
            want = torch.bmm(x.float().transpose(0, 1), w.float()).transpose(0, 1)
            err = float((res.float() - want.reshape(res.shape)).norm() / want.norm())
            if not err < (0.08 if isinstance(r.result, tuple) else 0.01):
                problems.append(f"baseline off the fp32 product by {err:.3f} (relative L2)")
        return problems

    return check


# ----------------------------------------------------------------------------- rows


def rows(b: Bench, a, vllm_quant) -> None:
    qname, quant = quant_fn(vllm_quant, a.group)
    b.header["baseline_quant"] = qname
    for H in a.heads:
        layers = all_layer_weights(b, H)
        for B in a.batches:
            xs = attention_outputs(b, H, B)
            for out in ("bf16", "fp8"):
                fp8 = out == "fp8"
                base = [
                    bmm_runner(x, w[0], quant if fp8 else None, a.group) for x, w in zip(xs, layers)
                ]
                key = dict(op="epilogue", impl="cublas_bmm" + ("+quant" if fp8 else ""), H=H, B=B)
                key.update(w_dtype="bf16", out=out)
                row = b.measure(key, base, bmm_check(base, xs, [w[0] for w in layers], a.group))
                base_us = row["us"] if row else None
                for wf in ("bf16", "fp8_block"):
                    ws = [w[0] if wf == "bf16" else w[1] for w in layers]
                    fused = [fused_runner(x, w, fp8, a.group) for x, w in zip(xs, ws)]
                    key = dict(op="epilogue", impl="fused", H=H, B=B, w_dtype=wf, out=out)
                    pl = plan(fused[0].result)
                    key.update(bucket=pl.bucket, tiles=pl.cfg)
                    extra: dict = {}
                    row = b.measure(key, fused, fused_check(fused, vllm_quant, extra))
                    if row:
                        row.update(extra)
                        if base_us:
                            row["vs_baseline"] = round(row["us"] / base_us, 3)
            b.save()  # after every batch: a run cut short keeps what it measured


#: the sweep's tile grids: "full" every combination; "split" the small-batch study of more
#: programs per head (SPLIT of the latent, FP8 groups cut among GROUP / BLOCK_V programs) at
#: the few pipeline shapes that won before, for a lease with little time
GRIDS = {
    "full": dict(
        bt=(16, 32, 64),
        bv=(32, 64, 128),
        bk=(64, 128, 256),
        # deeper pipelines (4-5 stages: at 16 heads and one token tile a program streams a
        # whole head's W_UV, 128 KiB, and more of it in flight is the only lever) and 16 warps
        nwns=((4, 3), (8, 3), (4, 2), (8, 4), (8, 5), (16, 3)),
        sp=(1, 2, 4, 8),
    ),
    # BLOCK_V 16: 8 programs per head and group, 128 at 16 heads (the prologue's count there,
    # whose 2 MiB of W_UK stream in ~2.9 us per layer in vLLM at full depth)
    "split": dict(
        bt=(16,), bv=(16, 32, 64, 128), bk=(128,), nwns=((4, 3), (8, 3), (8, 5)), sp=(1, 2, 4)
    ),
    # 64-row latent chunks, so SPLIT reaches 8 (128 programs at 16 heads for an FP8 output):
    # the a85ce66 stage probe put 16 heads' B = 1 time in streaming W_UV at 64 programs
    # (2.4-2.9 us) and the split's meeting (1.2-1.7 us)
    "few": dict(
        bt=(16,), bv=(32, 64, 128), bk=(64,), nwns=((4, 3), (4, 5), (8, 3)), sp=(1, 2, 4, 8)
    ),
    # the CUDA cores' products (cfg GEMV) for a few tokens: token tiles of 1-8 rows (no MMA
    # padding to 16), the whole latent as one chunk read before the PDL wait (512) or four
    # chunks of one scale block's rows (128); the a85ce66 probe's streaming (2.4-2.9 us at 16
    # heads, B = 1) is what this cuts, if anything does. Token tiles of B / 8 to B only. For an
    # FP8 output BLOCK_V 128 is one program per head and group (no meeting: 16 programs of
    # 128 KiB at 16 heads, read at once with BLOCK_K 512), 64 and 32 meet two and four; all
    # compile for sm_90 without spills at 4-16 warps (96-172 registers at BLOCK_V 128)
    "gemv": dict(
        bt=(1, 2, 4, 8),
        bv=(16, 32, 64, 128),
        bk=(128, 512),
        nwns=((4, 1), (8, 1), (16, 1)),
        sp=(1, 2),
        gemv=True,
    ),
    # a few tokens beyond one: GEMV (bv 32, 4 or 8 warps, the whole latent or 128-row chunks
    # split 2: the B = 1 sweep's winners at 315c4d2; split 4, which it did not try) with token
    # tiles of B / 2 and B, as one 3-D product or a row at a time (GEMV_ROWS); and the MMA with
    # the whole latent as one chunk (read at once, as GEMV's one-token tiles that beat cuBLAS
    # do). First run on an H100 at c7061be (docs/results.md): one token per program won at 2
    # and 8 tokens; the MMA part did not run (a filter, fixed since)
    "tokens": [
        dict(
            bt=(1, 2, 4, 8, 16),
            bv=(32,),
            bk=(128, 512),
            nwns=((4, 1), (8, 1)),
            sp=(1, 2, 4),
            gemv=True,
            rows=(False, True),
            bt_frac=2,
            max_batch=16,
        ),
        dict(bt=(16, 32), bv=(32, 64), bk=(512,), nwns=((4, 1), (8, 1)), sp=(1,), min_batch=8),
        # one token per program with a whole FP8 group (no meeting, no atomics): B x 16
        # programs at 16 heads, W_UV read once from HBM and B - 1 times from L2 (one token's
        # 16 programs of 128 KiB took 4.3-5.2 us at 315c4d2)
        dict(
            bt=(1,),
            bv=(128,),
            bk=(512,),
            nwns=((8, 1), (16, 1)),
            sp=(1,),
            gemv=True,
            min_batch=2,
            max_batch=16,
        ),
    ],
}


def sweep_grid(name: str, smoke: bool, B: int | None = None) -> list[dict]:
    """The configs of grid ``name`` (each of its parts' combinations), for ``B`` tokens when
    given: a GEMV part's token tiles of ``B / bt_frac`` (default 8) to B, and only the
    parts whose ``min_batch`` / ``max_batch`` hold B."""
    parts = GRIDS[name] if isinstance(GRIDS[name], list) else [GRIDS[name]]
    out = []
    for g in parts:
        if B is not None and not g.get("min_batch", 0) <= B <= g.get("max_batch", 1 << 30):
            continue
        gemv = {"GEMV": True} if g.get("gemv") else {}
        for bt in g["bt"]:
            if gemv and B is not None:
                if not B / g.get("bt_frac", 8) <= bt <= triton.next_power_of_2(B):
                    continue
            for rows in g.get("rows", (False,)):
                if rows and bt == 1:  # one token: the same product either way
                    continue
                extra = dict(gemv, GEMV_ROWS=True) if rows else gemv
                out += [
                    dict(
                        BLOCK_T=bt,
                        BLOCK_V=bv,
                        BLOCK_K=bk,
                        num_warps=nw,
                        num_stages=ns,
                        SPLIT=sp,
                        **extra,
                    )
                    for bv in g["bv"]
                    for bk in ((16,) if smoke else g["bk"])
                    for nw, ns in g["nwns"]
                    for sp in g["sp"]
                ]
    return out


def sweep(b: Bench, a, vllm_quant) -> None:
    dims = b.dims
    for H in a.heads:
        weights = all_layer_weights(b, H)
        for B in a.sweep_batches:
            grid = sweep_grid(a.sweep_grid, b.smoke, B)
            xs = attention_outputs(b, H, B)
            for out, w_name in KINDS:
                if f"{out}/{w_name}" not in a.sweep_kinds:
                    continue
                fp8 = out == "fp8"
                layers = [w[0] if w_name == "bf16" else w[1] for w in weights]
                # a dot's chunk lies inside one block of scale rows (plain W: no blocks)
                blk = layers[0].block[0] if w_name == "fp8_block" else None
                best = None
                for cfg in grid:
                    # more programs per head (a split latent, FP8 groups cut among
                    # programs) is for small batches
                    vsub = a.group // cfg["BLOCK_V"] if fp8 and cfg["BLOCK_V"] < a.group else 1
                    gemv = cfg.get("GEMV", False)  # GEMV's chunks may span scale blocks
                    if (
                        cfg["BLOCK_T"] > max(16, 4 * B)
                        or (blk and blk % cfg["BLOCK_K"] and not gemv)
                        or (cfg["SPLIT"] * vsub > 1 and B > 64)
                        or (dims["L"] // cfg["BLOCK_K"]) % cfg["SPLIT"]
                    ):
                        continue
                    runners = [fused_runner(x, w, fp8, a.group, cfg) for x, w in zip(xs, layers)]
                    extra: dict = {}
                    try:
                        us = b.time(
                            [r.run for r in runners],
                            fused_check(runners, vllm_quant, extra),
                            rep=100,
                        )
                    except Exception as e:  # noqa: BLE001 - a config that fails is recorded
                        b.sweep_skipped.append(
                            dict(H=H, B=B, out=out, w_dtype=w_name, cfg=cfg, error=str(e)[:200])
                        )
                        continue
                    b.sweep.append(
                        dict(H=H, B=B, out=out, w_dtype=w_name, cfg=cfg, vsub=vsub, us=us)
                    )
                    if best is None or us < best[0]:
                        best = (us, cfg)
                if best:
                    print(
                        f"   sweep H={H} B={B} {out} W {w_name}: best {best[0]:.2f} us {best[1]}",
                        flush=True,
                    )
                b.save()  # after every kind: a run cut short keeps what it measured


def print_table(rows_: list) -> None:
    print("\n| H | B | out | cuBLAS (+quant) us | fused bf16 W us | fused FP8-block W us |")
    print("|---|---|---|---|---|---|")
    by = {}
    for r in rows_:
        by.setdefault((r["H"], r["B"], r["out"]), {})[r["impl"] + r["w_dtype"]] = r["us"]
    for (H, B, out), d in sorted(by.items()):
        base = d.get("cublas_bmmbf16") or d.get("cublas_bmm+quantbf16")
        print(f"| {H} | {B} | {out} | {base} | {d.get('fusedbf16')} | {d.get('fusedfp8_block')} |")


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--heads", type=int, nargs="+", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--sweep", action="store_true", help="the tile sweep at a few batches")
    ap.add_argument("--sweep-batches", type=int, nargs="+", default=SWEEP_BATCHES)
    ap.add_argument(
        "--sweep-kinds",
        nargs="+",
        default=[f"{o}/{w}" for o, w in KINDS],
        choices=[f"{o}/{w}" for o, w in KINDS],
        help="the sweep's output/W_UV kinds (default: all)",
    )
    ap.add_argument("--sweep-grid", choices=sorted(GRIDS), default="full")
    ap.add_argument("--out-dir", default=None, help="write D/epilogue.json (unless --out)")
    ap.add_argument("--no-rows", action="store_true")
    a = ap.parse_args(argv)
    if a.out is None and a.out_dir is not None:
        Path(a.out_dir).mkdir(parents=True, exist_ok=True)
        a.out = str(Path(a.out_dir) / "epilogue.json")
    if a.smoke:
        ensure_interpreter()
    a.heads = a.heads or ([2] if a.smoke else HEADS)
    a.batches = a.batches or ([1, 5] if a.smoke else BATCHES)
    a.group = SMOKE_GROUP if a.smoke else GROUP
    if a.smoke:
        a.sweep_batches = [3]
    b = Bench.for_run(a.smoke, max(a.batches), out_path=a.out)
    b.dims = dict(SMOKE if a.smoke else FULL)
    vllm_quant = None if a.smoke else _vllm_quant()
    b.copy_bw = copy_bandwidth_gbps(b.device)
    b.header = run_header(a.smoke, dims=b.dims, layers=b.layers, group=a.group)
    with torch.inference_mode():
        if not a.no_rows:
            rows(b, a, vllm_quant)
        if a.sweep:
            sweep(b, a, vllm_quant)
    b.save()
    print_table(b.rows)
    print(f"tiles of the table (configs._GPU_TILES): {configs._GPU_TILES}")
    return verdict(b.rows, b.failures, a.smoke)


if __name__ == "__main__":
    raise SystemExit(main())
