"""Tests of fusemla.metadata (BatchMetadata: checks, decode / prefill views) and of the toy
scheduler that builds it (fusemla.testing.scheduler: block allocator, batch builder).

Every slot, position and block-table entry, and every view, is checked against values computed
here from the allocator's block lists, and a simulated multi-step run writes token ids into a
fake cache through ``slot_mapping`` and reads them back through ``block_table`` / ``seq_lens``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch

from fusemla.errors import FuseMLAError, FuseMLATypeError, FuseMLAValueError
from fusemla.metadata import PADDING_SLOT, BatchMetadata
from fusemla.testing.scheduler import (
    PADDING_ROW,
    BlockAllocator,
    RequestStep,
    Scheduler,
    build_metadata,
    token_request_index,
)

BLOCK_SIZES = (1, 16, 64)


def _randint(gen: torch.Generator, low: int, high: int) -> int:
    """A uniform int in [low, high] from ``gen``."""
    return int(torch.randint(low, high + 1, (1,), generator=gen))


def _random_steps(
    gen: torch.Generator, num_reqs: int, block_size: int, tag: str
) -> list[RequestStep]:
    """A random mix of decodes, fresh prefills and chunked prefills (contexts of a few blocks)."""
    steps = []
    for i in range(num_reqs):
        kind = _randint(gen, 0, 2)
        ctx = _randint(gen, 1, 3 * block_size + 2)
        if kind == 0:
            steps.append(RequestStep(f"{tag}{i}", ctx, 1))
        elif kind == 1:
            steps.append(RequestStep(f"{tag}{i}", 0, _randint(gen, 1, 2 * block_size + 3)))
        else:
            steps.append(RequestStep(f"{tag}{i}", ctx, _randint(gen, 2, block_size + 5)))
    return steps


def _expect_decode(s: RequestStep) -> bool:
    return s.is_decode if s.is_decode is not None else (s.num_new_tokens == 1 and s.context_len > 0)


def _check_against_allocator(
    md: BatchMetadata, order: list[int], steps: list[RequestStep], alloc: BlockAllocator
) -> None:
    """Check every field of ``md`` against values recomputed from the allocator's block lists."""
    bs = alloc.block_size
    assert md.block_size == bs
    assert len(order) == md.num_reqs
    real_rows = [i for i in order if i != PADDING_ROW]
    assert sorted(real_rows) == list(range(len(steps)))
    qsl = md.query_start_loc.tolist()
    assert tuple(qsl) == md.query_start_loc_cpu
    assert tuple(md.seq_lens.tolist()) == md.seq_lens_cpu
    bt = md.block_table.tolist()
    assert tuple(tuple(r) for r in bt) == md.block_table_cpu
    slots = md.slot_mapping.tolist()
    positions = md.positions.tolist()
    assert len(slots) == len(positions) == md.num_tokens == qsl[-1]
    assert md.block_table.shape[1] * bs >= md.max_seq_len
    for row, i in enumerate(order):
        lo, hi = qsl[row], qsl[row + 1]
        if i == PADDING_ROW:
            assert row < md.num_decodes
            assert hi - lo == 1 and md.seq_lens_cpu[row] == 0
            assert slots[lo] == PADDING_SLOT and positions[lo] == 0
            assert bt[row] == [0] * len(bt[row])
            continue
        s = steps[i]
        blocks = alloc.blocks_of(s.request_id)
        seq_len = s.context_len + s.num_new_tokens
        assert hi - lo == s.num_new_tokens
        assert md.seq_lens_cpu[row] == seq_len
        assert md.context_lens_cpu[row] == s.context_len
        n_used = math.ceil(seq_len / bs)
        assert len(blocks) >= n_used
        assert bt[row][:n_used] == blocks[:n_used]
        assert all(b == 0 for b in bt[row][n_used:])
        for j in range(s.num_new_tokens):
            pos = s.context_len + j
            assert positions[lo + j] == pos
            assert slots[lo + j] == blocks[pos // bs] * bs + pos % bs
    # Decode-first, stable.
    dec = [i for i, s in enumerate(steps) if _expect_decode(s)]
    pre = [i for i, s in enumerate(steps) if not _expect_decode(s)]
    assert [i for i in order[: md.num_decodes] if i != PADDING_ROW] == dec
    assert order[md.num_decodes :] == pre
    assert md.num_decodes == md.num_decode_tokens == len(order) - len(pre)
    assert md.num_prefills == len(pre)
    # Slots written this step never collide and lie in the cache.
    real = [x for x in slots if x != PADDING_SLOT]
    assert len(set(real)) == len(real)
    assert all(0 <= x < alloc.num_slots for x in real)
    _check_views(md)


def _check_views(md: BatchMetadata) -> None:
    """The decode / prefill views hold exactly their part of every field (values and storage)."""
    nd, D, N = md.num_decodes, md.num_decode_tokens, md.num_tokens
    bt, qsl, bs = md.block_table.tolist(), md.query_start_loc_cpu, md.block_size
    parts = ((md.decode, 0, nd, 0, D), (md.prefill, nd, md.num_reqs, D, N))
    for view, r0, r1, t0, t1 in parts:
        if r0 == r1:
            assert view is None
            continue
        assert view.num_tokens == t1 - t0
        assert view.block_table.tolist() == bt[r0:r1]
        assert view.seq_lens.tolist() == list(md.seq_lens_cpu[r0:r1])
        assert view.slot_mapping.tolist() == md.slot_mapping.tolist()[t0:t1]
        assert view.positions.tolist() == md.positions.tolist()[t0:t1]
        for name in ("block_table", "seq_lens", "slot_mapping", "positions"):
            assert getattr(view, name).untyped_storage().data_ptr() == (
                getattr(md, name).untyped_storage().data_ptr()
            ), name  # a view, not a copy
    if md.prefill is not None:
        assert md.prefill.token_start == D
        assert len(md.prefill.requests) == md.num_prefills
        for r, rq in zip(range(nd, md.num_reqs), md.prefill.requests, strict=True):
            assert (rq.start + D, rq.end + D, rq.seq_len) == (
                qsl[r],
                qsl[r + 1],
                md.seq_lens_cpu[r],
            )
            assert rq.num_tokens == qsl[r + 1] - qsl[r]
            assert rq.context_len == md.context_lens_cpu[r]
            assert rq.block_table.tolist() == [bt[r][: math.ceil(rq.seq_len / bs)]]


def _check_disjoint(alloc: BlockAllocator, ids) -> None:
    """Different live requests own disjoint blocks; owned + free = all blocks."""
    owned = [b for rid in ids for b in alloc.blocks_of(rid)]
    assert len(set(owned)) == len(owned)
    assert len(owned) + alloc.num_free == alloc.num_blocks


# ----------------------------------------------------------------------------- builder


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_build_random_batches(block_size, seed):
    gen = torch.Generator().manual_seed(1000 * block_size + seed)
    alloc = BlockAllocator(4096 // block_size + 64, block_size, seed=seed)
    for batch in range(4):
        steps = _random_steps(gen, _randint(gen, 1, 9), block_size, tag=f"b{batch}-")
        pad = None
        if batch % 2:
            n_dec = sum(_expect_decode(s) for s in steps)
            pad = n_dec + _randint(gen, 0, 3)
        md, order = build_metadata(steps, alloc, pad_decodes_to=pad)
        _check_against_allocator(md, order, steps, alloc)
        md.validate(num_slots=alloc.num_slots)
    _check_disjoint(
        alloc, [f"b{b}-{i}" for b in range(4) for i in range(9) if alloc.blocks_of(f"b{b}-{i}")]
    )


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_multi_step_run_through_a_fake_cache(block_size):
    """Write token ids through slot_mapping, read each request back through block_table."""
    gen = torch.Generator().manual_seed(7 + block_size)
    num_blocks = 2048 // block_size + 8
    alloc = BlockAllocator(num_blocks, block_size, seed=block_size)
    cache = torch.full((num_blocks * block_size,), -1, dtype=torch.int64)
    live: dict[str, int] = {}  # request id -> tokens in the cache
    prompt: dict[str, int] = {}  # request id -> prompt length
    next_id = 0
    for step_no in range(12):
        # Finish some requests, admit some new ones.
        for rid in list(live):
            if live[rid] >= prompt[rid] and _randint(gen, 0, 3) == 0:
                alloc.free(rid)
                del live[rid], prompt[rid]
        for _ in range(_randint(gen, 0, 3)):
            rid = f"r{next_id}"
            next_id += 1
            live[rid] = 0
            prompt[rid] = _randint(gen, 1, 3 * block_size + 1)
        steps = []
        for rid, n in live.items():
            if n < prompt[rid]:  # (chunked) prefill
                steps.append(
                    RequestStep(rid, n, min(prompt[rid] - n, _randint(gen, 1, 40)), is_decode=False)
                )
            else:
                steps.append(RequestStep(rid, n, 1, is_decode=True))
        pad = sum(s.is_decode for s in steps) + (step_no % 3)
        md, order = build_metadata(steps, alloc, pad_decodes_to=pad)
        _check_against_allocator(md, order, steps, alloc)
        _check_disjoint(alloc, live)

        # The "kernel": token (rid, pos) writes value id * 100000 + pos into its slot.
        rows = token_request_index(md).tolist()
        values = []
        for t, row in enumerate(rows):
            i = order[row]
            rid_num = -7 if i == PADDING_ROW else int(steps[i].request_id[1:])
            values.append(rid_num * 100000 + md.positions[t].item())
        values = torch.tensor(values, dtype=torch.int64)
        before = cache.clone()
        keep = md.slot_mapping >= 0
        cache[md.slot_mapping[keep]] = values[keep]
        assert (cache != before).sum() <= int(keep.sum())
        assert not (cache == -7 * 100000).any()  # padding wrote nothing

        # The "attention": every request reads back its whole sequence through the block table.
        for row, i in enumerate(order):
            if i == PADDING_ROW:
                continue
            s = steps[i]
            seq_len = md.seq_lens_cpu[row]
            pos = torch.arange(seq_len)
            slot = md.block_table[row, pos // block_size].long() * block_size + pos % block_size
            want = int(s.request_id[1:]) * 100000 + pos
            assert torch.equal(cache[slot], want), (step_no, s)
            live[s.request_id] = seq_len


def test_decode_first_stable_order():
    alloc = BlockAllocator(64, 4, seed=3)
    steps = [
        RequestStep("p0", 0, 5),  # prefill (fresh)
        RequestStep("d0", 7, 1),  # decode (default rule)
        RequestStep("p1", 3, 4),  # chunked prefill
        RequestStep("d1", 1, 1),  # decode
        RequestStep("p2", 0, 1),  # one-token prompt: prefill by the default rule
        RequestStep("p3", 9, 1, is_decode=False),  # forced prefill
        RequestStep("d2", 0, 1, is_decode=True),  # forced decode
    ]
    md, order = build_metadata(steps, alloc)
    assert order == [1, 3, 6, 0, 2, 4, 5]
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (3, 3, 4)
    assert md.num_prefill_tokens == 5 + 4 + 1 + 1
    assert md.query_start_loc_cpu == (0, 1, 2, 3, 8, 12, 13, 14)
    assert md.seq_lens_cpu == (8, 2, 1, 5, 7, 1, 10)
    assert md.context_lens_cpu == (7, 1, 0, 0, 3, 0, 9)
    assert md.query_lens_cpu == (1, 1, 1, 5, 4, 1, 1)
    assert md.max_seq_len == 10 and md.num_tokens == 14 and md.num_reqs == 7
    assert md.block_table.shape == (7, 3)
    _check_against_allocator(md, order, steps, alloc)


def test_padding_rows():
    alloc = BlockAllocator(32, 16, seed=0)
    steps = [RequestStep("a", 0, 20), RequestStep("b", 30, 1), RequestStep("c", 4, 1)]
    md, order = build_metadata(steps, alloc, pad_decodes_to=4)
    assert order == [1, 2, PADDING_ROW, PADDING_ROW, 0]
    assert md.num_decodes == md.num_decode_tokens == 4
    assert md.num_prefills == 1 and md.num_prefill_tokens == 20
    assert md.seq_lens_cpu == (31, 5, 0, 0, 20)
    assert md.slot_mapping[2:4].tolist() == [PADDING_SLOT] * 2
    assert md.positions[2:4].tolist() == [0, 0]
    assert md.block_table[2:4].tolist() == [[0, 0], [0, 0]]
    assert md.context_lens_cpu[2:4] == (0, 0)
    assert alloc.blocks_of(PADDING_ROW) == []  # padding allocates nothing
    _check_against_allocator(md, order, steps, alloc)


def test_only_padding_and_empty_batches():
    alloc = BlockAllocator(4, 16)
    md, order = build_metadata([], alloc, pad_decodes_to=3)
    assert order == [PADDING_ROW] * 3
    assert md.num_tokens == 3 and md.max_seq_len == 0 and md.block_table.shape == (3, 1)
    assert md.slot_mapping.tolist() == [PADDING_SLOT] * 3
    md, order = build_metadata([], alloc)
    assert order == [] and md.num_tokens == 0 and md.num_reqs == 0 and md.max_seq_len == 0
    assert md.query_start_loc_cpu == (0,) and md.block_table.shape == (0, 1)
    assert token_request_index(md).shape == (0,)
    assert alloc.num_free == 4


def test_pad_decodes_to_exact_and_too_small():
    alloc = BlockAllocator(16, 4)
    steps = [RequestStep("a", 3, 1), RequestStep("b", 5, 1)]
    md, order = build_metadata(steps, alloc, pad_decodes_to=2)
    assert order == [0, 1] and md.num_decodes == 2
    free = alloc.num_free
    with pytest.raises(FuseMLAValueError, match="pad_decodes_to"):
        build_metadata([RequestStep("c", 3, 1), *steps], alloc, pad_decodes_to=2)
    assert alloc.num_free == free and alloc.blocks_of("c") == []


def test_max_blocks():
    alloc = BlockAllocator(16, 4)
    steps = [RequestStep("a", 8, 1), RequestStep("b", 0, 3)]  # seq 9 -> 3 blocks
    md, _ = build_metadata(steps, alloc, max_blocks=6)
    assert md.block_table.shape == (2, 6)
    assert md.block_table[0, 3:].tolist() == [0, 0, 0]
    assert md.block_table[1, 1:].tolist() == [0] * 5
    md, _ = build_metadata(steps, alloc)
    assert md.block_table.shape == (2, 3)
    free = alloc.num_free
    with pytest.raises(FuseMLAValueError, match="max_blocks") as e:
        build_metadata([RequestStep("c", 0, 16), *steps], alloc, max_blocks=3)
    assert "got 3" in str(e.value) and ">= 4" in str(e.value)
    assert alloc.num_free == free and alloc.blocks_of("c") == []


def test_block_table_holds_only_the_blocks_in_use():
    """A request owning more blocks than its seq_len needs (reserved ahead) shows only those."""
    alloc = BlockAllocator(16, 4, seed=5)
    reserved = alloc.ensure("a", 30)  # 8 blocks
    steps = [RequestStep("a", 5, 1), RequestStep("b", 0, 2)]
    md, order = build_metadata(steps, alloc)
    assert md.block_table.shape == (2, 2)
    assert md.block_table_cpu[0] == tuple(reserved[:2])
    assert alloc.blocks_of("a") == reserved
    _check_against_allocator(md, order, steps, alloc)
    md, _ = build_metadata(steps, alloc, max_blocks=4)
    assert md.block_table_cpu[0] == (*reserved[:2], 0, 0)


def test_build_is_all_or_nothing_when_out_of_blocks():
    alloc = BlockAllocator(5, 4, seed=9)
    build_metadata([RequestStep("a", 0, 6)], alloc)  # 2 blocks
    snapshot = (alloc.num_free, alloc.blocks_of("a"))
    steps = [RequestStep("a", 6, 3), RequestStep("b", 0, 9)]  # a: +1 block, b: 3 -> 4 > 3 free
    with pytest.raises(FuseMLAValueError, match="out of blocks"):
        build_metadata(steps, alloc)
    assert (alloc.num_free, alloc.blocks_of("a")) == snapshot and alloc.blocks_of("b") == []
    md, order = build_metadata(steps[:1] + [RequestStep("b", 0, 8)], alloc)  # fits exactly
    assert alloc.num_free == 0
    _check_against_allocator(md, order, steps[:1] + [RequestStep("b", 0, 8)], alloc)


def test_build_metadata_argument_errors():
    alloc = BlockAllocator(16, 4)
    with pytest.raises(FuseMLATypeError, match="steps"):
        build_metadata(iter([RequestStep("a", 0, 1)]), alloc)  # not a Sequence
    with pytest.raises(FuseMLATypeError, match=r"steps\[1\]"):
        build_metadata([RequestStep("a", 0, 1), ("b", 0, 1)], alloc)
    with pytest.raises(FuseMLATypeError, match="allocator"):
        build_metadata([], object())
    with pytest.raises(FuseMLAValueError, match=r"steps\[2\].*'a'"):
        build_metadata(
            [RequestStep("a", 0, 1), RequestStep("b", 0, 1), RequestStep("a", 1, 1)], alloc
        )
    with pytest.raises(FuseMLATypeError, match="pad_decodes_to"):
        build_metadata([], alloc, pad_decodes_to=1.0)
    with pytest.raises(FuseMLATypeError, match="max_blocks"):
        build_metadata([], alloc, max_blocks="2")
    assert alloc.num_free == 16


def test_token_request_index():
    alloc = BlockAllocator(64, 16)
    steps = [RequestStep("p", 0, 3), RequestStep("d", 4, 1), RequestStep("q", 2, 2)]
    md, _ = build_metadata(steps, alloc, pad_decodes_to=2)
    idx = token_request_index(md)
    assert idx.dtype == torch.int64 and idx.device == md.device
    assert idx.tolist() == [0, 1, 2, 2, 2, 3, 3]
    assert token_request_index(md.to("meta")).device.type == "meta"
    with pytest.raises(FuseMLATypeError, match="md"):
        token_request_index(md.query_start_loc)


# ----------------------------------------------------------------------------- allocator


def test_allocator_blocks_and_slots():
    alloc = BlockAllocator(8, 4, shuffle=False)
    assert (alloc.num_blocks, alloc.block_size, alloc.num_slots, alloc.num_free) == (8, 4, 32, 8)
    assert alloc.blocks_of("x") == []
    assert alloc.ensure("x", 0) == []
    assert alloc.ensure("x", 5) == [0, 1]
    assert alloc.ensure("x", 8) == [0, 1]  # still fits
    assert alloc.ensure("x", 3) == [0, 1]  # never shrinks
    assert alloc.ensure(("y", 1), 1) == [2]
    assert alloc.num_free == 5
    assert [alloc.slot("x", p) for p in (0, 3, 4, 7)] == [0, 3, 4, 7]
    assert alloc.slot(("y", 1), 2) == 10
    got = alloc.blocks_of("x")
    got.append(99)  # a copy: the allocator is not changed
    assert alloc.blocks_of("x") == [0, 1]
    alloc.free("x")
    assert alloc.num_free == 7 and alloc.blocks_of("x") == []
    assert alloc.ensure("z", 16) == [3, 4, 5, 6]  # FIFO: freed blocks go to the back
    assert alloc.ensure("w", 9) == [7, 0, 1]


def test_allocator_exhaustion_leaves_state_unchanged():
    alloc = BlockAllocator(6, 16, seed=4)
    a = alloc.ensure("a", 40)  # 3 blocks
    alloc.ensure("b", 16)  # 1 block
    with pytest.raises(FuseMLAValueError, match="out of blocks") as e:
        alloc.ensure("c", 33)  # needs 3, 2 free
    assert "num_tokens" in str(e.value) and "2 of 6" in str(e.value)
    with pytest.raises(FuseMLAValueError, match="out of blocks"):
        alloc.ensure("a", 97)  # needs 7 - 3 = 4 more
    assert alloc.num_free == 2 and alloc.blocks_of("a") == a and alloc.blocks_of("c") == []
    assert alloc.ensure("c", 32) != []  # the 2 free blocks are still there
    assert alloc.num_free == 0
    _check_disjoint(alloc, ["a", "b", "c"])


def test_allocator_seed_determinism():
    a = BlockAllocator(16, 1, seed=0)
    b = BlockAllocator(16, 1, seed=0)
    c = BlockAllocator(16, 1, seed=1)
    ba, bb, bc = a.ensure("r", 16), b.ensure("r", 16), c.ensure("r", 16)
    assert ba == bb != bc
    assert sorted(ba) == sorted(bc) == list(range(16))
    # Pinned: random.Random(seed).shuffle is stable across processes, platforms and versions.
    assert ba == [10, 14, 5, 1, 9, 2, 3, 11, 13, 7, 8, 4, 0, 6, 15, 12]
    assert bc == [2, 10, 0, 14, 6, 5, 3, 8, 7, 11, 15, 1, 12, 13, 9, 4]


def test_allocator_seed_determinism_across_processes():
    """Same seed -> same blocks in fresh interpreters, whatever their string-hash seed."""
    code = (
        "from fusemla.testing.scheduler import BlockAllocator, RequestStep, build_metadata\n"
        "a = BlockAllocator(64, 16, seed=5)\n"
        "md, _ = build_metadata([RequestStep('x', 0, 70), RequestStep(('y', 2), 3, 1)], a)\n"
        "print(md.block_table_cpu, md.slot_mapping.tolist())\n"
    )
    outs = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        res = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        outs.add(res.stdout)
    here = BlockAllocator(64, 16, seed=5)
    md, _ = build_metadata([RequestStep("x", 0, 70), RequestStep(("y", 2), 3, 1)], here)
    outs.add(f"{md.block_table_cpu} {md.slot_mapping.tolist()}\n")
    assert len(outs) == 1, outs


@pytest.mark.parametrize(
    "make, exc, arg",
    [
        (lambda: BlockAllocator(0, 16), FuseMLAValueError, "num_blocks"),
        (lambda: BlockAllocator(4.0, 16), FuseMLATypeError, "num_blocks"),
        (lambda: BlockAllocator(4, 0), FuseMLAValueError, "block_size"),
        (lambda: BlockAllocator(4, 16, seed=-1), FuseMLAValueError, "seed"),
        (lambda: BlockAllocator(4, 16, seed="0"), FuseMLATypeError, "seed"),
        (lambda: BlockAllocator(4, 16, shuffle=1), FuseMLATypeError, "shuffle"),
        (lambda: BlockAllocator(4, 16).ensure("a", -1), FuseMLAValueError, "num_tokens"),
        (lambda: BlockAllocator(4, 16).ensure("a", True), FuseMLATypeError, "num_tokens"),
        (lambda: BlockAllocator(4, 16).ensure(["a"], 1), FuseMLATypeError, "request_id"),
        (lambda: BlockAllocator(4, 16).ensure(("a", []), 1), FuseMLATypeError, "request_id"),
        (lambda: BlockAllocator(4, 16).free("a"), FuseMLAValueError, "request_id"),
        (lambda: BlockAllocator(4, 16).slot("a", 0), FuseMLAValueError, "position"),
        (lambda: BlockAllocator(4, 16).slot("a", -1), FuseMLAValueError, "position"),
    ],
)
def test_allocator_errors(make, exc, arg):
    with pytest.raises(exc) as e:
        make()
    assert str(e.value).startswith(f"{arg}:"), str(e.value)
    assert "expected" in str(e.value) or "out of blocks" in str(e.value)


def test_allocator_slot_past_capacity_and_double_free():
    alloc = BlockAllocator(4, 16)
    alloc.ensure("a", 17)
    assert alloc.slot("a", 31) >= 0
    with pytest.raises(FuseMLAValueError, match=r"position: expected < 32.*got 32"):
        alloc.slot("a", 32)
    alloc.free("a")
    with pytest.raises(FuseMLAValueError, match="request_id"):
        alloc.free("a")
    assert alloc.num_free == 4


# ----------------------------------------------------------------------------- RequestStep


@pytest.mark.parametrize(
    "kwargs, exc, arg",
    [
        ({"request_id": ["a"]}, FuseMLATypeError, "request_id"),
        ({"context_len": -1}, FuseMLAValueError, "context_len"),
        ({"context_len": 1.5}, FuseMLATypeError, "context_len"),
        ({"num_new_tokens": 0}, FuseMLAValueError, "num_new_tokens"),
        ({"is_decode": "yes"}, FuseMLATypeError, "is_decode"),
        ({"num_new_tokens": 2, "is_decode": True}, FuseMLAValueError, "num_new_tokens"),
    ],
)
def test_request_step_errors(kwargs, exc, arg):
    base = {"request_id": "a", "context_len": 3, "num_new_tokens": 1}
    with pytest.raises(exc) as e:
        RequestStep(**{**base, **kwargs})
    assert str(e.value).startswith(f"{arg}:") and "expected" in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- BatchMetadata


def _base() -> tuple[BatchMetadata, BlockAllocator]:
    """block_size 4: decode a (seq 6), one padding decode, prefill b (0 + 3), prefill c (2 + 2)."""
    alloc = BlockAllocator(16, 4, seed=11)
    steps = [RequestStep("b", 0, 3), RequestStep("a", 5, 1), RequestStep("c", 2, 2)]
    md, order = build_metadata(steps, alloc, pad_decodes_to=2)
    assert order == [1, PADDING_ROW, 0, 2]
    assert md.query_start_loc_cpu == (0, 1, 2, 5, 7)
    assert md.seq_lens_cpu == (6, 0, 3, 4)
    assert md.block_table.shape == (4, 2)
    return md, alloc


def test_base_metadata_properties():
    md, alloc = _base()
    assert (md.num_tokens, md.num_reqs, md.max_seq_len) == (7, 4, 6)
    assert md.context_lens_cpu == (5, 0, 0, 2)
    assert md.device == torch.device("cpu")
    md.validate()
    md.validate(num_slots=alloc.num_slots)
    with pytest.raises(dataclasses.FrozenInstanceError):
        md.block_size = 8


def test_base_metadata_views():
    """decode: rows 0-1 (a and the padding row); prefill: b (tokens 0-2 of the prefill part,
    no context) and c (tokens 3-4, 2 cached); the views follow writes into the step's tensors
    (a CUDA graph's static metadata is refilled in place)."""
    md, _ = _base()
    dec, pre = md.decode, md.prefill
    assert dec.num_tokens == 2 and dec.seq_lens.tolist() == [6, 0]
    assert dec.block_table.tolist() == md.block_table.tolist()[:2]
    assert dec.slot_mapping.tolist() == md.slot_mapping.tolist()[:2]
    assert dec.slot_mapping.tolist()[1] == PADDING_SLOT
    assert (pre.token_start, pre.num_tokens) == (2, 5)
    assert pre.positions.tolist() == [0, 1, 2, 2, 3]
    got = [(rq.start, rq.end, rq.seq_len, rq.context_len, rq.num_tokens) for rq in pre.requests]
    assert got == [(0, 3, 3, 0, 3), (3, 5, 4, 2, 2)]
    assert [tuple(rq.block_table.shape) for rq in pre.requests] == [(1, 1), (1, 1)]
    assert pre.requests[1].block_table.tolist() == [[md.block_table_cpu[3][0]]]
    md.block_table.fill_(7)
    md.slot_mapping.fill_(-1)
    md.seq_lens.fill_(9)
    assert dec.block_table.tolist() == [[7, 7]] * 2 and pre.requests[0].block_table.item() == 7
    assert pre.slot_mapping.tolist() == [-1] * 5 and pre.seq_lens.tolist() == [9, 9]
    assert " decode=" not in repr(md) and " prefill=" not in repr(md)  # views: not in the repr


@pytest.mark.parametrize(
    "work, pad, parts",
    [
        ([("a", 5, 1), ("b", 2, 1)], None, (2, None)),  # decode only
        ([("a", 0, 4), ("b", 3, 2)], None, (None, 2)),  # prefill only
        ([], 3, (3, None)),  # only padding
        ([], None, (None, None)),  # empty
    ],
    ids=["decode-only", "prefill-only", "padding-only", "empty"],
)
def test_views_of_absent_parts_are_none(work, pad, parts):
    md, order = build_metadata(
        [RequestStep(*w) for w in work], BlockAllocator(16, 4), pad_decodes_to=pad
    )
    got = (
        None if md.decode is None else md.decode.num_tokens,
        None if md.prefill is None else len(md.prefill.requests),
    )
    assert got == parts
    _check_views(md)


def test_metadata_is_checked_once_per_step(monkeypatch):
    """Construction checks (and builds the views) once; the builder adds only the cache's
    num_slots check, and a validate() call re-checks on request."""
    calls = []
    real = BatchMetadata._check
    monkeypatch.setattr(BatchMetadata, "_check", lambda self: calls.append(1) or real(self))
    alloc = BlockAllocator(16, 4, seed=11)
    md, _ = build_metadata([RequestStep("b", 0, 3), RequestStep("a", 5, 1)], alloc)
    assert len(calls) == 1
    md.check_num_slots(alloc.num_slots)
    assert len(calls) == 1
    md.validate(num_slots=alloc.num_slots)
    assert len(calls) == 2


@pytest.mark.parametrize("name", ["BlockAllocator", "RequestStep", "build_metadata", "PADDING_ROW"])
def test_scheduler_names_moved_with_a_clear_error(name):
    import fusemla.metadata as metadata

    with pytest.raises(ImportError, match=rf"moved to fusemla\.testing\.scheduler.*import {name}"):
        exec(f"from fusemla.metadata import {name}", {})
    with pytest.raises(ImportError, match="fusemla.testing.scheduler"):
        getattr(metadata, name)
    assert not hasattr(metadata, "no_such_name")


def test_scheduler_tracks_contexts():
    """Scheduler.step: contexts grow by each step's tokens, rows name the requests (None for
    padding), a freed request starts again from 0 with its blocks back in the pool."""
    sched = Scheduler(BlockAllocator(16, 4, seed=1))
    md, rows = sched.step([("p", 5), ("q", 2)])
    assert rows == ["p", "q"] and md.num_decodes == 0 and md.context_lens_cpu == (0, 0)
    md, rows = sched.step([("q", 1), ("p", 3), ("r", 1)], pad_decodes_to=2)
    assert rows == ["q", None, "p", "r"]
    assert md.context_lens_cpu == (2, 0, 5, 0) and md.seq_lens_cpu == (3, 0, 8, 1)
    assert sched.context == {"p": 8, "q": 3, "r": 1}
    free = sched.allocator.num_free
    sched.free("p")
    assert sched.allocator.num_free == free + 2 and "p" not in sched.context
    md, rows = sched.step([("p", 1)])
    assert rows == ["p"] and md.num_prefills == 1 and md.context_lens_cpu == (0,)
    with pytest.raises(FuseMLATypeError, match="allocator"):
        Scheduler(object())


def _bt_strided(md: BatchMetadata) -> torch.Tensor:
    return md.block_table.t().contiguous().t()  # same values, stride (1, R)


VALIDATION_CASES = [
    # (id, changes (dict or callable md -> dict), exception, argument named first)
    ("D str", {"num_decode_tokens": "2"}, FuseMLATypeError, "num_decode_tokens"),
    ("D neg", {"num_decode_tokens": -1}, FuseMLAValueError, "num_decode_tokens"),
    ("P bool", {"num_prefill_tokens": True}, FuseMLATypeError, "num_prefill_tokens"),
    ("nd float", {"num_decodes": 2.0}, FuseMLATypeError, "num_decodes"),
    ("np neg", {"num_prefills": -2}, FuseMLAValueError, "num_prefills"),
    ("bs 0", {"block_size": 0}, FuseMLAValueError, "block_size"),
    ("bs none", {"block_size": None}, FuseMLATypeError, "block_size"),
    ("nd != D", {"num_decodes": 1}, FuseMLAValueError, "num_decodes"),
    (
        "nd > R",
        {"num_decodes": 5, "num_decode_tokens": 5, "num_prefill_tokens": 2},
        FuseMLAValueError,
        "num_decodes",
    ),
    ("np wrong", {"num_prefills": 1}, FuseMLAValueError, "num_prefills"),
    ("D+P != end", {"num_prefill_tokens": 6}, FuseMLAValueError, "query_start_loc_cpu"),
    ("qsl type", {"query_start_loc_cpu": "01257"}, FuseMLATypeError, "query_start_loc_cpu"),
    (
        "qsl entry",
        {"query_start_loc_cpu": (0, 1, 2, 5.0, 7)},
        FuseMLATypeError,
        "query_start_loc_cpu[3]",
    ),
    ("qsl len", {"query_start_loc_cpu": (0, 1, 2, 7)}, FuseMLAValueError, "query_start_loc_cpu"),
    (
        "qsl start",
        {"query_start_loc_cpu": (1, 1, 2, 5, 7)},
        FuseMLAValueError,
        "query_start_loc_cpu",
    ),
    (
        "qsl decreasing",
        {"query_start_loc_cpu": (0, 1, 2, 1, 7)},
        FuseMLAValueError,
        "query_start_loc_cpu",
    ),
    ("qsl end", {"query_start_loc_cpu": (0, 1, 2, 5, 8)}, FuseMLAValueError, "query_start_loc_cpu"),
    (
        "decode qlen 2",
        {"query_start_loc_cpu": (0, 2, 2, 5, 7)},
        FuseMLAValueError,
        "query_start_loc_cpu",
    ),
    (
        "decode qlen 0",
        {"query_start_loc_cpu": (0, 0, 1, 4, 6), "num_prefill_tokens": 4},
        FuseMLAValueError,
        "query_start_loc_cpu",
    ),
    (
        "prefill qlen 0",
        {"query_start_loc_cpu": (0, 1, 2, 2, 7)},
        FuseMLAValueError,
        "query_start_loc_cpu",
    ),
    ("seq < qlen", {"seq_lens_cpu": (6, 0, 2, 4)}, FuseMLAValueError, "seq_lens_cpu"),
    ("padding prefill", {"seq_lens_cpu": (6, 0, 0, 4)}, FuseMLAValueError, "seq_lens_cpu"),
    ("seq neg", {"seq_lens_cpu": (6, -1, 3, 4)}, FuseMLAValueError, "seq_lens_cpu[1]"),
    ("seq type", {"seq_lens_cpu": None}, FuseMLATypeError, "seq_lens_cpu"),
    ("seq count", {"seq_lens_cpu": (6, 0, 3)}, FuseMLAValueError, "query_start_loc_cpu"),
    ("seq too long", {"seq_lens_cpu": (6, 0, 3, 9)}, FuseMLAValueError, "block_table"),
    (
        "qsl list",
        lambda md: {"query_start_loc": md.query_start_loc_cpu},
        FuseMLATypeError,
        "query_start_loc",
    ),
    (
        "qsl dtype",
        lambda md: {"query_start_loc": md.query_start_loc.long()},
        FuseMLATypeError,
        "query_start_loc",
    ),
    (
        "qsl shape",
        lambda md: {"query_start_loc": md.query_start_loc[:4]},
        FuseMLAValueError,
        "query_start_loc",
    ),
    (
        "qsl 2d",
        lambda md: {"query_start_loc": md.query_start_loc[None]},
        FuseMLAValueError,
        "query_start_loc",
    ),
    ("seq_lens dtype", lambda md: {"seq_lens": md.seq_lens.long()}, FuseMLATypeError, "seq_lens"),
    ("seq_lens shape", lambda md: {"seq_lens": md.seq_lens[1:]}, FuseMLAValueError, "seq_lens"),
    (
        "bt type",
        lambda md: {"block_table": md.block_table.tolist()},
        FuseMLATypeError,
        "block_table",
    ),
    (
        "bt 1d",
        lambda md: {"block_table": md.block_table.flatten()},
        FuseMLAValueError,
        "block_table",
    ),
    ("bt rows", lambda md: {"block_table": md.block_table[:3]}, FuseMLAValueError, "block_table"),
    (
        "bt dtype",
        lambda md: {"block_table": md.block_table.long()},
        FuseMLATypeError,
        "block_table",
    ),
    (
        "bt narrow",
        lambda md: {"block_table": md.block_table[:, :1]},
        FuseMLAValueError,
        "block_table",
    ),
    ("bt stride", lambda md: {"block_table": _bt_strided(md)}, FuseMLAValueError, "block_table"),
    (
        "sm dtype",
        lambda md: {"slot_mapping": md.slot_mapping.int()},
        FuseMLATypeError,
        "slot_mapping",
    ),
    (
        "sm shape",
        lambda md: {"slot_mapping": md.slot_mapping[:-1]},
        FuseMLAValueError,
        "slot_mapping",
    ),
    (
        "sm stride",
        lambda md: {"slot_mapping": torch.zeros(14, dtype=torch.int64)[::2]},
        FuseMLAValueError,
        "slot_mapping",
    ),
    (
        "sm device",
        lambda md: {"slot_mapping": md.slot_mapping.to("meta")},
        FuseMLATypeError,
        "slot_mapping",
    ),
    ("pos dtype", lambda md: {"positions": md.positions.float()}, FuseMLATypeError, "positions"),
    ("pos shape", lambda md: {"positions": md.positions[:, None]}, FuseMLAValueError, "positions"),
    (
        "pos device",
        lambda md: {"positions": md.positions.to("meta")},
        FuseMLATypeError,
        "positions",
    ),
    (
        "bt device",
        lambda md: {"block_table": md.block_table.to("meta")},
        FuseMLATypeError,
        "block_table",
    ),
    ("btc type", {"block_table_cpu": "rows"}, FuseMLATypeError, "block_table_cpu"),
    (
        "btc rows",
        lambda md: {"block_table_cpu": md.block_table_cpu[:3]},
        FuseMLAValueError,
        "block_table_cpu",
    ),
    (
        "btc row len",
        lambda md: {"block_table_cpu": ((1,),) + md.block_table_cpu[1:]},
        FuseMLAValueError,
        "block_table_cpu[0]",
    ),
    (
        "btc neg",
        lambda md: {"block_table_cpu": ((1, -1),) + md.block_table_cpu[1:]},
        FuseMLAValueError,
        "block_table_cpu[0][1]",
    ),
    (
        "btc row type",
        lambda md: {"block_table_cpu": (None,) + md.block_table_cpu[1:]},
        FuseMLATypeError,
        "block_table_cpu[0]",
    ),
]


@pytest.mark.parametrize(
    "changes, exc, arg", [c[1:] for c in VALIDATION_CASES], ids=[c[0] for c in VALIDATION_CASES]
)
def test_validation_errors(changes, exc, arg):
    md, _ = _base()
    if callable(changes):
        changes = changes(md)
    with pytest.raises(exc) as e:
        dataclasses.replace(md, **changes)
    msg = str(e.value)
    assert msg.startswith(f"{arg}:"), msg
    assert "expected" in msg and "got" in msg, msg
    assert isinstance(e.value, FuseMLAError)


@pytest.mark.parametrize(
    "num_slots, changes, exc, arg",
    [
        ("64", {}, FuseMLATypeError, "num_slots"),
        (0, {}, FuseMLAValueError, "num_slots"),
        (30, {}, FuseMLAValueError, "num_slots"),  # not a multiple of block_size 4
        (4, {}, FuseMLAValueError, "num_slots"),  # max_seq_len 6 does not fit
        (
            20,
            {"block_table_cpu": ((5, 1), (0, 0), (2, 0), (3, 0))},
            FuseMLAValueError,
            "block_table_cpu[0][0]",
        ),
        (
            24,
            {"block_table_cpu": ((5, 1), (0, 6), (2, 0), (3, 0))},
            FuseMLAValueError,
            "block_table_cpu[1][1]",
        ),
    ],
)
def test_validate_num_slots_errors(num_slots, changes, exc, arg):
    md, _ = _base()
    md = dataclasses.replace(md, **changes)
    with pytest.raises(exc) as e:
        md.validate(num_slots=num_slots)
    msg = str(e.value)
    assert msg.startswith(f"{arg}:") and "expected" in msg and "got" in msg, msg


def test_validate_num_slots_without_host_block_table():
    md, alloc = _base()
    md = dataclasses.replace(md, block_table_cpu=None)
    md.validate(num_slots=alloc.num_slots)
    md.validate(num_slots=8)  # block ids unknown on the host: only max_seq_len <= 8 is checked
    with pytest.raises(FuseMLAValueError, match="num_slots"):
        md.validate(num_slots=4)


def test_host_values_are_normalized():
    np = pytest.importorskip("numpy")
    md, _ = _base()
    md2 = dataclasses.replace(
        md,
        num_decode_tokens=np.int64(2),
        block_size=np.int32(4),
        query_start_loc_cpu=list(np.array(md.query_start_loc_cpu)),
        seq_lens_cpu=[6, 0, 3, 4],
        block_table_cpu=[list(r) for r in md.block_table_cpu],
    )
    assert type(md2.num_decode_tokens) is int and type(md2.block_size) is int
    assert md2.query_start_loc_cpu == md.query_start_loc_cpu
    assert all(type(x) is int for x in md2.query_start_loc_cpu)
    assert md2.seq_lens_cpu == (6, 0, 3, 4)
    assert md2.block_table_cpu == md.block_table_cpu


# ----------------------------------------------------------------------------- no device sync


def test_validate_reads_only_host_copies():
    """Tensor values that contradict the host copies pass: validation never looks at them."""
    md, alloc = _base()
    bad = dataclasses.replace(
        md,
        query_start_loc=torch.full((5,), 99, dtype=torch.int32),
        seq_lens=torch.full((4,), -3, dtype=torch.int32),
        block_table=torch.full((4, 2), 1 << 30, dtype=torch.int32),
        slot_mapping=torch.full((7,), 1 << 40, dtype=torch.int64),
        positions=torch.full((7,), -5, dtype=torch.int64),
    )
    bad.validate(num_slots=alloc.num_slots)
    assert bad.max_seq_len == 6 and bad.context_lens_cpu == md.context_lens_cpu


def test_validate_on_meta_tensors():
    """Meta tensors have no values: any read (item, tolist, cpu, bool, indexing) would raise."""
    md, alloc = _base()
    meta = md.to("meta")
    assert {
        t.device.type
        for t in (
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            meta.slot_mapping,
            meta.positions,
        )
    } == {"meta"}
    meta.validate(num_slots=alloc.num_slots)
    assert meta.context_lens_cpu == md.context_lens_cpu and meta.max_seq_len == 6
    views = (
        meta.decode.block_table,
        meta.prefill.slot_mapping,
        meta.prefill.requests[1].block_table,
    )
    assert {t.device.type for t in views} == {"meta"}
    with pytest.raises(FuseMLAValueError, match="query_start_loc_cpu"):
        dataclasses.replace(meta, query_start_loc_cpu=(0, 1, 2, 5, 6))


def test_validate_calls_no_syncing_tensor_method(monkeypatch):
    md, alloc = _base()

    def boom(*args, **kwargs):
        raise AssertionError("validation read a tensor value")

    for name in (
        "item",
        "tolist",
        "cpu",
        "numpy",
        "__bool__",
        "__int__",
        "__index__",
        "nonzero",
        "__getitem__",
        "any",
        "all",
        "equal",
    ):
        monkeypatch.setattr(torch.Tensor, name, boom)
    md.validate(num_slots=alloc.num_slots)
    dataclasses.replace(md, num_prefills=2)  # __post_init__ too
    with pytest.raises(FuseMLAValueError):
        dataclasses.replace(md, num_prefills=1)


# ----------------------------------------------------------------------------- to(device)


def test_to_device(device):
    md, alloc = _base()
    for target in ("meta", device):
        moved = md.to(target)
        assert moved.device.type == torch.device(target).type
        assert moved.query_start_loc_cpu == md.query_start_loc_cpu
        assert moved.block_table_cpu == md.block_table_cpu
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "positions"):
            a, b = getattr(md, name), getattr(moved, name)
            assert (a.shape, a.dtype) == (b.shape, b.dtype)
        moved.validate(num_slots=alloc.num_slots)
        assert moved.decode.seq_lens.device.type == moved.prefill.positions.device.type
        assert moved.prefill.requests[0].block_table.device == moved.device
    back = md.to(device).to("cpu")
    _check_views(back)
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "positions"):
        assert torch.equal(getattr(md, name), getattr(back, name))


def test_build_on_device(device):
    alloc = BlockAllocator(32, 16, seed=2)
    steps = [RequestStep("a", 0, 20), RequestStep("b", 30, 1)]
    md, order = build_metadata(steps, alloc, device=device, pad_decodes_to=3)
    assert md.device.type == device
    assert token_request_index(md).device.type == device
    _check_against_allocator(md.to("cpu"), order, steps, alloc)
