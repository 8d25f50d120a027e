"""Launch configurations of the prologue kernel: tile sizes per backend, token chunking.

One function per decision: :func:`launch_config` gives the tiles for a model shape on a backend
(keyed on the model dims and one batch bucket, never on the token count, so a serving loop
compiles at most two variants); :func:`split_tokens` cuts the decode tokens into chunks.

Under the Triton interpreter the config is deliberately *small*: two L-tiles per head, two
passes of the cache row loop, 16-token BMM tiles and at most two tiles per chunk, so CPU tests
run the same tile arithmetic (L-tile offsets, token chunks, loops of several iterations) the
GPU runs. :func:`override` replaces any key for a block of code (tests force chunking on the
GPU with it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import triton

#: decode batches up to this size use the small-batch tile config (one extra compiled variant)
SMALL_BATCH = 8

_KEYS = ("BLOCK_P", "BLOCK_L", "BLOCK_T", "BLOCK_R", "BLOCK_LC", "ROPE_ROWS", "num_warps",
         "num_stages", "programs_per_sm", "max_tiles_per_chunk")
_overrides: dict[str, Any] = {}


@functools.cache
def _base_config(H: int, P: int, R: int, L: int, backend: str, small: bool) -> dict:
    common = dict(BLOCK_P=triton.next_power_of_2(P), BLOCK_R=triton.next_power_of_2(R),
                  BLOCK_LC=min(512, triton.next_power_of_2(L)), ROPE_ROWS=64, BLOCK_T=16,
                  max_tiles_per_chunk=None)
    lmax = triton.next_power_of_2(L)
    if backend == "interpreter":
        half = max(16, lmax // 2)
        return dict(common, BLOCK_L=half, BLOCK_LC=half, ROPE_ROWS=16, num_warps=1,
                    num_stages=1, programs_per_sm=0.0, max_tiles_per_chunk=2)
    if small:
        return dict(common, BLOCK_L=min(128 if H <= 32 else 256, lmax), num_warps=8,
                    num_stages=2, programs_per_sm=1.0)
    if H <= 32:
        return dict(common, BLOCK_L=min(128, lmax), BLOCK_T=64, num_warps=8, num_stages=3,
                    programs_per_sm=1.0)
    return dict(common, BLOCK_L=min(256, lmax), BLOCK_T=64, num_warps=8, num_stages=2,
                programs_per_sm=1.0)


def launch_config(H: int, P: int, R: int, L: int, backend: str, small: bool = False) -> dict:
    """Tile sizes for one model shape on one backend ("cuda", "rocm" or "interpreter").

    ``small``: decode batch <= :data:`SMALL_BATCH`. ``programs_per_sm`` sets how finely large
    batches are split into token chunks (each chunk re-reads its weight slice once);
    ``max_tiles_per_chunk`` (None: no limit) caps a chunk's BLOCK_T tiles. The CUDA values
    are the best of a sweep on an H200 (``benchmarks/bench_prologue.py --sweep``); ROCm uses
    them until measured there.
    """
    if backend not in ("cuda", "rocm", "interpreter"):
        raise ValueError(f"backend: expected 'cuda', 'rocm' or 'interpreter', got {backend!r}")
    cfg = dict(_base_config(H, P, R, L, backend, small))
    cfg.update(_overrides)
    return cfg


@contextlib.contextmanager
def override(**keys: Any) -> Iterator[None]:
    """Replace config keys (e.g. ``BLOCK_L=32, max_tiles_per_chunk=1``) inside a ``with`` block."""
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


def split_tokens(D: int, n_hl: int, cfg: dict, num_sms: int) -> tuple[int, int]:
    """(tokens_per_chunk, n_chunks) for ``D`` decode tokens over ``n_hl`` (head, L-tile) pairs.

    One chunk unless the (head, L-tile) grid underfills the GPU (``programs_per_sm``) or a
    chunk would hold more than ``max_tiles_per_chunk`` BLOCK_T tiles. Chunks hold whole tiles.
    """
    block_t = cfg["BLOCK_T"]
    n_tiles = triton.cdiv(max(D, 1), block_t)
    want = int(cfg["programs_per_sm"] * num_sms) // max(n_hl, 1)
    n_chunks = max(1, min(n_tiles, want))
    if cfg.get("max_tiles_per_chunk"):
        n_chunks = max(n_chunks, triton.cdiv(n_tiles, cfg["max_tiles_per_chunk"]))
    tiles_per_chunk = triton.cdiv(n_tiles, n_chunks)
    tokens_per_chunk = tiles_per_chunk * block_t
    return tokens_per_chunk, triton.cdiv(max(D, 1), tokens_per_chunk)
