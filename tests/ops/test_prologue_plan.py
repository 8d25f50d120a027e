"""One decision, one place: the kernel launch runs exactly what
:func:`fusemla.ops.prologue.launch.plan` returned (grid, program counts, every constexpr), and
the plan says what it chose (formats, bucket, tiles, variant, PDL, interpreter upcasts)."""

from __future__ import annotations

import pytest
import torch

import fusemla
import fusemla.ops.prologue.launch as launch_mod
from fusemla.quant import quantize_fp8_weight
from fusemla.testing import DEEPSEEK_V3, SMALL_DIMS, make_inputs, stable_seed
from fusemla.testing.spy import KernelSpy, recorded_launch_plans

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize(
    "weights,kv,neox,N,D",
    [
        ("plain", "bf16", False, 5, 5),
        ("plain", "fp8", True, 9, 4),
        ("fp8", "bf16", False, 40, 40),
        ("fp8xfp8", "fp8", False, 6, 3),
        ("plain", "bf16", False, 4, 0),
    ],
)
def test_the_launch_runs_what_the_plan_returned(device, monkeypatch, weights, kv, neox, N, D):
    dims = dict(DEEPSEEK_V3 if device == "cuda" else SMALL_DIMS, H=4)
    g = torch.Generator().manual_seed(stable_seed("plan", weights, kv, N, D))
    inp = make_inputs(
        N,
        **dims,
        num_decode_tokens=D,
        kv_dtype=FP8 if kv == "fp8" else None,
        kv_scale="tensor",
        device=device,
        generator=g,
    )
    w = inp.w_uk_t if weights == "plain" else quantize_fp8_weight(inp.w_uk_t, per_head=True)
    spy = KernelSpy(launch_mod.mla_prologue_kernel)
    monkeypatch.setattr(launch_mod, "mla_prologue_kernel", spy)
    with recorded_launch_plans() as plans:
        inp.run(
            fusemla.mla_prologue,
            w_uk_t=w,
            is_neox=neox,
            act_quant="fp8" if weights == "fp8xfp8" else None,
        )
    assert len(plans) == len(spy.calls) == 1
    (grid, kw), pl = spy.calls[0], plans[0]
    assert grid == pl.grid == (pl.n_bmm + pl.n_rope_d + pl.n_rope_p + pl.n_cache,)
    for key, value in pl.constexprs.items():
        assert kw[key] == value, key
    assert (kw["n_bmm"], kw["n_rope_d"], kw["n_rope_p"]) == (pl.n_bmm, pl.n_rope_d, pl.n_rope_p)
    # what the plan says it chose
    assert pl.weight_format == ("plain" if weights == "plain" else "fp8")
    assert pl.tile_format == weights
    assert pl.bucket == ("small" if D <= 8 else "large" if D >= 512 else "medium")
    assert pl.constexprs["IS_NEOX"] is neox
    assert (pl.constexprs["KV_FP8"] != 0) == (kv == "fp8")
    assert (pl.constexprs["A_QUANT"] != 0) == (weights == "fp8xfp8")
    assert pl.constexprs["W_FMT"] == {"plain": 0, "fp8": 1, "fp8xfp8": 1}[weights]
    interp = pl.backend == "interpreter"
    assert pl.constexprs["DOT_FP32"] is interp and pl.constexprs["FIX_BF16"] is interp
    assert pl.constexprs["USE_PDL"] is pl.pdl and ("launch_pdl" in kw) is pl.pdl
    assert (pl.n_bmm == 0) == (D == 0) == (pl.bmm_items == 0)


def test_pdl_trigger_is_off_unless_asked(monkeypatch):
    """A PDL launch lets the next kernel start only when it completes unless
    FUSEMLA_PDL_TRIGGER asks for the early trigger; without PDL there is nothing to trigger;
    a bad value names the variable."""
    from fusemla import config
    from fusemla.errors import FuseMLAValueError
    from fusemla.ops.common import choose_pdl_trigger

    monkeypatch.delenv(config.PDL_TRIGGER_ENV, raising=False)
    assert choose_pdl_trigger(True) is False and choose_pdl_trigger(False) is False
    monkeypatch.setenv(config.PDL_TRIGGER_ENV, "1")
    assert choose_pdl_trigger(True) is True and choose_pdl_trigger(False) is False
    monkeypatch.setenv(config.PDL_TRIGGER_ENV, "sometimes")
    with pytest.raises(FuseMLAValueError, match="FUSEMLA_PDL_TRIGGER"):
        choose_pdl_trigger(True)
