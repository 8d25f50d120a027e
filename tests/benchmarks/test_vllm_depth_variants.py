"""benchmarks/vllm_depth.py's engine variants (the environment each engine gets) and the
comparison table of every variant against plugin off."""

from __future__ import annotations

import pytest

from benchmarks.vllm_depth import compare, engine_env, variant_env


@pytest.mark.parametrize(
    "variant,env",
    [
        ("off", {"FUSEMLA_VLLM": "0"}),
        ("on", {"FUSEMLA_VLLM": "1"}),
        ("epi", {"FUSEMLA_VLLM": "1", "FUSEMLA_VLLM_EPILOGUE": "1"}),
        (
            "epi-stored",
            {"FUSEMLA_VLLM": "1", "FUSEMLA_VLLM_EPILOGUE": "1", "FUSEMLA_VLLM_W_UK": "stored"},
        ),
        (
            "epi-all-stored",
            {
                "FUSEMLA_VLLM": "1",
                "FUSEMLA_VLLM_EPILOGUE": "1",
                "FUSEMLA_VLLM_EPILOGUE_TOKENS": "all",
                "FUSEMLA_VLLM_W_UK": "stored",
            },
        ),
        ("fp8", {"FUSEMLA_VLLM": "1", "FUSEMLA_VLLM_W_UK": "fp8"}),
        (
            "on-vllm",
            {"FUSEMLA_VLLM": "1", "FUSEMLA_FUSED_DECODE": "0", "FUSEMLA_FUSED_PREFILL": "0"},
        ),
        ("on-flashmla", {"FUSEMLA_VLLM": "1", "FUSEMLA_VLLM_FORCE_BACKENDS": "FLASHMLA"}),
    ],
)
def test_variant_env(variant, env):
    assert variant_env(variant) == env


@pytest.mark.parametrize("variant", ["epilogue", "on-", "ep1", "OFF"])
def test_unknown_variant_raises(variant):
    with pytest.raises(ValueError, match="unknown part"):
        variant_env(variant)


def test_engine_env_drops_the_callers_fusemla_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEMLA_VLLM_EPILOGUE", "1")  # must not leak into an "on" engine
    env = engine_env("on", tmp_path, X="1")
    assert "FUSEMLA_VLLM_EPILOGUE" not in env
    assert env["FUSEMLA_VLLM"] == "1" and env["X"] == "1"
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path)


def _run(variant, ms, tokens):
    cell = {
        "batch": 1,
        "context": 1000,
        "sampling": "seeded",
        "median_ms": ms,
        "core_step_median_ms": ms,
        "token_hashes": [tokens],
        "profile": {"busy_us_per_step": ms * 1000},
    }
    return {"variant": variant, "config": {"num_attention_heads": 16}, "cells": [cell]}


def test_compare_puts_every_variant_against_off():
    runs = [_run("off", 10.0, [1, 2]), _run("on", 9.0, [1, 2]), _run("epi", 8.0, [1, 3])]
    rows = [line for line in compare(runs).splitlines() if line.startswith("| tp8")]
    assert len(rows) == 2
    epi, on = rows  # sorted by variant name
    assert "| epi |" in epi and "-20.0 %" in epi and "1/2" in epi
    assert "| on |" in on and "-10.0 %" in on and "2/2" in on


@pytest.mark.parametrize(
    "stats,shown",
    [
        ({"o_proj_quant_in_place": 1}, "o_proj quant in place"),
        ({"o_proj_quant_in_place_refused": 1}, "o_proj quant copied"),
        ({}, None),
    ],
)
def test_compare_says_how_the_fp8_handoff_quantized_the_other_rows(stats, shown):
    """An epilogue engine with the FP8 handoff: whether o_proj's quantization wrote the
    handoff's other rows in place or they were copied (two more kernels a layer on such a
    step), from the plugin's counters after start."""
    off, epi = _run("off", 10.0, [1, 2]), _run("epi-stored", 9.0, [1, 2])
    epi["plugin_after_start"] = {"layers_fused": 61, **stats}
    (row,) = [line for line in compare([off, epi]).splitlines() if line.startswith("| tp8")]
    assert "61/61" in row
    for text in ("o_proj quant in place", "o_proj quant copied"):
        assert (text in row) == (text == shown), row


def test_compare_pairs_the_repeats():
    """Repeat i against repeat i: the repeats' medians move together (the tokens, hence the
    MoE routing, change from repeat to repeat), so the ranges overlap while every pair says
    which engine was faster."""
    off, on = _run("off", 30.4, [1, 2]), _run("on", 30.2, [1, 2])
    off["cells"][0]["core_step"] = [{"median_ms": x} for x in (30.0, 31.0, 29.5)]
    on["cells"][0]["core_step"] = [{"median_ms": x} for x in (29.8, 30.7, 29.6)]
    (row,) = [line for line in compare([off, on]).splitlines() if line.startswith("| tp8")]
    assert "-0.300 to +0.100 ms (2/3 faster)" in row
    del on["cells"][0]["core_step"][2]  # repeats that do not pair: no column, not a guess
    (row,) = [line for line in compare([off, on]).splitlines() if line.startswith("| tp8")]
    assert "faster)" not in row


def test_pp2_shards_are_their_shards_first_pipeline_stage(tmp_path):
    """Half the TP8 (EP8) shard's layers at its per-layer shapes (it fits an 80 GB H100),
    labelled apart from the full-depth shard in every table (its steps are half as long)."""
    import json

    import benchmarks.vllm_depth as vd

    tp8, pp2 = vd.model_config("tp8"), vd.model_config("tp8pp2")
    assert pp2.pop("num_hidden_layers") == 31 and tp8.pop("num_hidden_layers") == 61
    assert pp2 == tp8
    cfg = json.loads((vd.write_model(tmp_path, "tp8pp2") / "config.json").read_text())
    assert vd._shard({"config": cfg}) == "tp8pp2"
    assert vd._shard({"config": vd.model_config("tp8")}) == "tp8"
    assert vd._shard({"config": {"num_attention_heads": 16}}) == "tp8"  # files before the key
    ep8, ep8pp2 = vd.model_config("ep8"), vd.model_config("ep8pp2")
    assert ep8pp2.pop("num_hidden_layers") == 31 and ep8.pop("num_hidden_layers") == 61
    assert ep8pp2 == ep8
    assert vd._shard({"config": vd.model_config("ep8pp2")}) == "ep8pp2"
    assert vd._shard({"config": vd.model_config("ep8")}) == "ep8"
