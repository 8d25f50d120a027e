"""The one home of what the tests, the demo and the benchmarks share (free of Triton):

- ``dims``: model dims (prologue and layer), DeepSeek-V3's YaRN settings, an attention config;
- ``models``: random attention weights (``self_attn.*`` state dicts) and the epilogue's W_UV;
- ``inputs``: random prologue inputs, poisoned caches, a float64 prologue model;
- ``compare``: the one correctness comparison with its tolerance table;
- ``scheduler``: the toy scheduler (block allocator, batch builder) that makes consistent
  :class:`fusemla.metadata.BatchMetadata`;
- ``spy``: the one launch spy (what the prologue really ran).

Imported by name only (heavier or engine-bound): ``hf`` (a tiny Hugging Face reference, needs
transformers), ``pdl_probe`` (a Triton producer kernel for PDL tests), ``vllm_worker`` (the vLLM
worker extension the engine tests load).
"""

from fusemla.testing.compare import (
    TOL,
    Comparison,
    check_against_reference,
    compare,
    fp8_ordinal,
    pow2_ceil64,
    rel_err,
    run_and_compare,
    scale_value,
    weight_kind,
)
from fusemla.testing.dims import (
    DEEPSEEK_V3,
    DEEPSEEK_V3_LAYER,
    DEEPSEEK_V3_YARN,
    SMALL_DIMS,
    SMALL_LAYER,
    TP8_LAYER,
    LayerDims,
    deepseek_yarn,
    hf_config,
)
from fusemla.testing.inputs import (
    FP8_NAN_BYTE,
    PrologueInputs,
    make_inputs,
    poisoned,
    poisoned_cache,
    prologue_model_f64,
    rope_f64,
    stable_seed,
)
from fusemla.testing.models import (
    block_fp8_w_uv,
    exact_w_uv,
    random_state_dict,
    vllm_w_uv,
    w_uv_f64,
)
from fusemla.testing.scheduler import (
    PADDING_ROW,
    BlockAllocator,
    RequestStep,
    Scheduler,
    build_metadata,
    token_request_index,
)
from fusemla.testing.spy import PrologueSpy, recorded_launch_plans

__all__ = [
    "DEEPSEEK_V3",
    "DEEPSEEK_V3_LAYER",
    "DEEPSEEK_V3_YARN",
    "FP8_NAN_BYTE",
    "PADDING_ROW",
    "SMALL_DIMS",
    "SMALL_LAYER",
    "TOL",
    "TP8_LAYER",
    "BlockAllocator",
    "Comparison",
    "LayerDims",
    "PrologueInputs",
    "PrologueSpy",
    "RequestStep",
    "Scheduler",
    "block_fp8_w_uv",
    "build_metadata",
    "check_against_reference",
    "compare",
    "deepseek_yarn",
    "exact_w_uv",
    "fp8_ordinal",
    "hf_config",
    "make_inputs",
    "poisoned",
    "poisoned_cache",
    "pow2_ceil64",
    "prologue_model_f64",
    "random_state_dict",
    "recorded_launch_plans",
    "rel_err",
    "rope_f64",
    "run_and_compare",
    "scale_value",
    "stable_seed",
    "token_request_index",
    "vllm_w_uv",
    "w_uv_f64",
    "weight_kind",
]
