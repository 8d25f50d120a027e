"""One-off questions about the prologue kernel, asked with bench_prologue's harness (the same
checks before timing): ``layout_probe`` (weight layout), ``stage_probe`` (parts of the grid),
``ncu_prologue`` (launches for Nsight Compute). Each is an entry of
:mod:`benchmarks.registry` with its own ``--smoke``."""
