"""The unfused MLA prologue in plain PyTorch: what engines run today, and the CPU fallback.

Four steps, as an engine runs them: the absorbed BMM on the decode tokens (``torch.bmm`` in the
activations' dtype, fp32 accumulation), RoPE on ``q_pe`` and ``k_pe`` in fp32, the concat, and
the paged cache write of every token. Same signature and semantics as
:func:`fusemla.mla_prologue` (decode-first batches, prefill outputs, skipped slots, clamped
positions, ``rope_applied``). No step syncs the device, so it can be captured in a CUDA graph and
compiled with ``torch.compile``. It imports no kernel.
"""

from __future__ import annotations

import inspect

import torch

from fusemla.contracts.prologue import (
    PrologueArgs,
    PrologueOutput,
    PrologueSpec,
    prepare,
    prepare_step,
)
from fusemla.dtypes import FP8_DTYPES, fp8_max
from fusemla.rope import apply_rope


def quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype):
    """``saturate(x / scale)`` cast to ``dtype``, rounded to nearest even.

    The division is an IEEE fp32 division by the fp32 scale (a float scale is rounded to fp32
    first, as the kernel receives it): tensor-by-tensor, because torch's CUDA division by a
    Python scalar multiplies by its reciprocal, which can differ in the last bit.
    """
    m = fp8_max(dtype)
    if not isinstance(scale, torch.Tensor):
        scale = torch.full((), scale, dtype=torch.float32, device=x.device)
    return (x.float() / scale.float()).clamp(-m, m).to(dtype)


def quantize_activations_fp8(q_nope: torch.Tensor, dtype: torch.dtype):
    """The FP8 activations of ``act_quant="fp8"``: one scale per (token, head) row of
    ``q_nope [..., P]``, ``scale = amax / fp8_max`` (1.0 for an all-zero row), codes
    ``saturate(q_nope * (1 / scale))`` rounded to nearest even (one IEEE division per row, a
    multiply per element, as the kernel). Returns ``(codes, scale [..., 1])``, codes in
    ``dtype``, scale fp32."""
    a = q_nope.float()
    amax = a.abs().amax(dim=-1, keepdim=True)
    m = fp8_max(dtype)
    fmax = torch.full((), m, dtype=torch.float32, device=a.device)
    scale = amax / fmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    inv = torch.ones_like(scale) / scale
    return (a * inv).clamp(-m, m).to(dtype), scale


def absorbed_bmm(args: PrologueArgs, fp32: bool) -> torch.Tensor:
    """``q_nope @ W_UK_T[h]`` per head, ``[B, H, L]``, quantizing exactly as the kernel does.

    Plain weights: ``torch.bmm`` in the activations' dtype (what engines run), or in fp32 when
    ``fp32`` (the result is rounded again later, e.g. to FP8). FP8 weights: ``data * scale``
    (a per-tensor, per-head or per-column-block scale) with fp32 products and the activations
    as they are, or with ``act_quant="fp8"`` the FP8
    activations of :func:`quantize_activations_fp8` times their scale. MXFP4: the dequantized
    weight. Returns ``[D, H, L]`` (decode tokens only), fp32 unless it is the plain
    activations'-dtype product.
    """
    qn = args.q_nope[: args.D].transpose(0, 1)  # [H, D, P]
    w = args.w_uk_t
    if args.weight_format == "plain":
        out = torch.bmm(qn.float(), w.float()) if fp32 else torch.bmm(qn, w)
        return out.transpose(0, 1)
    if args.weight_format == "mxfp4":
        return torch.bmm(qn.float(), w.dequantize(torch.float32)).transpose(0, 1)
    if args.act_quant == "fp8":
        codes, a_scale = quantize_activations_fp8(qn, w.data.dtype)
        out = torch.bmm(codes.float(), w.data.float()) * a_scale  # [H, D, L]
    else:
        out = torch.bmm(qn.float(), w.data.float())  # [H, D, L]
    if w.block is not None:  # block rows span P: one scale per column block, per head
        w_scale = w.scale.float().repeat_interleave(w.block[1], dim=2)[:, :, : w.N]  # [H, 1, L]
    else:
        w_scale = w.scale.float().reshape(-1, 1, 1)  # [1] or [H] -> broadcast over heads
    return (out * w_scale).transpose(0, 1)


def write_cache_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache[s // block_size, s % block_size] = rows[t]`` for each valid slot ``s = slots[t]``
    (0 <= s < num_blocks * block_size), without a sync, for any cache strides.

    Boolean indexing would sync (nonzero). Instead every skipped token is redirected to the
    first valid token's slot with that token's row, so the duplicate index writes identical
    bytes; when no token is valid, the skipped ones rewrite slot 0 with its own current bytes.
    """
    if cache.element_size() == 1:  # FP8: move bytes (few ops are implemented for float8 dtypes)
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    bs = cache.shape[1]
    n = cache.shape[0] * bs
    slots = slots.long()
    valid = (slots >= 0) & (slots < n)
    # first valid token, or 0 when none is valid (index_select, not t[0-d tensor], which syncs)
    first = torch.argmax(valid.to(torch.int32)).view(1)
    any_valid = valid.index_select(0, first)
    target = torch.where(any_valid, slots.index_select(0, first).clamp(0, n - 1), 0)
    fill = torch.where(
        any_valid[:, None], rows.index_select(0, first), cache[target // bs, target % bs]
    )
    idx = torch.where(valid, slots, target[0])
    vals = torch.where(valid[:, None], rows, fill)
    cache.index_put_((idx // bs, idx % bs), vals)


def prologue_into(args: PrologueArgs) -> None:
    """Run the unfused prologue on prepared arguments, writing the outputs and the cache."""
    if args.N == 0:
        return
    D, L = args.D, args.L
    dtype = args.q_nope.dtype
    q = args.q
    q_fp8 = q.dtype in FP8_DTYPES
    # 1. absorbed BMM (decode tokens): [H, D, P] @ [H, P, L] -> [D, H, L]
    ql_nope = absorbed_bmm(args, fp32=q_fp8) if D > 0 else None
    # 2. RoPE (positions clamped like the kernel's), unless the caller rotated already
    if args.apply_rope:
        pos = args.positions.long().clamp(0, args.cos_cache.shape[0] - 1)
        cos = args.cos_cache[pos].float()
        sin = args.sin_cache[pos].float()
        q_pe = apply_rope(args.q_pe, cos[:, None, :], sin[:, None, :], args.is_neox)
        k_pe = apply_rope(args.k_pe, cos, sin, args.is_neox)
    else:
        q_pe, k_pe = args.q_pe.float(), args.k_pe.float()
    # 3. concat into the 576-wide decode query (FP8: one scale for both halves)
    if D > 0:
        if q_fp8:
            q.copy_(
                quantize_fp8(torch.cat([ql_nope.float(), q_pe[:D]], dim=-1), args.q_scale, q.dtype)
            )
        else:
            q[..., :L] = ql_nope
            q[..., L:] = q_pe[:D].to(dtype)
    #    prefill tokens: their rotated q_pe and k_pe
    args.q_pe_out.copy_(q_pe[D:].to(dtype))
    args.k_pe_out.copy_(k_pe[D:].to(dtype))
    # 4. paged KV-cache write, every token
    cache = args.kv_cache
    if cache.dtype in FP8_DTYPES:
        rows = quantize_fp8(
            torch.cat([args.kv_c.float(), k_pe], dim=-1), args.kv_scale, cache.dtype
        )
    else:
        rows = torch.cat([args.kv_c.to(cache.dtype), k_pe.to(cache.dtype)], dim=-1)
    write_cache_rows(cache, args.slot_mapping, rows)


def mla_prologue_ref(*args, **kwargs) -> PrologueOutput:
    """Unfused reference of :func:`fusemla.mla_prologue`: the same arguments (checked by the
    same :func:`~fusemla.contracts.prologue.prepare`) and the same result."""
    a = prepare(*args, **kwargs)
    prologue_into(a)
    return a.outputs


def mla_prologue_step_ref(spec: PrologueSpec, *args, **kwargs) -> PrologueOutput:
    """Unfused reference of :func:`fusemla.mla_prologue_step` (same arguments and result)."""
    a = prepare_step(spec, *args, **kwargs)
    prologue_into(a)
    return a.outputs


def mla_decode_prologue_ref(*args, **kwargs) -> torch.Tensor:
    """:func:`mla_prologue_ref` for an all-decode batch (``num_decode_tokens`` is not taken);
    returns ``q [N, H, L + R]``."""
    if "num_decode_tokens" in kwargs:
        raise TypeError(
            "mla_decode_prologue_ref() got an unexpected keyword argument 'num_decode_tokens'"
        )
    return mla_prologue_ref(*args, **kwargs).q


mla_prologue_ref.__signature__ = inspect.signature(prepare).replace(
    return_annotation=PrologueOutput
)
mla_prologue_step_ref.__signature__ = inspect.signature(prepare_step).replace(
    return_annotation=PrologueOutput
)
