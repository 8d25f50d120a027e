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
