"""The ``torch.library`` registration of fusemla's kernels (``fusemla::mla_prologue``) and its fake.

The vLLM plugin registers one op of its own, ``fusemla::vllm_mla_attention``, in
:mod:`fusemla.integrations.vllm` (it exists only where vLLM runs).

``torch.compile`` and CUDA graphs see each op as one opaque call that mutates its outputs and
the KV cache. The public functions (:func:`fusemla.mla_prologue`) validate their arguments
once, on the host, then either run eagerly or, while compiling, call the op registered here;
the op's implementation does not validate again.
"""

from __future__ import annotations

import torch

from fusemla.ops.prologue.args import PrologueArgs, split_scale


@torch.library.custom_op("fusemla::mla_prologue",
                         mutates_args=("kv_cache", "q_out", "q_pe_out", "k_pe_out"))
def mla_prologue_op(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
    w_data: torch.Tensor, w_scale: torch.Tensor | None, w_format: str,
    positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_decode_tokens: int, is_neox: bool,
    apply_rope: bool, kv_scale_tensor: torch.Tensor | None, kv_scale_value: float,
    q_scale_tensor: torch.Tensor | None, q_scale_value: float,
    q_out: torch.Tensor, q_pe_out: torch.Tensor, k_pe_out: torch.Tensor,
) -> None:
    """The fused prologue on arguments already validated by the public function."""
    from fusemla.ops.prologue.launch import run

    if w_format:
        from fusemla.quant import QuantizedWeight

        w = QuantizedWeight(w_data, w_scale, w_format)
    else:
        w = w_data
    run(PrologueArgs(
        q_nope=q_nope, q_pe=q_pe, kv_c=kv_c, k_pe=k_pe, w_uk_t=w, positions=positions,
        cos_cache=cos_cache, sin_cache=sin_cache, kv_cache=kv_cache, slot_mapping=slot_mapping,
        num_decode_tokens=num_decode_tokens, is_neox=is_neox, apply_rope=apply_rope,
        kv_scale=kv_scale_tensor if kv_scale_tensor is not None else kv_scale_value,
        q_scale=q_scale_tensor if q_scale_tensor is not None else q_scale_value,
        q=q_out, q_pe_out=q_pe_out, k_pe_out=k_pe_out,
    ))


@mla_prologue_op.register_fake
def _mla_prologue_fake(q_nope, q_pe, kv_c, k_pe, w_data, w_scale, w_format, positions,
                       cos_cache, sin_cache, kv_cache, slot_mapping, num_decode_tokens, is_neox,
                       apply_rope, kv_scale_tensor, kv_scale_value, q_scale_tensor,
                       q_scale_value, q_out, q_pe_out, k_pe_out) -> None:
    return None


def call_mla_prologue(args: PrologueArgs) -> None:
    """Run validated arguments through the registered op (what torch.compile traces)."""
    w = args.w_uk_t
    w_data, w_scale, w_format = ((w, None, "") if isinstance(w, torch.Tensor)
                                 else (w.data, w.scale, w.format))
    kv_t, kv_v = split_scale(args.kv_scale)
    q_t, q_v = split_scale(args.q_scale)
    mla_prologue_op(args.q_nope, args.q_pe, args.kv_c, args.k_pe, w_data, w_scale, w_format,
                    args.positions, args.cos_cache, args.sin_cache, args.kv_cache,
                    args.slot_mapping, args.num_decode_tokens, args.is_neox, args.apply_rope,
                    kv_t, kv_v, q_t, q_v, args.q, args.q_pe_out, args.k_pe_out)
