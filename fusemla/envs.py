"""Every ``FUSEMLA_*`` environment variable, in one typed table.

Each :class:`EnvVar` holds the variable's name, its type (an on/off switch, a choice among named
values, or a comma-separated list of named values), its default, the values it accepts, when it
is read, and its documentation. :func:`get` reads one: unset or empty gives the default; values
are case-insensitive and surrounding blanks are ignored; any other value raises
:class:`~fusemla.errors.FuseMLAValueError` naming the variable and the values it accepts (a typo
must never select a path silently). :func:`report` lists them with the values in force, for
``fusemla info``; the README's list is checked against :data:`VARIABLES` by a test, and a test
fails when the code names a ``FUSEMLA_*`` variable this table lacks.

``TRITON_INTERPRET`` is Triton's own: fusemla reads it only through Triton
(:func:`fusemla.config.interpreting`), never parses it.

Scopes: ``library`` (what users set), ``tests`` and ``benchmarks`` (read by this repository's
test suites and benchmarks only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from fusemla.errors import FuseMLAValueError

__all__ = ["EnvVar", "VARIABLES", "get", "raw", "report", "names"]

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: ``kind`` is "switch" (on/off), "choice" (one of ``values``),
    "list" (comma-separated names from ``values``) or "text" (free text, e.g. a path)."""

    name: str
    kind: str
    default: Any
    doc: str
    scope: str = "library"
    #: accepted spellings -> the value :func:`get` returns ("choice" and "list")
    values: dict[str, str] = field(default_factory=dict)
    #: spellings no longer accepted -> the message that names what replaced them
    renamed: dict[str, str] = field(default_factory=dict)
    read: str = "per call"

    def allowed(self) -> str:
        """The accepted values, as an error message and the README list them."""
        if self.kind == "switch":
            return "1/true/yes/on or 0/false/no/off"
        if self.kind == "text":
            return "any text"
        names = ", ".join(dict.fromkeys(self.values.values()))
        if self.kind == "list":
            return f"a comma-separated list of {names}"
        return names

    def parse(self, text: str | None) -> Any:
        """The value ``text`` (the variable's raw value, or None when unset) stands for."""
        if text is None or not text.strip():
            return self.default
        value = text.strip()
        if self.kind == "text":
            return value
        low = value.lower()
        if self.kind == "switch":
            if low in _ON:
                return True
            if low in _OFF:
                return False
            raise self._error(text)
        if self.kind == "choice":
            if low in self.renamed:
                raise FuseMLAValueError(f"environment variable {self.name}: {self.renamed[low]}")
            if low not in self.values:
                raise self._error(text)
            return self.values[low]
        items = [x.strip().lower() for x in value.split(",") if x.strip()]
        bad = [x for x in items if x not in self.values]
        if bad:
            raise self._error(text, f" ({', '.join(repr(b) for b in bad)} unknown)")
        return tuple(dict.fromkeys(self.values[x] for x in items))

    def _error(self, text: str, extra: str = "") -> FuseMLAValueError:
        return FuseMLAValueError(
            f"environment variable {self.name}: expected {self.allowed()}, got {text!r}{extra}"
        )


def _choice(*names: str, **aliases: str) -> dict[str, str]:
    """Accepted (lower-case) spellings -> value: each name, and each alias."""
    return {**{n.lower(): n for n in names}, **{k.lower(): v for k, v in aliases.items()}}


_AUTO_ON_OFF = {"auto": "auto", **{v: "on" for v in _ON}, **{v: "off" for v in _OFF}}

#: every FUSEMLA_* variable, by name
VARIABLES: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "FUSEMLA_FUSED_DECODE",
            "switch",
            True,
            "fusemla.MLAAttention and the vLLM plugin run the decode tokens' prologue (absorbed "
            "BMM, RoPE, concat, cache write) fused; off: the unfused reference (the layer) or "
            "vLLM's own kernels (the plugin). MLAConfig(fused_decode=...) overrides it per layer.",
            read="per layer call (the layer); when vLLM builds a layer (the plugin)",
        ),
        EnvVar(
            "FUSEMLA_FUSED_PREFILL",
            "switch",
            True,
            "The same for the prefill tokens' prologue (RoPE + cache write); with both on, a "
            "mixed batch runs one launch for all its tokens. Under torch.compile both are read "
            "when the layer is traced (dynamo does not guard on them): set them before "
            "compiling, or use MLAConfig.",
            read="per layer call (the layer); when vLLM builds a layer (the plugin)",
        ),
        EnvVar(
            "FUSEMLA_PDL",
            "choice",
            "auto",
            "Programmatic dependent launch of the prologue kernel (NVIDIA sm_90+, Triton >= "
            "3.4): auto = where supported; on where unsupported raises; off = plain launches.",
            values=_AUTO_ON_OFF,
        ),
        EnvVar(
            "FUSEMLA_PDL_TRIGGER",
            "switch",
            False,
            "With PDL on, let the kernel after a fusemla kernel launch as soon as fusemla's "
            "starts (gdc_launch_dependents first thing) instead of when it completes. Off by "
            "default: only safe when that next kernel waits for its producer (griddepcontrol."
            "wait) before it reads; vLLM's FlashMLA dense decode kernel (SM90) is launched for "
            "PDL and does not, so it read fusemla's query and cache rows before they were "
            "written (H200, vLLM 0.33, full CUDA graphs); while it is on, the vLLM plugin "
            "leaves FLASHMLA layers to vLLM.",
        ),
        EnvVar(
            "FUSEMLA_MXFP4_PATH",
            "choice",
            "auto",
            "How MXFP4 weights multiply: dot_scaled (tl.dot_scaled, native on Blackwell and "
            "gfx950; forcing it elsewhere raises, except under the interpreter), dequant (to "
            "bf16 in registers), auto (dot_scaled exactly where the chip has native FP4 dots).",
            values=_choice("auto", "dot_scaled", "dequant", **{"dot-scaled": "dot_scaled"}),
        ),
        EnvVar(
            "FUSEMLA_DEBUG_CHECKS",
            "switch",
            False,
            "Before each launch, copy positions and slot_mapping to the host and raise if a "
            "position is outside the RoPE cache or a slot past the end of the KV cache. Syncs "
            "the device: a debugging aid, not for CUDA-graph capture. Without it the kernel "
            "still never reads or writes out of bounds: positions are clamped into "
            "[0, max_position) and slots past the cache are skipped like negative ones.",
        ),
        EnvVar(
            "FUSEMLA_VLLM",
            "switch",
            True,
            "The vLLM plugin: on by default once fusemla is installed beside vLLM; off leaves "
            "vLLM's MLA path untouched.",
            read="once per vLLM process (plugin registration)",
        ),
        EnvVar(
            "FUSEMLA_VLLM_W_UK",
            "choice",
            "as-is",
            "The W_UK_T the plugin's fused decode BMM reads: as-is (vLLM's own bf16/fp16 tensor, "
            "read in place), fp8 (quantized per head, once per layer), fp8xfp8 (also FP8 "
            "activations in the kernel, an FP8 x FP8 dot), stored (a block-FP8 checkpoint's "
            "kv_b_proj codes and block scales as stored, for W_UK_T and, with the epilogue, "
            "W_UV; other checkpoints keep as-is, with the reason logged). fp8, fp8xfp8 and "
            "stored change the numbers.",
            values=_choice("as-is", "fp8", "fp8xfp8", "stored", as_is="as-is"),
            renamed={"auto": "'auto' is now called 'as-is' (vLLM's weight as it is)"},
            read="once per vLLM process and layer",
        ),
        EnvVar(
            "FUSEMLA_VLLM_EPILOGUE",
            "switch",
            False,
            "The plugin's decode tokens run fusemla's epilogue kernel (W_UV straight into "
            "o_proj's input, bf16 or FP8 codes and group scales) instead of vLLM's _v_up_proj "
            "bmm, on the step sizes FUSEMLA_VLLM_EPILOGUE_TOKENS allows. Off by default: its "
            "gain over the prologue alone is 0.3-1.8 % of a decode step where measured, and one "
            "of three engine pairs timed a one-token step slower (docs/results.md); "
            "fusemla.MLAAttention always runs it with its fused decode.",
            read="when vLLM builds a layer",
        ),
        EnvVar(
            "FUSEMLA_VLLM_EPILOGUE_OUT",
            "choice",
            "auto",
            "What the plugin's epilogue hands o_proj: auto (FP8 codes and group scales in the "
            "layout o_proj's block-FP8 GEMM reads, skipping o_proj's own input quantization, "
            "where o_proj is such a linear; bf16 elsewhere, with the reason logged) or bf16 "
            "(always the activations' dtype, o_proj quantizes as it does in vLLM).",
            values=_choice("auto", "bf16"),
            read="when vLLM builds a layer",
        ),
        EnvVar(
            "FUSEMLA_VLLM_EPILOGUE_TOKENS",
            "choice",
            "measured",
            "On which decode steps the plugin's epilogue runs: measured (only where it was "
            "measured faster than vLLM's W_UV bmm + o_proj's quantization in vLLM on the GPU, "
            "per head count, output kind and step size: `fusemla info` prints the spans; "
            "elsewhere vLLM's own code runs) or all (every decode step: the correctness tests, "
            "and users timing their own GPU).",
            values=_choice("measured", "all"),
            read="when vLLM builds a layer",
        ),
        EnvVar(
            "FUSEMLA_VLLM_FORCE_BACKENDS",
            "list",
            (),
            "Decode backends the plugin leaves to vLLM under full CUDA graphs (FLASHMLA) to run "
            "fused anyway, for diagnosis.",
            values=_choice("FLASHMLA"),
            read="when vLLM builds a layer",
        ),
        # -- this repository's tests and benchmarks
        EnvVar(
            "FUSEMLA_REQUIRE_VLLM",
            "switch",
            False,
            "tests/vllm fails instead of skipping when vLLM is not installed (CI sets it).",
            scope="tests",
            read="at collection",
        ),
        EnvVar(
            "FUSEMLA_VLLM_MANY",
            "text",
            "0",
            "tests/vllm: this many extra seeded random shapes and schedules.",
            scope="tests",
            read="at collection",
        ),
        EnvVar(
            "FUSEMLA_VLLM_MANY_SEED",
            "text",
            "0",
            "tests/vllm: the first seed of FUSEMLA_VLLM_MANY's shapes.",
            scope="tests",
            read="at collection",
        ),
        EnvVar(
            "FUSEMLA_VLLM_GPU_REPORT",
            "text",
            "",
            "tests/vllm/test_vllm_gpu.py: write every deviation, counter and kernel count as "
            "JSON to this path.",
            scope="tests",
        ),
        EnvVar(
            "FUSEMLA_VLLM_GPU_DRYRUN",
            "switch",
            False,
            "tests/vllm/test_vllm_gpu.py: the suite's own logic on vLLM's CPU build.",
            scope="tests",
        ),
        EnvVar(
            "FUSEMLA_VLLM_GPU_MODELS",
            "text",
            "",
            "tests/vllm/test_vllm_gpu.py: only these models (comma-separated; an unknown "
            "name raises).",
            scope="tests",
        ),
        EnvVar(
            "FUSEMLA_VLLM_GPU_MODES",
            "text",
            "",
            "tests/vllm/test_vllm_gpu.py: only these graph modes (eager, full_and_piecewise; "
            "comma-separated) in every group but main.",
            scope="tests",
        ),
        EnvVar(
            "FUSEMLA_VLLM_GPU_ONLY",
            "text",
            "",
            "tests/vllm/test_vllm_gpu.py: only these groups of runs (comma-separated).",
            scope="tests",
        ),
        EnvVar(
            "FUSEMLA_VLLM_GPU_PER_DEVICE",
            "text",
            "4",
            "tests/vllm/test_vllm_gpu.py: engines built at once per GPU.",
            scope="tests",
        ),
        EnvVar(
            "FUSEMLA_COMMIT",
            "text",
            "",
            "benchmarks: the commit recorded in results files (default: git's HEAD).",
            scope="benchmarks",
        ),
    )
}


def names() -> tuple[str, ...]:
    return tuple(VARIABLES)


def raw(name: str) -> str | None:
    """The variable's raw text in the environment (None when unset)."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a fusemla environment variable (fusemla.envs.VARIABLES)")
    return os.environ.get(name)


def get(name: str) -> Any:
    """The value of ``FUSEMLA_*`` variable ``name`` now: its default when unset or empty.

    Raises :class:`~fusemla.errors.FuseMLAValueError` naming the variable and the values it
    accepts; :class:`KeyError` for a name the table does not hold.
    """
    return VARIABLES[name].parse(raw(name))


def report(scope: str | None = "library") -> list[str]:
    """One line per variable (of ``scope``; None: all): the raw value, the value in force or
    INVALID with the reason, and the default. Never raises on a bad value."""
    lines = []
    for v in VARIABLES.values():
        if scope is not None and v.scope != scope:
            continue
        text = os.environ.get(v.name)
        set_ = "not set" if text is None else repr(text)
        try:
            shown = f"{set_} -> {v.parse(text)!r}"
        except FuseMLAValueError as exc:
            shown = f"INVALID {set_} ({exc})"
        lines.append(f"{v.name}: {shown} (default {v.default!r}; {v.allowed()})")
    return lines
