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
  Each token is rotated once and written to the cache once.

``FUSEMLA_FUSED_DECODE=0`` / ``FUSEMLA_FUSED_PREFILL=0`` hand that half back to vLLM's own code
(vLLM's rotary embedding, cache write and decode BMM / prefill attention) inside the same op; both
off = vLLM's layer untouched. Read once per process, when the layers are built.

Layers or steps this plugin cannot handle run vLLM's own path, and the reason is logged once per
reason: see :func:`_structural_reason` (decided when the layer is built) and
:meth:`_LayerState.runtime_reason` (decided at the first step that sees the weights and cache).

Importing this module does not import vLLM; :func:`register` does.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter

import torch

from fusemla.config import env_switch, fused_decode, fused_prefill

__all__ = ["register", "stats", "reset_stats", "SUPPORTED_VLLM", "OP_NAME"]

SUPPORTED_VLLM = "0.32"  # the vLLM minor version this plugin was tested with (0.32.x)
OP_NAME = "fusemla::vllm_mla_attention"
ENV_SWITCH = "FUSEMLA_VLLM"

logger = logging.getLogger("vllm.fusemla")  # replaced by vLLM's own logger in register()

_lock = threading.Lock()
_registered = False  # register() succeeded in this process
_logged: set[str] = set()
_stats: Counter = Counter()
_layers: dict[str, "_LayerState"] = {}  # attention layer name -> state (read by the op)
_wrapper_cls: type | None = None


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
    ``vllm_rope_tokens`` / ``vllm_cache_write_tokens``: tokens left to vLLM's RoPE / cache write
    (a half switched off); ``mixed_calls``: op calls with both decode and prefill tokens;
    ``decode_calls`` / ``prefill_calls``: op calls with any decode / prefill tokens;
    ``no_metadata_calls``: profile / dummy runs (vLLM's path); ``fallback_calls``: steps run on
    vLLM's path for a runtime reason (logged once).
    """
    return dict(_stats)


def reset_stats() -> None:
    _stats.clear()


# ------------------------------------------------------------------------------ registration


def register() -> None:
    """The ``vllm.general_plugins`` entry point: swap vLLM's MLA wrapper for fusemla's.

    On by default; ``FUSEMLA_VLLM=0`` (0/false/no/off) leaves vLLM untouched. Only vLLM 0.32.x is
    supported: on another version it logs once and stays off. Safe to call more than once per
    process (vLLM loads general plugins once per process; a second call is a no-op).
    """
    global _registered, _wrapper_cls, logger
    with _lock:
        if _registered:
            return
        try:  # vLLM configures its "vllm" loggers after plugins may have been imported
            from vllm.logger import init_logger

            logger = init_logger("vllm.fusemla")
            logger.disabled = False  # a dictConfig after our import may have disabled it
        except ImportError:  # pragma: no cover
            pass
        if not env_switch(ENV_SWITCH, True):
            _log_once(logging.INFO, "fusemla: %s=0, vLLM's MLA path is left untouched",
                      ENV_SWITCH)
            return
        try:
            import vllm
        except ImportError:  # pragma: no cover - only called by vLLM
            return
        version = getattr(vllm, "__version__", "unknown")
        if not (version == SUPPORTED_VLLM or version.startswith(SUPPORTED_VLLM + ".")):
            _log_once(logging.WARNING,
                      "fusemla: vLLM %s is not supported (tested with %s.x): plugin off, "
                      "vLLM's own MLA path runs", version, SUPPORTED_VLLM)
            return
        from vllm.model_executor.custom_op import op_registry_oot
        from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

        name = MultiHeadLatentAttentionWrapper.__name__
        existing = op_registry_oot.get(name)
        if existing is not None and getattr(existing, "_fusemla", False):
            _registered = True  # this module was imported twice under different names
            return
        if existing is not None:
            _log_once(logging.WARNING,
                      "fusemla: %s is already replaced by %s (another plugin): fusemla off",
                      name, existing)
            return
        _register_op()
        _add_splitting_op()
        _wrapper_cls = _make_wrapper_class(MultiHeadLatentAttentionWrapper)
        MultiHeadLatentAttentionWrapper.register_oot(_wrapper_cls)
        _registered = True


def _add_splitting_op() -> None:
    """Make the fused op a split point of vLLM's piecewise compile (GPU CUDA graphs).

    The op reads per-step metadata (slot mapping, decode/prefill split), so it must run outside
    captured graph pieces, exactly like vLLM's own attention ops. vLLM builds its default
    ``splitting_ops`` from ``CompilationConfig._attention_ops``; registering happens before any
    config is built (plugins load first). A user who passes an explicit ``splitting_ops`` list
    must include ``fusemla::vllm_mla_attention`` (or run with enforce_eager).
    """
    try:
        from vllm.config.compilation import CompilationConfig
    except ImportError:  # pragma: no cover
        return
    ops = getattr(CompilationConfig, "_attention_ops", None)
    if isinstance(ops, list) and OP_NAME not in ops:
        ops.append(OP_NAME)


# ------------------------------------------------------------------------------ the custom op

_op_registered = False


def _register_op() -> None:
    global _op_registered
    if _op_registered:
        return

    @torch.library.custom_op(OP_NAME, mutates_args=("output",))
    def vllm_mla_attention(q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                           positions: torch.Tensor, output: torch.Tensor,
                           layer_name: str) -> None:
        """MLA attention of one layer for one step; reads the step's metadata at run time."""
        _layers[layer_name].run(q, kv_c_normed, k_pe, positions, output)

    @vllm_mla_attention.register_fake
    def _fake(q, kv_c_normed, k_pe, positions, output, layer_name) -> None:
        return None

    _op_registered = True


def _forward_context_for(layer_name: str):
    """(attention metadata or None, slot mapping or None) of ``layer_name`` for this step."""
    from vllm.forward_context import get_forward_context

    fc = get_forward_context()
    md = fc.attn_metadata
    if isinstance(md, dict):
        md = md.get(layer_name)
    elif isinstance(md, list):  # speculative decoding: [0] is the base model's
        md = md[0].get(layer_name) if md else None
    slots = fc.slot_mapping
    slots = slots.get(layer_name) if isinstance(slots, dict) else None
    return md, slots


# Decode backends the plugin leaves to vLLM in full CUDA-graph modes (FULL, FULL_AND_PIECEWISE,
# vLLM's default) until fusemla runs correctly through them there. Measured on the H200 (vLLM
# 0.32.0, tests/vllm/test_vllm_gpu.py, benchmarks/results/h200_vllm_gpu_*): with FLASHMLA (bf16
# cache) the fused path was bit-identical to vLLM's own in eager mode, but in FULL_AND_PIECEWISE
# its next-token logprobs deviated by 0.23 relative (noise floor 0.035; vLLM's own FLASHMLA path
# varied by 0.016 between two identical runs). FLASH_ATTN_MLA and TRITON_MLA agreed bit for bit
# in every mode. vLLM picks FLASHMLA on Hopper for FP8 caches, so those fall back by default.
UNVERIFIED_FULL_GRAPH_BACKENDS = {
    "FLASHMLA": "deviated from vLLM's own path under full CUDA graphs (H200, vLLM 0.32.0)",
}
FORCE_ENV = "FUSEMLA_VLLM_FORCE_BACKENDS"


def _forced_backends() -> set[str]:
    """Backends named in ``FUSEMLA_VLLM_FORCE_BACKENDS`` (comma-separated): run fused even
    where :data:`UNVERIFIED_FULL_GRAPH_BACKENDS` lists them (for diagnosis and tests only)."""
    raw = os.environ.get(FORCE_ENV, "")
    return {b.strip().upper() for b in raw.split(",") if b.strip()}


_FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
_PLAIN_CACHE_DTYPES = ("auto", "bfloat16", "float16", "half", "bf16")


class _LayerState:
    """What the op needs of one MLA layer (a plain object: not an nn.Module, no cycles)."""

    def __init__(self, wrapper, fused_dec: bool, fused_pre: bool):
        self.attn = wrapper.mla_attn  # vLLM's MLAAttention (weights, cache, impl)
        self.rotary_emb = wrapper.rotary_emb
        self.P = wrapper.qk_nope_head_dim
        self.R = wrapper.qk_rope_head_dim
        self.L = wrapper.kv_lora_rank
        self.fused_dec = fused_dec
        self.fused_pre = fused_pre
        self.is_neox = bool(getattr(self.rotary_emb, "is_neox_style", False))
        self._rope_key = None
        self._rope = None
        self._w_key = None
        self._w = None
        self._checked = False
        self._reason: str | None = None

    # -- cached derived tensors (refreshed if vLLM replaces the source tensor)

    def cos_sin(self):
        from fusemla.rope import split_cos_sin_cache

        cache = self.rotary_emb.cos_sin_cache
        key = (cache.data_ptr(), cache.dtype, cache.device, tuple(cache.shape))
        if key != self._rope_key:
            self._rope = split_cos_sin_cache(cache)
            self._rope_key = key
        return self._rope

    def w_uk_t(self):
        w = self.attn.W_UK_T
        key = (w.data_ptr(), w.dtype, w.device, tuple(w.stride()))
        if key != self._w_key:
            # fusemla wants the L dim contiguous; vLLM keeps a permuted view [H, P, L]
            self._w = w if w.stride(-1) == 1 else w.contiguous()
            self._w_key = key
        return self._w

    # -- runtime support check (first step with weights and a cache)

    def runtime_reason(self, q: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
        if self._checked:
            return self._reason
        a = self.attn
        reason = None
        w = getattr(a, "W_UK_T", None)
        if self.fused_dec and not isinstance(w, torch.Tensor):
            reason = ("kv_b_proj is not held as a plain W_UK_T tensor (AITER FP8/FP4 BMM or "
                      "AMX packing): decode BMM stays vLLM's")
        elif self.fused_dec and (w.dtype != q.dtype or tuple(w.shape) != (
                q.shape[1], self.P, self.L)):
            reason = f"W_UK_T {tuple(w.shape)} {w.dtype} does not match q {q.dtype}"
        elif q.dtype not in (torch.bfloat16, torch.float16):
            reason = f"activations are {q.dtype} (fusemla runs bf16/fp16)"
        elif kv_cache.dim() != 3 or kv_cache.shape[-1] != self.L + self.R:
            reason = (f"KV cache of shape {tuple(kv_cache.shape)} is not "
                      f"[blocks, block_size, {self.L + self.R}] rows")
        elif a.kv_cache_dtype in _FP8_CACHE_DTYPES and kv_cache.element_size() != 1:
            reason = f"FP8 cache of element size {kv_cache.element_size()}"
        elif not isinstance(getattr(self.rotary_emb, "cos_sin_cache", None), torch.Tensor):
            reason = "rotary embedding has no cos_sin_cache"
        self._reason = reason
        self._checked = True
        if reason is not None:
            _log_once(logging.WARNING, "fusemla: layer %s runs vLLM's MLA path: %s",
                      a.layer_name, reason)
        return reason

    # -- one step

    def run(self, q, kv_c, k_pe, positions, output) -> None:
        a = self.attn
        md, slots = _forward_context_for(a.layer_name)
        kv_cache = a.kv_cache
        if md is None or slots is None or kv_cache.numel() == 0:
            _stats["no_metadata_calls"] += 1
            self.vllm_path(q, kv_c, k_pe, positions, output, md, slots)
            return
        if self.runtime_reason(q, kv_cache) is not None:
            _stats["fallback_calls"] += 1
            self.vllm_path(q, kv_c, k_pe, positions, output, md, slots)
            return
        self.fused_path(q, kv_c, k_pe, positions, output, md, slots, kv_cache)

    def vllm_rope(self, positions, q, k_pe):
        """vLLM's own rotation of a copy of ``q`` (q_pe part) and of ``k_pe`` ([n, 1, R])."""
        q = q.clone()
        q[..., self.P:], k_pe = self.rotary_emb(positions, q[..., self.P:], k_pe)
        _stats["vllm_rope_tokens"] += q.shape[0]
        return q, k_pe

    def vllm_cache_write(self, kv_c, k_pe, kv_cache, slots) -> None:
        a = self.attn
        a.impl.do_kv_cache_update(kv_c, k_pe, kv_cache, slots, a.kv_cache_dtype, a._k_scale)
        _stats["vllm_cache_write_tokens"] += kv_c.shape[0]

    def vllm_path(self, q, kv_c, k_pe, positions, output, md, slots) -> None:
        """Exactly what vLLM's wrapper + MLAAttention do for this step."""
        a = self.attn
        q, k_pe = self.vllm_rope(positions, q, k_pe)
        a.prepare_kv_cache_update(md)
        a.update_kv_cache(kv_c, k_pe, a.kv_cache, slots, md, a.kv_cache_dtype, a._k_scale)
        a.forward_impl(q, kv_c, k_pe, a.kv_cache, md, output=output)

    def fused_path(self, q, kv_c, k_pe, positions, output, md, slots, kv_cache) -> None:
        a = self.attn
        impl = a.impl
        P, R, L = self.P, self.R, self.L
        n = int(md.num_actual_tokens)
        D = int(md.num_decode_tokens)
        q, kv_c, k_pe = q[:n], kv_c[:n], k_pe[:n]
        positions, slots = positions[:n], slots[:n]
        H = q.shape[1]
        fp8 = a.kv_cache_dtype in _FP8_CACHE_DTYPES
        cache = kv_cache
        kv_scale = None
        q_out_dtype = None
        q_scale = None
        if fp8:
            from vllm.platforms import current_platform

            cache = kv_cache.view(current_platform.fp8_dtype())
            kv_scale = a._k_scale
            if getattr(impl, "supports_quant_query_input", False):
                q_out_dtype, q_scale = cache.dtype, a._q_scale
        cos, sin = self.cos_sin()
        k2 = k_pe.reshape(n, R)
        common = dict(is_neox=self.is_neox, kv_scale=kv_scale)
        dec = self.fused_dec and D > 0
        pre = self.fused_pre and n > D

        q_dec = q_d = k_d = None  # decode query (fused) / rotated decode q, k_pe (vLLM's)
        q_pre = k_pre = None  # prefill q with rotated q_pe, rotated k_pe [n-D, 1, R]
        if pre:
            q_pre = q[D:].clone()
            k_pre = torch.empty(n - D, 1, R, dtype=q.dtype, device=q.device)
        if dec:
            q_dec = torch.empty(D, H, L + R, dtype=q_out_dtype or q.dtype, device=q.device)
        # -- one fused launch for every token fusemla handles
        if dec or pre:
            lo = 0 if dec else D
            hi = n if pre else D
            _prologue(q[lo:hi, :, :P], q[lo:hi, :, P:], kv_c[lo:hi], k2[lo:hi], self.w_uk_t(),
                      positions[lo:hi], cos, sin, cache, slots[lo:hi],
                      num_decode_tokens=(D - lo) if dec else 0,
                      out=q_dec, q_pe_out=q_pre[..., P:] if pre else None,
                      k_pe_out=k_pre[:, 0] if pre else None,
                      q_out_dtype=q_out_dtype, q_scale=q_scale, **common)
            _stats["prologue_calls"] += 1
            _stats["decode_tokens"] += D if dec else 0
            _stats["prefill_tokens"] += (n - D) if pre else 0
        # -- the halves left to vLLM: its RoPE and its cache write
        if D > 0 and not dec:
            q_d, k_d = self.vllm_rope(positions[:D], q[:D], k_pe[:D])
            self.vllm_cache_write(kv_c[:D], k_d, kv_cache, slots[:D])
        if n > D and not pre:
            q_pre, k_pre = self.vllm_rope(positions[D:], q[D:], k_pe[D:])
            self.vllm_cache_write(kv_c[D:], k_pre, kv_cache, slots[D:])
        _stats["op_calls"] += 1
        _stats["decode_calls"] += D > 0
        _stats["prefill_calls"] += n > D
        _stats["mixed_calls"] += 0 < D < n
        # -- attention: vLLM's own kernels
        if n > D:
            impl.forward_mha(q_pre, kv_c[D:], k_pre, cache, md, a._k_scale,
                             output=output[D:n])
        if D > 0:
            if dec:
                attn_out, _ = impl.forward_mqa(q_dec, cache, md, a)
                a._v_up_proj(attn_out, out=output[:D])
            else:
                # vLLM's decode path (BMM, concat, MQA, W_UV) on the decode tokens alone
                a.forward_impl(q_d, kv_c[:D], k_d, kv_cache, md, output=output[:D])


def _prologue(*args, **kwargs):
    """fusemla's fused prologue (a module-level hook so tests can wrap it)."""
    from fusemla.ops.prologue.api import mla_prologue

    return mla_prologue(*args, **kwargs)


# ------------------------------------------------------------------------------ the wrapper


def _structural_reason(w) -> str | None:
    """Why a layer cannot use the fused op at all (None: it can); decided at build time."""
    a = w.mla_attn
    impl = a.impl
    if w.rotary_emb is None:
        return "no rotary embedding (NoPE)"
    if getattr(w, "is_sparse", False) or getattr(w, "indexer", None) is not None:
        return "sparse MLA (indexer / top-k attention)"
    if getattr(w, "dcp_q_replicate", False) or getattr(impl, "dcp_world_size", 1) > 1:
        return "decode context parallelism"
    if getattr(a, "use_pcp", False):
        return "prefill context parallelism"
    if getattr(a, "hisparse_cache", None) is not None:
        return "hierarchical sparse KV cache"
    if getattr(a, "q_pad_num_heads", None) is not None:
        return f"the {a.attn_backend.get_name()} backend pads query heads"
    if getattr(a, "is_amx_bmm_enabled", False):
        return "AMX backend packs W_UK / W_UV itself"
    if getattr(a, "is_aiter_triton_fp8_bmm_enabled", False) or getattr(
            a, "is_aiter_triton_fp4_bmm_enabled", False):
        return "kv_b_proj runs AITER's FP8/FP4 BMM (quantized W_UK)"
    if a.prefill_backend is None:
        return "no dense prefill backend"
    backend = a.attn_backend.get_name()
    if (backend in UNVERIFIED_FULL_GRAPH_BACKENDS and backend not in _forced_backends()
            and _full_cudagraphs()):
        return (f"the {backend} decode backend {UNVERIFIED_FULL_GRAPH_BACKENDS[backend]}; it "
                f"runs fused with enforce_eager=True (set {FORCE_ENV}={backend} to run it fused "
                f"anyway, for diagnosis)")
    uses_flat = getattr(a, "_uses_flat_kv_cache", None)
    if callable(uses_flat) and uses_flat():
        return f"the {backend} backend keeps a flat KV cache layout"
    dt = a.kv_cache_dtype
    if dt not in _PLAIN_CACHE_DTYPES and dt not in _FP8_CACHE_DTYPES:
        return f"kv_cache_dtype={dt!r} (a packed per-token layout)"
    if w.kv_lora_rank + w.qk_rope_head_dim != a.head_size:
        return f"cache rows of {a.head_size} != kv_lora_rank + rope dim"
    if w.qk_rope_head_dim % 2:
        return "odd rope dim"
    try:
        from vllm.config import get_current_vllm_config

        if getattr(get_current_vllm_config(), "kv_transfer_config", None) is not None:
            return ("a KV-transfer connector is configured (its per-layer load/save hooks run "
                    "only inside vLLM's own attention op)")
    except Exception:  # pragma: no cover - outside a vLLM config context
        pass
    return None


def _full_cudagraphs() -> bool:
    """vLLM's config captures full CUDA graphs (FULL / FULL_AND_PIECEWISE and the like)."""
    try:
        from vllm.config import get_current_vllm_config

        cc = get_current_vllm_config().compilation_config
        mode = cc.cudagraph_mode
        return bool(mode is not None and mode.has_full_cudagraphs())
    except Exception:  # pragma: no cover - outside a vLLM config context: assume the default
        return True


def _mark_compile_cache(dec: bool, pre: bool) -> None:
    """Put the plugin into vLLM's config hash, so vLLM's on-disk torch.compile (AOT) cache never
    hands a graph traced with the plugin to a process without it, or the other way round.

    vLLM keys that cache on its config hash and re-checks only the source files the graph
    traced; with the plugin off, no changed file tells the two graphs apart (observed: the
    plugin-off run found the plugin-on artifact under the same key). ``additional_config`` is
    vLLM's free-form dict for plugins and is part of the hash; the model is built (and this runs)
    before the first forward compiles it.
    """
    try:
        from vllm.config import get_current_vllm_config

        cfg = get_current_vllm_config()
    except Exception:  # pragma: no cover - outside a vLLM config context
        return
    extra = getattr(cfg, "additional_config", None)
    if isinstance(extra, dict):
        import fusemla

        extra["fusemla"] = {"version": fusemla.__version__, "fused_decode": dec,
                            "fused_prefill": pre}


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
                _log_once(logging.WARNING if (dec or pre) else logging.INFO,
                          "fusemla: MLA layers run vLLM's own path: %s", reason)
                return
            _stats["layers_fused"] += 1
            _layers[self.mla_attn.layer_name] = _LayerState(self, dec, pre)
            # logged here, not in register(): vLLM may configure its loggers after plugins load
            _log_once(logging.INFO, "fusemla: vLLM MLA plugin active (fused decode=%s, fused "
                      "prefill=%s)", dec, pre)
            _mark_compile_cache(dec, pre)

        def forward(self, positions, hidden_states, llama_4_scaling=None):
            if self._fusemla_reason is not None or llama_4_scaling is not None:
                return super().forward(positions, hidden_states, llama_4_scaling)
            q, kv_c_normed, k_pe = self._fusemla_projections(hidden_states)
            output = torch.empty((hidden_states.shape[0], self.num_heads * self.v_head_dim),
                                 dtype=q.dtype, device=q.device)
            torch.ops.fusemla.vllm_mla_attention(q, kv_c_normed, k_pe, positions, output,
                                                 self.mla_attn.layer_name)
            if self.g_proj is not None:
                output = output * self.g_proj(hidden_states)[0].sigmoid()
            return self.o_proj(output)[0]

        def _fusemla_projections(self, hidden_states):
            """q [N, H, P+R] (not rotated), normalized latent [N, L], k_pe [N, 1, R] (not
            rotated): vLLM's projections and norms, as its own forward computes them."""
            if self.q_lora_rank is not None:
                qkv = self.fused_qkv_a_proj(hidden_states)[0]
                q_c, kv_lora = qkv.split(
                    [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1)
                kv_c, k_pe = kv_lora.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
                if self.fuse_qkv_rmsnorm:
                    from vllm.models.common.ops import fused_q_kv_rmsnorm

                    q_in, kv_c_normed = fused_q_kv_rmsnorm(
                        q_c, kv_c, self.q_a_layernorm.weight.data,
                        self.kv_a_layernorm.weight.data, self.q_a_layernorm.variance_epsilon)
                else:
                    q_in = self.q_a_layernorm(q_c)
                    kv_c_normed = self.kv_a_layernorm(kv_c)
                q = self.q_b_proj(q_in)[0]
            else:
                kv_lora = self.kv_a_proj_with_mqa(hidden_states)[0]
                kv_c, k_pe = kv_lora.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
                kv_c_normed = self.kv_a_layernorm(kv_c)
                q = self.q_proj(hidden_states)[0]
            q = q.view(-1, self.num_heads, self.qk_head_dim)
            return q, kv_c_normed, k_pe.unsqueeze(1)

    FuseMLAWrapper.__qualname__ = "FuseMLAWrapper"
    FuseMLAWrapper.__module__ = __name__
    return FuseMLAWrapper
