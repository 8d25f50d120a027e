"""The ``torch.library`` registration of fusemla's kernels (``fusemla::mla_prologue``,
``fusemla::mla_epilogue``) and their fakes.

The vLLM plugin registers one op of its own, ``fusemla::vllm_mla_attention``, in
:mod:`fusemla.integrations.vllm` (it exists only where vLLM runs).

``torch.compile`` and CUDA graphs see each op as one opaque call that mutates its outputs and
the KV cache. The public functions (:func:`fusemla.mla_prologue`, :func:`fusemla.mla_prologue_step`)
validate their arguments once, on the host, then either run eagerly or, while compiling, call the
op registered here; the op's implementation does not validate again.

The op takes a validated :class:`~fusemla.contracts.prologue.PrologueArgs` flattened into five
fields (:func:`pack` / :func:`unpack`, the one place that knows the order): the tensors it reads,
the tensors it writes, its ints, its floats and the weight format.
"""

from __future__ import annotations

from typing import Optional

import torch

from fusemla.contracts.epilogue import EpilogueArgs, EpilogueSpec
from fusemla.contracts.prologue import PrologueArgs, PrologueSpec, split_scale
from fusemla.quant import weight_parts

#: the read tensors, in :func:`pack`'s order (None where absent: a plain weight's scale, float
#: scales passed by value)
_INS = (
    "q_nope",
    "q_pe",
    "kv_c",
    "k_pe",
    "w_data",
    "w_scale",
    "positions",
    "cos_cache",
    "sin_cache",
    "slot_mapping",
    "kv_scale",
    "q_scale",
)
#: the written tensors (the KV cache and the three outputs)
_OUTS = ("kv_cache", "q", "q_pe_out", "k_pe_out")
_ACT_QUANT_CODES = {None: 0, "fp8": 1}
_ACT_QUANT_OF_CODE = {c: a for a, c in _ACT_QUANT_CODES.items()}


def pack(args: PrologueArgs) -> tuple[list, list, list, list, str]:
    """``(ins, outs, ints, floats, w_format)``: what the registered op takes."""
    spec = args.spec
    w = spec.w_uk_t
    w_data, w_scale, w_format = weight_parts(w)
    w_format = "" if w_format == "plain" else w_format
    kv_t, kv_v = split_scale(args.kv_scale)
    q_t, q_v = split_scale(spec.q_scale)
    ins = [
        args.q_nope,
        args.q_pe,
        args.kv_c,
        args.k_pe,
        w_data,
        w_scale,
        args.positions,
        spec.cos_cache,
        spec.sin_cache,
        args.slot_mapping,
        kv_t,
        q_t,
    ]
    outs = [args.kv_cache, args.q, args.q_pe_out, args.k_pe_out]
    block = getattr(w, "block", None) or (0, 0)
    ints = [
        args.num_decode_tokens,
        int(spec.is_neox),
        int(args.apply_rope),
        _ACT_QUANT_CODES[spec.act_quant],
        *block,
    ]
    return ins, outs, ints, [kv_v, q_v], w_format


def unpack(ins: list, outs: list, ints: list, floats: list, w_format: str) -> PrologueArgs:
    """The :class:`PrologueArgs` :func:`pack` flattened (already validated: not checked again)."""
    i = dict(zip(_INS, ins))
    o = dict(zip(_OUTS, outs))
    num_decode_tokens, is_neox, apply_rope, act_quant, bk, bn = ints
    kv_v, q_v = floats
    if w_format:
        from fusemla.quant import QuantizedWeight

        w = QuantizedWeight(i["w_data"], i["w_scale"], w_format, block=(bk, bn) if bk else None)
    else:
        w = i["w_data"]
    spec = PrologueSpec(
        w_uk_t=w,
        cos_cache=i["cos_cache"],
        sin_cache=i["sin_cache"],
        is_neox=bool(is_neox),
        q_out_dtype=o["q"].dtype,
        q_scale=i["q_scale"] if i["q_scale"] is not None else q_v,
        act_quant=_ACT_QUANT_OF_CODE[act_quant],
    )
    return PrologueArgs(
        spec=spec,
        q_nope=i["q_nope"],
        q_pe=i["q_pe"],
        kv_c=i["kv_c"],
        k_pe=i["k_pe"],
        positions=i["positions"],
        kv_cache=o["kv_cache"],
        slot_mapping=i["slot_mapping"],
        num_decode_tokens=num_decode_tokens,
        apply_rope=bool(apply_rope),
        kv_scale=i["kv_scale"] if i["kv_scale"] is not None else kv_v,
        q=o["q"],
        q_pe_out=o["q_pe_out"],
        k_pe_out=o["k_pe_out"],
    )


@torch.library.custom_op("fusemla::mla_prologue", mutates_args=("outs",))
def mla_prologue_op(
    # typing.Optional, not "X | None": torch.library infers the op's schema from it
    ins: list[Optional[torch.Tensor]],  # noqa: UP045
    outs: list[torch.Tensor],
    ints: list[int],
    floats: list[float],
    w_format: str,
) -> None:
    """The fused prologue on arguments already validated by the public function."""
    from fusemla.ops.prologue.launch import run

    run(unpack(ins, outs, ints, floats, w_format))


@mla_prologue_op.register_fake
def _mla_prologue_fake(ins, outs, ints, floats, w_format) -> None:
    return None


def call_mla_prologue(args: PrologueArgs) -> None:
    """Run validated arguments through the registered op (what torch.compile traces)."""
    mla_prologue_op(*pack(args))


# ----------------------------------------------------------------------------- epilogue


def pack_epilogue(args: EpilogueArgs) -> tuple[list, list, list, str]:
    """``(ins, outs, ints, w_format)``: what the registered epilogue op takes: ``ins`` =
    (attn_out, w_data, w_scale or None), ``outs`` = (out,) or (codes, scales), ``ints`` =
    (group_size, scale_ue8m0, block rows, block columns; 0 without block scales)."""
    spec = args.spec
    w_data, w_scale, w_format = weight_parts(spec.w_uv)
    block = getattr(spec.w_uv, "block", None) or (0, 0)
    outs = [args.out] if args.scale_out is None else [args.out, args.scale_out]
    ints = [spec.group_size, int(spec.scale_ue8m0), *block]
    return [args.attn_out, w_data, w_scale], outs, ints, "" if w_format == "plain" else w_format


def unpack_epilogue(ins: list, outs: list, ints: list, w_format: str) -> EpilogueArgs:
    """The :class:`EpilogueArgs` :func:`pack_epilogue` flattened (validated: not checked again)."""
    attn_out, w_data, w_scale = ins
    group_size, ue8m0, bk, bn = ints
    if w_format:
        from fusemla.quant import QuantizedWeight

        w = QuantizedWeight(w_data, w_scale, w_format, block=(bk, bn) if bk else None)
    else:
        w = w_data
    out = outs[0]
    fp8 = len(outs) == 2
    spec = EpilogueSpec(
        w_uv=w,
        out_dtype=out.dtype if fp8 else None,
        group_size=group_size,
        scale_ue8m0=bool(ue8m0),
    )
    return EpilogueArgs(spec=spec, attn_out=attn_out, out=out, scale_out=outs[1] if fp8 else None)


@torch.library.custom_op("fusemla::mla_epilogue", mutates_args=("outs",))
def mla_epilogue_op(
    ins: list[Optional[torch.Tensor]],  # noqa: UP045
    outs: list[torch.Tensor],
    ints: list[int],
    w_format: str,
) -> None:
    """The fused epilogue on arguments already validated by the public function."""
    from fusemla.ops.epilogue.launch import run

    run(unpack_epilogue(ins, outs, ints, w_format))


@mla_epilogue_op.register_fake
def _mla_epilogue_fake(ins, outs, ints, w_format) -> None:
    return None


def call_mla_epilogue(args: EpilogueArgs) -> None:
    """Run validated epilogue arguments through the registered op (what torch.compile traces)."""
    mla_epilogue_op(*pack_epilogue(args))
