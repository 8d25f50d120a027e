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
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from fusemla.contracts.checks import dtype as _dtype
from fusemla.contracts.checks import last_contiguous as _last_contiguous
from fusemla.contracts.checks import no_overlap as _no_overlap
from fusemla.contracts.checks import shape as _shape
from fusemla.contracts.checks import tensor as _tensor
from fusemla.dtypes import ACT_DTYPES, CACHE_DTYPES, FP8_DTYPES, INDEX_DTYPES, ROPE_DTYPES
from fusemla.errors import FuseMLATypeError, FuseMLAValueError, describe

Scale = float | torch.Tensor | None


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


#: the activation quantizations a spec may ask for (None: the dot runs in the activations' dtype)
ACT_QUANTS = (None, "fp8")


def tensor_key(t: torch.Tensor) -> tuple:
    """What identifies a spec source tensor's current contents cheaply (the layer's and the vLLM
    plugin's spec caches key on it): storage, layout and its version counter (an in-place
    reload, e.g. an RL weight update, bumps it). An inference tensor has no version counter
    (vLLM's rotary embedding may recast its cache inside inference mode): its key is storage
    and layout only, so replacing it is seen, writing into it in place is not."""
    try:
        version = t._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        version = None
    return (t.data_ptr(), t.dtype, t.device, tuple(t.shape), tuple(t.stride()), version)


@dataclass(frozen=True, eq=False)
class PrologueSpec:
    """The per-layer half of the prologue's arguments, checked once by :func:`build_spec`.

    ``w_uk_t``: ``[H, P, L]`` in the activations' dtype or a
    :class:`fusemla.quant.QuantizedWeight`; ``cos_cache`` / ``sin_cache``: ``[max_position, R/2]``;
    ``is_neox``: the RoPE pairing; ``q_out_dtype`` / ``q_scale``: the decode query's format
    (None: the activations' dtype); ``act_quant``: None, or ``"fp8"``: the decode tokens' q_nope
    is quantized in the kernel to the weight's FP8 format with one scale per (token, head)
    (``amax / fp8_max`` over its P values) and the BMM runs FP8 x FP8 (FP8 weights only).
    An engine builds one per layer and calls :func:`fusemla.mla_prologue_step` at every step.
    """

    w_uk_t: object
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    is_neox: bool = False
    q_out_dtype: torch.dtype | None = None
    q_scale: Scale = None
    act_quant: str | None = None

    @property
    def H(self) -> int:
        return self.w_uk_t.shape[0]

    @property
    def P(self) -> int:
        return self.w_uk_t.shape[1]

    @property
    def L(self) -> int:
        return self.w_uk_t.shape[2]

    @property
    def R(self) -> int:
        return 2 * self.cos_cache.shape[1]

    @property
    def device(self) -> torch.device:
        return self.cos_cache.device

    @property
    def weight_format(self) -> str:
        """ "plain", "fp8" or "mxfp4" (:func:`fusemla.quant.weight_format`)."""
        from fusemla.quant import weight_format

        return weight_format(self.w_uk_t)

    @property
    def act_dtype(self) -> torch.dtype | None:
        """The activations' dtype the weight fixes (plain weights), else None (bf16 or fp16)."""
        return self.w_uk_t.dtype if self.weight_format == "plain" else None


@dataclass
class PrologueArgs:
    """One step's validated arguments and outputs on top of a :class:`PrologueSpec`
    (``k_pe`` always ``[N, R]``)."""

    spec: PrologueSpec
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    positions: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_decode_tokens: int  # D: tokens [0, D) decode, [D, N) prefill
    apply_rope: bool  # False: the caller already rotated q_pe and k_pe (rope_applied=True)
    kv_scale: Scale
    q: torch.Tensor  # [D, H, L + R] output
    q_pe_out: torch.Tensor  # [N - D, H, R] output
    k_pe_out: torch.Tensor  # [N - D, R] output

    @property
    def w_uk_t(self) -> object:
        return self.spec.w_uk_t

    @property
    def cos_cache(self) -> torch.Tensor:
        return self.spec.cos_cache

    @property
    def sin_cache(self) -> torch.Tensor:
        return self.spec.sin_cache

    @property
    def is_neox(self) -> bool:
        return self.spec.is_neox

    @property
    def q_scale(self) -> Scale:
        return self.spec.q_scale

    @property
    def act_quant(self) -> str | None:
        return self.spec.act_quant

    @property
    def weight_format(self) -> str:
        return self.spec.weight_format

    @property
    def N(self) -> int:
        """The number of tokens (decode + prefill)."""
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


def _weight(w_uk_t: object, dims: tuple[int, int, int] | None, act: torch.dtype | None) -> object:
    """W_UK_T: a [H, P, L] tensor (in the activations' dtype ``act`` where known), or a
    QuantizedWeight; ``dims`` (H, P, L) where the activations fixed them already."""
    from fusemla.quant import QuantizedWeight

    H, P, L = dims if dims is not None else ("H", "P", "L")
    if isinstance(w_uk_t, QuantizedWeight):
        if dims is not None and tuple(w_uk_t.shape) != dims:
            raise FuseMLAValueError(
                f"w_uk_t: expected a quantized weight of shape [H={H}, P={P}, L={L}], got "
                f"format {w_uk_t.format!r} with shape {tuple(w_uk_t.shape)}"
            )
        if w_uk_t.block is not None and w_uk_t.block[0] < w_uk_t.K:
            raise FuseMLAValueError(
                f"w_uk_t: FP8 block scales of {w_uk_t.block[0]} rows cannot cover P="
                f"{w_uk_t.K}: the prologue reads block scales whose rows span all of P "
                "(DeepSeek's 128 x 128 blocks at P = 128; fusemla.quant.split_kv_b_proj_fp8)"
            )
        return w_uk_t
    w_uk_t = _tensor("w_uk_t", w_uk_t)
    if dims is None:
        if w_uk_t.dim() != 3 or 0 in w_uk_t.shape:
            raise FuseMLAValueError(f"w_uk_t: expected shape [H, P, L], got {describe(w_uk_t)}")
        _dtype(
            "w_uk_t",
            w_uk_t,
            ACT_DTYPES,
            " (the activations' dtype) or a fusemla.quant.QuantizedWeight",
        )
    else:
        _shape("w_uk_t", w_uk_t, dims, lambda: f"[H={H}, P={P}, L={L}]")
    if act is not None and w_uk_t.dtype != act:
        raise FuseMLATypeError(
            f"w_uk_t: expected dtype {act} (the activations' dtype) or a "
            f"fusemla.quant.QuantizedWeight, got {describe(w_uk_t)}"
        )
    if not weight_layout_readable(w_uk_t):
        raise FuseMLAValueError(
            "w_uk_t: expected stride 1 along L (the last dim) or along P (K-major), got "
            f"{describe(w_uk_t)}"
        )
    return w_uk_t


def weight_layout_readable(w_uk_t: torch.Tensor) -> bool:
    """The kernel reads a plain ``[H, P, L]`` weight as it is when it has stride 1 along L or
    along P (K-major, e.g. vLLM's permuted view of W_UK); any other layout needs a copy."""
    return w_uk_t.shape[-1] <= 1 or 1 in (w_uk_t.stride(-1), w_uk_t.stride(-2))


def build_spec(
    w_uk_t: object,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    *,
    is_neox: bool = False,
    q_out_dtype: torch.dtype | None = None,
    q_scale: Scale = None,
    act_quant: str | None = None,
    _dims: tuple[int, int, int, int] | None = None,
    _act: torch.dtype | None = None,
) -> PrologueSpec:
    """Check the per-layer arguments once and return the :class:`PrologueSpec` the per-step
    call takes (see :func:`fusemla.prologue_spec`). ``_dims`` (H, P, L, R) and ``_act`` are
    what :func:`prepare` already read off the activations, so its errors name the argument
    that disagrees with them."""
    w_dims = _dims[:3] if _dims is not None else None
    w_uk_t = _weight(w_uk_t, w_dims, _act)
    if not isinstance(is_neox, bool):
        raise FuseMLATypeError(f"is_neox: expected a bool, got {describe(is_neox)}")
    half = _dims[3] // 2 if _dims is not None else None
    what_r = f"R/2={half}" if half is not None else "R/2"
    cos_cache = _tensor("cos_cache", cos_cache)
    sin_cache = _tensor("sin_cache", sin_cache)
    _shape("cos_cache", cos_cache, (None, half), lambda: f"[max_position, {what_r}]")
    _shape(
        "sin_cache",
        sin_cache,
        tuple(cos_cache.shape),
        lambda: f"[max_position={cos_cache.shape[0]}, R/2={cos_cache.shape[1]}] (like cos_cache)",
    )
    if cos_cache.shape[0] == 0 or cos_cache.shape[1] == 0:
        raise FuseMLAValueError(
            f"cos_cache: expected at least one position and R/2 > 0, got {describe(cos_cache)}"
        )
    _dtype("cos_cache", cos_cache, ROPE_DTYPES)
    _dtype("sin_cache", sin_cache, ROPE_DTYPES)
    for name, x in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        _last_contiguous(name, x)

    from fusemla.quant import weight_format, weight_parts

    act = _act or (w_uk_t.dtype if weight_format(w_uk_t) == "plain" else None)
    if (
        q_out_dtype is not None
        and q_out_dtype not in FP8_DTYPES
        and (q_out_dtype not in ACT_DTYPES or (act is not None and q_out_dtype != act))
    ):
        allowed = (
            f"None, {act} or an FP8 dtype"
            if act is not None
            else "None, the activations' dtype or an FP8 dtype"
        )
        raise FuseMLATypeError(f"q_out_dtype: expected {allowed}, got {q_out_dtype!r}")
    q_fp8 = q_out_dtype in FP8_DTYPES
    q_scale = check_scale("q_scale", q_scale, f"q_out_dtype={q_out_dtype}" if q_fp8 else None)

    if act_quant not in ACT_QUANTS:
        raise FuseMLAValueError(f"act_quant: expected None or 'fp8', got {act_quant!r}")
    w_format = weight_format(w_uk_t)
    if act_quant == "fp8" and w_format != "fp8":
        raise FuseMLAValueError(
            "act_quant: 'fp8' (an FP8 x FP8 BMM) needs FP8 weights (a QuantizedWeight of "
            f"format 'fp8', e.g. fusemla.quant.quantize_fp8_weight), got w_uk_t of format "
            f"{w_format!r}"
        )

    device = cos_cache.device
    w_data, w_scale, _ = weight_parts(w_uk_t)
    w_parts = (
        [("w_uk_t", w_data)]
        if w_scale is None
        else [("w_uk_t.data", w_data), ("w_uk_t.scale", w_scale)]
    )
    named = [*w_parts, ("sin_cache", sin_cache)]
    if isinstance(q_scale, torch.Tensor):
        named.append(("q_scale", q_scale))
    for name, x in named:
        if x.device != device:
            raise FuseMLATypeError(
                f"{name}: expected device {device} (like cos_cache), got {describe(x)}"
            )
    return PrologueSpec(
        w_uk_t=w_uk_t,
        cos_cache=cos_cache,
        sin_cache=sin_cache,
        is_neox=is_neox,
        q_out_dtype=q_out_dtype,
        q_scale=q_scale,
        act_quant=act_quant,
    )


def _num_decode_tokens(value: object, N: int) -> int:
    if value is None:
        return N
    if isinstance(value, bool) or not isinstance(value, int):
        raise FuseMLATypeError(
            f"num_decode_tokens: expected an int in [0, N={N}] or None (all decode), "
            f"got {describe(value)}"
        )
    if not 0 <= value <= N:
        raise FuseMLAValueError(
            f"num_decode_tokens: expected a value in [0, N={N}] (decode tokens come first), "
            f"got {value}"
        )
    return value


def _output(
    name: str,
    x: torch.Tensor | None,
    shape: tuple,
    what: Callable[[], str],
    dtype: torch.dtype,
    like: torch.Tensor,
) -> torch.Tensor:
    """A given output, checked; or a new empty one."""
    if x is None:
        return like.new_empty(shape, dtype=dtype)
    x = _tensor(name, x)
    _shape(name, x, shape, what)
    if x.dtype != dtype:
        raise FuseMLATypeError(f"{name}: expected dtype {dtype}, got {describe(x)}")
    return x


def _activations(q_nope: object, q_pe: object, kv_c: object, k_pe: object):
    """The activations' first checks: (q_nope, q_pe, kv_c, k_pe [N, R]) and their dims
    (N, H, P, L, R) and dtype, each named when it disagrees with q_nope."""
    q_nope = _tensor("q_nope", q_nope)
    if q_nope.dim() != 3:
        raise FuseMLAValueError(f"q_nope: expected shape [N, H, P], got {describe(q_nope)}")
    _dtype("q_nope", q_nope, ACT_DTYPES)
    N, H, P = q_nope.shape
    q_pe = _tensor("q_pe", q_pe)
    if q_pe.dim() != 3:
        raise FuseMLAValueError(f"q_pe: expected shape [N={N}, H={H}, R], got {describe(q_pe)}")
    R = q_pe.shape[2]
    _shape("q_pe", q_pe, (N, H, R), lambda: f"[N={N}, H={H}, R]")
    if R % 2 != 0 or R == 0:
        raise FuseMLAValueError(f"q_pe: the rope dim R must be even and > 0, got {describe(q_pe)}")
    kv_c = _tensor("kv_c", kv_c)
    if kv_c.dim() != 2:
        raise FuseMLAValueError(f"kv_c: expected shape [N={N}, L], got {describe(kv_c)}")
    L = kv_c.shape[1]
    _shape("kv_c", kv_c, (N, L), lambda: f"[N={N}, L]")
    k_pe = _tensor("k_pe", k_pe)
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe[:, 0]
    _shape("k_pe", k_pe, (N, R), lambda: f"[N={N}, R={R}] or [N={N}, 1, R={R}]")
    return q_nope, q_pe, kv_c, k_pe, (N, H, P, L, R)


def prepare_step(
    spec: PrologueSpec,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_decode_tokens: int | None = None,
    rope_applied: bool = False,
    kv_scale: Scale = None,
    out: torch.Tensor | None = None,
    q_pe_out: torch.Tensor | None = None,
    k_pe_out: torch.Tensor | None = None,
    _acts: tuple | None = None,
) -> PrologueArgs:
    """Check one step's arguments against ``spec`` and allocate the outputs not given.
    (``_acts``: what :func:`_activations` returned for these activations, when :func:`prepare`
    already ran it.)

    Raises :class:`~fusemla.errors.FuseMLAValueError` / :class:`~fusemla.errors.FuseMLATypeError`
    naming the argument, before any launch or write.
    """
    if not isinstance(spec, PrologueSpec):
        raise FuseMLATypeError(
            f"spec: expected a PrologueSpec (fusemla.prologue_spec(...)), got {describe(spec)}"
        )
    q_nope, q_pe, kv_c, k_pe, (N, H, P, L, R) = _acts or _activations(q_nope, q_pe, kv_c, k_pe)
    act = q_nope.dtype
    device = q_nope.device
    sH, sP, sL, sR = spec.H, spec.P, spec.L, spec.R
    if (H, P) != (sH, sP):
        raise FuseMLAValueError(
            f"q_nope: expected shape [N, H={sH}, P={sP}] (the spec's "
            f"w_uk_t), got {describe(q_nope)}"
        )
    if R != sR:
        raise FuseMLAValueError(
            f"q_pe: expected shape [N={N}, H={H}, R={sR}] (the spec's "
            f"RoPE tables hold R/2={sR // 2}), got {describe(q_pe)}"
        )
    if L != sL:
        raise FuseMLAValueError(
            f"kv_c: expected shape [N={N}, L={sL}] (the spec's w_uk_t), got {describe(kv_c)}"
        )
    for name, x in (("q_pe", q_pe), ("kv_c", kv_c), ("k_pe", k_pe)):
        if x.dtype != act:
            raise FuseMLATypeError(f"{name}: expected dtype {act} (like q_nope), got {describe(x)}")
    if spec.act_dtype is not None and spec.act_dtype != act:
        raise FuseMLATypeError(
            f"q_nope: expected dtype {spec.act_dtype} (the spec's w_uk_t), got {describe(q_nope)}"
        )
    if spec.q_out_dtype in ACT_DTYPES and spec.q_out_dtype != act:
        raise FuseMLATypeError(
            f"q_nope: expected dtype {spec.q_out_dtype} (the spec's "
            f"q_out_dtype), got {describe(q_nope)}"
        )
    D = _num_decode_tokens(num_decode_tokens, N)
    if not isinstance(rope_applied, bool):
        raise FuseMLATypeError(f"rope_applied: expected a bool, got {describe(rope_applied)}")

    positions = _tensor("positions", positions)
    _shape("positions", positions, (N,), lambda: f"[N={N}]")
    _dtype("positions", positions, INDEX_DTYPES)

    kv_cache = _tensor("kv_cache", kv_cache)
    _shape(
        "kv_cache", kv_cache, (None, None, L + R), lambda: f"[num_blocks, block_size, L+R={L + R}]"
    )
    if kv_cache.dtype == torch.uint8:
        raise FuseMLATypeError(
            "kv_cache: a uint8 cache must be viewed as its FP8 type first "
            f"(kv_cache.view(torch.float8_e4m3fn)), got {describe(kv_cache)}"
        )
    _dtype("kv_cache", kv_cache, CACHE_DTYPES)

    slot_mapping = _tensor("slot_mapping", slot_mapping)
    _shape("slot_mapping", slot_mapping, (N,), lambda: f"[N={N}]")
    _dtype("slot_mapping", slot_mapping, INDEX_DTYPES)

    q_dtype = spec.q_out_dtype or act
    gave = (out is not None, q_pe_out is not None, k_pe_out is not None)
    q = _output("out", out, (D, H, L + R), lambda: f"[D={D}, H={H}, L+R={L + R}]", q_dtype, q_nope)
    q_pe_out = _output(
        "q_pe_out", q_pe_out, (N - D, H, R), lambda: f"[N-D={N - D}, H={H}, R={R}]", act, q_nope
    )
    k_pe_out = _output(
        "k_pe_out", k_pe_out, (N - D, R), lambda: f"[N-D={N - D}, R={R}]", act, q_nope
    )

    kv_fp8 = kv_cache.dtype in FP8_DTYPES
    kv_scale = check_scale(
        "kv_scale", kv_scale, f"an FP8 kv_cache ({kv_cache.dtype})" if kv_fp8 else None
    )

    named = [
        ("q_pe", q_pe),
        ("kv_c", kv_c),
        ("k_pe", k_pe),
        ("positions", positions),
        ("kv_cache", kv_cache),
        ("slot_mapping", slot_mapping),
        ("out", q),
        ("q_pe_out", q_pe_out),
        ("k_pe_out", k_pe_out),
        ("spec", spec.cos_cache),
    ]
    if isinstance(kv_scale, torch.Tensor):
        named.append(("kv_scale", kv_scale))
    for name, x in named:
        if x.device != device:
            what = "the spec's tensors (cos_cache)" if name == "spec" else name
            raise FuseMLATypeError(
                f"{what}: expected device {device} (like q_nope), got {describe(x)}"
            )
    for name, x in [("q_nope", q_nope)] + named:
        if x.dim() > 1 and name != "spec":  # the spec's tensors were checked by build_spec
            _last_contiguous(name, x)
    # what the kernel writes (the outputs the caller gave: those made here overlap nothing)
    # against what it reads; rotating in place (q_pe_out = q_pe[D:], k_pe_out = k_pe[D:]) is
    # allowed: one program reads each such row whole before it writes it. (The spec's weights
    # and RoPE tables: a layer's own buffers, not compared.)
    outs = (("out", q), ("q_pe_out", q_pe_out), ("k_pe_out", k_pe_out))
    written = [w for w, g in zip(outs, gave) if g] + [("kv_cache", kv_cache)]
    read = [
        ("q_nope", q_nope),
        ("q_pe", q_pe),
        ("kv_c", kv_c),
        ("k_pe", k_pe),
        ("positions", positions),
        ("slot_mapping", slot_mapping),
    ]
    if isinstance(kv_scale, torch.Tensor):
        read.append(("kv_scale", kv_scale))
    _no_overlap(written, read, (("q_pe_out", "q_pe", D), ("k_pe_out", "k_pe", D)))
    return PrologueArgs(
        spec=spec,
        q_nope=q_nope,
        q_pe=q_pe,
        kv_c=kv_c,
        k_pe=k_pe,
        positions=positions,
        kv_cache=kv_cache,
        slot_mapping=slot_mapping,
        num_decode_tokens=D,
        apply_rope=not rope_applied,
        kv_scale=kv_scale,
        q=q,
        q_pe_out=q_pe_out,
        k_pe_out=k_pe_out,
    )


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
    act_quant: str | None = None,
) -> PrologueArgs:
    """Check every argument of :func:`fusemla.mla_prologue` (the per-layer ones into a
    :class:`PrologueSpec`, then the step's) and allocate the outputs not given.

    The activations are read first, so an error names the per-layer argument that disagrees
    with them (``w_uk_t``, ``cos_cache``, ...). Raises before any launch or write.
    """
    acts = _activations(q_nope, q_pe, kv_c, k_pe)
    _, H, P, L, R = acts[4]
    spec = build_spec(
        w_uk_t,
        cos_cache,
        sin_cache,
        is_neox=is_neox,
        q_out_dtype=q_out_dtype,
        q_scale=q_scale,
        act_quant=act_quant,
        _dims=(H, P, L, R),
        _act=acts[0].dtype,
    )
    return prepare_step(
        spec,
        *acts[:4],
        positions,
        kv_cache,
        slot_mapping,
        num_decode_tokens=num_decode_tokens,
        rope_applied=rope_applied,
        kv_scale=kv_scale,
        out=out,
        q_pe_out=q_pe_out,
        k_pe_out=k_pe_out,
        _acts=acts,
    )


def check_device_values(args: PrologueArgs) -> None:
    """The syncing checks of ``FUSEMLA_DEBUG_CHECKS=1``: positions, slots and scale values."""
    if args.N == 0:
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
    for name, scale, used in (
        ("kv_scale", args.kv_scale, args.kv_cache.dtype in FP8_DTYPES),
        ("q_scale", args.q_scale, args.q.dtype in FP8_DTYPES),
    ):
        if used and isinstance(scale, torch.Tensor):
            value = float(scale.detach().cpu().reshape(()))
            if not (math.isfinite(value) and value > 0):
                raise FuseMLAValueError(f"{name}: expected a finite value > 0, got {value!r}")
