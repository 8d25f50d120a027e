"""benchmarks/vllm_depth.py's allocator summary of an engine once it is up."""

import benchmarks.vllm_depth as vd


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
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vd._rpc_memory(None) == {}
