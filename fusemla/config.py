"""Runtime switches read from the environment, through the one table of them.

Every ``FUSEMLA_*`` variable (name, type, default, accepted values, documentation) is declared
in :data:`fusemla.envs.VARIABLES`; the functions here read the ones the kernels and the layer
use. A bad value raises :class:`~fusemla.errors.FuseMLAValueError` naming the variable and the
accepted values. ``python -m fusemla info`` prints them all with the values in force.
``TRITON_INTERPRET`` is Triton's: :func:`interpreting` asks Triton, which accepts the spellings
it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusemla import envs
from fusemla.errors import FuseMLATypeError, describe

MXFP4_PATH_ENV = "FUSEMLA_MXFP4_PATH"
PDL_ENV = "FUSEMLA_PDL"
PDL_TRIGGER_ENV = "FUSEMLA_PDL_TRIGGER"
FUSED_DECODE_ENV = "FUSEMLA_FUSED_DECODE"
FUSED_PREFILL_ENV = "FUSEMLA_FUSED_PREFILL"


def debug_checks() -> bool:
    """Whether the slow, syncing bounds checks are on (``FUSEMLA_DEBUG_CHECKS``)."""
    return envs.get("FUSEMLA_DEBUG_CHECKS")


def interpreting() -> bool:
    """Whether Triton runs its kernels in the CPU interpreter (Triton's ``TRITON_INTERPRET``,
    as Triton itself reads it)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def pdl_mode() -> str:
    """``FUSEMLA_PDL`` normalized to "auto" | "on" | "off" (unset or empty: "auto")."""
    return envs.get(PDL_ENV)


def pdl_trigger() -> bool:
    """``FUSEMLA_PDL_TRIGGER`` (default off): whether a PDL-launched fusemla kernel lets the
    next kernel launch at its start rather than at its completion."""
    return envs.get(PDL_TRIGGER_ENV)


def mxfp4_path_mode() -> str:
    """``FUSEMLA_MXFP4_PATH``: "auto" | "dot_scaled" | "dequant" (unset or empty: "auto")."""
    return envs.get(MXFP4_PATH_ENV)


def fused_decode() -> bool:
    """``FUSEMLA_FUSED_DECODE`` (default on): whether :class:`fusemla.layers.MLAAttention` runs
    the decode tokens' prologue in the fused Triton kernel (off: the unfused reference)."""
    return envs.get(FUSED_DECODE_ENV)


def fused_prefill() -> bool:
    """``FUSEMLA_FUSED_PREFILL`` (default on): whether :class:`fusemla.layers.MLAAttention` runs
    the prefill tokens' prologue (RoPE + cache write) in the fused Triton kernel."""
    return envs.get(FUSED_PREFILL_ENV)


@dataclass(frozen=True)
class MLAConfig:
    """Per-layer choice of the fused paths of :class:`fusemla.layers.MLAAttention`.

    ``fused_decode`` / ``fused_prefill``: True (fused Triton prologue), False (the unfused
    plain-PyTorch reference, :func:`fusemla.mla_prologue_ref`) or None (read
    ``FUSEMLA_FUSED_DECODE`` / ``FUSEMLA_FUSED_PREFILL`` at call time; both default on).
    An explicit value overrides the environment.
    """

    fused_decode: bool | None = None
    fused_prefill: bool | None = None

    def __post_init__(self) -> None:
        for name in ("fused_decode", "fused_prefill"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise FuseMLATypeError(
                    f"{name}: expected None (read the environment) or a bool, got {describe(value)}"
                )

    def resolve(self) -> tuple[bool, bool]:
        """The effective ``(fused_decode, fused_prefill)``; None fields read the environment now.

        Raises :class:`~fusemla.errors.FuseMLAValueError` for a bad environment value.
        """
        dec = fused_decode() if self.fused_decode is None else self.fused_decode
        pre = fused_prefill() if self.fused_prefill is None else self.fused_prefill
        return dec, pre
