"""Random prologue inputs shared by the tests, the benchmark and the demo, and a float64 model.

The inputs look like an engine's: ``q_nope``/``q_pe`` are slices of one q_b_proj output
``[N, H, P + R]``; ``kv_c``/``k_pe`` are slices of one kv_a output ``[N, L + R]``; the cache is
poisoned (NaN, or a NaN byte for FP8) so that an unwritten row or a stray write shows. Seeds come
from :func:`stable_seed`, the same in every process (never Python's salted ``hash``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fusemla.dtypes import FP8_FORMATS
from fusemla.testing.dims import DEEPSEEK_V3, SMALL_DIMS  # noqa: F401  (their old home)

#: a byte that is NaN in each FP8 format (poison for caches and FP8 outputs)
FP8_NAN_BYTE = {dtype: fmt.nan_byte for dtype, fmt in FP8_FORMATS.items()}


def stable_seed(*parts: Any) -> int:
    """A 31-bit seed from ``parts`` (their ``repr``), identical in every process and run."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


@dataclass
class PrologueInputs:
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    w_uk_t: torch.Tensor
    positions: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    kv_scale: float | torch.Tensor | None = None
    num_decode_tokens: int | None = None  # None: all tokens decode
    extra: dict = field(default_factory=dict)

    @property
    def D(self) -> int:
        return self.q_nope.shape[0] if self.num_decode_tokens is None else self.num_decode_tokens

    def args(self) -> tuple:
        return (
            self.q_nope,
            self.q_pe,
            self.kv_c,
            self.k_pe,
            self.w_uk_t,
            self.positions,
            self.cos_cache,
            self.sin_cache,
            self.kv_cache,
            self.slot_mapping,
        )

    def run(
        self, fn: Callable, *, kv_cache: torch.Tensor | None = None, w_uk_t: Any = None, **kw: Any
    ) -> Any:
        """``fn(*args, num_decode_tokens=..., kv_scale=..., **kw)`` (an ``mla_prologue`` or its
        reference), optionally on another cache or weight."""
        args = list(self.args())
        if kv_cache is not None:
            args[8] = kv_cache
        if w_uk_t is not None:
            args[4] = w_uk_t
        kw.setdefault("kv_scale", self.kv_scale)
        return fn(*args, num_decode_tokens=self.num_decode_tokens, **kw)


def poisoned_cache(
    num_blocks: int, block_size: int, width: int, dtype: torch.dtype, device: str | torch.device
) -> torch.Tensor:
    """A ``[num_blocks, block_size, width]`` cache filled with NaN (NaN bytes for FP8)."""
    return poisoned((num_blocks, block_size, width), dtype, device)


def poisoned(shape: tuple, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A tensor filled with NaN (NaN bytes for FP8)."""
    if dtype in FP8_NAN_BYTE:
        return torch.full(shape, FP8_NAN_BYTE[dtype], dtype=torch.uint8, device=device).view(dtype)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def make_inputs(
    B: int,
    H: int,
    P: int,
    R: int,
    L: int,
    *,
    num_decode_tokens: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    kv_dtype: torch.dtype | None = None,
    block_size: int = 16,
    num_blocks: int | None = None,
    max_position: int = 4096,
    rope_dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int64,
    kv_scale: float | torch.Tensor | str | None = "auto",
    pad_fraction: float = 0.0,
    outliers: bool = True,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
) -> PrologueInputs:
    """Fresh random prologue inputs for ``B`` tokens (the first ``num_decode_tokens`` decode).

    ``pad_fraction`` of the tokens get slot -1 (CUDA-graph padding); the others get distinct
    random slots. ``kv_scale="auto"`` picks a float scale for an FP8 cache and None otherwise;
    ``"tensor"`` gives the same scale as a 1-element fp32 tensor. With an FP8 cache and
    ``outliers``, one latent and one rope value of the first token are planted far beyond the
    FP8 range, so saturation is always exercised (not only when random data happens to reach it).
    """
    kv_dtype = kv_dtype or dtype
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    dev = torch.device(device)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * scale).to(dtype)

    q = randn(B, H, P + R)
    kv_a = randn(B, L + R)
    w_uk_t = randn(H, P, L, scale=P**-0.5)
    positions = torch.randint(0, max_position, (B,), generator=g).to(index_dtype)
    angles = torch.rand(max_position, R // 2, generator=g, dtype=torch.float64) * 6.3
    mscale = 1.0 + 0.1 * torch.rand((), generator=g, dtype=torch.float64)
    cos_cache = (angles.cos() * mscale).to(rope_dtype)
    sin_cache = (angles.sin() * mscale).to(rope_dtype)
    if num_blocks is None:
        num_blocks = max(2, (2 * B + block_size - 1) // block_size + 1)
    n_slots = num_blocks * block_size
    slots = torch.randperm(n_slots, generator=g)[:B]
    if pad_fraction > 0:
        pad = torch.rand(B, generator=g) < pad_fraction
        slots = torch.where(pad, torch.full_like(slots, -1), slots)
    scale_value = None
    if kv_dtype in FP8_NAN_BYTE:
        # max |x| of a randn row is about 4-5; choose a scale that saturates the tail
        scale_value = (
            4.0 / FP8_FORMATS[kv_dtype].max * (0.8 + 0.2 * float(torch.rand((), generator=g)))
        )
        if outliers and B > 0:
            big = 8.0 * FP8_FORMATS[kv_dtype].max * scale_value
            kv_a[0, 0] = big
            kv_a[0, L + 1] = -big
    if kv_scale in ("auto", "tensor"):
        kv_scale = (
            None
            if scale_value is None
            else torch.tensor([scale_value], dtype=torch.float32, device=dev)
            if kv_scale == "tensor"
            else scale_value
        )
    kv_cache = poisoned_cache(num_blocks, block_size, L + R, kv_dtype, dev)
    q, kv_a = q.to(dev), kv_a.to(dev)
    return PrologueInputs(
        q[..., :P],
        q[..., P:],
        kv_a[:, :L],
        kv_a[:, L:],
        w_uk_t.to(dev),
        positions.to(dev),
        cos_cache.to(dev),
        sin_cache.to(dev),
        kv_cache,
        slots.to(index_dtype).to(dev),
        kv_scale,
        num_decode_tokens,
    )


def rope_f64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    x = x.double()
    if is_neox:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


def prologue_model_f64(
    inp: PrologueInputs,
    is_neox: bool,
    rope_applied: bool = False,
    w_uk_t: torch.Tensor | None = None,
) -> dict:
    """Float64 model of the prologue before any rounding, on the CPU.

    Returns ``q [D, H, L+R]``, ``q_pe [N, H, R]`` (rotated), ``k_pe [N, R]`` (rotated) and
    ``rows [N, L+R]`` (the cache rows). ``w_uk_t`` defaults to ``inp.w_uk_t``.
    """
    D = inp.D
    pos = inp.positions.long().clamp(0, inp.cos_cache.shape[0] - 1)
    cos = inp.cos_cache.double()[pos]
    sin = inp.sin_cache.double()[pos]
    k_pe = inp.k_pe.reshape(inp.k_pe.shape[0], inp.q_pe.shape[-1])
    if rope_applied:
        q_pe, k_rot = inp.q_pe.double(), k_pe.double()
    else:
        q_pe = rope_f64(inp.q_pe, cos[:, None], sin[:, None], is_neox)
        k_rot = rope_f64(k_pe, cos, sin, is_neox)
    w = inp.w_uk_t if w_uk_t is None else w_uk_t
    ql = torch.einsum("bhp,hpl->bhl", inp.q_nope[:D].double(), w.double())
    return dict(
        q=torch.cat([ql, q_pe[:D]], dim=-1).cpu(),
        q_pe=q_pe.cpu(),
        k_pe=k_rot.cpu(),
        rows=torch.cat([inp.kv_c.double(), k_rot], dim=-1).cpu(),
    )
