"""``MLAAttention``: a DeepSeek-V2/V3 Multi-Head Latent Attention layer over a paged KV cache.

One call runs one engine step: a decode-first batch (vLLM's order) described by a
:class:`fusemla.metadata.BatchMetadata`, against a paged cache ``[num_blocks, block_size, L + R]``
(dims: ``H`` heads, ``P`` = qk_nope_head_dim, ``R`` = qk_rope_head_dim, ``L`` = kv_lora_rank,
``V`` = v_head_dim). Per step, ``N`` tokens of which the first ``D = num_decode_tokens`` decode:

1. Projections (PyTorch): ``q = q_b_proj(rmsnorm(q_a_proj(x)))`` (or ``q_proj(x)``) viewed
   ``[N, H, P + R]``; ``kv_a = kv_a_proj_with_mqa(x)``, ``kv_c = kv_a_layernorm(kv_a[:, :L])``,
   ``k_pe = kv_a[:, L:]``. :meth:`MLAAttention.forward_latent` starts after this step.
2. The prologue, **fused** in one Triton launch (:func:`fusemla.mla_prologue`): the decode
   tokens' absorbed BMM ``q_nope @ W_UK_T``, RoPE of ``q_pe`` and the concat into the
   ``L + R``-wide latent query; the prefill tokens' RoPE of ``q_pe``; every token's RoPE of
   ``k_pe`` and paged cache write of ``[kv_c, rope(k_pe)]``. It is the step's only RoPE and its
   only cache write.
3. Decode attention, **not fused**, plain PyTorch
   (:func:`fusemla.reference.attention.paged_decode_attention`): latent MQA over the cache
   (scores over all ``L + R`` dims, values the first ``L``), then ``W_UV [H, L, V]``: with
   the fused decode on, the fused epilogue (:func:`fusemla.mla_epilogue`) writes o_proj's
   input from the attention output (rounded to the layer's dtype, as an engine's attention
   kernel returns it); off, a plain fp32 einsum. Static-shaped: a decode step can be captured in a CUDA graph and compiled with
   ``torch.compile(fullgraph=True)``. A Triton paged decode-attention kernel is a later piece.
4. Prefill attention, **not fused**, plain PyTorch, one request at a time
   (:func:`fusemla.reference.attention.prefill_attention`): causal, non-absorbed; ``k_nope``
   and ``v`` are expanded from the cached latents with the unquantized ``kv_b_proj`` weight.
5. ``o_proj`` (:meth:`MLAAttention.forward`; :meth:`~MLAAttention.forward_latent` returns the
   ``[N, H * V]`` attention output before it).

Flags (:mod:`fusemla.config`): ``FUSEMLA_FUSED_DECODE`` and ``FUSEMLA_FUSED_PREFILL`` (default
on, read on every call) or a per-layer :class:`fusemla.config.MLAConfig` (which wins) choose
the fused kernel or the unfused reference prologue (:func:`fusemla.mla_prologue_ref`) for each
half of the batch. Both on: one fused launch for the whole batch. One on: the fused call on its
half (slices of the batch) and the reference on the other. Both off: the reference. Each
token's cache row is written exactly once whatever the flags. Under ``torch.compile`` the
environment is read when the graph is traced and not guarded (changing it later does not
recompile); a changed ``layer.config`` does recompile. A captured CUDA graph keeps the paths it
was captured with.

RoPE coordination: the layer never rotates by itself; the prologue does, by ``positions``, in
the config's style (``is_neox = not rope_interleave``; DeepSeek rotates interleaved pairs). An
engine whose model wrapper rotated ``q_pe`` and ``k_pe`` already passes ``rope_applied=True``
to :meth:`~MLAAttention.forward_latent`; the prologue then uses them as given, so RoPE never
runs twice.

FP8 cache (``float8_e4m3fn`` / ``e4m3fnuz`` with ``kv_scale``, a float or a 1-element fp32
tensor read on the device): rows are stored as ``saturate(x / kv_scale)`` and read back as
``code * kv_scale`` in fp32. Both attentions read every key and value, this step's included,
from the cache after the prologue wrote it, so every key/value passes through FP8, decode and
prefill alike, as in an engine. The query stays in the activations' dtype.

Padding decode requests (``seq_len`` 0, slot -1) write nothing and get zero output rows. A
non-finite activation of one token reaches its own output row and, through its cache row, the
queries that attend to it: the same request's later tokens in this step and its later decode
steps; never another request. (Under the Triton interpreter the fused kernel stores a finite
FP8 code for a NaN value, so there the NaN stops at the cache; compiled on a GPU, and in the
reference, it is stored as FP8 NaN.)

Weights: :meth:`MLAAttention.from_hf` (a transformers ``DeepseekV3Attention``) or
:meth:`MLAAttention.from_state_dict` (a checkpoint's ``self_attn.*`` tensors; block-FP8
``weight`` + ``weight_scale_inv`` pairs are dequantized). ``W_UK_T [H, P, L]`` and
``W_UV [H, L, V]`` are split from ``kv_b_proj`` once; ``weight_format`` picks the W_UK_T the
fused kernel reads: ``"plain"`` (the activations' dtype), ``"fp8"`` or ``"mxfp4"`` (a
:class:`fusemla.quant.QuantizedWeight`); prefill always uses the unquantized weight. The
prologue's per-layer arguments (its :class:`~fusemla.contracts.prologue.PrologueSpec`: W_UK_T,
the RoPE tables) are checked once, by :meth:`~MLAAttention.load_weights`, and again only when
one of them changes. Per step the layer reads the metadata's decode and prefill views
(:attr:`~fusemla.metadata.BatchMetadata.decode` / ``.prefill``). Build the layer in the dtype
you want (bf16/fp16); ``module.to(dtype)`` is not supported. Parameters do
not require grad: it is an inference layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fusemla import platform
from fusemla.config import MLAConfig
from fusemla.dtypes import FP8_DTYPES
from fusemla.errors import FuseMLATypeError, FuseMLAValueError, describe
from fusemla.metadata import BatchMetadata
from fusemla.quant import QuantizedWeight, dequantize_block_fp8, prepare_w_uk_t
from fusemla.reference.attention import gather_latents, paged_decode_attention, prefill_attention
from fusemla.rope import rope_cache_from_hf_config, split_cos_sin_cache, yarn_get_mscale

Scale = float | torch.Tensor | None

__all__ = ["WEIGHT_FORMATS", "MLAAttention", "RMSNorm", "softmax_scale_from_hf_config"]

#: ``weight_format`` values: the W_UK_T the fused kernel reads
WEIGHT_FORMATS = ("plain", "fp8", "mxfp4")
_DTYPES = (torch.bfloat16, torch.float16)
_LINEARS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_NORMS = ("q_a_layernorm", "kv_a_layernorm")


class RMSNorm(nn.Module):
    """DeepSeek's RMSNorm: normalize in fp32, cast back to the input dtype, scale by ``weight``."""

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype=None, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _positive_int(cfg: Any, key: str) -> int:
    value = _get(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FuseMLAValueError(f"hf_config.{key}: expected a positive int, got {value!r}")
    return value


def softmax_scale_from_hf_config(hf_config: Any) -> float:
    """``(P + R) ** -0.5``, times ``yarn_get_mscale(factor, mscale_all_dim) ** 2`` under YaRN
    (DeepSeek's softmax scale; Hugging Face's ``DeepseekV3Attention.scaling``)."""
    scale = (
        _positive_int(hf_config, "qk_nope_head_dim") + _positive_int(hf_config, "qk_rope_head_dim")
    ) ** -0.5
    params = _get(hf_config, "rope_parameters") or _get(hf_config, "rope_scaling") or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type != "default" and params.get("mscale_all_dim"):
        m = yarn_get_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def _check_choice(dtype: object, weight_format: object, config: object) -> None:
    if dtype not in _DTYPES:
        raise FuseMLATypeError(
            f"dtype: expected torch.bfloat16 or torch.float16 (the fused "
            f"kernel's activations), got {describe(dtype)}"
        )
    if weight_format not in WEIGHT_FORMATS:
        raise FuseMLAValueError(
            f"weight_format: expected one of {WEIGHT_FORMATS}, got {weight_format!r}"
        )
    if config is not None and not isinstance(config, MLAConfig):
        raise FuseMLATypeError(
            f"config: expected None or a fusemla.MLAConfig, got {describe(config)}"
        )


class MLAAttention(nn.Module):
    """DeepSeek MLA over a paged cache with the fused prologue; see the module docstring.

    Build it with :meth:`from_hf` or :meth:`from_state_dict`; the constructor makes the modules
    (uninitialized) and :meth:`load_weights` fills them and derives ``W_UK_T`` / ``W_UV``.
    Dims: ``H = num_heads``, ``P = qk_nope_head_dim``, ``R = qk_rope_head_dim``,
    ``L = kv_lora_rank``, ``V = v_head_dim``.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None,
        cos_sin_cache: torch.Tensor,
        softmax_scale: float,
        is_neox: bool = False,
        attention_bias: bool = False,
        norm_eps: float = 1e-6,
        dtype: torch.dtype = torch.bfloat16,
        weight_format: str = "plain",
        config: MLAConfig | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        _check_choice(dtype, weight_format, config)
        dims = {
            "hidden_size": hidden_size,
            "num_heads": num_heads,
            "kv_lora_rank": kv_lora_rank,
            "qk_nope_head_dim": qk_nope_head_dim,
            "qk_rope_head_dim": qk_rope_head_dim,
            "v_head_dim": v_head_dim,
        }
        for name, value in dims.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise FuseMLAValueError(f"{name}: expected a positive int, got {value!r}")
        if q_lora_rank is not None and (
            isinstance(q_lora_rank, bool) or not isinstance(q_lora_rank, int) or q_lora_rank <= 0
        ):
            raise FuseMLAValueError(
                f"q_lora_rank: expected None or a positive int, got {q_lora_rank!r}"
            )
        if not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0:
            raise FuseMLAValueError(f"softmax_scale: expected a float > 0, got {softmax_scale!r}")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.H, self.P, self.R = num_heads, qk_nope_head_dim, qk_rope_head_dim
        self.L, self.V = kv_lora_rank, v_head_dim
        self.q_lora_rank = q_lora_rank
        self.softmax_scale = float(softmax_scale)
        self.is_neox = bool(is_neox)
        self.dtype = dtype
        self.weight_format = weight_format
        self.config = config
        kw = {"dtype": dtype, "device": device}
        H, P, R, L, V = self.H, self.P, self.R, self.L, self.V

        def linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
            return nn.Linear(n_in, n_out, bias=bias, **kw)

        if q_lora_rank is None:
            self.q_proj = linear(hidden_size, H * (P + R), False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = linear(hidden_size, q_lora_rank, attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps, **kw)
            self.q_b_proj = linear(q_lora_rank, H * (P + R), False)
        self.kv_a_proj_with_mqa = linear(hidden_size, L + R, attention_bias)
        self.kv_a_layernorm = RMSNorm(L, norm_eps, **kw)
        self.kv_b_proj = linear(L, H * (P + V), False)
        self.o_proj = linear(H * V, hidden_size, attention_bias)

        cos_sin = torch.as_tensor(cos_sin_cache)
        if cos_sin.dim() != 2 or cos_sin.shape[1] != R:
            raise FuseMLAValueError(
                f"cos_sin_cache: expected shape [max_position, R={R}], "
                f"got {describe(cos_sin_cache)}"
            )
        cos, sin = split_cos_sin_cache(cos_sin.to(device=device, dtype=torch.float32))
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        # Derived from kv_b_proj by load_weights(): W_UV [H, L, V]; W_UK [H, P, L] unquantized
        # for prefill; the fused kernel's W_UK_T (plain: the same tensor; else data + scale).
        self.register_buffer("W_UV", torch.empty(H, L, V, **kw), persistent=False)
        self.register_buffer("W_UK", torch.empty(H, P, L, **kw), persistent=False)
        self.register_buffer("_w_uk_t_data", None, persistent=False)
        self.register_buffer("_w_uk_t_scale", None, persistent=False)
        # (key, source tensors, PrologueSpec): built by load_weights, see _spec()
        self._spec_cache: tuple | None = None
        self._epilogue_spec_cache: tuple | None = None
        self.requires_grad_(False)  # an inference layer: the fused op has no backward

    # ------------------------------------------------------------------------------ weights

    @property
    def W_UK_T(self) -> torch.Tensor | QuantizedWeight:
        """The absorbed key weight ``[H, P, L]`` the prologue reads (per ``weight_format``)."""
        if self.weight_format == "plain":
            return self.W_UK
        return QuantizedWeight(self._w_uk_t_data, self._w_uk_t_scale, self.weight_format)

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy a checkpoint's ``self_attn.*`` tensors in (keys without the prefix) and derive
        ``W_UK_T`` / ``W_UV``. A linear's FP8 ``weight`` with ``weight_scale_inv`` ([128, 128]
        blocks) is dequantized to fp32 first. Raises on missing, unexpected or misshapen keys."""
        if not isinstance(state_dict, Mapping):
            raise FuseMLATypeError(
                f"state_dict: expected a mapping of tensors, got {describe(state_dict)}"
            )
        expected = {}
        for name in _LINEARS + _NORMS:
            mod = getattr(self, name)
            if mod is not None:
                for pname, p in mod.named_parameters():
                    expected[f"{name}.{pname}"] = p
        scales = {f"{n}.weight_scale_inv" for n in _LINEARS if getattr(self, n) is not None}
        unexpected = sorted(k for k in state_dict if k not in expected and k not in scales)
        missing = sorted(k for k in expected if k not in state_dict)
        if unexpected or missing:
            raise FuseMLAValueError(
                f"state_dict: expected the keys {sorted(expected)} (+ optional "
                f"<linear>.weight_scale_inv), got missing {missing}, unexpected {unexpected}"
            )
        w_kv_b32 = None
        for key, param in expected.items():
            value = state_dict[key]
            if not isinstance(value, torch.Tensor):
                raise FuseMLATypeError(
                    f"state_dict[{key!r}]: expected a tensor, got {describe(value)}"
                )
            scale_key = key.removesuffix(".weight") + ".weight_scale_inv"
            if value.dtype in FP8_DTYPES:
                if scale_key not in state_dict:
                    raise FuseMLAValueError(
                        f"state_dict[{scale_key!r}]: an FP8 {key} needs its block scales, got none"
                    )
                value = dequantize_block_fp8(value, state_dict[scale_key].to(value.device))
            elif key.endswith(".weight") and scale_key in state_dict:
                raise FuseMLAValueError(
                    f"state_dict[{scale_key!r}]: expected only with an FP8 "
                    f"{key}, got {key} {describe(value)}"
                )
            if tuple(value.shape) != tuple(param.shape):
                raise FuseMLAValueError(
                    f"state_dict[{key!r}]: expected shape "
                    f"{list(param.shape)}, got {describe(value)}"
                )
            if key == "kv_b_proj.weight":
                w_kv_b32 = value.to(device=param.device, dtype=torch.float32)
            param.copy_(value.to(param.device))
        dims = {"num_heads": self.H, "qk_nope_head_dim": self.P, "v_head_dim": self.V}
        self.W_UK, self.W_UV = prepare_w_uk_t(w_kv_b32, **dims, dtype=self.dtype)
        if self.weight_format != "plain":  # quantized from the fp32 weight, not the bf16 copy
            fp8_dtype = platform.default_fp8_weight_dtype(platform.detect(w_kv_b32.device))
            qw = prepare_w_uk_t(w_kv_b32, **dims, format=self.weight_format, fp8_dtype=fp8_dtype)[0]
            self._w_uk_t_data, self._w_uk_t_scale = qw.data, qw.scale
        self._spec_cache = None
        self._epilogue_spec_cache = None
        self._spec()  # the prologue's per-layer arguments, checked once, here

    @classmethod
    def from_state_dict(
        cls,
        state_dict: Mapping[str, torch.Tensor],
        hf_config: Any,
        *,
        dtype: torch.dtype = torch.bfloat16,
        weight_format: str = "plain",
        max_position: int | None = None,
        config: MLAConfig | None = None,
        device: str | torch.device | None = None,
    ) -> MLAAttention:
        """A layer from a checkpoint's ``self_attn.*`` tensors (keys without the prefix:
        ``q_a_proj.weight``, ``q_a_layernorm.weight``, ``q_b_proj.weight`` or ``q_proj.weight``,
        ``kv_a_proj_with_mqa.weight``, ``kv_a_layernorm.weight``, ``kv_b_proj.weight`` (+ an
        optional ``weight_scale_inv`` per linear for block-FP8), ``o_proj.weight``, biases when
        ``attention_bias``) and a Hugging Face DeepSeek-V2/V3 config (object or mapping).

        RoPE: :func:`fusemla.rope.rope_cache_from_hf_config` (``max_position`` rows; default from
        the config), interleaved unless ``rope_interleave`` is False. Softmax scale:
        :func:`softmax_scale_from_hf_config`. RMSNorm eps 1e-6 (as DeepSeek's attention).
        ``device``: None = that of ``state_dict["kv_b_proj.weight"]``.
        """
        _check_choice(dtype, weight_format, config)
        if isinstance(state_dict, Mapping) and device is None:
            ref = state_dict.get("kv_b_proj.weight")
            device = ref.device if isinstance(ref, torch.Tensor) else None
        return cls._build(
            state_dict,
            hf_config,
            dtype=dtype,
            weight_format=weight_format,
            max_position=max_position,
            config=config,
            device=device,
            softmax_scale=softmax_scale_from_hf_config(hf_config),
            norm_eps=1e-6,
        )

    @classmethod
    def from_hf(
        cls,
        module: nn.Module,
        *,
        dtype: torch.dtype = torch.bfloat16,
        weight_format: str = "plain",
        max_position: int | None = None,
        config: MLAConfig | None = None,
    ) -> MLAAttention:
        """A layer with the weights of a transformers ``DeepseekV3Attention`` (or V2) ``module``,
        on its device. Softmax scale: ``module.scaling``; RMSNorm eps: the module's."""
        _check_choice(dtype, weight_format, config)
        hf_config = getattr(module, "config", None)
        if (
            not isinstance(module, nn.Module)
            or hf_config is None
            or not hasattr(module, "kv_b_proj")
        ):
            raise FuseMLATypeError(
                f"module: expected a transformers DeepseekV3Attention (with "
                f".config and .kv_b_proj), got {type(module).__name__}"
            )
        scaling = getattr(module, "scaling", None)
        softmax_scale = (
            float(scaling) if scaling is not None else softmax_scale_from_hf_config(hf_config)
        )
        norm = getattr(module, "kv_a_layernorm", None)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        return cls._build(
            module.state_dict(),
            hf_config,
            dtype=dtype,
            weight_format=weight_format,
            max_position=max_position,
            config=config,
            device=module.kv_b_proj.weight.device,
            softmax_scale=softmax_scale,
            norm_eps=float(eps),
        )

    @classmethod
    def _build(
        cls,
        state_dict,
        hf_config,
        *,
        dtype,
        weight_format,
        max_position,
        config,
        device,
        softmax_scale,
        norm_eps,
    ) -> MLAAttention:
        if hf_config is None:
            raise FuseMLATypeError("hf_config: expected a DeepSeek-V2/V3 config, got None")
        q_lora_rank = _get(hf_config, "q_lora_rank")
        cos_sin = rope_cache_from_hf_config(
            hf_config, max_position, dtype=torch.float32, device=device
        )
        layer = cls(
            hidden_size=_positive_int(hf_config, "hidden_size"),
            num_heads=_positive_int(hf_config, "num_attention_heads"),
            kv_lora_rank=_positive_int(hf_config, "kv_lora_rank"),
            qk_nope_head_dim=_positive_int(hf_config, "qk_nope_head_dim"),
            qk_rope_head_dim=_positive_int(hf_config, "qk_rope_head_dim"),
            v_head_dim=_positive_int(hf_config, "v_head_dim"),
            q_lora_rank=q_lora_rank,
            cos_sin_cache=cos_sin,
            softmax_scale=softmax_scale,
            is_neox=_get(hf_config, "rope_interleave", True) is False,
            attention_bias=bool(_get(hf_config, "attention_bias", False)),
            norm_eps=norm_eps,
            dtype=dtype,
            weight_format=weight_format,
            config=config,
            device=device,
        )
        layer.load_weights(state_dict)
        return layer

    # ------------------------------------------------------------------------------ forward

    def flags(self) -> tuple[bool, bool]:
        """The effective ``(fused_decode, fused_prefill)`` for the next call."""
        return (self.config or MLAConfig()).resolve()

    def forward(
        self,
        hidden_states: torch.Tensor,
        positions: torch.Tensor,
        metadata: BatchMetadata,
        kv_cache: torch.Tensor,
        kv_scale: Scale = None,
    ) -> torch.Tensor:
        """``hidden_states [N, hidden]`` (rows in ``metadata``'s decode-first order),
        ``positions [N]``, ``kv_cache [num_blocks, block_size, L + R]`` (bf16/fp16, or FP8 with
        ``kv_scale``: a float or a 1-element fp32 tensor). Writes this step's cache rows;
        returns ``[N, hidden]``."""
        md = self._check_step(metadata, kv_cache)
        N = md.num_tokens
        x = self._check_activation(
            "hidden_states",
            hidden_states,
            (N, self.hidden_size),
            lambda: f"[N={N} (the metadata's num_tokens), hidden_size={self.hidden_size}]",
        )
        self._check_positions(positions, N)
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        kv_a = self.kv_a_proj_with_mqa(x)
        kv_c = self.kv_a_layernorm(kv_a[:, : self.L])
        q = q.view(N, self.H, self.P + self.R)
        out = self._attend(q, kv_c, kv_a[:, self.L :], positions, md, kv_cache, kv_scale, False)
        return self.o_proj(out)

    def forward_latent(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        positions: torch.Tensor,
        metadata: BatchMetadata,
        kv_cache: torch.Tensor,
        kv_scale: Scale = None,
        *,
        rope_applied: bool = False,
    ) -> torch.Tensor:
        """The layer after its projections: ``q [N, H, P + R]`` (q_b_proj output), ``kv_c [N, L]``
        (after kv_a_layernorm), ``k_pe [N, R]`` (rotated only when ``rope_applied``), then as
        :meth:`forward`. Returns the attention output ``[N, H * V]`` before ``o_proj``."""
        H, P, R, L = self.H, self.P, self.R, self.L
        md = self._check_step(metadata, kv_cache)
        N = md.num_tokens
        # the expected shapes' texts are built only on failure: formatting N under
        # torch.compile would specialize a dynamic batch size
        q = self._check_activation("q", q, (N, H, P + R), lambda: f"[N={N}, H={H}, P+R={P + R}]")
        self._check_activation("kv_c", kv_c, (N, L), lambda: f"[N={N}, L={L}]")
        if isinstance(k_pe, torch.Tensor) and k_pe.dim() == 3 and k_pe.shape[1] == 1:
            k_pe = k_pe[:, 0]
        self._check_activation("k_pe", k_pe, (N, R), lambda: f"[N={N}, R={R}] or [N, 1, R]")
        self._check_positions(positions, N)
        if not isinstance(rope_applied, bool):
            raise FuseMLATypeError(f"rope_applied: expected a bool, got {describe(rope_applied)}")
        return self._attend(q, kv_c, k_pe, positions, md, kv_cache, kv_scale, rope_applied)

    def _attend(
        self, q, kv_c, k_pe, positions, md, kv_cache, kv_scale, rope_applied
    ) -> torch.Tensor:
        """:meth:`forward_latent` after its checks: the prologue, both attentions, ``[N, H*V]``."""
        H, P, L, V = self.H, self.P, self.L, self.V
        N = md.num_tokens
        q_nope, q_pe = q[..., :P], q[..., P:]
        flags = self.flags()  # the environment read once per call
        dec_q, pre_q_pe = self._prologue(
            q_nope, q_pe, kv_c, k_pe, positions, md, kv_cache, kv_scale, rope_applied, flags
        )
        parts = []
        dec, pre = md.decode, md.prefill
        if dec is not None:
            o = paged_decode_attention(
                dec_q,
                kv_cache,
                dec.block_table,
                dec.seq_lens,
                self.softmax_scale,
                kv_scale,
                kv_lora_rank=L,
            )
            if flags[0]:  # fused: the epilogue kernel writes o_proj's input [D, H*V]
                from fusemla.ops.epilogue.api import mla_epilogue_step

                o = mla_epilogue_step(self._epilogue_spec(), o.to(self.dtype))
                if pre is None:
                    return o
                parts.append(o.float().view(-1, H, V))
            else:
                parts.append(torch.einsum("dhl,hlv->dhv", o, self.W_UV.float()))  # [D, H, V]
        # Prefill requests, one at a time (host ints: a step with prefills specializes its
        # shapes). A decode-only step never reads a request's host lengths, so its batch size
        # can stay dynamic under torch.compile.
        if pre is not None:
            pre_q_nope = q_nope[pre.token_start :]
            for rq in pre.requests:
                rows = gather_latents(kv_cache, rq.block_table, kv_scale, L)[0, : rq.seq_len]
                parts.append(
                    prefill_attention(
                        pre_q_nope[rq.start : rq.end],
                        pre_q_pe[rq.start : rq.end],
                        rows,
                        self.W_UK,
                        self.W_UV,
                        rq.context_len,
                        self.softmax_scale,
                    )
                )
        if not parts:
            return q.new_zeros(0, H * V)
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return out.to(self.dtype).reshape(N, H * V)

    # ------------------------------------------------------------------------------ internals

    def _prologue(
        self, q_nope, q_pe, kv_c, k_pe, positions, md, kv_cache, kv_scale, rope_applied, flags
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's only RoPE and cache write: ``(q [D, H, L+R], rotated q_pe [N-D, H, R])``.

        The batch is cut by :func:`~fusemla.ops.prologue.halves.split_halves` (the flags); a
        half's slots are the metadata's decode or prefill view."""
        from fusemla.ops.prologue.api import mla_prologue_step
        from fusemla.ops.prologue.halves import split_halves
        from fusemla.reference.prologue import mla_prologue_step_ref

        N, D = md.num_tokens, md.num_decode_tokens
        spec = self._spec()
        dec_q = pre_q_pe = None
        for span in split_halves(N, D, *flags).spans:
            if (span.lo, span.hi) == (0, N):
                slots = md.slot_mapping
            else:
                slots = (md.decode if span.num_decode_tokens else md.prefill).slot_mapping
            s = slice(span.lo, span.hi)
            fn = mla_prologue_step if span.fused else mla_prologue_step_ref
            out = fn(
                spec,
                q_nope[s],
                q_pe[s],
                kv_c[s],
                k_pe[s],
                positions[s],
                kv_cache,
                slots,
                num_decode_tokens=span.num_decode_tokens,
                rope_applied=rope_applied,
                kv_scale=kv_scale,
            )
            if span.num_decode_tokens > 0:
                dec_q = out.q
            if span.hi > span.lo + span.num_decode_tokens:
                pre_q_pe = out.q_pe
        if dec_q is None:
            dec_q = q_nope.new_empty(0, self.H, self.L + self.R)
        if pre_q_pe is None:
            pre_q_pe = q_pe.new_empty(0, self.H, self.R)
        return dec_q, pre_q_pe

    def _spec(self):
        """The layer's :class:`~fusemla.contracts.prologue.PrologueSpec` (W_UK_T, the RoPE
        tables, is_neox), checked once: built by :meth:`load_weights`, rebuilt only when a
        source tensor was replaced (``module.to``, an assigned buffer) or written in place (its
        version counter moved), or ``weight_format`` / ``is_neox`` changed. Under
        torch.compile it is built while the graph is traced (once per graph: dynamo guards the
        buffers themselves)."""
        from fusemla.contracts.prologue import build_spec, tensor_key

        if torch.compiler.is_compiling():
            return build_spec(self.W_UK_T, self.cos_cache, self.sin_cache, is_neox=self.is_neox)
        if self.weight_format == "plain":
            sources = (self.W_UK, self.cos_cache, self.sin_cache)
        else:
            sources = (self._w_uk_t_data, self._w_uk_t_scale, self.cos_cache, self.sin_cache)
        key = (self.weight_format, self.is_neox, *map(tensor_key, sources))
        cached = self._spec_cache
        if cached is None or cached[0] != key:
            spec = build_spec(self.W_UK_T, self.cos_cache, self.sin_cache, is_neox=self.is_neox)
            # the sources are kept alive with the key, so their storage cannot be reused
            self._spec_cache = cached = (key, sources, spec)
        return cached[2]

    def _epilogue_spec(self):
        """The layer's :class:`~fusemla.contracts.epilogue.EpilogueSpec` (W_UV, bf16 output
        into o_proj), checked once and rebuilt only when W_UV was replaced or written in place
        (as :meth:`_spec`)."""
        from fusemla.contracts.epilogue import build_spec
        from fusemla.contracts.prologue import tensor_key

        if torch.compiler.is_compiling():
            return build_spec(self.W_UV)
        key = tensor_key(self.W_UV)
        cached = self._epilogue_spec_cache
        if cached is None or cached[0] != key:
            self._epilogue_spec_cache = cached = (key, self.W_UV, build_spec(self.W_UV))
        return cached[2]

    def _check_positions(self, positions: object, N: int) -> None:
        if not isinstance(positions, torch.Tensor) or tuple(positions.shape) != (N,):
            raise FuseMLAValueError(
                f"positions: expected a tensor of shape [N={N}] (the "
                f"metadata's num_tokens), got {describe(positions)}"
            )

    def _check_activation(
        self, name: str, x: object, shape: tuple, what: Callable[[], str]
    ) -> torch.Tensor:
        """``what()``: the expected shape's text, built only when a check fails."""
        if not isinstance(x, torch.Tensor):
            raise FuseMLATypeError(f"{name}: expected a torch.Tensor {what()}, got {describe(x)}")
        if x.dim() != len(shape) or any(e is not None and e != s for e, s in zip(shape, x.shape)):
            raise FuseMLAValueError(f"{name}: expected shape {what()}, got {describe(x)}")
        if x.dtype != self.dtype:
            raise FuseMLATypeError(
                f"{name}: expected dtype {self.dtype} (the layer's), got {describe(x)}"
            )
        if x.device != self.W_UV.device:
            raise FuseMLATypeError(
                f"{name}: expected device {self.W_UV.device} (the layer's), got {describe(x)}"
            )
        return x

    def _check_step(self, metadata: object, kv_cache: object) -> BatchMetadata:
        if not isinstance(metadata, BatchMetadata):
            raise FuseMLATypeError(
                f"metadata: expected a fusemla.metadata.BatchMetadata, got {describe(metadata)}"
            )
        if not isinstance(kv_cache, torch.Tensor):
            raise FuseMLATypeError(
                f"kv_cache: expected a torch.Tensor [num_blocks, block_size, "
                f"L+R], got {describe(kv_cache)}"
            )
        width = self.L + self.R
        if kv_cache.dim() != 3 or kv_cache.shape[1:] != (metadata.block_size, width):
            raise FuseMLAValueError(
                f"kv_cache: expected shape [num_blocks, block_size={metadata.block_size} (that "
                f"of metadata), L+R={width}], got {describe(kv_cache)}"
            )
        device = self.W_UV.device
        for name, t in (("kv_cache", kv_cache), ("metadata", metadata.slot_mapping)):
            if t.device != device:
                raise FuseMLATypeError(
                    f"{name}: expected device {device} (the layer's), got {describe(t)}"
                )
        return metadata

    def extra_repr(self) -> str:
        return (
            f"H={self.H}, P={self.P}, R={self.R}, L={self.L}, V={self.V}, "
            f"q_lora_rank={self.q_lora_rank}, is_neox={self.is_neox}, dtype={self.dtype}, "
            f"weight_format={self.weight_format!r}, softmax_scale={self.softmax_scale:.6g}"
        )
