"""Rotary position embedding (RoPE) tables and a reference rotation for DeepSeek MLA.

Everything here is plain PyTorch; nothing launches a Triton kernel.

Cache layout
    Serving engines (vLLM among them) keep one table ``cos_sin_cache`` of shape
    ``[max_position, R]`` per model, where ``R`` is the rotary head dim (``qk_rope_head_dim``,
    64 for DeepSeek-V2/V3). Row ``p`` is ``cat(cos(p * inv_freq) * m, sin(p * inv_freq) * m)``:
    the cosines in the first ``R/2`` columns, the sines in the last ``R/2``, and ``m`` the
    attention factor ("mscale"; 1 for plain RoPE). :func:`split_cos_sin_cache` turns it into the
    two ``[max_position, R/2]`` tables the kernels read; :func:`deepseek_yarn_cos_sin_cache`,
    :func:`rope_cos_sin_cache` and :func:`rope_cache_from_hf_config` build it.

Rotation styles
    DeepSeek rotates *interleaved* pairs ``(x[2i], x[2i+1])`` by angle ``i`` (``is_neox=False``);
    GPT-NeoX style rotates the pairs ``(x[i], x[i + R/2])`` (``is_neox=True``).
    :func:`apply_rope` implements both as the float32 reference the kernels are tested against.

YaRN (DeepSeek variant)
    Frequencies whose wavelength is short compared to the original context keep their
    extrapolated value ``base ** (-2i/R)``; long-wavelength ones are interpolated (divided by
    ``scaling_factor``); the dims in between are blended with a linear ramp. The correction range
    comes from the dim at which a frequency turns ``beta_fast`` (resp. ``beta_slow``) times over
    ``original_max_position`` positions: ``d(b) = R * ln(L / (2 * pi * b)) / (2 * ln(base))``,
    floored (resp. ceiled) and clamped to ``[0, R - 1]``. The cos/sin values are scaled by
    ``yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fusemla.errors import FuseMLATypeError, FuseMLAValueError, describe

__all__ = [
    "apply_rope",
    "deepseek_yarn_cos_sin_cache",
    "deepseek_yarn_inv_freq",
    "rope_cache_from_hf_config",
    "rope_cos_sin_cache",
    "rope_inv_freq",
    "split_cos_sin_cache",
    "yarn_get_mscale",
]


# --------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------


def _check_rope_dim(rope_dim: int, name: str = "rope_dim") -> int:
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int):
        raise FuseMLATypeError(f"{name}: expected a positive even int, got {describe(rope_dim)}")
    if rope_dim <= 0 or rope_dim % 2 != 0:
        raise FuseMLAValueError(f"{name}: expected a positive even int, got {rope_dim}")
    return rope_dim


def _check_max_position(max_position: int, name: str = "max_position") -> int:
    if isinstance(max_position, bool) or not isinstance(max_position, int):
        raise FuseMLATypeError(f"{name}: expected a positive int, got {describe(max_position)}")
    if max_position <= 0:
        raise FuseMLAValueError(f"{name}: expected a positive int, got {max_position}")
    return max_position


def _check_float_dtype(dtype: torch.dtype, name: str = "dtype") -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise FuseMLATypeError(
            f"{name}: expected a floating torch.dtype (e.g. torch.float32), got {dtype!r}"
        )
    return dtype


# --------------------------------------------------------------------------------------------
# Cache splitting
# --------------------------------------------------------------------------------------------


def split_cos_sin_cache(cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an engine's ``[max_position, R]`` RoPE cache into its cosine and sine halves.

    Args:
        cos_sin_cache: ``cat(cos * m, sin * m)`` along the last dim, as vLLM keeps it: a 2-D
            floating tensor with an even last dim ``R``.

    Returns:
        ``(cos_cache, sin_cache)``, each ``[max_position, R/2]`` with the dtype and device of
        ``cos_sin_cache``: views into it (no copy, no memory: the kernel reads them with their
        row stride) when its last dim is contiguous, as an engine's cache is; contiguous copies
        otherwise. An engine shares one RoPE cache between all layers (vLLM does), so a copy
        per layer would hold ``layers x max_position x R`` values for nothing (1.2 GiB at
        DeepSeek-V3's 61 layers and 163,840 positions in bf16), and a copy made inside a CUDA
        graph capture would be replayed with the graph.

    Raises:
        FuseMLATypeError: ``cos_sin_cache`` is not a tensor or not floating point.
        FuseMLAValueError: ``cos_sin_cache`` is not 2-D or its last dim is odd or zero.
    """
    if not isinstance(cos_sin_cache, torch.Tensor):
        raise FuseMLATypeError(
            "cos_sin_cache: expected a torch.Tensor of shape [max_position, rope_dim], "
            f"got {describe(cos_sin_cache)}"
        )
    if not cos_sin_cache.dtype.is_floating_point:
        raise FuseMLATypeError(
            "cos_sin_cache: expected a floating dtype (float32/bfloat16/float16), "
            f"got {describe(cos_sin_cache)}"
        )
    if cos_sin_cache.dim() != 2:
        raise FuseMLAValueError(
            "cos_sin_cache: expected a 2-D tensor [max_position, rope_dim], "
            f"got {cos_sin_cache.dim()}-D {describe(cos_sin_cache)}"
        )
    width = cos_sin_cache.shape[1]
    if width == 0 or width % 2 != 0:
        raise FuseMLAValueError(
            "cos_sin_cache: expected a positive even last dim rope_dim (cos in the first "
            f"rope_dim/2 columns, sin in the last), got last dim {width} in "
            f"{describe(cos_sin_cache)}"
        )
    half = width // 2
    cos_cache, sin_cache = cos_sin_cache[:, :half], cos_sin_cache[:, half:]
    if cos_sin_cache.stride(1) != 1:
        cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
    return cos_cache, sin_cache


# --------------------------------------------------------------------------------------------
# Frequencies
# --------------------------------------------------------------------------------------------


def _dim_exponents(rope_dim: int, device: torch.device | str | None) -> torch.Tensor:
    """``2i / R`` for ``i in [0, R/2)`` as float32 (the exponents of ``base``)."""
    return torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim


def rope_inv_freq(
    rope_dim: int = 64,
    base: float = 10000.0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Plain RoPE inverse frequencies ``base ** (-2i / R)`` as a float32 ``[R/2]`` tensor."""
    _check_rope_dim(rope_dim)
    return 1.0 / (float(base) ** _dim_exponents(rope_dim, device))


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(num_rotations: float, rope_dim: int, base: float, max_pos: int) -> float:
    """The (fractional) dim index whose frequency makes ``num_rotations`` turns in ``max_pos``."""
    return rope_dim * math.log(max_pos / (num_rotations * 2.0 * math.pi)) / (2.0 * math.log(base))


def _yarn_correction_range(
    beta_fast: float,
    beta_slow: float,
    rope_dim: int,
    base: float,
    original_max_position: int,
    truncate: bool = True,
) -> tuple[float, float]:
    """``(low, high)`` dim bounds of the YaRN ramp, clamped into ``[0, R - 1]``."""
    low = _yarn_correction_dim(beta_fast, rope_dim, base, original_max_position)
    high = _yarn_correction_dim(beta_slow, rope_dim, base, original_max_position)
    if truncate:
        low = math.floor(low)
        high = math.ceil(high)
    return max(low, 0), min(high, rope_dim - 1)


def _linear_ramp(
    low: float, high: float, n: int, device: torch.device | str | None
) -> torch.Tensor:
    """float32 ``clamp((j - low) / (high - low), 0, 1)`` for ``j in [0, n)``."""
    if low == high:
        high = high + 0.001  # a step instead of a division by zero
    j = torch.arange(n, dtype=torch.float32, device=device)
    return ((j - low) / (high - low)).clamp(0.0, 1.0)


def deepseek_yarn_inv_freq(
    rope_dim: int = 64,
    base: float = 10000.0,
    scaling_factor: float = 40.0,
    original_max_position: int = 4096,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    *,
    truncate: bool = True,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """DeepSeek YaRN inverse frequencies as a float32 ``[R/2]`` tensor.

    ``inv_freq[i] = interp[i] * r[i] + extrap[i] * (1 - r[i])`` with ``extrap = base ** (-2i/R)``,
    ``interp = extrap / scaling_factor`` (computed as ``1 / (scaling_factor * base ** (2i/R))``)
    and ``r`` the linear ramp over the correction range (0 below ``low``: high frequencies are
    kept; 1 above ``high``: low frequencies are interpolated). All in float32, the way DeepSeek,
    vLLM and Hugging Face compute it, so the tables agree bit for bit.

    Args:
        rope_dim: rotary head dim ``R`` (even).
        base: RoPE base (``rope_theta``).
        scaling_factor: YaRN context extension factor.
        original_max_position: pre-training context length.
        beta_fast: rotations bounding the extrapolated (high-frequency) dims.
        beta_slow: rotations bounding the interpolated (low-frequency) dims.
        truncate: floor/ceil the correction range to whole dims (the DeepSeek behaviour).
        device: where to build the tensor.
    """
    _check_rope_dim(rope_dim)
    if scaling_factor <= 0:
        raise FuseMLAValueError(
            f"scaling_factor: expected a positive float, got {scaling_factor!r}"
        )
    if original_max_position <= 0:
        raise FuseMLAValueError(
            f"original_max_position: expected a positive int, got {original_max_position!r}"
        )
    base = float(base)
    powers = base ** _dim_exponents(rope_dim, device)  # base ** (2i/R)
    extrapolated = 1.0 / powers
    interpolated = 1.0 / (float(scaling_factor) * powers)
    low, high = _yarn_correction_range(
        beta_fast, beta_slow, rope_dim, base, original_max_position, truncate
    )
    ramp = _linear_ramp(low, high, rope_dim // 2, device)
    keep = 1.0 - ramp  # weight of the extrapolated (unscaled) frequency
    return interpolated * (1.0 - keep) + extrapolated * keep


# --------------------------------------------------------------------------------------------
# cos/sin caches
# --------------------------------------------------------------------------------------------


def _cos_sin_table(
    inv_freq: torch.Tensor,
    max_position: int,
    attention_factor: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``cat(cos(p * f) * m, sin(p * f) * m)`` for ``p in [0, max_position)``, float32 math."""
    positions = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    angles = torch.outer(positions, inv_freq.to(torch.float32))
    cos = angles.cos()
    sin = angles.sin()
    if attention_factor != 1.0:
        cos = cos * attention_factor
        sin = sin * attention_factor
    return torch.cat((cos, sin), dim=-1).to(dtype)


def rope_cos_sin_cache(
    rope_dim: int,
    max_position: int,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Unscaled RoPE cache ``[max_position, R]`` = ``cat(cos, sin)`` (attention factor 1).

    Args:
        rope_dim: rotary head dim ``R`` (even).
        max_position: number of rows (positions ``0 .. max_position - 1``).
        base: RoPE base (``rope_theta``).
        dtype: dtype of the returned table (angles and cos/sin are computed in float32).
        device: where to build the table.
    """
    _check_rope_dim(rope_dim)
    _check_max_position(max_position)
    _check_float_dtype(dtype)
    inv_freq = rope_inv_freq(rope_dim, base, device=device)
    return _cos_sin_table(inv_freq, max_position, 1.0, dtype)


def deepseek_yarn_cos_sin_cache(
    rope_dim: int = 64,
    max_position: int = 163840,
    base: float = 10000.0,
    scaling_factor: float = 40.0,
    original_max_position: int = 4096,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    mscale: float = 1.0,
    mscale_all_dim: float = 1.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    *,
    attention_factor: float | None = None,
    truncate: bool = True,
) -> torch.Tensor:
    """DeepSeek YaRN RoPE cache ``[max_position, R]`` = ``cat(cos * m, sin * m)``.

    The defaults are DeepSeek-V3's (``max_position = 4096 * 40``). ``m`` is DeepSeek's attention
    factor ``yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(scaling_factor,
    mscale_all_dim)`` unless ``attention_factor`` overrides it. Angles are
    ``outer(positions, inv_freq)`` in float32 with ``inv_freq`` from
    :func:`deepseek_yarn_inv_freq`; the table is cast to ``dtype`` at the end.

    Note that DeepSeek also scales the softmax scale by ``yarn_get_mscale(scaling_factor,
    mscale_all_dim) ** 2``; that is not part of this table.
    """
    _check_rope_dim(rope_dim)
    _check_max_position(max_position)
    _check_float_dtype(dtype)
    inv_freq = deepseek_yarn_inv_freq(
        rope_dim,
        base,
        scaling_factor,
        original_max_position,
        beta_fast,
        beta_slow,
        truncate=truncate,
        device=device,
    )
    if attention_factor is None:
        attention_factor = yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(
            scaling_factor, mscale_all_dim
        )
    return _cos_sin_table(inv_freq, max_position, float(attention_factor), dtype)


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _rope_params(config: Any) -> dict[str, Any]:
    """The RoPE dict of a Hugging Face config: ``rope_parameters`` (v5) or ``rope_scaling`` (v4)."""
    for key in ("rope_parameters", "rope_scaling"):
        value = _get(config, key)
        if isinstance(value, Mapping) and value:
            return dict(value)
    return {}


def rope_cache_from_hf_config(
    config: Any,
    max_position: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Build the ``[max_position, R]`` RoPE cache of a Hugging Face DeepSeek-V2/V3 config.

    Reads ``qk_rope_head_dim`` (falling back to ``head_dim``) and the RoPE settings from
    ``config.rope_parameters`` (transformers 5: ``rope_type``, ``rope_theta``, ``factor``,
    ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``mscale``,
    ``mscale_all_dim``, optional ``attention_factor``/``truncate``) or from ``config.rope_scaling``
    plus ``config.rope_theta`` (transformers 4.x; ``type`` is accepted for ``rope_type``). A plain
    mapping with the same keys works too.

    ``rope_type`` ``"yarn"``/``"deepseek_yarn"`` gives :func:`deepseek_yarn_cos_sin_cache`; no
    scaling (missing dict or ``"default"``) gives :func:`rope_cos_sin_cache`. The attention factor
    follows Hugging Face: an explicit ``attention_factor``, else ``get_mscale(f, mscale) /
    get_mscale(f, mscale_all_dim)`` when both are set and non-zero, else ``get_mscale(f)``.

    Args:
        config: a ``DeepseekV3Config``-like object or mapping.
        max_position: rows of the table. Default: ``max_position_embeddings`` (for YaRN at least
            ``original_max_position_embeddings * factor``, the size vLLM uses).
        dtype: dtype of the returned table.
        device: where to build it.

    Raises:
        FuseMLAValueError: missing rotary dim or an unsupported ``rope_type``.
    """
    rope_dim = _get(config, "qk_rope_head_dim") or _get(config, "head_dim")
    if rope_dim is None:
        raise FuseMLAValueError(
            "config: expected a qk_rope_head_dim (or head_dim) attribute, got none in "
            f"{type(config).__name__}"
        )
    rope_dim = _check_rope_dim(int(rope_dim), "config.qk_rope_head_dim")
    params = _rope_params(config)
    base = params.get("rope_theta") or _get(config, "rope_theta") or 10000.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    config_max = _get(config, "max_position_embeddings")

    if rope_type == "default":
        if max_position is None:
            if config_max is None:
                raise FuseMLAValueError(
                    "max_position: expected an int, got None and config has no "
                    "max_position_embeddings"
                )
            max_position = int(config_max)
        return rope_cos_sin_cache(rope_dim, max_position, float(base), dtype=dtype, device=device)

    if rope_type not in ("yarn", "deepseek_yarn"):
        raise FuseMLAValueError(
            "config: expected rope_type 'yarn', 'deepseek_yarn' or 'default' (no scaling), "
            f"got rope_type={rope_type!r}"
        )
    original = params.get("original_max_position_embeddings")
    if original is None:
        original = _get(config, "original_max_position_embeddings") or config_max
    if original is None:
        raise FuseMLAValueError(
            "config: expected original_max_position_embeddings in the rope scaling dict, got none"
        )
    original = int(original)
    factor = params.get("factor")
    if factor is None:
        if config_max is None:
            raise FuseMLAValueError("config: expected a yarn 'factor', got none")
        factor = config_max / original
    factor = float(factor)
    mscale = params.get("mscale")
    mscale_all_dim = params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(
                factor, mscale_all_dim
            )
        else:
            attention_factor = yarn_get_mscale(factor)
    if max_position is None:
        max_position = max(int(config_max or 0), int(original * factor))
    truncate = params.get("truncate")
    return deepseek_yarn_cos_sin_cache(
        rope_dim=rope_dim,
        max_position=max_position,
        base=float(base),
        scaling_factor=factor,
        original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        dtype=dtype,
        device=device,
        attention_factor=float(attention_factor),
        truncate=True if truncate is None else bool(truncate),
    )


# --------------------------------------------------------------------------------------------
# Reference rotation
# --------------------------------------------------------------------------------------------


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    """Rotate the last dim of ``x`` by RoPE; a float32 reference for the kernels.

    Args:
        x: ``[..., R]`` tensor (any floating dtype).
        cos: ``[..., R/2]`` cosines, broadcastable against ``x[..., :R/2]`` (already scaled by
            the attention factor if the cache is).
        sin: ``[..., R/2]`` sines, same shape rules as ``cos``.
        is_neox: ``False`` for DeepSeek's interleaved pairs ``(x[2i], x[2i+1])``; ``True`` for
            NeoX pairs ``(x[i], x[i + R/2])``. Pair ``i`` rotates by the angle of ``cos[..., i]``.

    Returns:
        float32 tensor of the broadcast shape, in the same layout as ``x``:
        ``out_a = a * c - b * s`` and ``out_b = b * c + a * s`` for each pair ``(a, b)``.
    """
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise FuseMLAValueError(f"x: expected [..., R] with R even, got {describe(x)}")
    half = x.shape[-1] // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() < 1 or t.shape[-1] != half:
            raise FuseMLAValueError(
                f"{name}: expected [..., {half}] (half of x's last dim), got {describe(t)}"
            )
    xf = x.to(torch.float32)
    c = cos.to(torch.float32)
    s = sin.to(torch.float32)
    if is_neox:
        a = xf[..., :half]
        b = xf[..., half:]
    else:
        a = xf[..., 0::2]
        b = xf[..., 1::2]
    out_a = a * c - b * s
    out_b = b * c + a * s
    if is_neox:
        return torch.cat((out_a, out_b), dim=-1)
    return torch.stack((out_a, out_b), dim=-1).flatten(-2)
