"""The run comparison's own logic (tests/vllm/harness.py) on synthetic runs: no vLLM needed.

The end-to-end tests are only as good as their judge: here, that a noise floor measured over the
judged run's steps is what the judged run is compared with, and that the tie margin a model's own
noise calls for lets a fused run flip what the noise flips and nothing wider.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def _run(tokens: dict, margins: dict, outs: dict | None = None) -> dict:
    """A run as harness.load returns it: tokens, margins, logprobs, token steps, captures."""
    arrays = {f"out/l0/{i}": np.asarray(v, dtype=np.float32) for i, v in (outs or {}).items()}
    return {
        "tokens": tokens,
        "margins": margins,
        "logprobs": {r: [{t: -1.0} for t in ts] for r, ts in tokens.items()},
        "token_steps": {r: list(range(1, len(ts) + 1)) for r, ts in tokens.items()},
        "ranks": [{"arrays": arrays}],
    }


def test_noise_tie_margin_allows_what_noise_flips_and_nothing_wider():
    ref = _run({"a": [1, 2, 3, 4], "b": [5, 6, 7]}, {"a": [20, 6, 30, 2], "b": [40, 40, 40]})
    noisy = _run({"a": [1, 9, 3, 4], "b": [5, 6, 7]}, ref["margins"])  # flips a margin-6 token
    tie = harness.noise_tie_margin(noisy, ref)
    assert 6 < tie < 6.01
    assert harness.noise_tie_margin(ref, ref) == harness.TIE_MARGIN  # no flip: the default
    same_flip = _run({"a": [1, 8, 3, 4], "b": [5, 6, 7]}, ref["margins"])
    wider_flip = _run({"a": [7, 2, 3, 4], "b": [5, 6, 7]}, ref["margins"])  # margin 20
    assert harness.token_problems(same_flip, ref) != []  # the bf16 threshold (4) refuses it
    assert harness.token_problems(same_flip, ref, margin=tie) == []
    assert harness.token_problems(wider_flip, ref, margin=tie) != []


def test_floor_over_the_judged_runs_steps():
    """Noise grows with the steps it compounds over: max_steps limits the floor to the steps
    the judged run compared, so a run that diverges early meets the floor of those steps."""
    ref_outs = {i: [1.0, 1.0] for i in range(6)}
    ref = _run({"a": [1] * 6}, {"a": [50] * 6}, ref_outs)
    noisy = _run({"a": [1] * 6}, ref["margins"], {i: [1.0 + 0.02 * i, 1.0] for i in range(6)})
    full = harness.deviation(noisy, ref)
    early = harness.deviation(noisy, ref, max_steps=2)
    assert full["steps_compared"] == 6 and early["steps_compared"] == 2
    assert abs(full["out"] - 0.10) < 1e-6 and abs(early["out"] - 0.02) < 1e-6


def test_narrowed_gpu_suite_keeps_the_planted_bug_on_its_model():
    """FUSEMLA_VLLM_GPU_MODELS narrows the judged models; the epi8 group's planted bugs stay on
    the model they were calibrated on, injected, with that model's own reference and noise runs
    (e5c4f82's narrowed run moved the RoPE one to the 128-head model, where it stays inside
    the judge)."""
    import os
    import subprocess

    code = (
        "import test_vllm_gpu as t\n"
        "s = {x.name: x for x in t.all_specs(tp2=False, groups={'epi8'})}\n"
        "bug = [x for n, x in s.items() if n.endswith('-epi8-bug-eager')]\n"
        "b = bug[0].shape\n"
        "sb = [x for n, x in s.items() if n.endswith('-epi8-scalebug-eager')]\n"
        "print(t.EPI8_MODELS, len(bug), b, bug[0].inject, f'{b}-off-eager' in s,\n"
        "      s[f'{b}-noise-eager'].inject.startswith('noise:'),\n"
        "      len(sb), sb[0].shape, sb[0].inject)\n"
    )
    env = {**os.environ, "FUSEMLA_VLLM_GPU_MODELS": "v3-h128-fp8", "FUSEMLA_VLLM_GPU_DRYRUN": ""}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == (
        "('v3-h128-fp8',) 1 v3-h16-fp8 rope_off_by_one True True 1 v3-h16-fp8 epilogue_scale_shift"
    ), out
