"""Per-step batch metadata for paged MLA attention: :class:`BatchMetadata` and its views.

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

Built once per step, with the metadata: its decode and prefill parts (vLLM's
``MLACommonMetadata.decode`` / ``.prefill``), :attr:`BatchMetadata.decode` (a
:class:`DecodeMetadata`) and :attr:`BatchMetadata.prefill` (a :class:`PrefillMetadata`, one
:class:`PrefillRequest` per prefill request), each None when the step has no such request. Their
tensors are views of the step's tensors, so every layer of the step reads the same ones and
none cuts the batch itself; writing into the step's tensors (a CUDA graph's static metadata)
changes the views too.

Validation (on construction) never synchronizes a device: it reads the host copies
(``query_start_loc_cpu``, ``seq_lens_cpu`` and, when present, ``block_table_cpu``) and the
tensors' shapes, dtypes, strides and devices, never their values. What only a device value could
tell is not checked: that the tensors hold the same numbers as the host copies, and the values of
``slot_mapping`` and ``positions``.

A toy scheduler that builds consistent metadata (a paged block allocator and a batch builder,
for tests, demos and benchmarks) is :mod:`fusemla.testing.scheduler`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

from fusemla.errors import FuseMLATypeError, FuseMLAValueError, describe

PADDING_SLOT = -1  # slot_mapping value of a token that writes nothing


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


# ----------------------------------------------------------------------------- views


@dataclass(frozen=True, eq=False)
class DecodeMetadata:
    """The decode part of a step (:attr:`BatchMetadata.decode`): requests and tokens
    ``[0, num_tokens)``, one token each, padding requests included. Views of the step's tensors.

    ``block_table``: ``[D, max_blocks]``; ``seq_lens``, ``slot_mapping``, ``positions``: ``[D]``.
    """

    num_tokens: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor


@dataclass(frozen=True, eq=False)
class PrefillRequest:
    """One prefill request: its tokens are ``[start, end)`` of the prefill part (add
    :attr:`PrefillMetadata.token_start` for the batch's), ``seq_len`` = cached + new tokens,
    ``block_table``: ``[1, ceil(seq_len / block_size)]``, a view of its block-table row."""

    start: int
    end: int
    seq_len: int
    block_table: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """New tokens this step."""
        return self.end - self.start

    @property
    def context_len(self) -> int:
        """Tokens already in the cache before this step."""
        return self.seq_len - (self.end - self.start)


@dataclass(frozen=True, eq=False)
class PrefillMetadata:
    """The prefill part of a step (:attr:`BatchMetadata.prefill`): requests
    ``[num_decodes, num_reqs)``, tokens ``[token_start, token_start + num_tokens)`` of the batch.
    Views of the step's tensors.

    ``block_table``: ``[num_prefills, max_blocks]``; ``seq_lens``: ``[num_prefills]``;
    ``slot_mapping``, ``positions``: ``[num_tokens]``; ``requests``: one
    :class:`PrefillRequest` per prefill request, in batch order.
    """

    token_start: int
    num_tokens: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    requests: tuple[PrefillRequest, ...]


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
    stored as tuples. Checks run once, on construction (see :meth:`validate`), and build the two
    views :attr:`decode` and :attr:`prefill`; the object is immutable.
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
    #: the decode part (None: no decode request), built on construction
    decode: DecodeMetadata | None = field(init=False, repr=False)
    #: the prefill part (None: no prefill request), built on construction
    prefill: PrefillMetadata | None = field(init=False, repr=False)

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
        self._check()
        object.__setattr__(self, "decode", self._decode_view())
        object.__setattr__(self, "prefill", self._prefill_view())

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

        Construction already ran these checks (without ``num_slots``); call it again only to
        add the cache's ``num_slots`` (or use :meth:`check_num_slots`, which checks just that).

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
        self._check()
        if num_slots is not None:
            self.check_num_slots(num_slots)

    def _check(self) -> None:
        """:meth:`validate` without ``num_slots``: what construction checks."""
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

    def check_num_slots(self, num_slots: int) -> None:
        """Check the metadata against a KV cache of ``num_slots = num_blocks * block_size`` rows:
        a positive multiple of ``block_size``, at least ``max_seq_len`` (the longest request
        fits) and, when ``block_table_cpu`` is present, above every block id in it (host values
        only). Raises as :meth:`validate`."""
        bs, max_seq_len, rows = self.block_size, self.max_seq_len, self.block_table_cpu
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

    # ------------------------------------------------------------------------- views

    def _decode_view(self) -> DecodeMetadata | None:
        # narrow(), not indexing: a view by host ints, whatever the device (no sync)
        nd = self.num_decodes
        if nd == 0:
            return None
        return DecodeMetadata(
            num_tokens=nd,
            block_table=self.block_table.narrow(0, 0, nd),
            seq_lens=self.seq_lens.narrow(0, 0, nd),
            slot_mapping=self.slot_mapping.narrow(0, 0, nd),
            positions=self.positions.narrow(0, 0, nd),
        )

    def _prefill_view(self) -> PrefillMetadata | None:
        nd, npf, D = self.num_decodes, self.num_prefills, self.num_decode_tokens
        if npf == 0:
            return None
        n, bs, qsl = self.num_prefill_tokens, self.block_size, self.query_start_loc_cpu
        table = self.block_table.narrow(0, nd, npf)
        requests = []
        for i, r in enumerate(range(nd, nd + npf)):
            seq_len = self.seq_lens_cpu[r]
            blocks = table.narrow(0, i, 1).narrow(1, 0, math.ceil(seq_len / bs))
            requests.append(PrefillRequest(qsl[r] - D, qsl[r + 1] - D, seq_len, blocks))
        return PrefillMetadata(
            token_start=D,
            num_tokens=n,
            block_table=table,
            seq_lens=self.seq_lens.narrow(0, nd, npf),
            slot_mapping=self.slot_mapping.narrow(0, D, n),
            positions=self.positions.narrow(0, D, n),
            requests=tuple(requests),
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


#: names that lived here until 0.5.0 and moved with the toy scheduler
_MOVED = ("BlockAllocator", "RequestStep", "build_metadata", "PADDING_ROW", "token_request_index")


def __getattr__(name: str):
    if name in _MOVED:
        raise ImportError(
            f"fusemla.metadata.{name} moved to fusemla.testing.scheduler (the toy scheduler for "
            f"tests, demos and benchmarks): from fusemla.testing.scheduler import {name}"
        )
    raise AttributeError(f"module 'fusemla.metadata' has no attribute {name!r}")
