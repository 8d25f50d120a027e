"""Launch configurations of the prologue kernel: tile sizes per backend, BMM program count.

One function per decision: :func:`launch_config` gives the tiles for a model shape on a backend
(keyed on the model dims and one batch bucket, never on the token count, so a serving loop
compiles at most two variants); :func:`bmm_programs` says how many BMM programs share the
(head, L-tile, token-tile) work items.

Under the Triton interpreter the config is deliberately *small*: two L-tiles per head, two
passes of the cache row loop, 16-token BMM tiles, two tokens per cache program and three
persistent BMM programs, so CPU tests run the same tile arithmetic (L-tile offsets, token
tiles, the persistent loop's stride, loops of several iterations) the GPU runs.
:func:`override` replaces any key for a block of code (tests force persistence on the GPU
with it).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

import triton

#: decode batches up to this size use the small-batch tile config (one extra compiled variant)
SMALL_BATCH = 8

_KEYS = ("BLOCK_P", "BLOCK_L", "BLOCK_T", "BLOCK_R", "BLOCK_LC", "ROPE_ROWS", "CACHE_ROWS",
         "num_warps", "num_stages", "programs_per_sm")
_overrides: dict[str, Any] = {}


@functools.cache
def _base_config(H: int, P: int, R: int, L: int, backend: str, small: bool) -> dict:
    common = dict(BLOCK_P=triton.next_power_of_2(P), BLOCK_R=triton.next_power_of_2(R),
                  BLOCK_LC=min(512, triton.next_power_of_2(L)), ROPE_ROWS=64, CACHE_ROWS=1,
                  BLOCK_T=16)
    lmax = triton.next_power_of_2(L)
    if backend == "interpreter":
        half = max(16, lmax // 2)
        return dict(common, BLOCK_L=half, BLOCK_LC=half, ROPE_ROWS=16, CACHE_ROWS=2,
                    num_warps=1, num_stages=1, programs_per_sm=3.0)
    if small:
        return dict(common, BLOCK_L=min(128 if H <= 32 else 256, lmax), num_warps=8,
                    num_stages=2, programs_per_sm=0.0)
    if H <= 32:
        return dict(common, BLOCK_L=min(128, lmax), BLOCK_T=64, CACHE_ROWS=4, num_warps=8,
                    num_stages=3, programs_per_sm=1.0)
    return dict(common, BLOCK_L=min(256, lmax), BLOCK_T=64, CACHE_ROWS=4, num_warps=8,
                num_stages=2, programs_per_sm=1.0)


def launch_config(H: int, P: int, R: int, L: int, backend: str, small: bool = False) -> dict:
    """Tile sizes for one model shape on one backend ("cuda", "rocm" or "interpreter").

    ``small``: decode batch <= :data:`SMALL_BATCH`. ``programs_per_sm``: BMM programs per
    multiprocessor when the work items outnumber them (persistent programs); 0 = one program
    per item. The CUDA values are the best of a sweep on an H200
    (``benchmarks/bench_prologue.py --sweep``); ROCm uses them until measured there.
    """
    if backend not in ("cuda", "rocm", "interpreter"):
        raise ValueError(f"backend: expected 'cuda', 'rocm' or 'interpreter', got {backend!r}")
    cfg = dict(_base_config(H, P, R, L, backend, small))
    cfg.update(_overrides)
    return cfg


@contextlib.contextmanager
def override(**keys: Any) -> Iterator[None]:
    """Replace config keys (e.g. ``BLOCK_L=32, programs_per_sm=0``) inside a ``with`` block."""
    unknown = set(keys) - set(_KEYS)
    if unknown:
        raise ValueError(f"override: unknown config keys {sorted(unknown)}; known: {_KEYS}")
    saved = dict(_overrides)
    _overrides.update(keys)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def bmm_items(D: int, H: int, L: int, cfg: dict) -> int:
    """The (head, L-tile, token-tile) work items of ``D`` decode tokens."""
    return H * triton.cdiv(L, cfg["BLOCK_L"]) * triton.cdiv(D, cfg["BLOCK_T"]) if D > 0 else 0


def bmm_programs(D: int, H: int, L: int, cfg: dict, num_sms: int) -> int:
    """How many BMM programs run the work items: all of them (``programs_per_sm`` 0) or
    ``ceil(programs_per_sm * num_sms)`` persistent ones, never more than there are items."""
    items = bmm_items(D, H, L, cfg)
    pps = cfg["programs_per_sm"]
    if pps <= 0:
        return items
    return min(items, max(1, math.ceil(pps * num_sms)))
