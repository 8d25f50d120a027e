"""Launch configurations of the prologue kernel: tile sizes per backend, BMM program count.

One function per decision: :func:`launch_config` gives the tiles for a model shape on a backend
(keyed on the model dims, the weight format and one of three batch buckets, never on the token
count, so a serving loop compiles at most three variants per weight format);
:func:`bmm_programs` says how many BMM programs share the (head, L-tile, token-tile) work items.

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

#: decode batches up to this size use the small-batch tile config
SMALL_BATCH = 8
#: decode batches of at least this size use the large-batch tile config (in between: medium)
LARGE_BATCH = 256

_KEYS = (
    "BLOCK_P",
    "BLOCK_L",
    "BLOCK_T",
    "BLOCK_R",
    "BLOCK_LC",
    "ROPE_ROWS",
    "CACHE_ROWS",
    "num_warps",
    "num_stages",
    "programs_per_sm",
)
_overrides: dict[str, Any] = {}

# (BLOCK_L, BLOCK_T, num_warps, num_stages, programs_per_sm, ROPE_ROWS, CACHE_ROWS): the best of
# sweeps on an H200 at DeepSeek-V3 dims, every config checked against the reference first
# (`python -m benchmarks.bench_prologue --sweep`; the runs and their times:
# benchmarks/results/h200_explore_v2_phase*.json, docs/results.md).
_CUDA_TILES = {
    # (heads <= 32, bucket, weight format or None for any)
    (True, "small", None): (128, 16, 4, 3, 2.0, 64, 1),
    # small batch, bf16 / FP8 weights: one program per (head, L-tile), no pipelining; FP8
    # weights K-major (quantize_fp8_weight's default); chosen by the layout probe
    # (benchmarks/results/h200_layout_probe_*.json: the persistent pipelined tiles lost there)
    (True, "small", "plain"): (128, 16, 4, 1, 0.0, 64, 1),
    (True, "small", "fp8"): (64, 16, 4, 1, 0.0, 64, 1),
    (True, "small", "fp8xfp8"): (64, 16, 8, 1, 0.0, 64, 1),
    (False, "small", "fp8xfp8"): (256, 16, 4, 1, 0.0, 64, 1),
    (True, "medium", None): (128, 64, 8, 2, 2.0, 128, 8),
    (True, "large", None): (128, 64, 8, 2, 2.0, 128, 8),
    (False, "small", "plain"): (128, 16, 4, 1, 0.0, 64, 1),
    (False, "small", "fp8"): (128, 16, 4, 1, 0.0, 64, 1),
    (False, "small", "mxfp4"): (128, 16, 8, 2, 0.0, 64, 1),
    (False, "medium", None): (128, 64, 8, 2, 2.0, 128, 8),
    (False, "large", "fp8"): (128, 64, 4, 3, 2.0, 64, 4),
    (False, "large", None): (128, 128, 8, 3, 1.0, 128, 8),
}


#: ROCm: the CUDA tiles until measured there, except where they need more LDS than AMD chips
#: have (64 KiB per workgroup on MI300 / gfx942, 160 KiB on MI350 / gfx950): the H > 32
#: large-batch plain / MXFP4 tiles (128, 128, 8 warps, 3 stages) need 128-200 KiB there
#: (benchmarks/targets.py compiles every variant for gfx942 / gfx950), so they take the medium ones
_ROCM_TILES = {**_CUDA_TILES, (False, "large", None): _CUDA_TILES[(False, "medium", None)]}

#: tile formats whose weights are another format's (for the fallback to its tiles)
_WEIGHTS_OF = {"fp8xfp8": "fp8"}


def batch_bucket(D: int) -> str:
    """The tile bucket of ``D`` decode tokens: "small" (<= :data:`SMALL_BATCH`), "large"
    (>= :data:`LARGE_BATCH`) or "medium"."""
    return "small" if D <= SMALL_BATCH else "large" if D >= LARGE_BATCH else "medium"


@functools.cache
def _base_config(
    H: int,
    P: int,
    R: int,
    L: int,
    backend: str,
    small: bool,
    large: bool = False,
    w_format: str = "plain",
) -> dict:
    common = dict(
        BLOCK_P=triton.next_power_of_2(P),
        BLOCK_R=triton.next_power_of_2(R),
        BLOCK_LC=min(512, triton.next_power_of_2(L)),
    )
    lmax = triton.next_power_of_2(L)
    if backend == "interpreter":
        half = max(16, lmax // 2)
        return dict(
            common,
            BLOCK_L=half,
            BLOCK_T=16,
            BLOCK_LC=half,
            ROPE_ROWS=16,
            CACHE_ROWS=2,
            num_warps=1,
            num_stages=1,
            programs_per_sm=3.0,
        )
    bucket = "small" if small else "large" if large else "medium"
    key = (H <= 32, bucket)
    # a format without tiles of its own takes its weights' format's (fp8xfp8 -> fp8), then any
    table = _ROCM_TILES if backend == "rocm" else _CUDA_TILES
    tiles = (
        table.get((*key, w_format))
        or table.get((*key, _WEIGHTS_OF.get(w_format, w_format)))
        or table[(*key, None)]
    )
    bl, bt, nw, ns, pps, rr, cr = tiles
    return dict(
        common,
        BLOCK_L=min(bl, lmax),
        BLOCK_T=bt,
        num_warps=nw,
        num_stages=ns,
        programs_per_sm=pps,
        ROPE_ROWS=rr,
        CACHE_ROWS=cr,
    )


def launch_config(
    H: int,
    P: int,
    R: int,
    L: int,
    backend: str,
    small: bool = False,
    *,
    large: bool = False,
    w_format: str = "plain",
) -> dict:
    """Tile sizes for one model shape on one backend ("cuda", "rocm" or "interpreter").

    ``small`` / ``large``: the decode batch's bucket (:func:`batch_bucket`; neither: medium),
    ``w_format``: "plain", "fp8", "fp8xfp8" (FP8 weights, ``act_quant="fp8"``) or "mxfp4".
    Keyed on these and the model dims only, never on
    the token count, so a serving loop compiles at most three variants per weight format.
    ``programs_per_sm``: BMM programs per multiprocessor when the work items outnumber them
    (persistent programs); 0 = one program per item. The CUDA values are the best of sweeps
    on an H200; ROCm uses them until measured there, except where they would not fit an
    AMD chip's LDS (``_ROCM_TILES``)."""
    if backend not in ("cuda", "rocm", "interpreter"):
        raise ValueError(f"backend: expected 'cuda', 'rocm' or 'interpreter', got {backend!r}")
    if small and large:
        raise ValueError("launch_config: a batch cannot be both small and large")
    cfg = dict(_base_config(H, P, R, L, backend, small, large, w_format))
    cfg.update(_overrides)
    return cfg


def tiles(
    H: int, P: int, R: int, L: int, num_decode_tokens: int, backend: str, tile_format: str
) -> tuple[str, dict]:
    """``(bucket, tiles)`` for a batch of ``num_decode_tokens`` decode tokens: the one place
    the batch's bucket picks its tiles (the launcher's plan and every benchmark call it).
    ``tile_format``: "plain", "fp8", "fp8xfp8" or "mxfp4"."""
    bucket = batch_bucket(num_decode_tokens)
    cfg = launch_config(
        H, P, R, L, backend, bucket == "small", large=bucket == "large", w_format=tile_format
    )
    return bucket, cfg


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
