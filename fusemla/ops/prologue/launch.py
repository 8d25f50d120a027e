"""The prologue launcher: validated arguments -> one kernel launch (or the CPU fallback).

:func:`run` is what both the eager path and the registered custom op call; it never validates
(that happened once, in :func:`fusemla.contracts.prologue.prepare`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from fusemla import config, platform
from fusemla.contracts.prologue import PrologueArgs, check_device_values, split_scale
from fusemla.dtypes import fp8_code
from fusemla.ops.common import backend_of, check_fp8_formats, choose_pdl_trigger
from fusemla.ops.common import num_sms as _num_sms
from fusemla.ops.prologue import configs, policy
from fusemla.ops.prologue.kernel import mla_prologue_kernel
from fusemla.quant import weight_parts


def tile_format(args: PrologueArgs) -> str:
    """The format key of the tile tables (:func:`fusemla.ops.prologue.configs.tiles`): the
    weight format, or "fp8xfp8" for FP8 weights with ``act_quant="fp8"``."""
    return "fp8xfp8" if args.act_quant == "fp8" else args.weight_format


def _check_formats(args: PrologueArgs, backend: str) -> None:
    w_data = weight_parts(args.w_uk_t)[0]
    named = [("kv_cache", args.kv_cache), ("out", args.q), ("w_uk_t.data", w_data)]
    check_fp8_formats(named, backend)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything one launch runs, decided in one place (:func:`plan`): the backend, the
    weight / activation / tile formats, the batch's tile bucket and tiles, the kernel variant,
    programmatic dependent launch, the interpreter's upcasts, every constexpr the kernel takes
    (:attr:`constexprs`) and the program counts of each phase of the flat grid (BMM programs,
    decode RoPE, prefill RoPE, cache programs)."""

    backend: str  # "cuda", "rocm" or "interpreter"
    weight_format: str  # "plain", "fp8" or "mxfp4"
    act_quant: str | None  # None or "fp8" (FP8 x FP8 dot)
    tile_format: str  # the tile tables' key: weight_format, or "fp8xfp8"
    bucket: str  # "small", "medium" or "large" (by the decode token count)
    variant: policy.PrologueVariant
    pdl: bool  # programmatic dependent launch
    cfg: dict
    bmm_items: int  # (head, L-tile, token-tile) work items
    n_bmm: int  # BMM programs (fewer than items when persistent)
    l_tiles: int  # BLOCK_L tiles across the latent (per head)
    lc_passes: int  # BLOCK_LC passes of a cache program across the latent
    n_rope_d: int
    n_rope_p: int
    n_cache: int
    #: the kernel's constexprs (formats, tiles, flags) and its launch options
    constexprs: dict

    @property
    def grid(self) -> tuple[int]:
        return (self.n_bmm + self.n_rope_d + self.n_rope_p + self.n_cache,)


def plan(
    args: PrologueArgs, info: platform.PlatformInfo | None = None, cfg: dict | None = None
) -> LaunchPlan:
    """The :class:`LaunchPlan` :func:`launch` runs for ``args`` on its device (``info``: the
    device's platform, detected if None; ``cfg`` overrides the tiles). The launcher, the tests
    and the benchmarks ask this function; nothing else decides what runs."""
    N, D, H, P, R, L = args.N, args.D, args.H, args.P, args.R, args.L
    info = info or platform.detect(args.q_nope.device)
    backend = backend_of(args.q_nope.device, info)
    fmt, tfmt = args.weight_format, tile_format(args)
    if cfg is None:
        bucket, cfg = configs.tiles(H, P, R, L, D, backend, tfmt)
    else:
        bucket = configs.batch_bucket(D)
    variant = policy.choose_prologue_variant(
        info,
        weight_format=fmt,
        P=P,
        L=L,
        block_l=cfg["BLOCK_L"],
        block=getattr(args.w_uk_t, "block", None),
    )
    w_fmt, mx_native = variant.kernel_flags
    pdl = policy.choose_pdl(info)
    pdl_trigger = choose_pdl_trigger(pdl)
    interp = backend == "interpreter"  # work around the interpreter's bf16 dot and cast
    w_dtype = weight_parts(args.w_uk_t)[0].dtype
    constexprs = dict(
        H=H,
        P=P,
        R=R,
        L=L,
        BLOCK_P=cfg["BLOCK_P"],
        BLOCK_L=cfg["BLOCK_L"],
        BLOCK_T=cfg["BLOCK_T"],
        BLOCK_R=cfg["BLOCK_R"],
        BLOCK_LC=cfg["BLOCK_LC"],
        ROPE_ROWS=cfg["ROPE_ROWS"],
        CACHE_ROWS=cfg["CACHE_ROWS"],
        IS_NEOX=args.is_neox,
        APPLY_ROPE=args.apply_rope,
        KV_FP8=fp8_code(args.kv_cache.dtype),
        Q_FP8=fp8_code(args.q.dtype),
        W_FMT=w_fmt,
        W_BN=variant.block_n or 0,
        MX_NATIVE=mx_native,
        A_FMT="bf16" if args.q_nope.dtype == torch.bfloat16 else "fp16",
        A_QUANT=fp8_code(w_dtype) if args.act_quant == "fp8" else 0,
        DOT_FP32=interp,
        FIX_BF16=interp,
        USE_PDL=pdl,
        PDL_TRIGGER=pdl_trigger,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    num_sms = 1 if interp else _num_sms(args.q_nope.device.index or 0)
    return LaunchPlan(
        backend=backend,
        weight_format=fmt,
        act_quant=args.act_quant,
        tile_format=tfmt,
        bucket=bucket,
        variant=variant,
        pdl=pdl,
        cfg=cfg,
        bmm_items=configs.bmm_items(D, H, L, cfg),
        n_bmm=configs.bmm_programs(D, H, L, cfg, num_sms),
        l_tiles=triton.cdiv(L, cfg["BLOCK_L"]),
        lc_passes=triton.cdiv(L, cfg["BLOCK_LC"]),
        n_rope_d=triton.cdiv(D * H, cfg["ROPE_ROWS"]),
        n_rope_p=triton.cdiv((N - D) * H, cfg["ROPE_ROWS"]),
        n_cache=triton.cdiv(N, cfg["CACHE_ROWS"]),
        constexprs=constexprs,
    )


def launch(args: PrologueArgs, cfg: dict | None = None) -> None:
    """Launch the kernel on validated arguments, writing the outputs and the cache: the
    pointers, strides and sizes of ``args``, and everything else as :func:`plan` decides."""
    if args.N == 0:
        return
    pl = plan(args, platform.detect(args.q_nope.device), cfg)  # detected once per launch
    _check_formats(args, pl.backend)
    w_data, w_scale, _ = weight_parts(args.w_uk_t)
    s_ws_h = w_scale.stride(0) if w_scale is not None and w_scale.numel() > 1 else 0
    s_ws_p = w_scale.stride(1) if w_scale is not None and w_scale.dim() > 1 else 0
    p_kv_scale, kv_scale_value = split_scale(args.kv_scale)
    p_q_scale, q_scale_value = split_scale(args.q_scale)
    launch_opts = {"launch_pdl": True} if pl.pdl else {}
    qn, qp, kvc, kpe = args.q_nope, args.q_pe, args.kv_c, args.k_pe
    q, qpo, kpo, cache = args.q, args.q_pe_out, args.k_pe_out, args.kv_cache
    mla_prologue_kernel[pl.grid](
        p_qn=qn,
        s_qn_t=qn.stride(0),
        s_qn_h=qn.stride(1),
        p_qp=qp,
        s_qp_t=qp.stride(0),
        s_qp_h=qp.stride(1),
        p_kvc=kvc,
        s_kvc_t=kvc.stride(0),
        p_kpe=kpe,
        s_kpe_t=kpe.stride(0),
        p_w=w_data,
        s_w_h=w_data.stride(0),
        s_w_p=w_data.stride(1),
        s_w_l=w_data.stride(2),
        p_ws=w_scale,
        s_ws_h=s_ws_h,
        s_ws_p=s_ws_p,
        p_pos=args.positions,
        s_pos=args.positions.stride(0),
        p_cos=args.cos_cache,
        s_cos=args.cos_cache.stride(0),
        p_sin=args.sin_cache,
        s_sin=args.sin_cache.stride(0),
        p_slot=args.slot_mapping,
        s_slot=args.slot_mapping.stride(0),
        p_kv_scale=p_kv_scale,
        kv_scale_value=kv_scale_value,
        p_q=q,
        s_q_t=q.stride(0),
        s_q_h=q.stride(1),
        p_q_scale=p_q_scale,
        q_scale_value=q_scale_value,
        p_qpo=qpo,
        s_qpo_t=qpo.stride(0),
        s_qpo_h=qpo.stride(1),
        p_kpo=kpo,
        s_kpo_t=kpo.stride(0),
        p_cache=cache,
        s_cache_b=cache.stride(0),
        s_cache_s=cache.stride(1),
        N=args.N,
        D=args.D,
        n_bmm=pl.n_bmm,
        n_rope_d=pl.n_rope_d,
        n_rope_p=pl.n_rope_p,
        max_pos=args.cos_cache.shape[0],
        num_slots=cache.shape[0] * cache.shape[1],
        block_size=cache.shape[1],
        **pl.constexprs,
        **launch_opts,
    )


def run(args: PrologueArgs) -> None:
    """Run the prologue on validated arguments: the kernel, or for CPU tensors without the
    interpreter the unfused reference (same semantics)."""
    if config.debug_checks():
        check_device_values(args)
    if args.q_nope.device.type == "cpu" and not config.interpreting():
        from fusemla.reference.prologue import prologue_into

        prologue_into(args)
        return
    launch(args)
