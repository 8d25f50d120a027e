"""Triton ops. Nothing here imports a layer or an engine integration.

``fusemla.ops.prologue``: the fused MLA prologue (see :func:`fusemla.mla_prologue`).
``fusemla.ops.custom_ops``: the kernels' ``torch.library`` registration (the vLLM plugin's own op
lives in ``fusemla.integrations.vllm``).
``fusemla.ops.triton_helpers``: Triton helpers shared by the kernels.
"""
