"""Host-side argument checks shared by the ops' contracts (no device sync; errors name the
argument). Every check raises the project's typed errors (:mod:`fusemla.errors`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fusemla.errors import FuseMLATypeError, FuseMLAValueError, describe


def tensor(name: str, x: object) -> torch.Tensor:
    """``x`` itself, if it is a tensor."""
    if not isinstance(x, torch.Tensor):
        raise FuseMLATypeError(f"{name}: expected a torch.Tensor, got {describe(x)}")
    return x


def shape(
    name: str, x: torch.Tensor, expected: Sequence[int | None], what: Callable[[], str]
) -> None:
    """Check ``x``'s shape against ``expected`` (None: any size). ``what`` builds the expected
    shape's text, and is called only when the check fails: formatting a size into a string
    under ``torch.compile`` would specialize a symbolic (dynamic) batch size to a constant."""
    ok = x.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, x.shape))
    if not ok:
        raise FuseMLAValueError(f"{name}: expected shape {what()}, got {describe(x)}")


def dtype(name: str, x: torch.Tensor, allowed: Sequence[torch.dtype], hint: str = "") -> None:
    """``x.dtype`` is one of ``allowed`` (``hint``: what else the argument may be)."""
    if x.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise FuseMLATypeError(f"{name}: expected dtype in ({names}){hint}, got {describe(x)}")


def last_contiguous(name: str, x: torch.Tensor) -> None:
    """The last dimension has stride 1 (any other strides are fine)."""
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise FuseMLAValueError(
            f"{name}: the last dimension must be contiguous (stride 1), got {describe(x)}"
        )


def flag(name: str, x: object) -> bool:
    """A real bool (not an int that happens to be 0 or 1)."""
    if not isinstance(x, bool):
        raise FuseMLATypeError(f"{name}: expected a bool, got {describe(x)}")
    return x


def same_device(named: Sequence[tuple[str, torch.Tensor]], device: torch.device, like: str) -> None:
    """Every named tensor lives on ``device`` (that of the argument ``like``)."""
    for name, x in named:
        if x.device != device:
            raise FuseMLATypeError(
                f"{name}: expected device {device} (like {like}), got {describe(x)}"
            )


def _byte_span(x: torch.Tensor) -> tuple[int, int] | None:
    """The address range ``[first, last + 1)`` of ``x``'s elements (None: no elements)."""
    if x.numel() == 0:
        return None
    extent = sum((n - 1) * s for n, s in zip(x.shape, x.stride()))
    lo = x.data_ptr()
    return lo, lo + (extent + 1) * x.element_size()


def _rows(x: torch.Tensor, base: int) -> tuple[int, int, int] | None:
    """``(period, lo, hi)``: ``x`` seen as rows of its storage, ``period`` bytes apart (its
    smallest outer stride; 0 for a single row), each row taking bytes ``[lo, hi)`` of its
    period from ``base``; every outer stride a whole number of periods and the row no wider
    than one. None where ``x`` is not laid out so (last dimension not contiguous)."""
    es = x.element_size()
    shp, st = x.shape, x.stride()
    n = shp[-1] if shp else 1  # (a 0-dim tensor: one element, a single row)
    if n > 1 and st[-1] != 1:
        return None
    outer = [s * es for k, s in zip(shp[:-1], st[:-1]) if k > 1]
    period = min(outer) if outer else 0
    if period and any(s % period for s in outer):
        return None
    off = x.data_ptr() - base
    lo = off % period if period else off
    return period, lo, lo + n * es


def columns_apart(x: torch.Tensor, y: torch.Tensor) -> bool:
    """True where two views of one storage provably share no element because they take
    disjoint columns of the same rows (e.g. ``q[:, :, :P]`` and ``q[:, :, P:]``: the rows
    interleave, the columns do not). False where that cannot be shown (they may still be
    apart: the caller refuses them then)."""
    base = x.untyped_storage().data_ptr()
    a, b = _rows(x, base), _rows(y, base)
    if a is None or b is None:
        return False
    periods = [p for p in (a[0], b[0]) if p]
    if not periods:  # two single rows: each one contiguous run, the byte ranges tell
        return False
    period = min(periods)
    if any(p % period for p in periods):
        return False
    spans = []
    for _, lo, hi in (a, b):
        lo, hi = lo % period, lo % period + hi - lo
        if hi > period:
            return False
        spans.append((lo, hi))
    (la, ha), (lb, hb) = spans
    return ha <= lb or hb <= la


def rows_of(x: torch.Tensor, y: torch.Tensor, first: int) -> bool:
    """``x`` is exactly the view ``y[first:]``: the same elements in the same order (an
    output written in place over the input it is computed from, element by element)."""
    shp = x.shape
    if x.dtype != y.dtype or len(shp) != y.dim() or not shp or shp[1:] != y.shape[1:]:
        return False
    if shp[0] != y.shape[0] - first or x.data_ptr() != y.data_ptr() + first * y.stride(0) * (
        y.element_size()
    ):
        return False
    return all(k <= 1 or a == b for k, a, b in zip(shp, x.stride(), y.stride()))


def no_overlap(
    written: Sequence[tuple[str, torch.Tensor]],
    read: Sequence[tuple[str, torch.Tensor]],
    in_place: Sequence[tuple[str, str, int]] = (),
) -> None:
    """No tensor the kernel writes shares memory with another one it writes or reads: one
    program's stores would land in what another still reads (a corrupted result, not an
    error). Tensors on different storages are taken as apart (a storage is one allocation);
    views of one storage are apart where their address ranges are, or where they take
    disjoint columns of the same rows (:func:`columns_apart`); any other two views of one
    buffer are refused, also those that interleave without sharing an element (even and odd
    rows). ``in_place``: ``(written, read, first)`` triples the op allows, the written tensor
    being exactly ``read[first:]`` (the kernel reads each such element before it writes it, in
    the same program). Skipped while torch.compile traces (fake tensors have no addresses):
    the op's eager call checks."""
    if not written or torch.compiler.is_compiling():
        return
    named = (*written, *read)
    bases = [x.untyped_storage().data_ptr() for _, x in named]
    for i in range(len(written)):
        for j in range(i + 1, len(named)):
            if bases[i] != bases[j]:
                continue
            (name, x), (other, y) = named[i], named[j]
            if any(w == name and r == other and rows_of(x, y, f) for w, r, f in in_place):
                continue
            a, b = _byte_span(x), _byte_span(y)
            if a is None or b is None or a[1] <= b[0] or b[1] <= a[0] or columns_apart(x, y):
                continue
            raise FuseMLAValueError(
                f"{name}: expected memory apart from {other}'s, got {describe(x)} over "
                f"bytes {a[0]:#x}-{a[1]:#x} of one buffer, {other} over {b[0]:#x}-{b[1]:#x}"
            )
