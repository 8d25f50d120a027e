"""Is vLLM's own FLASHMLA decode path right under full CUDA graphs? vLLM alone: this script
never imports fusemla, and every engine runs with ``VLLM_PLUGINS=none`` so no vLLM plugin
(fusemla's included) is loaded.

A tiny DeepSeek-V3-style model (3 layers, 16 heads, DeepSeek-V3's attention dims, random bf16
weights) serves the same requests in several engines, one process each: 32 prompts of 40 to 877
tokens submitted together, 48 greedy tokens each with the top-5 logprobs, so every decode step
is a uniform batch of 32 that vLLM replays as a full graph (``FULL_AND_PIECEWISE``), or runs
eagerly (``enforce_eager``). Per KV-cache dtype (bf16 ``auto`` and ``fp8``):

- FLASHMLA eager, twice (is the eager path reproducible run to run?);
- FLASHMLA FULL_AND_PIECEWISE, twice (is the full-graph path reproducible, and equal to eager?);
- a second backend eagerly (FLASH_ATTN_MLA for bf16, TRITON_MLA for FP8): another correct
  kernel for the same math, whose distance to FLASHMLA eager is the size of a legitimate
  numerical difference (the noise floor).

The deviation of two runs: the largest |logprob difference| of the sampled tokens over the
positions where both runs sampled the same token so far (a greedy flip ends the comparison of
that request), and the count of requests whose token streams differ. vLLM's full-graph path is
right when its distance to eager is within the floor and it is reproducible.

    python benchmarks/flashmla_graphs.py run --out-dir D          # GPU (vLLM's CUDA build)
    python benchmarks/flashmla_graphs.py table D/flashmla_graphs.json
    python benchmarks/flashmla_graphs.py --smoke                  # vLLM's CPU build, CPU_MLA
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

TOP_K = 5
NEW_TOKENS = 48
#: 32 requests (8 left too few positions to judge on a tiny model that sits on near ties)
PROMPT_LENS = tuple(40 + 27 * i for i in range(32))


def make_model(path: Path, heads: int, layers: int, hidden: int) -> Path:
    """A DeepSeek-V3-style checkpoint with DeepSeek-V3's attention dims, random weights."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    if (path / "config.json").exists():
        return path
    cfg = DeepseekV3Config(
        vocab_size=2000,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=384,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_k_dense_replace=layers,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_interleave=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                std = 1.0 if name.startswith(("model.embed_tokens", "lm_head")) else 0.06
                p.normal_(0.0, std)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def engine(args) -> None:
    """One engine: the requests, greedy, top-K logprobs; JSON to ``args.out``."""
    from vllm import LLM, SamplingParams

    kw = dict(
        model=args.model,
        skip_tokenizer_init=True,
        max_model_len=2048,
        dtype="bfloat16",
        seed=0,
        max_num_seqs=len(args.prompt_lens),
        kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.backend,
        gpu_memory_utilization=args.gpu_mem,
        enable_prefix_caching=False,
    )
    if args.mode == "eager":
        kw["enforce_eager"] = True
    else:
        kw["compilation_config"] = {
            "cudagraph_mode": args.mode.upper(),
            "cudagraph_capture_sizes": [1, 2, 4, 8, 16],
        }
    t0 = time.time()
    llm = LLM(**kw)
    t_init = time.time() - t0
    rnd = random.Random(1234)
    prompts = [
        {"prompt_token_ids": [rnd.randrange(1, 2000) for _ in range(n)]} for n in args.prompt_lens
    ]
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=args.new_tokens,
        ignore_eos=True,
        detokenize=False,
        logprobs=TOP_K,
    )
    outs = llm.generate(prompts, sp, use_tqdm=False)
    res = {
        "backend": args.backend,
        "mode": args.mode,
        "kv_cache_dtype": args.kv_cache_dtype,
        "init_s": round(t_init, 1),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        # the sampled token's logprob per position
        "logprobs": [
            [float(lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            for o in outs
        ],
    }
    try:  # the backend vLLM really ran (attention_backend is a request, not a guarantee)
        import vllm

        res["vllm"] = vllm.__version__
        res["backend_ran"] = llm.collective_rpc(_rpc_backend)[0]
    except Exception as e:  # noqa: BLE001 - diagnostics only
        res["backend_ran"] = f"unknown ({e!r})"
    Path(args.out).write_text(json.dumps(res))


def _rpc_backend(w) -> str:
    for mod in w.model_runner.model.modules():
        if hasattr(mod, "attn_backend") and hasattr(mod, "kv_cache_dtype"):
            return f"{mod.attn_backend.get_name()} / {mod.kv_cache_dtype}"
    return "none found"


def deviation(a: dict, b: dict) -> dict:
    """|logprob difference| of the sampled tokens where both runs agree so far (largest and
    median), the requests whose token streams differ, and the earliest position of a
    difference (None: none differ)."""
    diffs, differ, first = [], 0, None
    for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"]):
        if ta != tb:
            differ += 1
        for i, (x, y, p, q) in enumerate(zip(ta, tb, la, lb)):
            if x != y:
                first = i if first is None else min(first, i)
                break
            diffs.append(abs(p - q))
    return {
        "max_logprob_diff": round(max(diffs, default=0.0), 5),
        "median_logprob_diff": round(statistics.median(diffs), 6) if diffs else 0.0,
        "positions": len(diffs),
        "requests_differ": differ,
        "first_difference_at": first,
    }


def run_all(args) -> None:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = make_model(out_dir / "model", args.heads, args.layers, args.hidden)
    plan = []
    for kv in args.kv_cache_dtypes:
        second = args.floor_backend_fp8 if kv == "fp8" else args.floor_backend
        plan += [
            (args.backend, "eager", kv, "a"),
            (args.backend, "eager", kv, "b"),
            (args.backend, args.graph_mode, kv, "a"),
            (args.backend, args.graph_mode, kv, "b"),
            (second, "eager", kv, "a"),
        ]
        if args.fused:  # fusemla's plugin loaded and forced onto the backend (diagnosis)
            plan += [
                (args.backend, "eager", kv, "fused"),
                (args.backend, args.graph_mode, kv, "fused"),
            ]
    runs = {}
    for backend, mode, kv, rep in plan[: args.max_runs or None]:
        tag = f"{backend}_{mode}_{kv}_{rep}"
        js = out_dir / f"{tag}.json"
        # collective_rpc sends this script's function to the engine core (cloudpickle)
        env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
        for k in [k for k in env if k.startswith("FUSEMLA_")]:
            del env[k]
        if rep == "fused":
            env.update(FUSEMLA_VLLM="1", FUSEMLA_VLLM_FORCE_BACKENDS=backend)
        else:  # vLLM alone: no plugin loaded at all
            env["VLLM_PLUGINS"] = "none"
        if args.cpu:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        cmd = [
            sys.executable, __file__, "engine", "--model", str(model), "--backend", backend,
            "--mode", mode, "--kv-cache-dtype", kv, "--gpu-mem", str(args.gpu_mem),
            "--new-tokens", str(args.new_tokens), "--prompt-lens", *map(str, args.prompt_lens),
            "--out", str(js),
        ]  # fmt: skip
        t0 = time.time()
        with open(out_dir / f"{tag}.log", "w") as log:
            rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        print(f"[flashmla] {tag}: exit {rc} after {time.time() - t0:.0f} s", flush=True)
        if rc == 0 and js.exists():
            runs[tag] = json.loads(js.read_text())
        result = summarize(runs, args)
        (out_dir / "flashmla_graphs.json").write_text(json.dumps(result, indent=1))
    print(table(result))


def summarize(runs: dict, args) -> dict:
    rows = []
    for kv in args.kv_cache_dtypes:
        second = args.floor_backend_fp8 if kv == "fp8" else args.floor_backend
        b, g = args.backend, args.graph_mode
        pairs = [
            ("eager vs eager (reproducible?)", f"{b}_eager_{kv}_a", f"{b}_eager_{kv}_b"),
            (f"{g} vs {g} (reproducible?)", f"{b}_{g}_{kv}_a", f"{b}_{g}_{kv}_b"),
            (f"{g} vs eager (run a)", f"{b}_{g}_{kv}_a", f"{b}_eager_{kv}_a"),
            (f"{g} vs eager (run b)", f"{b}_{g}_{kv}_b", f"{b}_eager_{kv}_a"),
            (f"{second} eager vs eager (floor)", f"{second}_eager_{kv}_a", f"{b}_eager_{kv}_a"),
            (f"{g} vs {second} eager", f"{b}_{g}_{kv}_a", f"{second}_eager_{kv}_a"),
        ]
        if args.fused:
            pairs += [
                ("fused eager vs vLLM eager", f"{b}_eager_{kv}_fused", f"{b}_eager_{kv}_a"),
                (f"fused {g} vs vLLM {g}", f"{b}_{g}_{kv}_fused", f"{b}_{g}_{kv}_a"),
            ]
        for what, x, y in pairs:
            row = {"kv_cache_dtype": kv, "compare": what, "runs": [x, y]}
            if x in runs and y in runs:
                row.update(deviation(runs[x], runs[y]))
                row["backends_ran"] = [runs[x].get("backend_ran"), runs[y].get("backend_ran")]
            rows.append(row)
    version = next((r.get("vllm") for r in runs.values() if r.get("vllm")), None)
    return {"probe": "flashmla_graphs", "vllm": version, "new_tokens": args.new_tokens,
            "prompt_lens": list(args.prompt_lens), "rows": rows}  # fmt: skip


def table(result: dict) -> str:
    lines = [
        f"vLLM {result.get('vllm')}, {len(result['prompt_lens'])} requests x "
        f"{result['new_tokens']} greedy tokens",
        "| KV cache | compared | max logprob diff | median | positions | requests whose tokens "
        "differ | first difference at | ran |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['kv_cache_dtype']} | {r['compare']} | {r.get('max_logprob_diff', 'not run')} | "
            f"{r.get('median_logprob_diff', '')} | {r.get('positions', '')} | "
            f"{r.get('requests_differ', '')} | {r.get('first_difference_at', '')} | "
            f"{' / '.join(map(str, r.get('backends_ran', [])))} |"
        )
    return "\n".join(lines)


def smoke() -> None:
    """vLLM's CPU build: the plumbing with CPU_MLA standing in for every backend, eager only
    (the CPU build has no CUDA graphs), two engines on short prompts; fails unless the first
    row (the only one both of whose runs ran) was computed from both engines' tokens, and
    unless the comparison finds a run equal to itself and catches planted differences. (Two
    CPU_MLA runs are not always bit-identical on a loaded 2-core machine, so the smoke does
    not ask that of vLLM's CPU build.)"""
    import tempfile

    d = tempfile.mkdtemp(prefix="flashmla_graphs_smoke_")
    args = argparse.Namespace(
        out_dir=d, heads=4, layers=2, hidden=256, kv_cache_dtypes=["auto"], backend="CPU_MLA",
        graph_mode="eager", floor_backend="CPU_MLA", floor_backend_fp8="CPU_MLA", gpu_mem=0.3,
        cpu=True, max_runs=2, new_tokens=6, prompt_lens=[5, 17, 40, 9], fused=False,
    )  # fmt: skip
    run_all(args)
    result = json.loads((Path(d) / "flashmla_graphs.json").read_text())
    row = result["rows"][0]
    assert all("CPU_MLA" in str(b) for b in row["backends_ran"]), row
    assert "max_logprob_diff" in row and row["positions"] > 0, result
    x = json.loads((Path(d) / "CPU_MLA_eager_auto_a.json").read_text())
    assert len(x["tokens"]) == len(args.prompt_lens), x
    assert all(len(t) == args.new_tokens for t in x["tokens"]), x
    same = deviation(x, x)
    assert same["max_logprob_diff"] == 0.0 and same["first_difference_at"] is None, same
    assert same["positions"] == args.new_tokens * len(args.prompt_lens), same
    y = json.loads(json.dumps(x))  # planted differences
    y["logprobs"][3][4] += 0.25
    assert abs(deviation(x, y)["max_logprob_diff"] - 0.25) < 1e-4, deviation(x, y)
    y["tokens"][2][3] += 1
    dv = deviation(x, y)
    assert dv["requests_differ"] == 1 and dv["first_difference_at"] == 3, dv
    print("[flashmla] smoke ok")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    sub = ap.add_subparsers(dest="cmd")
    r = sub.add_parser("run")
    r.add_argument("--out-dir", required=True)
    r.add_argument("--heads", type=int, default=16)
    r.add_argument("--layers", type=int, default=3)
    r.add_argument("--hidden", type=int, default=1024)
    r.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8"])
    r.add_argument("--backend", default="FLASHMLA")
    r.add_argument("--graph-mode", default="full_and_piecewise")
    r.add_argument("--floor-backend", default="FLASH_ATTN_MLA")
    r.add_argument("--floor-backend-fp8", default="TRITON_MLA")
    r.add_argument("--gpu-mem", type=float, default=0.3)
    r.add_argument("--cpu", action="store_true")
    r.add_argument("--max-runs", type=int, default=0, help="run only the first N engines")
    r.add_argument(
        "--fused",
        action="store_true",
        help="also fusemla's plugin forced onto the backend (eager and graphs), vs vLLM's own",
    )
    r.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    r.add_argument("--prompt-lens", type=int, nargs="+", default=list(PROMPT_LENS))
    e = sub.add_parser("engine")
    e.add_argument("--model", required=True)
    e.add_argument("--backend", required=True)
    e.add_argument("--mode", required=True)
    e.add_argument("--kv-cache-dtype", default="auto")
    e.add_argument("--gpu-mem", type=float, default=0.3)
    e.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    e.add_argument("--prompt-lens", type=int, nargs="+", default=list(PROMPT_LENS))
    e.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("file")
    args = ap.parse_args()
    if args.smoke:
        smoke()
    elif args.cmd == "run":
        run_all(args)
    elif args.cmd == "engine":
        engine(args)
    elif args.cmd == "table":
        print(table(json.loads(Path(args.file).read_text())))
    else:
        ap.print_help()


if __name__ == "__main__":
    main()
