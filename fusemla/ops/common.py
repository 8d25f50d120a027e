"""What every op's launch plan asks the same way: the Triton backend of a device, its
multiprocessor count, and whether a kernel is launched with programmatic dependent launch.
Op-specific choices live with each op (``fusemla.ops.<op>.policy`` / ``launch.plan``)."""

from __future__ import annotations

import functools

import torch

from fusemla import config, platform
from fusemla.errors import FuseMLATypeError, FuseMLAValueError, describe


@functools.cache
def num_sms(device_index: int) -> int:
    """Multiprocessors (CUs) of CUDA/HIP device ``device_index``."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def backend_of(device: torch.device, info: platform.PlatformInfo | None = None) -> str:
    """The launch-config backend for tensors on ``device`` ("cuda", "rocm" or "interpreter");
    ``info``: its already detected platform."""
    be = (info or platform.detect(device)).backend
    if be == "cpu":
        raise ValueError("no Triton backend for CPU tensors without TRITON_INTERPRET=1")
    return be


def check_fp8_formats(named: list[tuple[str, torch.Tensor]], backend: str) -> None:
    """FP8 formats the backend's Triton can store: NVIDIA has no float8_e4m3fnuz (MI300's)."""
    if backend != "cuda":
        return
    for name, t in named:
        if t.dtype == torch.float8_e4m3fnuz:
            raise FuseMLATypeError(
                f"{name}: float8_e4m3fnuz is the MI300 (gfx940-942) format; Triton on NVIDIA "
                f"GPUs cannot store it: use torch.float8_e4m3fn, got {describe(t)}"
            )


def choose_pdl(info: platform.PlatformInfo) -> bool:
    """Whether a kernel is launched with programmatic dependent launch.

    ``FUSEMLA_PDL`` = "auto" (default): :func:`fusemla.platform.supports_pdl`; "off": never;
    "on": required, raising where unsupported.

    Raises:
        FuseMLAValueError: an invalid value, or "on" where PDL is not supported.
    """
    mode = config.pdl_mode()
    if mode == "off":
        return False
    ok = platform.supports_pdl(info)
    if mode == "on" and not ok:
        where = f"{info.backend} {info.arch}" if info.arch else info.backend
        raise FuseMLAValueError(
            f"environment variable {config.PDL_ENV}=on cannot be used on {where}: programmatic "
            "dependent launch needs an NVIDIA GPU of compute capability >= 9.0 and Triton >= 3.4. "
            "Unset it or set it to 'off'"
        )
    return ok


def choose_pdl_trigger(pdl: bool) -> bool:
    """Whether a kernel launched with PDL (``pdl``) triggers its dependents at its start
    (``gdc_launch_dependents``): only with ``FUSEMLA_PDL_TRIGGER`` on. Otherwise the next
    kernel may start only when this one has completed, as with a plain launch, which every
    consumer is safe with; an early trigger is safe only for consumers that wait for their
    producer before reading (vLLM's FlashMLA dense SM90 decode kernel, launched for PDL, does
    not: docs/results.md, de9c208)."""
    return pdl and config.pdl_trigger()
