"""Where does the small-batch epilogue's time go? Time the kernel beside variants that leave
stages out, and take differences (the device notes' method where there are no counters).

Same harness as bench_epilogue (a CUDA graph over enough layers that their W_UV is 3x the
GPU's L2, random bf16 attention outputs, DeepSeek-V3 dims), with PDL off in every variant (the
probe kernels have none). Per shape ``HxB`` and output / W_UV kind, the variants:

- ``full``: the launch the tables pick (``configs``), checked on the captured graph against the
  fp32 reference first, as bench_epilogue checks it;
- ``splitN`` (each N of ``--splits``, default 1): the same tiles with ``SPLIT`` N where the
  table picks another (``split1``: one program per item, no workspace, no arrival counter),
  checked too;
- ``body``: a probe kernel with the full launch's grid, tiles, warps and stages that runs the
  same latent loop (the kernel's own chunk loaders, block scales included) and stores each
  program's fp32 partial product to a scratch tile of its own: no meeting in the workspace, no
  counter, no finishing (the group quantization, the store in o_proj's layout). NOT an
  epilogue: timed only;
- ``empty``: a kernel of the full launch's grid and warps that does nothing: one graph node's
  launch and scheduling floor.

``full - body`` is what the split's meeting and the finishing cost; ``body - empty`` what
streaming W_UV and the activations costs at that grid; ``full`` against ``splitN`` whether the
table's split pays. The table at the end prints them per shape.

Usage: ``python -m benchmarks.probes.epilogue_stages --out stages.json (or --out-dir D)
[--shapes 16x1 16x32] [--kinds fp8/bf16 bf16/bf16] [--splits 1 2 8]``. ``--smoke``: the CPU
under the Triton interpreter, small dims, one shape, every variant (SPLIT 1 and 2).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.bench_core import Bench, Runner
from benchmarks.bench_epilogue import (
    FULL,
    GROUP,
    KINDS,
    SMOKE,
    SMOKE_GROUP,
    all_layer_weights,
    attention_outputs,
    fused_check,
    fused_runner,
)
from benchmarks.common import CheckFailed, ensure_interpreter, parser, run_header, verdict
from fusemla.contracts.epilogue import prepare
from fusemla.ops.epilogue.kernel import block_scales, program_item, w_chunk, x_chunk
from fusemla.ops.epilogue.launch import plan, weight_operands

FP8 = torch.float8_e4m3fn
VARIANTS = ("full", "split", "body", "empty")  # "split": one variant per --splits value


@triton.jit
def _body_kernel(
    p_x,
    s_x_t,
    s_x_h,
    p_w,
    s_w_h,
    s_w_k,
    s_w_v,
    p_ws,
    s_ws_h,
    s_ws_k,
    s_ws_v,
    p_scr,
    N,
    L: tl.constexpr,
    V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_FMT: tl.constexpr,
    W_BK: tl.constexpr,
    W_BN: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """The epilogue kernel's item decomposition and latent loop, then one unmasked store of
    the fp32 partial product to the program's own scratch tile."""
    if DOT_FP32:
        DOT_TY: tl.constexpr = tl.float32
    else:
        DOT_TY: tl.constexpr = p_x.dtype.element_ty
    NK: tl.constexpr = (L + BLOCK_K - 1) // BLOCK_K
    NKS: tl.constexpr = NK // SPLIT
    pid = tl.program_id(0)
    i_s, i_t, i_v, i_h, n_t, o_t, m_t, o_t64, o_v, m_v = program_item(
        pid, N, V, BLOCK_T, BLOCK_V, SPLIT
    )
    o_k = tl.arange(0, BLOCK_K)
    p_wh = p_w + i_h * s_w_h
    p_xh = p_x + i_h * s_x_h
    p_wsh = p_ws + i_h * s_ws_h
    acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
    for i_k in range(i_s * NKS, (i_s + 1) * NKS):
        o_kk = i_k * BLOCK_K + o_k
        m_k = o_kk < L
        b_w = w_chunk(p_wh, s_w_k, s_w_v, o_kk, m_k, o_v, m_v, DOT_TY)
        b_x = x_chunk(p_xh, o_t64, m_t, s_x_t, o_kk, m_k, DOT_TY)
        if W_FMT == 2:
            b_s = block_scales(p_wsh, s_ws_k, s_ws_v, i_k * BLOCK_K, o_v, m_v, W_BK, W_BN)
            acc += tl.dot(b_x, b_w) * b_s[None, :]
        else:
            acc = tl.dot(b_x, b_w, acc=acc)
    o_r = tl.arange(0, BLOCK_T)[:, None] * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    tl.store(p_scr + pid.to(tl.int64) * (BLOCK_T * BLOCK_V) + o_r, acc)


@triton.jit
def _empty_kernel(p_scr):
    """Nothing: a graph node's launch and scheduling, at the grid and warps it is given."""
    pass


def probe_runner(args, variant: str, cfg: dict | None) -> Runner:
    """``body`` or ``empty`` at the launch :func:`plan` gives ``args`` (with ``cfg``)."""
    pl = plan(args, cfg=cfg)
    c = pl.constexprs
    warps = dict(num_warps=c["num_warps"], num_stages=c["num_stages"])
    scr = torch.empty(
        pl.n_programs * c["BLOCK_T"] * c["BLOCK_V"], dtype=torch.float32, device=args.out.device
    )
    if variant == "empty":
        return Runner(lambda: _empty_kernel[pl.grid](scr, **warps), result=scr)
    w_data, p_ws, s_ws = weight_operands(args.spec.w_uv, pl.granularity)
    x = args.attn_out
    keys = ("L", "V", "BLOCK_T", "BLOCK_V", "BLOCK_K", "W_FMT", "W_BK", "W_BN", "DOT_FP32")

    def run():
        _body_kernel[pl.grid](
            x, x.stride(0), x.stride(1), w_data, *w_data.stride(), p_ws, *s_ws, scr, args.N,
            **{k: c[k] for k in keys}, SPLIT=c["SPLIT"], **warps,
        )  # fmt: skip

    return Runner(run, result=scr)


def shape_rows(b: Bench, a, H: int, B: int, weights) -> list[dict]:
    xs = attention_outputs(b, H, B)
    recs = []
    for out, w_name in KINDS:
        if f"{out}/{w_name}" not in a.kinds:
            continue
        fp8 = out == "fp8"
        layers = [w[0] if w_name == "bf16" else w[1] for w in weights]
        args0 = prepare(xs[0], layers[0], out_dtype=FP8 if fp8 else None, group_size=a.group)
        base = plan(args0)
        n_chunks = triton.cdiv(b.dims["L"], base.cfg["BLOCK_K"])
        todo = []
        for variant in a.variants:
            if variant != "split":
                todo.append((variant, None))
                continue
            for n in a.splits:  # the table's own split is "full"; N must divide the chunks
                if n != base.split and n_chunks % n == 0:
                    todo.append((f"split{n}", {"SPLIT": n}))
        for variant, cfg in todo:
            checked = variant == "full" or cfg is not None
            rec = dict(H=H, B=B, out=out, w_dtype=w_name, variant=variant)
            if checked:
                rs = [fused_runner(x, w, fp8, a.group, cfg) for x, w in zip(xs, layers)]
                check = fused_check(rs, None, {})
            else:
                rs = [
                    probe_runner(
                        prepare(x, w, out_dtype=FP8 if fp8 else None, group_size=a.group),
                        variant,
                        cfg,
                    )
                    for x, w in zip(xs, layers)
                ]
                check = None
            pl = plan(args0, cfg=cfg)
            rec.update(cfg=pl.cfg, split=pl.split, vsub=pl.vsub, programs=pl.n_programs)
            try:
                us = b.time([r.run for r in rs], check=check, rep=100)
            except CheckFailed as e:
                b.fail(rec, e.problems)
                continue
            rec.update(us=round(us, 3), checked=checked)
            recs.append(rec)
            print(rec, flush=True)
    return recs


def print_table(recs: list) -> None:
    print(
        "\n| H | B | out / W_UV | full (SPLIT) | other SPLITs | body | empty | full - body | "
        "body - empty |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    keys = sorted({(r["H"], r["B"], r["out"], r["w_dtype"]) for r in recs})
    for k in keys:
        mine = [r for r in recs if (r["H"], r["B"], r["out"], r["w_dtype"]) == k]
        got = {r["variant"]: r["us"] for r in mine}
        split = {r["variant"]: r["split"] for r in mine}.get("full", "")
        others = ", ".join(
            f"{r['split']}: {r['us']:.2f}" for r in mine if r["variant"].startswith("split")
        )

        def f(v):
            return "" if v is None else f"{v:.2f}"

        full, body, empty = got.get("full"), got.get("body"), got.get("empty")
        tail = None if full is None or body is None else full - body
        stream = None if body is None or empty is None else body - empty
        print(
            f"| {k[0]} | {k[1]} | {k[2]} / {k[3]} | {f(full)} ({split}) | {others} | "
            f"{f(body)} | {f(empty)} | {f(tail)} | {f(stream)} |"
        )


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--shapes", nargs="+", default=None, help="HxB, e.g. 16x1")
    ap.add_argument(
        "--kinds",
        nargs="+",
        default=[f"{o}/{w}" for o, w in KINDS],
        choices=[f"{o}/{w}" for o, w in KINDS],
    )
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--splits", nargs="+", type=int, default=None, help="SPLITs beside the table's")
    ap.add_argument("--out-dir", default=None, help="write D/epilogue_stages.json (unless --out)")
    a = ap.parse_args(argv)
    a.splits = a.splits or ([1, 2] if a.smoke else [1])
    if a.out is None and a.out_dir is not None:  # as a queued device job passes it
        Path(a.out_dir).mkdir(parents=True, exist_ok=True)
        a.out = str(Path(a.out_dir) / "epilogue_stages.json")
    if a.smoke:
        ensure_interpreter()
    os.environ["FUSEMLA_PDL"] = "off"  # the probe kernels have none: neither has the full one
    a.shapes = a.shapes or (["2x3"] if a.smoke else ["16x1", "16x32", "128x1"])
    a.group = SMOKE_GROUP if a.smoke else GROUP
    shapes = [tuple(map(int, s.lower().split("x"))) for s in a.shapes]
    b = Bench.for_run(a.smoke, max(B for _, B in shapes), out_path=a.out)
    b.dims = dict(SMOKE if a.smoke else FULL)
    b.header = run_header(a.smoke, dims=b.dims, layers=b.layers, group=a.group)
    recs: list = []
    with torch.inference_mode():
        for H, B in shapes:
            recs += shape_rows(b, a, H, B, all_layer_weights(b, H))
            b.rows = recs
            b.save()  # after every shape: a run cut short keeps what it measured
    print_table(recs)
    return verdict([r for r in recs if r["checked"]], b.failures, a.smoke)


if __name__ == "__main__":
    raise SystemExit(main())
