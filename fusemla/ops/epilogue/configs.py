"""Tiles of the epilogue kernel: per backend and batch bucket, the one place that picks them.

``SPLIT`` (default 1) cuts each item's latent into that many programs whose partial sums meet
in a workspace (the last to arrive adds them in order: deterministic); the table picks it for
FP8 outputs of few items (:data:`_FP8_OUT_FEW`). For an FP8 output a ``BLOCK_V`` below the
group cuts each group among ``GROUP / BLOCK_V`` programs that meet the same way; only the
GEMV rule picks that (:data:`_GEMV_FEW`: 1-2 tokens at 16 heads; with the MMA's tiles the
d1a0cb0 sweep found it never faster than SPLIT alone); benchmarks sweep both with ``cfg``.
Keyed on the output kind (bf16 / FP8 with its group), the weight's block rows, one of three
batch buckets and, on a GPU, whether the launch has few (token tile, V tile, head) items
(:data:`_FP8_OUT_FEW`, :data:`_BF16_OUT_FEW`: at 16 heads the buckets' tiles leave most of the
GPU idle), never the token count itself, so a serving loop compiles a handful of variants per
format. Under the Triton interpreter the tiles are deliberately small (16-token tiles, 32-wide
V tiles, 32-row latent chunks), so CPU tests run several V tiles, token tiles and chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import triton

#: token counts up to this use the small-batch tiles (in between: medium)
SMALL_BATCH = 16
#: token counts of at least this use the large-batch tiles
LARGE_BATCH = 128

#: (BLOCK_T, BLOCK_V, BLOCK_K, num_warps, num_stages) per bucket on CUDA (ROCm until measured),
#: for an output in the activations' dtype; the best of the H200 sweep at ec98a0e
#: (benchmarks/results/h200_epilogue_ec98a0e.json) where it measured the bucket
_GPU_TILES = {
    "small": (16, 32, 128, 4, 3),
    "medium": (32, 128, 64, 4, 3),
    "large": (64, 128, 64, 8, 3),
}
#: the same for an FP8 output, whose V tile holds a whole group (BLOCK_V widened to it)
_GPU_TILES_FP8 = {
    "small": (16, 128, 128, 8, 3),
    "medium": (16, 128, 128, 8, 3),
    "large": (64, 128, 128, 8, 3),
}
#: An FP8 output's launch of few (token tile, V tile, head) items on a GPU: per weight bytes
#: per element, rules ``(most items, SPLIT, num_stages or None)``, the first whose bound holds
#: applies: SPLIT cuts each item's latent in that many programs (fewer where the latent has
#: fewer chunks), num_stages replaces the bucket's. From the H200 sweeps of 16 heads (16, 32,
#: 64 items at B = 1, 32, 64; h200_epilogue_split_{d1a0cb0,de9c208}.json, FP8 out, weights
#: streamed from HBM), us per launch, the bucket's tiles -> the rule's:
#:
#: - bf16 W_UV: 16 items 5.75 -> 5.11 (SPLIT 4); 32 items 5.62 -> 5.27, 64 items 7.73 -> 5.29
#:   (5 stages; SPLIT 4 there: 5.71)
#: - block-FP8 W_UV: 16 items 6.58 -> 5.08, 32 items 6.80 -> 5.40, 64 items 9.53 -> 5.63
#:   (SPLIT 4)
#:
#: The large bucket's 64-token tiles were not swept: they keep the table's. At 128 heads (256
#: items at B = 32, 512 at B = 64) the bucket's tiles stay: 5 stages were
#: slower there (bf16 W_UV 11.54 -> 13.79 and 17.74 -> 24.17 us; block-FP8 W_UV 12.27 -> 10.68
#: at B = 32 but 15.71 -> 18.66 at B = 64); SPLIT was not swept above 64 items.
_FP8_OUT_FEW = {1: ((64, 4, None),), 2: ((16, 4, None), (64, 1, 5))}
#: A bf16 output's launch of few items in the medium bucket on a GPU: ``(most items at the
#: bucket's tiles, the tiles instead)``: 16-token tiles and 64-wide V tiles, 8 programs per head
#: and 32 tokens where the bucket's 32 x 128 tiles give one. From the H200 sweep of 16 heads
#: at a85ce66 (bf16 W_UV, h200_epilogue_bf16_split{,2}_a85ce66.json), us per launch, the
#: bucket's tiles -> these: B = 32 6.69 -> 5.01, B = 64 6.78 -> 5.12 (the sweep's best, 4.71
#: at B = 32, splits 32-wide V tiles' latent in 4: within its noise, and a workspace more).
#: The small bucket keeps its tiles (B = 16: 4.89 against 5.01), as do 128 heads (128 items
#: at B = 32), ROCm and the interpreter: not measured.
_BF16_OUT_FEW = (32, (16, 64, 128, 4, 3))
#: Launches of a few tokens on CUDA that take the GEMV variant (the CUDA cores' products, token
#: tiles of fewer rows than the MMA's 16): per (FP8 output, weight bytes per element), entries
#: ``(most tokens, most heads, (BLOCK_T, BLOCK_V, BLOCK_K, num_warps, num_stages, SPLIT))``,
#: the first whose bounds hold applies; ``BLOCK_T`` 1 is one token per program (each re-reads
#: its W_UV tile, from L2 after the first); a tile of more rows takes them in turn
#: (``GEMV_ROWS``: the only multi-row form the table holds, faster than the tile's joint
#: product in each H200 row that timed both: B = 4, bf16 output, 3.46 vs 4.07 us with bf16
#: W_UV, 3.16 vs 3.83 with block-FP8); an FP8 output's group wider than BLOCK_V is cut among
#: GROUP / BLOCK_V programs that meet, as SPLIT's do. Where it was measured only: 16 heads, us
#: per launch, the sweep's best against the bucket's MMA tiles in the same run, each config
#: checked before it was timed.
#:
#: One token, on the H200 (h200_epilogue_gemv_315c4d2.json, 36 configs per row):
#:
#: - bf16 output, bf16 W_UV: 2.94 (BLOCK_V 32, whole latent, 4 warps) against 2.91 at ef4201d
#:   and the MMA tiles' 3.49-4.67 in three earlier leases; cuBLAS's bmm 3.87.
#: - FP8 output, bf16 W_UV: 4.02 (BLOCK_V 32, whole latent, 8 warps) against the tables' 5.05;
#:   bmm + quant 5.39.
#: - FP8 output, block-FP8 W_UV: 3.23 (BLOCK_V 32, 128-row chunks, 8 warps, SPLIT 2; the next
#:   configs 3.64-3.79) against the tables' 4.78.
#:
#: Timed again as the table's pick at 0c16056 (h200_epilogue_rows_0c16056.json): 2.94, 4.40,
#: 3.63 us against cuBLAS's 3.88 and bmm + quant 5.40.
#:
#: Two and eight tokens, first on an H100 (the ``tokens`` grid, 26-34 configs per row;
#: h100_epilogue_tokens{,8}_c7061be.json): one token per program won in every kind measured,
#: BLOCK_V 32 with the whole latent at two tokens, a whole group (BLOCK_V 128) at eight; the
#: best multi-row tile (half or all of the launch's tokens, either form) was 0.1-1.1 us slower:
#:
#: - bf16 output, bf16 W_UV: B = 2 3.04 (8 warps; 4 warps 3.23) against the MMA tiles' 4.66;
#:   B = 8 4.60 against 4.80 (cuBLAS 3.97 / 4.01).
#: - bf16 output, block-FP8 W_UV: B = 2 2.75 against 4.61 (B = 8 not swept).
#: - FP8 output, bf16 W_UV: B = 2 4.50 (4 warps) against 5.20; B = 8 5.27 against 5.35 (bmm +
#:   quant 5.58 / 5.73).
#: - FP8 output, block-FP8 W_UV: B = 2 3.95 against 4.83; B = 8 4.36 against 4.96.
#:
#: Then on the H200 at 8091179 (h200_epilogue_tokens{,8}_8091179.json: B = 2, 4 with bf16
#: outputs, 8; 26-42 configs per row), against the entries above as the table's pick in the
#: same lease: at two tokens and eight they hold (the best within 0.17 us of the pick, except
#: below); what changed:
#:
#: - bf16 output, bf16 W_UV: B = 4 3.46 (two-row tiles in turn, BLOCK_V 32, 4 warps) against
#:   the eight tokens' config's 4.75 (cuBLAS 3.81). B = 8: the MMA's 16-token tile 4.74 against
#:   4.82, a tie: the entry stays.
#: - bf16 output, block-FP8 W_UV: B = 4 3.16 (two-row tiles in turn, 8 warps) against the MMA
#:   tiles' 4.63; B = 8 3.65 (one token per program, a whole group, 8 warps; 16 warps 3.65)
#:   against 4.70 (cuBLAS 3.81 / 3.87).
#:
#: Not timed, between two measured points: 3 tokens (four's config), 5-7 (eight's); with an
#: FP8 output, 3-7 (eight's, where two and eight agree). Not measured, so the bucket's tiles
#: stay: more than eight tokens, more than 16 heads (128 heads: 512 items at BLOCK_V 32), ROCm,
#: the interpreter.
_GEMV_FEW = {
    (False, 2): (
        (1, 16, (1, 32, 512, 4, 1, 1)),
        (2, 16, (1, 32, 512, 8, 1, 1)),
        (4, 16, (2, 32, 512, 4, 1, 1)),
        (8, 16, (1, 128, 512, 8, 1, 1)),
    ),
    (False, 1): (
        (2, 16, (1, 32, 512, 8, 1, 1)),
        (4, 16, (2, 32, 512, 8, 1, 1)),
        (8, 16, (1, 128, 512, 8, 1, 1)),
    ),
    (True, 2): (
        (1, 16, (1, 32, 512, 8, 1, 1)),
        (2, 16, (1, 32, 512, 4, 1, 1)),
        (8, 16, (1, 128, 512, 8, 1, 1)),
    ),
    (True, 1): (
        (1, 16, (1, 32, 128, 8, 1, 2)),
        (2, 16, (1, 32, 512, 8, 1, 1)),
        (8, 16, (1, 128, 512, 8, 1, 1)),
    ),
}
_INTERPRETER_TILES = (16, 32, 32, 1, 1)

#: the decode token counts at which the fused epilogue is the faster choice in vLLM, per
#: output kind, W_UV format and head count: (fp8 output, block-FP8 W_UV, heads up to) -> spans,
#: each an inclusive ``(lo, hi)`` (``()``: nowhere); on other step sizes an engine keeps its own
#: W_UV bmm (+ o_proj's input quantization for an FP8 output). Heads between two entries take
#: the larger head count's entry. From the engine's own profile (``benchmarks/vllm_depth.py
#: kernels``: the epilogue's time per layer against the W_UV bmm + the quantization it
#: replaces), not from the kernel benchmark, whose baseline differs from what vLLM runs (at
#: 8 tokens the two disagree in sign, below):
#:
#: - 16 heads, FP8 out, block-FP8 W_UV (``FUSEMLA_VLLM_W_UK=stored``): the fused kernel is
#:   faster at 1, 16 and 32 tokens: 3.18-3.24 us against bmm 3.42-3.57 + quant 2.07-2.09 at
#:   B = 1, 4.83 against 3.58 + 2.05 at B = 16, 5.02 against 3.87 + 2.38 at B = 32 (H100, vLLM
#:   0.33, the tp8pp2 shard, full graphs, two engine orders;
#:   benchmarks/results/h100_vllm033_depth_tp8pp2_ead800d.json); on the H200 at full depth
#:   with this range, 3.22 against 3.33 + 2.10 at B = 1 and 4.99 against 3.93 + 2.38 at B = 32
#:   (benchmarks/results/h200_vllm033_depth_tp8_212ba2a.json); at e5c4f82 (H100, tp8pp2) 3.22,
#:   4.24 and 5.10 us against 3.40 + 1.83, 3.55 + 2.13 and 3.93 + 2.28 at B = 1, 8 and 32
#:   (benchmarks/results/h100_vllm033_depth_tp8pp2_e5c4f82.json). Above 32 not measured in the
#:   engine: the H200 kernel benchmark put B = 64 slower (6.41 vs 6.11 us, 26b0b51).
#: - 16 heads, FP8 out, vLLM's bf16 W_UV: one token from 4698b24's engines (H100, tp8pp2):
#:   3.74 us a layer against bmm 3.40 + quant 2.22, the decode step 3.808 (3.789-3.814) ms
#:   against the prologue alone's 3.868 (3.843-3.939); at 8 tokens not: 5.94 against 3.53 +
#:   2.20, the step within the repeats' spread (6.809 against 6.804 ms), where the H200 kernel
#:   benchmark had the fused kernel ahead (5.12 vs 5.51 us, 8091179)
#:   (benchmarks/results/h100_vllm033_depth_tp8pp2_4698b24.json); at fa9192d (H100, tp8pp2)
#:   one token again 3.83 against 3.37 + 1.88 (there the decode step 4.049 against 3.927 ms,
#:   repeats overlapping, GPU busy per step equal); at e5c4f82, the epilogue's engine first
#:   (the two before ran it second), 4.00 against 3.40 + 1.80 and the step 3.786 (3.782-3.794)
#:   against 3.844 (3.835-3.861) ms, -1.5 %, repeats apart
#:   (benchmarks/results/h100_vllm033_depth_tp8pp2_e5c4f82.json): faster in two leases of
#:   three, in both engine orders, so the span stays. Not at 32 or 64 tokens (fa9192d, both engine
#:   orders): per layer 6.03 / 6.13 us against bmm 3.92 / 3.89 + quant 2.49 / 2.23 at B = 32,
#:   5.92 / 5.98 against 3.64 / 3.65 + 2.31 / 2.26 at B = 64 (even at best), and the decode
#:   step slower in both orders, +0.6 / +0.7 % at B = 32 (repeats apart), +0.3 % at B = 64
#:   (benchmarks/results/h100_vllm033_depth_tp8pp2_fa9192d.json), as the H200 kernel benchmark
#:   had it (6.62 vs 5.84 us at B = 32, 26b0b51). 9804a32's H200 engine, which put 32-64 in,
#:   ran the kernel before the FP8 output's latent split (de9c208).
#: - 128 heads, and a bf16 output at either: not measured faster in vLLM: nowhere.
_FUSE_TOKENS: dict[tuple[bool, bool, int], tuple[tuple[int, int], ...]] = {
    (True, True, 16): ((1, 32),),
    (True, False, 16): ((1, 1),),
    (True, True, 128): (),
    (True, False, 128): (),
    (False, True, 16): (),
    (False, False, 16): (),
    (False, True, 128): (),
    (False, False, 128): (),
}
_overrides: dict = {}
#: every decode step's token count (the interpreter's, FUSEMLA_VLLM_EPILOGUE_TOKENS=all)
ALL_TOKENS: tuple[tuple[int, int], ...] = ((1, 1 << 62),)


def fuse_token_spans(
    H: int, fp8_out: bool, backend: str, w_fp8: bool = False
) -> tuple[tuple[int, int], ...]:
    """The inclusive ``(lo, hi)`` spans of decode token counts on which the fused epilogue is
    the faster choice against an engine's own W_UV bmm (+ its FP8 input quantization for
    ``fp8_out``) at ``H`` heads on ``backend``, with a block-FP8 W_UV (``w_fp8``: the
    checkpoint's, as stored) or the activations' dtype (:data:`_FUSE_TOKENS`, measured on CUDA;
    ROCm takes CUDA's until measured; the interpreter always fuses: tests). ``()``: no step
    size; test one with :func:`fuses_at`."""
    if backend == "interpreter":
        return ALL_TOKENS
    heads = sorted(h for f, w, h in _FUSE_TOKENS if f == fp8_out and w == w_fp8)
    h = next((x for x in heads if H <= x), heads[-1])
    return _FUSE_TOKENS[(fp8_out, w_fp8, h)]


def fuses_at(tokens: int, spans: tuple[tuple[int, int], ...]) -> bool:
    """Whether a step of ``tokens`` decode tokens lies in one of ``spans``."""
    return any(lo <= tokens <= hi for lo, hi in spans)


def fuses_anywhere(H: int, fp8_out: bool, backend: str) -> bool:
    """Whether :func:`fuse_token_spans` fuses any decode step size at ``H`` heads with either
    W_UV (the activations' dtype or block-FP8 as stored): False where no engine measurement put
    the epilogue ahead (an engine then keeps its own W_UV bmm, and any FP8 handoff to o_proj
    would only add work)."""
    return any(fuse_token_spans(H, fp8_out, backend, w) for w in (False, True))


def describe_spans(spans: tuple[tuple[int, int], ...]) -> str:
    """``"1"``, ``"1-32"``, ``"1+32-64"``, ``"none"``, ``"all"`` (for ``fusemla info`` and logs)."""
    if not spans:
        return "none"
    if tuple(spans) == ALL_TOKENS:
        return "all"
    return "+".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans)


def batch_bucket(N: int) -> str:
    """The tile bucket of ``N`` tokens: "small", "medium" or "large"."""
    return "small" if N <= SMALL_BATCH else "large" if N >= LARGE_BATCH else "medium"


def _pow2_divisor(n: int) -> int:
    return n & -n


#: shared memory (bytes) the pipelined operand buffers may take per program: within an H200's
#: 227 KiB, and an MI300's 64 KiB LDS (gfx950: 160 KiB)
_SMEM_BUDGET = {"cuda": 160 * 1024, "rocm": 60 * 1024}


#: accumulator elements per program a tile may hold (64 x 128: 32 fp32 registers per thread at
#: 4 warps); wider V tiles (large groups) take fewer tokens
_MAX_ACC = 64 * 128


def smem_bytes(cfg: dict, w_bytes: int, fp8_out: bool = False) -> int:
    """The shared memory of a config: ``num_stages - 1`` buffered pairs of an activation
    chunk [BLOCK_T, BLOCK_K] (2 bytes) and a weight chunk [BLOCK_K, BLOCK_V], and for an FP8
    output the fp32 accumulator's layout change for the per-group reduction."""
    bt, bv, bk = cfg["BLOCK_T"], cfg["BLOCK_V"], cfg["BLOCK_K"]
    buffers = max(1, cfg["num_stages"] - 1) * (bt * bk * 2 + bk * bv * w_bytes)
    return buffers + (bt * bv * 4 if fp8_out else 0)


def _fit(tiles_: tuple, L: int, V: int, group: int | None, block_k: int | None) -> tuple:
    """A table's ``(BLOCK_T, BLOCK_V, BLOCK_K, num_warps, num_stages)`` fitted to the shape: a
    V tile no wider than V (rounded up to a power of two) but holding whole FP8 groups, a
    latent chunk no longer than L and inside one block of scale rows, at most
    :data:`_MAX_ACC` accumulator elements."""
    bt, bv, bk, nw, ns = tiles_
    bv = max(16, min(bv, triton.next_power_of_2(V)))
    if group is not None:
        bv = max(bv, group)  # a V tile holds whole groups
    bk = min(bk, max(16, triton.next_power_of_2(L)))
    if block_k is not None:
        bk = min(bk, _pow2_divisor(block_k))  # a chunk lies inside one block of rows
    while bt * bv > _MAX_ACC and bt > 16:
        bt //= 2
    return bt, bv, bk, nw, ns


def _dividing_split(split: int, L: int, block_k: int) -> int:
    """The largest power of two up to ``split`` that divides the latent's ``BLOCK_K`` chunks."""
    n_chunks = triton.cdiv(L, block_k)
    while n_chunks % split:
        split //= 2
    return split


def few_items_rule(
    items: int, w_bytes: int, fp8_out: bool, backend: str, bucket: str
) -> tuple[int, int | None]:
    """``(SPLIT, num_stages or None)`` of :data:`_FP8_OUT_FEW` for a launch of ``items`` items
    on CUDA in the small or medium bucket (the 16-token tiles the H200 sweeps measured);
    ``(1, None)`` (the bucket's tiles) elsewhere: ROCm (whose LDS would cut the 5 stages'
    latent chunks: not measured), the large bucket, the interpreter."""
    if fp8_out and backend == "cuda" and bucket in ("small", "medium"):
        for most, split, stages in _FP8_OUT_FEW.get(w_bytes, ()):
            if items <= most:
                return split, stages
    return 1, None


def gemv_rule(
    N: int, H: int, L: int, V: int, w_bytes: int, fp8_out: bool, backend: str
) -> dict | None:
    """The GEMV tiles of :data:`_GEMV_FEW` for ``N`` tokens at ``H`` heads on CUDA (fitted to
    L and V as the tables are), or None: the bucket's tiles."""
    entries = _GEMV_FEW.get((fp8_out, w_bytes), ()) if backend == "cuda" else ()
    for most_tokens, most_heads, (*tiles_, split) in entries:
        if N <= most_tokens and H <= most_heads:
            bt, bv, bk, nw, ns = _fit(tuple(tiles_), L, V, None, None)
            split = _dividing_split(split, L, bk)  # a latent shorter than the rule's: fewer
            cfg = dict(BLOCK_T=bt, BLOCK_V=bv, BLOCK_K=bk, num_warps=nw, num_stages=ns)
            cfg = dict(cfg, SPLIT=split, GEMV=True)
            return dict(cfg, GEMV_ROWS=True) if bt > 1 else cfg  # a multi-row tile: in turn
    return None


def tiles(
    L: int,
    V: int,
    N: int,
    backend: str,
    *,
    group: int | None,
    block_k: int | None,
    w_bytes: int = 2,
    H: int = 1,
    rules: bool = True,
) -> tuple[str, dict]:
    """``(bucket, tiles)`` for ``N`` tokens at ``H`` heads: ``group`` the FP8 output's group
    (None: not FP8), ``block_k`` the weight's block-scale rows along L (None: no block scales),
    ``w_bytes`` the weight's bytes per element. A wide V tile (a large group) takes fewer
    tokens, then shorter latent chunks, then fewer pipeline stages, until it fits the
    backend's shared memory; :func:`few_items_rule` picks SPLIT (and the stages) of a launch of
    few items. :func:`gemv_rule` picks the GEMV variant for a launch of a few tokens, unless
    ``rules`` is False or :func:`override` holds keys (explicit tiles then replace keys of the
    MMA tables' pick)."""
    if backend not in ("cuda", "rocm", "interpreter"):
        raise ValueError(f"backend: expected 'cuda', 'rocm' or 'interpreter', got {backend!r}")
    bucket = batch_bucket(N)
    # explicit tiles (``rules=False``, :func:`override`) replace keys of the MMA tables' pick,
    # as before the GEMV rule: a sweep's config names the variant it measures
    use_rules = rules and not _overrides
    gemv = gemv_rule(N, H, L, V, w_bytes, group is not None, backend) if use_rules else None
    if gemv is not None:
        check(gemv, group=group, block_k=block_k)
        return bucket, gemv
    table = _GPU_TILES_FP8 if group is not None else _GPU_TILES
    tiles_ = _INTERPRETER_TILES if backend == "interpreter" else table[bucket]
    bt, bv, bk, nw, ns = _fit(tiles_, L, V, group, block_k)
    items = triton.cdiv(N, bt) * triton.cdiv(V, bv) * H
    most, few = _BF16_OUT_FEW
    if group is None and backend == "cuda" and bucket == "medium" and items <= most:
        bt, bv, bk, nw, ns = _fit(few, L, V, group, block_k)
        items = triton.cdiv(N, bt) * triton.cdiv(V, bv) * H
    split, stages = few_items_rule(items, w_bytes, group is not None, backend, bucket)
    cfg = dict(BLOCK_T=bt, BLOCK_V=bv, BLOCK_K=bk, num_warps=nw, num_stages=stages or ns)
    budget = _SMEM_BUDGET.get(backend)
    while budget is not None and smem_bytes(cfg, w_bytes, group is not None) > budget:
        if cfg["BLOCK_K"] > 32:
            cfg["BLOCK_K"] //= 2
        elif cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif cfg["BLOCK_K"] > 16:
            cfg["BLOCK_K"] //= 2
        else:
            break
    cfg["SPLIT"] = _dividing_split(split, L, cfg["BLOCK_K"])
    cfg.update(_overrides)
    check(cfg, group=group, block_k=block_k)
    return bucket, cfg


def check(cfg: dict, *, group: int | None, block_k: int | None) -> None:
    """Raise ValueError for tiles the kernel cannot run: every tile a power of two >= 16 (so
    a V tile holds whole FP8 groups, or is a whole fraction of one: its GROUP / BLOCK_V tiles
    then meet in a workspace, as SPLIT's do), a latent chunk inside one block of scale rows.
    With ``GEMV`` (the CUDA cores' products: no MMA shape; block scales applied before the
    products) a token tile may be any power of two and a chunk may span blocks; ``GEMV_ROWS``
    (its tile's tokens one at a time) only with it."""
    gemv = cfg.get("GEMV", False)
    if not isinstance(gemv, bool):
        raise ValueError(f"GEMV: expected a bool, got {gemv!r}")
    rows = cfg.get("GEMV_ROWS", False)
    if not isinstance(rows, bool):
        raise ValueError(f"GEMV_ROWS: expected a bool, got {rows!r}")
    if rows and not gemv:
        raise ValueError("GEMV_ROWS (a token tile's rows in turn) is a form of GEMV: set GEMV too")
    for k in ("BLOCK_T", "BLOCK_V", "BLOCK_K"):
        v, least = cfg[k], 1 if gemv and k == "BLOCK_T" else 16
        if not isinstance(v, int) or v < least or v & (v - 1):
            raise ValueError(f"{k}: expected a power of two >= {least}, got {v!r}")
    if block_k is not None and block_k % cfg["BLOCK_K"] and not gemv:
        raise ValueError(f"BLOCK_K={cfg['BLOCK_K']} straddles the weight's {block_k}-row blocks")
    split = cfg.get("SPLIT", 1)
    if not isinstance(split, int) or split < 1 or split & (split - 1):
        raise ValueError(f"SPLIT: expected a power of two >= 1, got {split!r}")


@contextlib.contextmanager
def override(**keys: Any) -> Iterator[None]:
    """Replace tile keys for a block of code (benchmarks' sweeps, tests)."""
    old = dict(_overrides)
    _overrides.update(keys)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(old)
