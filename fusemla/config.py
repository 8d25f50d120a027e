"""Runtime switches read from the environment.

``FUSEMLA_DEBUG_CHECKS=1``
    Before each launch, copy ``positions`` and ``slot_mapping`` to the host and raise
    :class:`~fusemla.errors.FuseMLAValueError` if a position is outside the RoPE cache or a slot is
    past the end of the KV cache. This synchronizes the device (it is a debugging aid, not for
    CUDA-graph capture). Without it the kernel never reads or writes out of bounds: positions are
    clamped into ``[0, max_position)`` and slots ``>= num_blocks * block_size`` are skipped like
    negative ones.
"""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}


def env_flag(name: str, default: bool = False) -> bool:
    """Read a boolean environment variable (1/true/yes/on, case-insensitive)."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in _TRUE


def debug_checks() -> bool:
    """Whether the slow, syncing bounds checks are on (``FUSEMLA_DEBUG_CHECKS``)."""
    return env_flag("FUSEMLA_DEBUG_CHECKS")


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return env_flag("TRITON_INTERPRET")
