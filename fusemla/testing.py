"""Random inputs for the decode prologue, shared by the tests, the benchmark and the demo.

The inputs look like an engine's: ``q_nope``/``q_pe`` are slices of one q_b_proj output
``[B, H, P + R]``; ``kv_c``/``k_pe`` are slices of one kv_a output ``[B, L + R]``; the cache is
poisoned (NaN, or a NaN byte for FP8) so that an unwritten row or a stray write shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

#: DeepSeek-V3 dims: heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank
DEEPSEEK_V3 = dict(H=128, P=128, R=64, L=512)

#: a byte that is NaN in each FP8 cache format (poison for caches)
FP8_NAN_BYTE = {torch.float8_e4m3fn: 0x7F, torch.float8_e4m3fnuz: 0x80}


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
    kv_scale: Union[float, torch.Tensor, None] = None
    extra: dict = field(default_factory=dict)

    def args(self) -> tuple:
        return (self.q_nope, self.q_pe, self.kv_c, self.k_pe, self.w_uk_t, self.positions,
                self.cos_cache, self.sin_cache, self.kv_cache, self.slot_mapping)


def poisoned_cache(num_blocks: int, block_size: int, width: int, dtype: torch.dtype,
                   device: Union[str, torch.device]) -> torch.Tensor:
    """A ``[num_blocks, block_size, width]`` cache filled with NaN (NaN bytes for FP8)."""
    if dtype in FP8_NAN_BYTE:
        raw = torch.full((num_blocks, block_size, width), FP8_NAN_BYTE[dtype], dtype=torch.uint8,
                         device=device)
        return raw.view(dtype)
    return torch.full((num_blocks, block_size, width), float("nan"), dtype=dtype, device=device)


def make_inputs(
    B: int,
    H: int,
    P: int,
    R: int,
    L: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    kv_dtype: Optional[torch.dtype] = None,
    block_size: int = 16,
    num_blocks: Optional[int] = None,
    max_position: int = 4096,
    rope_dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int64,
    kv_scale: Union[float, torch.Tensor, str, None] = "auto",
    pad_fraction: float = 0.0,
    device: Union[str, torch.device] = "cpu",
    generator: Optional[torch.Generator] = None,
) -> PrologueInputs:
    """Fresh random prologue inputs.

    ``pad_fraction`` of the tokens get slot -1 (CUDA-graph padding); the others get distinct
    random slots. ``kv_scale="auto"`` picks a float scale for an FP8 cache (so that a few values
    saturate) and None otherwise; ``"tensor"`` gives the same scale as a 1-element fp32 tensor.
    """
    kv_dtype = kv_dtype or dtype
    g = generator
    dev = torch.device(device)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float32) * scale).to(dtype).to(dev)

    q = randn(B, H, P + R)
    kv_a = randn(B, L + R)
    w_uk_t = randn(H, P, L, scale=P ** -0.5)
    positions = torch.randint(0, max_position, (B,), generator=g).to(index_dtype).to(dev)
    angles = torch.rand(max_position, R // 2, generator=g, dtype=torch.float64) * 6.3
    mscale = 1.0 + 0.1 * torch.rand((), generator=g, dtype=torch.float64)
    cos_cache = (angles.cos() * mscale).to(rope_dtype).to(dev)
    sin_cache = (angles.sin() * mscale).to(rope_dtype).to(dev)
    if num_blocks is None:
        num_blocks = max(2, (2 * B + block_size - 1) // block_size + 1)
    kv_cache = poisoned_cache(num_blocks, block_size, L + R, kv_dtype, dev)
    n_slots = num_blocks * block_size
    slots = torch.randperm(n_slots, generator=g)[:B]
    if pad_fraction > 0:
        pad = torch.rand(B, generator=g) < pad_fraction
        slots = torch.where(pad, torch.full_like(slots, -1), slots)
    slot_mapping = slots.to(index_dtype).to(dev)
    if kv_scale in ("auto", "tensor"):
        if kv_dtype in FP8_NAN_BYTE:
            # max |x| of a randn row is about 4-5; choose a scale that saturates the tail
            value = 4.0 / torch.finfo(kv_dtype).max * (0.8 + 0.2 * float(torch.rand((), generator=g)))
            kv_scale = (torch.tensor([value], dtype=torch.float32, device=dev)
                        if kv_scale == "tensor" else value)
        else:
            kv_scale = None
    return PrologueInputs(q[..., :P], q[..., P:], kv_a[:, :L], kv_a[:, L:], w_uk_t, positions,
                          cos_cache, sin_cache, kv_cache, slot_mapping, kv_scale)


def prologue_model_f64(inp: PrologueInputs, is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 model of the prologue: (q [B, H, L+R], cache rows [B, L+R]) before any rounding."""
    pos = inp.positions.long().clamp(0, inp.cos_cache.shape[0] - 1)
    cos = inp.cos_cache.double()[pos]
    sin = inp.sin_cache.double()[pos]

    def rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        x = x.double()
        half = x.shape[-1] // 2
        if is_neox:
            a, b = x[..., :half], x[..., half:]
            return torch.cat([a * c - b * s, b * c + a * s], dim=-1)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)

    # computed where the inputs live (float64 on a GPU is fast enough), returned on the CPU
    ql = torch.einsum("bhp,hpl->bhl", inp.q_nope.double(), inp.w_uk_t.double())
    q = torch.cat([ql, rope(inp.q_pe, cos[:, None], sin[:, None])], dim=-1)
    k_pe = inp.k_pe.reshape(inp.k_pe.shape[0], -1)
    rows = torch.cat([inp.kv_c.double(), rope(k_pe, cos, sin)], dim=-1)
    return q.cpu(), rows.cpu()


def compare_with_reference(inp: PrologueInputs, is_neox: bool, q: torch.Tensor,
                           cache_after: torch.Tensor, cache_before: torch.Tensor) -> list[str]:
    """Problems (empty if none) of a prologue result against the reference and the f64 model.

    ``q`` and ``cache_after`` are the fused kernel's results on ``inp``; ``cache_before`` is the
    poisoned cache it started from. Checks: q within one output ulp of the unfused reference and
    within the dtype's error of the float64 model; written rows equal to the reference's (FP8:
    bytes within one code, as FMA may move the fp32 value by an ulp); all other bytes unchanged.
    """
    from fusemla.reference import mla_decode_prologue_ref

    problems = []
    dtype = inp.q_nope.dtype
    ulp = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    tol = {torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    cache_ref = cache_before.clone()
    args = list(inp.args())
    args[8] = cache_ref
    q_ref = mla_decode_prologue_ref(*args, is_neox=is_neox, kv_scale=inp.kv_scale)
    q64, rows64 = prologue_model_f64(inp, is_neox)
    qc = q.float().cpu()
    if torch.isnan(qc).any():
        problems.append(f"q: {int(torch.isnan(qc).sum())} elements not written (NaN)")
    rel = float((q.double().cpu() - q64).norm() / q64.norm().clamp_min(1e-30))
    if not rel < tol:
        problems.append(f"q: relative error vs float64 model {rel:.2e} >= {tol:.0e}")
    d = (qc - q_ref.float().cpu()).abs()
    bound = q_ref.float().cpu().abs() * ulp + 1e-3
    if not bool((d <= bound).all()):
        problems.append(f"q: {int((d > bound).sum())} elements differ from the reference by "
                        f"more than one ulp (max |diff| {float(d.max()):.3g})")
    width = cache_after.shape[-1]
    flat = cache_after.reshape(-1, width).view(torch.uint8).cpu()
    flat_ref = cache_ref.reshape(-1, width).view(torch.uint8).cpu()
    is_fp8 = cache_after.element_size() == 1
    if is_fp8:
        diff = (flat.int() - flat_ref.int()).abs()
        bad = int((diff > 1).sum())
    else:
        got = flat.view(cache_after.dtype).float()
        want = flat_ref.view(cache_after.dtype).float()
        both_nan = torch.isnan(got) & torch.isnan(want)
        close = (got - want).abs() <= want.abs() * ulp
        bad = int((~(close | both_nan)).sum())
    if bad:
        problems.append(f"kv_cache: {bad} elements differ from the reference's cache")
    del rows64
    return problems
