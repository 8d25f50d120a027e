"""Exceptions raised by fusemla's host-side input checks.

Every check runs before a kernel is launched or a byte is written, and every message names the
argument, what was expected and what was given, so an engine developer can fix the call site
without reading the kernel.
"""

from __future__ import annotations


class FuseMLAError(Exception):
    """Base class of every error fusemla raises on purpose."""


class FuseMLAValueError(FuseMLAError, ValueError):
    """An argument has the wrong shape, rank, layout or value."""


class FuseMLATypeError(FuseMLAError, TypeError):
    """An argument has the wrong dtype, device or Python type."""


def describe(x: object) -> str:
    """A short description of an argument for error messages (shape, dtype, device, strides)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        torch = None
    if torch is not None and isinstance(x, torch.Tensor):
        return (
            f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device}, "
            f"stride={tuple(x.stride())})"
        )
    return f"{type(x).__name__}({x!r})"
