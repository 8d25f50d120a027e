"""Which variant of the prologue kernel runs: the op's policy over what the platform can do
(:mod:`fusemla.platform`) and the environment's overrides (:mod:`fusemla.envs`).

:func:`fusemla.ops.prologue.launch.plan` is the one caller that turns these choices into a
launch; ``fusemla info`` prints them (:func:`report_lines`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fusemla import config
from fusemla.errors import FuseMLAValueError
from fusemla.ops.common import choose_pdl, choose_pdl_trigger
from fusemla.platform import PlatformInfo, check_info

__all__ = [
    "PrologueVariant",
    "choose_mxfp4_path",
    "choose_pdl",
    "choose_prologue_variant",
    "mxfp4_tiles_fit",
    "report_lines",
]


def choose_mxfp4_path(info: PlatformInfo) -> str:
    """How MXFP4 weights are multiplied: "dot_scaled" (``tl.dot_scaled``) or "dequant".

    "auto" (default of ``FUSEMLA_MXFP4_PATH``) gives "dot_scaled" exactly when
    ``info.native_fp4``. The variable can force either; forcing "dot_scaled" is allowed on
    native-FP4 chips and under the Triton interpreter (which emulates ``tl.dot_scaled``).

    Raises:
        FuseMLAValueError: ``FUSEMLA_MXFP4_PATH`` is invalid, or is "dot_scaled" on a platform
            without native FP4 dots.
        FuseMLATypeError: ``info`` is not a PlatformInfo.
    """
    check_info(info)
    mode = config.mxfp4_path_mode()
    if mode == "auto":
        return "dot_scaled" if info.native_fp4 else "dequant"
    if mode == "dot_scaled" and not (info.native_fp4 or info.backend == "interpreter"):
        where = f"{info.backend} {info.arch}" if info.arch else info.backend
        if info.backend == "cpu":
            why = "the PyTorch fallback runs no Triton kernel"
        else:
            why = (
                "it has no hardware FP4 (MX) dots; those need compute capability >= 10.0 "
                "(Blackwell) or gfx950"
            )
        raise FuseMLAValueError(
            f"environment variable {config.MXFP4_PATH_ENV}=dot_scaled cannot be used on "
            f"{where}: {why}. Unset it or set it to 'dequant'"
        )
    return mode


@dataclass(frozen=True)
class PrologueVariant:
    """Which variant of the prologue kernel runs: the one decision, made by
    :func:`choose_prologue_variant` for the launcher, ``fusemla info`` and tests."""

    #: "plain" (weights in the activations' dtype), "fp8" or "mxfp4"
    weight_format: str
    #: MXFP4 weights only: "dot_scaled" or "dequant"; None for other formats
    mxfp4_path: str | None
    #: FP8 block scales only: the columns (along L) of a scale block; None otherwise
    block_n: int | None = None

    @property
    def kernel_flags(self) -> tuple[int, bool]:
        """(W_FMT, MX_NATIVE) as the kernel takes them (W_FMT 3: FP8 with block scales)."""
        w_fmt = {"plain": 0, "fp8": 1, "mxfp4": 2}[self.weight_format]
        if self.block_n is not None:
            w_fmt = 3
        return w_fmt, self.mxfp4_path == "dot_scaled"


def mxfp4_tiles_fit(P: int, L: int, block_l: int) -> bool:
    """Whether ``tl.dot_scaled`` can take the kernel's weight tiles: it needs whole, unmasked
    tiles, so P a power of two (one [P, BLOCK_L] tile, whole 32-element scale blocks) and
    L a multiple of BLOCK_L."""
    return P >= 32 and P & (P - 1) == 0 and L % block_l == 0


def choose_prologue_variant(
    info: PlatformInfo,
    *,
    weight_format: str,
    P: int | None = None,
    L: int | None = None,
    block_l: int | None = None,
    block: tuple[int, int] | None = None,
) -> PrologueVariant:
    """The prologue kernel variant for ``info`` and a weight format (the same for any batch).

    Plain weights have one variant, FP8 weights two (FP8 weights are upcast to the
    activations' dtype in registers): a per-tensor / per-head scale, or ``block`` scales (the
    block's rows along P, columns along L; one block row must cover P, as DeepSeek's 128 x
    128 blocks do at P = 128). MXFP4 weights: :func:`choose_mxfp4_path`; when the tiles (``P``,
    ``L``, ``block_l``; see :func:`mxfp4_tiles_fit`) cannot feed ``tl.dot_scaled``, "auto"
    picks "dequant" and a forced ``FUSEMLA_MXFP4_PATH=dot_scaled`` raises.

    Raises:
        FuseMLAValueError: an unknown weight format, an invalid environment override, or a
            forced choice that cannot run here.
    """
    check_info(info)
    if weight_format == "fp8" and block is not None:
        if P is not None and block[0] < P:
            raise FuseMLAValueError(
                f"w_uk_t: FP8 block scales of {block[0]} rows cannot cover P={P}: the prologue "
                "reads block scales whose rows span all of P (DeepSeek's 128 x 128 at P = 128)"
            )
        return PrologueVariant("fp8", None, block[1])
    if weight_format in ("plain", "fp8"):
        return PrologueVariant(weight_format, None)
    if weight_format != "mxfp4":
        raise FuseMLAValueError(
            f"weight_format: expected 'plain', 'fp8' or 'mxfp4', got {weight_format!r}"
        )
    path = choose_mxfp4_path(info)
    if path == "dot_scaled" and None not in (P, L, block_l) and not mxfp4_tiles_fit(P, L, block_l):
        if config.mxfp4_path_mode() == "dot_scaled":
            raise FuseMLAValueError(
                f"environment variable {config.MXFP4_PATH_ENV}=dot_scaled cannot run with "
                f"P={P}, L={L} and tile BLOCK_L={block_l}: tl.dot_scaled needs P a power of two "
                ">= 32 and L a multiple of BLOCK_L. Unset it or set it to 'dequant'"
            )
        path = "dequant"
    return PrologueVariant("mxfp4", path)


def report_lines(info: PlatformInfo) -> list[str]:
    """The variant choices on ``info`` at DeepSeek-V3 dims, for ``fusemla info``. Never raises
    on a bad environment override: the line of that variable says what is wrong."""
    check_info(info)
    lines = []
    dims = dict(P=128, L=512, block_l=128)  # DeepSeek-V3
    try:
        path = choose_prologue_variant(info, weight_format="mxfp4", **dims).mxfp4_path
    except FuseMLAValueError as exc:
        path = f"error: {exc}"
    lines.append(f"  MXFP4 weights: {path}")
    try:
        on = choose_pdl(info)
        trigger = "at its start" if choose_pdl_trigger(on) else "when it completes"
        pdl = f"on (the next kernel may launch {trigger})" if on else "off"
    except FuseMLAValueError as exc:
        pdl = f"error: {exc}"
    lines.append(f"  programmatic dependent launch: {pdl}")
    return lines
