"""A block-FP8 linear kernel for vLLM's CPU build on hosts without AMX (test-only).

vLLM's CPU block-FP8 kernels need Intel AMX; CI's machines have none, so a block-FP8 checkpoint
(``engine_run.py``'s ``-fp8`` shapes) cannot load there. :func:`install` puts
:class:`EmulatedFp8BlockKernel` first in vLLM's CPU block-FP8 kernel list (in this process, before
the engine is built): it quantizes its input as CUTLASS's block-FP8 kernel does on Hopper
(vLLM's own ``QuantFP8``, dynamic per token group of 128, column-major fp32 scales, not UE8M0)
and multiplies the dequantized operands in fp32. So the plugin's FP8 handoff (the epilogue's
codes and scales straight into o_proj's ``apply_block_scaled_mm``) runs on the CPU exactly as far
as the layout and the call sequence go; the GEMM is vLLM's on a GPU, this one here.
"""

from __future__ import annotations


def install() -> None:
    import torch
    import vllm.model_executor.kernels.linear as kl
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.platforms import PlatformEnum, current_platform

    class EmulatedFp8BlockKernel(Fp8BlockScaledMMLinearKernel):
        """vLLM's input quantization in CUTLASS's scale layout, then an fp32 GEMM of the
        dequantized codes."""

        def __init__(self, config) -> None:
            super().__init__(config)
            self.quant_fp8 = QuantFP8(
                static=False,
                group_shape=config.activation_quant_key.scale.group_shape,
                use_ue8m0=False,
                column_major_scales=True,
            )

        @classmethod
        def is_supported(cls, compute_capability=None):
            return current_platform.is_cpu(), "CPU only (test emulation)"

        @classmethod
        def can_implement(cls, config):
            return True, None

        def apply_block_scaled_mm(self, A, B, As, Bs):
            bn, bk = self.weight_group_shape.row, self.weight_group_shape.col
            M, K = A.shape
            N = B.shape[0]
            g = K // As.shape[1]
            a = A.float() * As.float().repeat_interleave(g, dim=1)[:, :K]
            s = Bs.float().repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
            return (a @ (B.float() * s).t()).to(self.config.out_dtype)

    kernels = kl._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if not any(k.__name__ == EmulatedFp8BlockKernel.__name__ for k in kernels):
        kernels.insert(0, EmulatedFp8BlockKernel)
    del torch
