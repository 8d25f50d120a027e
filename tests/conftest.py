"""Test setup: ``--device=cpu`` (default; kernels run in Triton's interpreter at small dims) or
``--device=cuda`` (kernels compiled for the GPU, full DeepSeek-V3 dims)."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cpu: Triton interpreter, small dims (CI); cuda: the GPU, full dims",
    )


def pytest_configure(config):
    # Triton decides interpreter vs compiler when a kernel is decorated, so this must be set
    # before any test module imports fusemla's ops.
    if config.getoption("--device") == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--device") == "cpu":
        skip = pytest.mark.skip(reason="needs --device=cuda")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def device(pytestconfig) -> str:
    dev = pytestconfig.getoption("--device")
    if dev == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.exit("--device=cuda but torch sees no GPU", returncode=2)
    return dev


@pytest.fixture(scope="session")
def on_gpu(device) -> bool:
    return device == "cuda"


@pytest.fixture
def prologue_spy():
    """fusemla.testing.spy.PrologueSpy installed for the test: the fused launches (args, plans)
    and the reference prologue's calls and cache writes, in order; ``take()`` reads and resets."""
    from fusemla.testing.spy import PrologueSpy

    with PrologueSpy() as spy:
        yield spy
