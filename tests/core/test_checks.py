"""The host-side overlap rules (fusemla.contracts.checks) against brute force: on random strided
views of one buffer, a pair called apart by its columns shares no byte, and a pair called
``y[first:]`` is exactly those elements."""

from __future__ import annotations

import random

import torch

from fusemla.contracts.checks import columns_apart, rows_of


def _bytes(x: torch.Tensor) -> set[int]:
    """Every byte address of ``x``'s elements, relative to its storage."""
    base = x.untyped_storage().data_ptr()
    idx = torch.zeros(x.shape, dtype=torch.int64)
    for d, (n, s) in enumerate(zip(x.shape, x.stride())):
        shape = [1] * x.dim()
        shape[d] = n
        idx = idx + (torch.arange(n) * s).view(shape)
    first = (x.data_ptr() - base) // x.element_size()
    es = x.element_size()
    return {(first + int(i)) * es + b for i in idx.flatten() for b in range(es)}


def _random_view(buf: torch.Tensor, rng: random.Random, period: int) -> torch.Tensor:
    """A view of ``buf`` laid out as rows ``period`` elements apart (as the ops' callers make
    them), often with a stride that breaks the pattern."""
    dims = rng.choice([1, 2, 3])
    shape = [rng.randint(1, 3) for _ in range(dims - 1)] + [rng.randint(1, 6)]
    strides = [period * rng.randint(1, 4) for _ in range(dims - 1)] + [1]
    for d in range(dims - 1):
        if rng.random() < 0.2:  # a row that does not start a whole number of periods on
            strides[d] += rng.randint(1, period - 1)
    offset = rng.randint(0, 2 * period)
    return buf.as_strided(shape, strides, offset)


def test_columns_apart_and_rows_of_against_brute_force():
    buf = torch.zeros(4096, dtype=torch.bfloat16)
    rng = random.Random(7)
    apart = exact = 0
    for _ in range(3000):
        period = rng.choice([8, 12, 16])
        x = _random_view(buf, rng, period)
        y = _random_view(buf, rng, period if rng.random() < 0.8 else 2 * period)
        if columns_apart(x, y):
            apart += 1
            assert not _bytes(x) & _bytes(y), (x.shape, x.stride(), y.shape, y.stride())
        first = rng.randint(0, 2)
        z = y[first:] if rng.random() < 0.5 else x
        if rows_of(z, y, first):
            exact += 1
            assert _bytes(z) == _bytes(y[first:])
            assert z.shape == y[first:].shape
    assert apart > 100 and exact > 100  # both rules said yes often enough to be tested


def test_columns_apart_named_cases():
    q = torch.zeros(5, 4, 48, dtype=torch.bfloat16)
    assert columns_apart(q[:, :, :32], q[2:, :, 32:])  # vLLM's q_nope | q_pe
    assert not columns_apart(q[:, :, :33], q[2:, :, 32:])  # one column shared
    assert not columns_apart(q[0::2], q[1::2])  # interleaved rows: not shown apart
    # rows 20 elements apart are not whole periods of 8: their columns move (4-7 in row 2)
    buf = torch.zeros(64, dtype=torch.bfloat16)
    assert not columns_apart(buf.as_strided((2, 2, 4), (20, 8, 1), 0), buf[20:36].view(2, 8)[:, :4])
    # a 0-dim tensor is one element at its own offset: in the columns it takes, not column 0
    flat = q.view(-1)
    assert not columns_apart(q[:, :, 40:], flat[40])
    assert columns_apart(q[:, :, 40:], flat[8])
    assert rows_of(q[2:, :, 32:], q[:, :, 32:], 2)
    assert not rows_of(q[1:4, :, 32:], q[:, :, 32:], 2)
    assert not rows_of(q[2:].view(torch.float16), q[:, :, :], 2)
