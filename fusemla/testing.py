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


# --------------------------------------------------------------------------------------------
# comparison with the reference (free of Triton: usable on any tensors)
# --------------------------------------------------------------------------------------------


@dataclass
class Comparison:
    """Result of :func:`compare`: numbers worth printing, and what disagreed (empty = agreed)."""

    metrics: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# relative L2 error vs the float64 model: one rounding of the output + bf16/fp16 operands
REL_TOL = {"bfloat16": 8e-3, "float16": 1e-3}
# an FP8 e4m3 value is within 2^-4 (half an ulp at 3 mantissa bits) of what it rounds
FP8_REL_TOL = 2.0 ** -4


def rel_err(x, ref) -> float:
    x, ref = x.double().cpu(), ref.double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def scale_value(scale) -> float:
    import torch

    if isinstance(scale, torch.Tensor):
        return float(scale.float().cpu().reshape(-1)[0])
    return 1.0 if scale is None else float(scale)


def _rope_magnitude(x, cos, sin, is_neox: bool):
    """Per output element, an upper bound of sum |term| of RoPE's two products (fp32)."""
    import torch

    x = x.abs().float()
    half = x.shape[-1] // 2
    w = cos.abs().float() + sin.abs().float()
    if is_neox:
        m = (x[..., :half] + x[..., half:]) * w
        return torch.cat([m, m], dim=-1)
    m = (x[..., 0::2] + x[..., 1::2]) * w
    return torch.stack([m, m], dim=-1).flatten(-2)


def fp8_ordinal(codes):
    """FP8 bytes -> integers in value order (+0 and -0 both 0; adjacent values differ by 1).

    Valid for both e4m3 formats: sign-magnitude with the sign in bit 7.
    """
    c = _bits(codes).int()
    mag = c & 0x7F
    return mag.where(c < 0x80, -mag)


def _bits(x):
    """The raw bits of a tensor, as integers of the same width."""
    import torch

    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _within_ulp(got, want, dtype, slack):
    """Elementwise: |got - want| <= 1 ulp of the larger, plus ``slack`` (False for NaN)."""
    import torch

    got, want = got.float(), want.float()
    fi = torch.finfo(dtype)
    bound = fi.eps * torch.maximum(got.abs(), want.abs()) + fi.tiny + slack
    return (got - want).abs() <= bound


def compare(inp, q, q_ref, cache, cache_ref, cache_before, *, is_neox: bool = False
            ) -> Comparison:
    """Check the fused result (``q``, ``cache``) against the reference (``q_ref``, ``cache_ref``).

    ``inp`` is the :class:`fusemla.testing.PrologueInputs` both ran on (before: ``cache_before``).
    Agreement means:

    - q: no NaN, and every value within 1 ulp of the reference's (plus the fp32 accumulation
      error bound ``2 * K * 2^-24 * sum|products|``, which only matters under cancellation);
      relative L2 error vs the float64 model below ``REL_TOL``.
    - cache rows of the valid slots: bf16/fp16 within 1 ulp of the reference's (the latent part
      bit-equal); FP8 codes equal or one code apart; dequantized rows close to the float64 model.
    - every other cache row byte-identical to ``cache_before``.
    """
    import torch

    res = Comparison()
    m, problems = res.metrics, res.problems
    dtype = inp.q_nope.dtype
    B, H, P = inp.q_nope.shape
    L = inp.kv_c.shape[1]
    R = inp.q_pe.shape[-1]
    if tuple(q.shape) != (B, H, L + R) or q.dtype != dtype:
        problems.append(f"q has shape {tuple(q.shape)} {q.dtype}, expected {(B, H, L + R)} {dtype}")
        return res
    q64, rows64 = prologue_model_f64(inp, is_neox)

    # ---- q ----------------------------------------------------------------------------------
    qc, qr = q.detach().float().cpu(), q_ref.detach().float().cpu()
    n_nan = int(torch.isnan(qc).sum())
    if n_nan:
        problems.append(f"q: {n_nan} of {qc.numel()} values are NaN (not written?)")
    diff = (qc - qr).abs().nan_to_num(nan=float("inf"))
    m["q_max_abs_diff"] = float(diff.max()) if diff.numel() else 0.0
    # fp32 accumulation error bound, from the magnitudes of the summed products
    acc = 2.0 ** -24
    s_nope = torch.bmm(inp.q_nope.abs().float().transpose(0, 1),
                       inp.w_uk_t.abs().float()).transpose(0, 1).cpu()
    pos = inp.positions.long().clamp(0, inp.cos_cache.shape[0] - 1)
    cos, sin = inp.cos_cache[pos].float(), inp.sin_cache[pos].float()
    s_rope = _rope_magnitude(inp.q_pe, cos[:, None], sin[:, None], is_neox).cpu()
    slack = torch.cat([2 * P * acc * s_nope, 4 * acc * s_rope], dim=-1)
    bad = ~_within_ulp(qc, qr, dtype, slack)
    n_bad = int(bad.sum()) - n_nan
    if n_bad > 0:
        problems.append(f"q: {n_bad} of {qc.numel()} values differ from the reference by more "
                        f"than 1 ulp (max |fused - ref| = {m['q_max_abs_diff']:.3g})")
    tol = REL_TOL.get(str(dtype).replace("torch.", ""), 8e-3)
    for part, sl in (("nope", slice(0, L)), ("rope", slice(L, L + R))):
        m[f"q_rel_{part}"] = rel_err(qc[..., sl], q64[..., sl])
        m[f"q_rel_{part}_ref"] = rel_err(qr[..., sl], q64[..., sl])
        if not m[f"q_rel_{part}"] < tol:
            problems.append(f"q[..., {part}]: relative L2 error vs float64 "
                            f"{m[f'q_rel_{part}']:.3g} >= {tol:g}")

    # ---- cache ------------------------------------------------------------------------------
    width = cache.shape[-1]
    flat = cache.reshape(-1, width).cpu()
    flat_ref = cache_ref.reshape(-1, width).cpu()
    flat_before = cache_before.reshape(-1, width).cpu()
    n_rows = flat.shape[0]
    slots_all = inp.slot_mapping.long().cpu()
    valid = (slots_all >= 0) & (slots_all < n_rows)
    slots = slots_all[valid]
    written = torch.zeros(n_rows, dtype=torch.bool)
    written[slots] = True
    m["rows_valid"] = int(slots.numel())
    m["rows_padding"] = int((~valid).sum())
    stray = (flat[~written].view(torch.uint8) != flat_before[~written].view(torch.uint8))
    n_stray = int(stray.any(dim=-1).sum())
    if n_stray:
        problems.append(f"cache: {n_stray} rows outside the valid slots were modified")
    fp8 = cache.element_size() == 1
    m["cache_kind"] = "fp8" if fp8 else "float"
    if slots.numel() == 0:
        m["rows_agree"] = 0
        return res
    got, want = flat[slots], flat_ref[slots]
    ref_rows = rows64[valid]
    if fp8:
        scale = scale_value(inp.kv_scale)
        if torch.isnan(got.float()).any():
            problems.append("cache: NaN codes in written rows (not written?)")
        step = (fp8_ordinal(got) - fp8_ordinal(want)).abs()
        row_ok = (step <= 1).all(dim=-1) & ~torch.isnan(got.float()).any(dim=-1)
        m["fp8_codes_equal"] = int((step == 0).sum())
        m["fp8_codes_off_by_one"] = int((step == 1).sum())
        m["fp8_codes_total"] = int(step.numel())
        fmax = torch.finfo(cache.dtype).max * scale
        m["cache_rel"] = rel_err(got.float() * scale, ref_rows.clamp(-fmax, fmax))
        cache_tol = FP8_REL_TOL
    else:
        k_pe = inp.k_pe.reshape(B, -1)
        s_k = _rope_magnitude(k_pe, cos, sin, is_neox).cpu()[valid]
        slack = torch.cat([torch.zeros(s_k.shape[0], L), 4 * acc * s_k], dim=-1)
        ok = _within_ulp(got, want, cache.dtype, slack)
        ok[:, :L] = _bits(got[:, :L]) == _bits(want[:, :L])  # the latent part is a plain copy
        row_ok = ok.all(dim=-1)
        m["cache_rel"] = rel_err(got, ref_rows)
        cache_tol = REL_TOL.get(str(cache.dtype).replace("torch.", ""), 8e-3)
    m["rows_agree"] = int(row_ok.sum())
    n_bad_rows = int((~row_ok).sum())
    if n_bad_rows:
        what = "more than 1 FP8 code" if fp8 else "more than 1 ulp (or latent part not exact)"
        first = int(slots[~row_ok][0])
        problems.append(f"cache: {n_bad_rows} of {slots.numel()} written rows differ from the "
                        f"reference by {what} (first: slot {first})")
    if not m["cache_rel"] < cache_tol:
        problems.append(f"cache: relative L2 error of the written rows vs float64 "
                        f"{m['cache_rel']:.3g} >= {cache_tol:g}")
    return res



def check_against_reference(inp: PrologueInputs, is_neox: bool, q: torch.Tensor,
                            cache_before: torch.Tensor) -> Comparison:
    """Run the unfused reference on ``inp`` (from ``cache_before``) and :func:`compare` to it.

    ``q`` and ``inp.kv_cache`` are the fused kernel's results on ``inp``.
    """
    from fusemla.reference import mla_decode_prologue_ref

    cache_ref = cache_before.clone()
    args = list(inp.args())
    args[8] = cache_ref
    q_ref = mla_decode_prologue_ref(*args, is_neox=is_neox, kv_scale=inp.kv_scale)
    return compare(inp, q, q_ref, inp.kv_cache, cache_ref, cache_before, is_neox=is_neox)
