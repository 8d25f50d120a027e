"""benchmarks/vllm_depth.py's grid: every committed off/on pair placed in the full-depth grid's cells,
judged on the engine core's decode step, with the orders still missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.vllm_depth as vd
from benchmarks.vllm_depth import GRID, grid, pairs_of, verdict

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _cell(batch, context, medians, sampling="seeded"):
    return {
        "batch": batch,
        "context": context,
        "sampling": sampling,
        "core_step": [{"median_ms": x} for x in medians],
        "core_step_median_ms": sorted(medians)[len(medians) // 2],
    }


def _run(variant, cells, heads=16, kv="auto", fused=61):
    return {
        "variant": variant,
        "config": {"num_attention_heads": heads},
        "engine": {"attention": {"kv_cache_dtype": kv}},
        "plugin_after_start": {"layers_fused": fused} if variant != "off" else {},
        "cells": cells,
    }


def _file(tmp_path, name, commit, runs):
    p = tmp_path / name
    p.write_text(json.dumps({"commit": commit, "runs": runs}))
    return p


@pytest.mark.parametrize(
    "off,on,want",
    [
        ([10.0, 10.1, 10.2], [9.0, 9.1, 9.2], "faster"),  # ranges disjoint
        ([10.0, 11.0, 12.0], [9.9, 10.9, 11.9], "faster"),  # overlap, every repeat faster
        ([10.0, 11.0, 12.0], [10.1, 10.9, 12.0], "within spread"),
        ([10.0, 11.0, 12.0], [10.1, 11.1, 12.1], "slower"),  # every repeat slower
        ([10.0, 10.1], [10.5, 10.6], "slower"),
        ([], [9.0], "no decode-step time"),
    ],
)
def test_verdict(off, on, want):
    assert verdict(_cell(1, 1000, off) if off else {}, _cell(1, 1000, on)) == want


def test_pairs_know_which_engine_ran_first_and_skip_other_variants(tmp_path):
    a = _file(
        tmp_path,
        "a.json",
        "aaaaaaa",
        [
            _run("on", [_cell(1, 1000, [9.0, 9.1]), _cell(32, 4000, [20.0, 20.1])]),
            _run("off", [_cell(1, 1000, [10.0, 10.1])]),  # 32 x 4000 not run: no pair
        ],
    )
    b = _file(
        tmp_path,
        "b.json",
        "bbbbbbb (+ a note)",
        [
            _run("epi", [_cell(1, 1000, [8.0, 8.1])]),
            _run("off", [_cell(1, 1000, [10.0, 10.1])]),
            _run("on", [_cell(1, 1000, [10.3, 10.4])]),
            _run("on-x", [_cell(1, 1000, [10.0, 10.1])], fused=0),
        ],
    )
    rows = pairs_of([a, b, tmp_path / "missing.json"])
    assert [(r["commit"], r["variant"], r["first"], r["fused"], r["verdict"]) for r in rows] == [
        ("aaaaaaa", "on", "on", True, "faster"),
        ("bbbbbbb", "on", "off", True, "slower"),
        ("bbbbbbb", "on-x", "off", False, "within spread"),
    ]
    assert rows[0]["change_pct"] == pytest.approx(-10.0, abs=0.6)
    text = grid(rows)
    (line,) = [x for x in text.splitlines() if x.startswith("| tp8 | auto | 1 | 1000 |")]
    assert "aaaaaaa on first" in line and "bbbbbbb off first" in line
    assert "fallback: bbbbbbb on-x within spread" in line
    assert line.endswith("| yes | yes |")
    (line,) = [x for x in text.splitlines() if x.startswith("| tp8 | auto | 32 | 4000 |")]
    assert line.endswith("| - | **missing** | **missing** |")
    assert "1 faster, 1 slower; slower beyond the repeats' spread: b.json B=1" in text
    # the pairs that would fill the missing orders, per shard, cache and order
    todo = [x for x in text.splitlines() if x.startswith("to run: ")]
    assert "to run: --shard tp8 --order off,on --cells 8x1000 32x1000 128x1000 1x4000 32x4000 " in (
        "\n".join(todo) + " "
    )
    assert any(
        x.startswith(
            "to run: --shard tp8 --kv-cache-dtype fp8 --order on,off --cells 1x1000 32x1000"
        )
        for x in todo
    )
    assert not any("--cells 1x1000 " in x and "tp8 --order" in x for x in todo)  # 1 x 1000 has both
    assert len(todo) == 6  # 3 (shard, cache) x 2 orders, each missing somewhere


def test_an_off_on_off_lease_times_both_orders(tmp_path):
    """The on engine pairs with the off before it (off first) and the off after it (on first),
    each on the cells both ran; a second on engine pairs with its own neighbours only."""
    a = _file(
        tmp_path,
        "aba.json",
        "ccccccc",
        [
            _run("off", [_cell(128, 1000, [40.0, 40.1]), _cell(32, 4000, [36.0, 36.1])], 128),
            _run("on", [_cell(128, 1000, [39.0, 39.1]), _cell(32, 4000, [36.5, 36.6])], 128),
            _run("off", [_cell(128, 1000, [40.2, 40.3])], 128),  # the deadline cut 32 x 4000
            _run("on-vllm", [_cell(128, 1000, [40.2, 40.3])], 128, fused=0),
        ],
    )
    rows = pairs_of([a])
    assert [(r["variant"], r["batch"], r["first"], r["verdict"]) for r in rows] == [
        ("on", 128, "off", "faster"),
        ("on", 32, "off", "slower"),
        ("on", 128, "on", "faster"),
        ("on-vllm", 128, "off", "within spread"),
    ]
    assert rows[2]["off_ms"] == pytest.approx(40.3) and rows[0]["off_ms"] == pytest.approx(40.1)
    text = grid(rows)
    (line,) = [x for x in text.splitlines() if x.startswith("| ep8 | auto | 128 | 1000 |")]
    assert "ccccccc off first" in line and "ccccccc on first" in line
    assert line.endswith("| yes | yes |")
    (line,) = [x for x in text.splitlines() if x.startswith("| ep8 | auto | 32 | 4000 |")]
    assert line.endswith("| **missing** | yes |")


def test_a_pair_before_the_cells_kernel_change_is_listed_not_counted(tmp_path, monkeypatch):
    """KERNEL_SINCE: on the FP8-cache rows a pair of a commit older than the FP8-query
    prologue's change is marked and does not fill an order; the same pair on a bf16 row does."""
    runs = [
        _run("off", [_cell(1, 1000, [10.0, 10.1])], kv="fp8"),
        _run("on", [_cell(1, 1000, [9.0, 9.1])], kv="fp8"),
    ]
    old = _file(tmp_path, "old.json", "0ld0000", runs)
    bf16 = _file(
        tmp_path,
        "bf16.json",
        "0ld0000",
        [dict(r, engine={"attention": {"kv_cache_dtype": "auto"}}) for r in runs],
    )
    monkeypatch.setattr(vd, "descends", lambda commit, since: commit != "0ld0000")
    text = grid(pairs_of([old, bf16]))
    (line,) = [x for x in text.splitlines() if x.startswith("| tp8 | fp8 | 1 | 1000 |")]
    assert f"0ld0000 (before {vd.KERNEL_SINCE[('tp8', 'fp8')]}) off first" in line
    assert line.endswith("| **missing** | **missing** |")
    (line,) = [x for x in text.splitlines() if x.startswith("| tp8 | auto | 1 | 1000 |")]
    assert "(before" not in line and line.endswith("| **missing** | yes |")
    assert "to run: --shard tp8 --kv-cache-dtype fp8 --order off,on --cells 1x1000 32x1000" in text


def test_descends_reads_the_history():
    since = vd.KERNEL_SINCE[("tp8", "fp8")]
    if vd.descends("HEAD", since) is None:
        pytest.skip("no git history here")
    assert vd.descends("HEAD", since) is True
    assert vd.descends("4f5ec9c", since) is True  # the FP8 pair with the current prologue
    assert vd.descends("de9c208", since) is False  # the one before it
    assert vd.descends("nosuchcommit", since) is None


def test_the_committed_pairs():
    """The README's claim, checked on the committed files: no fused pair's decode step is
    slower than off beyond the repeats' spread, and every cell of the grid has a pair."""
    files = sorted(RESULTS.glob("h200_vllm033_depth_*.json"))
    rows = pairs_of(files)
    fused = [r for r in rows if r["fused"]]
    assert fused, files
    assert not [r for r in fused if r["verdict"] == "slower"]
    for (shard, kv), cells in GRID.items():
        for batch, ctx in cells:
            assert any(
                (r["shard"], r["kv"], r["batch"], r["context"]) == (shard, kv, batch, ctx)
                and r["verdict"] != "no decode-step time"
                for r in fused
            ), (shard, kv, batch, ctx)


def test_a_missing_order_says_the_device_time_it_needs(tmp_path):
    """grid's `to run` lines price a pair by what the shard's engines took before: two starts at
    the median start seen and, per engine, each cell's median time (cell_times)."""
    off = dict(_run("off", [_cell(1, 1000, [10.0, 10.1])]), engine_start_s=100.0)
    off["cell_times"] = [{"cell": "1x1000", "estimated_s": None, "took_s": 20.0}]
    on = dict(_run("on", [_cell(1, 1000, [9.0, 9.1])]), engine_start_s=300.0)
    on["cell_times"] = [{"cell": "1x1000", "estimated_s": None, "took_s": 30.0}]
    late = dict(_run("off", []), engine_start_s=140.0)  # a third start, no cells
    a = _file(tmp_path, "a.json", "aaaaaaa", [on, off, late])  # on first: plugin second missing
    timings = vd.timings_of([a, tmp_path / "missing.json"])
    assert timings[("tp8", "auto")] == {
        "start_s": [300.0, 100.0, 140.0],
        "cells": {"1x1000": [30.0, 20.0]},
    }
    need = vd.lease_need(timings[("tp8", "auto")], ["1x1000", "32x1000"])
    # 2 x (median start 140 + median cell 25); 32 x 1000 never timed
    assert need.startswith("~330 s: 2 starts of ~140 s (slowest seen 300)")
    assert "1x1000 ~25 s per engine" in need and "not yet timed: 32x1000" in need
    assert vd.lease_need(None, ["1x1000"]) == "no engine of this shard timed yet"
    out = grid(pairs_of([a]), timings)
    line = [x for x in out.splitlines() if x.startswith("to run: --shard tp8 --order off,on")]
    assert line and "--cells 1x1000" in line[0] and "(~" in line[0]
    assert "(~" not in grid(pairs_of([a]))  # no timings given: the arguments alone
