"""vLLM plugin: DeepSeek-style MLA layers in vLLM run their prologue through fusemla.

Declared as a ``vllm.general_plugins`` entry point (``fusemla = fusemla.integrations.vllm:register``),
so installing fusemla next to vLLM is what turns it on; ``FUSEMLA_VLLM=0`` turns it off. vLLM calls
:func:`register` once in every process it starts (API server / main, engine core, each worker).

What it changes, per MLA layer (vLLM's ``MultiHeadLatentAttentionWrapper``, swapped for
:class:`FuseMLAWrapper` through vLLM's ``register_oot``):

- the model-side forward keeps vLLM's projections (q_a/q_b or q_proj, kv_a + norms) and o_proj,
  but no longer rotates q_pe / k_pe itself and no longer calls vLLM's cache-update and attention
  ops: it calls one opaque torch custom op of its own, ``torch.ops.fusemla.vllm_mla_attention``;
- that op runs at every step (eagerly, like vLLM's own ``unified_mla_attention_with_output``) and
  reads the step's metadata from vLLM's forward context *there*: the layer's attention metadata
  (``num_decode_tokens``, ``num_actual_tokens``), its slot mapping and its KV cache. Nothing that
  changes per step is read while torch.compile traces the model;
- inside the op, one :func:`fusemla.mla_prologue` launch for the whole decode-first batch: decode
  tokens get the absorbed W_UK BMM + RoPE + 576-wide concat + cache write, prefill tokens RoPE +
  cache write; then vLLM's own decode attention (``impl.forward_mqa`` + ``_v_up_proj``) on the
  decode tokens and vLLM's own prefill attention (``impl.forward_mha``) on the prefill tokens.
  Each token is rotated once and written to the cache once. With ``FUSEMLA_VLLM_EPILOGUE=1``
  the decode tokens' W_UV projection is fusemla's epilogue kernel
  (:func:`fusemla.mla_epilogue_step`, written in place into o_proj's input) instead of vLLM's
  ``_v_up_proj`` bmm; a layer whose W_UV it cannot read keeps vLLM's, with the reason logged.
  Where o_proj is a block-FP8 linear (an FP8 checkpoint) whose input quantization the epilogue
  can do (``VllmAdapter.o_proj_fp8_route``: per-token groups, plain row- or column-major
  fp32 scales), the layer runs ``torch.ops.fusemla.vllm_mla_attention_fp8`` instead: the
  epilogue writes o_proj's input as FP8 codes + group scales in that GEMM's layout, rows it does
  not write (prefill, vLLM's path) go through o_proj's own quantization, and the wrapper calls
  o_proj's block-FP8 GEMM on them (``FUSEMLA_VLLM_EPILOGUE_OUT=bf16``: always bf16).

``FUSEMLA_FUSED_DECODE=0`` / ``FUSEMLA_FUSED_PREFILL=0`` hand that half back to vLLM's own code
(vLLM's rotary embedding, cache write and decode BMM / prefill attention) inside the same op; both
off = vLLM's layer untouched. Read once per process, when the layers are built.

Layers or steps this plugin cannot handle run vLLM's own path, and the reason is logged once per
reason: see :func:`_structural_reason` (decided when the layer is built) and
:meth:`_LayerState.runtime_reason` (decided at the first step that sees the weights and cache).

Every vLLM internal it touches goes through the adapter of the running vLLM minor version
(:mod:`fusemla.integrations.vllm_adapters`), picked once in :func:`register`; supported: vLLM
0.32.x and 0.33.x. The batch is cut into the fused span and vLLM's by
:func:`fusemla.ops.prologue.halves.split_halves`, the same function :class:`fusemla.MLAAttention`
uses.

``FUSEMLA_VLLM_W_UK`` (default ``as-is``: the weight vLLM holds, bf16/fp16) chooses the W_UK_T the
fused decode BMM reads: ``fp8`` quantizes vLLM's W_UK_T to FP8 per head (once per layer, at its
first fused step, and again if vLLM replaces or reloads the weight) and runs FP8 weights with
the activations as they are; ``fp8xfp8`` also quantizes the activations in the kernel
(``act_quant="fp8"``, an FP8 x FP8 dot); ``stored`` reads a block-FP8 checkpoint's
``kv_b_proj`` codes and block scales as stored, for W_UK_T and (with the epilogue) W_UV
(:func:`fusemla.quant.split_kv_b_proj_fp8`; another checkpoint keeps ``as-is``, logged). They change the numbers (docs/results.md: FUSEMLA_VLLM_W_UK against vLLM's bf16 path);
vLLM's own path (decode half off, fallbacks, prefill) keeps vLLM's weights.

Importing this module does not import vLLM; :func:`register` does.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

import torch

from fusemla import envs
from fusemla.config import PDL_TRIGGER_ENV, fused_decode, fused_prefill, pdl_trigger
from fusemla.contracts.prologue import tensor_key
from fusemla.integrations.vllm_adapters import ADAPTERS, VllmAdapter, adapter_for

__all__ = ["register", "stats", "reset_stats", "SUPPORTED_VLLM", "OP_NAME", "w_uk_mode"]

SUPPORTED_VLLM = tuple(ADAPTERS)  # the vLLM minor versions with an adapter ("0.32", "0.33")
OP_NAME = "fusemla::vllm_mla_attention"
ENV_SWITCH = "FUSEMLA_VLLM"
W_UK_ENV = "FUSEMLA_VLLM_W_UK"
W_UK_MODES = ("as-is", "fp8", "fp8xfp8", "stored")
EPILOGUE_ENV = "FUSEMLA_VLLM_EPILOGUE"
EPILOGUE_OUT_ENV = "FUSEMLA_VLLM_EPILOGUE_OUT"
EPILOGUE_TOKENS_ENV = "FUSEMLA_VLLM_EPILOGUE_TOKENS"
OP_NAME_FP8 = "fusemla::vllm_mla_attention_fp8"

logger = logging.getLogger("vllm.fusemla")  # replaced by vLLM's own logger in register()

_lock = threading.Lock()
_registered = False  # register() succeeded in this process
_logged: set[str] = set()
_stats: Counter = Counter()
_layers: dict[str, _LayerState] = {}  # attention layer name -> state (read by the op)
_wrapper_cls: type | None = None
_adapter: VllmAdapter | None = None  # the running vLLM's, set by register()


def w_uk_mode() -> str:
    """``FUSEMLA_VLLM_W_UK``: "as-is" (default), "fp8", "fp8xfp8" or "stored"; read when
    layers are built. The old spelling "auto" raises, naming "as-is"."""
    return envs.get(W_UK_ENV)


def _log_once(level: int, msg: str, *args) -> None:
    key = msg % args if args else msg
    if key in _logged:
        return
    _logged.add(key)
    logger.log(level, msg, *args)


def stats() -> dict[str, int]:
    """Counters of this process (what ran where), for tests and debugging:

    ``layers_fused`` / ``layers_vllm``: MLA layers built with the fused op / left to vLLM;
    ``op_calls``: calls of the fused op; ``prologue_calls``: :func:`fusemla.mla_prologue` calls;
    ``decode_tokens`` / ``prefill_tokens``: tokens through fusemla's prologue per half;
    ``epilogue_calls`` / ``epilogue_tokens``: :func:`fusemla.mla_epilogue_step` calls and their
    decode tokens (``FUSEMLA_VLLM_EPILOGUE``); ``layers_epilogue`` / ``layers_epilogue_vllm``:
    layers whose decode tokens run it / keep vLLM's W_UV bmm (counted at their first step, or
    when built where no step size runs it: :func:`_epilogue_nowhere`);
    ``vllm_rope_tokens`` / ``vllm_cache_write_tokens``: tokens left to vLLM's RoPE / cache write
    (a half switched off); ``mixed_calls``: op calls with both decode and prefill tokens;
    ``decode_calls`` / ``prefill_calls``: op calls with any decode / prefill tokens;
    ``no_metadata_calls``: profile / dummy runs (vLLM's path); ``fallback_calls``: steps run on
    vLLM's path for a runtime reason (logged once); ``spec_builds``: layer specs built (once
    per layer, again when vLLM replaces or reloads a source tensor), ``spec_builds_in_capture``
    the ones built inside a CUDA graph capture (0 when :meth:`_LayerState.prebuild` ran);
    ``layers_epilogue_fp8`` / ``layers_epilogue_bf16``: epilogue layers built to hand o_proj
    FP8 codes + group scales (``FUSEMLA_VLLM_EPILOGUE_OUT=auto``, a block-FP8 o_proj) / bf16;
    ``epilogue_fp8_tokens``: decode tokens the epilogue wrote as FP8;
    ``epilogue_vllm_tokens``: decode tokens of epilogue layers left to vLLM's bmm because the
    step's size is outside the spans measured faster (``configs.fuse_token_spans``;
    ``FUSEMLA_VLLM_EPILOGUE_TOKENS=all``: none); ``o_proj_quant_rows``:
    rows of an FP8-handoff layer quantized by o_proj's own quantization (prefill, vLLM's
    path), ``o_proj_quant_copied_rows`` those of them quantized apart and copied into the
    handoff (the others written in place); ``o_proj_quant_in_place`` /
    ``o_proj_quant_in_place_refused``: handoff formats whose in-place quantization passed /
    failed its check on the device (:func:`_check_in_place`, logged); ``stored_builds``:
    W_UK_T / W_UV pairs read from a block-FP8 ``kv_b_proj`` as stored
    (``FUSEMLA_VLLM_W_UK=stored``; their codes are views of vLLM's weight), ``stored_copied``
    those of them whose codes were copied (vLLM's weight not contiguous).
    """
    return dict(_stats)


def reset_stats() -> None:
    _stats.clear()


# ------------------------------------------------------------------------------ registration


def register() -> None:
    """The ``vllm.general_plugins`` entry point: swap vLLM's MLA wrapper for fusemla's.

    On by default; ``FUSEMLA_VLLM=0`` (0/false/no/off) leaves vLLM untouched. Supported: the
    vLLM minor versions of :data:`SUPPORTED_VLLM`; on another version it logs once and stays
    off. Safe to call more than once per process (vLLM loads general plugins once per process;
    a second call is a no-op).
    """
    global _registered, _wrapper_cls, _adapter, logger
    with _lock:
        if _registered:
            return
        try:
            import vllm
        except ImportError:  # pragma: no cover - only called by vLLM
            return
        version = getattr(vllm, "__version__", "unknown")
        adapter = adapter_for(version)
        if adapter is not None:
            try:  # vLLM configures its "vllm" loggers after plugins may have been imported
                logger = adapter.init_logger("vllm.fusemla")
                logger.disabled = False  # a dictConfig after our import may have disabled it
            except ImportError:  # pragma: no cover
                pass
        if not envs.get(ENV_SWITCH):
            _log_once(logging.INFO, "fusemla: %s=0, vLLM's MLA path is left untouched", ENV_SWITCH)
            return
        if adapter is None:
            _log_once(
                logging.WARNING,
                "fusemla: vLLM %s is not supported (supported: %s): plugin off, "
                "vLLM's own MLA path runs",
                version,
                ", ".join(f"{m}.x" for m in SUPPORTED_VLLM),
            )
            return
        w_uk_mode()  # a bad FUSEMLA_VLLM_W_UK fails here, before any engine is built
        base = adapter.wrapper_base()
        name = base.__name__
        existing = adapter.registered_oot(name)
        if existing is not None and getattr(existing, "_fusemla", False):
            _registered = True  # this module was imported twice under different names
            _adapter = adapter
            return
        if existing is not None:
            _log_once(
                logging.WARNING,
                "fusemla: %s is already replaced by %s (another plugin): fusemla off",
                name,
                existing,
            )
            return
        _adapter = adapter
        _register_op()
        # the op reads per-step metadata, so it must run outside captured graph pieces, like
        # vLLM's own attention ops (a user's explicit splitting_ops must name it)
        adapter.add_splitting_op(OP_NAME)
        adapter.add_splitting_op(OP_NAME_FP8)
        _wrapper_cls = _make_wrapper_class(base)
        adapter.register_wrapper(base, _wrapper_cls)
        _registered = True


# ------------------------------------------------------------------------------ the custom op

_op_registered = False


def _register_op() -> None:
    global _op_registered
    if _op_registered:
        return

    # q and k_pe are declared mutated: like vLLM's own wrapper (whose rotary embedding rotates
    # them in place), the op rotates q_pe (prefill rows, vLLM's path) and k_pe (vLLM's path) in
    # place instead of copying them first. A copy of q at vLLM's 16,384-token profile step is
    # 0.75 GiB at 128 heads, taken from the KV cache (H200, a7b3bce: 7 % fewer KV tokens).
    @torch.library.custom_op(OP_NAME, mutates_args=("q", "k_pe", "output"))
    def vllm_mla_attention(
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        positions: torch.Tensor,
        output: torch.Tensor,
        layer_name: str,
    ) -> None:
        """MLA attention of one layer for one step; reads the step's metadata at run time."""
        _layers[layer_name].run(q, kv_c_normed, k_pe, positions, output)

    @vllm_mla_attention.register_fake
    def _fake(q, kv_c_normed, k_pe, positions, output, layer_name) -> None:
        return None

    @torch.library.custom_op(OP_NAME_FP8, mutates_args=("q", "k_pe", "output", "codes", "scales"))
    def vllm_mla_attention_fp8(
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        positions: torch.Tensor,
        output: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        layer_name: str,
    ) -> None:
        """The same, with o_proj's input as FP8 codes + group scales (the FP8 handoff);
        ``output`` is the bf16 scratch of the rows the epilogue does not write."""
        _layers[layer_name].run(q, kv_c_normed, k_pe, positions, output, codes, scales)

    @vllm_mla_attention_fp8.register_fake
    def _fake_fp8(q, kv_c_normed, k_pe, positions, output, codes, scales, layer_name) -> None:
        return None

    _op_registered = True


# Decode backends the plugin leaves to vLLM in full CUDA-graph modes (FULL, FULL_AND_PIECEWISE,
# vLLM's default) until fusemla runs correctly through them there; a version's adapter lists the
# (backend, cache kind) pairs verified on it (VllmAdapter.FULL_GRAPH_VERIFIED). Measured on the
# H200 (tests/vllm/test_vllm_gpu.py, docs/results.md): with FLASHMLA and a bf16 cache the fused
# path was bit-identical to vLLM's own in eager mode, but under FULL_AND_PIECEWISE its next-token
# logprobs deviated (vLLM 0.32.0 at dfbba2c: 0.23 relative; 0.33.0 at de9c208: 0.21; noise floor
# 0.035). The cause: fusemla's kernels triggered their PDL dependents at their start, and
# FlashMLA's dense decode kernel (launched for PDL) reads its query and the cache without
# waiting. Since 603b9ac they trigger at completion (FUSEMLA_PDL_TRIGGER), and on 0.33.0 the
# forced fused run is bit-identical under full graphs too (4f5ec9c); with an FP8 cache it was
# within the FP8 floor in both modes (de9c208). 0.33's adapter lists both pairs; 0.32 has not
# been re-judged since the fix and keeps the fallback.
UNVERIFIED_FULL_GRAPH_BACKENDS = {
    "FLASHMLA": "deviated from vLLM's own path under full CUDA graphs (H200)",
}
FORCE_ENV = "FUSEMLA_VLLM_FORCE_BACKENDS"

# Decode backends whose kernel, launched for PDL, reads what fusemla's prologue wrote (the decode
# query, the cache rows) without waiting for it (no griddepcontrol.wait): with the early PDL
# trigger (FUSEMLA_PDL_TRIGGER on) it can start before fusemla's kernel has written them, in any
# graph mode (a host gap between the launches only hides it). The plugin leaves such layers to
# vLLM while the trigger is on, unless FUSEMLA_VLLM_FORCE_BACKENDS names the backend.
PDL_NO_WAIT_BACKENDS = {
    "FLASHMLA": "its SM90 decode kernel reads the query and the cache without waiting",
}


def _forced_backends() -> set[str]:
    """Backends named in ``FUSEMLA_VLLM_FORCE_BACKENDS`` (comma-separated): run fused even
    where :data:`UNVERIFIED_FULL_GRAPH_BACKENDS` lists them (for diagnosis and tests only).
    A name it does not know raises, naming the ones it does (:mod:`fusemla.envs`)."""
    return set(envs.get(FORCE_ENV))


class _LayerState:
    """What the op needs of one MLA layer (a plain object: not an nn.Module, no cycles)."""

    def __init__(
        self,
        adapter: VllmAdapter,
        wrapper,
        fused_dec: bool,
        fused_pre: bool,
        w_uk: str = "as-is",
        epilogue: bool = False,
        o_fp8: dict | None = None,
    ):
        self.ad = adapter
        self.attn = adapter.attention(wrapper)  # vLLM's MLAAttention (weights, cache, impl)
        self.rotary_emb = adapter.rotary(wrapper)
        dims = adapter.layer_dims(wrapper)
        self.P, self.R, self.L, self.V = dims["P"], dims["R"], dims["L"], dims["V"]
        self.fused_dec = fused_dec
        self.fused_pre = fused_pre
        self.w_uk = w_uk  # FUSEMLA_VLLM_W_UK
        self.is_neox = adapter.is_neox(self.rotary_emb)
        self.name = adapter.layer_name(self.attn)
        self._spec_key = None
        self._spec = None
        self.epilogue = epilogue and fused_dec  # FUSEMLA_VLLM_EPILOGUE (decode tokens only)
        self._epi_key = None
        self._epi_spec = None
        # the decode step sizes the epilogue runs on (epilogue_tokens), decided at the first step
        self._epi_spans: tuple[tuple[int, int], ...] | None = None
        self._epi_all = envs.get(EPILOGUE_TOKENS_ENV) == "all"
        # o_proj's FP8 input (FUSEMLA_VLLM_EPILOGUE_OUT=auto, a block-FP8 o_proj): the op writes
        # codes + group scales in o_proj's layout and the wrapper calls its GEMM on them
        self.o_fp8 = o_fp8 if self.epilogue else None
        self.o_proj = adapter.o_proj(wrapper) if self.o_fp8 is not None else None
        self._stored_key = None
        self._stored = None  # (W_UK_T, W_UV) QuantizedWeight, FUSEMLA_VLLM_W_UK=stored
        self._checked = False
        self._reason: str | None = None
        self._in_place: bool | None = None  # quantizes_in_place's verdict, once decided

    # -- FP8 weights as the checkpoint stores them (FUSEMLA_VLLM_W_UK=stored)

    def stored(self):
        """``(W_UK_T, W_UV)`` read from vLLM's block-FP8 ``kv_b_proj`` as stored (codes and
        block scales byte-identical, :func:`fusemla.quant.split_kv_b_proj_fp8`): the codes are
        views of ``kv_b_proj.weight``, which vLLM keeps for prefill (no second copy; a
        non-contiguous weight is copied, 8 MiB per piece a layer at 128 heads, and counted in
        ``stored_copied``), the block scales small copies; rebuilt when vLLM replaces or
        rewrites it; W_UV is None in a layer without the epilogue (not kept); None (logged
        once, the layer reads vLLM's own tensors) when the checkpoint is not block-FP8 or its
        blocks straddle a head."""
        if self.w_uk != "stored":
            return None
        src, why = self.ad.kv_b_proj_fp8(self.attn)
        if src is not None:
            key = (tensor_key(src[0]), tensor_key(src[1]), src[2])
            if key == self._stored_key:
                return self._stored
            from fusemla.errors import FuseMLAError
            from fusemla.quant import split_kv_b_proj_fp8

            H = src[0].shape[0] // (self.P + self.V)
            share = src[0].is_contiguous()  # the codes as views of vLLM's own weight
            try:
                pair = split_kv_b_proj_fp8(
                    src[0],
                    src[1],
                    num_heads=H,
                    qk_nope_head_dim=self.P,
                    v_head_dim=self.V,
                    block_size=src[2],
                    share=share,
                )
            except FuseMLAError as e:
                why = str(e)
            else:
                if not self.epilogue:  # only the epilogue reads W_UV: not kept
                    pair = (pair[0], None)
                self._stored, self._stored_key = pair, key
                _stats["stored_builds"] += 1
                if not share:
                    _stats["stored_copied"] += 1
                return pair
        _log_once(
            logging.WARNING,
            "fusemla: FUSEMLA_VLLM_W_UK=stored: layer %s reads vLLM's own W_UK_T / W_UV: %s",
            self.name,
            why,
        )
        self.w_uk = "as-is"
        return None

    # -- the layer's prologue spec (rebuilt when vLLM replaces or reloads a source tensor)

    def spec(self, fp8_query: tuple[torch.dtype, torch.Tensor] | None):
        """The :class:`~fusemla.contracts.prologue.PrologueSpec` of this layer: W_UK_T (vLLM's
        own tensor, or quantized per ``FUSEMLA_VLLM_W_UK``), the split RoPE tables and
        the decode query's format (``fp8_query``: FP8 dtype and scale, or None)."""
        from fusemla.contracts.prologue import build_spec, weight_layout_readable

        w = self.ad.w_uk_t(self.attn)
        cache = self.ad.cos_sin_cache(self.rotary_emb)
        stored = self.stored()
        key = (
            tensor_key(w),
            tensor_key(cache),
            None if fp8_query is None else (fp8_query[0], id(fp8_query[1])),
            None if stored is None else id(stored[0]),
        )
        if key != self._spec_key:
            from fusemla.rope import split_cos_sin_cache

            if stored is not None:
                w_fused = stored[0]  # block-FP8 W_UK_T as the checkpoint stores it
            elif self.w_uk == "as-is":
                # vLLM keeps W_UK_T as a permuted view [H, P, L] of W_UK [L, H, P] (stride 1
                # along P): the kernel reads it as it is, no copy (any other layout: one copy)
                w_fused = w if weight_layout_readable(w) else w.contiguous()
            else:
                from fusemla.quant import quantize_fp8_weight

                w_fused = quantize_fp8_weight(w, dtype=self.ad.fp8_dtype(), per_head=True)
            cos, sin = split_cos_sin_cache(cache)
            q_dtype, q_scale = fp8_query if fp8_query is not None else (None, None)
            self._spec = build_spec(
                w_fused,
                cos,
                sin,
                is_neox=self.is_neox,
                q_out_dtype=q_dtype,
                q_scale=q_scale,
                act_quant="fp8" if self.w_uk == "fp8xfp8" else None,
            )
            self._spec_key = key
            _stats["spec_builds"] += 1
            if _capturing():
                _stats["spec_builds_in_capture"] += 1
        return self._spec

    def epilogue_spec(self):
        """The :class:`~fusemla.contracts.epilogue.EpilogueSpec` of this layer: vLLM's W_UV
        (read in place when its layout allows, else one copy) or, with
        ``FUSEMLA_VLLM_W_UK=stored``, the checkpoint's block-FP8 W_UV; output into o_proj's
        input: bf16/fp16, or FP8 codes and group scales in o_proj's layout (:attr:`o_fp8`);
        rebuilt when vLLM replaces or reloads a source tensor."""
        from fusemla.contracts.epilogue import build_spec, weight_layout_readable

        w = self.ad.w_uv(self.attn)
        stored = self.stored()
        key = (tensor_key(w), None if stored is None else id(stored[1]))
        if key != self._epi_key:
            if stored is not None:
                w_epi = stored[1]
            else:
                w_epi = w if weight_layout_readable(w) else w.contiguous()
            r = self.o_fp8
            self._epi_spec = build_spec(
                w_epi,
                out_dtype=None if r is None else r["dtype"],
                group_size=128 if r is None else r["group_size"],
                scale_ue8m0=False if r is None else r["ue8m0"],
                scale_col_major=False if r is None else r["col_major"],
            )
            self._epi_key = key
            _stats["spec_builds"] += 1
            if _capturing():
                _stats["spec_builds_in_capture"] += 1
        return self._epi_spec

    def epilogue_tokens(self, q: torch.Tensor) -> tuple[tuple[int, int], ...]:
        """The inclusive ``(lo, hi)`` spans of decode token counts whose steps run the
        epilogue, the others keeping vLLM's W_UV bmm, where it was measured faster in vLLM
        (:func:`fusemla.ops.epilogue.configs.fuse_token_spans`;
        ``FUSEMLA_VLLM_EPILOGUE_TOKENS=all``: every step); decided per step, so per captured
        CUDA graph size."""
        if self._epi_spans is None:
            from fusemla.ops.common import backend_of
            from fusemla.ops.epilogue.configs import ALL_TOKENS, describe_spans, fuse_token_spans

            try:
                backend = backend_of(q.device)
            except ValueError:  # CPU tensors without the interpreter: the PyTorch reference
                backend = "interpreter"
            w_fp8 = self.stored() is not None  # the checkpoint's block-FP8 W_UV, as stored
            if self._epi_all:
                self._epi_spans = ALL_TOKENS
            else:
                self._epi_spans = fuse_token_spans(
                    q.shape[1], self.o_fp8 is not None, backend, w_fp8
                )
            _log_once(
                logging.INFO,
                "fusemla: the epilogue runs on decode steps of %s tokens (%d heads, %s out, %s "
                "W_UV; FUSEMLA_VLLM_EPILOGUE_TOKENS=%s), vLLM's W_UV bmm on the others",
                describe_spans(self._epi_spans),
                q.shape[1],
                "FP8" if self.o_fp8 is not None else "bf16",
                "block-FP8 (stored)" if w_fp8 else "vLLM's",
                "all" if self._epi_all else "measured",
            )
        return self._epi_spans

    def epilogue_runs(self, q: torch.Tensor, D: int) -> bool:
        """Whether this layer's step of ``D`` decode tokens runs the epilogue: built with it,
        and ``D`` in one of :meth:`epilogue_tokens`' spans."""
        if not self.epilogue:
            return False
        from fusemla.ops.epilogue.configs import fuses_at

        return fuses_at(D, self.epilogue_tokens(q))

    def epilogue_reason(self, q: torch.Tensor) -> str | None:
        """Why this layer's decode tokens keep vLLM's _v_up_proj (None: the epilogue runs)."""
        w = self.ad.w_uv(self.attn)
        if not isinstance(w, torch.Tensor):
            return "W_UV is not held as a plain tensor (AITER FP8/FP4 BMM or AMX packing)"
        if w.dim() != 3 or w.shape[:2] != (q.shape[1], self.L) or w.dtype != q.dtype:
            return f"W_UV {tuple(w.shape)} {w.dtype} does not match q {q.dtype} [H, L, V]"
        return None

    def fp8_query(self) -> tuple[torch.dtype, torch.Tensor] | None:
        """The decode query's FP8 dtype and scale, when the cache is FP8 and vLLM's decode
        backend takes an FP8 query; else None (the query stays in the activations' dtype)."""
        if not self.ad.is_fp8_cache(self.attn):
            return None
        takes_fp8, q_scale = self.ad.fp8_query(self.attn)
        return (self.ad.fp8_dtype(), q_scale) if takes_fp8 else None

    def prebuild(self) -> None:
        """Build the spec ahead of the first fused step, on a step vLLM runs without metadata
        (its profile run, eager, before any CUDA graph is captured): the first fused step is
        otherwise inside a capture (vLLM 0.33 captures before it serves), where a spec build's
        work (``FUSEMLA_VLLM_W_UK=fp8`` quantizes, and syncs) cannot run. Skipped while
        capturing or before the weights exist; a spec that cannot be built here is built (and
        its error raised) at the first fused step."""
        if self._spec_key is not None or not (self.fused_dec or self.fused_pre) or _capturing():
            return
        w = self.ad.w_uk_t(self.attn)
        if not isinstance(w, torch.Tensor) or tuple(w.shape[1:]) != (self.P, self.L):
            return
        if self.ad.cos_sin_cache(self.rotary_emb) is None:
            return
        try:
            self.spec(self.fp8_query())
        except Exception:  # noqa: BLE001 - raised again, with its message, at the first fused step
            self._spec_key = self._spec = None
        w_uv = self.ad.w_uv(self.attn)
        if self.epilogue and isinstance(w_uv, torch.Tensor) and w_uv.shape[1:2] == (self.L,):
            try:
                self.epilogue_spec()
            except Exception:  # noqa: BLE001 - raised again at the first fused step
                self._epi_key = self._epi_spec = None

    # -- runtime support check (first step with weights and a cache)

    def runtime_reason(self, q: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
        if self._checked:
            return self._reason
        ad, a = self.ad, self.attn
        reason = None
        w = ad.w_uk_t(a)
        if self.fused_dec and not isinstance(w, torch.Tensor):
            reason = (
                "kv_b_proj is not held as a plain W_UK_T tensor (AITER FP8/FP4 BMM or "
                "AMX packing): decode BMM stays vLLM's"
            )
        elif self.fused_dec and (
            w.dtype != q.dtype or tuple(w.shape) != (q.shape[1], self.P, self.L)
        ):
            reason = f"W_UK_T {tuple(w.shape)} {w.dtype} does not match q {q.dtype}"
        elif q.dtype not in (torch.bfloat16, torch.float16):
            reason = f"activations are {q.dtype} (fusemla runs bf16/fp16)"
        elif kv_cache.dim() != 3 or kv_cache.shape[-1] != self.L + self.R:
            reason = (
                f"KV cache of shape {tuple(kv_cache.shape)} is not "
                f"[blocks, block_size, {self.L + self.R}] rows"
            )
        elif ad.is_fp8_cache(a) and kv_cache.element_size() != 1:
            reason = f"FP8 cache of element size {kv_cache.element_size()}"
        elif ad.cos_sin_cache(self.rotary_emb) is None:
            reason = "rotary embedding has no cos_sin_cache"
        self._reason = reason
        self._checked = True
        if reason is not None:
            _log_once(
                logging.WARNING, "fusemla: layer %s runs vLLM's MLA path: %s", self.name, reason
            )
        elif self.epilogue:
            why = self.epilogue_reason(q)
            if why is not None:
                self.epilogue = False
                _log_once(
                    logging.WARNING, "fusemla: layer %s keeps vLLM's W_UV bmm: %s", self.name, why
                )
            _stats["layers_epilogue" if self.epilogue else "layers_epilogue_vllm"] += 1
        return reason

    # -- one step

    def run(self, q, kv_c, k_pe, positions, output, codes=None, scales=None) -> None:
        """One step. ``codes`` / ``scales`` (the FP8 handoff, :attr:`o_fp8`): o_proj's input
        as FP8 codes and group scales in its GEMM's layout, every row of the step written:
        the epilogue's decode rows directly, any other row (prefill, vLLM's path) as bf16 in
        ``output`` first, then through o_proj's own quantization."""
        md, slots = self.ad.step_context(self.name)
        kv_cache = self.ad.kv_cache(self.attn)
        if md is None or slots is None or kv_cache.numel() == 0:
            _stats["no_metadata_calls"] += 1
            self.vllm_path(q, kv_c, k_pe, positions, output, md, slots)
            self.quantize_rows(output, codes, scales, 0, output.shape[0])
            self.prebuild()
            return
        if self.runtime_reason(q, kv_cache) is not None:
            _stats["fallback_calls"] += 1
            self.vllm_path(q, kv_c, k_pe, positions, output, md, slots)
            self.quantize_rows(output, codes, scales, 0, output.shape[0])
            return
        self.fused_path(q, kv_c, k_pe, positions, output, md, slots, kv_cache, codes, scales)

    def quantize_rows(self, output, codes, scales, lo: int, hi: int) -> None:
        """Rows ``[lo, hi)`` of the bf16 ``output`` into ``codes`` / ``scales`` through
        o_proj's own input quantization (what vLLM's o_proj would have run on them): written
        in place by o_proj's kernel where :meth:`quantizes_in_place`, else quantized and
        copied (two more kernels)."""
        if codes is None or hi <= lo:
            return
        x = output[lo:hi]
        if not (
            self.quantizes_in_place(x, codes, scales)
            and self.ad.o_proj_quantize_into(self.o_proj, x, codes[lo:hi], scales[lo:hi])
        ):
            c, sc = self.ad.o_proj_quantize(self.o_proj, x)
            codes[lo:hi].copy_(c)
            scales[lo:hi].copy_(sc)
            _stats["o_proj_quant_copied_rows"] += hi - lo
        _stats["o_proj_quant_rows"] += hi - lo

    def quantizes_in_place(self, x, codes, scales) -> bool:
        """Whether o_proj's quantization writes the handoff's rows in place
        (:meth:`VllmAdapter.o_proj_quantize_into`): decided once per process and handoff
        format, at the first call outside a CUDA graph capture, by :func:`_check_in_place`
        on the device (until then, copies: a graph captured before it keeps them); kept on
        the layer after that, so a step only reads it."""
        if self._in_place is not None:
            return self._in_place
        key = (self.o_fp8["group_size"], self.o_fp8["ue8m0"], self.o_fp8["col_major"])
        key += (str(codes.dtype), codes.shape[1], str(x.dtype), x.device.type)
        ok = _in_place.get(key)
        if ok is None:
            if _capturing():
                return False
            why = _check_in_place(self.ad, self.o_proj, x, codes, scales, self.o_fp8["col_major"])
            ok = _in_place[key] = why is None
            _stats["o_proj_quant_in_place" if ok else "o_proj_quant_in_place_refused"] += 1
            if ok:
                _log_once(
                    logging.INFO,
                    "fusemla: o_proj's input quantization writes the FP8 handoff in place",
                )
            else:
                _log_once(
                    logging.INFO,
                    "fusemla: o_proj's input quantization is copied into the FP8 handoff: %s",
                    why,
                )
        self._in_place = ok
        return ok

    def vllm_rope(self, positions, q, k_pe):
        """vLLM's own rotation of ``q``'s q_pe part and of ``k_pe`` ([n, 1, R]), in place as
        vLLM's wrapper does it (the op declares both mutated); returns (q, rotated k_pe)."""
        q[..., self.P :], k_pe = self.ad.rope(self.rotary_emb, positions, q[..., self.P :], k_pe)
        _stats["vllm_rope_tokens"] += q.shape[0]
        return q, k_pe

    def vllm_cache_write(self, kv_c, k_pe, kv_cache, slots) -> None:
        self.ad.cache_write(self.attn, kv_c, k_pe, kv_cache, slots)
        _stats["vllm_cache_write_tokens"] += kv_c.shape[0]

    def vllm_path(self, q, kv_c, k_pe, positions, output, md, slots) -> None:
        """Exactly what vLLM's wrapper + MLAAttention do for this step."""
        q, k_pe = self.vllm_rope(positions, q, k_pe)
        self.ad.own_path(self.attn, q, kv_c, k_pe, md, slots, output)

    def fused_path(
        self, q, kv_c, k_pe, positions, output, md, slots, kv_cache, codes=None, scales=None
    ) -> None:
        from fusemla.ops.prologue.halves import split_halves

        ad, a = self.ad, self.attn
        P, R, L = self.P, self.R, self.L
        n, D = ad.step_tokens(md)
        q, kv_c, k_pe = q[:n], kv_c[:n], k_pe[:n]
        positions, slots = positions[:n], slots[:n]
        H = q.shape[1]
        cache, kv_scale, fp8_query = kv_cache, None, self.fp8_query()
        if ad.is_fp8_cache(a):
            cache = kv_cache.view(ad.fp8_dtype())
            kv_scale = ad.k_scale(a)
        split = split_halves(n, D, self.fused_dec, self.fused_pre)
        k2 = k_pe.reshape(n, R)

        q_dec = q_d = k_d = None  # decode query (fused) / rotated decode q, k_pe (vLLM's)
        q_pre = k_pre = None  # prefill q with rotated q_pe, rotated k_pe [n-D, 1, R]
        for span in split.spans:
            lo, hi, d = span.lo, span.hi, span.num_decode_tokens
            if span.fused:  # -- one fused launch for every token fusemla handles
                if hi > lo + d:  # prefill rows: q_pe rotated in place (q is mutable)
                    q_pre = q[lo + d : hi]
                    k_pre = torch.empty(hi - lo - d, 1, R, dtype=q.dtype, device=q.device)
                if d > 0:
                    q_dec = torch.empty(
                        d, H, L + R, device=q.device, dtype=fp8_query[0] if fp8_query else q.dtype
                    )
                _prologue(
                    self.spec(fp8_query),
                    q[lo:hi, :, :P],
                    q[lo:hi, :, P:],
                    kv_c[lo:hi],
                    k2[lo:hi],
                    positions[lo:hi],
                    cache,
                    slots[lo:hi],
                    num_decode_tokens=d,
                    kv_scale=kv_scale,
                    out=q_dec,
                    q_pe_out=q_pre[..., P:] if q_pre is not None else None,
                    k_pe_out=k_pre[:, 0] if k_pre is not None else None,
                )
                _stats["prologue_calls"] += 1
                _stats["decode_tokens"] += d
                _stats["prefill_tokens"] += hi - lo - d
            else:  # -- vLLM's RoPE and its cache write, per half
                if d > 0:
                    q_d, k_d = self.vllm_rope(
                        positions[lo : lo + d], q[lo : lo + d], k_pe[lo : lo + d]
                    )
                    self.vllm_cache_write(kv_c[lo : lo + d], k_d, kv_cache, slots[lo : lo + d])
                if hi > lo + d:
                    q_pre, k_pre = self.vllm_rope(
                        positions[lo + d : hi], q[lo + d : hi], k_pe[lo + d : hi]
                    )
                    self.vllm_cache_write(kv_c[lo + d : hi], k_pre, kv_cache, slots[lo + d : hi])
        _stats["op_calls"] += 1
        _stats["decode_calls"] += D > 0
        _stats["prefill_calls"] += n > D
        _stats["mixed_calls"] += 0 < D < n
        # -- attention: vLLM's own kernels
        if n > D:
            ad.prefill_attention(a, q_pre, kv_c[D:], k_pre, cache, md, output[D:n])
        self.quantize_rows(output, codes, scales, D, n)
        if D > 0:
            if split.decode_fused and self.epilogue_runs(q, D):
                from fusemla.ops.epilogue.api import mla_epilogue_step

                o = ad.decode_mqa(a, q_dec, cache, md).view(D, -1, L)
                if codes is not None:  # FP8 codes + group scales straight into o_proj's input
                    mla_epilogue_step(self.epilogue_spec(), o, out=codes[:D], scale_out=scales[:D])
                    _stats["epilogue_fp8_tokens"] += D
                else:
                    mla_epilogue_step(self.epilogue_spec(), o, out=output[:D])
                _stats["epilogue_calls"] += 1
                _stats["epilogue_tokens"] += D
            else:
                if split.decode_fused:  # vLLM's W_UV bmm (no epilogue, or faster at this D)
                    if self.epilogue:
                        _stats["epilogue_vllm_tokens"] += D
                    ad.decode_attention(a, q_dec, cache, md, output[:D])
                else:
                    # vLLM's decode path (BMM, concat, MQA, W_UV) on the decode tokens alone
                    ad.own_attention(a, q_d, kv_c[:D], k_d, kv_cache, md, output[:D])
                self.quantize_rows(output, codes, scales, 0, D)


def _epilogue_nowhere(heads: int, fp8_out: bool, backend: str | None = None) -> str | None:
    """Why a layer of ``heads`` heads built with ``FUSEMLA_VLLM_EPILOGUE`` keeps vLLM's W_UV
    bmm on every step (None: some step size runs the epilogue): no decode step size was
    measured faster there (:func:`fusemla.ops.epilogue.configs.fuses_anywhere`) and
    ``FUSEMLA_VLLM_EPILOGUE_TOKENS`` is not ``all``. Decided when the layer is built, so such a
    layer hands o_proj bf16 as vLLM does: an FP8 handoff would send every row through
    o_proj's own kernel into a second buffer of codes (``o_proj_quant_rows``; copied where the
    in-place form is refused), nothing gained.
    ``backend``: the launch backend (default: the current device's)."""
    from fusemla.ops.epilogue.configs import fuses_anywhere

    if envs.get(EPILOGUE_TOKENS_ENV) == "all":
        return None
    if backend is None:
        from fusemla.ops.common import backend_of

        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        try:
            backend = backend_of(dev)
        except ValueError:  # CPU tensors without the interpreter: the PyTorch reference
            backend = "interpreter"
    if fuses_anywhere(heads, fp8_out, backend):
        return None
    return (
        f"no decode step size measured faster at {heads} heads with "
        f"{'an FP8' if fp8_out else 'a bf16'} output on {backend} "
        f"(configs.fuse_token_spans; {EPILOGUE_TOKENS_ENV}=all runs it anyway)"
    )


#: per handoff format (:meth:`_LayerState.quantizes_in_place`): whether o_proj's quantization
#: writes the handoff's rows in place (checked once on the device)
_in_place: dict[tuple, bool] = {}


def _check_in_place(ad: VllmAdapter, o, x, codes, scales, col_major: bool) -> str | None:
    """Why o_proj ``o``'s in-place quantization (:meth:`VllmAdapter.o_proj_quantize_into`)
    cannot fill the FP8 handoff (None: it can): on five rows of random bf16 values with
    magnitudes from 2^-8 to 2^8 per group, written into a poisoned handoff laid out like
    ``codes`` / ``scales`` (row-major codes; column-major scales with ``col_major``, as the
    handoff's, else row-major) at rows 1-3, row 2 alone and
    all five, its codes and scales must equal :meth:`VllmAdapter.o_proj_quantize` of the same
    rows byte for byte, and every other row keep its poison. Syncs the device (never called
    inside a capture). A local generator: vLLM's random state is not touched."""
    try:
        n, width = 5, codes.shape[1]
        groups = scales.shape[1]
        gen = torch.Generator(device=x.device)
        gen.manual_seed(20261207)
        v = torch.randn(n, groups, width // groups, generator=gen, device=x.device)
        mag = torch.randint(-8, 9, (n, groups, 1), generator=gen, device=x.device)
        v = (v * torch.exp2(mag.float())).reshape(n, width).to(x.dtype)
        poison = torch.full((n, width), 0x5A, dtype=torch.uint8, device=x.device)
        for lo, hi in ((1, 4), (2, 3), (0, n)):
            c = poison.clone().view(codes.dtype)
            if col_major:
                s = torch.full((groups, n), -1.0, device=x.device).t()
            else:
                s = torch.full((n, groups), -1.0, device=x.device)
            if not ad.o_proj_quantize_into(o, v[lo:hi], c[lo:hi], s[lo:hi]):
                return (
                    "o_proj's quantization is not vLLM's CUDA per_token_group_fp8_quant "
                    "(another platform, its native PyTorch form, or an input it refuses)"
                )
            rc, rs = ad.o_proj_quantize(o, v[lo:hi])
            got = c.view(torch.uint8)
            if not torch.equal(got[lo:hi], rc.reshape(hi - lo, width).view(torch.uint8)):
                return f"its codes of rows {lo}-{hi - 1} differ from o_proj's own quantization"
            if not torch.equal(s[lo:hi], rs.reshape(hi - lo, groups).float()):
                return f"its scales of rows {lo}-{hi - 1} differ from o_proj's own quantization"
            outside = torch.ones(n, dtype=torch.bool, device=x.device)
            outside[lo:hi] = False
            if not (
                torch.equal(got[outside], poison[outside]) and bool((s[outside] == -1.0).all())
            ):
                return f"writing rows {lo}-{hi - 1} changed other rows"
    except Exception as e:  # noqa: BLE001 - any failure means: copy, as before
        return f"{type(e).__name__}: {e}"
    return None


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _prologue(*args, **kwargs):
    """fusemla's fused prologue step (a module-level hook so tests can wrap it)."""
    from fusemla.ops.prologue.api import mla_prologue_step

    return mla_prologue_step(*args, **kwargs)


# ------------------------------------------------------------------------------ the wrapper


def _structural_reason(w) -> str | None:
    """Why a layer cannot use the fused op at all (None: it can); decided at build time."""
    forced = _forced_backends()
    why = _adapter.structural_reason(w, UNVERIFIED_FULL_GRAPH_BACKENDS, forced, FORCE_ENV)
    if why is None and pdl_trigger():
        backend = w.mla_attn.attn_backend.get_name()
        if backend in PDL_NO_WAIT_BACKENDS and backend not in forced:
            return (
                f"{PDL_TRIGGER_ENV} is on and the {backend} backend "
                f"{PDL_NO_WAIT_BACKENDS[backend]}: it could read the query before fusemla has "
                f"written it (unset {PDL_TRIGGER_ENV} to run it fused)"
            )
    return why


def _mark_compile_cache(
    dec: bool, pre: bool, w_uk: str, epilogue: bool = False, epilogue_out: str = "bf16"
) -> None:
    """Put the plugin into vLLM's config hash, so vLLM's on-disk torch.compile (AOT) cache never
    hands a graph traced with the plugin to a process without it, or the other way round.

    vLLM keys that cache on its config hash and re-checks only the source files the graph
    traced; with the plugin off, no changed file tells the two graphs apart (observed: the
    plugin-off run found the plugin-on artifact under the same key). ``additional_config`` is
    vLLM's free-form dict for plugins and is part of the hash; the model is built (and this runs)
    before the first forward compiles it.
    """
    import fusemla

    _adapter.mark_compile_cache(
        "fusemla",
        {
            "version": fusemla.__version__,
            "fused_decode": dec,
            "fused_prefill": pre,
            "w_uk": w_uk,
            "epilogue": epilogue,
            "epilogue_out": epilogue_out,
        },
    )


def _make_wrapper_class(base: type) -> type:
    class FuseMLAWrapper(base):
        """vLLM's MLA wrapper with the prologue, cache write and attention dispatch in one
        fusemla custom op (see the module docstring)."""

        _fusemla = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            dec, pre = fused_decode(), fused_prefill()
            reason = None if (dec or pre) else "FUSEMLA_FUSED_DECODE=0 and FUSEMLA_FUSED_PREFILL=0"
            if reason is None:
                reason = _structural_reason(self)
            self._fusemla_reason = reason
            if reason is not None:
                _stats["layers_vllm"] += 1
                _log_once(
                    logging.WARNING if (dec or pre) else logging.INFO,
                    "fusemla: MLA layers run vLLM's own path: %s",
                    reason,
                )
                return
            w_uk = w_uk_mode()
            epilogue = envs.get(EPILOGUE_ENV) and dec
            o_fp8 = None
            if epilogue and envs.get(EPILOGUE_OUT_ENV) == "auto":
                o_fp8, why = _adapter.o_proj_fp8_route(self)
                if o_fp8 is None:
                    _log_once(logging.INFO, "fusemla: the epilogue hands o_proj bf16: %s", why)
            if epilogue:
                why = _epilogue_nowhere(_adapter.num_heads(self), o_fp8 is not None)
                if why is not None:  # vLLM's own bmm and o_proj (its own quantization) as off
                    epilogue, o_fp8 = False, None
                    _stats["layers_epilogue_vllm"] += 1
                    _log_once(logging.INFO, "fusemla: MLA layers keep vLLM's W_UV bmm: %s", why)
            _stats["layers_fused"] += 1
            state = _LayerState(_adapter, self, dec, pre, w_uk, epilogue, o_fp8)
            _layers[state.name] = state
            self._fusemla_layer_name = state.name
            self._fusemla_o_fp8 = state.o_fp8
            if state.epilogue:
                _stats["layers_epilogue_fp8" if state.o_fp8 else "layers_epilogue_bf16"] += 1
            # logged here, not in register(): vLLM may configure its loggers after plugins load
            _log_once(
                logging.INFO,
                "fusemla: vLLM MLA plugin active (vLLM %s adapter, fused "
                "decode=%s, fused prefill=%s, W_UK %s, epilogue %s)",
                _adapter.minor,
                dec,
                pre,
                w_uk,
                f"FP8 into o_proj ({state.o_fp8['kernel']})"
                if state.o_fp8
                else ("bf16" if state.epilogue else "off"),
            )
            _mark_compile_cache(dec, pre, w_uk, state.epilogue, "fp8" if state.o_fp8 else "bf16")

        def forward(self, positions, hidden_states, llama_4_scaling=None):
            if self._fusemla_reason is not None or llama_4_scaling is not None:
                return super().forward(positions, hidden_states, llama_4_scaling)
            q, kv_c_normed, k_pe = _adapter.projections(self, hidden_states)
            T, width = hidden_states.shape[0], _adapter.output_width(self)
            output = torch.empty((T, width), dtype=q.dtype, device=q.device)
            r = self._fusemla_o_fp8
            if r is None:
                torch.ops.fusemla.vllm_mla_attention(
                    q, kv_c_normed, k_pe, positions, output, self._fusemla_layer_name
                )
                return _adapter.finish(self, output, hidden_states)
            # the FP8 handoff: o_proj's input as codes + group scales in its GEMM's layout
            codes = torch.empty((T, width), dtype=r["dtype"], device=q.device)
            groups = width // r["group_size"]
            if r["col_major"]:
                scales = torch.empty((groups, T), dtype=torch.float32, device=q.device).t()
            else:
                scales = torch.empty((T, groups), dtype=torch.float32, device=q.device)
            torch.ops.fusemla.vllm_mla_attention_fp8(
                q, kv_c_normed, k_pe, positions, output, codes, scales, self._fusemla_layer_name
            )
            return _adapter.o_proj_fp8(_adapter.o_proj(self), codes, scales)

    FuseMLAWrapper.__qualname__ = "FuseMLAWrapper"
    FuseMLAWrapper.__module__ = __name__
    return FuseMLAWrapper
