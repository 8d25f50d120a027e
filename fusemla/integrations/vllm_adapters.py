"""Every vLLM internal the plugin touches, one adapter per vLLM minor version.

:mod:`fusemla.integrations.vllm` (the plugin) holds what does not depend on vLLM's version: the
decision which layers and steps run fused, the custom op, the half-fused dispatch, the fallbacks
and their logged reasons. Whatever names a vLLM module, class, attribute, private member or
method signature goes through the adapter :func:`adapter_for` picks once, at registration, from
``vllm.__version__``. A vLLM minor version without an adapter gets none: the plugin logs that
once and stays off, vLLM's own MLA path runs.

Supported: 0.32.x (:class:`Vllm032`, tested in vLLM's CPU build in CI and its CUDA build on an
H200) and 0.33.x (:class:`Vllm033`, tested in its CUDA build on an H200). What 0.33 changed
that the plugin sees (read from both releases' sources): ``MLAAttention.update_kv_cache`` passes
a 7th argument ``skip_scale`` to ``impl.do_kv_cache_update`` (True for an FP8 cache whose scale
is exactly 1.0; the bytes written are the same), so :meth:`Vllm033.cache_write` passes it too, as
vLLM's own path does. Everything else the adapter touches is the same in both (listed in
:data:`Vllm032.INTERNALS`).

Importing this module does not import vLLM; the adapters' methods do.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["VllmAdapter", "Vllm032", "Vllm033", "ADAPTERS", "adapter_for", "minor_of"]

_FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
_PLAIN_CACHE_DTYPES = ("auto", "bfloat16", "float16", "half", "bf16")


def minor_of(version: str) -> str:
    """``"0.33"`` for ``"0.33.0"``, ``"0.33.1rc2"``, ``"0.33.0+cu130"``."""
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


class VllmAdapter:
    """The plugin's view of one vLLM minor version (the base class is vLLM 0.32's)."""

    #: the vLLM minor version this adapter was written and tested against
    minor = "0.32"

    #: (decode backend, cache kind "bf16" / "fp8") pairs that run fused under full CUDA graphs
    #: although the plugin's unverified table lists the backend (verified on this version)
    FULL_GRAPH_VERIFIED: frozenset[tuple[str, str]] = frozenset()

    #: every vLLM internal this adapter touches (for the docs and the closing notes)
    INTERNALS = (
        "vllm.__version__",
        "vllm.logger.init_logger",
        "vllm.model_executor.layers.mla.MultiHeadLatentAttentionWrapper (class; swapped through "
        "CustomOp.register_oot; its forward(positions, hidden_states, llama_4_scaling))",
        "vllm.model_executor.custom_op.op_registry_oot",
        "vllm.config.compilation.CompilationConfig._attention_ops (class list, appended to)",
        "vllm.config.get_current_vllm_config(): .compilation_config.cudagraph_mode"
        ".has_full_cudagraphs(), .additional_config (dict, hashed), .kv_transfer_config",
        "vllm.forward_context.get_forward_context(): .attn_metadata (dict by layer name or "
        "list of dicts), .slot_mapping (dict by layer name)",
        "attention metadata: .num_actual_tokens, .num_decode_tokens",
        "vllm.platforms.current_platform.fp8_dtype()",
        "vllm.models.common.ops.fused_q_kv_rmsnorm",
        "wrapper: mla_attn, rotary_emb, num_heads, qk_nope_head_dim, qk_rope_head_dim, "
        "qk_head_dim, kv_lora_rank, v_head_dim, q_lora_rank, fused_qkv_a_proj, fuse_qkv_rmsnorm, "
        "q_a_layernorm (.weight, .variance_epsilon), kv_a_layernorm, q_b_proj, q_proj, "
        "kv_a_proj_with_mqa, o_proj, g_proj, is_sparse, indexer, dcp_q_replicate",
        "rotary_emb: cos_sin_cache, is_neox_style, __call__(positions, q_pe, k_pe)",
        "MLAAttention: layer_name, W_UK_T, W_UV ([H, L, V], read by the epilogue), kv_cache, kv_cache_dtype, head_size, _k_scale, "
        "_q_scale, impl, attn_backend.get_name(), prefill_backend, use_pcp, hisparse_cache, "
        "q_pad_num_heads, is_amx_bmm_enabled, is_aiter_triton_fp8_bmm_enabled, "
        "is_aiter_triton_fp4_bmm_enabled, _uses_flat_kv_cache(), prepare_kv_cache_update(md), "
        "update_kv_cache(kv_c, k_pe, kv_cache, slots, md, dtype, k_scale), "
        "forward_impl(q, kv_c, k_pe, kv_cache, md, output=), _v_up_proj(x, out=)",
        "MLA impl: forward_mqa(q, kv_cache, md, layer) -> (out, lse), "
        "forward_mha(q, kv_c, k_pe, kv_cache, md, k_scale, output=), "
        "do_kv_cache_update(kv_c, k_pe, kv_cache, slots, dtype, k_scale), "
        "supports_quant_query_input, dcp_world_size",
        "MLAAttention.kv_b_proj (FUSEMLA_VLLM_W_UK=stored): .weight, .weight_scale_inv, "
        ".quant_method.weight_block_size",
        "o_proj (the FP8 handoff): quant_method (.fp8_linear, .block_quant), bias, "
        "input_is_parallel, reduce_results, tp_size; its fp8_linear (vLLM's "
        "Fp8BlockScaledMMLinearKernel): apply_input_quant, use_triton, config.out_dtype, "
        "quant_fp8 (.static, .is_group_quant, .group_size, .use_ue8m0, "
        ".use_deep_gemm_supported, .column_major_scales, .tma_aligned_scales, "
        ".num_token_padding, __call__(x, scale, scale_ub, use_triton=)), "
        "_get_layer_params(layer) (.weight, .block_scale, .input_scale, .input_scale_ub), "
        "apply_block_scaled_mm(A=, B=, As=, Bs=); quant_fp8._forward_method / .forward_cuda "
        "(which forward vLLM's CustomOp picked), torch.ops._C.per_token_group_fp8_quant(x, x_q, "
        "x_s, group_size, eps, fp8_min, fp8_max, ue8m0, column_major, tma_aligned) (o_proj's "
        "quantization into the handoff's rows), vllm.model_executor.layers.quantization.utils"
        ".quant_utils.get_fp8_min_max",
        "vllm.distributed.tensor_model_parallel_all_reduce, vllm.envs.VLLM_BATCH_INVARIANT",
    )

    # ------------------------------------------------------------------ registration

    def init_logger(self, name: str):
        from vllm.logger import init_logger

        return init_logger(name)

    def wrapper_base(self) -> type:
        """vLLM's MLA wrapper class (what the plugin subclasses and swaps in)."""
        from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

        return MultiHeadLatentAttentionWrapper

    def registered_oot(self, name: str) -> type | None:
        """The out-of-tree replacement already registered for custom op class ``name``."""
        from vllm.model_executor.custom_op import op_registry_oot

        return op_registry_oot.get(name)

    def register_wrapper(self, base: type, cls: type) -> None:
        base.register_oot(cls)

    def add_splitting_op(self, op_name: str) -> None:
        """Make ``op_name`` a split point of vLLM's piecewise compile: vLLM builds its default
        ``splitting_ops`` from ``CompilationConfig._attention_ops``."""
        try:
            from vllm.config.compilation import CompilationConfig
        except ImportError:  # pragma: no cover
            return
        ops = getattr(CompilationConfig, "_attention_ops", None)
        if isinstance(ops, list) and op_name not in ops:
            ops.append(op_name)

    # ------------------------------------------------------------------ config

    def _config(self):
        from vllm.config import get_current_vllm_config

        return get_current_vllm_config()

    def full_cudagraphs(self) -> bool:
        """vLLM's config captures full CUDA graphs (FULL / FULL_AND_PIECEWISE ...); outside a
        config context: assume vLLM's default (it does)."""
        try:
            mode = self._config().compilation_config.cudagraph_mode
            return bool(mode is not None and mode.has_full_cudagraphs())
        except Exception:  # pragma: no cover - outside a vLLM config context
            return True

    def kv_transfer_configured(self) -> bool:
        try:
            return getattr(self._config(), "kv_transfer_config", None) is not None
        except Exception:  # pragma: no cover - outside a vLLM config context
            return False

    def mark_compile_cache(self, key: str, value: dict) -> None:
        """Put ``value`` into the config's hashed ``additional_config`` under ``key``."""
        try:
            extra = getattr(self._config(), "additional_config", None)
        except Exception:  # pragma: no cover - outside a vLLM config context
            return
        if isinstance(extra, dict):
            extra[key] = value

    # ------------------------------------------------------------------ per step

    def step_context(self, layer_name: str) -> tuple[Any, torch.Tensor | None]:
        """(attention metadata or None, slot mapping or None) of ``layer_name`` this step."""
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

    def step_tokens(self, md) -> tuple[int, int]:
        """(tokens this step, decode tokens among them: the first ones)."""
        return int(md.num_actual_tokens), int(md.num_decode_tokens)

    def fp8_dtype(self) -> torch.dtype:
        from vllm.platforms import current_platform

        return current_platform.fp8_dtype()

    # ------------------------------------------------------------------ a layer

    def layer_dims(self, w) -> dict:
        """The MLA dims of wrapper ``w``: P, R, L, V (qk_nope, qk_rope, kv_lora_rank,
        v_head_dim)."""
        return dict(P=w.qk_nope_head_dim, R=w.qk_rope_head_dim, L=w.kv_lora_rank, V=w.v_head_dim)

    def num_heads(self, w) -> int:
        """The query heads of wrapper ``w`` on this rank (vLLM's local heads)."""
        return int(w.num_heads)

    def attention(self, w):
        """vLLM's MLAAttention of wrapper ``w`` (weights, cache, impl)."""
        return w.mla_attn

    def rotary(self, w):
        return w.rotary_emb

    def is_neox(self, rotary) -> bool:
        return bool(getattr(rotary, "is_neox_style", False))

    def cos_sin_cache(self, rotary) -> torch.Tensor | None:
        cache = getattr(rotary, "cos_sin_cache", None)
        return cache if isinstance(cache, torch.Tensor) else None

    def layer_name(self, attn) -> str:
        return attn.layer_name

    def backend_name(self, attn) -> str:
        return attn.attn_backend.get_name()

    def w_uk_t(self, attn) -> Any:
        """vLLM's absorbed W_UK_T ([H, P, L], a permuted view) or None when it holds none."""
        return getattr(attn, "W_UK_T", None)

    def w_uv(self, attn) -> Any:
        """vLLM's W_UV ([H, L, V], a transposed view) or None when it holds none."""
        return getattr(attn, "W_UV", None)

    def kv_cache(self, attn) -> torch.Tensor:
        return attn.kv_cache

    def kv_cache_dtype(self, attn) -> str:
        return attn.kv_cache_dtype

    def is_fp8_cache(self, attn) -> bool:
        return attn.kv_cache_dtype in _FP8_CACHE_DTYPES

    def k_scale(self, attn) -> torch.Tensor:
        return attn._k_scale

    def fp8_query(self, attn) -> tuple[bool, torch.Tensor | None]:
        """(the decode backend takes an FP8 query, its scale) for an FP8 cache."""
        return bool(getattr(attn.impl, "supports_quant_query_input", False)), attn._q_scale

    def structural_reason(
        self, w, unverified_full_graph: dict[str, str], forced: set[str], force_env: str
    ) -> str | None:
        """Why wrapper ``w``'s layer cannot run fused at all (None: it can), decided when the
        layer is built. ``unverified_full_graph``: backend -> why it is left to vLLM under full
        CUDA graphs, unless named in ``forced``."""
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
            a, "is_aiter_triton_fp4_bmm_enabled", False
        ):
            return "kv_b_proj runs AITER's FP8/FP4 BMM (quantized W_UK)"
        if a.prefill_backend is None:
            return "no dense prefill backend"
        backend = a.attn_backend.get_name()
        cache = "fp8" if self.is_fp8_cache(a) else "bf16"
        if (
            backend in unverified_full_graph
            and (backend, cache) not in self.FULL_GRAPH_VERIFIED
            and backend not in forced
            and self.full_cudagraphs()
        ):
            return (
                f"the {backend} decode backend with a {cache} cache "
                f"{unverified_full_graph[backend]}; it runs fused with enforce_eager=True (set "
                f"{force_env}={backend} to run it fused anyway, for diagnosis)"
            )
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
        if self.kv_transfer_configured():
            return (
                "a KV-transfer connector is configured (its per-layer load/save hooks run "
                "only inside vLLM's own attention op)"
            )
        return None

    def projections(self, w, hidden_states: torch.Tensor):
        """q [N, H, P+R] (not rotated), normalized latent [N, L], k_pe [N, 1, R] (not rotated):
        vLLM's projections and norms, as its own wrapper forward computes them."""
        if w.q_lora_rank is not None:
            qkv = w.fused_qkv_a_proj(hidden_states)[0]
            q_c, kv_lora = qkv.split([w.q_lora_rank, w.kv_lora_rank + w.qk_rope_head_dim], dim=-1)
            kv_c, k_pe = kv_lora.split([w.kv_lora_rank, w.qk_rope_head_dim], dim=-1)
            if w.fuse_qkv_rmsnorm:
                from vllm.models.common.ops import fused_q_kv_rmsnorm

                q_in, kv_c_normed = fused_q_kv_rmsnorm(
                    q_c,
                    kv_c,
                    w.q_a_layernorm.weight.data,
                    w.kv_a_layernorm.weight.data,
                    w.q_a_layernorm.variance_epsilon,
                )
            else:
                q_in = w.q_a_layernorm(q_c)
                kv_c_normed = w.kv_a_layernorm(kv_c)
            q = w.q_b_proj(q_in)[0]
        else:
            kv_lora = w.kv_a_proj_with_mqa(hidden_states)[0]
            kv_c, k_pe = kv_lora.split([w.kv_lora_rank, w.qk_rope_head_dim], dim=-1)
            kv_c_normed = w.kv_a_layernorm(kv_c)
            q = w.q_proj(hidden_states)[0]
        q = q.view(-1, w.num_heads, w.qk_head_dim)
        return q, kv_c_normed, k_pe.unsqueeze(1)

    def output_width(self, w) -> int:
        return w.num_heads * w.v_head_dim

    def finish(self, w, output: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """The wrapper's forward after attention: the optional gate, then o_proj."""
        if w.g_proj is not None:
            output = output * w.g_proj(hidden_states)[0].sigmoid()
        return w.o_proj(output)[0]

    # ------------------------------------------------------------------ FP8 weights as stored

    def kv_b_proj_fp8(self, attn) -> tuple[tuple | None, str | None]:
        """``((weight, weight_scale_inv, (bn, bk)), None)`` when vLLM holds the layer's
        ``kv_b_proj`` as a block-FP8 checkpoint stores it (``[H * (P + V), L]`` FP8 codes and
        one fp32 scale per ``bn x bk`` block), else ``(None, why)``."""
        kvb = getattr(attn, "kv_b_proj", None)
        w = getattr(kvb, "weight", None)
        s = getattr(kvb, "weight_scale_inv", None)
        if not isinstance(w, torch.Tensor) or w.dtype not in (
            torch.float8_e4m3fn,
            torch.float8_e4m3fnuz,
        ):
            return None, f"kv_b_proj's weight is {getattr(w, 'dtype', None)}, not FP8"
        block = getattr(getattr(kvb, "quant_method", None), "weight_block_size", None)
        if not isinstance(s, torch.Tensor) or not block or len(block) != 2:
            return None, "kv_b_proj is FP8 without 2-D block scales (weight_scale_inv)"
        bn, bk = (int(b) for b in block)
        want = (-(-w.shape[0] // bn), -(-w.shape[1] // bk))
        if s.dtype != torch.float32 or tuple(s.shape) != want or w.dim() != 2:
            return None, (
                f"kv_b_proj's block scales are {s.dtype} {tuple(s.shape)}, not fp32 {want} "
                f"(vLLM re-laid them out for its GEMM)"
            )
        return (w, s, (bn, bk)), None

    # ------------------------------------------------------------------ o_proj's FP8 input

    def o_proj_fp8_route(self, w) -> tuple[dict | None, str | None]:
        """``(route, None)`` when wrapper ``w``'s o_proj is a block-FP8 linear whose own input
        quantization the epilogue can do instead, else ``(None, why)``. ``route``: the FP8
        dtype, the group size, UE8M0 scales, column-major scales (the layout the o_proj kernel
        reads). Decided when the layer is built (the kernel object is vLLM's choice then)."""
        o = getattr(w, "o_proj", None)
        qm = getattr(o, "quant_method", None)
        k = getattr(qm, "fp8_linear", None)
        if k is None or not getattr(qm, "block_quant", False):
            return None, "o_proj is not a block-FP8 linear"
        name = type(k).__name__
        if not getattr(k, "apply_input_quant", False) or not callable(
            getattr(k, "apply_block_scaled_mm", None)
        ):
            return None, f"o_proj's kernel {name} takes its input unquantized"
        if hasattr(k, "base") and hasattr(k, "fallback"):
            return None, f"o_proj's kernel {name} picks between two kernels at run time"
        qf = getattr(k, "quant_fp8", None)
        if (
            qf is None
            or getattr(qf, "static", True)
            or not getattr(qf, "is_group_quant", False)
            or getattr(qf, "num_token_padding", None) is not None
        ):
            return None, f"o_proj's kernel {name} does not quantize per token group"
        if getattr(qf, "tma_aligned_scales", False):
            return None, f"o_proj's kernel {name} reads TMA-aligned scales"
        if getattr(qf, "use_ue8m0", False) and getattr(qf, "use_deep_gemm_supported", False):
            return None, f"o_proj's kernel {name} reads DeepGEMM's packed UE8M0 scales"
        if getattr(o, "bias", None) is not None or not getattr(o, "input_is_parallel", True):
            return None, "o_proj has a bias or splits its input itself"
        if getattr(w, "g_proj", None) is not None:
            return None, "a gate multiplies o_proj's input"
        try:
            import vllm.envs as venvs

            if getattr(venvs, "VLLM_BATCH_INVARIANT", False):
                return None, "VLLM_BATCH_INVARIANT is set"
        except ImportError:  # pragma: no cover
            pass
        return (
            dict(
                dtype=self.fp8_dtype(),
                group_size=int(qf.group_size),
                ue8m0=bool(getattr(qf, "use_ue8m0", False)),
                col_major=bool(getattr(qf, "column_major_scales", False)),
                kernel=name,
            ),
            None,
        )

    def o_proj(self, w):
        """Wrapper ``w``'s output projection (vLLM's RowParallelLinear)."""
        return w.o_proj

    def o_proj_quantize(self, o, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj ``o``'s own input quantization of ``x`` ``[m, H*V]`` (what its
        ``apply_weights`` would run): ``(codes, scales)`` in the layout its GEMM reads."""
        k = o.quant_method.fp8_linear
        p = k._get_layer_params(o)
        return k.quant_fp8(x, p.input_scale, p.input_scale_ub, use_triton=k.use_triton)

    def o_proj_quantize_into(
        self, o, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor
    ) -> bool:
        """o_proj ``o``'s own input quantization of ``x`` ``[m, H*V]`` written straight into
        ``codes`` / ``scales`` (``m`` rows of the FP8 handoff's buffers, in its GEMM's layout),
        in one launch of the kernel o_proj runs itself: True. That is vLLM's CUDA
        ``per_token_group_fp8_quant`` whenever o_proj's ``QuantFP8`` dispatches to its
        ``forward_cuda`` (vLLM's custom op enabled, ``+quant_fp8``; the route refused DeepGEMM's
        packed and TMA-aligned scales) and ``x`` and ``codes`` are contiguous CUDA tensors; it
        takes its outputs as arguments and addresses column-major scales through their column
        stride, so a row range of the handoff's scales is written in place. Else False and
        nothing written (the caller quantizes and copies). The plugin checks the result against
        :meth:`o_proj_quantize` on the device once before it relies on it."""
        qf = o.quant_method.fp8_linear.quant_fp8
        fwd = getattr(qf, "_forward_method", None)
        if fwd is None or fwd != getattr(qf, "forward_cuda", None):
            return False
        if not (x.is_contiguous() and codes.is_contiguous()):
            return False
        kernel = self.group_quant_kernel(x)
        if kernel is None:
            return False
        fmin, fmax = self.fp8_min_max()
        kernel(
            x,
            codes,
            scales,
            int(qf.group_size),
            1e-10,  # vLLM's per_token_group_quant_fp8 default eps
            fmin,
            fmax,
            bool(qf.use_ue8m0),
            bool(qf.column_major_scales),
            False,  # TMA-aligned scales: the route refused them
        )
        return True

    def group_quant_kernel(self, x: torch.Tensor):
        """vLLM's ``torch.ops._C.per_token_group_fp8_quant`` for CUDA tensors ``x`` (what
        ``fp8_utils.per_token_group_quant_fp8`` calls on a contiguous input), else None."""
        if x.device.type != "cuda" or torch.version.cuda is None:
            return None
        try:
            return torch.ops._C.per_token_group_fp8_quant
        except (AttributeError, RuntimeError):  # not built into this vLLM
            return None

    def fp8_min_max(self) -> tuple[float, float]:
        """The code range vLLM's FP8 quantization clamps to (``get_fp8_min_max``)."""
        from vllm.model_executor.layers.quantization.utils.quant_utils import get_fp8_min_max

        fmin, fmax = get_fp8_min_max()
        return float(fmin), float(fmax)

    def o_proj_fp8(self, o, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """o_proj ``o`` on an input already quantized in its kernel's layout: vLLM's
        ``RowParallelLinear.forward`` + ``apply_weights`` without the input quantization
        (the route refused a bias, a gate, and an input split)."""
        k = o.quant_method.fp8_linear
        p = k._get_layer_params(o)
        y = k.apply_block_scaled_mm(A=codes, B=p.weight, As=scales, Bs=p.block_scale)
        y = y.to(dtype=k.config.out_dtype)
        if getattr(o, "reduce_results", False) and getattr(o, "tp_size", 1) > 1:
            from vllm.distributed import tensor_model_parallel_all_reduce

            y = tensor_model_parallel_all_reduce(y)
        return y

    # ------------------------------------------------------------------ vLLM's own kernels

    def rope(self, rotary, positions, q_pe, k_pe):
        """vLLM's rotary embedding: (rotated q_pe, rotated k_pe)."""
        return rotary(positions, q_pe, k_pe)

    def cache_write(self, attn, kv_c, k_pe, kv_cache, slots) -> None:
        """vLLM's cache write of these tokens (what ``update_kv_cache`` calls)."""
        attn.impl.do_kv_cache_update(
            kv_c, k_pe, kv_cache, slots, attn.kv_cache_dtype, attn._k_scale
        )

    def own_path(self, attn, q, kv_c, k_pe, md, slots, output) -> None:
        """vLLM's MLAAttention for this step, after RoPE: cache update, then attention."""
        attn.prepare_kv_cache_update(md)
        attn.update_kv_cache(
            kv_c, k_pe, attn.kv_cache, slots, md, attn.kv_cache_dtype, attn._k_scale
        )
        attn.forward_impl(q, kv_c, k_pe, attn.kv_cache, md, output=output)

    def own_attention(self, attn, q, kv_c, k_pe, kv_cache, md, output) -> None:
        """vLLM's attention alone (rotated q / k_pe; the cache already written)."""
        attn.forward_impl(q, kv_c, k_pe, kv_cache, md, output=output)

    def prefill_attention(self, attn, q, kv_c, k_pe, cache, md, output) -> None:
        attn.impl.forward_mha(q, kv_c, k_pe, cache, md, attn._k_scale, output=output)

    def decode_mqa(self, attn, q, cache, md) -> torch.Tensor:
        """vLLM's decode MQA on the 576-wide query: the latent attention output [D, H, L]."""
        out, _ = attn.impl.forward_mqa(q, cache, md, attn)
        return out

    def v_up_proj(self, attn, out, output) -> None:
        """vLLM's W_UV projection of the attention output into ``output`` (o_proj's input)."""
        attn._v_up_proj(out, out=output)

    def decode_attention(self, attn, q, cache, md, output) -> None:
        """vLLM's decode MQA on the 576-wide query, then its W_UV projection into ``output``."""
        self.v_up_proj(attn, self.decode_mqa(attn, q, cache, md), output)


class Vllm032(VllmAdapter):
    """vLLM 0.32.x."""

    minor = "0.32"


#: (decode backend, cache kind) pairs of the plugin's unverified full-graph table that vLLM
#: 0.33's GPU suite judged right fused under full CUDA graphs (tests/vllm/test_vllm_gpu.py,
#: flashmla group, on the H200). FLASHMLA with an FP8 cache, vLLM's own pick for FP8 caches on
#: Hopper (de9c208: within the FP8 noise floor of vLLM's own FLASHMLA path eagerly and under
#: FULL_AND_PIECEWISE, as far from it under full graphs as eagerly). FLASHMLA with a bf16 cache
#: since fusemla's kernels stopped triggering their PDL dependents early (603b9ac; at 4f5ec9c
#: the forced fused run under FULL_AND_PIECEWISE gave vLLM's own tokens, logprobs and cache rows
#: bit for bit, where de9c208's, with the early trigger, was 6x the bf16 floor).
_VERIFIED_033 = frozenset({("FLASHMLA", "fp8"), ("FLASHMLA", "bf16")})


class Vllm033(VllmAdapter):
    """vLLM 0.33.x: the cache write passes ``skip_scale`` (as 0.33's ``update_kv_cache`` does)."""

    minor = "0.33"
    FULL_GRAPH_VERIFIED = _VERIFIED_033
    INTERNALS = VllmAdapter.INTERNALS + (
        "MLA impl: do_kv_cache_update(..., skip_scale) (new in 0.33); MLAAttention: "
        "_k_scale_float (read for skip_scale)",
    )

    def cache_write(self, attn, kv_c, k_pe, kv_cache, slots) -> None:
        skip = (
            attn.kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2")
            and float(getattr(attn, "_k_scale_float", 0.0)) == 1.0
        )
        attn.impl.do_kv_cache_update(
            kv_c, k_pe, kv_cache, slots, attn.kv_cache_dtype, attn._k_scale, skip
        )


#: the supported vLLM minor versions and their adapters
ADAPTERS: dict[str, type[VllmAdapter]] = {"0.32": Vllm032, "0.33": Vllm033}


def adapter_for(version: str) -> VllmAdapter | None:
    """The adapter of vLLM ``version`` (e.g. "0.33.0"), or None when no adapter covers it."""
    cls = ADAPTERS.get(minor_of(version))
    return cls() if cls is not None else None
