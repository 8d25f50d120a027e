"""Runtime switches read from the environment.

``FUSEMLA_DEBUG_CHECKS=1``
    Before each launch, copy ``positions`` and ``slot_mapping`` to the host and raise
    :class:`~fusemla.errors.FuseMLAValueError` if a position is outside the RoPE cache or a slot is
    past the end of the KV cache. This synchronizes the device (it is a debugging aid, not for
    CUDA-graph capture). Without it the kernel never reads or writes out of bounds: positions are
    clamped into ``[0, max_position)`` and slots ``>= num_blocks * block_size`` are skipped like
    negative ones.

``FUSEMLA_MXFP4_PATH`` = ``auto`` (default) | ``dot_scaled`` | ``dequant``
    How kernels with MXFP4 weights multiply: ``dot_scaled`` feeds the packed FP4 values and
    their E8M0 scales to ``tl.dot_scaled`` (hardware MX dots on Blackwell and gfx950);
    ``dequant`` expands them to bf16 in registers first; ``auto`` picks ``dot_scaled`` exactly
    when the chip has native FP4 dots. Forcing ``dot_scaled`` on a GPU without native FP4
    raises :class:`~fusemla.errors.FuseMLAValueError` (it is allowed under the Triton
    interpreter, which emulates ``tl.dot_scaled``). Read on every call
    (:func:`fusemla.platform.choose_mxfp4_path`).

``FUSEMLA_FUSED_DECODE`` = ``1`` (default) | ``0``
    Whether :class:`fusemla.layers.MLAAttention` runs the decode tokens' prologue (absorbed BMM,
    RoPE, concat, cache write) in the fused Triton kernel; off: the unfused plain-PyTorch
    reference (:func:`fusemla.mla_prologue_ref`). Accepts 1/true/yes/on and 0/false/no/off; any
    other value raises :class:`~fusemla.errors.FuseMLAValueError` naming the variable. Read on
    every layer call (:func:`fused_decode`) unless :class:`MLAConfig` sets ``fused_decode``.

``FUSEMLA_FUSED_PREFILL`` = ``1`` (default) | ``0``
    The same for the prefill tokens' prologue (RoPE + cache write): :func:`fused_prefill`,
    ``MLAConfig.fused_prefill``. With both on, a mixed batch runs one launch for all tokens.
    Under ``torch.compile`` both are read when the layer is traced (dynamo does not guard on
    them): set them before compiling, or use :class:`MLAConfig`.

``FUSEMLA_PDL`` = ``auto`` (default) | ``on`` | ``off``
    Programmatic dependent launch of the prologue kernel (NVIDIA sm_90+, Triton >= 3.4): the
    kernel may start while the kernel before it still runs, loading its weights early.
    ``auto``: on where supported (:func:`fusemla.platform.choose_pdl`); ``on`` (also
    ``1``/``true``/``yes``) where unsupported raises; ``off`` (also ``0``/``false``/``no``):
    plain launches. Any other value raises :class:`~fusemla.errors.FuseMLAValueError`.

Empty values count as unset; values are case-insensitive and surrounding blanks are ignored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fusemla.errors import FuseMLATypeError, FuseMLAValueError, describe

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


MXFP4_PATH_ENV = "FUSEMLA_MXFP4_PATH"

#: auto / on / off, with the spellings of a boolean switch
_AUTO_ON_OFF_MODES = {
    "auto": "auto",
    **{v: "on" for v in ("on", "1", "true", "yes")},
    **{v: "off" for v in ("off", "0", "false", "no")},
}
_MXFP4_PATH_MODES = {
    "auto": "auto",
    "dot_scaled": "dot_scaled",
    "dot-scaled": "dot_scaled",
    "dequant": "dequant",
}


def _env_choice(name: str, choices: dict[str, str], expected: str) -> str:
    """The normalized value of an enumerated environment variable; "auto" when unset or empty."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return "auto"
    mode = choices.get(raw.strip().lower())
    if mode is None:
        raise FuseMLAValueError(f"environment variable {name}: expected {expected}, got {raw!r}")
    return mode


PDL_ENV = "FUSEMLA_PDL"


def pdl_mode() -> str:
    """``FUSEMLA_PDL`` normalized to "auto" | "on" | "off" (unset or empty: "auto").

    Raises :class:`~fusemla.errors.FuseMLAValueError` naming the variable for any other value.
    """
    return _env_choice(PDL_ENV, _AUTO_ON_OFF_MODES, "auto, on/1/true/yes or off/0/false/no")


def mxfp4_path_mode() -> str:
    """``FUSEMLA_MXFP4_PATH`` normalized to "auto" | "dot_scaled" | "dequant" (unset/empty: "auto").

    Raises :class:`~fusemla.errors.FuseMLAValueError` naming the variable for any other value.
    """
    return _env_choice(MXFP4_PATH_ENV, _MXFP4_PATH_MODES, "auto, dot_scaled or dequant")


# ----------------------------------------------------------------------------- fused-path flags

FUSED_DECODE_ENV = "FUSEMLA_FUSED_DECODE"
FUSED_PREFILL_ENV = "FUSEMLA_FUSED_PREFILL"

_SWITCH_VALUES = {
    **{v: True for v in ("1", "true", "yes", "on")},
    **{v: False for v in ("0", "false", "no", "off")},
}


def env_switch(name: str, default: bool) -> bool:
    """A strict on/off environment variable: 1/true/yes/on or 0/false/no/off.

    Unset or empty gives ``default``; values are case-insensitive and surrounding blanks are
    ignored. Any other value raises :class:`~fusemla.errors.FuseMLAValueError` naming the
    variable and the allowed values (a typo must not silently select a path).
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = _SWITCH_VALUES.get(raw.strip().lower())
    if value is None:
        raise FuseMLAValueError(
            f"environment variable {name}: expected 1/true/yes/on or 0/false/no/off, got {raw!r}"
        )
    return value


def fused_decode() -> bool:
    """``FUSEMLA_FUSED_DECODE`` (default on): whether :class:`fusemla.layers.MLAAttention` runs
    the decode tokens' prologue in the fused Triton kernel (off: the unfused reference)."""
    return env_switch(FUSED_DECODE_ENV, True)


def fused_prefill() -> bool:
    """``FUSEMLA_FUSED_PREFILL`` (default on): whether :class:`fusemla.layers.MLAAttention` runs
    the prefill tokens' prologue (RoPE + cache write) in the fused Triton kernel."""
    return env_switch(FUSED_PREFILL_ENV, True)


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
