"""Triton ops. Nothing here imports a layer or an engine integration.

``fusemla.ops.prologue``: the fused MLA prologue (see :func:`fusemla.mla_prologue`).
``fusemla.ops.custom_ops``: every ``torch.library`` registration.
``fusemla.ops.triton_helpers``: Triton helpers shared by the kernels.
"""
