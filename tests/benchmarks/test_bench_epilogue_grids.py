"""bench_epilogue's sweep grids: every config of every grid is one the epilogue's plan accepts
(the GEMV grid's token tiles below 16 and chunks across scale blocks included), so a lease's
sweep spends no time on configs refused at launch; a batch takes only its parts' token tiles."""

from __future__ import annotations

import pytest

from benchmarks.bench_epilogue import GRIDS, sweep_grid
from fusemla.ops.epilogue import configs


def _parts(name: str) -> list[dict]:
    return GRIDS[name] if isinstance(GRIDS[name], list) else [GRIDS[name]]


@pytest.mark.parametrize("name", sorted(GRIDS))
@pytest.mark.parametrize("smoke", [False, True])
def test_every_grid_config_passes_the_plans_check(name, smoke):
    grid = sweep_grid(name, smoke)
    assert grid, name
    kinds = {bool(p.get("gemv")) for p in _parts(name)}
    for cfg in grid:
        gemv = cfg.get("GEMV", False)
        assert gemv in kinds, cfg
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
    # one token: token tiles of one row only (B / 8 to B)
    assert {c["BLOCK_T"] for c in sweep_grid("gemv", False, 1)} == {1}


def test_the_tokens_grid_per_batch():
    """The tokens grid: GEMV's token tiles of B / 2 to B up to 16 tokens, both forms of a
    tile of several rows (3-D product, GEMV_ROWS) and one form of a one-row tile; one-token
    programs of a whole group from 2 tokens; the MMA's whole-latent chunks from 8 tokens."""
    two = sweep_grid("tokens", False, 2)
    assert {c["BLOCK_T"] for c in two} == {1, 2} and all(c.get("GEMV") for c in two)
    # a whole FP8 group per one-token program from 2 tokens, not at one (the B = 1 sweep's)
    assert any(c["BLOCK_V"] == 128 and c["BLOCK_T"] == 1 for c in two)
    assert not any(c["BLOCK_V"] == 128 for c in sweep_grid("tokens", False, 1))
    assert not any(c.get("GEMV_ROWS") for c in two if c["BLOCK_T"] == 1)
    rows = {c.get("GEMV_ROWS", False) for c in two if c["BLOCK_T"] == 2}
    assert rows == {False, True}
    eight = sweep_grid("tokens", False, 8)
    assert {c["BLOCK_T"] for c in eight if c.get("GEMV") and c["BLOCK_V"] < 128} == {4, 8}
    mma = [c for c in eight if not c.get("GEMV")]
    assert mma and {c["BLOCK_K"] for c in mma} == {512}
    big = sweep_grid("tokens", False, 64)
    assert big and not any(c.get("GEMV") for c in big)
    for B, n in ((1, 8), (2, 26), (8, 42), (32, 8)):  # a lease's budget: configs per kind
        grid = sweep_grid("tokens", False, B)
        kept = [c for c in grid if (512 // c["BLOCK_K"]) % c["SPLIT"] == 0]
        assert len(kept) == n, (B, len(kept))
