"""fusemla's benchmarks: one registry (:mod:`benchmarks.registry`), one runner (``python -m
benchmarks``, :mod:`benchmarks.runner`), every benchmark with a ``--smoke`` that checks rows on
the CPU.

Run from the repository root (the package is not installed; fusemla is)::

    python -m benchmarks list                       # what there is
    python -m benchmarks run bench_prologue --out results.json   # = python -m benchmarks.bench_prologue
    python -m benchmarks smoke                      # every smoke, a summary, non-zero on a failure

Layout:

- entries (registry.py): ``bench_prologue`` (the kernel against its peers; its parts:
  ``bench_core``, ``bench_sections``, ``peers``, ``prologue_sweep``), ``bench_mla_layer``, the
  probes in ``probes/`` (``layout_probe``, ``stage_probe``, ``ncu_prologue``, ``epilogue_stages``),
  ``aiter_peer``, ``targets``, the vLLM benchmarks (``bench_vllm``, ``vllm_depth``, ``flashmla_graphs``) and
  ``summarize``;
- shared: ``common`` (JSON header, timing, the smoke's interpreter, the exit verdict);
- ``results/``: the committed runs (JSON and logs, the commit in each).

The package modules import each other as ``benchmarks.*`` (``python -m`` puts the root on the
path: no ``sys.path`` edits); the scripts that engines or remote jobs start by path
(``vllm_depth.py``, ``flashmla_graphs.py``, ``bench_vllm.py``, ``aiter_peer.py``,
``summarize.py``, ``targets.py``) also run as ``python benchmarks/NAME.py``.
"""
