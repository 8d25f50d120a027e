"""One vLLM engine run for the plugin tests (run as a script, in its own process).

    python engine_run.py make-model DIR
    python engine_run.py run DIR OUT_DIR [--tp N] [--compiled] [--inject double_rope|double_write]
                                         [--capture]

``make-model`` saves a tiny DeepSeek-V3 (hidden 256, 2 layers, 4 heads, no MoE, vocab 1000,
kv_lora_rank 512, rope 64) with real random weights through transformers' ``save_pretrained``.
``run`` drives vLLM's engine with staggered requests (so some steps mix prefill and decode),
greedy, and writes OUT_DIR/tokens.json plus, from every worker, OUT_DIR/rank<r>.json (counters,
cache-write log summary) and rank<r>.npz (KV caches, per-layer outputs when --capture).
The plugin is on or off through FUSEMLA_VLLM, set by the test in this process's environment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def make_model(path: str) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=1000, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=96, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
        v_head_dim=32, first_k_dense_replace=2, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, max_position_embeddings=1024, tie_word_embeddings=False,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "rope_type": "yarn"},
        rope_interleave=True, torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        # larger-than-default weights; the embedding and lm_head dominate the logits so greedy
        # picks are far from ties (bf16 rounding differences in the attention, which the tests
        # compare directly, must not flip a token): the tests check the margins
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                big = name.startswith(("model.embed_tokens", "lm_head"))
                p.normal_(0.0, 1.0 if big else 0.08)
    model.to(torch.bfloat16).save_pretrained(path)


# requests: (id, arrival step, prompt length, max new tokens)
SCHEDULE = [("a", 0, 23, 14), ("b", 3, 41, 10), ("c", 4, 9, 12), ("d", 9, 57, 8)]


def _margin(lp: dict) -> float:
    """top-1 minus top-2 logprob of one sampled position (how near a greedy tie it was)."""
    vals = sorted((v.logprob for v in lp.values()), reverse=True)
    return float(vals[0] - vals[1]) if len(vals) > 1 else float("inf")


def run(args) -> None:
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model=args.model, skip_tokenizer_init=True, max_model_len=512,
              dtype="bfloat16", enforce_eager=not args.compiled, seed=0,
              tensor_parallel_size=args.tp, max_num_seqs=8,
              worker_extension_cls="fusemla.integrations.vllm_testing.FuseMLATestExtension")
    t_init = time.time() - t0
    wrappers = llm.collective_rpc("fusemla_setup", args=(args.inject, args.capture))
    engine = llm.llm_engine
    import random

    rnd = random.Random(1234)
    prompts = {rid: [rnd.randrange(1, 1000) for _ in range(n)] for rid, _, n, _ in SCHEDULE}
    tokens: dict[str, list[int]] = {}
    margins: dict[str, list[float]] = {}
    step = 0
    pending = list(SCHEDULE)
    while pending or engine.has_unfinished_requests():
        for item in [p for p in pending if p[1] <= step]:
            rid, _, _, max_new = item
            engine.add_request(rid, {"prompt_token_ids": prompts[rid]},
                               SamplingParams(temperature=0.0, max_tokens=max_new,
                                              ignore_eos=True, detokenize=False,
                                              logprobs=2))
            pending.remove(item)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                margins[out.request_id] = [_margin(lp) for lp in out.outputs[0].logprobs]
        step += 1
        if step > 500:
            raise RuntimeError("engine did not finish")
    summaries = llm.collective_rpc("fusemla_collect", args=(args.out,))
    with open(os.path.join(args.out, "tokens.json"), "w") as f:
        json.dump({"tokens": tokens, "margins": margins, "steps": step, "wrappers": wrappers,
                   "init_s": round(t_init, 1), "total_s": round(time.time() - t0, 1),
                   "summaries": summaries}, f, indent=1, sort_keys=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("path")
    r = sub.add_parser("run")
    r.add_argument("model")
    r.add_argument("out")
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("--compiled", action="store_true")
    r.add_argument("--inject", default="none")
    r.add_argument("--capture", action="store_true")
    args = ap.parse_args()
    if args.cmd == "make-model":
        make_model(args.path)
    else:
        os.makedirs(args.out, exist_ok=True)
        run(args)


if __name__ == "__main__":
    sys.exit(main())
