"""Test instrumentation for the vLLM plugin, run inside vLLM's workers (never used in serving).

Passed to vLLM as ``worker_extension_cls="fusemla.integrations.vllm_testing.FuseMLATestExtension"``
and driven through ``LLM.collective_rpc``: it works whether the workers share the test driver's
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TP=1) or not (TP=2). It

- logs every KV-cache write (vLLM's ``impl.do_kv_cache_update``, fusemla's kernel launch and
  fusemla's PyTorch reference) as (layer, slots), so a test can check that each token's row is
  written exactly once;
- counts Triton kernel launches (``fusemla.ops.prologue.launch.launch``) vs the reference;
- records each MLA layer's output per step (forward hooks; eager mode only);
- zeroes the KV caches before the run and dumps them after it;
- can inject the bugs the tests must catch: ``double_rope`` (the prologue's inputs are rotated
  before the kernel rotates them again) and ``double_write`` (vLLM's own cache write also runs
  for the tokens fusemla writes).

Importing this module imports vLLM only inside the methods.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

_log: dict = {"writes": [], "kernel": 0, "reference": 0, "captures": {}}
_installed = False


def _layer_modules(model):
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, MultiHeadLatentAttentionWrapper)]


def _install(model, inject: str, capture: bool) -> None:
    global _installed
    if _installed:
        return
    _installed = True
    import fusemla.ops.prologue.launch as launch_mod
    import fusemla.reference.prologue as ref_mod
    from fusemla.integrations import vllm as plugin

    layers = _layer_modules(model)
    by_ptr = {}
    for _, w in layers:
        a = w.mla_attn
        by_ptr[a.kv_cache.data_ptr()] = a.layer_name
        a.kv_cache.zero_()

        def logged(kv_c, k_pe, kv_cache, slot_mapping, *rest, _orig=a.impl.do_kv_cache_update,
                   _name=a.layer_name):
            _log["writes"].append((_name, "vllm", slot_mapping.detach().cpu().long().numpy().copy()))
            return _orig(kv_c, k_pe, kv_cache, slot_mapping, *rest)

        a.impl.do_kv_cache_update = logged

    def record(args, who):
        name = by_ptr.get(args.kv_cache.data_ptr(), "?")
        _log["writes"].append((name, who, args.slot_mapping.detach().cpu().long().numpy().copy()))

    orig_launch = launch_mod.launch

    def counted_launch(args, cfg=None):
        _log["kernel"] += 1
        record(args, "kernel")
        return orig_launch(args, cfg)

    launch_mod.launch = counted_launch
    orig_ref = ref_mod.prologue_into

    def counted_ref(args):
        _log["reference"] += 1
        record(args, "reference")
        return orig_ref(args)

    ref_mod.prologue_into = counted_ref

    if inject == "double_rope":
        orig_prologue = plugin._prologue

        def double_rope(q_nope, q_pe, kv_c, k_pe, w, positions, cos, sin, *a, **kw):
            from fusemla.rope import apply_rope

            c, s = cos[positions.long()].float(), sin[positions.long()].float()
            q_pe = apply_rope(q_pe, c[:, None], s[:, None], kw["is_neox"]).to(q_pe.dtype)
            k_pe = apply_rope(k_pe, c, s, kw["is_neox"]).to(k_pe.dtype)
            return orig_prologue(q_nope, q_pe, kv_c, k_pe, w, positions, cos, sin, *a, **kw)

        plugin._prologue = double_rope
    elif inject == "double_write":
        orig_fused = plugin._LayerState.fused_path

        def double_write(self, q, kv_c, k_pe, positions, output, md, slots, kv_cache):
            n = int(md.num_actual_tokens)
            _, k_r = self.vllm_rope(positions[:n], q[:n], k_pe[:n])
            self.vllm_cache_write(kv_c[:n], k_r, kv_cache, slots[:n])
            return orig_fused(self, q, kv_c, k_pe, positions, output, md, slots, kv_cache)

        plugin._LayerState.fused_path = double_write
    elif inject not in ("", "none"):
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

                if (not is_forward_context_available()
                        or get_forward_context().attn_metadata is None):
                    return
                _log["captures"][_name].append(out.detach().float().cpu().clone())

            w.register_forward_hook(hook)


class FuseMLATestExtension:
    """Methods added to vLLM's worker (``self`` is the worker)."""

    def fusemla_setup(self, inject: str = "none", capture: bool = False) -> str:
        model = self.model_runner.model
        _install(model, inject, capture)
        return type(_layer_modules(model)[0][1]).__name__

    def fusemla_collect(self, out_dir: str) -> dict:
        from fusemla.integrations import vllm as plugin

        model = self.model_runner.model
        rank = int(getattr(self, "rank", 0))
        arrays = {}
        for _, w in _layer_modules(model):
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
            "wrapper": type(_layer_modules(model)[0][1]).__name__,
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
