"""benchmarks/vllm_depth.py reads what vLLM's memory profile gave each engine off its log."""

from __future__ import annotations

from benchmarks.vllm_depth import memory_of_log

LOG = """\
(EngineCore pid=1) INFO [gpu_worker.py:772] Available KV cache memory: 9.46 GiB
(EngineCore pid=1) INFO [kv_cache_utils.py:1147] GPU KV cache size: 144,496 tokens, Maximum concurrency
(EngineCore pid=1) INFO [gpu_worker.py:1003] CUDA graph pool memory: 8.61 GiB (actual), 12.97 GiB (estimated), difference: 4.36 GiB (50.6%).
(EngineCore pid=1) INFO [gpu_worker.py:1066] Free memory on device (139.1/139.8 GiB) on startup. Actual usage is 99.88 GiB for consumed memory (weights + non-torch), 19.27 GiB for peak activation, and 8.61 GiB for CUDAGraph memory.
"""


def test_memory_of_log_reads_the_profile():
    assert memory_of_log(LOG) == {
        "kv_cache_tokens": 144496,
        "kv_cache_gib": 9.46,
        "consumed_gib": 99.88,
        "peak_activation_gib": 19.27,
        "cudagraph_gib": 8.61,
        "cudagraph_estimate_gib": 12.97,
    }


def test_memory_of_log_without_the_lines_is_empty():
    assert memory_of_log("an engine that failed before profiling") == {}
