"""The epilogue launcher: validated arguments -> one kernel launch (or the CPU fallback).

:func:`plan` decides everything a launch runs; :func:`run` is what both the eager path and the
registered custom op call. Neither validates (that happened once, in
:func:`fusemla.contracts.epilogue.prepare_step`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import triton

from fusemla import config, platform
from fusemla.contracts.epilogue import EPS, EpilogueArgs, fp8_group_max
from fusemla.dtypes import fp8_code
from fusemla.ops.common import backend_of, check_fp8_formats, choose_pdl, choose_pdl_trigger
from fusemla.ops.epilogue import configs
from fusemla.ops.epilogue.kernel import mla_epilogue_kernel
from fusemla.quant import weight_parts

#: the kernel's weight-format codes
W_FMT = {"plain": 0, "tensor": 1, "head": 1, "block": 2}


@dataclass(frozen=True)
class EpiloguePlan:
    """Everything one epilogue launch runs, decided in one place (:func:`plan`)."""

    backend: str  # "cuda", "rocm" or "interpreter"
    weight_format: str  # "plain" or "fp8"
    granularity: str  # "plain", "tensor", "head" or "block"
    out_format: str  # "act" (the activations' dtype) or the FP8 dtype's name
    bucket: str
    pdl: bool
    cfg: dict
    n_items: int  # (token tile, V tile, head) items
    split: int  # programs per item (the latent cut in SPLIT parts; 1: one program per item)
    vsub: int  # V tiles per FP8 group (a group wider than BLOCK_V: its tiles meet); else 1
    constexprs: dict

    @property
    def n_programs(self) -> int:
        return self.n_items * self.split

    @property
    def grid(self) -> tuple[int]:
        return (self.n_programs,)


def plan(
    args: EpilogueArgs, info: platform.PlatformInfo | None = None, cfg: dict | None = None
) -> EpiloguePlan:
    """The :class:`EpiloguePlan` :func:`launch` runs for ``args`` (``info``: the device's
    platform, detected if None; ``cfg``: tiles replacing the table's)."""
    spec = args.spec
    info = info or platform.detect(args.attn_out.device)
    backend = backend_of(args.attn_out.device, info)
    w = spec.w_uv
    fmt = spec.weight_format
    gran = "plain" if fmt == "plain" else w.granularity
    block = w.block if gran == "block" else (0, 0)
    group = spec.group_size if spec.fp8_out else None
    w_bytes = weight_parts(w)[0].element_size()
    bucket, tiles = configs.tiles(
        spec.L,
        spec.V,
        args.N,
        backend,
        group=group,
        block_k=block[0] or None,
        w_bytes=w_bytes,
        H=spec.H,
        rules=cfg is None,
    )
    if cfg is not None:
        tiles = {**tiles, **cfg}
        configs.check(tiles, group=group, block_k=block[0] or None)
    split = tiles.get("SPLIT", 1)
    n_chunks = triton.cdiv(spec.L, tiles["BLOCK_K"])
    if n_chunks % split:
        raise ValueError(
            f"SPLIT={split} does not divide the {n_chunks} latent chunks of BLOCK_K="
            f"{tiles['BLOCK_K']} (L={spec.L})"
        )
    # an FP8 group wider than the V tile: its GROUP / BLOCK_V tiles meet in the workspace
    vsub = group // tiles["BLOCK_V"] if group and tiles["BLOCK_V"] < group else 1
    pdl = choose_pdl(info)
    pdl_trigger = choose_pdl_trigger(pdl)
    interp = backend == "interpreter"
    out_code = fp8_code(args.out.dtype) if spec.fp8_out else 0
    constexprs = dict(
        L=spec.L,
        V=spec.V,
        BLOCK_T=tiles["BLOCK_T"],
        BLOCK_V=tiles["BLOCK_V"],
        BLOCK_K=tiles["BLOCK_K"],
        W_FMT=W_FMT[gran],
        W_BK=block[0],
        W_BN=block[1],
        OUT_FP8=out_code,
        FMAX=fp8_group_max(args.out.dtype) if spec.fp8_out else 0.0,
        GROUP=group or 0,
        UE8M0=spec.scale_ue8m0 if spec.fp8_out else False,
        EPS=EPS,
        DOT_FP32=interp,
        FIX_BF16=interp,
        USE_PDL=pdl,
        PDL_TRIGGER=pdl_trigger,
        SPLIT=split,
        VSUB=vsub,
        GEMV=bool(tiles.get("GEMV", False)),
        GEMV_ROWS=bool(tiles.get("GEMV_ROWS", False)),
        num_warps=tiles["num_warps"],
        num_stages=tiles["num_stages"],
    )
    n_items = triton.cdiv(args.N, tiles["BLOCK_T"]) * triton.cdiv(spec.V, tiles["BLOCK_V"]) * spec.H
    return EpiloguePlan(
        backend=backend,
        weight_format=fmt,
        granularity=gran,
        out_format=str(args.out.dtype).replace("torch.", "") if spec.fp8_out else "act",
        bucket=bucket,
        pdl=pdl,
        cfg=tiles,
        n_items=n_items,
        split=split,
        vsub=vsub,
        constexprs=constexprs,
    )


#: the split items' arrival counters, per (device, stream): int32, zero between launches (the
#: last program of an item to arrive sets its counter back to 0), so a launch needs no memset
#: of its own. Buffers are never dropped: a CUDA graph captured with one keeps its address.
_COUNTERS: dict[tuple, list[torch.Tensor]] = {}
_COUNTERS_LOCK = threading.Lock()


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 arrival counters for a split launch on ``device`` and the
    current stream (launches on one stream run one after the other, so they may share them).
    Allocated once per size class (a power of two), kept for the process's life; a buffer
    first made inside a CUDA-graph capture is zeroed by a memset the graph replays, which
    leaves it zero as every launch does."""
    dev = torch.device(device)
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    key = (str(dev), stream)
    with _COUNTERS_LOCK:
        bufs = _COUNTERS.setdefault(key, [])
        if not bufs or bufs[-1].numel() < n:
            bufs.append(
                torch.zeros(max(1024, triton.next_power_of_2(n)), dtype=torch.int32, device=dev)
            )
        return bufs[-1]


def weight_operands(w, granularity: str) -> tuple:
    """W_UV as the kernel takes it: (codes or plain weights, the scales' tensor, their
    (head, latent block, V block) strides); plain weights pass themselves as the never-read
    scales, a per-tensor scale a head stride of 0."""
    w_data, w_scale, _ = weight_parts(w)
    if w_scale is None:
        return w_data, w_data, (0, 0, 0)
    if granularity == "block":
        return w_data, w_scale, tuple(w_scale.stride())
    return w_data, w_scale, (w_scale.stride(0) if w_scale.numel() > 1 else 0, 0, 0)


def launch(args: EpilogueArgs, cfg: dict | None = None) -> None:
    """Launch the kernel on validated arguments: the pointers and strides of ``args``, and
    everything else as :func:`plan` decides."""
    if args.N == 0:
        return
    pl = plan(args, platform.detect(args.attn_out.device), cfg)
    w_data, p_ws, s_ws = weight_operands(args.spec.w_uv, pl.granularity)
    check_fp8_formats([("out", args.out), ("w_uv.data", w_data)], pl.backend)
    x, o = args.attn_out, args.out
    so = args.scale_out
    p_os, s_os = (so, tuple(so.stride())) if so is not None else (o, (0, 0))
    if pl.split * pl.vsub > 1:  # the partial products' workspace and the arrival counters
        wk = torch.empty(pl.split, args.N, o.shape[1], dtype=torch.float32, device=o.device)
        cnt = split_counters(o.device, pl.n_items)
        p_wk, s_wk = wk, (wk.stride(0), wk.stride(1))
    else:
        p_wk, s_wk, cnt = o, (0, 0), o
    mla_epilogue_kernel[pl.grid](
        p_x=x,
        s_x_t=x.stride(0),
        s_x_h=x.stride(1),
        p_w=w_data,
        s_w_h=w_data.stride(0),
        s_w_k=w_data.stride(1),
        s_w_v=w_data.stride(2),
        p_ws=p_ws,
        s_ws_h=s_ws[0],
        s_ws_k=s_ws[1],
        s_ws_v=s_ws[2],
        p_o=o,
        s_o_t=o.stride(0),
        p_os=p_os,
        s_os_t=s_os[0],
        s_os_g=s_os[1],
        p_wk=p_wk,
        s_wk_s=s_wk[0],
        s_wk_t=s_wk[1],
        p_cnt=cnt,
        N=args.N,
        **pl.constexprs,
        **({"launch_pdl": True} if pl.pdl else {}),
    )


def run(args: EpilogueArgs) -> None:
    """Run the epilogue on validated arguments: the kernel, or for CPU tensors without the
    interpreter the reference (same semantics)."""
    if args.attn_out.device.type == "cpu" and not config.interpreting():
        from fusemla.reference.epilogue import epilogue_into

        epilogue_into(args)
        return
    launch(args)
