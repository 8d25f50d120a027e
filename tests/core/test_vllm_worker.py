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
