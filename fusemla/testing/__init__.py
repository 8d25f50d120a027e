"""Shared by tests, the demo and the benchmark: random inputs (``inputs``) and the one
correctness comparison with its tolerance table (``compare``). Free of Triton."""

from fusemla.testing.compare import (
    TOL,
    Comparison,
    check_against_reference,
    compare,
    fp8_ordinal,
    rel_err,
    run_and_compare,
    scale_value,
    weight_kind,
)
from fusemla.testing.inputs import (
    DEEPSEEK_V3,
    FP8_NAN_BYTE,
    SMALL_DIMS,
    PrologueInputs,
    make_inputs,
    poisoned,
    poisoned_cache,
    prologue_model_f64,
    rope_f64,
    stable_seed,
)

__all__ = [
    "DEEPSEEK_V3",
    "FP8_NAN_BYTE",
    "SMALL_DIMS",
    "TOL",
    "Comparison",
    "PrologueInputs",
    "check_against_reference",
    "compare",
    "fp8_ordinal",
    "make_inputs",
    "poisoned",
    "poisoned_cache",
    "prologue_model_f64",
    "rel_err",
    "rope_f64",
    "run_and_compare",
    "scale_value",
    "stable_seed",
    "weight_kind",
]
