"""The decode step in vLLM, plugin on vs off: TPOT and where the GPU time goes.

Method: one engine process per (model, plugin on/off), all started first and kept alive; then,
model by model, the two engines of a pair measure in alternation (off-on, then on-off, ...)
while every other engine sits idle: each measurement adds B requests of a ``--prompt``-token
prompt, steps the engine until every request has its first token (prefill), then times
``--steps`` engine steps of pure decode (wall clock per step = TPOT, as a user sees it).
``--repeats`` alternations per batch size; median and min/max reported. Then one profiled
measurement per engine and batch (torch profiler, CUDA kernels of the same number of decode
steps, CUDA-graph replays included): GPU time per step by kernel, so a TPOT difference is
attributed to the kernels that changed (fusemla's prologue vs vLLM's BMM, RoPE, concat and
cache write) or to the host.

Variants (``--variants``): ``off`` (vLLM's own path), ``on`` (the plugin, vLLM's bf16 W_UK_T),
``fp8`` / ``fp8xfp8`` (the plugin with ``FUSEMLA_VLLM_W_UK=fp8`` / ``fp8xfp8``: FP8 W_UK_T, and
FP8 activations for the second); every variant of a model alternates with the others, each
repeat in a rotated order, and each plugin variant's profile is attributed against ``off``.

Models: ``engine_run.SHAPES['bench-h16' / 'bench-h128']`` (DeepSeek-V3 attention: hidden 7168,
q_lora 1536, kv_lora 512, rope 64, nope 128, v 128; 16 or 128 heads; 4 layers; MLP width 1024;
random weights), bf16, vLLM's default compile and CUDA-graph mode (FULL_AND_PIECEWISE).

    python benchmarks/bench_vllm.py --out results.json          # on a GPU with vLLM
    python benchmarks/bench_vllm.py --smoke                      # CPU vLLM, tiny model

``--smoke`` fails unless every (batch, variant) measured a TPOT and no engine reported an error.
The script also runs as ``python -m benchmarks.bench_vllm`` (its engines run it as a file).

Run with vLLM installed (on the H200: through the offline bundle, docs/results.md, "How the suite ran on the H200").
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# from the full-depth benchmark: kernel name -> category (its table: MoE, FP8 quant and norm
# included) and an engine process's environment
if __package__:
    from benchmarks.vllm_depth import category, engine_env
else:  # run as a file (as its engines are): benchmarks/ is sys.path[0]
    from vllm_depth import category, engine_env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENGINE_RUN = ROOT / "tests" / "vllm" / "engine_run.py"
TAG = "@@BENCH@@ "
VARIANTS = ("off", "on", "fp8", "fp8xfp8")


# ------------------------------------------------------------------------------ worker side


def worker(args) -> None:
    """One engine; reads JSON commands on stdin, answers on stdout lines tagged with TAG."""
    import torch
    from vllm import LLM, SamplingParams

    batches = json.loads(args.batches)
    on_gpu = torch.cuda.is_available()
    kw = dict(
        model=args.model,
        skip_tokenizer_init=True,
        max_model_len=args.max_len,
        dtype="bfloat16",
        seed=0,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(8192, max(batches) * args.prompt),
    )
    if on_gpu:
        sizes = sorted(
            {s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if s <= max(batches)} | set(batches)
        )
        kw.update(
            gpu_memory_utilization=0.2,
            kv_cache_memory_bytes=4 << 30,
            compilation_config={"cudagraph_capture_sizes": sizes},
        )
    else:
        kw.update(enforce_eager=True, attention_backend="CPU_MLA")
    llm = LLM(**kw)
    engine = llm.llm_engine
    counter = [0]

    def measure(batch: int, steps: int, profile: bool) -> dict:
        ids = []
        for _ in range(batch):
            rid = f"r{counter[0]}"
            counter[0] += 1
            ids.append(rid)
            prompt = [(counter[0] * 7919 + i * 104729) % 997 + 1 for i in range(args.prompt)]
            engine.add_request(
                rid,
                {"prompt_token_ids": prompt},
                SamplingParams(
                    temperature=0.0, max_tokens=steps + 8, ignore_eos=True, detokenize=False
                ),
            )
        seen: set = set()
        n = 0
        while len(seen) < batch:  # prefill: until every request produced a token
            for out in engine.step():
                if out.outputs and out.outputs[0].token_ids:
                    seen.add(out.request_id)
            n += 1
            assert n < 1000, "prefill did not finish"
        for _ in range(2):  # settle into pure decode steps
            engine.step()
        prof = None
        if profile and on_gpu:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as tprofile

            torch.cuda.synchronize()
            prof = tprofile(activities=[ProfilerActivity.CUDA])
            prof.__enter__()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if on_gpu:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        res = {"tpot_ms": 1e3 * dt / steps}
        if prof is not None:
            prof.__exit__(None, None, None)
            from fusemla.testing.vllm_worker import cuda_kernel_times

            res["kernel_us_per_step"] = {
                k: us / steps for k, (_, us) in cuda_kernel_times(prof).items()
            }
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        return res

    print(TAG + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            break
        try:
            res = measure(cmd["batch"], cmd["steps"], cmd.get("profile", False))
        except Exception as e:  # reported, the driver decides
            res = {"error": f"{type(e).__name__}: {e}"}
        print(TAG + json.dumps(res), flush=True)


# ------------------------------------------------------------------------------ driver side


class Engine:
    def __init__(self, name: str, model: str, variant: str, args, gpu: int | None, log_dir: Path):
        self.name = name
        env = engine_env(
            variant,
            log_dir / "cache" / name,
            strip=("FUSEMLA_", "VLLM_"),
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
        )
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        if args.smoke:
            env.update(VLLM_CPU_KVCACHE_SPACE="1")
        self.log = open(log_dir / f"{name}.log", "w")
        cmd = [
            sys.executable,
            __file__,
            "worker",
            "--model",
            model,
            "--batches",
            json.dumps(args.batches),
            "--prompt",
            str(args.prompt),
            "--max-len",
            str(args.prompt + args.steps + 64),
        ]
        self.p = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )

    def read(self, timeout: float = 900) -> dict:
        box: list = []

        def pump():
            for line in self.p.stdout:
                if line.startswith(TAG):
                    box.append(json.loads(line[len(TAG) :]))
                    return
                self.log.write(line)
            box.append({"error": f"engine {self.name} exited (rc={self.p.poll()})"})

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        t.join(timeout)
        self.log.flush()
        return box[0] if box else {"error": f"engine {self.name}: no answer in {timeout} s"}

    def ask(self, **cmd) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self) -> None:
        try:
            self.p.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.p.stdin.flush()
            self.p.wait(60)
        except Exception:
            self.p.kill()
        self.log.close()


def attribute(on: dict, off: dict) -> dict:
    """Per category and per layer-changing kernel: GPU µs per decode step, on vs off."""
    cats = {}
    for label, prof in (("on", on), ("off", off)):
        for name, us in prof.items():
            c = cats.setdefault(category(name), {"on": 0.0, "off": 0.0})
            c[label] += us
    total = {"on": sum(on.values()), "off": sum(off.values())}
    changed = {
        n: {"on": round(on.get(n, 0.0), 2), "off": round(off.get(n, 0.0), 2)}
        for n in set(on) | set(off)
        if abs(on.get(n, 0.0) - off.get(n, 0.0)) > 0.5
    }
    return {
        "gpu_us_per_step": {k: round(v, 2) for k, v in total.items()},
        "by_category": {k: {x: round(y, 2) for x, y in v.items()} for k, v in cats.items()},
        "changed_kernels": dict(
            sorted(changed.items(), key=lambda kv: -abs(kv[1]["on"] - kv[1]["off"]))
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--model", required=True)
    w.add_argument("--batches", required=True)
    w.add_argument("--prompt", type=int, default=256)
    w.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", nargs="+", default=["bench-h16", "bench-h128"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 128])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--variants", nargs="+", default=["off", "on"], choices=VARIANTS)
    ap.add_argument("--smoke", action="store_true", help="CPU vLLM, tiny model, 1 repeat")
    args = ap.parse_args()
    if args.cmd == "worker":
        worker(args)
        return
    if args.smoke:
        args.models, args.batches, args.repeats, args.steps, args.prompt = (
            ["base"],
            [1, 2],
            1,
            3,
            16,
        )
    variants = ["off"] + [v for v in args.variants if v != "off"]
    try:
        import torch

        gpus = list(range(torch.cuda.device_count()))
    except Exception:
        gpus = []
    work = Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    t_start = time.time()
    engines: dict = {}
    for i, m in enumerate(args.models):
        path = work / "models" / m
        subprocess.run(
            [sys.executable, str(ENGINE_RUN), "make-model", str(path), "--shape", m], check=True
        )
        gpu = gpus[i % len(gpus)] if gpus else None
        for v in variants:
            engines[(m, v)] = Engine(f"{m}-{v}", str(path), v, args, gpu, work)
    ready = {k: e.read() for k, e in engines.items()}
    bad = {f"{k[0]}-{k[1]}": v for k, v in ready.items() if not v.get("ready")}
    results: dict = {
        "method": __doc__.split("\n\n")[1],
        "args": vars(args),
        "rows": [],
        "attribution": {},
        "errors": bad,
    }
    if not bad:
        for m in args.models:
            group = {v: engines[(m, v)] for v in variants}
            for b in args.batches:
                tp: dict = {v: [] for v in variants}
                for r in range(args.repeats):
                    k = r % len(variants)  # rotate the order: each variant leads in turn
                    for v in variants[k:] + variants[:k]:
                        res = group[v].ask(batch=b, steps=args.steps)
                        if "error" in res:
                            results["errors"][f"{m}-B{b}-{v}-r{r}"] = res["error"]
                            continue
                        tp[v].append(res["tpot_ms"])
                row = {"model": m, "batch": b, "tpot_ms": tp, "median": {}, "spread": {}}
                for v, xs in tp.items():
                    if xs:
                        row["median"][v] = round(statistics.median(xs), 4)
                        row["spread"][v] = round(max(xs) - min(xs), 4)
                off = row["median"].get("off")
                row["saved_ms"] = {
                    v: round(off - x, 4)
                    for v, x in row["median"].items()
                    if v != "off" and off is not None
                }
                results["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "tpot_ms"}), flush=True)
                prof = {
                    v: group[v].ask(batch=b, steps=min(args.steps, 16), profile=True)
                    for v in variants
                }
                for v in variants[1:]:
                    if all("kernel_us_per_step" in prof[x] for x in ("off", v)):
                        results["attribution"][f"{m}/B{b}/{v}"] = attribute(
                            prof[v]["kernel_us_per_step"], prof["off"]["kernel_us_per_step"]
                        )
    for e in engines.values():
        e.close()
    results["seconds"] = round(time.time() - t_start, 1)
    results["logs"] = str(work)
    text = json.dumps(results, indent=1, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text)
    print_table(results)
    if results["errors"]:
        print("errors:", json.dumps(results["errors"], indent=1)[:3000])
        sys.exit(1)
    missing = [
        f"{m}/B{b}/{v}"
        for m in args.models
        for b in args.batches
        for v in variants
        if not any(
            r["model"] == m and r["batch"] == b and r["median"].get(v, 0) > 0
            for r in results["rows"]
        )
    ]
    if missing:
        print(f"no TPOT measured for {missing}; exit status 1")
        sys.exit(1)
    print(f"bench_vllm: {len(results['rows'])} rows, every variant measured")


def print_table(results: dict) -> None:
    print(
        "\nmodel        B   variant    TPOT ms (spread)   saved vs off ms   GPU us/step "
        "off -> variant"
    )
    for r in results["rows"]:
        for v, med in r["median"].items():
            a = results["attribution"].get(f"{r['model']}/B{r['batch']}/{v}", {})
            g = a.get("gpu_us_per_step", {})
            saved = r["saved_ms"].get(v)
            gpu = f"{g.get('off', 0):.1f} -> {g.get('on', 0):.1f}" if g else ""
            print(
                f"{r['model']:<11} {r['batch']:>3}   {v:<9}  {med:.3f} ({r['spread'][v]:.3f})"
                f"      {'' if saved is None else f'{saved:+.3f}':>8}         {gpu}"
            )


if __name__ == "__main__":
    main()
