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


def no_overlap(
    written: Sequence[tuple[str, torch.Tensor]], read: Sequence[tuple[str, torch.Tensor]]
) -> None:
    """No tensor the kernel writes shares memory with another one it writes or reads: one
    program's stores would land in what another still reads (a corrupted result, not an
    error). Tensors on one storage (views of one buffer) are compared by address range, so two
    views that interleave without sharing an element (even and odd rows) are refused too;
    tensors on different storages are taken as apart (a storage is one allocation). Skipped
    while torch.compile traces (fake tensors have no addresses): the op's eager call checks."""
    if not written or torch.compiler.is_compiling():
        return
    named = (*written, *read)
    bases = [x.untyped_storage().data_ptr() for _, x in named]
    for i in range(len(written)):
        for j in range(i + 1, len(named)):
            if bases[i] != bases[j]:
                continue
            (name, x), (other, y) = named[i], named[j]
            a, b = _byte_span(x), _byte_span(y)
            if a is not None and b is not None and a[0] < b[1] and b[0] < a[1]:
                raise FuseMLAValueError(
                    f"{name}: expected memory apart from {other}'s, got {describe(x)} over "
                    f"bytes {a[0]:#x}-{a[1]:#x} of one buffer, {other} over {b[0]:#x}-{b[1]:#x}"
                )
