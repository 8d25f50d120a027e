"""Host-side argument checks for the decode prologue (no device sync, nothing launched).

:func:`validate` runs before any kernel or write. It looks only at shapes, dtypes, devices and
strides; values that live on the device are checked by :func:`check_device_values`, which syncs
and so runs only under ``FUSEMLA_DEBUG_CHECKS=1``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from fusemla.errors import FuseMLATypeError, FuseMLAValueError, describe

ACT_DTYPES = (torch.bfloat16, torch.float16)
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
CACHE_DTYPES = ACT_DTYPES + FP8_CACHE_DTYPES
INDEX_DTYPES = (torch.int32, torch.int64)
ROPE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class PrologueArgs:
    """Validated, normalized arguments (``k_pe`` always ``[B, R]``; ``w_uk_t`` a tensor in the
    activations' dtype or a :class:`fusemla.quant.QuantizedWeight`)."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    w_uk_t: object
    positions: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    is_neox: bool
    kv_scale: Union[float, torch.Tensor, None]
    q_dtype: torch.dtype  # the query's dtype: the activations', or FP8 with q_scale
    q_scale: Union[float, torch.Tensor, None]
    fp8_activations: Optional[bool]  # FP8 weights only: None = chosen by the platform
    B: int
    H: int
    P: int
    R: int
    L: int


def _tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise FuseMLATypeError(f"{name}: expected a torch.Tensor, got {describe(x)}")
    return x


def _shape(name: str, x: torch.Tensor, expected: Sequence[Optional[int]], what: str) -> None:
    ok = x.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, x.shape))
    if not ok:
        raise FuseMLAValueError(f"{name}: expected shape {what}, got {describe(x)}")


def _dtype(name: str, x: torch.Tensor, allowed: Sequence[torch.dtype], hint: str = "") -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise FuseMLATypeError(f"{name}: expected dtype in ({names}){hint}, got {describe(x)}")


def _last_contiguous(name: str, x: torch.Tensor) -> None:
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise FuseMLAValueError(
            f"{name}: the last dimension must be contiguous (stride 1), got {describe(x)}"
        )


def _scale(name: str, scale: object, needed_by: Optional[str]) -> Union[float, torch.Tensor, None]:
    """A positive float (rounded to fp32, as the kernel receives it) or a 1-element fp32 tensor."""
    if scale is None:
        if needed_by is not None:
            raise FuseMLAValueError(
                f"{name}: {needed_by} needs {name} (a positive float or a 1-element fp32 "
                "tensor), got None"
            )
        return None
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise FuseMLAValueError(f"{name}: expected a 1-element tensor, got {describe(scale)}")
        _dtype(name, scale, (torch.float32,))
        return scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise FuseMLATypeError(
            f"{name}: expected a float or a 1-element fp32 tensor, got {describe(scale)}"
        )
    scale32 = struct.unpack("f", struct.pack("f", scale))[0] if math.isfinite(scale) else scale
    if not (math.isfinite(scale32) and scale32 > 0):
        raise FuseMLAValueError(f"{name}: expected a finite value > 0 (as fp32), got {scale!r}")
    return scale32


def _weight(w_uk_t: object, H: int, P: int, L: int, act: torch.dtype) -> object:
    """W_UK_T: a [H, P, L] tensor in the activations' dtype, or a QuantizedWeight."""
    from fusemla.quant import QuantizedWeight

    if isinstance(w_uk_t, QuantizedWeight):
        if tuple(w_uk_t.shape) != (H, P, L):
            raise FuseMLAValueError(
                f"w_uk_t: expected a quantized weight of shape [H={H}, P={P}, L={L}], got "
                f"format {w_uk_t.format!r} with shape {tuple(w_uk_t.shape)}"
            )
        for part in ("data", "scale"):
            t = getattr(w_uk_t, part)
            if t.dim() > 1:
                _last_contiguous(f"w_uk_t.{part}", t)
        return w_uk_t
    w_uk_t = _tensor("w_uk_t", w_uk_t)
    _shape("w_uk_t", w_uk_t, (H, P, L), f"[H={H}, P={P}, L={L}]")
    if w_uk_t.dtype != act:
        raise FuseMLATypeError(
            f"w_uk_t: expected dtype {act} (the activations' dtype) or a "
            f"fusemla.quant.QuantizedWeight, got {describe(w_uk_t)}"
        )
    return w_uk_t


def validate(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk_t: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_neox: bool,
    kv_scale: Union[float, torch.Tensor, None],
    out: Optional[torch.Tensor],
    q_out_dtype: Optional[torch.dtype] = None,
    q_scale: Union[float, torch.Tensor, None] = None,
    fp8_activations: Optional[bool] = None,
) -> PrologueArgs:
    """Check every argument of :func:`fusemla.mla_decode_prologue`; raise before any launch."""
    q_nope = _tensor("q_nope", q_nope)
    if q_nope.dim() != 3:
        raise FuseMLAValueError(f"q_nope: expected shape [B, H, P], got {describe(q_nope)}")
    _dtype("q_nope", q_nope, ACT_DTYPES)
    B, H, P = q_nope.shape
    act = q_nope.dtype
    device = q_nope.device

    q_pe = _tensor("q_pe", q_pe)
    if q_pe.dim() != 3:
        raise FuseMLAValueError(f"q_pe: expected shape [B={B}, H={H}, R], got {describe(q_pe)}")
    R = q_pe.shape[2]
    _shape("q_pe", q_pe, (B, H, R), f"[B={B}, H={H}, R]")
    if R % 2 != 0 or R == 0:
        raise FuseMLAValueError(f"q_pe: the rope dim R must be even and > 0, got {describe(q_pe)}")

    kv_c = _tensor("kv_c", kv_c)
    if kv_c.dim() != 2:
        raise FuseMLAValueError(f"kv_c: expected shape [B={B}, L], got {describe(kv_c)}")
    L = kv_c.shape[1]
    _shape("kv_c", kv_c, (B, L), f"[B={B}, L]")

    k_pe = _tensor("k_pe", k_pe)
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe[:, 0]
    _shape("k_pe", k_pe, (B, R), f"[B={B}, R={R}] or [B={B}, 1, R={R}]")

    w_uk_t = _weight(w_uk_t, H, P, L, q_nope.dtype)

    positions = _tensor("positions", positions)
    _shape("positions", positions, (B,), f"[B={B}]")
    _dtype("positions", positions, INDEX_DTYPES)

    cos_cache = _tensor("cos_cache", cos_cache)
    sin_cache = _tensor("sin_cache", sin_cache)
    _shape("cos_cache", cos_cache, (None, R // 2), f"[max_position, R/2={R // 2}]")
    _shape("sin_cache", sin_cache, (cos_cache.shape[0], R // 2),
           f"[max_position={cos_cache.shape[0]}, R/2={R // 2}] (like cos_cache)")
    if cos_cache.shape[0] == 0:
        raise FuseMLAValueError(f"cos_cache: expected at least one position, got {describe(cos_cache)}")
    _dtype("cos_cache", cos_cache, ROPE_DTYPES)
    _dtype("sin_cache", sin_cache, ROPE_DTYPES)

    kv_cache = _tensor("kv_cache", kv_cache)
    _shape("kv_cache", kv_cache, (None, None, L + R), f"[num_blocks, block_size, L+R={L + R}]")
    if kv_cache.dtype == torch.uint8:
        raise FuseMLATypeError(
            "kv_cache: a uint8 cache must be viewed as its FP8 type first "
            f"(kv_cache.view(torch.float8_e4m3fn)), got {describe(kv_cache)}"
        )
    _dtype("kv_cache", kv_cache, CACHE_DTYPES)

    slot_mapping = _tensor("slot_mapping", slot_mapping)
    _shape("slot_mapping", slot_mapping, (B,), f"[B={B}]")
    _dtype("slot_mapping", slot_mapping, INDEX_DTYPES)

    for name, x in (("q_pe", q_pe), ("kv_c", kv_c), ("k_pe", k_pe)):
        if x.dtype != act:
            raise FuseMLATypeError(f"{name}: expected dtype {act} (like q_nope), got {describe(x)}")

    q_dtype = act if q_out_dtype is None else q_out_dtype
    if q_dtype not in (act,) + FP8_CACHE_DTYPES:
        raise FuseMLATypeError(
            f"q_out_dtype: expected None, {act} or an FP8 dtype, got {q_out_dtype!r}"
        )
    if out is not None:
        out = _tensor("out", out)
        _shape("out", out, (B, H, L + R), f"[B={B}, H={H}, L+R={L + R}]")
        if out.dtype != q_dtype:
            raise FuseMLATypeError(
                f"out: expected dtype {q_dtype} (q_out_dtype, default the activations'), "
                f"got {describe(out)}"
            )
    kv_fp8 = kv_cache.dtype in FP8_CACHE_DTYPES
    kv_scale = _scale("kv_scale", kv_scale, f"an FP8 kv_cache ({kv_cache.dtype})" if kv_fp8 else None)
    q_fp8 = q_dtype in FP8_CACHE_DTYPES
    q_scale = _scale("q_scale", q_scale, f"q_out_dtype={q_dtype}" if q_fp8 else None)
    if fp8_activations and getattr(w_uk_t, "format", None) != "fp8":
        raise FuseMLAValueError(
            "fp8_activations: only FP8 weights (a QuantizedWeight of format 'fp8') can run with "
            f"FP8 activations, got w_uk_t {describe(w_uk_t)}"
        )

    w_parts = ([("w_uk_t.data", w_uk_t.data), ("w_uk_t.scale", w_uk_t.scale)]
               if not isinstance(w_uk_t, torch.Tensor) else [("w_uk_t", w_uk_t)])
    named = [("q_pe", q_pe), ("kv_c", kv_c), ("k_pe", k_pe), *w_parts,
             ("positions", positions), ("cos_cache", cos_cache), ("sin_cache", sin_cache),
             ("kv_cache", kv_cache), ("slot_mapping", slot_mapping)]
    if isinstance(kv_scale, torch.Tensor):
        named.append(("kv_scale", kv_scale))
    if isinstance(q_scale, torch.Tensor):
        named.append(("q_scale", q_scale))
    if out is not None:
        named.append(("out", out))
    for name, x in named:
        if x.device != device:
            raise FuseMLATypeError(
                f"{name}: expected device {device} (like q_nope), got {describe(x)}"
            )
    for name, x in [("q_nope", q_nope)] + named:
        if x.dim() > 1 and not name.startswith("w_uk_t."):
            _last_contiguous(name, x)
    return PrologueArgs(q_nope, q_pe, kv_c, k_pe, w_uk_t, positions, cos_cache, sin_cache,
                        kv_cache, slot_mapping, bool(is_neox), kv_scale, q_dtype, q_scale,
                        fp8_activations, B, H, P, R, L)


def check_device_values(args: PrologueArgs) -> None:
    """The syncing checks of ``FUSEMLA_DEBUG_CHECKS=1``: positions, slots and kv_scale values."""
    if args.B == 0:
        return
    max_pos = args.cos_cache.shape[0]
    pos = args.positions.detach().cpu()
    bad = (pos < 0) | (pos >= max_pos)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise FuseMLAValueError(
            f"positions: expected values in [0, {max_pos}) (the RoPE cache's length), "
            f"got positions[{i}] = {int(pos[i])}"
        )
    num_slots = args.kv_cache.shape[0] * args.kv_cache.shape[1]
    slots = args.slot_mapping.detach().cpu()
    bad = slots >= num_slots
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise FuseMLAValueError(
            f"slot_mapping: expected values < {num_slots} (num_blocks * block_size) or negative "
            f"(skip), got slot_mapping[{i}] = {int(slots[i])}"
        )
    if isinstance(args.kv_scale, torch.Tensor) and args.kv_cache.dtype in FP8_CACHE_DTYPES:
        value = float(args.kv_scale.detach().cpu().reshape(()))
        if not (math.isfinite(value) and value > 0):
            raise FuseMLAValueError(f"kv_scale: expected a finite value > 0, got {value!r}")


def resolve_fp8_activations(args: PrologueArgs) -> bool:
    """Whether FP8 weights run against FP8-quantized activations (False for other weights)."""
    if getattr(args.w_uk_t, "format", None) != "fp8":
        return False
    if args.fp8_activations is not None:
        return bool(args.fp8_activations)
    from fusemla import platform

    return platform.choose_fp8_activations(platform.detect(args.q_nope.device), args.B)
