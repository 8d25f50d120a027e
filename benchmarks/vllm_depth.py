"""The decode step at full depth, as a user serves it: vLLM's ``LLM.generate`` with its defaults.

One engine at a time (two 61-layer engines do not fit on one H200), each in its own process, the
engine core in a process of its own (vLLM's default), vLLM's default compile and CUDA-graph mode,
async scheduling, ``load_format="dummy"``. Per batch size ``B`` and sampling mode, ``--repeats``
times: TPOT = (t(generate ``--long`` new tokens) - t(generate ``--short`` new tokens)) /
(long - short), B fresh prompts of ``--context`` tokens per call (prefix caching never hits), the
prompts the same in every engine. Then, in the same engine:

- a profiled window of decode steps (torch profiler in the engine-core process, CUDA kernels,
  CUDA-graph replays included): GPU time per step by kernel category (MoE included), GPU busy
  and idle time per step (the idle time is host and launch time the GPU waits for);
- the graph each step ran: the model runner's CUDA-graph dispatch, wrapped, counted by (mode,
  tokens, requests) over the timed calls; decode steps whose request count is B show that all B
  requests ran together (else the cell is marked "does not fit");
- the plugin op's Python calls per decode step (``fusemla.integrations.vllm.stats()``; zero
  means every decode step replayed a full graph), and the compile config vLLM resolved
  (graph mode, splitting ops, fusion passes).

Sampling modes: ``greedy`` (what a user's greedy benchmark does) and ``seeded`` (temperature 1,
a fixed seed per request): a dummy-weight model's logits are near ties, so greedy tokens differ
between two engines at the first bf16 rounding difference, their MoE routing follows the tokens,
and the MoE's weight traffic (the largest part of a decode step at B >= 8) differs with it; with
seeded sampling the sampled token is decided by the seed's noise, not by the near tie, so both
engines decode the same tokens and route alike (the token hashes in the JSON show it).

Serving layouts of DeepSeek-V3 (61 layers, FP8 128x128 block weights, dummy values):
``tp8``: one tensor-parallel-8 rank (16 heads, 256 experts 256 wide, dense 2304, vocab 16160);
``ep8``: one rank of data-parallel attention + expert-parallel 8 (128 heads, 32 experts 2048
wide, dense 18432, vocab 129280). No collectives run (one GPU), DeepGEMM off.

    python benchmarks/vllm_depth.py config DIR --shard tp8              # the model directory
    python benchmarks/vllm_depth.py engine --model DIR --variant on --batches 1 32 --out X.json
    python benchmarks/vllm_depth.py pair --shard tp8 --order off,on --out-dir D   # one engine after the other
    python benchmarks/vllm_depth.py latency --shard tp8 --batches 1 32 --out-dir D   # vllm bench latency
    python benchmarks/vllm_depth.py table D/*.json                      # the results table
    python benchmarks/vllm_depth.py --smoke     # vLLM's CPU build, tiny model: a pair, then latency
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# ------------------------------------------------------------------------------ the models

#: DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3) and what one GPU holds of it per layout
V3 = dict(
    hidden_size=7168,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_hidden_layers=61,
    first_k_dense_replace=3,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    n_shared_experts=1,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_theta=10000,
    rope_scaling={
        "type": "yarn",
        "rope_type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
    torch_dtype="bfloat16",
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    quantization_config={
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    },
)
SHARDS = {
    # tensor parallel 8: heads, expert width, dense width and vocab split 8 ways
    "tp8": dict(
        num_attention_heads=16,
        num_key_value_heads=16,
        n_routed_experts=256,
        moe_intermediate_size=256,
        intermediate_size=2304,
        vocab_size=16160,
    ),
    # data-parallel attention + expert parallel 8: all heads, 256/8 experts at full width
    "ep8": dict(
        num_attention_heads=128,
        num_key_value_heads=128,
        n_routed_experts=32,
        moe_intermediate_size=2048,
        intermediate_size=18432,
        vocab_size=129280,
    ),
    # --smoke on vLLM's CPU build: DeepSeek-V3's attention dims, 2 layers, small everything else
    "smoke": dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        moe_intermediate_size=128,
        intermediate_size=256,
        vocab_size=10240,  # vllm bench latency's dummy prompts draw token ids below 10000
        hidden_size=256,
        q_lora_rank=128,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        max_position_embeddings=4096,
        quantization_config=None,
    ),
}

# the TP8 shard's first pipeline stage of two (tensor parallel 8 x pipeline parallel 2, as
# two 8-GPU H100 nodes may serve the FP8 checkpoint): layers 0-30, 3 dense + 28 MoE, the same
# per-layer shapes in half the weights (~41 GB), so it fits an 80 GB H100; the model keeps
# its lm_head (a real first stage hands its hidden states on instead: 16160 x 7168, small)
SHARDS["tp8pp2"] = {**SHARDS["tp8"], "num_hidden_layers": 31}
# the EP8 shard's first pipeline stage of two, likewise: 128 heads, layers 0-30 (~51 GB with
# its 129,280-row embedding and lm_head, by parameter count), so 128 heads fit an H100
SHARDS["ep8pp2"] = {**SHARDS["ep8"], "num_hidden_layers": 31}
#: seconds an engine after a lease's first takes to start, per shard (pair's --later-start-s
#: default): full depth on the H200 158-214 s; the half-depth stages on an H100 34-63 s (tp8pp2,
#: ead800d and 4698b24) and 110 s (ep8pp2, c4768ca), where 240 s kept a pair that fitted from
#: starting (4698b24's lease)
LATER_START_S = {"tp8pp2": 90.0, "ep8pp2": 150.0}
LATER_START_DEFAULT_S = 240.0


def model_config(shard: str) -> dict:
    cfg = {**V3, **SHARDS[shard]}
    if cfg.get("quantization_config") is None:
        cfg.pop("quantization_config", None)
    return cfg


def write_model(path: Path, shard: str) -> Path:
    """A model directory vLLM loads with ``load_format="dummy"``: config.json only."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model_config(shard), indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    return path


# ------------------------------------------------------------------------------ kernel categories

#: kernel-name fragments -> category (first match wins; names lower-cased)
CATEGORIES = (
    ("fusemla prologue", ("mla_prologue_kernel",)),
    ("fusemla epilogue", ("mla_epilogue_kernel",)),
    ("vllm cache write", ("concat_and_cache_mla",)),
    ("vllm rope", ("rotary_embedding", "rope")),
    ("moe", ("fused_moe", "moe_", "_moe", "topk", "expert", "moe")),
    ("fp8 quant", ("per_token_group", "quant")),
    ("attention", ("flash", "fmha", "mla", "attn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "bmm", "splitk", "sm90")),
    ("norm", ("rms_norm", "rmsnorm", "layernorm")),
    ("triton (inductor)", ("triton_",)),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, frags in CATEGORIES:
        if any(f in low for f in frags):
            return cat
    return "other"


# ------------------------------------------------------------------------------ engine-core side
# Functions sent to the engine core through LLM.collective_rpc (cloudpickled by value, each with
# its own copy of this module's globals): ``w`` is vLLM's worker there, and the state lives on it.


def _rpc_install(w) -> dict:
    """Wrap the model runner's CUDA-graph dispatch (count what each step ran) and its
    execute_model (the profiled window); return the resolved config."""
    import collections

    runner = w.model_runner
    st = w.__dict__.setdefault(
        "_depth_state",
        {
            "dispatch": collections.Counter(),
            "timeline": [],
            "arm": 0,
            "steps": 0,
            "prof": None,
            "result": None,
        },
    )
    kind = type(runner).__module__
    mgr = getattr(runner, "cudagraph_manager", None)  # Model Runner V2
    disp = getattr(runner, "cudagraph_dispatcher", None)  # Model Runner V1
    if mgr is not None and not getattr(mgr, "_depth_wrapped", False):
        orig = mgr.dispatch

        def dispatch(num_reqs, num_tokens, *a, **k):
            desc = orig(num_reqs, num_tokens, *a, **k)
            st["dispatch"][(desc.cg_mode.name, int(num_tokens), int(num_reqs))] += 1
            return desc

        mgr.dispatch = dispatch
        mgr._depth_wrapped = True
    elif disp is not None and not getattr(disp, "_depth_wrapped", False):
        orig = disp.dispatch

        def dispatch(num_tokens, *a, **k):
            mode, bd = orig(num_tokens, *a, **k)
            st["dispatch"][(mode.name, int(num_tokens), int(getattr(bd, "num_reqs", 0) or 0))] += 1
            return mode, bd

        disp.dispatch = dispatch
        disp._depth_wrapped = True
    if not getattr(runner, "_depth_wrapped", False):
        orig_exec = runner.execute_model

        def execute_model(*a, **k):
            if not k.get("dummy_run", False):
                so = a[0] if a else k.get("scheduler_output")
                try:  # the step timeline: when each real step was issued, and its shape
                    st["timeline"].append(
                        (
                            time.perf_counter(),
                            int(so.total_num_scheduled_tokens),
                            len(so.num_scheduled_tokens),
                        )
                    )
                except Exception:  # noqa: BLE001 - diagnostics only
                    pass
                if st["arm"]:
                    _window_tick(st)
            return orig_exec(*a, **k)

        runner.execute_model = execute_model
        runner._depth_wrapped = True
    cc = w.vllm_config.compilation_config
    pc = cc.pass_config
    passes = {
        k: getattr(pc, k)
        for k in dir(pc)
        if k.startswith(("fuse_", "enable_", "eliminate"))
        and isinstance(getattr(pc, k, None), bool)
    }
    attn = {}
    try:
        m = runner.model
        for mod in m.modules():
            if hasattr(mod, "attn_backend") and hasattr(mod, "kv_cache_dtype"):
                attn = {
                    "backend": mod.attn_backend.get_name(),
                    "kv_cache_dtype": str(mod.kv_cache_dtype),
                }
                break
        # vLLM's MLA wrapper, or the plugin's subclass of it (FuseMLAWrapper)
        names = (type(mod).__name__ for mod in m.modules())
        wrappers = collections.Counter(
            n for n in names if "LatentAttention" in n or n == "FuseMLAWrapper"
        )
    except Exception as e:  # pragma: no cover - diagnostics only
        wrappers = {"error": repr(e)}
    cache = w.vllm_config.cache_config
    sched = w.vllm_config.scheduler_config
    return {
        "model_runner": kind,
        "cudagraph_mode": str(cc.cudagraph_mode),
        "splitting_ops": list(cc.splitting_ops or []),
        "compile_mode": str(cc.mode),
        "use_inductor_graph_partition": bool(cc.use_inductor_graph_partition),
        "capture_sizes": list(cc.cudagraph_capture_sizes or []),
        "passes": passes,
        "custom_ops": list(cc.custom_ops or []),
        "attention": attn,
        "wrappers": dict(wrappers),
        "num_gpu_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "async_scheduling": bool(getattr(sched, "async_scheduling", False)),
    }


def _window_tick(st) -> None:
    """Called at the start of each real execute_model while a window is armed: the first call
    starts the profiler, the (arm + 1)-th stops it (the window is ``arm`` whole steps)."""
    import torch

    cuda = torch.cuda.is_available()
    if st["prof"] is None:
        from torch.profiler import ProfilerActivity, profile

        if cuda:
            torch.cuda.synchronize()
        # vLLM's CPU build (the smoke run): CPU ops stand in for kernels
        st["prof"] = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
        st["prof"].__enter__()
        st["steps"] = 0
        st["plugin0"] = _plugin_stats()
        return
    st["steps"] += 1
    if st["steps"] < st["arm"]:
        return
    if cuda:
        torch.cuda.synchronize()
    prof, st["prof"] = st["prof"], None
    prof.__exit__(None, None, None)
    st["arm"] = 0
    st["result"] = _summarize_profile(prof, st["steps"], st["plugin0"], _plugin_stats())


def _plugin_stats() -> dict:
    try:
        from fusemla.integrations import vllm as plugin

        return dict(plugin.stats())
    except Exception:
        return {}


def _summarize_profile(prof, steps: int, s0: dict, s1: dict) -> dict:
    import torch

    want = "CUDA" if torch.cuda.is_available() else "CPU"
    ev = []
    for e in prof.events():
        if e.device_type.name == want:
            ev.append((float(e.time_range.start), float(e.time_range.end), e.name))
    ev.sort()
    by_kernel: dict = {}
    for a, b, n in ev:
        c = by_kernel.setdefault(n, [0, 0.0])
        c[0] += 1
        c[1] += b - a
    busy, cur_a, cur_b = 0.0, None, None  # union of the kernels' intervals
    for a, b, _ in ev:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                busy += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        busy += cur_b - cur_a
    span = (ev[-1][1] - ev[0][0]) if ev else 0.0
    cats: dict = {}
    for n, (_, us) in by_kernel.items():
        cats[category(n)] = cats.get(category(n), 0.0) + us
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:30]
    return {
        "steps": steps,
        "kernel_us_per_step": round(sum(v[1] for v in by_kernel.values()) / steps, 2),
        "busy_us_per_step": round(busy / steps, 2),
        "idle_us_per_step": round((span - busy) / steps, 2),
        "span_us_per_step": round(span / steps, 2),
        "kernels_per_step": round(len(ev) / steps, 1),
        "by_category_us_per_step": {
            k: round(v / steps, 2) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])
        },
        "top_kernels": [
            {"name": n[:160], "per_step": round(c / steps, 2), "us_per_step": round(us / steps, 2)}
            for n, (c, us) in top
        ],
        "plugin_stats_delta": {k: s1.get(k, 0) - s0.get(k, 0) for k in set(s0) | set(s1)},
    }


def _rpc_arm(w, steps: int) -> None:
    st = w._depth_state
    st["result"], st["arm"], st["prof"] = None, steps, None


def _rpc_result(w):
    return w._depth_state["result"]


def _rpc_dispatch(w, reset: bool):
    st = w._depth_state
    out = [[k[0], k[1], k[2], v] for k, v in sorted(st["dispatch"].items())]
    if reset:
        st["dispatch"].clear()
    return out


def _rpc_timeline(w, batch: int):
    """The decode steps' wall time in the engine core since the last call: the interval from
    one step's issue to the next, over consecutive steps that both decode all ``batch``
    requests (one token each). With async scheduling a step is issued while the one before
    runs, so in steady state the interval is the step's time: GPU time when the GPU is the
    bottleneck, host time when the host is. No prefill time enters, unlike (t(long) -
    t(short)) / (long - short)."""
    import statistics

    tl, w._depth_state["timeline"] = w._depth_state["timeline"], []
    iv = [
        (b[0] - a[0]) * 1e3
        for a, b in zip(tl, tl[1:])
        if a[1] == a[2] == batch and b[1] == b[2] == batch
    ]
    if not iv:
        return {"steps": 0}
    iv.sort()
    return {
        "steps": len(iv),
        "median_ms": round(statistics.median(iv), 4),
        "mean_ms": round(statistics.fmean(iv), 4),
        "p10_ms": round(iv[len(iv) // 10], 4),
        "p90_ms": round(iv[(9 * len(iv)) // 10], 4),
    }


def _rpc_plugin(w):
    return _plugin_stats()


def _rpc_memory(w) -> dict:
    """The engine core's CUDA allocator once the engine is up (its graphs captured): reserved
    and live bytes per pool (the default pool, the CUDA graphs' private pools) and the sizes
    of the live blocks there. The EP8 shard's graph pool took 8.61 GiB with the plugin and
    4.85 without (a7b3bce to a85ce66, unexplained): live blocks something still holds show here
    as a count of one size, space reserved but free between blocks as reserved > live."""
    import collections

    import torch

    if not torch.cuda.is_available():
        return {}
    gib = 1 << 30
    reserved, live = collections.Counter(), collections.Counter()
    blocks = collections.Counter()
    try:  # a diagnostic: it must not end the engine's run
        snapshot = torch.cuda.memory_snapshot()
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)[:200]}
    for seg in snapshot:
        pool = "default" if tuple(seg.get("segment_pool_id") or (0, 0)) == (0, 0) else "graphs"
        reserved[pool] += seg["total_size"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                live[pool] += b["size"]
                blocks[(pool, b["size"] >> 20)] += 1
    top = sorted(blocks.items(), key=lambda kv: -kv[0][1] * kv[1])[:12]
    return {
        "reserved_gib": {k: round(v / gib, 3) for k, v in reserved.items()},
        "live_gib": {k: round(v / gib, 3) for k, v in live.items()},
        "live_blocks_by_mib": [[pool, mib, n] for (pool, mib), n in top],
    }


# ------------------------------------------------------------------------------ client side


def _median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


def _extreme(f, xs):
    xs = [x for x in xs if x is not None]
    return round(f(xs), 4) if xs else None


def prompts_for(batch: int, context: int, vocab: int, tag: str) -> list:
    """B prompts of ``context`` token ids, fixed by (B, context, tag): the same in every engine,
    different per call (so vLLM's prefix cache never hits)."""
    import random

    rnd = random.Random(f"{batch}/{context}/{tag}")
    return [
        {"prompt_token_ids": [rnd.randrange(2, vocab) for _ in range(context)]}
        for _ in range(batch)
    ]


def cells_of(args) -> list:
    """The (B, context) cells in their order: ``--cells BxC ...`` as given, else every
    ``--batches`` at ``--context``."""
    if not getattr(args, "cells", None):
        return [(b, args.context) for b in args.batches]
    out = []
    for spec in args.cells:
        try:
            b, c = (int(x) for x in spec.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--cells: {spec!r} is not BxCONTEXT (e.g. 32x4000)") from None
        if b < 1 or c < 2:
            raise SystemExit(f"--cells: {spec!r} needs B >= 1 and CONTEXT >= 2")
        out.append((b, c))
    return out


def cell_fits(now: float, stop_at: float, estimate_s: float | None) -> bool:
    """Whether a cell may start at ``now`` and end by ``stop_at`` (0: no limit), its cost
    estimated by :func:`cell_estimate` or, before the engine's first cell, bounded below by
    :func:`cell_floor` (None: it runs)."""
    if not stop_at or estimate_s is None:
        return True
    return now + estimate_s <= stop_at


def cell_floor(warm_s: float, repeats: int, modes: int = 1) -> float:
    """The least time a cell can take, from its warm-up call alone (before the engine has run
    a cell, when :func:`cell_estimate` has nothing to price decode steps by): per sampling mode
    ``repeats`` short and long calls, each at least as long as a short warm-up call at the same
    B and context, less 10 % for the warm-up's own noise. An engine's first cell runs unless even
    this would end past ``--stop-at``. (Until eee87b0 the first cell always ran: that lease's EP8
    off engine spent 228 s on 32 x 4000 with ~137 s of its share left, warm-up 17.9 s, floor
    161 s, and the lease ended before its pair's second engine was up.)"""
    return 0.9 * modes * 2 * repeats * warm_s


def cell_estimate(
    warm_s: float, batch: int, seen: list, repeats: int, steps: int, modes: int = 1
) -> float | None:
    """A cell's expected time from its warm-up call (``warm_s``: the second short call at its
    B and context, the first having paid the shape's one-time costs) and the cells this engine
    ran (``seen``: :func:`cell_cost`'s dicts; None while empty). Per sampling mode a cell makes
    ``repeats`` short and long calls and one more prefill for its profile, each about a
    warm-up, and ``repeats x steps`` extra decode steps (long - short), priced at the slowest
    step seen scaled up by sqrt(B / B seen) where B is larger (the step grows slower than that
    at full depth: 7.5 / 12.2 / 24.0 / 30.7 ms at B = 1 / 8 / 32 / 128 on the TP8 shard,
    14.9 / 30.4 / 33.9 / 42.3 on EP8); plus the largest fixed cost seen (profiler, collective
    RPCs), all with a 25 % margin. (Until 991c82e the estimate was the warm-up times the
    largest cell / warm-up ratio seen: a decode-bound cell's ratio priced the prefill-bound
    TP8 32 x 4000 at ~292 s against its ~58, and two cells that fit were skipped.)"""
    if not seen:
        return None
    step = max(s["step_s"] * max(1.0, batch / s["batch"]) ** 0.5 for s in seen)
    fixed = max(s["fixed_s"] for s in seen)
    return 1.25 * modes * ((2 * repeats + 1) * warm_s + repeats * steps * step) + fixed


def cell_cost(batch: int, total_s: float, warm_s: float, cells: list) -> dict:
    """What :func:`cell_estimate` learns from a cell that ran (``cells``: its entries in the
    engine's JSON, one per sampling mode): its decode step (the slowest mode's TPOT by
    difference, the median over repeats) and its fixed cost (``total_s`` less its calls
    (``walls_s``) and one warm-up's prefill per mode for the profile, at least 0)."""
    calls = sum(w[0] + w[1] for c in cells for w in c["walls_s"])
    return {
        "batch": batch,
        "step_s": max([c["median_ms"] / 1e3 for c in cells] + [0.0]),
        "fixed_s": max(total_s - calls - len(cells) * warm_s, 0.0),
    }


def first_engine_stop(up: float, end: float, later: int, later_start_s: float) -> float:
    """When the first engine of a pair under ``--deadline-s`` stops starting cells: it learns
    its own start cost only once it is up (``up``), then leaves each of the ``later`` engines
    ``later_start_s`` to start plus as much time for the same cells as it takes itself, all by
    ``end`` (0: no limit). The first engine of a lease pays torch.compile and the graph
    captures: 357-372 s at full depth on the H200, against 158-214 s for the engines after it
    (a85ce66, 13ad969); an even split of the deadline gave it too little (13ad969: 18 s of
    its 375 s share left for cells, one cell of four run)."""
    if not end or not later:
        return end
    cells_s = (end - up - later * later_start_s) / (later + 1)
    return up + max(cells_s, 0.0)


def later_engine_stop(end: float, after: int, later_start_s: float, first_cells_s: float) -> float:
    """The stop of an engine after the first: ``end`` less what the ``after`` engines still to
    come need (each its start and the first engine's cell time ``first_cells_s``)."""
    if not end:
        return end
    return end - after * (later_start_s + first_cells_s)


def completed_cells(res: dict) -> list:
    """The ``BxCONTEXT`` cells an engine's JSON holds, in its order, once each (a cell has one
    entry per sampling mode): the cells the pair's next engine runs after a deadline."""
    out: list = []
    for c in res.get("cells", []):
        spec = f"{c['batch']}x{c['context']}"
        if spec not in out:
            out.append(spec)
    return out


def engine_main(args) -> None:
    import torch
    from vllm import LLM, SamplingParams

    on_gpu = torch.cuda.is_available()
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    vocab = cfg["vocab_size"]
    kw = dict(
        model=args.model,
        load_format="dummy",
        skip_tokenizer_init=True,
        seed=0,
        max_model_len=args.max_model_len,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if not on_gpu:  # vLLM's CPU build (the smoke run)
        kw.update(attention_backend="CPU_MLA", enforce_eager=True, gpu_memory_utilization=0.3)
    t0 = time.time()
    llm = LLM(**kw)
    # the first engine of a pair sizes its share of the deadline now that it is up
    args.stop_at = first_engine_stop(
        time.time(), args.stop_at, args.later_engines, args.later_start_s
    )
    res: dict = {
        "variant": args.variant,
        "model": args.model,
        "config": cfg,
        "engine_start_s": round(time.time() - t0, 1),
        "cells": [],
        "env": {
            k: v for k, v in os.environ.items() if k.startswith(("FUSEMLA_", "VLLM_USE_DEEP_GEMM"))
        },
    }
    try:
        import vllm

        res["vllm"] = vllm.__version__
        res["torch"] = torch.__version__
        res["device"] = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    except Exception:
        pass
    res["engine"] = llm.collective_rpc(_rpc_install)[0]
    res["plugin_after_start"] = llm.collective_rpc(_rpc_plugin)[0]
    res["cuda_memory_after_start"] = llm.collective_rpc(_rpc_memory)[0]
    print(f"[depth] {args.variant}: CUDA memory {json.dumps(res['cuda_memory_after_start'])}")
    print(
        f"[depth] {args.variant}: engine up in {res['engine_start_s']} s: "
        f"{json.dumps(res['engine'])[:600]}",
        flush=True,
    )

    def params(mode: str, n: int, batch: int):
        if mode == "greedy":
            return SamplingParams(
                temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False
            )
        return [
            SamplingParams(
                temperature=1.0,
                seed=1000 + i,
                max_tokens=n,
                min_tokens=n,
                ignore_eos=True,
                detokenize=False,
            )
            for i in range(batch)
        ]

    def timed(prompts, sp) -> tuple[float, list]:
        if on_gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        return dt, [list(o.outputs[0].token_ids) for o in outs]

    grid = cells_of(args)
    # warm-up: a short call per cell (first-call allocations, JIT of sampling kernels, the
    # shape's MoE configs); under a deadline a second one (fresh prompts: no prefix-cache hit)
    # prices the cell against --stop-at (cell_estimate)
    warm = {}
    for b, ctx in grid:
        for k in range(2 if args.stop_at else 1):
            dt, _ = timed(prompts_for(b, ctx, vocab, f"warm/{k}"), params("greedy", args.short, b))
        warm[(b, ctx)] = dt
    res["warm_s"] = {f"{b}x{c}": round(t, 4) for (b, c), t in warm.items()}
    seen: list = []  # cell_cost of the cells run
    steps = args.long - args.short
    res["skipped_cells"] = []
    for b, ctx in grid:
        est = cell_estimate(warm[(b, ctx)], b, seen, args.repeats, steps, len(args.sampling))
        # before the first cell: nothing to price decode steps by, only the cell's least time
        floor = est is None
        if floor:
            est = cell_floor(warm[(b, ctx)], args.repeats, len(args.sampling))
        if not cell_fits(time.time(), args.stop_at, est):
            skip = {"cell": f"{b}x{ctx}", "estimated_s": round(est, 1)}
            res["skipped_cells"].append(dict(skip, floor=True) if floor else skip)
            print(
                f"[depth] {args.variant} {b}x{ctx} skipped: {'at least ' if floor else ''}"
                f"~{est:.1f} s would end past --stop-at",
                flush=True,
            )
            continue
        t_cell = time.time()
        for mode in args.sampling:
            llm.collective_rpc(_rpc_dispatch, args=(True,))
            p0 = llm.collective_rpc(_rpc_plugin)[0]
            tpot, hashes, tokens0, walls, core = [], [], None, [], []
            llm.collective_rpc(_rpc_timeline, args=(b,))  # start the timeline afresh
            for r in range(args.repeats):
                t_s, _ = timed(
                    prompts_for(b, ctx, vocab, f"{mode}/s{r}"), params(mode, args.short, b)
                )
                t_l, toks = timed(
                    prompts_for(b, ctx, vocab, f"{mode}/l{r}"), params(mode, args.long, b)
                )
                tpot.append(1e3 * (t_l - t_s) / (args.long - args.short))
                walls.append([round(t_s, 4), round(t_l, 4), round(time.time(), 2)])
                core.append(llm.collective_rpc(_rpc_timeline, args=(b,))[0])
                hashes.append([hashlib.sha1(json.dumps(t).encode()).hexdigest()[:12] for t in toks])
                if r == 0:
                    tokens0 = toks
            p1 = llm.collective_rpc(_rpc_plugin)[0]
            disp = llm.collective_rpc(_rpc_dispatch, args=(True,))[0]
            # decode steps: b tokens of b requests; their graph mode
            dec = {}
            for mode_name, ntok, nreq, cnt in disp:
                if nreq == b and ntok >= b and ntok <= max(b, 1) * 2 and ntok < ctx:
                    dec[mode_name] = dec.get(mode_name, 0) + cnt
            expected_steps = args.repeats * (args.short + args.long - 2)
            n_dec = sum(dec.values())
            cell = {
                "batch": b,
                "sampling": mode,
                "context": ctx,
                "tpot_ms": [round(x, 4) for x in tpot],
                # per repeat: wall s of the short and the long call, and the clock at its end
                "walls_s": walls,
                # per repeat: the decode steps' time in the engine core (_rpc_timeline)
                "core_step": core,
                "core_step_median_ms": _median([c.get("median_ms") for c in core]),
                "core_step_min_ms": _extreme(min, [c.get("median_ms") for c in core]),
                "core_step_max_ms": _extreme(max, [c.get("median_ms") for c in core]),
                "median_ms": round(statistics.median(tpot), 4),
                "min_ms": round(min(tpot), 4),
                "max_ms": round(max(tpot), 4),
                "decode_steps_with_all_B": n_dec,
                "decode_steps_expected": expected_steps,
                # all B requests decoded together (None: this model runner's dispatch unseen)
                "fits": (any(nreq == b for _, _, nreq, _ in disp) if disp else None),
                "decode_graph_modes": dec,
                "dispatch": disp,
                "plugin_calls_delta": {k: p1.get(k, 0) - p0.get(k, 0) for k in set(p0) | set(p1)},
                "token_hashes": hashes,
                "tokens_r0": tokens0 if b <= 32 else None,
            }
            print(
                f"[depth] {args.variant} B={b} ctx={ctx} {mode}: TPOT median {cell['median_ms']:.3f} ms "
                f"(core decode step {cell['core_step_median_ms']} ms) "
                f"({cell['min_ms']:.3f}-{cell['max_ms']:.3f}); decode steps with all B: "
                f"{n_dec}/{expected_steps} {dec}; plugin op calls "
                f"{cell['plugin_calls_delta'].get('op_calls', 0)}",
                flush=True,
            )
            if args.profile_steps:
                cell["profile"] = profile_window(llm, b, ctx, args, vocab, params(mode, 10**4, b))
                pr = cell["profile"] or {}
                print(
                    f"[depth] {args.variant} B={b} profile: {json.dumps({k: pr.get(k) for k in ('steps', 'kernel_us_per_step', 'busy_us_per_step', 'idle_us_per_step')})} "
                    f"{json.dumps(pr.get('by_category_us_per_step'))}",
                    flush=True,
                )
            res["cells"].append(cell)
            if args.out:  # written after every cell: a lease may end mid-run
                Path(args.out).write_text(json.dumps(res, indent=1))
        took = time.time() - t_cell
        mine = [c for c in res["cells"] if (c["batch"], c["context"]) == (b, ctx)]
        seen.append(cell_cost(b, took, warm[(b, ctx)], mine))
        # each cell's estimate beside what it took, to judge cell_estimate (None: the first,
        # with the floor it was let in by)
        times = {"cell": f"{b}x{ctx}", "estimated_s": None if floor else round(est, 1)}
        res.setdefault("cell_times", []).append(
            dict(times, took_s=round(took, 1), **({"floor_s": round(est, 1)} if floor else {}))
        )
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


def profile_window(llm, batch: int, context: int, args, vocab: int, sp) -> dict | None:
    """Profile ``args.profile_steps`` whole decode steps of B running requests."""
    engine = llm.llm_engine
    ids = [f"prof{batch}-{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts_for(batch, context, vocab, "prof")):
        engine.add_request(rid, p, sp[ids.index(rid)] if isinstance(sp, list) else sp)
    seen: set = set()
    for _ in range(2000):  # prefill: until every request has its first token
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                seen.add(out.request_id)
        if len(seen) == batch:
            break
    for _ in range(4):
        engine.step()
    llm.collective_rpc(_rpc_arm, args=(args.profile_steps,))
    result = None
    for _ in range(args.profile_steps * 4 + 50):
        engine.step()
        result = llm.collective_rpc(_rpc_result)[0]
        if result is not None:
            break
    engine.abort_request(ids)
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    llm.collective_rpc(_rpc_dispatch, args=(True,))
    return result


# ------------------------------------------------------------------------------ driver


#: the parts of an engine variant's name ("on", "off", or parts joined by "-": "epi-stored")
VARIANT_PARTS = {
    "on": {},
    "epi": {"FUSEMLA_VLLM_EPILOGUE": "1"},  # the W_UV epilogue too (FP8 handoff where it can)
    "epibf16": {"FUSEMLA_VLLM_EPILOGUE": "1", "FUSEMLA_VLLM_EPILOGUE_OUT": "bf16"},
    # with "epi": the epilogue on every decode step, not only on the measured range
    # (configs.fuse_token_spans): the engine profile that re-derives the spans
    "all": {"FUSEMLA_VLLM_EPILOGUE_TOKENS": "all"},
    "fp8": {"FUSEMLA_VLLM_W_UK": "fp8"},
    "fp8xfp8": {"FUSEMLA_VLLM_W_UK": "fp8xfp8"},
    "stored": {"FUSEMLA_VLLM_W_UK": "stored"},
    # fused on FLASHMLA under full graphs whatever the cache (the plugin leaves a bf16 cache
    # there to vLLM; vLLM 0.33's adapter fuses an FP8 cache by default since de9c208)
    "flashmla": {"FUSEMLA_VLLM_FORCE_BACKENDS": "FLASHMLA"},
    # the plugin installed, every layer on vLLM's own path (the wrapper's fallback): what a
    # fallback costs against off, with no fusemla kernel in the step ("on-vllm")
    "vllm": {"FUSEMLA_FUSED_DECODE": "0", "FUSEMLA_FUSED_PREFILL": "0"},
}


def variant_env(variant: str) -> dict:
    """The fusemla variables of engine ``variant``: "off" (the plugin off), "on" (the prologue),
    or :data:`VARIANT_PARTS` joined by "-" (e.g. "epi-stored": prologue + epilogue, the
    checkpoint's FP8 weights as stored); an unknown part raises (a typo must not time the
    default)."""
    if variant == "off":
        return {"FUSEMLA_VLLM": "0"}
    env = {"FUSEMLA_VLLM": "1"}
    for part in variant.split("-"):
        if part not in VARIANT_PARTS:
            raise ValueError(
                f"engine variant {variant!r}: unknown part {part!r} "
                f"(off, or parts of {sorted(VARIANT_PARTS)} joined by '-')"
            )
        env.update(VARIANT_PARTS[part])
    return env


def engine_env(
    variant: str, cache_root, strip: tuple[str, ...] = ("FUSEMLA_",), **extra: str
) -> dict:
    """The environment of one engine process of ``variant`` (:func:`variant_env`): this one's
    without the variables starting with ``strip``, the variant's, vLLM's cache under
    ``cache_root``, then ``extra``. Shared with bench_vllm.py."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(strip)}
    env.update(
        variant_env(variant),
        PYTHONUNBUFFERED="1",
        VLLM_CACHE_ROOT=str(cache_root),
        **extra,
    )
    return env


_MEM_PATTERNS = {
    # vLLM 0.33's gpu_worker lines (the engine core's log)
    "kv_cache_tokens": r"GPU KV cache size: ([\d,]+) tokens",
    "kv_cache_gib": r"Available KV cache memory: ([\d.]+) GiB",
    "consumed_gib": r"Actual usage is ([\d.]+) GiB for consumed memory",
    "peak_activation_gib": r"([\d.]+) GiB for peak activation",
    "cudagraph_gib": r"([\d.]+) GiB for CUDAGraph memory",
    "cudagraph_estimate_gib": r"CUDA graph pool memory: [\d.]+ GiB \(actual\), ([\d.]+) GiB",
}


def memory_of_log(text: str) -> dict:
    """What vLLM's memory profile gave an engine, read off its log: KV-cache tokens and GiB,
    peak activation, CUDA-graph pool (actual and vLLM's estimate). A plugin that raises the
    profiled peak takes it out of the KV cache, so the pair's table shows both engines'."""
    import re

    out: dict = {}
    for key, pat in _MEM_PATTERNS.items():
        m = re.findall(pat, text)
        if m:
            v = m[-1].replace(",", "")
            out[key] = int(v) if key == "kv_cache_tokens" else float(v)
    return out


def pair_main(args) -> None:
    """Engines one after the other (``--order``), each a process of its own; JSON per engine."""
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = write_model(out_dir / f"model_{args.shard}", args.shard)
    cache_root = Path(args.cache_root or out_dir / "vllm_cache")
    order = args.order.split(",")
    for variant in order:  # a typo raises before any engine starts
        variant_env(variant)
    later_s = args.later_start_s  # each later engine's start; None: the shard's (LATER_START_S)
    if later_s is None:
        later_s = LATER_START_S.get(args.shard, LATER_START_DEFAULT_S)
    t_pair = time.time()
    end = t_pair + args.deadline_s if args.deadline_s else 0.0
    end_at = getattr(args, "end_at", 0.0)  # --end-at: the lease's end, whatever came before
    if end_at:
        end = min(end, end_at) if end else end_at
    if end and end - t_pair < len(order) * later_s:
        # the engines' starts alone would not fit: no engine starts (a pair queued behind a
        # long one must not outrun the lease)
        print(
            f"[depth] pair {args.shard} {args.order} not started: {end - t_pair:.0f} s left, "
            f"{len(order)} engine starts need ~{len(order) * later_s:.0f} s",
            flush=True,
        )
        return
    cells = list(getattr(args, "cells", None) or [])
    first_cells_s = 0.0  # the first engine's time from up to done
    first_cell_s = 0.0  # the time its first cell took

    def tag_of(i: int, variant: str) -> str:
        return f"{args.shard}_{args.tag}_{i}{variant}"

    for i, variant in enumerate(order):
        # --deadline-s: the first engine sizes its share once it is up (first_engine_stop);
        # the engines after it run the cells it ran (a pair, not two halves), each leaving the
        # ones still to come their start and that much time
        if i == 0:
            stop_at, later = end, len(order) - 1
        else:
            left = end - time.time() if end else 0.0
            if end and left < later_s + first_cell_s:
                # it could not be up and run the first engine's first cell before the end: its
                # start would be lost (eee87b0: an EP8 on engine started with 134 s left)
                print(
                    f"[depth] {tag_of(i, variant)} not started: {left:.0f} s left, its start and "
                    f"first cell need ~{later_s + first_cell_s:.0f} s",
                    flush=True,
                )
                break
            after = len(order) - 1 - i
            stop_at = later_engine_stop(end, after, later_s, first_cells_s)
            later = 0
        env = engine_env(
            variant,
            cache_root,
            VLLM_USE_DEEP_GEMM="0",
            # LLM.collective_rpc sends this script's functions to the engine core (cloudpickle)
            VLLM_ALLOW_INSECURE_SERIALIZATION="1",
        )
        if args.shard == "smoke":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        tag = tag_of(i, variant)
        cmd = [
            sys.executable,
            __file__,
            "engine",
            "--model",
            str(model),
            "--variant",
            variant,
            "--batches",
            *map(str, args.batches),
            "--context",
            str(args.context),
            *(["--cells", *cells] if cells else []),
            "--repeats",
            str(args.repeats),
            "--short",
            str(args.short),
            "--long",
            str(args.long),
            "--sampling",
            *args.sampling,
            "--profile-steps",
            str(args.profile_steps),
            "--kv-cache-dtype",
            args.kv_cache_dtype,
            "--max-model-len",
            str(args.max_model_len),
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--out",
            str(out_dir / f"{tag}.json"),
            "--stop-at",
            str(stop_at),
            "--later-engines",
            str(later),
            "--later-start-s",
            str(later_s),
        ]
        print(f"[depth] starting {tag}: {' '.join(cmd[2:])}", flush=True)
        t0 = time.time()
        with open(out_dir / f"{tag}.log", "w") as log:
            rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        print(f"[depth] {tag} exit {rc} after {time.time() - t0:.0f} s", flush=True)
        js = out_dir / f"{tag}.json"
        if js.exists():  # the memory vLLM's profile gave this engine, beside its cells
            res = json.loads(js.read_text())
            res["memory"] = memory_of_log((out_dir / f"{tag}.log").read_text(errors="replace"))
            js.write_text(json.dumps(res, indent=1))
            print(f"[depth] {tag} memory: {json.dumps(res['memory'])}", flush=True)
            if i == 0 and end:
                first_cells_s = max(time.time() - t0 - res.get("engine_start_s", 0.0), 0.0)
                first_cell_s = float((res.get("cell_times") or [{}])[0].get("took_s", 0.0))
                cells = completed_cells(res)
                print(f"[depth] the next engines run the cells {tag} ran: {cells}", flush=True)
                if not cells:
                    break
        os.system(f"grep '^\\[depth\\]' {out_dir / f'{tag}.log'} | tail -40")


#: ``vllm bench latency`` as vLLM's own CLI runs it (``vllm.entrypoints.cli.main``), in a
#: process of this Python: vLLM's CPU build is installed as the distribution "vllm-cpu", where
#: the CLI's ``importlib.metadata.version("vllm")`` fails, so that lookup answers as vLLM's own
#: platform detection does there (``version("vllm-cpu") + "+cpu"``); everything else is the CLI's
VLLM_CLI = """
import importlib.metadata as md, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        try:
            return _version("vllm-cpu") + "+cpu"
        except md.PackageNotFoundError:  # a pruned install without its metadata
            import vllm
            return vllm.__version__
md.version = version
sys.argv = ["vllm", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""


def latency_main(args) -> None:
    """vLLM's own ``vllm bench latency`` (dummy load, ``--num-iters``), plugin off and on, one
    engine after the other (``--order``), so a user can reproduce the headline with the tool
    they know. Its latency is one whole ``generate`` of B requests (prefill of ``--input-len``
    tokens + ``--output-len`` decode steps; the tool turns prefix caching off, so every iteration
    prefills). Its spread over 5 iterations (+-30 ms at B = 1 on the H200) is the size of the
    decode steps' saving there: ``--num-iters`` more to resolve it."""
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = write_model(out_dir / f"model_{args.shard}", args.shard)
    cache_root = Path(args.cache_root or out_dir / "vllm_cache")
    order = args.order.split(",")
    for variant in order:  # a typo raises before any engine starts
        variant_env(variant)
    rows = []
    for b in args.batches:
        for i, variant in enumerate(order):
            env = engine_env(variant, cache_root, VLLM_USE_DEEP_GEMM="0")
            tag = f"latency_{args.shard}_{args.tag}_B{b}_{i}{variant}"
            js = out_dir / f"{tag}.json"
            cmd = [
                sys.executable, "-c", VLLM_CLI, "bench", "latency",
                "--model", str(model), "--load-format", "dummy", "--skip-tokenizer-init",
                "--disable-detokenize", "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "--batch-size", str(b),
                "--num-iters", str(args.num_iters), "--num-iters-warmup", "1",
                "--max-model-len", str(args.max_model_len), "--output-json", str(js),
            ]  # fmt: skip
            if args.shard == "smoke":  # vLLM's CPU build
                env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
                cmd += ["--enforce-eager", "--gpu-memory-utilization", "0.3",
                        "--attention-backend", "CPU_MLA"]  # fmt: skip
            print(f"[depth] starting {tag}", flush=True)
            t0 = time.time()
            with open(out_dir / f"{tag}.log", "w") as log:
                rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            row = {"batch": b, "variant": variant, "rc": rc, "wall_s": round(time.time() - t0)}
            if js.exists():
                r = json.loads(js.read_text())
                row.update(avg_latency_s=r.get("avg_latency"), latencies_s=r.get("latencies"))
            rows.append(row)
            print(f"[depth] {tag}: {json.dumps(row)}", flush=True)
            (out_dir / f"latency_{args.shard}_{args.tag}.json").write_text(
                json.dumps({"command": "vllm bench latency", "rows": rows}, indent=1)
            )


def load_runs(paths) -> list:
    runs = []
    for p in paths:
        try:
            r = json.loads(Path(p).read_text())
        except Exception:
            continue
        if isinstance(r, dict) and "cells" in r:
            r["_file"] = str(p)
            runs.append(r)
        elif isinstance(r, dict) and isinstance(r.get("runs"), list):  # a committed results file
            for x in r["runs"]:
                x.setdefault("_file", f"{p}:{x.get('variant')}")
                runs.append(x)
    return runs


def _shard(r: dict) -> str:
    """The shard an engine ran, by its heads and layers; else the first (full-depth) shard of
    its heads; else ``h<heads>``."""
    full = V3["num_hidden_layers"]
    heads = r["config"]["num_attention_heads"]
    layers = r["config"].get("num_hidden_layers", full)
    named = [n for n, s in SHARDS.items() if n != "smoke" and s["num_attention_heads"] == heads]
    same = (n for n in named if SHARDS[n].get("num_hidden_layers", full) == layers)
    return next(same, named[0] if named else f"h{heads}")


def _cell_key(r: dict, c: dict) -> tuple:
    """What makes two engines' cells comparable: shard, B, context, cache dtype, sampling."""
    kv = r.get("engine", {}).get("attention", {}).get("kv_cache_dtype")
    return (_shard(r), c["batch"], c["context"], kv, c["sampling"])


def _ms(x, nd: int = 3) -> str:
    return "" if x is None else f"{x:.{nd}f}"


def table(runs: list) -> str:
    """Per cell and engine: TPOT as (t(long) - t(short)) / (long - short) and as the engine
    core's decode-step time (median of the repeats' medians, min-max), GPU span / busy / idle
    per step in the profiled window, MoE GPU time, the plugin op's calls during the timed
    calls and the graph mode of the decode steps."""
    lines = [
        "| shard | B | ctx | kv | sampling | engine | TPOT ms, by difference | "
        "core decode step ms | GPU span us/step | busy | idle | MoE | plugin op calls | "
        "decode graphs | KV blocks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        kv = r.get("engine", {}).get("attention", {}).get("kv_cache_dtype", "")
        for c in r["cells"]:
            pr = c.get("profile") or {}
            moe = (pr.get("by_category_us_per_step") or {}).get("moe")
            fit = " does not fit" if c["fits"] is False else ""
            core = (
                f"{_ms(c.get('core_step_median_ms'))} ({_ms(c.get('core_step_min_ms'))}-"
                f"{_ms(c.get('core_step_max_ms'))})"
                if c.get("core_step_median_ms") is not None
                else ""
            )
            lines.append(
                f"| {_shard(r)} | {c['batch']} | {c['context']} | {kv} | {c['sampling']} | "
                f"{r['variant']} ({Path(r['_file']).stem}) | {c['median_ms']:.3f} "
                f"({c['min_ms']:.3f}-{c['max_ms']:.3f}){fit} | {core} | "
                f"{pr.get('span_us_per_step', '')} | {pr.get('busy_us_per_step', '')} | "
                f"{pr.get('idle_us_per_step', '')} | {'' if moe is None else moe} | "
                f"{c['plugin_calls_delta'].get('op_calls', 0)} | {c['decode_graph_modes']} | "
                f"{r.get('engine', {}).get('num_gpu_blocks', '')} |"
            )
    return "\n".join(lines)


def kernel_diff(base: dict, other: dict, min_us: float = 5.0) -> list:
    """The kernels whose GPU time per step moved between two engines' profiles of one cell
    (``profile`` dicts of :func:`_summarize_profile`), by at least ``min_us``, largest move
    first: ``(name, base_calls, base_us, other_calls, other_us)`` per step (0 where a kernel
    is absent from one profile's top list). Where a kernel replaces others one for one (61 per
    step for 61 layers), ``us / calls`` is its time per layer: how the epilogue's per-layer time
    against vLLM's W_UV bmm + o_proj's input quantization is read off an engine profile."""

    def by_name(pr: dict) -> dict:
        return {k["name"]: (k["per_step"], k["us_per_step"]) for k in pr.get("top_kernels") or []}

    a, b = by_name(base), by_name(other)
    rows = []
    for name in set(a) | set(b):
        (ac, au), (bc, bu) = a.get(name, (0, 0.0)), b.get(name, (0, 0.0))
        if abs(bu - au) >= min_us or ac != bc:
            rows.append((name, ac, au, bc, bu))
    return sorted(rows, key=lambda r: -abs(r[4] - r[2]))


def kernels_table(runs: list, base: str, other: str, min_us: float = 5.0) -> str:
    """:func:`kernel_diff` of engine ``other`` against ``base`` in every cell both profiled
    (same shard, B, context, cache dtype, sampling): per kernel its calls and us per step in
    each, the change, and us per call (per layer where it runs once a layer). Where the files
    hold several engines of a variant (jobs one after the other), the i-th ``base`` of a cell
    goes with its i-th ``other`` (column ``n``)."""

    prof: dict = {}
    for r in runs:
        for c in r["cells"]:
            if c.get("profile"):
                prof.setdefault(_cell_key(r, c), {}).setdefault(r["variant"], []).append(
                    c["profile"]
                )
    lines = [
        f"| shard | B | ctx | kv | sampling | n | kernel | {base}: calls, us per step | "
        f"{other}: calls, us per step | change, us per step | us per call: {base} / {other} |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k in sorted(prof, key=str):
        pairs = zip(prof[k].get(base, []), prof[k].get(other, []))
        for n, (pb, po) in enumerate(pairs, 1):
            for name, ac, au, bc, bu in kernel_diff(pb, po, min_us):
                per = " / ".join(f"{u / c:.2f}" if c else "-" for c, u in ((ac, au), (bc, bu)))
                lines.append(
                    f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | {n} | {name[:70]} | "
                    f"{ac:g}, {au:.1f} | {bc:g}, {bu:.1f} | {bu - au:+.1f} | {per} |"
                )
    return "\n".join(lines)


def repeat_medians(cell: dict) -> list | None:
    """The engine core's decode step per repeat of ``cell`` (each repeat's median, ms), or
    None where a repeat lacks it (files from before it was recorded)."""
    xs = [(r or {}).get("median_ms") for r in cell.get("core_step") or []]
    return xs if xs and None not in xs else None


def compare(runs: list) -> str:
    """Every plugin-on variant against off per cell (same shard, B, context, cache dtype,
    sampling): the change of each measure in percent of off (negative: the plugin is faster),
    and whether both engines decoded the same tokens (then their MoE routing and expert
    traffic were the same)."""

    cells: dict = {}
    for r in runs:
        for c in r["cells"]:
            cells.setdefault(_cell_key(r, c), {}).setdefault(r["variant"], []).append(c)
    lines = [
        "| shard | B | ctx | kv | sampling | variant | backend, layers fused | same tokens | "
        "TPOT by difference | core decode step | per repeat, on - off | GPU span per step | "
        "GPU busy per step | KV-cache tokens | peak activation GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    eng = {id(c): r for r in runs for c in r["cells"]}

    def fused(r: dict) -> str:
        """The decode backend vLLM ran and how many MLA layers the plugin fused (of all):
        "FLASHMLA, 0/61" is a fallback, no gain to claim."""
        backend = r.get("engine", {}).get("attention", {}).get("backend", "?")
        st = r.get("plugin_after_start") or {}
        n_f, n_v = st.get("layers_fused", 0), st.get("layers_vllm", 0)
        out = f"{backend}, {n_f}/{n_f + n_v}" if n_f + n_v else f"{backend}, -"
        # the FP8 handoff's other rows: o_proj's quantization in place, or quantized and copied
        if st.get("o_proj_quant_in_place"):
            out += ", o_proj quant in place"
        elif st.get("o_proj_quant_in_place_refused"):
            out += ", o_proj quant copied"
        return out

    mem = {id(c): r.get("memory") or {} for r in runs for c in r["cells"]}

    def pct(on, off):
        return "" if on is None or off in (None, 0) else f"{100 * (on - off) / off:+.1f} %"

    def paired(off: dict, on: dict) -> str:
        """Repeat i of one engine against repeat i of the other: with seeded sampling both
        decode the same tokens in repeat i (the same-tokens column says how far), so their MoE
        routing is the same there, while it moves from one repeat to the next; the spread
        across repeats then says nothing about on against off, the paired difference does."""
        a, b = repeat_medians(off), repeat_medians(on)
        if not a or not b or len(a) != len(b):
            return ""
        d = [y - x for x, y in zip(a, b)]
        return f"{min(d):+.3f} to {max(d):+.3f} ms ({sum(x < 0 for x in d)}/{len(d)} faster)"

    for k, by in sorted(
        cells.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], str(kv[0][3]), kv[0][4])
    ):
        if "off" not in by:
            continue
        off = by["off"][0]
        for variant in sorted(v for v in by if v != "off"):
            on = by[variant][0]
            same = sum(
                x == y
                for a, b in zip(off["token_hashes"], on["token_hashes"])
                for x, y in zip(a, b)
            )
            total = sum(len(a) for a in off["token_hashes"])
            po, pn = off.get("profile") or {}, on.get("profile") or {}
            lines.append(
                f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | {variant} | "
                f"{fused(eng[id(on)])} | {same}/{total} | "
                f"{off['median_ms']:.3f} -> {on['median_ms']:.3f} "
                f"({pct(on['median_ms'], off['median_ms'])}) | "
                f"{_ms(off.get('core_step_median_ms'))} -> "
                f"{_ms(on.get('core_step_median_ms'))} "
                f"({pct(on.get('core_step_median_ms'), off.get('core_step_median_ms'))}) | "
                f"{paired(off, on)} | "
                f"{po.get('span_us_per_step', '')} -> {pn.get('span_us_per_step', '')} "
                f"({pct(pn.get('span_us_per_step'), po.get('span_us_per_step'))}) | "
                f"{po.get('busy_us_per_step', '')} -> {pn.get('busy_us_per_step', '')} "
                f"({pct(pn.get('busy_us_per_step'), po.get('busy_us_per_step'))}) | "
                f"{_arrow(mem[id(off)], mem[id(on)], 'kv_cache_tokens', pct)} | "
                f"{_arrow(mem[id(off)], mem[id(on)], 'peak_activation_gib', pct)} |"
            )
    return "\n".join(lines)


# the full-depth grid (docs/method.md): per shard and KV-cache dtype, the cells (batch, context)
# every committed pair is placed in; each needs a pair with the plugin first and one with it
# second (another lease)
GRID = {
    ("tp8", "auto"): [(1, 1000), (8, 1000), (32, 1000), (128, 1000), (1, 4000), (32, 4000)],
    ("ep8", "auto"): [(1, 1000), (8, 1000), (32, 1000), (128, 1000), (1, 4000), (32, 4000)],
    ("tp8", "fp8"): [(1, 1000), (32, 1000)],
}


VERDICTS = ("faster", "within spread", "slower", "no decode-step time")

#: grid rows whose plugin path changed after some of their pairs ran: a pair of a commit that
#: does not descend from the one named is listed, marked, and not counted for the orders. The
#: FP8-query prologue (an FP8 KV cache) took 7.0 us per layer in the engine at de9c208 and 3.6
#: from 26b0b51 on (docs/results.md, 4f5ec9c). With a bf16 cache the TP8 prologue's engine
#: time stayed 2.9 us per layer from e8032df to 991c82e, the PDL change of 603b9ac included,
#: and EP8's pairs before and after it agree within 0.1 point.
KERNEL_SINCE = {("tp8", "fp8"): "26b0b51"}


def descends(commit: str, since: str) -> bool | None:
    """Whether ``commit`` has ``since`` in its history (git; None where git cannot say)."""
    try:
        rc = subprocess.run(
            ["git", "merge-base", "--is-ancestor", since, commit],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
        ).returncode
    except OSError:
        return None
    return {0: True, 1: False}.get(rc)


def verdict(off: dict, on: dict) -> str:
    """One cell of one pair, judged on the engine core's decode step: "faster" / "slower" when
    the 5 repeats' ranges are disjoint, or when repeat i of one engine beat repeat i of the
    other in every repeat (both decode the same tokens in repeat i); else "within spread".
    "no decode-step time" where the file predates it (TPOT by difference only)."""
    a, b = repeat_medians(off), repeat_medians(on)
    if not a or not b:
        return "no decode-step time"
    if max(b) < min(a):
        return "faster"
    if min(b) > max(a):
        return "slower"
    if len(a) == len(b):
        d = [y - x for x, y in zip(a, b)]
        if all(x < 0 for x in d):
            return "faster"
        if all(x > 0 for x in d):
            return "slower"
    return "within spread"


def results_files(files):
    """``(path, document, runs)`` of each readable results file holding a list of engine runs
    (unreadable or other files skipped): what :func:`pairs_of` and :func:`timings_of` read."""
    for p in files:
        try:
            d = json.loads(Path(p).read_text())
        except (OSError, ValueError):
            continue
        runs = d.get("runs") if isinstance(d, dict) else None
        if isinstance(runs, list):
            yield p, d, runs


def pairs_of(files) -> list:
    """Every (off, plugin-on variant: a name starting with "on") pair in the committed results
    files, one row per cell: which engine ran first (a file is one lease, its engines in the
    order they ran), the change of the decode step and its verdict. A variant pairs with the
    nearest off engine before it (off first) and the nearest after it (on first), so an
    ``off,on,off`` lease times both orders with three engines. A variant that fused no layer
    is a fallback."""
    rows = []
    for p, d, runs in results_files(files):
        commit = str(d.get("commit") or "?").split()[0]
        offs = [i for i, r in enumerate(runs) if r.get("variant") == "off"]
        for i, r in enumerate(runs):
            v = r.get("variant", "")
            if not v.startswith("on"):
                continue
            before = [j for j in offs if j < i][-1:]
            after = [j for j in offs if j > i][:1]
            for i_off in before + after:
                rows += _pair_rows(commit, Path(p).name, runs[i_off], r, i < i_off)
    return rows


def _pair_rows(commit: str, file: str, off: dict, on: dict, on_first: bool) -> list:
    """One row per cell both engines ran (same B, context and sampling): :func:`pairs_of`."""
    rows = []
    v = on.get("variant", "")
    st = on.get("plugin_after_start") or {}
    kv = on.get("engine", {}).get("attention", {}).get("kv_cache_dtype")
    by = {(c["batch"], c["context"], c.get("sampling")): c for c in off["cells"]}
    since = KERNEL_SINCE.get((_shard(on), kv))
    # False: an older plugin path than the row's (KERNEL_SINCE): listed, counted for no order
    current = descends(commit, since) if since else True
    for c in on["cells"]:
        o = by.get((c["batch"], c["context"], c.get("sampling")))
        if o is None:
            continue
        a, b = o.get("core_step_median_ms"), c.get("core_step_median_ms")
        rows.append(
            {
                "shard": _shard(on),
                "kv": kv,
                "batch": c["batch"],
                "context": c["context"],
                "commit": commit,
                "file": file,
                "variant": v,
                "sampling": c.get("sampling"),
                "first": "on" if on_first else "off",
                "fused": bool(st.get("layers_fused")),
                "off_ms": a,
                "on_ms": b,
                "change_pct": None if not a or b is None else 100 * (b - a) / a,
                "verdict": verdict(o, c),
                "current": current,
            }
        )
    return rows


def timings_of(files) -> dict:
    """What the committed engines took, per ``(shard, kv)``: their starts (``engine_start_s``)
    and each cell's time (``cell_times``' ``took_s``, kept since df29556): :func:`lease_need`."""
    out: dict = {}
    for _, _, runs in results_files(files):
        for r in runs:
            if "config" not in r:
                continue
            kv = r.get("engine", {}).get("attention", {}).get("kv_cache_dtype")
            t = out.setdefault((_shard(r), kv), {"start_s": [], "cells": {}})
            if r.get("engine_start_s"):
                t["start_s"].append(float(r["engine_start_s"]))
            for c in r.get("cell_times") or []:
                t["cells"].setdefault(c["cell"], []).append(float(c["took_s"]))
    return out


def lease_need(timing: dict | None, cells: list, engines: int = 2) -> str:
    """A pair's device time from what its shard's engines took before (:func:`timings_of`):
    ``engines`` starts at the median start seen, each running ``cells`` at each cell's median
    time; the slowest start seen beside it (a lease's first engine of a shard pays its
    compiles unless warm caches are carried: 357-372 s at 13ad969)."""
    starts = sorted((timing or {}).get("start_s") or [])
    if not starts:
        return "no engine of this shard timed yet"
    took = (timing or {}).get("cells", {})
    known = {c: statistics.median(took[c]) for c in cells if took.get(c)}
    start = statistics.median(starts)
    total = engines * (start + sum(known.values()))
    unknown = [c for c in cells if c not in known]
    return (
        f"~{total:.0f} s: {engines} starts of ~{start:.0f} s (slowest seen {starts[-1]:.0f}), "
        + ", ".join(f"{c} ~{t:.0f} s" for c, t in known.items())
        + (" per engine" if known else "")
        + (f"; not yet timed: {' '.join(unknown)}" if unknown else "")
    )


def grid(rows: list, timings: dict | None = None) -> str:
    """The full-depth grid (:data:`GRID`) from :func:`pairs_of`'s rows: per cell, every fused
    pair (commit, which engine ran first, change, verdict), the orders still missing, and the
    fallbacks apart; then the ``pair`` arguments that would fill the missing orders, each with
    the device time it needs by ``timings`` (:func:`timings_of`, :func:`lease_need`)."""
    lines = [
        "| shard | kv | B | context | pairs (commit, first, decode step off -> on, verdict) "
        "| plugin first | plugin second |",
        "|---|---|---|---|---|---|---|",
    ]
    todo: dict = {}  # (shard, kv, order) -> the cells still missing that order
    for (shard, kv), cells in GRID.items():
        for batch, ctx in cells:
            mine = [
                r
                for r in rows
                if (r["shard"], r["kv"], r["batch"], r["context"]) == (shard, kv, batch, ctx)
            ]
            since = KERNEL_SINCE.get((shard, kv))
            fused = [r for r in mine if r["fused"]]
            text = "; ".join(
                f"{r['commit']}"
                + ("" if r["current"] is not False else f" (before {since})")
                + f" {r['first']} first"
                + ("" if r["sampling"] in (None, "seeded") else f" ({r['sampling']})")
                + ": "
                + (
                    f"{r['off_ms']:.3f} -> {r['on_ms']:.3f} ({r['change_pct']:+.1f} %), "
                    if r["change_pct"] is not None
                    else ""
                )
                + r["verdict"]
                for r in fused
            )
            falls = [r for r in mine if not r["fused"]]
            if falls:
                text += "; fallback: " + ", ".join(
                    f"{r['commit']}"
                    + ("" if r["current"] is not False else f" (before {since})")
                    + f" {r['variant']} {r['verdict']}"
                    for r in falls
                )
            timed = [
                r
                for r in fused
                if r["verdict"] != "no decode-step time" and r["current"] is not False
            ]
            first = "yes" if any(r["first"] == "on" for r in timed) else "**missing**"
            second = "yes" if any(r["first"] == "off" for r in timed) else "**missing**"
            for order, have in (("on,off", first), ("off,on", second)):
                if have != "yes":
                    todo.setdefault((shard, kv, order), []).append(f"{batch}x{ctx}")
            lines.append(
                f"| {shard} | {kv} | {batch} | {ctx} | {text or '-'} | {first} | {second} |"
            )
    fused = [r for r in rows if r["fused"]]
    slower = [r for r in fused if r["verdict"] == "slower"]
    counts = {v: sum(r["verdict"] == v for r in fused) for v in VERDICTS}
    lines.append("")
    lines.append(
        "fused pairs (cells): "
        + ", ".join(f"{n} {v}" for v, n in counts.items() if n)
        + "; slower beyond the repeats' spread: "
        + (", ".join(f"{r['file']} B={r['batch']}" for r in slower) if slower else "none")
    )
    # the pairs that fill the missing orders, as `pair` arguments (one lease each, or joined
    # by " + " in one tests/vllm/h200.sh depth job)
    for (shard, kv, order), cells in todo.items():
        lines.append(
            f"to run: --shard {shard}"
            + ("" if kv == "auto" else f" --kv-cache-dtype {kv}")
            + f" --order {order} --cells {' '.join(cells)} --sampling seeded --repeats 5"
            + (f" ({lease_need(timings.get((shard, kv)), cells)})" if timings is not None else "")
        )
    return "\n".join(lines)


def _arrow(off: dict, on: dict, key: str, pct) -> str:
    a, b = off.get(key), on.get(key)
    return "" if a is None or b is None else f"{a} -> {b} ({pct(b, a)})"


def smoke() -> None:
    """vLLM's CPU build: the tiny 'smoke' layout, plugin off then on, one repeat, then the
    table; fails unless both engines produced a TPOT and the on engine's plugin ran fused."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="vllm_depth_smoke_"))
    args = argparse.Namespace(
        out_dir=str(d),
        shard="smoke",
        order="off,on",
        tag="smoke",
        batches=[1, 2],
        context=16,
        cells=["1x16", "2x24"],  # two contexts in one engine
        repeats=1,
        short=2,
        long=4,
        sampling=["greedy", "seeded"],
        profile_steps=3,
        kv_cache_dtype="auto",
        max_model_len=256,
        max_num_seqs=0,
        cache_root=None,
        deadline_s=0.0,
        later_start_s=240.0,
    )
    pair_main(args)
    runs = load_runs(sorted(d.glob("*.json")))
    print(table(runs))
    print(compare(runs))
    assert len(runs) == 2 and all(len(r["cells"]) == 4 for r in runs), "smoke: missing cells"
    on = [r for r in runs if r["variant"] == "on"][0]
    assert on["plugin_after_start"].get("layers_fused", 0) > 0, "smoke: the plugin did not fuse"
    assert all(c["plugin_calls_delta"].get("op_calls", 0) > 0 for c in on["cells"]), (
        "smoke: the plugin op never ran"
    )
    assert all(
        (c.get("profile") or {}).get("steps") == 3
        for r in runs
        for c in r["cells"]
        if c["sampling"] == "greedy"
    ), "smoke: no profiled window"
    # vLLM's own `vllm bench latency`, off and on, as the lease runs it
    lat = argparse.Namespace(
        out_dir=str(d / "latency"),
        shard="smoke",
        batches=[2],
        order="off,on",
        input_len=16,
        output_len=4,
        num_iters=1,
        max_model_len=256,
        tag="smoke",
        cache_root=None,
    )
    latency_main(lat)
    rows = json.loads((d / "latency" / "latency_smoke_smoke.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["off", "on"], rows
    assert all(r["rc"] == 0 and r.get("avg_latency_s") for r in rows), (
        f"smoke: vllm bench latency failed (logs in {d / 'latency'}): {rows}"
    )
    print("[depth] smoke ok")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    sub = ap.add_subparsers(dest="cmd")
    c = sub.add_parser("config")
    c.add_argument("dir")
    c.add_argument("--shard", choices=sorted(SHARDS), default="tp8")
    for name in ("engine", "pair"):
        e = sub.add_parser(name)
        e.add_argument("--batches", nargs="+", type=int, default=[1, 32])
        e.add_argument("--context", type=int, default=1000)
        e.add_argument(
            "--cells",
            nargs="+",
            default=None,
            help="BxCONTEXT cells in this order (e.g. 1x1000 32x4000); replaces --batches/--context",
        )
        e.add_argument("--repeats", type=int, default=5)
        e.add_argument("--short", type=int, default=8)
        e.add_argument("--long", type=int, default=136)
        e.add_argument(
            "--sampling", nargs="+", default=["greedy", "seeded"], choices=["greedy", "seeded"]
        )
        e.add_argument("--profile-steps", type=int, default=16)
        e.add_argument("--kv-cache-dtype", default="auto")
        e.add_argument("--max-model-len", type=int, default=8192)
        e.add_argument("--max-num-seqs", type=int, default=0)
        if name == "engine":
            e.add_argument("--model", required=True)
            e.add_argument("--variant", default="on")
            e.add_argument("--out", default=None)
            e.add_argument(
                "--stop-at",
                type=float,
                default=0.0,
                help="epoch seconds: start no cell estimated to end later (0: no limit)",
            )
            e.add_argument(
                "--later-engines",
                type=int,
                default=0,
                help="engines of the pair still to come after this one (the first engine "
                "leaves them their start and its own cell time before --stop-at)",
            )
        else:
            e.add_argument("--shard", choices=sorted(SHARDS), default="tp8")
            e.add_argument("--order", default="off,on")
            e.add_argument("--out-dir", required=True)
            e.add_argument("--tag", default="run")
            e.add_argument("--cache-root", default=None)
            e.add_argument(
                "--deadline-s",
                type=float,
                default=0.0,
                help="the whole pair within this many seconds (a device lease's rest): the first "
                "engine, once up, leaves each later one --later-start-s and as much time for "
                "cells as it takes itself, skipping the cells that would not fit; the others "
                "run the cells the first ran (0: no limit)",
            )
            e.add_argument(
                "--end-at",
                type=float,
                default=0.0,
                help="the whole pair by this time (seconds since the epoch), with --deadline-s "
                "the earlier of the two: jobs queued one after the other in one lease end by "
                "the lease's end, however long the ones before them took (0: none)",
            )
        e.add_argument(
            "--later-start-s",
            type=float,
            default=None if name == "pair" else LATER_START_DEFAULT_S,
            help="seconds an engine after a lease's first takes to start (with --deadline-s; "
            "a pair's default is the shard's, LATER_START_S: 240 at full depth, where the "
            "H200 took 158-214 and the first 357-372; 90 for tp8pp2, 150 for ep8pp2, measured "
            "on an H100)",
        )
    lat = sub.add_parser("latency", help="vLLM's own `vllm bench latency`, off and on")
    lat.add_argument("--shard", choices=sorted(SHARDS), default="tp8")
    lat.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    lat.add_argument("--order", default="off,on")
    lat.add_argument("--input-len", type=int, default=1000)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters", type=int, default=5)
    lat.add_argument("--max-model-len", type=int, default=8192)
    lat.add_argument("--out-dir", required=True)
    lat.add_argument("--tag", default="run")
    lat.add_argument("--cache-root", default=None)
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    k = sub.add_parser(
        "kernels", help="the kernels whose GPU time per step moved between two engines, per cell"
    )
    k.add_argument("files", nargs="+")
    k.add_argument("--base", default="off")
    k.add_argument("--variant", default="on")
    k.add_argument("--min-us", type=float, default=5.0)
    g = sub.add_parser("grid", help="every committed off/on pair by cell of the full-depth grid")
    g.add_argument(
        "files",
        nargs="*",
        help="results files (default: benchmarks/results/h200_vllm033_depth_*.json)",
    )
    args = ap.parse_args()
    if args.smoke:
        smoke()
    elif args.cmd == "config":
        print(write_model(Path(args.dir), args.shard))
    elif args.cmd == "engine":
        engine_main(args)
    elif args.cmd == "pair":
        pair_main(args)
    elif args.cmd == "latency":
        latency_main(args)
    elif args.cmd == "grid":
        files = args.files or sorted(
            (Path(__file__).parent / "results").glob("h200_vllm033_depth_*.json")
        )
        print(grid(pairs_of(files), timings_of(files)))
    elif args.cmd == "kernels":
        print(kernels_table(load_runs(args.files), args.base, args.variant, args.min_us))
    elif args.cmd == "table":
        runs = load_runs(args.files)
        print(table(runs))
        print()
        print(compare(runs))
    else:
        ap.print_help()


if __name__ == "__main__":
    main()
