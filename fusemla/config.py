"""Runtime switches read from the environment.

``FUSEMLA_DEBUG_CHECKS=1``
    Before each launch, copy ``positions`` and ``slot_mapping`` to the host and raise
    :class:`~fusemla.errors.FuseMLAValueError` if a position is outside the RoPE cache or a slot is
    past the end of the KV cache. This synchronizes the device (it is a debugging aid, not for
    CUDA-graph capture). Without it the kernel never reads or writes out of bounds: positions are
    clamped into ``[0, max_position)`` and slots ``>= num_blocks * block_size`` are skipped like
    negative ones.

``FUSEMLA_FP8_ACTIVATIONS`` = ``auto`` (default) | ``on`` | ``off``
    How kernels with FP8 weights treat the activations. ``on`` (also ``1``/``true``/``yes``):
    quantize them in the kernel per token and head and run the FP8 tensor-core dot; ``off``
    (also ``0``/``false``/``no``): keep bf16 activations and upcast the weights in registers;
    ``auto``: FP8 activations when the chip has FP8 tensor cores and the batch has at least
    :data:`fusemla.platform.FP8_ACT_MIN_BATCH` tokens (None, i.e. never, since they lost to
    bf16 activations at every shape measured on the H200). Read on every call
    (:func:`fusemla.platform.choose_fp8_activations`); any other value raises
    :class:`~fusemla.errors.FuseMLAValueError`. ``on`` is obeyed even on chips without FP8
    tensor cores (it is meant for experiments).

``FUSEMLA_MXFP4_PATH`` = ``auto`` (default) | ``dot_scaled`` | ``dequant``
    How kernels with MXFP4 weights multiply: ``dot_scaled`` feeds the packed FP4 values and
    their E8M0 scales to ``tl.dot_scaled`` (hardware MX dots on Blackwell and gfx950);
    ``dequant`` expands them to bf16 in registers first; ``auto`` picks ``dot_scaled`` exactly
    when the chip has native FP4 dots. Forcing ``dot_scaled`` on a GPU without native FP4
    raises :class:`~fusemla.errors.FuseMLAValueError` (it is allowed under the Triton
    interpreter, which emulates ``tl.dot_scaled``). Read on every call
    (:func:`fusemla.platform.choose_mxfp4_path`).

Empty values count as unset; values are case-insensitive and surrounding blanks are ignored.
"""

from __future__ import annotations

import os

from fusemla.errors import FuseMLAValueError

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


FP8_ACTIVATIONS_ENV = "FUSEMLA_FP8_ACTIVATIONS"
MXFP4_PATH_ENV = "FUSEMLA_MXFP4_PATH"

_FP8_ACT_MODES = {
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


def fp8_activations_mode() -> str:
    """``FUSEMLA_FP8_ACTIVATIONS`` normalized to "auto" | "on" | "off" (unset or empty: "auto").

    Raises :class:`~fusemla.errors.FuseMLAValueError` naming the variable for any other value.
    """
    return _env_choice(FP8_ACTIVATIONS_ENV, _FP8_ACT_MODES,
                       "auto, on/1/true/yes or off/0/false/no")


def mxfp4_path_mode() -> str:
    """``FUSEMLA_MXFP4_PATH`` normalized to "auto" | "dot_scaled" | "dequant" (unset/empty: "auto").

    Raises :class:`~fusemla.errors.FuseMLAValueError` naming the variable for any other value.
    """
    return _env_choice(MXFP4_PATH_ENV, _MXFP4_PATH_MODES, "auto, dot_scaled or dequant")
