"""benchmarks/vllm_depth.py's ``--deadline-s``: a pair that would outlast a device lease runs
fewer cells in both engines, never all of them in one engine and half in the other."""

import argparse
import json
import time

import pytest

import benchmarks.vllm_depth as vd


def test_a_cell_fits_by_its_estimate():
    assert vd.cell_fits(100.0, 0.0, 500.0)  # no limit
    assert vd.cell_fits(100.0, 120.0, None)  # nothing measured yet: the first cell runs
    assert vd.cell_fits(100.0, 200.0, 100.0)  # 100 + 100 = 200: ends on time
    assert not vd.cell_fits(100.0, 199.0, 100.0)


def test_cell_cost_reads_the_decode_step_and_the_fixed_cost():
    # 3 repeats: short calls 1 s, long calls 1.3-6.4 s; the cell's TPOT median 12 ms
    walls = [[1.0, 2.28, 0.0], [1.0, 2.536, 0.0], [1.0, 7.4, 0.0]]
    cell = {"median_ms": 12.0, "walls_s": walls}
    c = vd.cell_cost(8, 30.0, 1.0, [cell])
    assert c["batch"] == 8 and c["step_s"] == pytest.approx(0.012)
    assert c["fixed_s"] == pytest.approx(30.0 - (3.0 + 2.28 + 2.536 + 7.4) - 1.0)
    assert vd.cell_cost(8, 1.0, 1.0, [cell])["fixed_s"] == 0.0  # never negative
    # two sampling modes: one profile prefill each, the slower mode's step
    c2 = vd.cell_cost(8, 40.0, 1.0, [cell, dict(cell, median_ms=15.0)])
    assert c2["fixed_s"] == pytest.approx(40.0 - 2 * (3.0 + 2.28 + 2.536 + 7.4) - 2.0)
    assert c2["step_s"] == pytest.approx(0.015)


def test_cell_estimate_prices_prefill_and_decode_apart():
    """The H200 TP8 lease of 991c82e: after 8 x 1000 (decode step ~12.8 ms) and 1 x 4000, the
    prefill-bound 32 x 4000 (warm-up ~4.1 s, ~58 s in e8032df) must not be priced as the old
    ratio rule did (~292 s), nor below what it takes."""
    assert vd.cell_estimate(4.1, 32, [], 5, 128) is None  # the first cell always runs
    seen = [
        {"batch": 8, "step_s": 0.0128, "fixed_s": 3.0},
        {"batch": 1, "step_s": 0.0077, "fixed_s": 2.0},
    ]
    est = vd.cell_estimate(4.1, 32, seen, 5, 128)
    assert 58.0 < est < 120.0
    # B = 32 priced at the slowest of the B = 8 step x 2 and the B = 1 step x sqrt(32); a
    # smaller B at the slowest step seen, unscaled
    assert est == pytest.approx(1.25 * (11 * 4.1 + 5 * 128 * 0.0077 * 32**0.5) + 3.0)
    assert vd.cell_estimate(4.1, 32, seen[:1], 5, 128) == pytest.approx(
        1.25 * (11 * 4.1 + 5 * 128 * 0.0128 * 2) + 3.0
    )
    assert vd.cell_estimate(0.3, 1, seen, 5, 128) == pytest.approx(
        1.25 * (11 * 0.3 + 5 * 128 * 0.0128) + 3.0
    )
    # two sampling modes cost twice the calls, the fixed cost once (it is measured per cell)
    assert vd.cell_estimate(4.1, 32, seen, 5, 128, modes=2) == pytest.approx(2 * (est - 3.0) + 3.0)


def test_completed_cells_once_each_in_order():
    res = {
        "cells": [
            {"batch": 8, "context": 1000, "sampling": "greedy"},
            {"batch": 8, "context": 1000, "sampling": "seeded"},
            {"batch": 1, "context": 4000, "sampling": "greedy"},
        ]
    }
    assert vd.completed_cells(res) == ["8x1000", "1x4000"]
    assert vd.completed_cells({}) == []


def _pair_args(tmp_path, deadline_s, order="on,off"):
    return argparse.Namespace(
        out_dir=str(tmp_path), shard="smoke", order=order, tag="t", batches=[1], context=16,
        cells=["1x16", "128x16", "2x16"], repeats=1, short=2, long=4, sampling=["seeded"],
        profile_steps=0, kv_cache_dtype="auto", max_model_len=256, max_num_seqs=0,
        cache_root=None, deadline_s=deadline_s, later_start_s=240.0,
    )  # fmt: skip


@pytest.fixture
def engines(monkeypatch):
    """Each engine process replaced by one that 'runs' the cells it is given except 128x16
    (too long for its --stop-at, as a real engine would judge it) and writes its JSON."""
    calls = []

    def fake_call(cmd, env=None, stdout=None, stderr=None):
        argv = cmd[cmd.index("engine") + 1 :]
        cells = argv[argv.index("--cells") + 1 : argv.index("--repeats")]
        stop_at = float(argv[argv.index("--stop-at") + 1])
        calls.append(
            {
                "variant": argv[argv.index("--variant") + 1],
                "cells": cells,
                "stop_at": stop_at,
                "later": int(argv[argv.index("--later-engines") + 1]),
                "later_start_s": float(argv[argv.index("--later-start-s") + 1]),
            }
        )
        ran = [c for c in cells if not (stop_at and c == "128x16")]
        res = {
            "variant": calls[-1]["variant"],
            "engine_start_s": 0.0,
            "cells": [
                {"batch": int(c.split("x")[0]), "context": int(c.split("x")[1])} for c in ran
            ],
        }
        out = argv[argv.index("--out") + 1]
        with open(out, "w") as f:
            json.dump(res, f)
        return 0

    monkeypatch.setattr(vd.subprocess, "call", fake_call)
    monkeypatch.setattr(vd.os, "system", lambda cmd: 0)
    return calls


def test_the_second_engine_runs_what_the_first_ran(tmp_path, engines):
    vd.pair_main(_pair_args(tmp_path, 1000.0))
    first, second = engines
    assert first["cells"] == ["1x16", "128x16", "2x16"]
    assert second["cells"] == ["1x16", "2x16"]  # the skipped cell is skipped in both
    # the first sizes its share once up (first_engine_stop), knowing one engine follows;
    # the last may use the whole deadline
    assert first["later"] == 1 and second["later"] == 0
    assert first["later_start_s"] == second["later_start_s"] == 240.0
    assert first["stop_at"] == pytest.approx(second["stop_at"], abs=1e-6)
    assert first["stop_at"] - 1000.0 == pytest.approx(time.time(), abs=60.0)


def test_three_engines_the_middle_leaves_the_last_its_start_and_the_cells(tmp_path, engines):
    vd.pair_main(_pair_args(tmp_path, 1000.0, order="off,on,epi"))
    first, middle, last = engines
    assert [e["later"] for e in engines] == [2, 0, 0]
    # the fake engine takes no time: the first engine's cell time is ~0
    assert last["stop_at"] - middle["stop_at"] == pytest.approx(240.0, abs=5.0)
    assert first["stop_at"] == pytest.approx(last["stop_at"], abs=1e-6)


def test_the_first_engine_keeps_an_even_share_of_what_its_start_left():
    # 13ad969 on the H200: up 357 s into a 750 s deadline, one engine to follow
    assert vd.first_engine_stop(357.0, 750.0, 1, 240.0) == pytest.approx(357.0 + 76.5)
    # two engines to follow: (750 - 357 - 480) < 0, no time left: only its first cell runs
    assert vd.first_engine_stop(357.0, 750.0, 2, 240.0) == 357.0
    assert vd.first_engine_stop(100.0, 1000.0, 2, 150.0) == pytest.approx(100.0 + 200.0)
    assert vd.first_engine_stop(357.0, 0.0, 1, 240.0) == 0.0  # no deadline
    assert vd.first_engine_stop(357.0, 750.0, 0, 240.0) == 750.0  # alone: the whole of it
    # an engine after it: the end less what the ones still to come need
    assert vd.later_engine_stop(750.0, 0, 240.0, 76.5) == 750.0
    assert vd.later_engine_stop(1000.0, 1, 150.0, 200.0) == 650.0
    assert vd.later_engine_stop(0.0, 1, 150.0, 200.0) == 0.0


def test_no_deadline_runs_every_cell_in_every_engine(tmp_path, engines):
    vd.pair_main(_pair_args(tmp_path, 0.0))
    assert [c["cells"] for c in engines] == [["1x16", "128x16", "2x16"]] * 2
    assert [c["stop_at"] for c in engines] == [0.0, 0.0]


@pytest.mark.parametrize("deadline_s", [0.0, 1000.0, 200.0])
def test_end_at_caps_the_deadline(tmp_path, engines, deadline_s):
    """--end-at (a lease's end) bounds the pair as a deadline would, whichever comes first; the
    second engine then runs only what the first ran, as under --deadline-s."""
    end_at = time.time() + 500.0
    args = _pair_args(tmp_path, deadline_s)
    args.end_at, args.later_start_s = end_at, 60.0
    vd.pair_main(args)
    first, second = engines
    want = min(end_at, time.time() + deadline_s) if deadline_s else end_at
    assert second["stop_at"] == pytest.approx(want, abs=5.0)
    assert first["later"] == 1
    assert second["cells"] == ["1x16", "2x16"]


def test_a_pair_whose_starts_would_not_fit_starts_no_engine(tmp_path, engines):
    args = _pair_args(tmp_path, 0.0)
    args.end_at = time.time() + 2 * 240.0 - 30.0  # two starts of 240 s do not fit
    vd.pair_main(args)
    assert engines == []
    args.end_at = time.time() + 2 * 240.0 + 30.0
    vd.pair_main(args)
    assert len(engines) == 2


@pytest.mark.parametrize("shard,start_s", [("tp8pp2", 90.0), ("ep8pp2", 150.0), ("tp8", 240.0)])
def test_a_pair_takes_its_shards_later_start_by_default(tmp_path, engines, shard, start_s):
    """No --later-start-s: the shard's own (vd.LATER_START_S; the H100's half-depth stages
    start in a fraction of the full-depth 240 s). 4698b24's lease: three tp8pp2 engines with
    324 s left were refused at 3 x 240 s; at the shard's 90 s they start, and the engines are
    told the same figure."""
    args = _pair_args(tmp_path, 0.0, order="on,epi-all,epi")
    args.shard, args.later_start_s = shard, None
    args.end_at = time.time() + 3 * start_s - 30.0  # three starts do not fit
    vd.pair_main(args)
    assert engines == []
    args.end_at = time.time() + 3 * start_s + 30.0
    vd.pair_main(args)
    assert len(engines) == 3 and {e["later_start_s"] for e in engines} == {start_s}
    # one given: that one, whatever the shard
    engines.clear()
    args.later_start_s, args.end_at = 60.0, time.time() + 3 * 60.0 + 30.0
    vd.pair_main(args)
    assert len(engines) == 3 and {e["later_start_s"] for e in engines} == {60.0}


def test_a_first_engine_that_ran_nothing_ends_the_pair(tmp_path, engines, monkeypatch):
    args = _pair_args(tmp_path, 1000.0)
    args.cells = ["128x16"]
    vd.pair_main(args)
    assert len(engines) == 1  # no lone second engine


def test_the_first_cell_runs_only_if_its_floor_fits():
    """eee87b0's EP8 lease: warm-up 17.9 s, 5 repeats, ~137 s of the off engine's share left;
    the cell took 228 s. Its floor (10 calls at 0.9x the warm-up) would have skipped it."""
    floor = vd.cell_floor(17.87, 5)
    assert floor == pytest.approx(0.9 * 10 * 17.87)
    assert floor < 228.0  # below what the cell took
    assert not vd.cell_fits(0.0, 137.0, floor)
    assert vd.cell_floor(17.87, 5, modes=2) == pytest.approx(2 * floor)
    # the TP8 cells of the same lease: each floor below what the cell took
    for warm_s, took_s in [(5.5168, 68.5), (4.0659, 65.0), (0.1801, 9.2), (1.2948, 32.1)]:
        assert vd.cell_floor(warm_s, 5) < took_s


def test_a_later_engine_that_could_not_run_the_first_cell_is_not_started(
    tmp_path, engines, monkeypatch
):
    """After the first engine, what is left must hold the later engine's start and the first
    engine's first cell (its took_s in cell_times), else the later engine does not start."""
    real = vd.subprocess.call

    def slow_first(cmd, **kw):  # the first engine's first cell took 300 s
        rc = real(cmd, **kw)
        out = cmd[cmd.index("--out") + 1]
        res = json.loads(open(out).read())
        res["cell_times"] = [{"cell": "1x16", "estimated_s": None, "took_s": 300.0}]
        with open(out, "w") as f:
            json.dump(res, f)
        return rc

    monkeypatch.setattr(vd.subprocess, "call", slow_first)
    args = _pair_args(tmp_path, 0.0)
    args.later_start_s = 100.0
    args.end_at = time.time() + 350.0  # two starts fit (200 s); a start and the cell (400) not
    vd.pair_main(args)
    assert len(engines) == 1
    args.end_at = time.time() + 450.0
    vd.pair_main(args)
    assert len(engines) == 3  # this pair's two
