"""A toy scheduler for tests, demos and benchmarks: paged blocks and consistent batch metadata.

:class:`BlockAllocator` hands out a paged KV cache's blocks (seeded shuffle, no prefix sharing);
:func:`build_metadata` turns one step's :class:`RequestStep` list into a decode-first
:class:`fusemla.metadata.BatchMetadata` whose tensors agree with its host copies by construction;
:class:`Scheduler` keeps each request's cached length across steps. Not engine code: an engine
builds :class:`~fusemla.metadata.BatchMetadata` from its own scheduler.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from fusemla.errors import FuseMLATypeError, FuseMLAValueError, describe
from fusemla.metadata import PADDING_SLOT, BatchMetadata, _int

__all__ = [
    "PADDING_ROW",
    "BlockAllocator",
    "RequestStep",
    "Scheduler",
    "build_metadata",
    "token_request_index",
]

PADDING_ROW = -1  # value of ``order[i]`` (from build_metadata) for a padding request row


def _hashable(name: str, x: object) -> None:
    if not isinstance(x, Hashable):
        raise FuseMLATypeError(f"{name}: expected a hashable request id, got {describe(x)}")
    try:
        hash(x)  # only to reject e.g. a tuple holding a list; never used for ordering or seeds
    except TypeError:
        raise FuseMLATypeError(
            f"{name}: expected a hashable request id, got {describe(x)}"
        ) from None


# ----------------------------------------------------------------------------- allocator


class BlockAllocator:
    """A paged KV-cache block allocator (for tests, demos and benchmarks; no prefix sharing).

    The ``num_blocks`` free blocks are handed out first-in first-out, starting from a seeded
    shuffle of ``range(num_blocks)`` (``shuffle=False``: ascending). The shuffle uses
    ``random.Random(seed)``, so it is the same in every process and on every platform. Freed
    blocks go to the back of the free queue. Each request owns a list of blocks, block ``j``
    holding its positions ``[j * block_size, (j + 1) * block_size)``.
    """

    def __init__(
        self, num_blocks: int, block_size: int, *, seed: int = 0, shuffle: bool = True
    ) -> None:
        self._num_blocks = _int("num_blocks", num_blocks, minimum=1)
        self._block_size = _int("block_size", block_size, minimum=1)
        seed = _int("seed", seed)
        if not isinstance(shuffle, bool):
            raise FuseMLATypeError(f"shuffle: expected a bool, got {describe(shuffle)}")
        order = list(range(self._num_blocks))
        if shuffle:
            random.Random(seed).shuffle(order)
        self._free: deque[int] = deque(order)
        self._blocks: dict[Hashable, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks of the cache."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Cache rows per block."""
        return self._block_size

    @property
    def num_slots(self) -> int:
        """Rows of the cache: ``num_blocks * block_size`` (what ``validate(num_slots=)`` takes)."""
        return self._num_blocks * self._block_size

    @property
    def num_free(self) -> int:
        """Blocks not owned by any request."""
        return len(self._free)

    def blocks_of(self, request_id: Hashable) -> list[int]:
        """A copy of the request's block list (empty for a request that owns no blocks)."""
        _hashable("request_id", request_id)
        return list(self._blocks.get(request_id, ()))

    def _blocks_needed(self, request_id: Hashable, num_tokens: int) -> int:
        """More blocks ``request_id`` needs to hold ``num_tokens`` tokens (0 if it has enough)."""
        have = len(self._blocks.get(request_id, ()))
        return max(math.ceil(num_tokens / self._block_size) - have, 0)

    def ensure(self, request_id: Hashable, num_tokens: int) -> list[int]:
        """Grow the request's blocks to hold ``num_tokens`` tokens; return a copy of its list.

        Never shrinks. Raises :class:`FuseMLAValueError` ("out of blocks"), allocating nothing,
        when fewer blocks are free than needed.
        """
        _hashable("request_id", request_id)
        num_tokens = _int("num_tokens", num_tokens)
        need = self._blocks_needed(request_id, num_tokens)
        if need > len(self._free):
            raise FuseMLAValueError(
                f"num_tokens: out of blocks: request {request_id!r} needs {need} more block(s) "
                f"of {self._block_size} to hold num_tokens = {num_tokens}, but only "
                f"{len(self._free)} of {self._num_blocks} are free"
            )
        blocks = self._blocks.setdefault(request_id, [])
        blocks.extend(self._free.popleft() for _ in range(need))
        return list(blocks)

    def free(self, request_id: Hashable) -> None:
        """Return all of the request's blocks to the back of the free queue."""
        _hashable("request_id", request_id)
        if request_id not in self._blocks:
            raise FuseMLAValueError(
                f"request_id: expected a request that owns blocks "
                f"(allocated by ensure and not yet freed), got "
                f"{request_id!r}"
            )
        self._free.extend(self._blocks.pop(request_id))

    def slot(self, request_id: Hashable, position: int) -> int:
        """The cache slot of the request's token at ``position``: ``block * block_size + off``."""
        blocks = self.blocks_of(request_id)
        position = _int("position", position)
        capacity = len(blocks) * self._block_size
        if position >= capacity:
            raise FuseMLAValueError(
                f"position: expected < {capacity} (the {len(blocks)} "
                f"block(s) of request {request_id!r}), got {position}"
            )
        block, offset = divmod(position, self._block_size)
        return blocks[block] * self._block_size + offset


# ----------------------------------------------------------------------------- builder


@dataclass(frozen=True)
class RequestStep:
    """One request's work in a step.

    ``request_id``: any hashable id (the allocator's key). ``context_len``: tokens already in the
    cache. ``num_new_tokens``: tokens processed this step (>= 1; 1 for a decode).
    ``is_decode``: ``None`` means decode iff ``num_new_tokens == 1 and context_len > 0``;
    ``True`` requires ``num_new_tokens == 1``.
    """

    request_id: object
    context_len: int
    num_new_tokens: int
    is_decode: bool | None = None

    def __post_init__(self) -> None:
        _hashable("request_id", self.request_id)
        object.__setattr__(self, "context_len", _int("context_len", self.context_len))
        object.__setattr__(
            self, "num_new_tokens", _int("num_new_tokens", self.num_new_tokens, minimum=1)
        )
        if self.is_decode is not None and not isinstance(self.is_decode, bool):
            raise FuseMLATypeError(
                f"is_decode: expected None or a bool, got {describe(self.is_decode)}"
            )
        if self.is_decode and self.num_new_tokens != 1:
            raise FuseMLAValueError(
                f"num_new_tokens: expected 1 for a decode step "
                f"(is_decode=True), got {self.num_new_tokens}"
            )


def _is_decode(step: RequestStep) -> bool:
    if step.is_decode is not None:
        return step.is_decode
    return step.num_new_tokens == 1 and step.context_len > 0


def build_metadata(
    steps: Sequence[RequestStep],
    allocator: BlockAllocator,
    *,
    device: str | torch.device = "cpu",
    pad_decodes_to: int | None = None,
    max_blocks: int | None = None,
) -> tuple[BatchMetadata, list[int]]:
    """Allocate cache blocks for one step and build its :class:`BatchMetadata`.

    Requests are ordered decode-first, stably (decodes in the given order, then prefills in the
    given order). Each request's blocks are grown to hold ``context_len + num_new_tokens`` tokens
    (all-or-nothing: if the allocator is short, nothing is allocated), and ``slot_mapping`` /
    ``positions`` are filled for its new tokens (positions ``context_len ...``).

    ``pad_decodes_to=n`` appends padding decode requests (seq_len 0, slot -1, position 0,
    block-table row of zeros) after the real decodes until there are ``n`` decode tokens, as fed to
    a CUDA graph captured at decode batch ``n``. ``max_blocks`` fixes the block table's width;
    the default is the longest request's block count (at least 1).

    Returns ``(metadata, order)``: ``order[i]`` is the index into ``steps`` of the request in row
    ``i``, or ``-1`` (:data:`PADDING_ROW`) for a padding row.
    """
    if not isinstance(steps, Sequence) or isinstance(steps, (str, bytes)):
        raise FuseMLATypeError(f"steps: expected a sequence of RequestStep, got {describe(steps)}")
    for i, s in enumerate(steps):
        if not isinstance(s, RequestStep):
            raise FuseMLATypeError(f"steps[{i}]: expected a RequestStep, got {describe(s)}")
    if not isinstance(allocator, BlockAllocator):
        raise FuseMLATypeError(f"allocator: expected a BlockAllocator, got {describe(allocator)}")
    seen: dict[object, int] = {}
    for i, s in enumerate(steps):
        if s.request_id in seen:
            raise FuseMLAValueError(
                f"steps[{i}]: expected unique request ids, got request_id "
                f"{s.request_id!r} again (also steps[{seen[s.request_id]}])"
            )
        seen[s.request_id] = i
    bs = allocator.block_size

    decode_idx = [i for i, s in enumerate(steps) if _is_decode(s)]
    prefill_idx = [i for i, s in enumerate(steps) if not _is_decode(s)]
    num_pad = 0
    if pad_decodes_to is not None:
        pad_decodes_to = _int("pad_decodes_to", pad_decodes_to)
        if pad_decodes_to < len(decode_idx):
            raise FuseMLAValueError(
                f"pad_decodes_to: expected >= the number of decode requests "
                f"= {len(decode_idx)}, got {pad_decodes_to}"
            )
        num_pad = pad_decodes_to - len(decode_idx)
    order = decode_idx + [PADDING_ROW] * num_pad + prefill_idx

    # Widths first: a too-narrow max_blocks must fail before anything is allocated.
    seq_lens = [
        0 if i == PADDING_ROW else steps[i].context_len + steps[i].num_new_tokens for i in order
    ]
    needed_width = max((math.ceil(s / bs) for s in seq_lens), default=0)
    if max_blocks is None:
        width = max(needed_width, 1)
    else:
        width = _int("max_blocks", max_blocks)
        if width < needed_width:
            raise FuseMLAValueError(
                f"max_blocks: expected >= {needed_width} (the longest "
                f"request, seq_len {max(seq_lens)}, at block_size {bs}), "
                f"got {width}"
            )

    # All-or-nothing allocation.
    total = sum(
        allocator._blocks_needed(steps[i].request_id, seq_lens[r])
        for r, i in enumerate(order)
        if i != PADDING_ROW
    )
    if total > allocator.num_free:
        raise FuseMLAValueError(
            f"steps: out of blocks: the step needs {total} more block(s) of "
            f"{bs}, but only {allocator.num_free} of {allocator.num_blocks} "
            f"are free"
        )

    qsl = [0]
    block_rows: list[tuple[int, ...]] = []
    slots: list[int] = []
    positions: list[int] = []
    for r, i in enumerate(order):
        if i == PADDING_ROW:
            qsl.append(qsl[-1] + 1)
            block_rows.append((0,) * width)
            slots.append(PADDING_SLOT)
            positions.append(0)
            continue
        s = steps[i]
        blocks = allocator.ensure(s.request_id, seq_lens[r])
        used = blocks[: math.ceil(seq_lens[r] / bs)]
        block_rows.append(tuple(used) + (0,) * (width - len(used)))
        for p in range(s.context_len, seq_lens[r]):
            block, offset = divmod(p, bs)
            slots.append(blocks[block] * bs + offset)
            positions.append(p)
        qsl.append(qsl[-1] + s.num_new_tokens)

    num_decodes = len(decode_idx) + num_pad
    R = len(order)
    flat = [b for row in block_rows for b in row]
    md = BatchMetadata(
        num_decode_tokens=num_decodes,
        num_prefill_tokens=qsl[-1] - num_decodes,
        num_decodes=num_decodes,
        num_prefills=len(prefill_idx),
        block_size=bs,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_table=torch.tensor(flat, dtype=torch.int32).view(R, width).to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        positions=torch.tensor(positions, dtype=torch.int64).to(device),
        query_start_loc_cpu=tuple(qsl),
        seq_lens_cpu=tuple(seq_lens),
        block_table_cpu=tuple(block_rows),
    )
    md.check_num_slots(allocator.num_slots)  # the rest was checked on construction
    return md, order


class Scheduler:
    """Steps over one :class:`BlockAllocator` that remember each request's cached tokens.

    ``step(work)``: ``work`` lists ``(request_id, num_new_tokens)``; each request's
    ``context_len`` is what the earlier steps gave it (0 for a new one), and the decode rule is
    :class:`RequestStep`'s. ``device`` and ``max_blocks`` go to every :func:`build_metadata`.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        device: str | torch.device = "cpu",
        max_blocks: int | None = None,
    ) -> None:
        if not isinstance(allocator, BlockAllocator):
            raise FuseMLATypeError(
                f"allocator: expected a BlockAllocator, got {describe(allocator)}"
            )
        self.allocator = allocator
        self.device = device
        self.max_blocks = max_blocks
        #: tokens in the cache per request id
        self.context: dict[Hashable, int] = {}

    def step(
        self, work: Sequence[tuple[Hashable, int]], *, pad_decodes_to: int | None = None
    ) -> tuple[BatchMetadata, list]:
        """Build the step's metadata (see :func:`build_metadata`) and advance the contexts.

        Returns ``(metadata, rows)``: ``rows[i]`` is the request id of row ``i``, None for a
        padding row."""
        steps = [RequestStep(r, self.context.get(r, 0), n) for r, n in work]
        md, order = build_metadata(
            steps,
            self.allocator,
            device=self.device,
            pad_decodes_to=pad_decodes_to,
            max_blocks=self.max_blocks,
        )
        for s in steps:
            self.context[s.request_id] = s.context_len + s.num_new_tokens
        return md, [None if i == PADDING_ROW else steps[i].request_id for i in order]

    def free(self, request_id: Hashable) -> None:
        """Finish a request: its blocks go back to the allocator, its context is forgotten."""
        self.allocator.free(request_id)
        self.context.pop(request_id, None)


def token_request_index(md: BatchMetadata) -> torch.Tensor:
    """``[num_tokens]`` int64: the request row of each token, built on the host, on md's device."""
    if not isinstance(md, BatchMetadata):
        raise FuseMLATypeError(f"md: expected a BatchMetadata, got {describe(md)}")
    rows = torch.arange(md.num_reqs, dtype=torch.int64)
    q_lens = torch.tensor(md.query_lens_cpu, dtype=torch.int64)
    return torch.repeat_interleave(rows, q_lens).to(md.device)
