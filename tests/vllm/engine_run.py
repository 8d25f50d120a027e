"""One vLLM engine run for the plugin tests and the vLLM benchmark (run as a script, in its own
process: the plugin registers once per process, so plugin on and off need separate processes).

    python engine_run.py make-model DIR --shape NAME[-mtp][-fp8]
    python engine_run.py run DIR OUT_DIR [--tp N] [--mode eager|compiled|piecewise|full_and_piecewise]
        [--schedule NAME] [--kv-cache-dtype auto|fp8] [--backend NAME] [--capture] [--profile]
        [--inject none|double_rope|double_write|rope_off_by_one|noise:EPS]
        [--speculative K [--spec-method ngram|deepseek_mtp]]

``make-model`` saves a tiny DeepSeek-V3-style model (no MoE, vocab 1000, kv_lora_rank 512,
rope 64) of one of :data:`SHAPES` with real random weights through transformers'
``save_pretrained``; with the suffix ``-mtp`` it has one multi-token-prediction layer too (a
MoE layer, for vLLM's ``deepseek_mtp`` drafter: ``run --speculative 1 --spec-method
deepseek_mtp``). A shape name with the suffix ``-fp8`` (``v3-h16-fp8``, ``base-fp8``,
``seed:3-fp8``) is the same model (same dims, same weights) saved the way DeepSeek-V3's own
checkpoint is: every linear weight of the decoder layers as float8_e4m3fn codes with an fp32
``weight_scale_inv`` per 128x128 block (dequantized weight = codes * scale) and
``quantization_config`` (``fp8``, dynamic activations, ``weight_block_size`` [128, 128]) in
config.json, so vLLM loads it through its block-FP8 linear path (``Fp8LinearMethod``). vLLM
merges q_a_proj with kv_a_proj_with_mqa, and gate_proj with up_proj; where the first of a pair
(q_lora_rank, the MLP width) is not a multiple of 128 it still loads the model, but its merged
scale rows then miss the second weight's rows (base-fp8's fused_qkv_a_proj, q_lora 96,
dequantizes up to 21 % of its largest weight off). ``v3-*``, ``v2lite-*``, ``nope64-*``,
``bench-*`` and ``h1-nolora`` are multiples. ``run`` drives vLLM's engine through a
:data:`SCHEDULES` entry (requests arriving at different steps, so steps are prefill-only, mixed
and decode-only), greedy, and
writes OUT_DIR/tokens.json (tokens, top-1/top-2 margins, top-k logprobs, the engine step at which
each token appeared) plus, from every worker, OUT_DIR/rank<r>.json (counters, cache-write
accounting, kernel counts with --profile) and rank<r>.npz (used KV-cache rows, per-layer outputs
with --capture). The plugin is on or off through FUSEMLA_VLLM, set by the caller.

Modes: ``eager`` (enforce_eager), ``compiled`` (vLLM's default compile and graph mode: on the CPU
build, torch.compile without CUDA graphs), ``piecewise`` / ``full_and_piecewise`` (GPU: that
``cudagraph_mode``, with capture sizes up to the schedule's batch).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

# name -> (heads, qk_nope_head_dim, v_head_dim, q_lora_rank or 0, layers, hidden[, MLP width])
SHAPES = {
    # CPU (vLLM's CPU MLA backend takes any head dims with 576-wide cache rows)
    "base": (4, 32, 32, 96, 2, 256),
    "h1-nolora": (1, 48, 40, 0, 3, 192),  # one head, no q_lora, dims not powers of two
    "h16-lora": (16, 24, 56, 64, 3, 256),  # v_head_dim > qk_nope_head_dim
    "h6-lora": (6, 40, 24, 48, 3, 256),  # v < nope; 3 heads per rank at TP=2
    # GPU (FA3's prefill takes (nope, rope, v) = (128, 64, 128) or (64, 64, 128) here)
    "v3-h2": (2, 128, 128, 256, 2, 256),  # DeepSeek-V3's head dims, 2 heads (CPU FP8 runs)
    "v3-h16": (16, 128, 128, 384, 3, 512),  # DeepSeek-V3 attention dims, 16 heads (TP=8's share)
    "v3-h128": (128, 128, 128, 384, 3, 512),  # all 128 heads
    "v2lite-h16": (16, 128, 128, 0, 3, 512),  # DeepSeek-V2-Lite: no q_lora
    "nope64-h32": (32, 64, 128, 256, 3, 512),  # another FA3 prefill shape (nope 64 != v 128)
    # benchmarks/bench_vllm.py: DeepSeek-V3's attention (hidden 7168, q_lora 1536), small MLP
    "bench-h16": (16, 128, 128, 1536, 4, 7168, 1024),
    "bench-h128": (128, 128, 128, 1536, 4, 7168, 1024),
}

FP8_SUFFIX = "-fp8"  # SHAPES name + this: that model as a DeepSeek-V3-style block-FP8 checkpoint
MTP_SUFFIX = "-mtp"  # SHAPES name + this (before -fp8): with one multi-token-prediction layer
FP8_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size (output rows, input columns)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value

# requests: (id, arrival step, prompt length, max new tokens)
SCHEDULES = {
    # the original CPU schedule (prompts 9..57)
    "small": [("a", 0, 23, 14), ("b", 3, 41, 10), ("c", 4, 9, 12), ("d", 9, 57, 8)],
    # CPU: 1- to 300-token prompts at different steps; step 0 is prefill-only, later steps mix,
    # the tail is decode-only (a 1-token prompt is a decode-shaped query: "a" joins a decode step)
    "wide": [
        ("b", 0, 37, 8),
        ("a", 1, 1, 10),
        ("c", 2, 300, 4),
        ("d", 3, 5, 8),
        ("e", 5, 120, 5),
        ("f", 7, 2, 4),
    ],
    # GPU: vLLM's FLASH_ATTN_MLA counts requests with up to 512 new tokens as decodes, so the
    # prompts that make steps mixed are longer than that
    "gpu": [
        ("a", 0, 7, 24),
        ("b", 0, 600, 16),
        ("c", 2, 1, 24),
        ("d", 3, 900, 12),
        ("e", 5, 64, 20),
        ("f", 8, 530, 10),
        ("g", 10, 3, 16),
        ("h", 12, 700, 8),
    ],
}
TOP_K = 5  # logprobs returned per position


def schedule_from_seed(seed: int, max_prompt: int = 300) -> list:
    """A random schedule (the ``--many`` mode): 3-7 requests, prompts of 1..max_prompt tokens."""
    rnd = random.Random(seed)
    out = []
    for i in range(rnd.randint(3, 7)):
        out.append(
            (
                chr(ord("a") + i),
                rnd.randint(0, 10),
                rnd.choice([1, 2, rnd.randint(3, 40), rnd.randint(40, max_prompt)]),
                rnd.randint(3, 12),
            )
        )
    return out


def shape_from_seed(seed: int) -> tuple:
    """A random CPU model shape (the ``--many`` mode)."""
    rnd = random.Random(seed)
    nope = rnd.choice([16, 24, 40, 48, 64, 96])
    return (
        rnd.randint(1, 16),
        nope,
        rnd.choice([16, 40, nope, 72]),
        rnd.choice([0, 32, 96]),
        rnd.randint(1, 4),
        rnd.choice([128, 256]),
    )


def split_fp8(name: str) -> tuple[str, bool]:
    """``NAME-fp8`` -> ``(NAME, True)``; any other name -> ``(name, False)``."""
    if name.endswith(FP8_SUFFIX):
        return name[: -len(FP8_SUFFIX)], True
    return name, False


def split_mtp(name: str) -> tuple[str, bool]:
    """``NAME-mtp[-fp8]`` -> ``(NAME[-fp8], True)``; any other name -> ``(name, False)``."""
    base, fp8 = split_fp8(name)
    if base.endswith(MTP_SUFFIX):
        return base[: -len(MTP_SUFFIX)] + (FP8_SUFFIX if fp8 else ""), True
    return name, False


def shape_dims(name: str) -> tuple:
    """The dims of a shape name: a :data:`SHAPES` key or ``seed:<int>``, optionally ``-mtp``
    then ``-fp8``."""
    base, _ = split_fp8(split_mtp(name)[0])
    if base.startswith("seed:"):
        return shape_from_seed(int(base[5:]))
    return SHAPES[base]


def shape_names() -> list[str]:
    """Every named shape, plain and ``-fp8`` (``seed:<int>[-fp8]`` are valid too)."""
    return sorted(SHAPES) + sorted(s + FP8_SUFFIX for s in SHAPES)


def _shape_arg(name: str) -> str:
    """argparse type of ``--shape``: a valid shape name, else a message listing them."""
    try:
        shape_dims(name)
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"unknown shape {name!r}: one of {shape_names()} or seed:<int>[{FP8_SUFFIX}]"
        ) from None
    return name


def quantize_fp8_blocks(w, block=FP8_BLOCK):
    """DeepSeek-V3's block FP8 of a 2-D weight ``w`` [out, in]: ``(codes, scale_inv)``, codes
    float8_e4m3fn [out, in], scale_inv fp32 [ceil(out / block[0]), ceil(in / block[1])] with
    ``w ~= codes.float() * scale_inv`` per block (edge blocks may be partial); each block's scale
    is its max |w| / 448, so the block's largest element maps to +-448."""
    import torch

    bn, bk = block
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.view(gn, bn, gk, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(gn * bn, gk * bk)
    return q[:n, :k].to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def dequantize_fp8_blocks(codes, scale_inv, block=FP8_BLOCK):
    """The fp32 weight that block-FP8 ``codes`` with ``scale_inv`` stand for."""
    bn, bk = block
    n, k = codes.shape
    s = scale_inv.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:n, :k]
    return codes.float() * s


# the linear layers whose weights DeepSeek-V3's checkpoint stores in block FP8
_FP8_LINEARS = {
    "q_a_proj",
    "q_b_proj",
    "q_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
}


def _fp8_quantized(name: str) -> bool:
    """Whether a saved tensor is one DeepSeek-V3's checkpoint stores in block FP8: the weights of
    the decoder layers' linear layers (attention projections, dense/expert/shared MLPs), not the
    embeddings, lm_head, norms or the MoE router (``mlp.gate``)."""
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in _FP8_LINEARS


def _load_saved(path: str) -> dict:
    """Every tensor save_pretrained wrote in ``path`` (one file or shards with their index)."""
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = [
                os.path.join(path, s) for s in sorted(set(json.load(f)["weight_map"].values()))
            ]
    else:
        files = [os.path.join(path, "model.safetensors")]
    tensors = {}
    for fn in files:
        tensors.update(load_file(fn))
    return tensors


def _resave(path: str, tensors: dict) -> None:
    """``tensors`` as the one model.safetensors of ``path`` (shards and their index removed)."""
    import glob

    from safetensors.torch import save_file

    for fn in glob.glob(os.path.join(path, "model*.safetensors*")):
        os.remove(fn)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def _update_config(path: str, **kw) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(kw)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def _save_fp8(path: str) -> None:
    """Rewrites the bf16 model save_pretrained wrote in ``path`` as a block-FP8 checkpoint: one
    model.safetensors (the shards and their index removed) and quantization_config."""
    import torch

    out = {}
    for name, t in _load_saved(path).items():
        if _fp8_quantized(name):
            assert t.dim() == 2, (name, t.shape)
            out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(t, FP8_BLOCK)
        else:
            out[name] = t
    assert any(t.dtype == torch.float8_e4m3fn for t in out.values())
    _resave(path, out)
    _update_config(
        path,
        quantization_config={
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": list(FP8_BLOCK),
        },
    )


def _save_mtp(path: str, layers: int) -> None:
    """Rewrites the model of ``layers + 1`` decoder layers save_pretrained wrote in ``path`` as
    a model of ``layers`` with DeepSeek-V3's multi-token-prediction layer (config
    ``num_nextn_predict_layers`` 1; vLLM's ``deepseek_mtp`` drafter): the last decoder layer's
    weights stay under ``model.layers.<layers>``, with the MTP layer's own norms (``enorm``,
    ``hnorm``, ``shared_head.norm``: ones), ``eh_proj`` (the embedding's half the identity, plus
    noise) and ``shared_head.head`` (a copy of lm_head). The MTP layer is a MoE layer when ``first_k_dense_replace`` <= layers."""
    import torch

    tensors = _load_saved(path)
    pre = f"model.layers.{layers}."
    assert any(k.startswith(pre) for k in tensors), "no decoder layer to make the MTP layer of"
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    g = torch.Generator().manual_seed(1)
    dt = tensors["lm_head.weight"].dtype
    tensors[pre + "enorm.weight"] = torch.ones(hidden, dtype=dt)
    tensors[pre + "hnorm.weight"] = torch.ones(hidden, dtype=dt)
    tensors[pre + "shared_head.norm.weight"] = torch.ones(hidden, dtype=dt)
    # eh_proj [hidden, 2 hidden] over (enorm(next token's embedding), hnorm(hidden state)):
    # the embedding passed through (plus noise), so the MTP layer's residual stream carries a
    # token's embedding as the model's does and its greedy draft wins by many bf16 ulps (see
    # lm_head in make_model): a draft picked from a near tie would flip with a legitimate
    # rounding difference, and the rejected draft's cache row with it
    eh = torch.randn(hidden, 2 * hidden, generator=g) * (0.1 / (2 * hidden) ** 0.5)
    eh[:, :hidden] += torch.eye(hidden)
    tensors[pre + "eh_proj.weight"] = eh.to(dt)
    tensors[pre + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    _resave(path, tensors)
    # the MoE routing transformers' DeepseekV3 implements (and saved its router's bias for)
    _update_config(
        path,
        num_hidden_layers=layers,
        num_nextn_predict_layers=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )


def make_model(path: str, shape, fp8: bool = False) -> None:
    """Saves the model of ``shape`` (a shape name, see :func:`shape_dims`, or a dims tuple) in
    ``path``; block FP8 (see the module docstring) with ``fp8`` or a ``-fp8`` name; with a
    multi-token-prediction layer (:func:`_save_mtp`) with a ``-mtp`` name."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    mtp = False
    if isinstance(shape, str):
        fp8 = fp8 or split_fp8(shape)[1]
        mtp = split_mtp(shape)[1]
        dims = shape_dims(shape)
    else:
        dims = shape
    heads, nope, v, q_lora, layers, hidden = dims[:6]
    mlp = dims[6] if len(dims) > 6 else 2 * hidden
    cfg = DeepseekV3Config(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=mlp,
        moe_intermediate_size=128,
        # -mtp: one layer more, saved as DeepSeek-V3's multi-token-prediction layer (below)
        num_hidden_layers=layers + mtp,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=q_lora or None,
        kv_lora_rank=512,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=64,
        v_head_dim=v,
        first_k_dense_replace=layers,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "rope_type": "yarn",
        },
        rope_interleave=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                std = 1.0 if name.startswith(("model.embed_tokens", "lm_head")) else 0.08
                if name.endswith("o_proj.weight"):
                    std = 0.5 / (heads * v) ** 0.5  # attention output ~ the embedding's size
                p.normal_(0.0, std)
        # vLLM's logits are bf16: with random lm_head rows a greedy pick sits within two bf16
        # ulps of the runner-up at ~10 % of positions, and a legitimate rounding difference then
        # flips it. lm_head row j is the embedding of token perm(j) (plus noise), so the token
        # whose embedding the last hidden state carries wins by a margin of many ulps; the
        # attention still moves every hidden state, cache row and logit, which the tests compare
        emb = model.model.embed_tokens.weight
        perm = torch.randperm(emb.shape[0])
        model.lm_head.weight.copy_(emb[perm] + 0.3 * torch.randn_like(emb))
    model.to(torch.bfloat16).save_pretrained(path)
    if mtp:
        _save_mtp(path, layers)
    if fp8:
        _save_fp8(path)
    meta = {
        "heads": heads,
        "qk_nope_head_dim": nope,
        "v_head_dim": v,
        "q_lora_rank": q_lora or None,
        "layers": layers,
        "hidden": hidden,
        "mlp": mlp,
    }
    if mtp:
        meta["mtp_layers"] = 1
    if fp8:
        meta["fp8_blocks"] = list(FP8_BLOCK)
    with open(os.path.join(path, "fusemla_shape.json"), "w") as f:
        json.dump(meta, f)


def _margin(lp: dict) -> float:
    """top-1 minus top-2 logprob of one sampled position (how near a greedy tie it was)."""
    vals = sorted((v.logprob for v in lp.values()), reverse=True)
    return float(vals[0] - vals[1]) if len(vals) > 1 else float("inf")


def llm_kwargs(args, on_gpu: bool, max_batch: int) -> dict:
    kw = dict(
        model=args.model,
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        dtype="bfloat16",
        seed=0,
        tensor_parallel_size=args.tp,
        max_num_seqs=max_batch,
        kv_cache_dtype=args.kv_cache_dtype,
        worker_extension_cls="fusemla.testing.vllm_worker.FuseMLATestExtension",
    )
    if args.backend:
        kw["attention_backend"] = args.backend
    if args.speculative:
        # a step verifies 1 + k tokens of a request, the rejected drafts' cache rows written
        # and later overwritten: n-gram drafts (no draft model), or DeepSeek's MTP layer (a
        # -mtp model; the drafter's MLA layer is one more layer the plugin runs, on the
        # target's attention backend)
        spec = dict(method=args.spec_method, num_speculative_tokens=args.speculative)
        if args.spec_method == "ngram":
            spec.update(prompt_lookup_min=1, prompt_lookup_max=2)
        elif args.backend:
            spec["attention_backend"] = args.backend
        kw["speculative_config"] = spec
    if args.mode == "eager":
        kw["enforce_eager"] = True
    else:
        kw["enforce_eager"] = False
        if on_gpu:
            sizes = [s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if s <= max(max_batch, 1)]
            cc = {"cudagraph_capture_sizes": sizes}
            if args.mode == "piecewise":
                cc["cudagraph_mode"] = "PIECEWISE"
            elif args.mode == "full_and_piecewise":
                cc["cudagraph_mode"] = "FULL_AND_PIECEWISE"
            kw["compilation_config"] = cc
    if on_gpu:
        # a fixed KV-cache size instead of vLLM's memory profiling, which other engines starting
        # on the same GPU at the same time would disturb
        kw["gpu_memory_utilization"] = args.gpu_mem
        kw["kv_cache_memory_bytes"] = int(args.kv_gib * (1 << 30))
    return kw


def run(args) -> None:
    from vllm import LLM, SamplingParams

    on_gpu = _on_gpu()
    schedule = (
        schedule_from_seed(args.seed) if args.schedule == "seeded" else SCHEDULES[args.schedule]
    )
    if args.emulate_fp8_linear:  # a block-FP8 checkpoint on a CPU without AMX (tests only)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import fp8_emulation

        fp8_emulation.install()
    t0 = time.time()
    llm = LLM(**llm_kwargs(args, on_gpu, max_batch=8))
    t_init = time.time() - t0
    wrappers = llm.collective_rpc("fusemla_setup", args=(args.inject, args.capture))
    backends = llm.collective_rpc("fusemla_backend")
    engine = llm.llm_engine
    rnd = random.Random(args.prompt_seed)
    prompts = {rid: [rnd.randrange(1, 1000) for _ in range(n)] for rid, _, n, _ in schedule}
    tokens: dict[str, list[int]] = {}
    margins: dict[str, list[float]] = {}
    logprobs: dict[str, list[dict]] = {}
    token_steps: dict[str, list[int]] = {}  # engine step at which each token was first seen
    if args.profile:
        llm.collective_rpc("fusemla_profile", args=("start",))
    step = 0
    pending = list(schedule)
    t_loop = time.time()
    while pending or engine.has_unfinished_requests():
        for item in [p for p in pending if p[1] <= step]:
            rid, _, _, max_new = item
            engine.add_request(
                rid,
                {"prompt_token_ids": prompts[rid]},
                SamplingParams(
                    temperature=0.0,
                    max_tokens=max_new,
                    ignore_eos=True,
                    detokenize=False,
                    logprobs=TOP_K,
                ),
            )
            pending.remove(item)
        for out in engine.step():
            seen = token_steps.setdefault(out.request_id, [])
            n = len(out.outputs[0].token_ids)
            seen.extend([step] * (n - len(seen)))
            if out.finished:
                o = out.outputs[0]
                tokens[out.request_id] = list(o.token_ids)
                margins[out.request_id] = [_margin(lp) for lp in o.logprobs]
                logprobs[out.request_id] = [
                    {str(k): float(v.logprob) for k, v in lp.items()} for lp in o.logprobs
                ]
        step += 1
        if step > 2000:
            raise RuntimeError("engine did not finish")
    t_loop = time.time() - t_loop
    kernels = llm.collective_rpc("fusemla_profile", args=("stop",)) if args.profile else None
    summaries = llm.collective_rpc("fusemla_collect", args=(args.out,))
    with open(os.path.join(args.out, "tokens.json"), "w") as f:
        json.dump(
            {
                "tokens": tokens,
                "margins": margins,
                "logprobs": logprobs,
                "token_steps": token_steps,
                "steps": step,
                "wrappers": wrappers,
                "backends": backends,
                "schedule": schedule,
                "kernels": kernels,
                "args": vars(args),
                "init_s": round(t_init, 1),
                "loop_s": round(t_loop, 2),
                "total_s": round(time.time() - t0, 1),
                "summaries": summaries,
            },
            f,
            indent=1,
            sort_keys=True,
        )


def _on_gpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike())


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("path")
    m.add_argument(
        "--shape",
        default="base",
        type=_shape_arg,
        help=f"one of {sorted(SHAPES)} or seed:<int>; any of them + {MTP_SUFFIX!r}: with one "
        f"MTP layer; + {FP8_SUFFIX!r} (last): the same model as a DeepSeek-V3-style block-FP8 "
        "checkpoint",
    )
    r = sub.add_parser("run")
    r.add_argument("model")
    r.add_argument("out")
    r.add_argument("--tp", type=int, default=1)
    r.add_argument(
        "--mode", default="eager", choices=("eager", "compiled", "piecewise", "full_and_piecewise")
    )
    r.add_argument("--schedule", default="small", help=f"{sorted(SCHEDULES)} or seeded")
    r.add_argument("--seed", type=int, default=0, help="for --schedule seeded")
    r.add_argument("--prompt-seed", type=int, default=1234, help="the prompts' random tokens")
    r.add_argument("--kv-cache-dtype", default="auto")
    r.add_argument("--backend", default=None, help="vLLM attention backend (e.g. CPU_MLA)")
    r.add_argument("--inject", default="none")
    r.add_argument("--capture", action="store_true", help="per-layer outputs (eager only)")
    r.add_argument("--profile", action="store_true", help="count GPU kernels (torch profiler)")
    r.add_argument("--max-model-len", type=int, default=1024)
    r.add_argument("--speculative", type=int, default=0, help="speculative decoding: drafts")
    r.add_argument("--spec-method", default="ngram", choices=("ngram", "deepseek_mtp"))
    r.add_argument(
        "--emulate-fp8-linear",
        action="store_true",
        help="CPU: block-FP8 linears through fp8_emulation.py (vLLM's need AMX)",
    )
    r.add_argument("--gpu-mem", type=float, default=0.1)
    r.add_argument("--kv-gib", type=float, default=1.0, help="GPU: KV-cache size in GiB")
    args = ap.parse_args()
    if args.cmd == "make-model":
        make_model(args.path, args.shape)
    else:
        os.makedirs(args.out, exist_ok=True)
        run(args)


if __name__ == "__main__":
    sys.exit(main())
