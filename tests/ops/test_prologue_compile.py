"""torch.compile keeps the prologue's batch dimension dynamic: one compile for every batch size.

The prologue's argument checks (:func:`fusemla.contracts.prologue.prepare`, and the layer's own
checks) run while dynamo traces. Formatting a symbolic size into a string (an error message built
eagerly, ``f"[N={N}]"``) makes dynamo specialize it to a constant: a compiled caller then
recompiled for every batch size, and raised ConstraintViolationError when the batch dim was
marked with ``torch._dynamo.mark_dynamic``. Each test below compiles once (``fullgraph=True``,
backend ``aot_eager``), calls the compiled function with fresh inputs at three batch sizes, holds
every result (outputs and every cache byte) against the unfused reference run eagerly, and
asserts that dynamo compiled exactly one graph.

What may specialize (and does): the model dims H, P, R, L, dtypes, the cache's shape and block
size. What must not: N (tokens) and, where it is derived from a tensor's size, D
(``num_decode_tokens``). A plain Python int ``num_decode_tokens`` is a constant to dynamo under
``dynamic=False`` (a new D recompiles, by design): with it only N is checked to stay dynamic.

``--device=cpu``: the fused op's compiled graph calls the registered custom op, whose
implementation runs the Triton kernel in the interpreter (the conftest sets
``TRITON_INTERPRET=1``); the tests count those launches, so a silent fall-back to the PyTorch
reference would fail them.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from fusemla import config
from fusemla.config import FUSED_DECODE_ENV, FUSED_PREFILL_ENV, MLAConfig
from fusemla.layers import MLAAttention
from fusemla.ops.prologue.api import mla_decode_prologue, mla_prologue
from fusemla.reference.prologue import mla_decode_prologue_ref, mla_prologue_ref
from fusemla.testing import (
    SMALL_DIMS,
    SMALL_LAYER,
    BlockAllocator,
    Scheduler,
    check_against_reference,
    hf_config,
    make_inputs,
    random_state_dict,
    stable_seed,
)

DIMS = dict(SMALL_DIMS, H=2)
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    for name in (FUSED_DECODE_ENV, FUSED_PREFILL_ENV):
        monkeypatch.delenv(name, raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _mark_batch_dynamic(inp):
    for t in (inp.q_nope, inp.q_pe, inp.kv_c, inp.k_pe, inp.positions, inp.slot_mapping):
        torch._dynamo.mark_dynamic(t, 0)


def _outputs(out):
    # fresh tensors out of the graph (the op's outputs are graph inputs' aliases otherwise)
    return type(out)(*(t * 1 for t in out))


FNS = {"fused": mla_prologue, "reference": mla_prologue_ref}
# decode tokens per batch of N tokens: None (all decode), a Python int (a constant to dynamo),
# or derived from the size of a decode-only tensor (symbolic, like N)
CASES = {
    "all-decode": ((3, 5, 7), None),
    "mixed-int-D": ((5, 7, 9), lambda n: 2),
    "mixed-size-D": ((5, 7, 9), lambda n: n - 3),
}


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("which", list(FNS))
def test_compiled_prologue_compiles_once_for_all_batch_sizes(device, which, case, kv, prologue_spy):
    """``mark_dynamic`` on the per-token inputs: three batch sizes, one graph, every result equal
    to the reference's (fused: also one kernel launch per call)."""
    if which == "fused" and device == "cpu":
        assert config.interpreting()  # the kernel runs (interpreted), not the CPU fallback
    fn = FNS[which]
    sizes, decode_of = CASES[case]

    if case == "mixed-size-D":

        def step(decode_seq_lens, *args, kv_scale):
            return _outputs(
                fn(*args, num_decode_tokens=decode_seq_lens.shape[0], kv_scale=kv_scale)
            )
    elif case == "mixed-int-D":

        def step(*args, kv_scale):
            return _outputs(fn(*args, num_decode_tokens=2, kv_scale=kv_scale))
    else:

        def step(*args, kv_scale):
            return _outputs(fn(*args, kv_scale=kv_scale))

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=False)
    expected_launches = []
    for N in sizes:
        D = None if decode_of is None else decode_of(N)
        inp = make_inputs(
            N,
            **DIMS,
            num_decode_tokens=D,
            kv_dtype=FP8 if kv == "fp8" else None,
            kv_scale="tensor",
            num_blocks=4,
            pad_fraction=0.25,
            device=device,
            generator=torch.Generator().manual_seed(
                stable_seed("compile-dynamic", which, case, kv, N)
            ),
        )
        _mark_batch_dynamic(inp)
        extra = ()
        if case == "mixed-size-D":
            extra = (torch.ones(D, dtype=torch.int32, device=device),)
            torch._dynamo.mark_dynamic(extra[0], 0)
        before = inp.kv_cache.clone()
        out = compiled(*extra, *inp.args(), kv_scale=inp.kv_scale)
        check_against_reference(inp, out, before).assert_ok()
        expected_launches.append((N, N if D is None else D))
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times for N = {sizes}"
    assert prologue_spy.take()["launch"] == (expected_launches if which == "fused" else [])


@pytest.mark.parametrize("which", ["fused", "reference"])
def test_compiled_decode_prologue_compiles_once(device, which):
    """The all-decode aliases (:func:`mla_decode_prologue` and its reference), same check."""
    fn = {"fused": mla_decode_prologue, "reference": mla_decode_prologue_ref}[which]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda *a: fn(*a) * 1, backend=counter, fullgraph=True, dynamic=False)
    for N in (3, 6, 11):
        inp = make_inputs(
            N,
            **DIMS,
            num_blocks=4,
            device=device,
            generator=torch.Generator().manual_seed(stable_seed("compile-decode-alias", which, N)),
        )
        _mark_batch_dynamic(inp)
        before = inp.kv_cache.clone()
        q = compiled(*inp.args())
        check_against_reference(inp, q, before).assert_ok()
    assert counter.frame_count == 1


# ----------------------------------------------------------------------------- the layer

#: the small DeepSeek-V3-style attention config (4 heads, L=64, YaRN RoPE)
LAYER_CFG = hf_config(SMALL_LAYER)


def _layer(device, seed, fused: bool) -> MLAAttention:
    sd = random_state_dict(LAYER_CFG, torch.Generator().manual_seed(seed))
    return MLAAttention.from_state_dict(
        sd, LAYER_CFG, config=MLAConfig(fused, fused), device=device
    )


@pytest.mark.parametrize("entry", ["forward_latent", "forward"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
def test_compiled_layer_decode_step_compiles_once(device, fused, entry, prologue_spy):
    """:meth:`MLAAttention.forward_latent` (and :meth:`~MLAAttention.forward`) on decode steps
    padded to 3, 5 and 7 requests: one graph, outputs and cache bytes equal to eager.

    The batch size reaches the layer as the metadata's Python ints (``num_decode_tokens`` ...),
    which ``dynamic=False`` makes constants, so this compiles with ``dynamic=True`` (ints and
    sizes symbolic; the model dims, the block size and the cache shape then specialize through
    the layer's checks, which is fine). Floats stay specialized (``specialize_float``), else
    dynamo restarts the trace once to specialize the FP8 maximum, which a compile counter counts
    as a second graph. Steps with prefill requests specialize by design: their attention loops
    over the requests' host-side lengths."""
    seed = stable_seed("compile-layer", fused, entry)
    layer = _layer(device, seed, fused)
    bs, num_blocks, max_blocks = 16, 32, 4
    names = [f"r{i}" for i in range(7)]
    alloc = BlockAllocator(num_blocks, bs, shuffle=False)
    alloc.ensure("reserved", 1)  # block 0: nobody's
    sched = Scheduler(alloc, device=device, max_blocks=max_blocks)
    cache = torch.zeros(num_blocks, bs, layer.L + layer.R, device=device).to(FP8)
    kv_scale = torch.tensor([3.0 / 448], device=device)
    md, _ = sched.step([(n, 2 + i) for i, n in enumerate(names)])
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(md.num_tokens, layer.hidden_size, generator=g).to(device, torch.bfloat16)
    layer(x, md.positions, md, cache, kv_scale)  # prefill, eager
    prologue_spy.take()  # forget the eager prefill's launch

    if entry == "forward_latent":

        def step(q, kv_c, k_pe, positions, md, cache, kv_scale):
            return layer.forward_latent(q, kv_c, k_pe, positions, md, cache, kv_scale)
    else:

        def step(x, positions, md, cache, kv_scale):
            return layer(x, positions, md, cache, kv_scale)

    counter = CompileCounterWithBackend("aot_eager")
    with torch._dynamo.config.patch(specialize_float=True):
        compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
        for n in (3, 5, 7):
            md, _ = sched.step([(r, 1) for r in names[: n - 1]], pad_decodes_to=n)
            if entry == "forward_latent":
                H, P, L, R = layer.H, layer.P, layer.L, layer.R
                args = (
                    torch.randn(n, H, P + R, generator=g),
                    torch.randn(n, L, generator=g),
                    torch.randn(n, R, generator=g),
                )
                args = tuple(a.to(device, torch.bfloat16) for a in args)
            else:
                args = (torch.randn(n, layer.hidden_size, generator=g).to(device, torch.bfloat16),)
            cache_eager = cache.clone()
            eager = step(*args, md.positions, md, cache_eager, kv_scale)
            out = compiled(*args, md.positions, md, cache, kv_scale)
            torch.testing.assert_close(out, eager, atol=0, rtol=0)
            assert torch.equal(cache.view(torch.uint8), cache_eager.view(torch.uint8))
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"
    # eager and compiled: one fused launch each per step (none for the reference layer)
    assert prologue_spy.take()["launch"] == (
        [(n, n) for n in (3, 5, 7) for _ in range(2)] if fused else []
    )
