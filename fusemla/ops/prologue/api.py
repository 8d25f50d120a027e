"""Public entry points of the fused prologue.

:func:`prologue_spec` checks a layer's fixed arguments once (weights, RoPE tables, query
format) and :func:`mla_prologue_step` runs one step on it: what an engine calls. :func:`mla_prologue`
takes everything in one call (built on the two) and :func:`mla_decode_prologue` is its
all-decode alias."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fusemla.contracts.prologue import (
    PrologueArgs,
    PrologueOutput,
    PrologueSpec,
    Scale,
    build_spec,
    prepare,
    prepare_step,
)
from fusemla.ops.prologue.launch import run

if TYPE_CHECKING:  # pragma: no cover
    from fusemla.quant import QuantizedWeight


def mla_prologue(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk_t: torch.Tensor | QuantizedWeight,
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
) -> PrologueOutput:
    """Fused MLA prologue for a decode-first batch, in one kernel launch.

    The batch has ``N`` tokens; the first ``D = num_decode_tokens`` (None: all) are decode
    tokens, the rest prefill tokens (vLLM's order). Shapes (H heads, P = qk_nope_head_dim,
    R = qk_rope_head_dim, L = kv_lora_rank):

    - ``q_nope [N, H, P]``, ``q_pe [N, H, R]``: bf16 or fp16; any strides, last dim contiguous
      (slices of the q_b_proj output ``[N, H, P + R]`` work as they are).
    - ``kv_c [N, L]``: the normalized latent; ``k_pe [N, R]`` or ``[N, 1, R]``.
    - ``w_uk_t [H, P, L]``: the absorbed key up-projection, in the activations' dtype, or a
      :class:`fusemla.quant.QuantizedWeight` (FP8 per-tensor/per-head, or MXFP4). FP8 weights
      are upcast to the activations' dtype in registers.
    - ``positions [N]`` (int32/int64); ``cos_cache``, ``sin_cache [max_position, R/2]``
      (fp32/bf16/fp16; :func:`fusemla.rope.split_cos_sin_cache` splits an engine's cache).
    - ``kv_cache [num_blocks, block_size, L + R]``: bf16/fp16, or float8_e4m3fn/e4m3fnuz with
      ``kv_scale`` (a positive float, rounded to fp32, or a 1-element fp32 tensor read on the
      device, so a CUDA graph replays with its current value). Row ``slot`` is
      ``kv_cache[slot // block_size, slot % block_size]``.
    - ``slot_mapping [N]`` (int32/int64): a negative slot (or one past the cache) writes nothing.
    - ``is_neox``: False = interleaved pairs (2i, 2i+1), DeepSeek's; True = pairs (i, i + R/2).
    - ``rope_applied``: True when the caller already rotated ``q_pe`` and ``k_pe``: they are
      then used as given (never rotated twice).
    - ``q_out_dtype``: None (the activations' dtype) or an FP8 dtype, with ``q_scale``: both
      halves of the decode query are stored as ``saturate(q / q_scale)``.
    - ``act_quant``: None, or ``"fp8"`` with FP8 weights: the decode tokens' ``q_nope`` is
      quantized in the kernel to the weight's FP8 format, one scale per (token, head)
      (``amax / fp8_max`` over its P values), and the BMM runs FP8 x FP8 on the tensor cores.
      It changes the numbers (docs/results.md, 'The 0.5.0 kernel: FP8 absorbed BMM'), so it is never chosen for you.

    Every token: cache row ``slot`` = ``[kv_c, rope(k_pe)]`` (FP8: ``saturate(x / kv_scale)``,
    rounded to nearest even). Decode tokens: ``q[t] = [q_nope[t] @ w_uk_t[h], rope(q_pe[t])]``.
    Prefill tokens: ``q_pe_out[t - D] = rope(q_pe[t])`` and ``k_pe_out[t - D] = rope(k_pe[t])``
    (activations' dtype, unquantized); pass ``q_pe_out=q_pe[D:]`` to rotate in place. Positions
    outside the RoPE cache are clamped to its ends.

    Returns :class:`~fusemla.contracts.prologue.PrologueOutput` ``(q [D, H, L + R],
    q_pe [N - D, H, R], k_pe [N - D, R])``, the given ``out`` / ``q_pe_out`` / ``k_pe_out``
    where passed.

    Raises :class:`~fusemla.errors.FuseMLAValueError` / :class:`~fusemla.errors.FuseMLATypeError`
    on bad input, before anything is launched or written. No device sync unless
    ``FUSEMLA_DEBUG_CHECKS=1``. Registered as ``torch.ops.fusemla.mla_prologue``: traceable by
    ``torch.compile(fullgraph=True)`` and capturable in CUDA graphs.
    """
    return _execute(
        prepare(
            q_nope,
            q_pe,
            kv_c,
            k_pe,
            w_uk_t,
            positions,
            cos_cache,
            sin_cache,
            kv_cache,
            slot_mapping,
            num_decode_tokens=num_decode_tokens,
            is_neox=is_neox,
            rope_applied=rope_applied,
            kv_scale=kv_scale,
            out=out,
            q_pe_out=q_pe_out,
            k_pe_out=k_pe_out,
            q_out_dtype=q_out_dtype,
            q_scale=q_scale,
            act_quant=act_quant,
        )
    )


def prologue_spec(
    w_uk_t: torch.Tensor | QuantizedWeight,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    *,
    is_neox: bool = False,
    q_out_dtype: torch.dtype | None = None,
    q_scale: Scale = None,
    act_quant: str | None = None,
) -> PrologueSpec:
    """A layer's fixed prologue arguments, checked once, for :func:`mla_prologue_step`.

    The arguments mean what they mean in :func:`mla_prologue`. The spec holds references, not
    copies: update a weight or RoPE table in place, or build a new spec. A ``q_scale`` tensor is
    read on the device at every step (CUDA-graph safe).
    """
    return build_spec(
        w_uk_t,
        cos_cache,
        sin_cache,
        is_neox=is_neox,
        q_out_dtype=q_out_dtype,
        q_scale=q_scale,
        act_quant=act_quant,
    )


def mla_prologue_step(
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
) -> PrologueOutput:
    """One step of the fused prologue on a layer's :func:`prologue_spec`: the per-step
    arguments of :func:`mla_prologue` (same meaning, same result), with only these checked at
    every call."""
    return _execute(
        prepare_step(
            spec,
            q_nope,
            q_pe,
            kv_c,
            k_pe,
            positions,
            kv_cache,
            slot_mapping,
            num_decode_tokens=num_decode_tokens,
            rope_applied=rope_applied,
            kv_scale=kv_scale,
            out=out,
            q_pe_out=q_pe_out,
            k_pe_out=k_pe_out,
        )
    )


def _execute(args: PrologueArgs) -> PrologueOutput:
    """Run validated arguments: eagerly, or through the registered op while compiling."""
    if torch.compiler.is_compiling():
        from fusemla.ops.custom_ops import call_mla_prologue

        call_mla_prologue(args)
    else:
        run(args)
    return args.outputs


def mla_decode_prologue(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    w_uk_t: torch.Tensor | QuantizedWeight,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    is_neox: bool = False,
    rope_applied: bool = False,
    kv_scale: Scale = None,
    out: torch.Tensor | None = None,
    q_out_dtype: torch.dtype | None = None,
    q_scale: Scale = None,
    act_quant: str | None = None,
) -> torch.Tensor:
    """:func:`mla_prologue` for an all-decode batch; returns ``q [N, H, L + R]``."""
    return mla_prologue(
        q_nope,
        q_pe,
        kv_c,
        k_pe,
        w_uk_t,
        positions,
        cos_cache,
        sin_cache,
        kv_cache,
        slot_mapping,
        is_neox=is_neox,
        rope_applied=rope_applied,
        kv_scale=kv_scale,
        out=out,
        q_out_dtype=q_out_dtype,
        q_scale=q_scale,
        act_quant=act_quant,
    ).q
