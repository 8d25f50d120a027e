"""The one launch spy of the tests and the engine test support: what the prologue really ran.

:class:`PrologueSpy` wraps, while installed, fusemla's fused kernel launch
(``fusemla.ops.prologue.launch.launch``), the plan each launch runs (``launch.plan``), the
unfused reference prologue (``fusemla.reference.prologue.prologue_into``, also the CPU fallback
of the fused op) and the reference's only cache write (``write_cache_rows``), and records them in
order. Each wrapper first calls an optional hook with the call's
:class:`~fusemla.contracts.prologue.PrologueArgs` (the vLLM worker extension logs slots there).
Nothing is recorded where no Python runs: a kernel a captured CUDA graph replays, a reference
prologue that torch.compile traced into its graph (the fused launch runs inside the custom op,
outside the graph, so it is recorded).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["PrologueSpy", "recorded_launch_plans"]

Hook = Callable[[Any], None]


class PrologueSpy:
    """Records the prologue's calls while installed (``with PrologueSpy() as spy:``, or
    :meth:`install` for the rest of the process).

    ``launches``: the ``PrologueArgs`` of each fused kernel launch; ``plans``: the
    ``LaunchPlan`` of each (tiles, program counts); ``reference``: the ``PrologueArgs`` of each
    reference prologue; ``cache_writes``: the rows of each reference cache write.
    ``on_launch`` / ``on_reference``: hooks called with the args before each launch / reference.
    ``keep=False``: record nothing, only call the hooks (an install for a whole engine run then
    holds no step's tensors alive).
    """

    def __init__(
        self,
        *,
        on_launch: Hook | None = None,
        on_reference: Hook | None = None,
        keep: bool = True,
    ):
        self.launches: list = []
        self.plans: list = []
        self.reference: list = []
        self.cache_writes: list[int] = []
        self._hooks = (on_launch, on_reference)
        self._keep = keep
        self._undo: list = []

    def take(self) -> dict:
        """``{"launch": [(N, D) per launch], "ref_write": [rows per reference cache write]}``
        since the last take, then forget them all."""
        out = {
            "launch": [(int(a.N), int(a.D)) for a in self.launches],
            "ref_write": list(self.cache_writes),
        }
        self.launches, self.plans, self.reference, self.cache_writes = [], [], [], []
        return out

    def install(self) -> PrologueSpy:
        """Wrap the four functions (each in its module; callers look them up there)."""
        import fusemla.ops.prologue.launch as launch_mod
        import fusemla.reference.prologue as ref_mod

        on_launch, on_reference = self._hooks

        def launch(real):
            def spied(args, cfg=None):
                if torch.compiler.is_compiling():
                    return real(args, cfg)
                if on_launch is not None:
                    on_launch(args)
                if self._keep:
                    self.launches.append(args)
                return real(args, cfg)

            return spied

        def plan(real):
            def spied(*args, **kwargs):
                if torch.compiler.is_compiling():
                    return real(*args, **kwargs)
                p = real(*args, **kwargs)
                if self._keep:
                    self.plans.append(p)
                return p

            return spied

        def prologue_into(real):
            def spied(args):
                if torch.compiler.is_compiling():
                    return real(args)
                if on_reference is not None:
                    on_reference(args)
                if self._keep:
                    self.reference.append(args)
                return real(args)

            return spied

        def write_cache_rows(real):
            def spied(cache, slots, rows):
                if self._keep and not torch.compiler.is_compiling():
                    self.cache_writes.append(int(slots.shape[0]))
                return real(cache, slots, rows)

            return spied

        for module, wrap in (
            (launch_mod, launch),
            (launch_mod, plan),
            (ref_mod, prologue_into),
            (ref_mod, write_cache_rows),
        ):
            real = getattr(module, wrap.__name__)
            self._undo.append((module, wrap.__name__, real))
            setattr(module, wrap.__name__, wrap(real))
        return self

    def uninstall(self) -> None:
        """Put the real functions back."""
        while self._undo:
            module, name, real = self._undo.pop()
            setattr(module, name, real)

    def __enter__(self) -> PrologueSpy:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


@contextlib.contextmanager
def recorded_launch_plans() -> Iterator[list]:
    """Within the block, every kernel launch appends the
    :class:`~fusemla.ops.prologue.launch.LaunchPlan` it ran (its tiles and program counts) to the
    yielded list. Nothing is recorded where fusemla's PyTorch reference runs instead."""
    with PrologueSpy() as spy:
        yield spy.plans


class KernelSpy:
    """Stands in for a Triton kernel object in a launcher module (monkeypatch it in): records
    every ``kernel[grid](**kwargs)``, then runs the real kernel with them (``calls``)."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __getitem__(self, grid):
        def call(**kwargs):
            self.calls.append((grid, kwargs))
            return self.real[grid](**kwargs)

        return call
