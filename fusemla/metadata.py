"""Per-step batch metadata for paged MLA attention, a paged block allocator and a batch builder.

An engine step is described once, on the host, by a :class:`BatchMetadata` and handed unchanged to
every op and layer of the step. It follows vLLM's conventions (which SGLang and others mirror):

* Requests are ordered **decodes first**: the first ``num_decodes`` requests have exactly one new
  token each, so the first ``num_decode_tokens == num_decodes`` tokens of the batch are decode
  tokens; prefill requests (one or more new tokens each) follow.
* The KV cache is ``[num_blocks, block_size, L + R]``; a token's cache row is its *slot*,
  ``slot = block * block_size + offset_in_block``. ``slot_mapping[t] < 0`` (we write ``-1``) means
  "write nothing for token ``t``" (CUDA-graph padding).
* ``block_table[r, j]`` is the cache block holding positions ``[j * block_size, (j + 1) *
  block_size)`` of request ``r``; entries past the request's last block are 0, so a kernel may
  gather them safely and mask by ``seq_lens``.
* A *padding request* (CUDA-graph capture at a fixed decode batch) is a decode row with
  ``seq_len == 0``: its one token has slot ``-1`` and position 0, and its block-table row is 0.

Validation never synchronizes a device: it reads the host copies (``query_start_loc_cpu``,
``seq_lens_cpu`` and, when present, ``block_table_cpu``) and the tensors' shapes, dtypes, strides
and devices, never their values. What only a device value could tell is not checked: that the
tensors hold the same numbers as the host copies, and the values of ``slot_mapping`` and
``positions``. :func:`build_metadata` produces them consistent by construction.
"""

from __future__ import annotations

import math
import numbers
import random
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from fusemla.errors import FuseMLATypeError, FuseMLAValueError, describe

PADDING_SLOT = -1  # slot_mapping value of a token that writes nothing
PADDING_ROW = -1  # value of ``order[i]`` (from build_metadata) for a padding request row


# ----------------------------------------------------------------------------- argument checks


def _int(name: str, x: object, *, minimum: int = 0) -> int:
    """``x`` as a Python int >= ``minimum`` (int or numpy-style integer; not bool, not tensor)."""
    if isinstance(x, (bool, torch.Tensor)) or not isinstance(x, numbers.Integral):
        raise FuseMLATypeError(f"{name}: expected an int >= {minimum}, got {describe(x)}")
    value = int(x)
    if value < minimum:
        raise FuseMLAValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def _int_tuple(name: str, x: object, *, minimum: int = 0) -> tuple[int, ...]:
    """``x`` (a tuple or list of ints >= ``minimum``) as a tuple of Python ints."""
    if not isinstance(x, (tuple, list)):
        raise FuseMLATypeError(f"{name}: expected a tuple of ints, got {describe(x)}")
    return tuple(_int(f"{name}[{i}]", v, minimum=minimum) for i, v in enumerate(x))


def _tensor(
    name: str, x: object, dtype: torch.dtype, shape: tuple[int, ...], what: str
) -> torch.Tensor:
    """Check type, dtype, shape and unit stride of the last dim (metadata only: no sync)."""
    if not isinstance(x, torch.Tensor):
        raise FuseMLATypeError(f"{name}: expected a torch.Tensor {what} {dtype}, got {describe(x)}")
    if x.dtype != dtype:
        raise FuseMLATypeError(f"{name}: expected dtype {dtype}, got {describe(x)}")
    if tuple(x.shape) != shape:
        raise FuseMLAValueError(f"{name}: expected shape {what} = {list(shape)}, got {describe(x)}")
    if x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
        raise FuseMLAValueError(f"{name}: expected unit stride in the last dim, got {describe(x)}")
    return x


def _hashable(name: str, x: object) -> None:
    if not isinstance(x, Hashable):
        raise FuseMLATypeError(f"{name}: expected a hashable request id, got {describe(x)}")
    try:
        hash(x)  # only to reject e.g. a tuple holding a list; never used for ordering or seeds
    except TypeError:
        raise FuseMLATypeError(
            f"{name}: expected a hashable request id, got {describe(x)}"
        ) from None


# ----------------------------------------------------------------------------- metadata


@dataclass(frozen=True, eq=False)
class BatchMetadata:
    """What the engine knows about one step's batch; built and validated once, on the host.

    Fields (``R = num_reqs``, ``T = num_tokens``):
        ``num_decode_tokens``: ``D``, the decode tokens, which come first (one per decode request).
        ``num_prefill_tokens``: tokens of the prefill requests, after the decode tokens.
        ``num_decodes``: decode requests (``== num_decode_tokens``), padding requests included.
        ``num_prefills``: prefill requests (``== R - num_decodes``).
        ``block_size``: cache rows per block (``>= 1``).
        ``query_start_loc``: ``[R + 1]`` int32; request ``r``'s tokens are
        ``[query_start_loc[r], query_start_loc[r + 1])``.
        ``seq_lens``: ``[R]`` int32, context + new tokens of each request (0 for padding).
        ``block_table``: ``[R, max_blocks]`` int32, rows of unit stride; unused entries are 0.
        ``slot_mapping``: ``[T]`` int64, ``block * block_size + offset``; ``-1``: write nothing.
        ``positions``: ``[T]`` int64, the token's position in its request (``context_len + i``);
        0 for padding.
        ``query_start_loc_cpu``, ``seq_lens_cpu``: host copies of the two tensors.
        ``block_table_cpu``: optional host copy of ``block_table`` (``R`` rows of ``max_blocks``
        ints); when given, :meth:`validate` checks its block ids against ``num_slots``.

    All tensors live on one device; 1-D tensors are contiguous. Lists given for the host copies are
    stored as tuples. Checks run on construction (see :meth:`validate`); the object is immutable.
    """

    num_decode_tokens: int
    num_prefill_tokens: int
    num_decodes: int
    num_prefills: int
    block_size: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    query_start_loc_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    block_table_cpu: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        # Normalize the host-side values (numpy ints -> int, lists -> tuples), then check all.
        for name in ("num_decode_tokens", "num_prefill_tokens", "num_decodes", "num_prefills"):
            object.__setattr__(self, name, _int(name, getattr(self, name)))
        object.__setattr__(self, "block_size", _int("block_size", self.block_size, minimum=1))
        object.__setattr__(
            self, "query_start_loc_cpu", _int_tuple("query_start_loc_cpu", self.query_start_loc_cpu)
        )
        object.__setattr__(self, "seq_lens_cpu", _int_tuple("seq_lens_cpu", self.seq_lens_cpu))
        if self.block_table_cpu is not None:
            rows = self.block_table_cpu
            if not isinstance(rows, (tuple, list)):
                raise FuseMLATypeError(
                    f"block_table_cpu: expected None or a tuple of rows "
                    f"(tuples of ints), got {describe(rows)}"
                )
            object.__setattr__(
                self,
                "block_table_cpu",
                tuple(_int_tuple(f"block_table_cpu[{r}]", row) for r, row in enumerate(rows)),
            )
        self.validate()

    # ------------------------------------------------------------------------- derived values

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch: ``num_decode_tokens + num_prefill_tokens``."""
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def num_reqs(self) -> int:
        """Requests in the batch (decodes, padding included, then prefills)."""
        return len(self.seq_lens_cpu)

    @property
    def max_seq_len(self) -> int:
        """The longest ``seq_len`` of the batch (0 for an empty batch)."""
        return max(self.seq_lens_cpu, default=0)

    @property
    def query_lens_cpu(self) -> tuple[int, ...]:
        """New tokens of each request this step (1 for every decode request)."""
        q = self.query_start_loc_cpu
        return tuple(q[r + 1] - q[r] for r in range(self.num_reqs))

    @property
    def context_lens_cpu(self) -> tuple[int, ...]:
        """Tokens already cached per request: ``seq_len - query_len`` (0 for a padding request)."""
        pairs = zip(self.seq_lens_cpu, self.query_lens_cpu, strict=True)
        return tuple(max(s - q, 0) for s, q in pairs)

    @property
    def device(self) -> torch.device:
        """The device of every tensor of the metadata."""
        return self.query_start_loc.device

    # ------------------------------------------------------------------------- checks

    def validate(self, *, num_slots: int | None = None) -> None:
        """Check the metadata from host values only (never reads a device tensor's values).

        Checked: counts are ints >= 0 (``block_size`` >= 1); the tensors have the documented
        ranks, shapes and dtypes, unit stride in their last dim, and share one device;
        ``query_start_loc_cpu`` has ``num_reqs + 1`` entries, starts at 0, never decreases and ends
        at ``num_tokens``; the first ``num_decodes`` requests have query length 1
        (``num_decodes == num_decode_tokens``), the others >= 1, and ``num_prefills ==
        num_reqs - num_decodes``; each request has ``seq_len >= query_len``, except padding
        requests (decode rows with ``seq_len == 0``); ``block_table`` is wide enough for
        ``max_seq_len``.

        ``num_slots`` (``num_blocks * block_size`` of the KV cache) additionally checks that it is
        a positive multiple of ``block_size``, that the longest request fits in the cache and, when
        ``block_table_cpu`` is present, that every block id in it is ``< num_blocks``.

        Not checked (each would need a device value): that the tensors hold the host copies'
        numbers, and the values of ``block_table`` (without ``block_table_cpu``), ``slot_mapping``
        and ``positions``.

        Raises:
            FuseMLATypeError: a wrong Python type, dtype or device.
            FuseMLAValueError: a wrong shape, count or value.
        """
        D = _int("num_decode_tokens", self.num_decode_tokens)
        num_prefill_tokens = _int("num_prefill_tokens", self.num_prefill_tokens)
        num_decodes = _int("num_decodes", self.num_decodes)
        num_prefills = _int("num_prefills", self.num_prefills)
        bs = _int("block_size", self.block_size, minimum=1)
        qsl = _int_tuple("query_start_loc_cpu", self.query_start_loc_cpu)
        seq_lens = _int_tuple("seq_lens_cpu", self.seq_lens_cpu)
        R = len(seq_lens)
        T = D + num_prefill_tokens

        # Host copies: query_start_loc_cpu.
        if len(qsl) != R + 1:
            raise FuseMLAValueError(
                f"query_start_loc_cpu: expected num_reqs + 1 = {R + 1} "
                f"entries (num_reqs = len(seq_lens_cpu) = {R}), got "
                f"{len(qsl)}: {qsl}"
            )
        if qsl[0] != 0:
            raise FuseMLAValueError(f"query_start_loc_cpu: expected to start at 0, got {qsl}")
        for r in range(R):
            if qsl[r + 1] < qsl[r]:
                raise FuseMLAValueError(
                    f"query_start_loc_cpu: expected non-decreasing entries, "
                    f"got {qsl[r]} then {qsl[r + 1]} at index {r}: {qsl}"
                )
        if qsl[-1] != T:
            raise FuseMLAValueError(
                f"query_start_loc_cpu: expected to end at num_tokens = "
                f"num_decode_tokens + num_prefill_tokens = {D} + "
                f"{num_prefill_tokens} = {T}, got {qsl[-1]}"
            )

        # Decode / prefill split.
        if num_decodes > R:
            raise FuseMLAValueError(f"num_decodes: expected <= num_reqs = {R}, got {num_decodes}")
        if num_decodes != D:
            raise FuseMLAValueError(
                f"num_decodes: expected == num_decode_tokens = {D} (one token "
                f"per decode request), got {num_decodes}"
            )
        if num_prefills != R - num_decodes:
            raise FuseMLAValueError(
                f"num_prefills: expected num_reqs - num_decodes = {R} - "
                f"{num_decodes} = {R - num_decodes}, got {num_prefills}"
            )
        for r in range(R):
            q_len = qsl[r + 1] - qsl[r]
            if r < num_decodes and q_len != 1:
                raise FuseMLAValueError(
                    f"query_start_loc_cpu: expected query length 1 for decode "
                    f"request {r} (num_decodes = {num_decodes}), got {q_len}"
                )
            if r >= num_decodes and q_len < 1:
                raise FuseMLAValueError(
                    f"query_start_loc_cpu: expected query length >= 1 for "
                    f"prefill request {r}, got {q_len}"
                )
            if seq_lens[r] == 0 and r < num_decodes:
                continue  # a padding request
            if seq_lens[r] < q_len:
                pad = (
                    " (seq_len 0 marks padding, allowed only among decodes)"
                    if (seq_lens[r] == 0)
                    else ""
                )
                raise FuseMLAValueError(
                    f"seq_lens_cpu: expected seq_len >= query length "
                    f"{q_len} for request {r}, got {seq_lens[r]}{pad}"
                )
        max_seq_len = max(seq_lens, default=0)

        # Tensors: metadata only (type, dtype, shape, stride, device).
        qsl_t = _tensor(
            "query_start_loc", self.query_start_loc, torch.int32, (R + 1,), "[num_reqs + 1]"
        )
        _tensor("seq_lens", self.seq_lens, torch.int32, (R,), "[num_reqs]")
        bt = self.block_table
        if not isinstance(bt, torch.Tensor):
            raise FuseMLATypeError(
                f"block_table: expected a torch.Tensor [num_reqs, max_blocks] "
                f"int32, got {describe(bt)}"
            )
        if bt.dim() != 2:
            raise FuseMLAValueError(
                f"block_table: expected a [num_reqs, max_blocks] int32 tensor, got {describe(bt)}"
            )
        max_blocks = bt.shape[1]
        _tensor("block_table", bt, torch.int32, (R, max_blocks), "[num_reqs, max_blocks]")
        _tensor("slot_mapping", self.slot_mapping, torch.int64, (T,), "[num_tokens]")
        _tensor("positions", self.positions, torch.int64, (T,), "[num_tokens]")
        for name in ("seq_lens", "block_table", "slot_mapping", "positions"):
            t = getattr(self, name)
            if t.device != qsl_t.device:
                raise FuseMLATypeError(
                    f"{name}: expected device {qsl_t.device} (that of "
                    f"query_start_loc), got {describe(t)}"
                )
        for name in ("query_start_loc", "seq_lens", "slot_mapping", "positions"):
            t = getattr(self, name)
            if not t.is_contiguous():
                raise FuseMLAValueError(f"{name}: expected a contiguous tensor, got {describe(t)}")
        if max_blocks * bs < max_seq_len:
            raise FuseMLAValueError(
                f"block_table: expected max_blocks * block_size >= max_seq_len "
                f"= {max_seq_len}, i.e. max_blocks >= "
                f"{math.ceil(max_seq_len / bs)} at block_size {bs}, got "
                f"{describe(bt)}"
            )

        # Optional host copy of the block table.
        rows = self.block_table_cpu
        if rows is not None:
            if not isinstance(rows, tuple) or len(rows) != R:
                raise FuseMLAValueError(
                    f"block_table_cpu: expected None or num_reqs = {R} rows, got {describe(rows)}"
                )
            for r, row in enumerate(rows):
                row = _int_tuple(f"block_table_cpu[{r}]", row)
                if len(row) != max_blocks:
                    raise FuseMLAValueError(
                        f"block_table_cpu[{r}]: expected max_blocks = "
                        f"{max_blocks} entries (block_table.shape[1]), got "
                        f"{len(row)}"
                    )

        if num_slots is None:
            return
        num_slots = _int("num_slots", num_slots, minimum=1)
        if num_slots % bs:
            raise FuseMLAValueError(
                f"num_slots: expected num_blocks * block_size, a multiple of "
                f"block_size = {bs}, got {num_slots}"
            )
        num_blocks = num_slots // bs
        if max_seq_len > num_slots:
            raise FuseMLAValueError(
                f"num_slots: expected >= max_seq_len = {max_seq_len} (the "
                f"longest request must fit in the cache), got {num_slots}"
            )
        if rows is not None:
            for r, row in enumerate(rows):
                for j, block in enumerate(row):
                    if block >= num_blocks:
                        raise FuseMLAValueError(
                            f"block_table_cpu[{r}][{j}]: expected a block id < num_blocks = "
                            f"num_slots // block_size = {num_blocks}, got {block}"
                        )

    # ------------------------------------------------------------------------- moves

    def to(self, device: str | torch.device) -> BatchMetadata:
        """The same metadata with its tensors on ``device`` (host copies unchanged)."""
        return BatchMetadata(
            num_decode_tokens=self.num_decode_tokens,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decodes=self.num_decodes,
            num_prefills=self.num_prefills,
            block_size=self.block_size,
            query_start_loc=self.query_start_loc.to(device),
            seq_lens=self.seq_lens.to(device),
            block_table=self.block_table.to(device),
            slot_mapping=self.slot_mapping.to(device),
            positions=self.positions.to(device),
            query_start_loc_cpu=self.query_start_loc_cpu,
            seq_lens_cpu=self.seq_lens_cpu,
            block_table_cpu=self.block_table_cpu,
        )


def token_request_index(md: BatchMetadata) -> torch.Tensor:
    """``[num_tokens]`` int64: the request row of each token, built on the host, on md's device."""
    if not isinstance(md, BatchMetadata):
        raise FuseMLATypeError(f"md: expected a BatchMetadata, got {describe(md)}")
    rows = torch.arange(md.num_reqs, dtype=torch.int64)
    q_lens = torch.tensor(md.query_lens_cpu, dtype=torch.int64)
    return torch.repeat_interleave(rows, q_lens).to(md.device)


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
    md.validate(num_slots=allocator.num_slots)
    return md, order
