"""The epilogue's argument record and its host-side checks (no device sync, nothing launched).

The MLA decode epilogue is what a decode layer runs after attention: the W_UV up-projection of
the latent attention output, ``o[n, h*V + v] = sum_l attn_out[n, h, l] * W_UV[h, l, v]``, written
straight into o_proj's input ``[N, H*V]`` (vLLM's ``MLAAttention._v_up_proj``), optionally
quantized to FP8 per token and group of ``group_size`` columns as o_proj's block-FP8 GEMM takes
it (vLLM's ``per_token_group_quant_fp8``; :func:`fp8_group_max`).

Both the fused op (:mod:`fusemla.ops.epilogue`) and the reference
(:mod:`fusemla.reference.epilogue`) take their arguments through :func:`prepare` /
:func:`prepare_step`, which validate every argument once and allocate the outputs not given.
This module imports neither Triton nor a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusemla.contracts.checks import dtype as _dtype
from fusemla.contracts.checks import flag as _flag
from fusemla.contracts.checks import last_contiguous as _last_contiguous
from fusemla.contracts.checks import no_overlap as _no_overlap
from fusemla.contracts.checks import same_device as _same_device
from fusemla.contracts.checks import shape as _shape
from fusemla.contracts.checks import tensor as _tensor
from fusemla.dtypes import ACT_DTYPES, FP8_DTYPES
from fusemla.errors import FuseMLATypeError, FuseMLAValueError, describe

#: the smallest quantization group the kernel takes (one tensor-core tile's width)
MIN_GROUP = 16
#: vLLM's ``eps``: the smallest absmax a group's scale is computed from
EPS = 1e-10


def fp8_group_max(dtype: torch.dtype) -> float:
    """The largest code magnitude of the epilogue's FP8 output: vLLM's ``get_fp8_min_max``,
    448 for ``float8_e4m3fn`` and 224 (not the format's 240) for ``float8_e4m3fnuz``, which
    vLLM uses on ROCm for accuracy."""
    if dtype == torch.float8_e4m3fn:
        return 448.0
    if dtype == torch.float8_e4m3fnuz:
        return 224.0
    raise FuseMLATypeError(f"dtype: expected an FP8 dtype, got {dtype!r}")


@dataclass(frozen=True, eq=False)
class EpilogueSpec:
    """The per-layer half of the epilogue's arguments, checked once by :func:`build_spec`.

    ``w_uv``: ``[H, L, V]`` in the activations' dtype or an FP8
    :class:`fusemla.quant.QuantizedWeight` (per tensor, per head, or block scales);
    ``out_dtype``: None (the activations' dtype) or an FP8 dtype; the FP8 output's
    ``group_size``, ``scale_ue8m0`` (scales rounded up to powers of two) and
    ``scale_col_major`` (the layout of scales the op allocates itself).
    """

    w_uv: object
    out_dtype: torch.dtype | None = None
    group_size: int = 128
    scale_ue8m0: bool = False
    scale_col_major: bool = False

    @property
    def H(self) -> int:
        return self.w_uv.shape[0]

    @property
    def L(self) -> int:
        return self.w_uv.shape[1]

    @property
    def V(self) -> int:
        return self.w_uv.shape[2]

    @property
    def device(self) -> torch.device:
        from fusemla.quant import weight_parts

        return weight_parts(self.w_uv)[0].device

    @property
    def weight_format(self) -> str:
        """ "plain" or "fp8" (:func:`fusemla.quant.weight_format`)."""
        from fusemla.quant import weight_format

        return weight_format(self.w_uv)

    @property
    def fp8_out(self) -> bool:
        """The output is FP8 codes with per-group scales."""
        return self.out_dtype in FP8_DTYPES

    @property
    def act_dtype(self) -> torch.dtype | None:
        """The activations' dtype the weight fixes (plain weights), else None (bf16 or fp16)."""
        return self.w_uv.dtype if self.weight_format == "plain" else None


@dataclass
class EpilogueArgs:
    """One step's validated arguments and outputs on top of an :class:`EpilogueSpec`.

    ``out``: ``[N, H*V]`` (activations' dtype, or FP8 codes); ``scale_out``: ``[N, H*V /
    group_size]`` fp32 for FP8 outputs, else None."""

    spec: EpilogueSpec
    attn_out: torch.Tensor
    out: torch.Tensor
    scale_out: torch.Tensor | None

    @property
    def N(self) -> int:
        return self.attn_out.shape[0]

    @property
    def H(self) -> int:
        return self.spec.H

    @property
    def L(self) -> int:
        return self.spec.L

    @property
    def V(self) -> int:
        return self.spec.V

    @property
    def w_uv(self) -> object:
        return self.spec.w_uv

    @property
    def weight_format(self) -> str:
        return self.spec.weight_format

    @property
    def result(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """What the public functions return: ``out``, or ``(codes, scales)`` for FP8."""
        return (self.out, self.scale_out) if self.spec.fp8_out else self.out


def weight_layout_readable(w: torch.Tensor) -> bool:
    """The kernel reads a plain ``[H, L, V]`` weight as it is when it has stride 1 along V or
    along L (K-major, e.g. vLLM's transposed view of W_UV); any other layout needs a copy."""
    return w.shape[-1] <= 1 or 1 in (w.stride(-1), w.stride(-2))


def _weight(w_uv: object, dims: tuple[int, int] | None, act: torch.dtype | None) -> object:
    """W_UV: a [H, L, V] tensor (in the activations' dtype ``act`` where known) or an FP8
    QuantizedWeight; ``dims`` (H, L) where the activations fixed them already."""
    from fusemla.quant import QuantizedWeight

    H, L = dims if dims is not None else ("H", "L")
    if isinstance(w_uv, QuantizedWeight):
        if w_uv.format != "fp8":
            raise FuseMLAValueError(
                f"w_uv: expected a plain tensor or an FP8 QuantizedWeight (per tensor, per head "
                f"or block scales), got format {w_uv.format!r}"
            )
        if dims is not None and tuple(w_uv.shape[:2]) != dims:
            raise FuseMLAValueError(
                f"w_uv: expected a quantized weight of shape [H={H}, L={L}, V], got shape "
                f"{tuple(w_uv.shape)}"
            )
        if w_uv.block is not None:
            bk = w_uv.block[0]
            if bk & -bk < MIN_GROUP:  # the kernel's K chunk must divide the block's rows
                raise FuseMLAValueError(
                    f"w_uv: block scales with blocks of {bk} rows along L cannot be read: the "
                    f"row count must be a multiple of {MIN_GROUP} (DeepSeek's is 128)"
                )
        return w_uv
    w_uv = _tensor("w_uv", w_uv)
    if w_uv.dim() != 3 or 0 in w_uv.shape:
        raise FuseMLAValueError(f"w_uv: expected shape [H={H}, L={L}, V], got {describe(w_uv)}")
    if dims is not None:
        _shape("w_uv", w_uv, (*dims, None), lambda: f"[H={H}, L={L}, V]")
    _dtype("w_uv", w_uv, ACT_DTYPES, " (the activations' dtype) or a fusemla.quant.QuantizedWeight")
    if act is not None and w_uv.dtype != act:
        raise FuseMLATypeError(
            f"w_uv: expected dtype {act} (the activations' dtype) or a "
            f"fusemla.quant.QuantizedWeight, got {describe(w_uv)}"
        )
    if not weight_layout_readable(w_uv):
        raise FuseMLAValueError(
            f"w_uv: expected stride 1 along V (the last dim) or along L (K-major), got "
            f"{describe(w_uv)}"
        )
    return w_uv


def build_spec(
    w_uv: object,
    *,
    out_dtype: torch.dtype | None = None,
    group_size: int = 128,
    scale_ue8m0: bool = False,
    scale_col_major: bool = False,
    _dims: tuple[int, int] | None = None,
    _act: torch.dtype | None = None,
) -> EpilogueSpec:
    """Check the per-layer arguments once and return the :class:`EpilogueSpec` the per-step
    call takes (see :func:`fusemla.epilogue_spec`). ``_dims`` (H, L) and ``_act`` are what
    :func:`prepare` already read off ``attn_out``, so its errors name the argument that
    disagrees with it."""
    w_uv = _weight(w_uv, _dims, _act)
    act = _act or (w_uv.dtype if isinstance(w_uv, torch.Tensor) else None)
    if out_dtype is not None and out_dtype not in FP8_DTYPES:
        if not isinstance(out_dtype, torch.dtype) or out_dtype not in ACT_DTYPES:
            raise FuseMLATypeError(
                f"out_dtype: expected None, the activations' dtype or an FP8 dtype, got "
                f"{describe(out_dtype)}"
            )
        if act is not None and out_dtype != act:
            raise FuseMLATypeError(
                f"out_dtype: expected None, {act} (the activations' dtype) or an FP8 dtype, "
                f"got {out_dtype!r}"
            )
    _flag("scale_ue8m0", scale_ue8m0)
    _flag("scale_col_major", scale_col_major)
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise FuseMLATypeError(f"group_size: expected a positive int, got {describe(group_size)}")
    V = w_uv.shape[2]
    if out_dtype in FP8_DTYPES:
        if group_size < MIN_GROUP or group_size & (group_size - 1):
            raise FuseMLAValueError(
                f"group_size: expected a power of two >= {MIN_GROUP} (o_proj's block-FP8 input "
                f"uses 128), got {group_size}"
            )
        if V % group_size:
            raise FuseMLAValueError(
                f"group_size: a quantization group must lie inside one head's V={V} outputs "
                f"(V a multiple of group_size), got group_size={group_size}"
            )
    elif group_size <= 0:
        raise FuseMLAValueError(f"group_size: expected a positive int, got {group_size}")
    from fusemla.quant import weight_parts

    w_data, w_scale, _ = weight_parts(w_uv)
    if w_scale is not None:
        _same_device([("w_uv.scale", w_scale)], w_data.device, "w_uv.data")
    return EpilogueSpec(
        w_uv=w_uv,
        out_dtype=out_dtype,
        group_size=group_size,
        scale_ue8m0=scale_ue8m0,
        scale_col_major=scale_col_major,
    )


def _attn_out(attn_out: object) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``attn_out`` ``[N, H, L]`` checked, and its dims."""
    attn_out = _tensor("attn_out", attn_out)
    if attn_out.dim() != 3 or attn_out.shape[1] == 0 or attn_out.shape[2] == 0:
        raise FuseMLAValueError(f"attn_out: expected shape [N, H, L], got {describe(attn_out)}")
    _dtype("attn_out", attn_out, ACT_DTYPES)
    _last_contiguous("attn_out", attn_out)
    N, H, L = attn_out.shape
    return attn_out, (N, H, L)


def _scale_out(spec: EpilogueSpec, N: int, scale_out: object, like: torch.Tensor) -> torch.Tensor:
    groups = spec.H * spec.V // spec.group_size
    if scale_out is None:
        if spec.scale_col_major:  # [N, G] with stride (1, N): vLLM's column-major scales
            return like.new_empty((groups, N), dtype=torch.float32).t()
        return like.new_empty((N, groups), dtype=torch.float32)
    scale_out = _tensor("scale_out", scale_out)
    _shape(
        "scale_out",
        scale_out,
        (N, groups),
        lambda: f"[N={N}, H*V/group_size={groups}]",
    )
    _dtype("scale_out", scale_out, (torch.float32,))
    return scale_out


def prepare_step(
    spec: EpilogueSpec,
    attn_out: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    _checked: tuple | None = None,
) -> EpilogueArgs:
    """Check one step's arguments against a layer's spec and allocate the outputs not given.
    Raises before anything is written."""
    if not isinstance(spec, EpilogueSpec):
        raise FuseMLATypeError(
            f"spec: expected a fusemla EpilogueSpec (fusemla.epilogue_spec), got {describe(spec)}"
        )
    attn_out, (N, H, L) = _checked or _attn_out(attn_out)
    if (H, L) != (spec.H, spec.L):
        raise FuseMLAValueError(
            f"attn_out: expected shape [N, H={spec.H}, L={spec.L}] (the spec's w_uv), got "
            f"{describe(attn_out)}"
        )
    act = spec.act_dtype
    if act is not None and attn_out.dtype != act:
        raise FuseMLATypeError(
            f"attn_out: expected dtype {act} (that of w_uv), got {describe(attn_out)}"
        )
    if spec.out_dtype not in (None, *FP8_DTYPES) and spec.out_dtype != attn_out.dtype:
        raise FuseMLATypeError(
            f"attn_out: expected dtype {spec.out_dtype} (the spec's out_dtype), got "
            f"{describe(attn_out)}"
        )
    device = attn_out.device
    if spec.device != device:
        raise FuseMLATypeError(
            f"attn_out: expected device {spec.device} (that of w_uv), got {describe(attn_out)}"
        )
    HV = H * spec.V
    out_dtype = spec.out_dtype if spec.fp8_out else attn_out.dtype
    given = (out is not None, scale_out is not None)  # buffers made here overlap nothing
    if out is None:
        out = attn_out.new_empty((N, HV), dtype=out_dtype)
    else:
        out = _tensor("out", out)
        _shape("out", out, (N, HV), lambda: f"[N={N}, H*V={HV}]")
        if out.dtype != out_dtype:
            raise FuseMLATypeError(f"out: expected dtype {out_dtype}, got {describe(out)}")
        _last_contiguous("out", out)
    if spec.fp8_out:
        scale_out = _scale_out(spec, N, scale_out, attn_out)
    elif scale_out is not None:
        raise FuseMLAValueError(
            f"scale_out: only FP8 outputs have scales (out_dtype={spec.out_dtype}), got "
            f"{describe(scale_out)}"
        )
    written = [("out", out)] + ([("scale_out", scale_out)] if scale_out is not None else [])
    _same_device(written, device, "attn_out")
    # (W_UV: a layer's own buffer, not compared)
    _no_overlap([w for w, g in zip(written, given) if g], [("attn_out", attn_out)])
    return EpilogueArgs(spec=spec, attn_out=attn_out, out=out, scale_out=scale_out)


def prepare(
    attn_out: torch.Tensor,
    w_uv: object,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    group_size: int = 128,
    scale_ue8m0: bool = False,
    scale_col_major: bool = False,
    scale_out: torch.Tensor | None = None,
) -> EpilogueArgs:
    """Check every argument of :func:`fusemla.mla_epilogue` (the per-layer ones into an
    :class:`EpilogueSpec`, then the step's) and allocate the outputs not given. ``attn_out``
    is read first, so an error names the per-layer argument that disagrees with it."""
    checked = _attn_out(attn_out)
    _, H, L = checked[1]
    spec = build_spec(
        w_uv,
        out_dtype=out_dtype,
        group_size=group_size,
        scale_ue8m0=scale_ue8m0,
        scale_col_major=scale_col_major,
        _dims=(H, L),
        _act=checked[0].dtype,
    )
    return prepare_step(spec, checked[0], out=out, scale_out=scale_out, _checked=checked)
