"""One-off questions about a kernel, asked with its benchmark's harness (the same checks before
timing): of the prologue, ``layout_probe`` (weight layout), ``stage_probe`` (parts of the grid),
``ncu_prologue`` (launches for Nsight Compute); of the epilogue, ``epilogue_stages`` (stages
left out, other SPLITs). Each is an entry of
:mod:`benchmarks.registry` with its own ``--smoke``."""
