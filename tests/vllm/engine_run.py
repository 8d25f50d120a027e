"""One vLLM engine run for the plugin tests and the vLLM benchmark (run as a script, in its own
process: the plugin registers once per process, so plugin on and off need separate processes).

    python engine_run.py make-model DIR --shape NAME
    python engine_run.py run DIR OUT_DIR [--tp N] [--mode eager|compiled|piecewise|full_and_piecewise]
        [--schedule NAME] [--kv-cache-dtype auto|fp8] [--backend NAME] [--capture] [--profile]
        [--inject none|double_rope|double_write|rope_off_by_one|noise:EPS]

``make-model`` saves a tiny DeepSeek-V3-style model (no MoE, vocab 1000, kv_lora_rank 512,
rope 64) of one of :data:`SHAPES` with real random weights through transformers'
``save_pretrained``. ``run`` drives vLLM's engine through a :data:`SCHEDULES` entry (requests
arriving at different steps, so steps are prefill-only, mixed and decode-only), greedy, and
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
    "v3-h16": (16, 128, 128, 384, 3, 512),  # DeepSeek-V3 attention dims, 16 heads (TP=8's share)
    "v3-h128": (128, 128, 128, 384, 3, 512),  # all 128 heads
    "v2lite-h16": (16, 128, 128, 0, 3, 512),  # DeepSeek-V2-Lite: no q_lora
    "nope64-h32": (32, 64, 128, 256, 3, 512),  # another FA3 prefill shape (nope 64 != v 128)
    # benchmarks/bench_vllm.py: DeepSeek-V3's attention (hidden 7168, q_lora 1536), small MLP
    "bench-h16": (16, 128, 128, 1536, 4, 7168, 1024),
    "bench-h128": (128, 128, 128, 1536, 4, 7168, 1024),
}

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


def make_model(path: str, shape) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    dims = SHAPES[shape] if isinstance(shape, str) else shape
    heads, nope, v, q_lora, layers, hidden = dims[:6]
    mlp = dims[6] if len(dims) > 6 else 2 * hidden
    cfg = DeepseekV3Config(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=mlp,
        moe_intermediate_size=128,
        num_hidden_layers=layers,
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
    with open(os.path.join(path, "fusemla_shape.json"), "w") as f:
        json.dump(
            {
                "heads": heads,
                "qk_nope_head_dim": nope,
                "v_head_dim": v,
                "q_lora_rank": q_lora or None,
                "layers": layers,
                "hidden": hidden,
                "mlp": mlp,
            },
            f,
        )


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
    t0 = time.time()
    llm = LLM(**llm_kwargs(args, on_gpu, max_batch=8))
    t_init = time.time() - t0
    wrappers = llm.collective_rpc("fusemla_setup", args=(args.inject, args.capture))
    backends = llm.collective_rpc("fusemla_backend")
    engine = llm.llm_engine
    rnd = random.Random(1234)
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
    m.add_argument("--shape", default="base", help=f"one of {sorted(SHAPES)} or seed:<int>")
    r = sub.add_parser("run")
    r.add_argument("model")
    r.add_argument("out")
    r.add_argument("--tp", type=int, default=1)
    r.add_argument(
        "--mode", default="eager", choices=("eager", "compiled", "piecewise", "full_and_piecewise")
    )
    r.add_argument("--schedule", default="small", help=f"{sorted(SCHEDULES)} or seeded")
    r.add_argument("--seed", type=int, default=0, help="for --schedule seeded")
    r.add_argument("--kv-cache-dtype", default="auto")
    r.add_argument("--backend", default=None, help="vLLM attention backend (e.g. CPU_MLA)")
    r.add_argument("--inject", default="none")
    r.add_argument("--capture", action="store_true", help="per-layer outputs (eager only)")
    r.add_argument("--profile", action="store_true", help="count GPU kernels (torch profiler)")
    r.add_argument("--max-model-len", type=int, default=1024)
    r.add_argument("--gpu-mem", type=float, default=0.1)
    r.add_argument("--kv-gib", type=float, default=1.0, help="GPU: KV-cache size in GiB")
    args = ap.parse_args()
    if args.cmd == "make-model":
        shape = args.shape
        if shape.startswith("seed:"):
            shape = shape_from_seed(int(shape[5:]))
        make_model(args.path, shape)
    else:
        os.makedirs(args.out, exist_ok=True)
        run(args)


if __name__ == "__main__":
    sys.exit(main())
