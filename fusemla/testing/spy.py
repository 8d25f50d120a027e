"""Record what the launcher really ran (for tests): :func:`recorded_launch_plans`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def recorded_launch_plans() -> Iterator[list]:
    """Within the block, every kernel launch appends the
    :class:`~fusemla.ops.prologue.launch.LaunchPlan` it ran (its tiles and program counts) to the
    yielded list. Nothing is recorded where fusemla's PyTorch reference runs instead."""
    from fusemla.ops.prologue import launch as launch_mod

    plans: list = []
    orig = launch_mod.plan

    def recorded(*args, **kwargs):
        p = orig(*args, **kwargs)
        plans.append(p)
        return p

    launch_mod.plan = recorded
    try:
        yield plans
    finally:
        launch_mod.plan = orig
