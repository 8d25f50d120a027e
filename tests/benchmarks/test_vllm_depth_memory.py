"""benchmarks/vllm_depth.py reads what vLLM's memory profile gave each engine off its log, and
summarizes the engine's CUDA allocator once it is up."""

from __future__ import annotations

import benchmarks.vllm_depth as vd
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


def test_rpc_memory_sorts_live_blocks_by_pool_and_size(monkeypatch):
    """The engine's allocator summary (vllm_depth._rpc_memory): reserved vs live per pool and
    the live blocks' sizes, from a made-up snapshot (vLLM's CPU build has no CUDA)."""
    import torch

    mib = 1 << 20
    snap = [
        {  # default pool: one 2 MiB live block, 6 MiB free
            "segment_pool_id": (0, 0), "total_size": 8 * mib,
            "blocks": [{"size": 2 * mib, "state": "active_allocated"},
                       {"size": 6 * mib, "state": "inactive"}],
        },
        {  # a graph pool: three 64 MiB blocks still live, one free
            "segment_pool_id": (1, 3), "total_size": 256 * mib,
            "blocks": [{"size": 64 * mib, "state": "active_allocated"}] * 3
            + [{"size": 64 * mib, "state": "inactive"}],
        },
    ]  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snap)
    m = vd._rpc_memory(None)
    assert m["reserved_gib"] == {"default": round(8 / 1024, 3), "graphs": 0.25}
    assert m["live_gib"] == {"default": round(2 / 1024, 3), "graphs": round(192 / 1024, 3)}
    assert m["live_blocks_by_mib"] == [["graphs", 64, 3], ["default", 2, 1]]

    def broken():
        raise RuntimeError("no snapshot here")

    monkeypatch.setattr(torch.cuda, "memory_snapshot", broken)  # a diagnostic never ends a run
    assert "no snapshot here" in vd._rpc_memory(None)["error"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vd._rpc_memory(None) == {}
