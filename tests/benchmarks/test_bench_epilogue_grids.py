"""bench_epilogue's sweep grids: every config of every grid is one the epilogue's plan accepts
(the GEMV grid's token tiles below 16 and chunks across scale blocks included), so a lease's
sweep spends no time on configs refused at launch."""

from __future__ import annotations

import pytest

from benchmarks.bench_epilogue import GRIDS, sweep_grid
from fusemla.ops.epilogue import configs


@pytest.mark.parametrize("name", sorted(GRIDS))
@pytest.mark.parametrize("smoke", [False, True])
def test_every_grid_config_passes_the_plans_check(name, smoke):
    grid = sweep_grid(name, smoke)
    assert grid, name
    for cfg in grid:
        gemv = cfg.get("GEMV", False)
        assert gemv == bool(GRIDS[name].get("gemv")), cfg
        # a bf16 output and an FP8 one (group 128); block-FP8 W_UV's 128-row blocks: the
        # dot's chunks lie inside one (the sweep skips the others), GEMV's may span them
        configs.check(cfg, group=None, block_k=None)
        configs.check(cfg, group=128, block_k=128 if gemv or 128 % cfg["BLOCK_K"] == 0 else None)


def test_the_gemv_grid_has_token_tiles_below_the_mma_and_whole_latent_chunks():
    grid = sweep_grid("gemv", False)
    assert {c["BLOCK_T"] for c in grid} == {1, 2, 4, 8}
    assert 512 in {c["BLOCK_K"] for c in grid}  # DeepSeek's whole latent in one chunk
    with pytest.raises(ValueError, match="BLOCK_T"):
        configs.check(dict(grid[0], GEMV=False), group=None, block_k=None)
