"""benchmarks/vllm_depth.py's kernel diff: which kernels one engine ran in place of another's, per
cell, read off the engines' own profiles (how the epilogue's crossover table is derived)."""

from __future__ import annotations

from pathlib import Path

import benchmarks.vllm_depth as vd

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _prof(*kernels):
    return {"top_kernels": [{"name": n, "per_step": c, "us_per_step": u} for n, c, u in kernels]}


def test_kernel_diff_finds_the_swap_and_orders_by_size():
    base = _prof(
        ("gemm", 305, 3500.0), ("bmm", 61, 200.0), ("quant", 235, 620.0), ("norm", 63, 530.0)
    )
    other = _prof(
        ("gemm", 305, 3502.0), ("epilogue", 61, 300.0), ("quant", 174, 495.0), ("norm", 63, 530.0)
    )
    rows = vd.kernel_diff(base, other, min_us=5.0)
    assert [r[0] for r in rows] == ["epilogue", "bmm", "quant"]  # gemm moved 2 us, norm not at all
    assert rows[0] == ("epilogue", 0, 0.0, 61, 300.0)
    assert rows[1] == ("bmm", 61, 200.0, 0, 0.0)
    # a changed call count is listed whatever the time moved
    rows = vd.kernel_diff(base, _prof(("gemm", 304, 3500.0)), min_us=1e9)
    assert {r[0] for r in rows} == {"gemm", "bmm", "quant", "norm"}


def test_kernels_table_reads_the_committed_9804a32_profile():
    """The engine profile behind configs._FUSE_TOKENS' 16-head FP8 entry: at B = 1 the epilogue
    took 6.69 us a layer where vLLM ran its W_UV bmm (3.31 us) and 61 fewer input quantizations
    (128.0 us per step, 2.10 us a layer)."""
    runs = vd.load_runs([RESULTS / "h200_vllm033_depth_tp8_9804a32.json"])
    text = vd.kernels_table(runs, "on", "epi")
    b1 = [
        line
        for line in text.splitlines()
        if line.startswith("| tp8 | 1 | 1000 | auto | seeded | 1 |")
    ]
    epi = next(line for line in b1 if "mla_epilogue_kernel" in line)
    assert "| 0, 0.0 | 61, 407.9 | +407.9 | - / 6.69 |" in epi
    bmm = next(line for line in b1 if "nvjet" in line)
    assert "| 61, 202.0 | 0, 0.0 | -202.0 | 3.31 / - |" in bmm
    quant = next(line for line in b1 if "per_token_group_quant" in line)
    assert "| -128.0 |" in quant
    # an engine the file lacks: a header and no rows
    assert len(vd.kernels_table(runs, "on", "epi-stored").splitlines()) == 2


def test_kernels_table_pairs_the_engines_of_two_jobs_in_order():
    """A file of two jobs (the same variants twice in one cell): the i-th base engine goes with
    the i-th other, each pair its own rows (n = 1, 2), none overwritten."""
    runs = vd.load_runs([RESULTS / "h100_vllm033_depth_tp8pp2_ead800d.json"])
    rows = [
        line
        for line in vd.kernels_table(runs, "on", "epi-all-stored").splitlines()
        if line.startswith("| tp8pp2 | 1 |") and "mla_epilogue_kernel" in line
    ]
    assert len(rows) == 2
    assert "| 1 | mla_epilogue_kernel |" in rows[0] and "- / 3.18 |" in rows[0]
    assert "| 2 | mla_epilogue_kernel |" in rows[1] and "- / 3.24 |" in rows[1]


def test_kernels_table_reads_the_committed_4698b24_profile():
    """The engine profile behind configs._FUSE_TOKENS' one-token span with vLLM's bf16 W_UV
    (16 heads, FP8 out): at B = 1 the epilogue took 3.74 us a layer where the prologue-only
    engine ran vLLM's W_UV bmm (3.40 us) and 31 more input quantizations; at B = 8 it took
    5.94 us against 3.53 us + the quantizations, not ahead (the table leaves 8 to vLLM)."""
    runs = vd.load_runs([RESULTS / "h100_vllm033_depth_tp8pp2_4698b24.json"])
    text = vd.kernels_table(runs, "on", "epi-all")

    def row(B, kernel):
        head = f"| tp8pp2 | {B} | 1000 | auto | seeded | 1 |"
        return next(x for x in text.splitlines() if x.startswith(head) and kernel in x)

    assert "| 0, 0.0 | 31, 116.0 | +116.0 | - / 3.74 |" in row(1, "mla_epilogue_kernel")
    assert "| 31, 105.3 | 0, 0.0 | -105.3 | 3.40 / - |" in row(1, "nvjet")
    assert "| 115, 309.1 | 84, 240.3 | -68.8 |" in row(1, "per_token_group_quant")
    assert "| 0, 0.0 | 31, 184.2 | +184.2 | - / 5.94 |" in row(8, "mla_epilogue_kernel")
    assert "| 31, 109.4 | 0, 0.0 | -109.4 | 3.53 / - |" in row(8, "nvjet")
    assert "| -68.1 |" in row(8, "per_token_group_quant")


def test_the_committed_fa9192d_engines_keep_32_to_64_tokens_with_vllm():
    """The engines behind dropping 32-64 tokens from configs._FUSE_TOKENS' span with vLLM's
    bf16 W_UV (16 heads, FP8 out): in both engine orders of fa9192d's lease the fused epilogue
    saved at most 0.4 us a layer at 32 and 64 tokens against vLLM's W_UV bmm + the input
    quantizations it skips (31 a step), and the decode step was slower in both orders at 32;
    at one token it saved over 1 us a layer. The table now fuses one token only."""
    from fusemla.ops.epilogue import configs

    runs = vd.load_runs([RESULTS / "h100_vllm033_depth_tp8pp2_fa9192d.json"])

    def cell(job, B):
        run = next(r for r in runs if r.get("job") == job)
        return next(c for c in run["cells"] if c["batch"] == B)

    pairs = {1: ("sp_0_0on", "sp_0_1epi"), 2: ("sq_0_1on", "sq_0_0epi")}  # on first, epi first

    def saved(B, n):  # us a layer: bmm + skipped quantizations - epilogue
        on, epi = (cell(job, B)["profile"] for job in pairs[n])
        swapped = ("nvjet", "per_token_group_quant", "mla_epilogue_kernel")
        rows = vd.kernel_diff(on, epi, min_us=1e9)  # the kernels whose call count changed
        return sum(au - bu for nm, ac, au, bc, bu in rows if any(k in nm for k in swapped)) / 31

    assert saved(1, 1) > 1.0
    for B in (32, 64):
        for n in (1, 2):  # on first, then epi first
            assert -0.2 < saved(B, n) < 0.4, (B, n, saved(B, n))

    for on, epi in pairs.values():
        assert cell(epi, 32)["core_step_median_ms"] > cell(on, 32)["core_step_median_ms"]
    spans = configs.fuse_token_spans(16, True, "cuda")
    assert configs.fuses_at(1, spans) and not any(configs.fuses_at(n, spans) for n in (32, 64))
