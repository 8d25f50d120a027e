"""The shared Triton helpers, byte for byte against torch's casts."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fusemla.dtypes import FP8_FORMATS
from fusemla.ops.triton_helpers import cast_rne, divide_exact, inverse, round_to_fp8_grid

FP8 = list(FP8_FORMATS)


@triton.jit
def _round_kernel(p_x, p_y, n, CODE: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(p_x + o, mask=m, other=0.0)
    tl.store(p_y + o, round_to_fp8_grid(x, CODE), mask=m)


@triton.jit
def _bf16_kernel(p_x, p_y, n, FIX: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(
        p_y + o, cast_rne(tl.load(p_x + o, mask=m, other=0.0), p_y.dtype.element_ty, FIX), mask=m
    )


@triton.jit
def _divide_kernel(p_x, p_d, p_y, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(p_x + o, mask=m, other=0.0)
    d = tl.load(p_d + o, mask=m, other=1.0)
    tl.store(p_y + o, divide_exact(x, d, inverse(d, 1)), mask=m)


def _fp8_probe_values(dtype: torch.dtype) -> torch.Tensor:
    fmax = FP8_FORMATS[dtype].max
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[torch.isfinite(grid)]
    mids = (grid[:-1].sort().values + grid.sort().values[1:]) / 2  # exact ties
    g = torch.Generator().manual_seed(0)
    rand = torch.cat([torch.randn(1 << 16, generator=g) * s for s in (1e-3, 0.05, 1.0, 30.0, fmax)])
    special = torch.tensor(
        [
            0.0,
            -0.0,
            fmax,
            -fmax,
            fmax * 1.03,
            -fmax * 1.5,
            1e30,
            -1e30,
            float("inf"),
            float("-inf"),
            2.0**-12,
            -(2.0**-12),
            31.6,
        ]
    )
    return torch.cat(
        [
            grid,
            mids,
            torch.nextafter(mids, mids + 1),
            torch.nextafter(mids, mids - 1),
            rand,
            special,
        ]
    ).contiguous()


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_rounding_matches_torch_saturating_cast(device, dtype):
    fmax = FP8_FORMATS[dtype].max
    x = _fp8_probe_values(dtype).to(device)
    y = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](
        x, y, x.numel(), CODE=FP8_FORMATS[dtype].code, BLOCK=1024
    )
    want = x.clamp(-fmax, fmax).to(dtype)
    # the helper's output is exactly representable: casting it is exact and equals torch's cast
    assert torch.equal(y.to(dtype).view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(y.to(dtype).float(), y), "helper returned a value off the FP8 grid"


@pytest.mark.parametrize("fix", [True, False], ids=["rne", "backend-cast"])
def test_bf16_cast_rounds_to_nearest_even(device, fix):
    if not fix and device == "cpu":
        pytest.skip("the interpreter's own bf16 cast truncates; that is what FIX works around")
    g = torch.Generator().manual_seed(1)
    x = torch.cat(
        [
            torch.randn(1 << 16, generator=g) * 3,
            torch.tensor(
                [
                    1.0 + 2.0**-8,
                    1.0 + 3 * 2.0**-8,
                    -(1.0 + 2.0**-8),
                    3.4e38,
                    float("inf"),
                    0.0,
                    -0.0,
                ]
            ),
        ]
    ).to(device)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    _bf16_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), FIX=fix, BLOCK=1024)
    assert torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 3e38 / 1e-3, on purpose
def test_divide_exact_is_the_ieee_quotient(device):
    """``divide_exact`` (a reciprocal, a multiply and two fma) against IEEE fp32 division, bit for
    bit: random numerators over many magnitudes, divisors shaped like FP8 scales (absmax / 448,
    powers of two, the 1e-10 floor's quotient) and arbitrary ones, the overflowing quotient of a
    huge value by a tiny scale (an infinity, never a NaN), and zeros. A plain ``x * (1 / d)``
    differs from the quotient in about one case in a hundred; the count below proves the probe
    holds such cases."""
    g = torch.Generator().manual_seed(7)
    n = 1 << 18
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    d = torch.rand(n, generator=g) * torch.exp2(torch.randint(-12, 8, (n,), generator=g).float())
    d[: n // 4] = (x[: n // 4].abs() + 1e-3) / 448.0  # absmax-style scales
    d[n // 4 : n // 4 + 64] = 2.0 ** torch.arange(-32, 32).float()
    d = d.clamp_min(1e-10 / 448)
    x[:4] = torch.tensor([3e38, -3e38, 0.0, -0.0])
    d[:4] = torch.tensor([1e-3, 1e-3, 0.3, 0.3])
    x, d = x.to(device), d.to(device)
    y = torch.empty_like(x)
    _divide_kernel[(triton.cdiv(n, 1024),)](x, d, y, n, BLOCK=1024)
    want = x / d
    assert torch.equal(y.view(torch.int32), want.view(torch.int32))
    assert not torch.isnan(y).any()
    plain = x * (1.0 / d)
    assert int((plain != want).sum()) > 100  # the probe separates the quotient from a multiply
