"""The dtypes fusemla accepts, and the FP8 formats table (defined once, used everywhere).

Kernels receive one small integer per FP8 output (:attr:`FP8Format.code`: 0 = not FP8,
1 = ``float8_e4m3fn``, 2 = ``float8_e4m3fnuz``) and derive every constant of the format from
it (:func:`fusemla.ops.triton_helpers.round_to_fp8_grid`); host code reads the same facts here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: activations (q, kv_c, k_pe) and the query output
ACT_DTYPES = (torch.bfloat16, torch.float16)
#: FP8 storage formats (KV cache, weights, query output)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
#: KV cache element types
CACHE_DTYPES = ACT_DTYPES + FP8_DTYPES
#: positions, slots, block tables
INDEX_DTYPES = (torch.int32, torch.int64)
#: RoPE cos/sin caches
ROPE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FP8Format:
    """One e4m3 flavour: the code kernels receive and the facts derived from it."""

    code: int  #: 1 = e4m3fn (OCP: NVIDIA, gfx950), 2 = e4m3fnuz (MI300: gfx940/941/942)
    max: float  #: largest finite value: 448 / 240
    min_exp: int  #: exponent of the smallest normal: -6 / -7
    nan_byte: int  #: a byte that decodes to NaN (used to poison caches in tests)
    has_neg_zero: bool  #: e4m3fnuz has no -0 (its byte 0x80 is NaN)


FP8_FORMATS: dict[torch.dtype, FP8Format] = {
    torch.float8_e4m3fn: FP8Format(code=1, max=448.0, min_exp=-6, nan_byte=0x7F, has_neg_zero=True),
    torch.float8_e4m3fnuz: FP8Format(
        code=2, max=240.0, min_exp=-7, nan_byte=0x80, has_neg_zero=False
    ),
}


def fp8_code(dtype: torch.dtype) -> int:
    """The kernels' format code of ``dtype``: 0 when it is not an FP8 dtype."""
    fmt = FP8_FORMATS.get(dtype)
    return 0 if fmt is None else fmt.code


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3fn, 240 for e4m3fnuz)."""
    return FP8_FORMATS[dtype].max
