"""The prologue's argument record and its host-side checks (no device sync, nothing launched).

Both the fused op (:mod:`fusemla.ops.prologue`) and the unfused reference
(:mod:`fusemla.reference.prologue`) take their arguments through :func:`prepare`, which
validates every argument once and allocates the outputs; neither imports the other. This module
imports neither Triton nor a kernel.

A batch holds ``N`` tokens, the first ``D = num_decode_tokens`` of them decode tokens (absorbed
BMM + RoPE + concat + cache write), the other ``N - D`` prefill tokens (RoPE + cache write).

:func:`prepare` looks only at shapes, dtypes, devices and strides; values that live on the
device are checked by :func:`check_device_values`, which syncs and so runs only under
``FUSEMLA_DEBUG_CHECKS=1``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Union

import torch

from fusemla.dtypes import ACT_DTYPES, CACHE_DTYPES, FP8_DTYPES, INDEX_DTYPES, ROPE_DTYPES
from fusemla.errors import FuseMLATypeError, FuseMLAValueError, describe

Scale = Union[float, torch.Tensor, None]


class PrologueOutput(NamedTuple):
    """What :func:`fusemla.mla_prologue` returns.

    ``q``: ``[D, H, L + R]``, the decode tokens' 576-wide queries.
    ``q_pe``: ``[N - D, H, R]``, the prefill tokens' rotated ``q_pe`` (activations' dtype).
    ``k_pe``: ``[N - D, R]``, the prefill tokens' rotated ``k_pe`` (activations' dtype), for a
    prefill attention that reads the new tokens' keys at full precision.
    """

    q: torch.Tensor
    q_pe: torch.Tensor
    k_pe: torch.Tensor


@dataclass
class PrologueArgs:
    """Validated, normalized arguments and outputs (``k_pe`` always ``[N, R]``; ``w_uk_t`` a
    tensor in the activations' dtype or a :class:`fusemla.quant.QuantizedWeight`)."""

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
    num_decode_tokens: int  # D: tokens [0, D) decode, [D, N) prefill
    is_neox: bool
    apply_rope: bool  # False: the caller already rotated q_pe and k_pe (rope_applied=True)
    kv_scale: Scale
    q_scale: Scale
    q: torch.Tensor  # [D, H, L + R] output
    q_pe_out: torch.Tensor  # [N - D, H, R] output
    k_pe_out: torch.Tensor  # [N - D, R] output

    @property
    def B(self) -> int:
        """N, the number of tokens (decode + prefill)."""
        return self.q_nope.shape[0]

    @property
    def D(self) -> int:
        return self.num_decode_tokens

    @property
    def H(self) -> int:
        return self.q_nope.shape[1]

    @property
    def P(self) -> int:
        return self.q_nope.shape[2]

    @property
    def R(self) -> int:
        return self.q_pe.shape[2]

    @property
    def L(self) -> int:
        return self.kv_c.shape[1]

    @property
    def outputs(self) -> PrologueOutput:
        return PrologueOutput(self.q, self.q_pe_out, self.k_pe_out)


def _tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise FuseMLATypeError(f"{name}: expected a torch.Tensor, got {describe(x)}")
    return x


def _shape(name: str, x: torch.Tensor, expected: Sequence[int | None],
           what: Callable[[], str]) -> None:
    """Check ``x``'s shape against ``expected`` (None: any size). ``what`` builds the expected
    shape's text, and is called only when the check fails: formatting a size into a string
    under ``torch.compile`` would specialize a symbolic (dynamic) batch size to a constant."""
    ok = x.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, x.shape))
    if not ok:
        raise FuseMLAValueError(f"{name}: expected shape {what()}, got {describe(x)}")


def _dtype(name: str, x: torch.Tensor, allowed: Sequence[torch.dtype], hint: str = "") -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise FuseMLATypeError(f"{name}: expected dtype in ({names}){hint}, got {describe(x)}")


def _last_contiguous(name: str, x: torch.Tensor) -> None:
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise FuseMLAValueError(
            f"{name}: the last dimension must be contiguous (stride 1), got {describe(x)}"
        )


def check_scale(name: str, scale: object, needed_by: str | None) -> Scale:
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


def split_scale(scale: Scale) -> tuple[torch.Tensor | None, float]:
    """(tensor or None, value) for a checked float/tensor/None scale: a tensor is read on the
    device, a float (or None: 1.0) is passed by value."""
    if isinstance(scale, torch.Tensor):
        return scale, 1.0
    return None, 1.0 if scale is None else float(scale)


def _weight(w_uk_t: object, H: int, P: int, L: int, act: torch.dtype) -> object:
    """W_UK_T: a [H, P, L] tensor in the activations' dtype, or a QuantizedWeight."""
    from fusemla.quant import QuantizedWeight

    if isinstance(w_uk_t, QuantizedWeight):
        if tuple(w_uk_t.shape) != (H, P, L):
            raise FuseMLAValueError(
                f"w_uk_t: expected a quantized weight of shape [H={H}, P={P}, L={L}], got "
                f"format {w_uk_t.format!r} with shape {tuple(w_uk_t.shape)}"
            )
        return w_uk_t
    w_uk_t = _tensor("w_uk_t", w_uk_t)
    _shape("w_uk_t", w_uk_t, (H, P, L), lambda: f"[H={H}, P={P}, L={L}]")
    if w_uk_t.dtype != act:
        raise FuseMLATypeError(
            f"w_uk_t: expected dtype {act} (the activations' dtype) or a "
            f"fusemla.quant.QuantizedWeight, got {describe(w_uk_t)}"
        )
    return w_uk_t


def _num_decode_tokens(value: object, N: int) -> int:
    if value is None:
        return N
    if isinstance(value, bool) or not isinstance(value, int):
        raise FuseMLATypeError(
            f"num_decode_tokens: expected an int in [0, N={N}] or None (all decode), "
            f"got {describe(value)}")
    if not 0 <= value <= N:
        raise FuseMLAValueError(
            f"num_decode_tokens: expected a value in [0, N={N}] (decode tokens come first), "
            f"got {value}")
    return value


def _output(name: str, x: torch.Tensor | None, shape: tuple, what: Callable[[], str],
            dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """A given output, checked; or a new empty one."""
    if x is None:
        return like.new_empty(shape, dtype=dtype)
    x = _tensor(name, x)
    _shape(name, x, shape, what)
    if x.dtype != dtype:
        raise FuseMLATypeError(f"{name}: expected dtype {dtype}, got {describe(x)}")
    return x


def prepare(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk_t: object,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_decode_tokens: int | None = None,
    is_neox: bool = False,
    rope_applied: bool = False,
    kv_scale: Scale = None,
    out: torch.Tensor | None = None,
    q_pe_out: torch.Tensor | None = None,
    k_pe_out: torch.Tensor | None = None,
    q_out_dtype: torch.dtype | None = None,
    q_scale: Scale = None,
) -> PrologueArgs:
    """Check every argument of :func:`fusemla.mla_prologue` and allocate the outputs not given.

    Raises :class:`~fusemla.errors.FuseMLAValueError` / :class:`~fusemla.errors.FuseMLATypeError`
    naming the argument, before any launch or write.
    """
    q_nope = _tensor("q_nope", q_nope)
    if q_nope.dim() != 3:
        raise FuseMLAValueError(f"q_nope: expected shape [N, H, P], got {describe(q_nope)}")
    _dtype("q_nope", q_nope, ACT_DTYPES)
    B, H, P = q_nope.shape
    act = q_nope.dtype
    device = q_nope.device
    D = _num_decode_tokens(num_decode_tokens, B)

    q_pe = _tensor("q_pe", q_pe)
    if q_pe.dim() != 3:
        raise FuseMLAValueError(f"q_pe: expected shape [N={B}, H={H}, R], got {describe(q_pe)}")
    R = q_pe.shape[2]
    _shape("q_pe", q_pe, (B, H, R), lambda: f"[N={B}, H={H}, R]")
    if R % 2 != 0 or R == 0:
        raise FuseMLAValueError(f"q_pe: the rope dim R must be even and > 0, got {describe(q_pe)}")

    kv_c = _tensor("kv_c", kv_c)
    if kv_c.dim() != 2:
        raise FuseMLAValueError(f"kv_c: expected shape [N={B}, L], got {describe(kv_c)}")
    L = kv_c.shape[1]
    _shape("kv_c", kv_c, (B, L), lambda: f"[N={B}, L]")

    k_pe = _tensor("k_pe", k_pe)
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe[:, 0]
    _shape("k_pe", k_pe, (B, R), lambda: f"[N={B}, R={R}] or [N={B}, 1, R={R}]")

    w_uk_t = _weight(w_uk_t, H, P, L, act)

    positions = _tensor("positions", positions)
    _shape("positions", positions, (B,), lambda: f"[N={B}]")
    _dtype("positions", positions, INDEX_DTYPES)

    cos_cache = _tensor("cos_cache", cos_cache)
    sin_cache = _tensor("sin_cache", sin_cache)
    _shape("cos_cache", cos_cache, (None, R // 2), lambda: f"[max_position, R/2={R // 2}]")
    _shape("sin_cache", sin_cache, (cos_cache.shape[0], R // 2),
           lambda: f"[max_position={cos_cache.shape[0]}, R/2={R // 2}] (like cos_cache)")
    if cos_cache.shape[0] == 0:
        raise FuseMLAValueError(
            f"cos_cache: expected at least one position, got {describe(cos_cache)}")
    _dtype("cos_cache", cos_cache, ROPE_DTYPES)
    _dtype("sin_cache", sin_cache, ROPE_DTYPES)

    kv_cache = _tensor("kv_cache", kv_cache)
    _shape("kv_cache", kv_cache, (None, None, L + R),
           lambda: f"[num_blocks, block_size, L+R={L + R}]")
    if kv_cache.dtype == torch.uint8:
        raise FuseMLATypeError(
            "kv_cache: a uint8 cache must be viewed as its FP8 type first "
            f"(kv_cache.view(torch.float8_e4m3fn)), got {describe(kv_cache)}"
        )
    _dtype("kv_cache", kv_cache, CACHE_DTYPES)

    slot_mapping = _tensor("slot_mapping", slot_mapping)
    _shape("slot_mapping", slot_mapping, (B,), lambda: f"[N={B}]")
    _dtype("slot_mapping", slot_mapping, INDEX_DTYPES)

    for name, x in (("q_pe", q_pe), ("kv_c", kv_c), ("k_pe", k_pe)):
        if x.dtype != act:
            raise FuseMLATypeError(f"{name}: expected dtype {act} (like q_nope), got {describe(x)}")

    q_dtype = act if q_out_dtype is None else q_out_dtype
    if q_dtype not in (act,) + FP8_DTYPES:
        raise FuseMLATypeError(
            f"q_out_dtype: expected None, {act} or an FP8 dtype, got {q_out_dtype!r}"
        )
    q = _output("out", out, (D, H, L + R), lambda: f"[D={D}, H={H}, L+R={L + R}]", q_dtype,
                q_nope)
    q_pe_out = _output("q_pe_out", q_pe_out, (B - D, H, R),
                       lambda: f"[N-D={B - D}, H={H}, R={R}]",
                       act, q_nope)
    k_pe_out = _output("k_pe_out", k_pe_out, (B - D, R), lambda: f"[N-D={B - D}, R={R}]", act,
                       q_nope)

    kv_fp8 = kv_cache.dtype in FP8_DTYPES
    kv_scale = check_scale("kv_scale", kv_scale,
                           f"an FP8 kv_cache ({kv_cache.dtype})" if kv_fp8 else None)
    q_fp8 = q_dtype in FP8_DTYPES
    q_scale = check_scale("q_scale", q_scale, f"q_out_dtype={q_dtype}" if q_fp8 else None)

    w_parts = ([("w_uk_t.data", w_uk_t.data), ("w_uk_t.scale", w_uk_t.scale)]
               if not isinstance(w_uk_t, torch.Tensor) else [("w_uk_t", w_uk_t)])
    named = [("q_pe", q_pe), ("kv_c", kv_c), ("k_pe", k_pe), *w_parts,
             ("positions", positions), ("cos_cache", cos_cache), ("sin_cache", sin_cache),
             ("kv_cache", kv_cache), ("slot_mapping", slot_mapping), ("out", q),
             ("q_pe_out", q_pe_out), ("k_pe_out", k_pe_out)]
    if isinstance(kv_scale, torch.Tensor):
        named.append(("kv_scale", kv_scale))
    if isinstance(q_scale, torch.Tensor):
        named.append(("q_scale", q_scale))
    for name, x in named:
        if x.device != device:
            raise FuseMLATypeError(
                f"{name}: expected device {device} (like q_nope), got {describe(x)}"
            )
    for name, x in [("q_nope", q_nope)] + named:
        if x.dim() > 1 and not name.startswith("w_uk_t."):
            _last_contiguous(name, x)
    return PrologueArgs(
        q_nope=q_nope, q_pe=q_pe, kv_c=kv_c, k_pe=k_pe, w_uk_t=w_uk_t, positions=positions,
        cos_cache=cos_cache, sin_cache=sin_cache, kv_cache=kv_cache, slot_mapping=slot_mapping,
        num_decode_tokens=D, is_neox=bool(is_neox), apply_rope=not rope_applied,
        kv_scale=kv_scale, q_scale=q_scale,
        q=q, q_pe_out=q_pe_out, k_pe_out=k_pe_out,
    )


def check_device_values(args: PrologueArgs) -> None:
    """The syncing checks of ``FUSEMLA_DEBUG_CHECKS=1``: positions, slots and scale values."""
    if args.B == 0:
        return
    max_pos = args.cos_cache.shape[0]
    pos = args.positions.detach().cpu()
    bad = (pos < 0) | (pos >= max_pos)
    if args.apply_rope and bool(bad.any()):
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
    for name, scale, used in (("kv_scale", args.kv_scale, args.kv_cache.dtype in FP8_DTYPES),
                              ("q_scale", args.q_scale, args.q.dtype in FP8_DTYPES)):
        if used and isinstance(scale, torch.Tensor):
            value = float(scale.detach().cpu().reshape(()))
            if not (math.isfinite(value) and value > 0):
                raise FuseMLAValueError(f"{name}: expected a finite value > 0, got {value!r}")
