"""A Triton producer kernel for testing and measuring programmatic dependent launch (PDL).

In an engine the prologue runs behind other kernels (q_b_proj's GEMM, the kv_c RMSNorm that
torch.compile generates as a Triton kernel). :func:`produce` stands in for such a Triton producer:
it writes the prologue's inputs (``dst = src * scale``) and, with PDL, lets its dependent start
early (``gdc_launch_dependents``). Tests check that a PDL prologue behind it never reads stale
inputs; the benchmark times the chain with PDL on and off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_producer_kernel(p_src, p_dst, n, scale, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_wait()  # the kernel before this one may still be writing src
        gdc_launch_dependents()  # the prologue may start now (and load its weights)
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(p_src + o, mask=m, other=0.0).to(tl.float32)
    tl.store(p_dst + o, (x * scale).to(p_dst.dtype.element_ty), mask=m)


def produce(src: torch.Tensor, dst: torch.Tensor, scale: float = 1.0, pdl: bool = False) -> None:
    """``dst = src * scale`` (both contiguous, same numel) in one Triton launch."""
    n = src.numel()
    block = 1024
    opts = {"launch_pdl": True} if pdl else {}
    pdl_producer_kernel[(triton.cdiv(n, block),)](
        src, dst, n, scale, BLOCK=block, USE_PDL=pdl, num_warps=4, **opts
    )
