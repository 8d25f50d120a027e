"""The test worker's layer discovery (fusemla.testing.vllm_worker._worker_layers): the target
model's MLA layers and a drafter's, wherever the model runner keeps the drafter. No vLLM
needed: the MLA-layer filter is replaced by a marker."""

from types import SimpleNamespace

import pytest
import torch

from fusemla.testing import vllm_worker


class _Mla(torch.nn.Module):
    pass


def _model(n: int) -> torch.nn.Module:
    return torch.nn.Sequential(*(_Mla() for _ in range(n)), torch.nn.Linear(2, 2))


@pytest.fixture(autouse=True)
def _marker_filter(monkeypatch):
    def layers(model):
        return [(name, m) for name, m in model.named_modules() if isinstance(m, _Mla)]

    monkeypatch.setattr(vllm_worker, "_layer_modules", layers)


class _Wrapper:
    """A model wrapper that forwards attributes, not an nn.Module (the worker allows for one)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("attr", ["drafter", "speculator"])
@pytest.mark.parametrize("wrap", [False, True])
def test_drafter_layers_counted_where_the_runner_keeps_them(attr, wrap):
    target, draft = _model(3), _model(1)
    runner = SimpleNamespace(
        model=target, **{attr: SimpleNamespace(model=_Wrapper(draft) if wrap else draft)}
    )
    layers = vllm_worker._worker_layers(runner)
    assert len(layers) == 4
    assert {id(m) for _, m in layers} == {id(m) for m in (*target[:3], draft[0])}


def test_no_drafter_and_shared_modules_not_counted_twice():
    target = _model(3)
    assert len(vllm_worker._worker_layers(SimpleNamespace(model=target))) == 3
    # a drafter without a model of its own (n-gram), one whose model is the target's, and one
    # that shares the target's layers
    for draft in (SimpleNamespace(), SimpleNamespace(model=target)):
        runner = SimpleNamespace(model=target, drafter=draft, speculator=draft)
        assert len(vllm_worker._worker_layers(runner)) == 3
    shared = torch.nn.Sequential(target[0], _Mla())
    runner = SimpleNamespace(model=target, speculator=SimpleNamespace(model=shared))
    assert len(vllm_worker._worker_layers(runner)) == 4


def test_epilogue_scale_shift_rolls_only_the_fp8_scales(device, monkeypatch):
    """The planted epilogue bug (``epilogue_scale_shift``): after an FP8 step the codes are the
    epilogue's own and each token's group scales are its true scales rolled by one group
    (so o_proj would read every group with its neighbour's scale); a bf16 step is untouched."""
    import fusemla
    from fusemla.ops.epilogue import api

    monkeypatch.setattr(api, "mla_epilogue_step", api.mla_epilogue_step)  # undone after
    g = torch.Generator().manual_seed(7)
    H, L, V, N = 2, 64, 128, 3  # 2 heads x 128 = 2 groups of 128 per token
    w = torch.randn(H, L, V, generator=g).to(device, torch.bfloat16)
    x = torch.randn(N, H, L, generator=g).to(device, torch.bfloat16)
    fp8 = fusemla.epilogue_spec(w, out_dtype=torch.float8_e4m3fn)
    bf16 = fusemla.epilogue_spec(w)
    codes, scales = api.mla_epilogue_step(fp8, x)
    plain = api.mla_epilogue_step(bf16, x)
    vllm_worker._shift_epilogue_scales()
    codes_b, scales_b = api.mla_epilogue_step(fp8, x)
    assert torch.equal(codes_b.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(scales_b, scales.roll(1, dims=-1))
    assert not torch.equal(scales_b, scales)  # the groups' scales differ: the bug is visible
    assert torch.equal(api.mla_epilogue_step(bf16, x), plain)
