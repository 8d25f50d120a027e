"""The fused epilogue under torch.compile, as the registered op ``fusemla::mla_epilogue``, and in
CUDA graphs.

- ``torch.library.opcheck`` of the op with the arguments :func:`pack_epilogue` makes of a
  prepared call (plain, per-head FP8 and block-FP8 weights; output in the activations' dtype
  and FP8 with column-major scales). torch's schema check compares tensors with ops FP8 has no
  kernel for (``"mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'``), so where an FP8
  tensor is among the arguments that one check is replaced by the same question asked directly:
  the op writes every byte of its ``outs`` and nothing else.
- ``torch.compile(fullgraph=True)`` of a step calling :func:`fusemla.mla_epilogue_step`: one
  graph for three batch sizes (``mark_dynamic`` on the tokens), the same bytes as eager, and
  the kernel launched for every call (the interpreter's, on the CPU: no silent fallback).
- CUDA graphs (``--device=cuda``): capture once, new inputs on every replay.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import fusemla
import fusemla.ops.epilogue.launch as launch_mod
from fusemla.contracts.epilogue import prepare
from fusemla.ops.custom_ops import pack_epilogue, unpack_epilogue
from fusemla.quant import QuantizedWeight, quantize_fp8_weight
from fusemla.testing import block_fp8_w_uv, poisoned, stable_seed, vllm_w_uv

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _CountingKernel:
    """Stands in for the Triton kernel object: counts launches, then launches the real one."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch):
    counter = _CountingKernel(launch_mod.mla_epilogue_kernel)
    monkeypatch.setattr(launch_mod, "mla_epilogue_kernel", counter)
    return counter


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(stable_seed("epilogue-compile", *parts))


def _dims(device: str) -> dict:
    return (
        dict(H=16, L=512, V=128, P=128, block=128)
        if device == "cuda"
        else dict(H=2, L=64, V=64, P=32, block=32)
    )


def _weight(kind: str, d: dict, g, device) -> torch.Tensor | QuantizedWeight:
    H, L, V = d["H"], d["L"], d["V"]
    if kind == "plain":  # vLLM's layout: a transposed view of [L, H, V]
        return vllm_w_uv(H, L, V, g, BF16, device)
    if kind == "fp8-head":
        return quantize_fp8_weight(torch.randn(H, L, V, generator=g).to(device), per_head=True)
    return block_fp8_w_uv(H, d["P"], L, V, (d["block"], d["block"]), g, device)


def _out_kw(out: str, d: dict) -> dict:
    if out == "act":
        return {}
    return dict(out_dtype=FP8, group_size=d["block"] if out == "fp8" else 16, scale_col_major=True)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _as_tuple(res) -> tuple:
    return res if isinstance(res, tuple) else (res,)


def _same_bytes(a, b) -> None:
    a, b = _as_tuple(a), _as_tuple(b)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(_bytes(x), _bytes(y))


# ----------------------------------------------------------------------------- the op


@pytest.mark.parametrize("out", ["act", "fp8", "fp8-ue8m0-g16"])
@pytest.mark.parametrize("weights", ["plain", "fp8-head", "fp8-block"])
def test_opcheck(device, weights, out, launches):
    d = _dims(device)
    g = _gen("opcheck", weights, out)
    w = _weight(weights, d, g, device)
    x = torch.randn(5, d["H"], d["L"], generator=g).to(device, BF16)
    kw = _out_kw(out, d)
    if out == "fp8-ue8m0-g16":
        kw["scale_ue8m0"] = True
    args = prepare(x, w, **kw)
    packed = pack_epilogue(args)
    ins, outs, ints, w_format = packed
    assert ins[0] is x and outs[0] is args.out
    assert w_format == ("" if weights == "plain" else "fp8")
    assert ints == [
        kw.get("group_size", 128),
        int(kw.get("scale_ue8m0", False)),
        *((d["block"], d["block"]) if weights == "fp8-block" else (0, 0)),
    ]
    # the op's own unpacking runs the same launch as the public call
    assert launch_mod.plan(unpack_epilogue(*packed)) == launch_mod.plan(args)
    has_fp8 = any(t is not None and t.dtype == FP8 for t in (*ins, *outs))
    tests = ["test_schema", "test_autograd_registration", "test_faketensor"]
    tests.append("test_aot_dispatch_dynamic")
    if has_fp8:
        tests.remove("test_schema")  # torch cannot compare FP8 tensors there (module doc)
    torch.library.opcheck(torch.ops.fusemla.mla_epilogue.default, packed, test_utils=tests)
    assert launches.launches >= 1  # the kernel ran (interpreted on the CPU)

    # what test_schema asks, directly: every byte of outs written, the inputs untouched
    assert outs[0].is_contiguous()
    outs_p = [poisoned(outs[0].shape, outs[0].dtype, device)]
    if len(outs) == 2:  # column-major scales: a poisoned buffer of the same strides
        outs_p.append(poisoned(outs[1].shape[::-1], torch.float32, device).t())
        assert outs_p[1].stride() == outs[1].stride() == (1, 5)
    ins_before = [None if t is None else _bytes(t).clone() for t in ins]
    torch.ops.fusemla.mla_epilogue(ins, outs_p, ints, w_format)
    for t, t0 in zip(ins, ins_before):
        assert t is None or torch.equal(_bytes(t), t0)
    expected = fusemla.mla_epilogue(x, w, **kw)
    _same_bytes(tuple(outs_p) if len(outs_p) == 2 else outs_p[0], expected)


def test_op_schema_mutates_only_outs():
    schema = str(torch.ops.fusemla.mla_epilogue.default._schema)
    assert "Tensor?[] ins" in schema and "Tensor(a1!)[] outs" in schema
    assert schema.endswith("-> ()")


# ----------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize(
    "weights,out", [("plain", "act"), ("fp8-block", "fp8"), ("fp8-head", "fp8-ue8m0-g16")]
)
def test_compiled_step_compiles_once_and_matches_eager(device, weights, out, launches):
    """One graph for three batch sizes; compiled and eager results equal byte for byte; one
    kernel launch per call, compiled or eager."""
    d = _dims(device)
    g = _gen("compile", weights, out)
    w = _weight(weights, d, g, device)
    kw = _out_kw(out, d)
    if out == "fp8-ue8m0-g16":
        kw["scale_ue8m0"] = True
    spec = fusemla.epilogue_spec(w, **kw)

    def step(x):
        return fusemla.mla_epilogue_step(spec, x)

    backend = "inductor" if device == "cuda" else "aot_eager"
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=False)
    sizes = (3, 5, 7) if device == "cpu" else (3, 64, 300)
    for N in sizes:
        x = torch.randn(N, d["H"], d["L"], generator=g).to(device, BF16)
        torch._dynamo.mark_dynamic(x, 0)
        before = launches.launches
        got = compiled(x)
        eager = step(x)
        assert launches.launches == before + 2
        _same_bytes(got, eager)
        if out != "act":  # the spec's column-major scales survive compilation
            assert got[1].stride() == eager[1].stride() == (1, N)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times for N = {sizes}"


@pytest.mark.parametrize("out", ["act", "fp8"])
def test_compiled_step_writes_into_given_buffers(device, out, launches):
    """A compiled step writing into the caller's buffers (a column slice of a wider poisoned
    ``out``, strided scales) mutates them as eager does, and nothing around them."""
    d = _dims(device)
    g = _gen("compile-out", out)
    w = _weight("fp8-block", d, g, device)
    kw = _out_kw(out, d)
    spec = fusemla.epilogue_spec(w, **kw)
    N, HV = 9, d["H"] * d["V"]
    dtype = FP8 if out == "fp8" else BF16

    def buffers():
        wide = poisoned((N, HV + 32), dtype, device)
        sbase = poisoned((HV // d["block"], N + 3), torch.float32, device)
        return wide, sbase

    def step(x, o, s):
        fusemla.mla_epilogue_step(spec, x, out=o, scale_out=s)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    x = torch.randn(N, d["H"], d["L"], generator=g).to(device, BF16)
    results = []
    for fn in (compiled, step):
        wide, sbase = buffers()
        o = wide[:, 16 : 16 + HV]
        s = sbase[:, :N].t() if out == "fp8" else None
        fn(x, o, s)
        results.append((wide, sbase))
    (wc, sc), (we, se) = results
    assert torch.equal(_bytes(wc), _bytes(we))
    assert not torch.isnan(wc[:, 16 : 16 + HV].float()).any()
    poison = _bytes(poisoned((N, 16), dtype, device))
    assert torch.equal(_bytes(wc[:, :16]), poison)
    if out == "fp8":
        assert torch.equal(sc[:, :N], se[:, :N]) and not sc[:, :N].isnan().any()
        assert bool(sc[:, N:].isnan().all())
    assert launches.launches == 2


# ----------------------------------------------------------------------------- CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize("out", ["act", "fp8", "fp8-ue8m0-g16"])
@pytest.mark.parametrize("H", [16, 128])
def test_cuda_graph_replay_reads_new_inputs(device, H, out):
    """Capture ``mla_epilogue_step`` once (into given buffers, and returning fresh ones); change
    the input in place; every replay equals eager on the new input."""
    d = dict(_dims(device), H=H)
    g = _gen("graph", H, out)
    w = _weight("fp8-block", d, g, device)
    kw = _out_kw(out, d)
    if out == "fp8-ue8m0-g16":
        kw["scale_ue8m0"] = True
    spec = fusemla.epilogue_spec(w, **kw)
    N = 64
    x = torch.randn(N, H, d["L"], generator=g).to(device, BF16)
    given = _as_tuple(fusemla.mla_epilogue_step(spec, x))  # compiles outside capture
    bufs = dict(out=torch.empty_like(given[0]))
    if len(given) == 2:
        bufs["scale_out"] = torch.empty_like(given[1])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fusemla.mla_epilogue_step(spec, x, **bufs)
        returned = fusemla.mla_epilogue_step(spec, x)
    for _ in range(3):
        x.copy_(torch.randn(N, H, d["L"], generator=g).to(device, BF16))
        for b in bufs.values():
            b.copy_(poisoned(b.shape, b.dtype, device))
        graph.replay()
        torch.cuda.synchronize()
        eager = fusemla.mla_epilogue_step(spec, x.clone())
        _same_bytes(tuple(bufs.values()) if len(bufs) == 2 else bufs["out"], eager)
        _same_bytes(returned, eager)
