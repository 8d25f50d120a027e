"""The peers the fused prologue is measured against, and the floors, for bench_prologue.py.

* :class:`EnginePrologue` - what vLLM runs today for the MLA decode prologue, four kernels:
  cuBLAS ``torch.bmm(q_nope.transpose(0, 1), W_UK_T)`` -> ``[H, D, L]``; ONE rotary kernel
  rotating q_pe and k_pe (:func:`rotary`, positions index the cos/sin caches; written out of
  place so the benchmark's inputs stay as they were: the same bytes as vLLM's in-place
  rotation); ONE concat (``torch.cat(..., out=q)``) into the 576-wide query; ONE cache-write
  kernel (:func:`cache_write`, vLLM's ``concat_and_cache_mla``: ``[kv_c, k_pe_rot]`` into
  slot ``slot_mapping[t]``, negative slots skipped, an FP8 cache quantized as
  ``saturate(x / kv_scale)`` rounded to nearest even, exactly as
  :func:`fusemla.reference.prologue.quantize_fp8` does).
* :func:`make_compiled_body` - the reference's body
  (:func:`fusemla.reference.prologue.prologue_into`)
  for ``torch.compile`` with only the batch dim dynamic (see its docstring for why it is not
  ``mla_decode_prologue_ref`` itself).
* Floors: :func:`empty_launch` (one program that stores one int) and :func:`weight_read` (reads
  a whole ``W_UK_T`` with enough programs to fill the GPU, one fp32 partial sum per program).

The Triton kernels here share only the exact-rounding helpers of
:mod:`fusemla.ops.triton_helpers` with the kernel under test (``cast_rne`` for bf16 stores under
the interpreter, whose cast truncates; ``round_to_fp8_grid`` for FP8 cache bytes); every row,
peers included, is checked against the pure-PyTorch reference, so a bug there fails both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusemla.dtypes import fp8_code
from fusemla.ops.triton_helpers import cast_rne, round_to_fp8_grid

#: heads per rotary program
ROTARY_BLOCK_H = 16


# ------------------------------------------------------------------------------- rotary


@triton.jit
def rotary_kernel(
    p_pos,
    s_pos,
    p_cos,
    s_cos,
    p_sin,
    s_sin,
    max_pos,
    p_q,
    s_q_t,
    s_q_h,
    p_k,
    s_k_t,
    p_qo,
    s_qo_t,
    s_qo_h,
    p_ko,
    s_ko_t,
    H,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_NEOX: tl.constexpr,
    FIX_BF16: tl.constexpr,
):
    """Program (t, j) rotates heads [j * BLOCK_H, (j + 1) * BLOCK_H) of q_pe[t]; program (t, 0)
    also k_pe[t] (vLLM's ``rotary_embedding`` runs one block per token; this splits a token's
    heads over several programs, which only lowers its latency). fp32 math,
    ``a*c - b*s`` / ``b*c + a*s`` as :func:`fusemla.rope.apply_rope`."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    pos = tl.load(p_pos + t * s_pos).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
    i = tl.arange(0, BLOCK_HALF)
    mi = i < HALF
    c = tl.load(p_cos + pos * s_cos + i, mask=mi, other=0.0).to(tl.float32)
    s = tl.load(p_sin + pos * s_sin + i, mask=mi, other=0.0).to(tl.float32)
    if IS_NEOX:
        ia = i
        ib = i + HALF
    else:
        ia = 2 * i
        ib = 2 * i + 1
    h = j * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (h < H)[:, None] & mi[None, :]
    src = p_q + t * s_q_t + h[:, None].to(tl.int64) * s_q_h
    a = tl.load(src + ia[None, :], mask=m, other=0.0).to(tl.float32)
    b = tl.load(src + ib[None, :], mask=m, other=0.0).to(tl.float32)
    oa = a * c[None, :] - b * s[None, :]
    ob = b * c[None, :] + a * s[None, :]
    dst = p_qo + t * s_qo_t + h[:, None].to(tl.int64) * s_qo_h
    ty = p_qo.dtype.element_ty
    tl.store(dst + ia[None, :], cast_rne(oa, ty, FIX_BF16), mask=m)
    tl.store(dst + ib[None, :], cast_rne(ob, ty, FIX_BF16), mask=m)
    if j == 0:
        ka = tl.load(p_k + t * s_k_t + ia, mask=mi, other=0.0).to(tl.float32)
        kb = tl.load(p_k + t * s_k_t + ib, mask=mi, other=0.0).to(tl.float32)
        kty = p_ko.dtype.element_ty
        tl.store(p_ko + t * s_ko_t + ia, cast_rne(ka * c - kb * s, kty, FIX_BF16), mask=mi)
        tl.store(p_ko + t * s_ko_t + ib, cast_rne(kb * c + ka * s, kty, FIX_BF16), mask=mi)


def _interpreting() -> bool:
    from fusemla.config import interpreting

    return interpreting()


def rotary(positions, cos_cache, sin_cache, q_pe, k_pe, q_out, k_out, is_neox=False) -> None:
    """``q_out[t, h] = rope(q_pe[t, h])``, ``k_out[t] = rope(k_pe[t])`` (one launch; any row
    strides, last dims contiguous; ``k_pe`` ``[N, R]`` or ``[N, 1, R]``)."""
    N, H, R = q_pe.shape
    if N == 0:
        return
    k_pe = k_pe.reshape(N, R) if k_pe.dim() == 3 else k_pe
    k_out = k_out.reshape(N, R) if k_out.dim() == 3 else k_out
    for name, x in (
        ("q_pe", q_pe),
        ("k_pe", k_pe),
        ("q_out", q_out),
        ("k_out", k_out),
        ("cos_cache", cos_cache),
        ("sin_cache", sin_cache),
    ):
        if x.stride(-1) != 1:
            raise ValueError(f"rotary: {name} needs a contiguous last dim")
    half = R // 2
    block_h = min(triton.next_power_of_2(H), ROTARY_BLOCK_H)
    rotary_kernel[(N, triton.cdiv(H, block_h))](
        positions,
        positions.stride(0),
        cos_cache,
        cos_cache.stride(0),
        sin_cache,
        sin_cache.stride(0),
        cos_cache.shape[0],
        q_pe,
        q_pe.stride(0),
        q_pe.stride(1),
        k_pe,
        k_pe.stride(0),
        q_out,
        q_out.stride(0),
        q_out.stride(1),
        k_out,
        k_out.stride(0),
        H,
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_H=block_h,
        IS_NEOX=bool(is_neox),
        FIX_BF16=_interpreting() and q_out.dtype == torch.bfloat16,
        num_warps=4,
    )


# ------------------------------------------------------------------------------- cache write


@triton.jit
def cache_write_kernel(
    p_kvc,
    s_kvc_t,
    p_kpe,
    s_kpe_t,
    p_slot,
    s_slot,
    p_cache,
    s_cache_b,
    s_cache_s,
    block_size,
    num_slots,
    p_scale,
    L,
    R,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One program per token (vLLM's ``concat_and_cache_mla``): cache row ``slot`` =
    ``[kv_c[t], k_pe[t]]``; FP8: ``saturate(x / scale)`` (IEEE division), ties to even.
    Slots < 0 or >= num_slots write nothing."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(p_slot + t * s_slot).to(tl.int64)
    ol = tl.arange(0, BLOCK_L)
    orr = tl.arange(0, BLOCK_R)
    # the slot test elementwise (the interpreter mis-types a scalar bool ANDed into a mask)
    sl = slot + tl.zeros([BLOCK_L], dtype=tl.int64)
    sr = slot + tl.zeros([BLOCK_R], dtype=tl.int64)
    ml = (ol < L) & (sl >= 0) & (sl < num_slots)
    mr = (orr < R) & (sr >= 0) & (sr < num_slots)
    slot = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
    row = p_cache + (slot // block_size) * s_cache_b + (slot % block_size) * s_cache_s
    x = tl.load(p_kvc + t * s_kvc_t + ol, mask=ml, other=0.0)
    k = tl.load(p_kpe + t * s_kpe_t + orr, mask=mr, other=0.0)
    ty = p_cache.dtype.element_ty
    if KV_FP8 != 0:
        scale = tl.load(p_scale).to(tl.float32)
        x = round_to_fp8_grid(tl.math.div_rn(x.to(tl.float32), scale), KV_FP8)
        k = round_to_fp8_grid(tl.math.div_rn(k.to(tl.float32), scale), KV_FP8)
    tl.store(row + ol, x.to(ty), mask=ml)
    tl.store(row + L + orr, k.to(ty), mask=mr)


def cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale=None) -> None:
    """One launch: ``kv_cache[s // bs, s % bs] = [kv_c[t], k_pe[t]]`` for ``s = slot[t] >= 0``.

    ``k_pe`` in the activations' dtype (already rotated); an FP8 cache needs ``kv_scale`` as a
    1-element fp32 tensor."""
    N, L = kv_c.shape
    if N == 0:
        return
    k_pe = k_pe.reshape(N, -1)
    R = k_pe.shape[1]
    code = fp8_code(kv_cache.dtype)
    if code and not isinstance(kv_scale, torch.Tensor):
        kv_scale = torch.full((1,), float(kv_scale), dtype=torch.float32, device=kv_cache.device)
    cache_write_kernel[(N,)](
        kv_c,
        kv_c.stride(0),
        k_pe,
        k_pe.stride(0),
        slot_mapping,
        slot_mapping.stride(0),
        kv_cache,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.shape[1],
        kv_cache.shape[0] * kv_cache.shape[1],
        kv_scale if code else kv_c,
        L,
        R,
        BLOCK_L=triton.next_power_of_2(L),
        BLOCK_R=triton.next_power_of_2(R),
        KV_FP8=code,
        num_warps=4,
    )


# ------------------------------------------------------------------------------- engine path


class EnginePrologue:
    """vLLM's four kernels for one layer's batch (decode tokens first, ``D`` of ``N``), with
    its own intermediate buffers: bmm -> rotary -> cat -> cache write.

    ``run()`` returns ``(q [D, H, L+R], q_pe_rot [N-D, H, R], k_pe_rot [N-D, R])`` (the
    prefill parts are views of the rotary kernel's output, as vLLM's prefill reads its
    in-place rotated q_pe / k_pe)."""

    def __init__(self, inp, out: torch.Tensor, num_decode_tokens: int | None = None):
        self.inp = inp
        N, H, _ = inp.q_nope.shape
        R, L = inp.q_pe.shape[-1], inp.kv_c.shape[1]
        self.D = N if num_decode_tokens is None else num_decode_tokens
        dev, act = inp.q_nope.device, inp.q_nope.dtype
        self.out = out
        self.ql = torch.empty(H, self.D, L, dtype=act, device=dev)
        self.q_rot = torch.empty(N, H, R, dtype=act, device=dev)
        self.k_rot = torch.empty(N, R, dtype=act, device=dev)

    @property
    def buffers(self) -> list:
        """Everything it writes besides the cache (to poison before a check)."""
        return [self.out, self.ql, self.q_rot, self.k_rot]

    def run(self):
        x, D = self.inp, self.D
        if D > 0:
            torch.bmm(x.q_nope[:D].transpose(0, 1), x.w_uk_t, out=self.ql)  # 1: cuBLAS
        rotary(
            x.positions, x.cos_cache, x.sin_cache, x.q_pe, x.k_pe, self.q_rot, self.k_rot
        )  # 2: one rotary kernel
        if D > 0:
            torch.cat([self.ql.transpose(0, 1), self.q_rot[:D]], dim=-1, out=self.out)  # 3
        cache_write(x.kv_c, self.k_rot, x.kv_cache, x.slot_mapping, x.kv_scale)  # 4
        return self.out, self.q_rot[D:], self.k_rot[D:]


# ------------------------------------------------------------------------------- compiled


def make_compiled_body():
    """``body(q_nope, ..., slot_mapping, kv_scale, out, q_pe_out, k_pe_out,
    num_decode_tokens=None)``: the reference's four steps
    (:func:`fusemla.reference.prologue.prologue_into`) on arguments validated outside, for
    ``torch.compile(fullgraph=True)`` (no graph break: a break would hand the batch size to the
    resumed frame as a constant).

    The argument checks of ``mla_decode_prologue_ref`` are host-side Python (validated once
    outside the timed graph here, as an engine validates at setup), so the compiled graph holds
    only the four steps an unfused engine path runs. (The JSON of commit 90e81b4 was taken with
    this body; ``prepare()`` itself keeps the batch dim dynamic since 42d3a20.)"""
    from fusemla.contracts.prologue import PrologueArgs, PrologueSpec
    from fusemla.reference.prologue import prologue_into

    def body(
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
        kv_scale,
        out,
        q_pe_out,
        k_pe_out,
        num_decode_tokens=None,
    ):
        D = q_nope.shape[0] if num_decode_tokens is None else num_decode_tokens
        spec = PrologueSpec(w_uk_t=w_uk_t, cos_cache=cos_cache, sin_cache=sin_cache)
        prologue_into(
            PrologueArgs(
                spec=spec,
                q_nope=q_nope,
                q_pe=q_pe,
                kv_c=kv_c,
                k_pe=k_pe,
                positions=positions,
                kv_cache=kv_cache,
                slot_mapping=slot_mapping,
                num_decode_tokens=D,
                apply_rope=True,
                kv_scale=kv_scale,
                q=out,
                q_pe_out=q_pe_out,
                k_pe_out=k_pe_out,
            )
        )
        return out, q_pe_out, k_pe_out

    return body


# ------------------------------------------------------------------------------- floors


@triton.jit
def empty_kernel(p_flag):
    tl.store(p_flag, 1)


def empty_launch(flag: torch.Tensor) -> None:
    """One program that stores ``flag[0] = 1`` (the launch floor, checked)."""
    empty_kernel[(1,)](flag, num_warps=1)


@triton.jit
def weight_read_kernel(p_w, n, p_out, PER_PROG: tl.constexpr, BLOCK: tl.constexpr):
    """Program i sums elements [i * PER_PROG, (i + 1) * PER_PROG) of ``w`` (fp32) and stores
    the one partial sum."""
    pid = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, PER_PROG, BLOCK):
        idx = pid * PER_PROG + i + o
        acc += tl.load(p_w + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.store(p_out + pid, tl.sum(acc, axis=0))


def weight_read_programs(n: int, programs: int, block: int) -> tuple[int, int]:
    """(grid, elements per program) for reading ``n`` elements with about ``programs``
    programs, each a whole number of ``block``-element loads."""
    per = triton.cdiv(triton.cdiv(n, max(programs, 1)), block) * block
    return triton.cdiv(n, per), per


def weight_read(w: torch.Tensor, partial: torch.Tensor, programs: int, block: int) -> None:
    """Read all of ``w`` (contiguous) once; ``partial[:grid]`` gets one fp32 sum per program."""
    n = w.numel()
    grid, per = weight_read_programs(n, programs, block)
    weight_read_kernel[(grid,)](w, n, partial, PER_PROG=per, BLOCK=block, num_warps=4)
