"""What the current accelerator can do (which kernel variant runs on it is the op's policy:
:mod:`fusemla.ops.prologue.policy`).

One Triton source serves NVIDIA and AMD GPUs, the Triton interpreter and a PyTorch fallback;
they differ in the number formats the chip stores and multiplies:

* FP8 (weights, KV cache, query output): the MI300 family (gfx940/941/942) uses
  ``float8_e4m3fnuz`` (bias 8, no negative zero, max 240); everything else uses the OCP
  ``float8_e4m3fn`` (bias 7, max 448). FP8 weights are upcast to the activations' dtype
  (bf16/fp16) in registers on every platform.
* MXFP4 weights: ``tl.dot_scaled`` maps onto hardware MX dots on the Blackwell family
  (sm_100+, compute capability major >= 10) and gfx950; elsewhere the kernel dequantizes.

:func:`platform_from` derives a :class:`PlatformInfo` from a backend and an architecture name
without touching a device (tests use it to fake platforms); :func:`detect` asks torch about a
real device; :func:`supports_pdl` and the :class:`PlatformInfo` flags say what it can run.

Triton is imported lazily, only for its version string.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from fusemla import config
from fusemla.errors import FuseMLAError, FuseMLATypeError, FuseMLAValueError

__all__ = [
    "BACKENDS",
    "PlatformInfo",
    "supports_pdl",
    "clear_cache",
    "default_fp8_weight_dtype",
    "detect",
    "platform_from",
    "report_lines",
]

#: the values of :attr:`PlatformInfo.backend`
BACKENDS = ("cuda", "rocm", "interpreter", "cpu")
_BACKEND_ALIASES = {"hip": "rocm"}

#: MI300 family: FP8 MFMA in the FNUZ formats
_GFX_FNUZ = frozenset({"gfx940", "gfx941", "gfx942"})
#: AMD chips whose matrix cores take FP8 (gfx12 / RDNA4 and gfx1250 are left out until measured)
_GFX_NATIVE_FP8 = _GFX_FNUZ | {"gfx950"}
#: AMD chips with hardware MX (FP4 with E8M0 block scales) dots
_GFX_NATIVE_FP4 = frozenset({"gfx950"})

_SM_RE = re.compile(r"sm_(\d{2,3})([af]?)")
_GFX_RE = re.compile(r"gfx[0-9a-f]{3,4}")


@dataclass(frozen=True)
class PlatformInfo:
    """One device as the kernels see it. Build with :func:`platform_from` or :func:`detect`."""

    #: "cuda" | "rocm" | "interpreter" (``TRITON_INTERPRET=1``: kernels on the CPU) | "cpu"
    #: (no GPU, no interpreter: the PyTorch fallback runs)
    backend: str
    #: "sm_90", "sm_100", "sm_89", "gfx942", "gfx950", ...; None for "interpreter" and "cpu"
    arch: str | None
    device_name: str | None
    #: FP8 format the matrix units compute in: float8_e4m3fnuz on gfx940/941/942 (MI300),
    #: float8_e4m3fn everywhere else (NVIDIA, gfx950, interpreter, CPU)
    fp8_dtype: torch.dtype
    #: FP8 tensor-core dots: sm_89+, gfx940/941/942, gfx950; the interpreter emulates them
    native_fp8: bool
    #: hardware FP4 (MX) dots for ``tl.dot_scaled``: compute capability major >= 10, gfx950
    native_fp4: bool
    torch_version: str
    triton_version: str | None


# --------------------------------------------------------------------------------------------
# building a PlatformInfo
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _triton_version() -> str | None:
    try:
        import triton
    except Exception:  # noqa: BLE001 - a broken or missing Triton is reported as None
        return None
    return str(getattr(triton, "__version__", None) or "unknown")


def _sm_capability(arch: str) -> tuple[int, int] | None:
    """(major, minor) of "sm_90" / "sm_90a" / "sm_100f" / "sm_121", else None."""
    m = _SM_RE.fullmatch(arch)
    if m is None:
        return None
    digits = m.group(1)
    return int(digits[:-1]), int(digits[-1])


def _normalize_arch(backend: str, arch: object) -> str | None:
    if backend in ("interpreter", "cpu"):
        if arch is not None:
            raise FuseMLAValueError(
                f"arch: expected None for backend {backend!r} (no GPU), got {arch!r}"
            )
        return None
    if not isinstance(arch, str):
        example = "'sm_90'" if backend == "cuda" else "'gfx942'"
        raise FuseMLAValueError(
            f"arch: backend {backend!r} needs an architecture name like {example}, got {arch!r}"
        )
    name = arch.strip().lower()
    if backend == "cuda":
        cap = _sm_capability(name)
        if cap is None or cap[0] < 1:
            raise FuseMLAValueError(
                f"arch: expected an NVIDIA architecture 'sm_<major><minor>' such as 'sm_90' or "
                f"'sm_100a' for backend 'cuda', got {arch!r}"
            )
        return name
    # rocm: accept the full gcnArchName ("gfx942:sramecc+:xnack-") and keep the base name
    name = name.split(":", 1)[0]
    if _GFX_RE.fullmatch(name) is None:
        raise FuseMLAValueError(
            f"arch: expected an AMD architecture 'gfx...' such as 'gfx942' or 'gfx950' for "
            f"backend 'rocm', got {arch!r}"
        )
    return name


def platform_from(
    backend: str, arch: str | None = None, device_name: str | None = None
) -> PlatformInfo:
    """A :class:`PlatformInfo` derived from ``backend`` and ``arch`` alone (no device queries).

    Args:
        backend: "cuda", "rocm" (alias "hip"), "interpreter" or "cpu"; case-insensitive.
        arch: required for "cuda" (``sm_<major><minor>``, an ``a``/``f`` suffix allowed:
            "sm_90", "sm_100a") and "rocm" ("gfx942"; a full gcnArchName such as
            "gfx942:sramecc+:xnack-" is cut to its base name); must be None for "interpreter"
            and "cpu". Stored lower-case.
        device_name: free text for reports (e.g. "NVIDIA H200"), or None.

    Raises:
        FuseMLAValueError: naming the argument, for an unknown backend or a malformed or
            misplaced arch.
        FuseMLATypeError: if ``device_name`` is neither a string nor None.
    """
    if not isinstance(backend, str):
        raise FuseMLAValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    be = backend.strip().lower()
    be = _BACKEND_ALIASES.get(be, be)
    if be not in BACKENDS:
        raise FuseMLAValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if device_name is not None and not isinstance(device_name, str):
        raise FuseMLATypeError(
            f"device_name: expected a str or None, got {type(device_name).__name__}"
        )
    name = _normalize_arch(be, arch)

    fp8_dtype = torch.float8_e4m3fn
    if be == "cuda":
        major, minor = _sm_capability(name)
        native_fp8 = (major, minor) >= (8, 9)
        native_fp4 = major >= 10
    elif be == "rocm":
        if name in _GFX_FNUZ:
            fp8_dtype = torch.float8_e4m3fnuz
        native_fp8 = name in _GFX_NATIVE_FP8
        native_fp4 = name in _GFX_NATIVE_FP4
    elif be == "interpreter":
        native_fp8, native_fp4 = True, False  # it emulates FP8 dots; auto MXFP4 stays dequant
    else:  # cpu: the PyTorch fallback
        native_fp8, native_fp4 = False, False
    return PlatformInfo(
        backend=be,
        arch=name,
        device_name=device_name,
        fp8_dtype=fp8_dtype,
        native_fp8=native_fp8,
        native_fp4=native_fp4,
        torch_version=str(torch.__version__),
        triton_version=_triton_version(),
    )


def _device_index(device: torch.device | str | int | None) -> int | None:
    """The CUDA/HIP device index ``device`` names, or None for the CPU (and no GPU)."""
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else None
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise FuseMLATypeError(
            f"device: expected a torch.device, str, int or None, got {type(device).__name__}"
        )
    if isinstance(device, int):  # a GPU index, as torch.cuda takes it
        device = f"cuda:{device}" if device >= 0 else str(device)
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise FuseMLAValueError(f"device: not a device: {device!r} ({exc})") from None
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise FuseMLAValueError(
            f"device: expected a CPU or CUDA/ROCm ('cuda') device, got {str(dev)!r}"
        )
    if not torch.cuda.is_available():
        raise FuseMLAValueError(f"device: {str(dev)!r}, but torch sees no CUDA/ROCm GPU")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise FuseMLAValueError(f"device: {str(dev)!r}, but torch sees {count} GPU(s)")
    return index


@functools.cache
def _gpu_platform(index: int) -> PlatformInfo:
    """Query GPU ``index`` once per process (architecture and name do not change)."""
    if getattr(torch.version, "hip", None):
        props = torch.cuda.get_device_properties(index)
        gcn = getattr(props, "gcnArchName", None) or ""
        if not gcn.strip():
            raise FuseMLAError(
                f"cannot tell the architecture of ROCm device {index}: torch reports no "
                "gcnArchName (a torch build from before 2.1?)"
            )
        name = getattr(props, "name", None) or torch.cuda.get_device_name(index)
        return platform_from("rocm", gcn, str(name))
    major, minor = torch.cuda.get_device_capability(index)
    return platform_from("cuda", f"sm_{major}{minor}", torch.cuda.get_device_name(index))


def detect(device: torch.device | str | int | None = None) -> PlatformInfo:
    """The :class:`PlatformInfo` of ``device`` (default: the current GPU, or the CPU without one).

    * ``TRITON_INTERPRET=1`` -> "interpreter" for any device (the kernels are then interpreted
      even on GPU tensors: :func:`fusemla.mla_prologue` then runs in the interpreter);
    * a CPU device, or ``None`` without a GPU -> "cpu" (the PyTorch fallback);
    * a GPU on a ROCm build (``torch.version.hip`` set) -> "rocm", arch from ``gcnArchName``;
    * a GPU otherwise -> "cuda", arch ``sm_<major><minor>`` from the compute capability.

    Caching: the GPU query is cached per device index for the life of the process
    (:func:`clear_cache` forgets it); ``TRITON_INTERPRET`` is re-read on every call, so setting it
    after import takes effect. An explicit ``device`` is checked first either way; ``None`` under
    the interpreter touches no GPU.

    Raises:
        FuseMLAValueError: ``device`` is not a CPU/CUDA device, or names a GPU that torch
            does not see.
        FuseMLATypeError: ``device`` has the wrong Python type.
    """
    if device is None and config.interpreting():
        return platform_from("interpreter")  # no need to touch (and initialize) the GPU
    index = _device_index(device)
    if config.interpreting():
        return platform_from("interpreter")
    if index is None:
        return platform_from("cpu")
    return _gpu_platform(index)


def clear_cache() -> None:
    """Forget the cached GPU queries of :func:`detect` (and the Triton version)."""
    _gpu_platform.cache_clear()
    _triton_version.cache_clear()


# --------------------------------------------------------------------------------------------
# kernel-variant selection
# --------------------------------------------------------------------------------------------


def check_info(info: object) -> PlatformInfo:
    if not isinstance(info, PlatformInfo):
        raise FuseMLATypeError(f"info: expected a PlatformInfo, got {type(info).__name__}")
    return info


def supports_pdl(info: PlatformInfo) -> bool:
    """Programmatic dependent launch: NVIDIA compute capability >= 9.0 and Triton >= 3.4
    (``launch_pdl`` and ``gdc_wait``); never under the interpreter or on ROCm."""
    check_info(info)
    if info.backend != "cuda":
        return False
    major, _ = _sm_capability(info.arch)
    try:
        tv = tuple(int(x) for x in (info.triton_version or "0.0").split(".")[:2])
    except ValueError:
        tv = (0, 0)
    return major >= 9 and tv >= (3, 4)


def default_fp8_weight_dtype(info: PlatformInfo) -> torch.dtype:
    """The FP8 dtype to store weights in for ``info`` (= ``info.fp8_dtype``)."""
    return check_info(info).fp8_dtype


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def report_lines(info: PlatformInfo) -> list[str]:
    """A human-readable report of what ``info``'s hardware can do (the variants the prologue
    picks on it: :func:`fusemla.ops.prologue.policy.report_lines`)."""
    check_info(info)
    where = info.arch or "no GPU arch"
    device = info.device_name or ("CPU" if info.backend in ("interpreter", "cpu") else "unknown")
    what = {
        "cuda": "Triton kernels compiled for an NVIDIA GPU",
        "rocm": "Triton kernels compiled for an AMD GPU",
        "interpreter": "Triton kernels run by the interpreter on the CPU (TRITON_INTERPRET=1)",
        "cpu": "no GPU and no interpreter: the PyTorch fallback runs",
    }[info.backend]
    dtype_name = str(info.fp8_dtype).removeprefix("torch.")
    fp8_note = " (emulated)" if info.backend == "interpreter" else ""
    lines = [
        f"platform: {info.backend}, {where}, {device} - {what}",
        f"  FP8 dtype: {dtype_name}",
        (
            f"  native FP8 dots: {_yes(info.native_fp8)}{fp8_note}; "
            f"native FP4 (MX) dots: {_yes(info.native_fp4)}"
        ),
        (
            "  FP8 weights: upcast to the activations' dtype (bf16/fp16) in registers, or with "
            "act_quant='fp8' an FP8 x FP8 dot; read fastest K-major (quantize_fp8_weight's default)"
        ),
        (
            "  speed: pick a weight format for memory, not prologue speed; measured prologue "
            "times per weight format: docs/results.md ('The 0.5.0 kernel')"
        ),
    ]
    lines.append(f"  programmatic dependent launch supported: {_yes(supports_pdl(info))}")
    return lines
