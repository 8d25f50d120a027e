"""Test instrumentation for the vLLM plugin, run inside vLLM's workers (never used in serving).

Passed to vLLM as ``worker_extension_cls="fusemla.testing.vllm_worker.FuseMLATestExtension"``
and driven through ``LLM.collective_rpc``: it works whether the workers share the test driver's
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TP=1) or not (TP=2). It

- logs every KV-cache write (vLLM's ``impl.do_kv_cache_update``, fusemla's kernel launch and
  fusemla's PyTorch reference) as (layer, slots), so a test can check that each token's row is
  written exactly once;
- counts Triton kernel launches (``fusemla.ops.prologue.launch.launch``) vs the reference,
  through the tests' one launch spy (:class:`fusemla.testing.spy.PrologueSpy`);
- records each MLA layer's output per step (forward hooks; eager mode only);
- zeroes the KV caches before the run and dumps them after it;
- can inject the bugs the tests must catch: ``double_rope`` (the prologue's inputs are rotated
  before the kernel rotates them again), ``double_write`` (vLLM's own cache write also runs
  for the tokens fusemla writes), ``rope_off_by_one`` (decode tokens rotated by position + 1)
  and ``epilogue_scale_shift`` (the FP8 group scales the epilogue hands o_proj rolled by one
  group within each token: every group's codes read with its neighbour's scale);
- can perturb vLLM's own path by rounding-sized noise, ``noise:EPS`` (every value vLLM writes to
  the KV cache multiplied by ``1 + EPS * u``, ``u`` uniform in [-1, 1], before any FP8
  quantization), which measures the deviation legitimate rounding differences cause;
- counts GPU kernels by name with the torch profiler (``fusemla_profile``), which sees the
  kernels that CUDA-graph replays run too, where no Python code runs.

Host-side logs (writes, launches) are taken only outside CUDA-graph capture; instrumentation
is installed after vLLM built its graphs, so a replayed graph runs none of it (the kernel counts
cover those steps).

Importing this module imports vLLM only inside the methods.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from fusemla.integrations.vllm import _capturing
from fusemla.testing.spy import PrologueSpy

_log: dict = {"writes": [], "kernel": 0, "reference": 0, "captures": {}}
_installed = False


def _layer_modules(model):
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, MultiHeadLatentAttentionWrapper)
    ]


def _worker_layers(model_runner) -> list:
    """The MLA layers of the worker's model and of its speculative drafter's model, if it has
    one of its own (DeepSeek's MTP layer: one more MLA layer with its own cache)."""
    layers = _layer_modules(model_runner.model)
    seen = {id(m) for _, m in layers}
    # the drafter lives at `.drafter` in vLLM's v1 runner (the CPU build) and at `.speculator`
    # in 0.33's CUDA runner (vllm.v1.worker.gpu.model_runner: the H100 suite at b7014e0 found
    # no drafter layer through `.drafter`); its model may be a wrapper that forwards
    # attributes, not an nn.Module: anything with named_modules
    for attr in ("drafter", "speculator"):
        draft = getattr(getattr(model_runner, attr, None), "model", None)
        if hasattr(draft, "named_modules") and draft is not model_runner.model:
            new = [(n, m) for n, m in _layer_modules(draft) if id(m) not in seen]
            seen.update(id(m) for _, m in new)
            layers += new
    return layers


def _install(layers: list, inject: str, capture: bool) -> None:
    global _installed
    if _installed:
        return
    _installed = True
    from fusemla.integrations import vllm as plugin

    noise = float(inject.split(":", 1)[1]) if inject.startswith("noise:") else 0.0
    by_ptr = {}
    for _, w in layers:
        a = w.mla_attn
        by_ptr[a.kv_cache.data_ptr()] = a.layer_name
        a.kv_cache.zero_()

        def logged(
            kv_c,
            k_pe,
            kv_cache,
            slot_mapping,
            *rest,
            _orig=a.impl.do_kv_cache_update,
            _name=a.layer_name,
        ):
            if not _capturing():
                _log["writes"].append(
                    (_name, "vllm", slot_mapping.detach().cpu().long().numpy().copy())
                )
            if noise:
                kv_c, k_pe = _perturbed(kv_c, noise), _perturbed(k_pe, noise)
            return _orig(kv_c, k_pe, kv_cache, slot_mapping, *rest)

        a.impl.do_kv_cache_update = logged

    def record(args, who):
        if _capturing():
            return
        _log[who] += 1
        name = by_ptr.get(args.kv_cache.data_ptr(), "?")
        _log["writes"].append((name, who, args.slot_mapping.detach().cpu().long().numpy().copy()))

    PrologueSpy(
        on_launch=lambda args: record(args, "kernel"),
        on_reference=lambda args: record(args, "reference"),
        keep=False,
    ).install()

    if inject == "double_rope":
        orig_prologue = plugin._prologue

        def double_rope(spec, q_nope, q_pe, kv_c, k_pe, positions, *a, **kw):
            from fusemla.rope import apply_rope

            p = positions.long()
            c, s = spec.cos_cache[p].float(), spec.sin_cache[p].float()
            q_pe = apply_rope(q_pe, c[:, None], s[:, None], spec.is_neox).to(q_pe.dtype)
            k_pe = apply_rope(k_pe, c, s, spec.is_neox).to(k_pe.dtype)
            return orig_prologue(spec, q_nope, q_pe, kv_c, k_pe, positions, *a, **kw)

        plugin._prologue = double_rope
    elif inject == "double_write":
        orig_fused = plugin._LayerState.fused_path

        def double_write(self, q, kv_c, k_pe, positions, output, md, slots, kv_cache, *rest):
            n = int(md.num_actual_tokens)
            # on copies: vLLM's rotation is in place, and this bug is the second write alone
            _, k_r = self.vllm_rope(positions[:n], q[:n].clone(), k_pe[:n].clone())
            self.vllm_cache_write(kv_c[:n], k_r, kv_cache, slots[:n])
            return orig_fused(self, q, kv_c, k_pe, positions, output, md, slots, kv_cache, *rest)

        plugin._LayerState.fused_path = double_write
    elif inject == "rope_off_by_one":
        orig_prologue = plugin._prologue

        def off_by_one(spec, q_nope, q_pe, kv_c, k_pe, positions, *a, **kw):
            d = kw.get("num_decode_tokens")
            d = positions.shape[0] if d is None else d
            shifted = positions.clone()
            shifted[:d] += 1
            return orig_prologue(spec, q_nope, q_pe, kv_c, k_pe, shifted, *a, **kw)

        plugin._prologue = off_by_one
    elif inject == "epilogue_scale_shift":
        _shift_epilogue_scales()
    elif inject not in ("", "none") and not noise:
        raise ValueError(f"unknown injection {inject!r}")

    if capture:
        for _, w in layers:
            name = w.mla_attn.layer_name
            _log["captures"][name] = []

            def hook(mod, inp, out, _name=name):
                # real steps only: a dummy batch (no attention metadata; vLLM runs them e.g. to
                # keep tensor-parallel ranks in step) is not part of the comparison, and whether
                # one happens is up to the engine's timing
                from vllm.forward_context import get_forward_context, is_forward_context_available

                if (
                    not is_forward_context_available()
                    or get_forward_context().attn_metadata is None
                ):
                    return
                _log["captures"][_name].append(out.detach().float().cpu().clone())

            w.register_forward_hook(hook)


def _shift_epilogue_scales() -> None:
    """Plant ``epilogue_scale_shift``: after each epilogue step that hands o_proj FP8 codes, its
    group scales are rolled by one group along each token (the codes stay right, so only the
    handoff's scale layout is wrong: what a stride or group-index slip would do). A step with
    bf16 output is left alone; the plugin imports the step function at each call, so this
    reaches it in eager mode."""
    from fusemla.ops.epilogue import api

    orig = api.mla_epilogue_step

    def shifted(spec, attn_out, *, out=None, scale_out=None):
        res = orig(spec, attn_out, out=out, scale_out=scale_out)
        if isinstance(res, tuple):
            s = res[1]
            s.copy_(s.roll(1, dims=-1))
        return res

    api.mla_epilogue_step = shifted


def _perturbed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * (1 + eps * u)``, u uniform in [-1, 1] (fresh per call, CUDA-graph safe)."""
    u = torch.rand(x.shape, device=x.device, dtype=torch.float32) * 2 - 1
    return (x.float() * (1 + eps * u)).to(x.dtype)


# kernel-name fragments counted by fusemla_profile (the GPU kernels of the MLA prologue paths)
KERNEL_KEYS = {
    "fusemla_prologue": "mla_prologue_kernel",  # fusemla's fused kernel
    "fusemla_epilogue": "mla_epilogue_kernel",  # fusemla's W_UV epilogue (FUSEMLA_VLLM_EPILOGUE)
    "vllm_cache_write": "concat_and_cache_mla",  # vLLM's KV-cache write
    "vllm_rotary": "rotary_embedding",  # vLLM's RoPE CUDA kernel (custom-op path)
}
_prof: dict = {}


def cuda_kernel_times(prof) -> dict[str, list]:
    """A finished ``torch.profiler.profile``'s CUDA kernels: name -> [count, total µs]."""
    out: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            c = out.setdefault(e.name, [0, 0.0])
            c[0] += 1
            c[1] += float(e.time_range.elapsed_us())
    return out


class FuseMLATestExtension:
    """Methods added to vLLM's worker (``self`` is the worker)."""

    def fusemla_setup(self, inject: str = "none", capture: bool = False) -> str:
        layers = _worker_layers(self.model_runner)
        _install(layers, inject, capture)
        return type(layers[0][1]).__name__

    def fusemla_backend(self) -> dict:
        """The attention backend, block size and cache dtype vLLM chose for the MLA layers (the
        model's first; ``layers`` counts the drafter's too)."""
        layers = _worker_layers(self.model_runner)
        a = layers[0][1].mla_attn
        kv = a.kv_cache
        return {
            "backend": a.attn_backend.get_name(),
            "kv_cache_dtype": a.kv_cache_dtype,
            "block_size": int(kv.shape[1]) if kv.dim() == 3 else None,
            "cache_shape": list(kv.shape),
            "layers": len(layers),
        }

    def fusemla_profile(self, what: str) -> dict | None:
        """``start``: torch profiler on (CUDA activity); ``stop``: per key of
        :data:`KERNEL_KEYS` the number of kernels and their GPU time, and the step total."""
        if what == "start":
            if not torch.cuda.is_available():
                return None
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            _prof["p"] = profile(activities=[ProfilerActivity.CUDA])
            _prof["p"].__enter__()
            return None
        p = _prof.pop("p", None)
        if p is None:
            return None
        torch.cuda.synchronize()
        p.__exit__(None, None, None)
        counts = {k: 0 for k in KERNEL_KEYS}
        times = {k: 0.0 for k in KERNEL_KEYS}
        total_n, total_us = 0, 0.0
        for name, (n, us) in cuda_kernel_times(p).items():
            total_n += n
            total_us += us
            for k, frag in KERNEL_KEYS.items():
                if frag in name:
                    counts[k] += n
                    times[k] += us
        return {
            "counts": counts,
            "us": {k: round(v, 2) for k, v in times.items()},
            "kernels": total_n,
            "kernel_us": round(total_us, 2),
        }

    def fusemla_collect(self, out_dir: str) -> dict:
        from fusemla.integrations import vllm as plugin

        layers = _worker_layers(self.model_runner)
        rank = int(getattr(self, "rank", 0))
        arrays = {}
        for _, w in layers:
            # the cache rows that hold anything (the caches were zeroed before the run): the
            # whole cache is ~1 GiB here
            a = w.mla_attn
            flat = a.kv_cache.detach().reshape(-1, a.kv_cache.shape[-1])
            used = torch.nonzero(flat.view(torch.uint8).reshape(flat.shape[0], -1).any(1))[:, 0]
            arrays[f"cache/{a.layer_name}"] = flat[used].float().cpu().numpy()
            arrays[f"slots/{a.layer_name}"] = used.cpu().numpy()
        for name, outs in _log["captures"].items():
            for i, t in enumerate(outs):
                arrays[f"out/{name}/{i}"] = t.numpy()
        # each (layer, slot) must be written exactly once over the run
        per_layer: dict[str, list] = {}
        writers: dict[str, int] = {}
        for name, who, slots in _log["writes"]:
            per_layer.setdefault(name, []).append(slots[slots >= 0])
            writers[who] = writers.get(who, 0) + int((slots >= 0).sum())
        dup = {}
        rows = {}
        for name, parts in per_layer.items():
            s = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            rows[name] = int(s.size)
            dup[name] = int(s.size - np.unique(s).size)
        summary = {
            "rank": rank,
            "wrapper": type(layers[0][1]).__name__,
            "plugin_stats": plugin.stats(),
            "kernel_launches": _log["kernel"],
            "reference_calls": _log["reference"],
            "rows_written": rows,
            "rows_written_twice": dup,
            "rows_by_writer": writers,
            "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
        }
        os.makedirs(out_dir, exist_ok=True)
        np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **arrays)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(summary, f, indent=1, sort_keys=True)
        return summary


__all__ = ["FuseMLATestExtension"]
