"""bench_epilogue rotates enough layers that their W_UV does not sit in the GPU's L2 (with the
prologue's eight, 16 heads' W_UV was 16 MiB: L2-resident on the H200, and the kernel looked
faster against the baseline than it is in vLLM)."""

from __future__ import annotations

import types

import torch

from benchmarks import bench_epilogue
from benchmarks.bench_core import Bench


def _bench(smoke: bool) -> Bench:
    b = Bench.for_run(smoke, 8)
    b.dims = dict(bench_epilogue.FULL)
    if not smoke:
        b.device = "cuda"
    return b


def test_layer_count_exceeds_l2(monkeypatch):
    l2 = 50 * 1024 * 1024
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(L2_cache_size=l2)
    )
    b = _bench(smoke=False)
    for H in (16, 128):
        n = bench_epilogue.layer_count(b, H)
        per_layer = H * b.dims["L"] * b.dims["V"] * 2
        assert n >= b.layers and n * per_layer >= bench_epilogue.L2_MULTIPLE * l2, (H, n)
    assert bench_epilogue.layer_count(b, 16) > bench_epilogue.layer_count(b, 128)


def test_layer_count_smoke_keeps_the_small_graph():
    b = _bench(smoke=True)
    assert bench_epilogue.layer_count(b, 2) == b.layers
