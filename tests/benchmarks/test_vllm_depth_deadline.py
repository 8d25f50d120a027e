"""benchmarks/vllm_depth.py's ``--deadline-s``: a pair that would outlast a device lease runs
fewer cells in both engines, never all of them in one engine and half in the other."""

import argparse
import json

import pytest

import benchmarks.vllm_depth as vd


def test_a_cell_fits_by_the_largest_ratio_seen():
    assert vd.cell_fits(100.0, 0.0, 50.0, 9.0)  # no limit
    assert vd.cell_fits(100.0, 120.0, 50.0, None)  # nothing measured yet: the first cell runs
    assert vd.cell_fits(100.0, 200.0, 10.0, 10.0)  # 100 + 100 = 200: ends on time
    assert not vd.cell_fits(100.0, 199.0, 10.0, 10.0)


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
        cache_root=None, deadline_s=deadline_s,
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
            {"variant": argv[argv.index("--variant") + 1], "cells": cells, "stop_at": stop_at}
        )
        ran = [c for c in cells if not (stop_at and c == "128x16")]
        res = {
            "variant": calls[-1]["variant"],
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
    assert 0 < first["stop_at"] < second["stop_at"]
    assert second["stop_at"] - first["stop_at"] == pytest.approx(500.0, abs=5.0)


def test_no_deadline_runs_every_cell_in_every_engine(tmp_path, engines):
    vd.pair_main(_pair_args(tmp_path, 0.0))
    assert [c["cells"] for c in engines] == [["1x16", "128x16", "2x16"]] * 2
    assert [c["stop_at"] for c in engines] == [0.0, 0.0]


def test_a_first_engine_that_ran_nothing_ends_the_pair(tmp_path, engines, monkeypatch):
    args = _pair_args(tmp_path, 1000.0)
    args.cells = ["128x16"]
    vd.pair_main(args)
    assert len(engines) == 1  # no lone second engine
