"""The vLLM plugin's version adapters and the half split, without vLLM installed.

The adapters' vLLM-facing methods run in tests/vllm (vLLM's CPU build in CI, its CUDA builds on
the H200); here: which version gets which adapter, what differs between them, that an
unsupported vLLM leaves the plugin off with one warning, and the batch split both the plugin
and the layer use.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest

from fusemla.integrations import vllm_adapters as ad
from fusemla.ops.prologue.halves import Span, split_halves


@pytest.mark.parametrize(
    "version,minor,cls",
    [
        ("0.32.0", "0.32", ad.Vllm032),
        ("0.32.3", "0.32", ad.Vllm032),
        ("0.33.0", "0.33", ad.Vllm033),
        ("0.33.1rc2", "0.33", ad.Vllm033),
        ("0.33.0+cu130", "0.33", ad.Vllm033),
        ("0.34.0", "0.34", None),
        ("0.31.2", "0.31", None),
        ("1.0", "1.0", None),
        ("unknown", "unknown", None),
    ],
)
def test_adapter_for_version(version, minor, cls):
    assert ad.minor_of(version) == minor
    a = ad.adapter_for(version)
    if cls is None:
        assert a is None
    else:
        assert type(a) is cls and a.minor == minor


class _Impl:
    def __init__(self):
        self.calls = []

    def do_kv_cache_update(self, *args):
        self.calls.append(args)


def _attn(dtype: str, scale: float):
    return types.SimpleNamespace(
        impl=_Impl(), kv_cache_dtype=dtype, _k_scale="k-scale", _k_scale_float=scale
    )


@pytest.mark.parametrize(
    "dtype,scale,skip",
    [("fp8", 1.0, True), ("fp8_e4m3", 1.0, True), ("fp8", 0.5, False), ("auto", 1.0, False)],
)
def test_cache_write_per_version(dtype, scale, skip):
    """0.32's do_kv_cache_update takes 6 arguments; 0.33's update_kv_cache passes a 7th,
    skip_scale (FP8 cache with a scale of exactly 1.0), and the 0.33 adapter passes it alike."""
    for cls, extra in ((ad.Vllm032, ()), (ad.Vllm033, (skip,))):
        a = _attn(dtype, scale)
        cls().cache_write(a, "kv_c", "k_pe", "cache", "slots")
        assert a.impl.calls == [("kv_c", "k_pe", "cache", "slots", dtype, "k-scale", *extra)]


def test_internals_listed_per_version():
    assert "skip_scale" not in " ".join(ad.Vllm032.INTERNALS)
    assert "skip_scale" in " ".join(ad.Vllm033.INTERNALS)
    assert set(ad.ADAPTERS) == {"0.32", "0.33"}


def test_unsupported_vllm_leaves_plugin_off(monkeypatch, caplog):
    """register() under a vLLM without an adapter: one warning, nothing registered."""
    from fusemla.integrations import vllm as plugin

    fake = types.ModuleType("vllm")
    fake.__version__ = "0.34.0"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_adapter", None)
    monkeypatch.setattr(plugin, "_logged", set())
    monkeypatch.setattr(plugin, "logger", logging.getLogger("test.fusemla"))
    with caplog.at_level(logging.WARNING, logger="test.fusemla"):
        plugin.register()
        plugin.register()
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [
        "fusemla: vLLM 0.34.0 is not supported (supported: 0.32.x, 0.33.x): "
        "plugin off, vLLM's own MLA path runs"
    ]
    assert plugin._adapter is None and not plugin._registered


def test_w_uk_mode(monkeypatch):
    from fusemla.errors import FuseMLAValueError
    from fusemla.integrations.vllm import w_uk_mode

    monkeypatch.delenv("FUSEMLA_VLLM_W_UK", raising=False)
    assert w_uk_mode() == "as-is"
    for v, want in (("fp8", "fp8"), (" FP8xFP8 ", "fp8xfp8"), ("as-is", "as-is"), ("", "as-is")):
        monkeypatch.setenv("FUSEMLA_VLLM_W_UK", v)
        assert w_uk_mode() == want
    monkeypatch.setenv("FUSEMLA_VLLM_W_UK", "int8")
    with pytest.raises(FuseMLAValueError, match="FUSEMLA_VLLM_W_UK.*as-is, fp8, fp8xfp8.*int8"):
        w_uk_mode()
    monkeypatch.setenv("FUSEMLA_VLLM_W_UK", "auto")  # the old name of as-is: told the new one
    with pytest.raises(FuseMLAValueError, match="FUSEMLA_VLLM_W_UK.*'auto' is now called 'as-is'"):
        w_uk_mode()


def test_forced_backends_typo_raises(monkeypatch):
    from fusemla.errors import FuseMLAValueError
    from fusemla.integrations.vllm import UNVERIFIED_FULL_GRAPH_BACKENDS, _forced_backends

    monkeypatch.setenv("FUSEMLA_VLLM_FORCE_BACKENDS", " flashmla ,")
    assert _forced_backends() == {"FLASHMLA"} == set(UNVERIFIED_FULL_GRAPH_BACKENDS)
    monkeypatch.setenv("FUSEMLA_VLLM_FORCE_BACKENDS", "FLASHMLA,FLASH_MLA")
    with pytest.raises(FuseMLAValueError, match="FORCE_BACKENDS.*FLASHMLA.*'flash_mla' unknown"):
        _forced_backends()


@pytest.mark.parametrize("N,D", [(0, 0), (5, 0), (5, 5), (7, 3)])
@pytest.mark.parametrize("fd,fp", [(True, True), (False, False), (True, False), (False, True)])
def test_split_halves_covers_every_token_once(N, D, fd, fp):
    split = split_halves(N, D, fd, fp)
    covered = [t for s in split.spans for t in range(s.lo, s.hi)]
    assert covered == list(range(N))  # every token once, in order
    assert all(len(s) > 0 for s in split.spans)
    assert sum(s.fused for s in split.spans) <= 1
    for s in split.spans:
        decode = range(s.lo, s.lo + s.num_decode_tokens)
        assert all(t < D for t in decode) and all(t >= D for t in range(decode.stop, s.hi))
        # a token's half decides its path
        assert all(s.fused == (fd if t < D else fp) for t in range(s.lo, s.hi))
    if fd == fp:
        assert split.spans == ((Span(0, N, D, fd),) if N else ())
    assert (split.decode_fused, split.prefill_fused) == (fd, fp)
    with pytest.raises(ValueError):
        split_halves(3, 4, fd, fp)


def test_spec_key_of_tensors_with_and_without_version_counter():
    """The plugin's per-layer spec cache keys on tensors' version counters; an inference tensor
    (vLLM may recast its RoPE cache inside inference mode) has none and must not raise."""
    import torch

    from fusemla.contracts.prologue import tensor_key as _tensor_key

    w = torch.zeros(2, 3)
    k0 = _tensor_key(w)
    w.add_(1)  # an in-place reload: a new key
    assert _tensor_key(w) != k0
    with torch.inference_mode():
        cache = torch.zeros(4, 2)
    assert _tensor_key(cache) == _tensor_key(cache)
    assert _tensor_key(cache)[-1] is None


class _FakeAdapter(ad.VllmAdapter):
    """The plugin's per-layer state over plain objects (no vLLM): what spec building reads."""

    def attention(self, w):
        return w.mla_attn

    def layer_name(self, attn):
        return attn.layer_name

    def is_fp8_cache(self, attn):
        return False


def _layer(name, rotary, w_uk_t, P=8, R=4, L=16, V=8):
    attn = types.SimpleNamespace(layer_name=name, W_UK_T=w_uk_t, kv_cache_dtype="auto")
    return types.SimpleNamespace(
        mla_attn=attn,
        rotary_emb=rotary,
        qk_nope_head_dim=P,
        qk_rope_head_dim=R,
        kv_lora_rank=L,
        v_head_dim=V,
    )


def test_spec_prebuilt_once_and_rope_tables_shared(monkeypatch):
    """The plugin builds each layer's spec on vLLM's metadata-less profile step (eager, before
    any CUDA graph capture), once; every layer's RoPE tables are views of vLLM's one shared
    cos_sin_cache (61 copies of it cost 1.2 GiB of KV cache at DeepSeek-V3's depth)."""
    import torch

    from fusemla.integrations import vllm as plugin

    monkeypatch.setattr(plugin, "_stats", plugin.Counter())
    H, P, R, L = 2, 8, 4, 16
    rotary = types.SimpleNamespace(cos_sin_cache=torch.randn(32, R), is_neox_style=False)
    # vLLM's W_UK_T: a permuted view of W_UK [L, H, P]
    w = torch.randn(L, H, P, dtype=torch.bfloat16).permute(1, 2, 0)
    states = [
        plugin._LayerState(_FakeAdapter(), _layer(f"l{i}", rotary, w), True, True) for i in range(3)
    ]
    for st in states:
        st.prebuild()
        st.prebuild()  # a second metadata-less step: nothing rebuilt
    assert plugin.stats()["spec_builds"] == 3
    assert plugin.stats().get("spec_builds_in_capture", 0) == 0
    for st in states:
        spec = st.spec(None)  # the prebuilt one
        assert spec.cos_cache.data_ptr() == rotary.cos_sin_cache.data_ptr()
        assert spec.sin_cache.data_ptr() == rotary.cos_sin_cache[:, R // 2 :].data_ptr()
        assert spec.w_uk_t.data_ptr() == w.data_ptr()  # read in place, no copy
    assert plugin.stats()["spec_builds"] == 3
    rotary.cos_sin_cache = torch.randn(32, R)  # vLLM replaced its cache: rebuilt, on demand
    assert states[0].spec(None).cos_cache.data_ptr() == rotary.cos_sin_cache.data_ptr()
    assert plugin.stats()["spec_builds"] == 4


def test_spec_prebuild_waits_for_weights_and_keeps_no_broken_spec(monkeypatch):
    import torch

    from fusemla.integrations import vllm as plugin

    monkeypatch.setattr(plugin, "_stats", plugin.Counter())
    rotary = types.SimpleNamespace(cos_sin_cache=torch.randn(32, 4), is_neox_style=False)
    st = plugin._LayerState(_FakeAdapter(), _layer("l0", rotary, None), True, True)
    st.prebuild()  # no W_UK_T yet (before process_weights_after_loading): nothing built
    assert "spec_builds" not in plugin.stats() and st._spec is None
    st.attn.W_UK_T = torch.randn(2, 8, 16).to(torch.int32)  # a spec that cannot be built
    st.prebuild()
    assert st._spec is None and st._spec_key is None  # left for the first fused step to raise
    with pytest.raises(Exception, match="w_uk_t"):
        st.spec(None)


# ------------------------------------------------------------------ FP8 weights and o_proj


class _Fp8Adapter(_FakeAdapter):
    def fp8_dtype(self):
        import torch

        return torch.float8_e4m3fn


def _block_fp8(w, bn: int, bk: int):
    """A 2-D weight as a block-FP8 checkpoint stores it: e4m3 codes, one fp32 scale per block."""
    import torch

    N, K = w.shape
    s = torch.zeros(-(-N // bn), -(-K // bk))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            s[i, j] = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().max() / 448
    full = s.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return (w / full).clamp(-448, 448).to(torch.float8_e4m3fn), s


class _QuantFP8(types.SimpleNamespace):
    """vLLM's QuantFP8 module as the handoff reads it: attributes, and a call that quantizes
    per token group of 128 (the reference rule) into row- or column-major scales."""

    def __call__(self, x, scale, scale_ub, use_triton=False):
        from fusemla.reference.epilogue import group_quant_fp8

        self.calls += 1
        codes, s = group_quant_fp8(x.float(), self.group_size)
        return codes, (s.t().contiguous().t() if self.column_major_scales else s)


class _BlockKernel:
    """What the FP8 handoff reads of vLLM's Fp8BlockScaledMMLinearKernel, over plain torch:
    its input quantization and a GEMM of the dequantized operands."""

    apply_input_quant = True
    use_triton = False

    def __init__(self, col_major=True, **quant):
        import torch

        self.config = types.SimpleNamespace(out_dtype=torch.bfloat16)
        self.quant_fp8 = _QuantFP8(
            static=False,
            is_group_quant=True,
            group_size=128,
            use_ue8m0=False,
            use_deep_gemm_supported=False,
            column_major_scales=col_major,
            tma_aligned_scales=False,
            num_token_padding=None,
            calls=0,
        )
        vars(self.quant_fp8).update(quant)

    def _get_layer_params(self, layer):
        return types.SimpleNamespace(
            weight=layer.weight,
            block_scale=layer.weight_scale_inv,
            input_scale=None,
            input_scale_ub=None,
        )

    def apply_block_scaled_mm(self, A, B, As, Bs):
        from fusemla.quant import dequantize_block_fp8

        a = A.float() * As.repeat_interleave(128, dim=1)
        return (a @ dequantize_block_fp8(B, Bs).t()).to(self.config.out_dtype)


def _o_proj(kernel, HV=256, out=64, **kw):
    import torch

    codes, scale = _block_fp8(torch.randn(out, HV), 128, 128)
    qm = types.SimpleNamespace(fp8_linear=kernel, block_quant=True)
    o = types.SimpleNamespace(
        quant_method=qm,
        weight=codes,
        weight_scale_inv=scale,
        bias=None,
        input_is_parallel=True,
        reduce_results=True,
        tp_size=1,
    )
    vars(o).update(kw)
    return o


def _wrapper(o_proj, **kw):
    return types.SimpleNamespace(o_proj=o_proj, g_proj=kw.pop("g_proj", None), **kw)


def test_o_proj_fp8_route_taken():
    k = _BlockKernel()
    route, why = _Fp8Adapter().o_proj_fp8_route(_wrapper(_o_proj(k)))
    assert why is None
    assert route["group_size"] == 128 and route["col_major"] and not route["ue8m0"]
    assert route["kernel"] == "_BlockKernel"


@pytest.mark.parametrize(
    "change,reason",
    [
        ("not_block", "not a block-FP8 linear"),
        ("bf16_input", "takes its input unquantized"),
        ("dispatch", "picks between two kernels"),
        ("static", "does not quantize per token group"),
        ("padding", "does not quantize per token group"),
        ("tma", "TMA-aligned"),
        ("deepgemm_ue8m0", "DeepGEMM's packed UE8M0"),
        ("bias", "a bias"),
        ("split_input", "splits its input"),
        ("gate", "a gate"),
    ],
)
def test_o_proj_fp8_route_refused_with_reason(change, reason):
    """Every o_proj the epilogue cannot feed FP8 is refused with the reason the plugin logs
    (the layer then hands o_proj bf16, as vLLM does)."""
    k = _BlockKernel()
    o = _o_proj(k)
    w = _wrapper(o)
    if change == "not_block":
        o.quant_method.block_quant = False
    elif change == "bf16_input":
        k.apply_input_quant = False
    elif change == "dispatch":
        k.base = k.fallback = object()
    elif change == "static":
        k.quant_fp8.static = True
    elif change == "padding":
        k.quant_fp8.num_token_padding = 16
    elif change == "tma":
        k.quant_fp8.tma_aligned_scales = True
    elif change == "deepgemm_ue8m0":
        k.quant_fp8.use_ue8m0 = k.quant_fp8.use_deep_gemm_supported = True
    elif change == "bias":
        o.bias = object()
    elif change == "split_input":
        o.input_is_parallel = False
    elif change == "gate":
        w.g_proj = object()
    route, why = _Fp8Adapter().o_proj_fp8_route(w)
    assert route is None and reason in why, why


def test_o_proj_fp8_ue8m0_without_deepgemm_is_taken():
    k = _BlockKernel(use_ue8m0=True)
    route, why = _Fp8Adapter().o_proj_fp8_route(_wrapper(_o_proj(k)))
    assert why is None and route["ue8m0"]


@pytest.mark.parametrize("col_major", [True, False])
def test_o_proj_fp8_is_o_proj_on_prequantized_input(col_major):
    """o_proj on pre-quantized codes + scales is o_proj's own forward on the bf16 input it
    would have quantized itself: the same GEMM in the same scale layout, no second quant."""
    import torch

    from fusemla.reference.epilogue import group_quant_fp8

    k = _BlockKernel(col_major=col_major)
    o = _o_proj(k)
    adapter = _Fp8Adapter()
    x = torch.randn(5, 256)
    codes, scales = adapter.o_proj_quantize(o, x)
    assert k.quant_fp8.calls == 1
    assert (scales.stride(0) == 1) == col_major
    y = adapter.o_proj_fp8(o, codes, scales)
    assert k.quant_fp8.calls == 1  # o_proj_fp8 quantizes nothing itself
    c_ref, s_ref = group_quant_fp8(x, 128)
    want = k.apply_block_scaled_mm(c_ref, o.weight, s_ref, o.weight_scale_inv)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)


# ------------------------------------------------- o_proj's quantization into the FP8 handoff


def _c_group_quant(bug: str | None = None):
    """vLLM's CUDA ``per_token_group_fp8_quant(x, x_q, x_s, group_size, eps, fp8_min,
    fp8_max, ue8m0, column_major, tma_aligned)`` as the plugin calls it, over plain torch: the
    codes into ``x_q``, the scales into ``x_s`` through ``x_s``'s own strides (the CUDA kernel
    addresses column-major scales through their column stride). Planted layout bugs: ``rows``
    addresses column-major scales as if the buffer held only ``x``'s rows; ``row_major``
    writes them row-major whatever the buffer's strides."""
    import torch

    from fusemla.reference.epilogue import group_quant_fp8

    def kernel(x, x_q, x_s, group_size, eps, fp8_min, fp8_max, ue8m0, col_major, tma):
        kernel.calls.append((x.shape[0], group_size, eps, fp8_min, fp8_max, ue8m0, col_major, tma))
        codes, s = group_quant_fp8(x.float(), group_size, ue8m0=ue8m0)
        x_q.copy_(codes)
        m, g = s.shape
        if bug == "rows":
            torch.as_strided(x_s, (m, g), (1, m)).copy_(s)
        elif bug == "row_major":
            torch.as_strided(x_s, (m, g), (g, 1)).copy_(s)
        else:
            x_s.copy_(s)

    kernel.calls = []
    return kernel


class _InPlaceAdapter(_Fp8Adapter):
    """The FP8 handoff's adapter with vLLM's CUDA quantization kernel emulated (a CPU test)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def group_quant_kernel(self, x):
        return self.kernel

    def fp8_min_max(self):
        return -448.0, 448.0


def _handoff_state(monkeypatch, adapter, col_major=True, native=False):
    """A layer state of an FP8-handoff layer (route as o_proj_fp8_route returns it) whose
    o_proj's QuantFP8 dispatched to forward_cuda (``native``: to its PyTorch form)."""
    import torch

    from fusemla.integrations import vllm as plugin

    monkeypatch.setattr(plugin, "_stats", plugin.Counter())
    monkeypatch.setattr(plugin, "_logged", set())
    monkeypatch.setattr(plugin, "_in_place", {})
    k = _BlockKernel(col_major=col_major)
    qf = k.quant_fp8
    qf.forward_cuda = lambda *a, **kw: None
    qf._forward_method = (lambda *a, **kw: None) if native else qf.forward_cuda
    rotary = types.SimpleNamespace(cos_sin_cache=torch.randn(32, 4), is_neox_style=False)
    layer = _layer("l0", rotary, torch.randn(2, 8, 16, dtype=torch.bfloat16))
    layer.o_proj = _o_proj(k)
    route = dict(
        dtype=torch.float8_e4m3fn, group_size=128, ue8m0=False, col_major=col_major, kernel="K"
    )
    return plugin._LayerState(adapter, layer, True, True, "as-is", True, route), qf


def _handoff_buffers(T, width=256, col_major=True):
    """The wrapper's handoff buffers, poisoned: codes 0x5A, scales -1."""
    import torch

    codes = torch.full((T, width), 0x5A, dtype=torch.uint8).view(torch.float8_e4m3fn)
    g = width // 128
    scales = torch.full((g, T), -1.0).t() if col_major else torch.full((T, g), -1.0)
    return codes, scales


def _assert_rows(output, codes, scales, lo, hi):
    """Rows [lo, hi) hold o_proj's quantization of output's rows, every other row its poison."""
    import torch

    from fusemla.reference.epilogue import group_quant_fp8

    c, s = group_quant_fp8(output[lo:hi].float(), 128)
    got = codes.view(torch.uint8)
    assert torch.equal(got[lo:hi], c.view(torch.uint8)) and torch.equal(scales[lo:hi], s)
    rest = torch.ones(codes.shape[0], dtype=torch.bool)
    rest[lo:hi] = False
    assert bool((got[rest] == 0x5A).all()) and bool((scales[rest] == -1.0).all())


@pytest.mark.parametrize("col_major", [True, False])
def test_o_proj_quantization_writes_the_handoff_in_place(monkeypatch, caplog, col_major):
    """Rows the epilogue did not write (prefill, vLLM's path, steps outside the range) go
    through o_proj's own quantization kernel straight into the handoff's rows (vLLM's CUDA
    per_token_group_fp8_quant takes its outputs), after one check on the device against
    o_proj's quantization proper: no quantized copy and two copy kernels a layer."""
    import torch

    from fusemla.integrations import vllm as plugin

    kernel = _c_group_quant()
    st, qf = _handoff_state(monkeypatch, _InPlaceAdapter(kernel), col_major)
    T = 7
    output = torch.randn(T, 256, dtype=torch.bfloat16) * 3
    codes, scales = _handoff_buffers(T, col_major=col_major)
    with caplog.at_level(logging.INFO, logger=plugin.logger.name):
        st.quantize_rows(output, codes, scales, 2, 5)
    _assert_rows(output, codes, scales, 2, 5)
    s = plugin.stats()
    assert s["o_proj_quant_in_place"] == 1 and "o_proj_quant_in_place_refused" not in s, s
    assert s["o_proj_quant_rows"] == 3 and "o_proj_quant_copied_rows" not in s, s
    assert len(kernel.calls) == 3 + 1 and qf.calls == 3  # the check's three cases, the rows
    assert kernel.calls[-1] == (3, 128, 1e-10, -448.0, 448.0, False, col_major, False)
    assert any("in place" in r.getMessage() for r in caplog.records)
    # checked once: the next rows (a step's other half) in place at once
    st.quantize_rows(output, codes, scales, 0, 2)
    _assert_rows(output, codes, scales, 0, 5)
    assert len(kernel.calls) == 5 and qf.calls == 3
    assert plugin.stats()["o_proj_quant_in_place"] == 1


@pytest.mark.parametrize("case", ["rows", "row_major", "unavailable", "native"])
def test_o_proj_quantization_copied_where_the_check_refuses(monkeypatch, caplog, case):
    """Where o_proj's kernel cannot write the handoff's rows (a planted layout bug: the
    check on the device catches it; no CUDA kernel; o_proj's quantization in its PyTorch
    form), the rows are quantized apart and copied, as before, with the reason logged once;
    the handoff is right either way."""
    import torch

    from fusemla.integrations import vllm as plugin

    kernel = None if case == "unavailable" else _c_group_quant(bug=case)
    st, _ = _handoff_state(monkeypatch, _InPlaceAdapter(kernel), native=case == "native")
    T = 6
    output = torch.randn(T, 256, dtype=torch.bfloat16)
    codes, scales = _handoff_buffers(T)
    with caplog.at_level(logging.INFO, logger=plugin.logger.name):
        st.quantize_rows(output, codes, scales, 1, 4)
        st.quantize_rows(output, codes, scales, 4, 6)
    _assert_rows(output, codes, scales, 1, 6)
    s = plugin.stats()
    assert s["o_proj_quant_in_place_refused"] == 1 and "o_proj_quant_in_place" not in s, s
    assert s["o_proj_quant_copied_rows"] == s["o_proj_quant_rows"] == 5, s
    msgs = [
        r.getMessage() for r in caplog.records if "copied into the FP8 handoff" in r.getMessage()
    ]
    assert len(msgs) == 1, msgs
    want = "differ" if case in ("rows", "row_major") else "not vLLM's CUDA"
    assert want in msgs[0], msgs


def test_o_proj_quantization_checked_outside_a_capture(monkeypatch):
    """The check syncs the device: inside a CUDA graph capture the rows are copied (that graph
    keeps its copies) and the check waits for the first call outside one."""
    import torch

    from fusemla.integrations import vllm as plugin

    st, _ = _handoff_state(monkeypatch, _InPlaceAdapter(_c_group_quant()))
    output = torch.randn(4, 256, dtype=torch.bfloat16)
    codes, scales = _handoff_buffers(4)
    monkeypatch.setattr(plugin, "_capturing", lambda: True)
    st.quantize_rows(output, codes, scales, 0, 2)
    s = plugin.stats()
    assert s["o_proj_quant_copied_rows"] == 2 and "o_proj_quant_in_place" not in s, s
    monkeypatch.setattr(plugin, "_capturing", lambda: False)
    st.quantize_rows(output, codes, scales, 2, 4)
    _assert_rows(output, codes, scales, 0, 4)
    s = plugin.stats()
    assert s["o_proj_quant_in_place"] == 1 and s["o_proj_quant_copied_rows"] == 2, s


def test_vllm_group_quant_kernel_only_for_cuda_tensors():
    """Off CUDA (this CPU, ROCm's forward_hip) the adapter offers no in-place kernel."""
    import torch

    assert ad.VllmAdapter().group_quant_kernel(torch.zeros(2, 128)) is None


def _kv_b_proj(H, P, V, L, block, dtype="fp8"):
    import torch

    w = torch.randn(H * (P + V), L)
    qm = types.SimpleNamespace(weight_block_size=list(block))
    if dtype != "fp8":
        return types.SimpleNamespace(weight=w.bfloat16(), quant_method=qm), w
    codes, scale = _block_fp8(w, *block)
    kvb = types.SimpleNamespace(weight=codes, weight_scale_inv=scale, quant_method=qm)
    return kvb, w


def test_stored_weights_read_as_stored(monkeypatch):
    """FUSEMLA_VLLM_W_UK=stored: W_UK_T (prologue) and W_UV (epilogue) are the checkpoint's
    block-FP8 codes and scales as stored, the codes views of vLLM's own kv_b_proj weight (no
    second copy), built once per layer and rebuilt when vLLM reloads kv_b_proj; a
    non-contiguous weight is copied and counted."""
    import torch

    from fusemla.integrations import vllm as plugin

    monkeypatch.setattr(plugin, "_stats", plugin.Counter())
    H, P, V, R, L = 2, 16, 16, 4, 32
    rotary = types.SimpleNamespace(cos_sin_cache=torch.randn(32, R), is_neox_style=False)
    w_uk = torch.randn(L, H, P, dtype=torch.bfloat16).permute(1, 2, 0)
    layer = _layer("l0", rotary, w_uk, P=P, R=R, L=L, V=V)
    kvb, _ = _kv_b_proj(H, P, V, L, (16, 16))
    layer.mla_attn.kv_b_proj = kvb
    layer.mla_attn.W_UV = torch.randn(L, H, V, dtype=torch.bfloat16).transpose(0, 1)
    st = plugin._LayerState(_Fp8Adapter(), layer, True, True, "stored", epilogue=True)
    spec = st.spec(None)
    assert plugin.stats()["stored_builds"] == 1 and st.w_uk == "stored"
    uk, uv = st.stored()
    assert spec.w_uk_t is uk and st.epilogue_spec().w_uv is uv
    assert torch.equal(
        uk.data.view(torch.uint8),
        kvb.weight.view(H, P + V, L)[:, :P].contiguous().view(torch.uint8),
    )
    # the codes are vLLM's own memory: W_UK_T at the weight's start, W_UV P rows into it
    assert uk.data.data_ptr() == kvb.weight.data_ptr()
    assert uv.data.data_ptr() == kvb.weight[P].data_ptr() and uv.data.stride(0) == (P + V) * L
    assert "stored_copied" not in plugin.stats()
    assert plugin.stats()["stored_builds"] == 1  # built once
    kvb.weight_scale_inv.mul_(2)  # vLLM reloaded the weights in place: rebuilt
    assert st.stored()[0] is not uk and plugin.stats()["stored_builds"] == 2
    kvb.weight.view(torch.uint8)[0, 0] ^= 1  # the codes rewritten in place: rebuilt too
    assert plugin.stats()["stored_builds"] == 2 and st.stored() is not None
    assert plugin.stats()["stored_builds"] == 3
    # a layer without the epilogue keeps only W_UK_T (W_UV's copy is the epilogue's alone)
    st2 = plugin._LayerState(_Fp8Adapter(), layer, True, True, "stored")
    uk2, uv2 = st2.stored()
    assert uv2 is None and torch.equal(
        uk2.data.view(torch.uint8), st.stored()[0].data.view(torch.uint8)
    )
    assert st2.spec(None).w_uk_t is uk2
    # a weight vLLM holds with other strides: its codes copied, the same bytes, counted
    viewed = [t.data.view(torch.uint8).clone() for t in st.stored()]
    kvb_t, _ = _kv_b_proj(H, P, V, L, (16, 16))
    kvb_t.weight = kvb.weight.T.contiguous().T
    layer.mla_attn.kv_b_proj = kvb_t
    st3 = plugin._LayerState(_Fp8Adapter(), layer, True, True, "stored", epilogue=True)
    uk3, uv3 = st3.stored()
    assert plugin.stats()["stored_copied"] == 1 and uk3.data.is_contiguous()
    assert uk3.data.untyped_storage().data_ptr() != kvb_t.weight.untyped_storage().data_ptr()
    assert torch.equal(uk3.data.view(torch.uint8), viewed[0])
    assert torch.equal(uv3.data.view(torch.uint8), viewed[1])


@pytest.mark.parametrize("case", ["bf16", "straddle"])
def test_stored_weights_fall_back_with_reason(monkeypatch, caplog, case):
    """A checkpoint that is not block-FP8, or whose blocks straddle a head, keeps vLLM's own
    tensors (as-is) with the reason logged once."""
    import torch

    from fusemla.integrations import vllm as plugin

    monkeypatch.setattr(plugin, "_stats", plugin.Counter())
    monkeypatch.setattr(plugin, "_logged", set())
    H, P, V, R, L = 2, 16, 16, 4, 32
    rotary = types.SimpleNamespace(cos_sin_cache=torch.randn(32, R), is_neox_style=False)
    w_uk = torch.randn(L, H, P, dtype=torch.bfloat16).permute(1, 2, 0)
    layer = _layer("l0", rotary, w_uk, P=P, R=R, L=L, V=V)
    if case == "bf16":
        layer.mla_attn.kv_b_proj, _ = _kv_b_proj(H, P, V, L, (16, 16), dtype="bf16")
        want = "not FP8"
    else:
        layer.mla_attn.kv_b_proj, _ = _kv_b_proj(H, P, V, L, (32, 16))
        want = "straddle"
    st = plugin._LayerState(_Fp8Adapter(), layer, True, True, "stored")
    with caplog.at_level(logging.WARNING, logger=plugin.logger.name):
        spec = st.spec(None)
        st.spec(None)
    assert st.w_uk == "as-is" and spec.w_uk_t.data_ptr() == w_uk.data_ptr()
    msgs = [r.getMessage() for r in caplog.records if "W_UK=stored" in r.getMessage()]
    assert len(msgs) == 1 and want in msgs[0], msgs
    assert "stored_builds" not in plugin.stats()


# ------------------------------------------------------------------ q rotated in place


class _StepAdapter(_FakeAdapter):
    """A step's worth of vLLM over plain tensors: metadata, a cache, vLLM's in-place rotary
    embedding (what its CUDA op does) and attention calls that record what they were handed."""

    def __init__(self, n, d, cache):
        self.md = types.SimpleNamespace(num_actual_tokens=n, num_decode_tokens=d)
        self.slots = None
        self.cache = cache
        self.seen = {}

    def step_context(self, layer_name):
        return self.md, self.slots

    def kv_cache(self, attn):
        return self.cache

    def rope(self, rotary, positions, q_pe, k_pe):
        from fusemla.rope import apply_rope, split_cos_sin_cache

        cos, sin = split_cos_sin_cache(rotary.cos_sin_cache)
        c, s = cos[positions.long()], sin[positions.long()]
        q_pe.copy_(apply_rope(q_pe, c[:, None], s[:, None], rotary.is_neox_style))
        k_pe.copy_(apply_rope(k_pe, c[:, None], s[:, None], rotary.is_neox_style))
        return q_pe, k_pe

    def cache_write(self, attn, kv_c, k_pe, kv_cache, slots):
        self.seen["cache_write"] = k_pe.clone()

    def own_path(self, attn, q, kv_c, k_pe, md, slots, output):
        self.seen["own_path"] = (q.data_ptr(), q.clone(), k_pe.data_ptr())

    def prefill_attention(self, attn, q, kv_c, k_pe, cache, md, output):
        self.seen["prefill"] = (q.data_ptr(), q.clone(), k_pe.clone())

    def decode_attention(self, attn, q, cache, md, output):
        self.seen["decode"] = q.clone()


@pytest.mark.parametrize("path", ["no-metadata", "fused-mixed"])
def test_q_rotated_in_place_no_copy(monkeypatch, path):
    """The op rotates q's q_pe in place, as vLLM's wrapper does (q and k_pe are declared mutated
    in the op's schema): a copy of q at vLLM's 16,384-token profile step cost 7 % of the KV cache
    at 128 heads (H200, a7b3bce). vLLM's path (no metadata: the profile step) hands vLLM's
    attention q itself, rotated; the fused prefill rows are rotated in place by the prologue and
    handed to vLLM's prefill attention as a view of q, the nope part and the decode rows
    untouched."""
    import torch

    from fusemla.integrations import vllm as plugin
    from fusemla.rope import apply_rope, split_cos_sin_cache

    monkeypatch.setattr(plugin, "_stats", plugin.Counter())
    torch.manual_seed(0)
    H, P, R, L, N, D = 2, 8, 4, 16, 5, 2
    rotary = types.SimpleNamespace(cos_sin_cache=torch.randn(64, R), is_neox_style=False)
    w = torch.randn(L, H, P, dtype=torch.bfloat16).permute(1, 2, 0)
    cache = torch.randn(4, 16, L + R, dtype=torch.bfloat16)
    adapter = _StepAdapter(N, D, cache)
    if path == "no-metadata":
        adapter.md = None
    st = plugin._LayerState(adapter, _layer("l0", rotary, w, P=P, R=R, L=L), True, True)
    q = torch.randn(N, H, P + R, dtype=torch.bfloat16)
    kv_c = torch.randn(N, L, dtype=torch.bfloat16)
    k_pe = torch.randn(N, 1, R, dtype=torch.bfloat16)
    positions = torch.randint(0, 64, (N,))
    adapter.slots = torch.randperm(64)[:N]
    output = torch.empty(N, H * 8, dtype=torch.bfloat16)
    q0, k0 = q.clone(), k_pe.clone()
    cos, sin = split_cos_sin_cache(rotary.cos_sin_cache)
    c, s = cos[positions], sin[positions]
    q_rot = apply_rope(q0[..., P:], c[:, None], s[:, None], False).to(q.dtype)
    k_rot = apply_rope(k0[:, 0], c, s, False).to(q.dtype)
    st.run(q, kv_c, k_pe, positions, output)
    if path == "no-metadata":
        ptr, q_seen, k_ptr = adapter.seen["own_path"]
        assert ptr == q.data_ptr() and k_ptr == k_pe.data_ptr()  # q itself, no copy
        assert torch.equal(q_seen[..., P:], q_rot) and torch.equal(q_seen[..., :P], q0[..., :P])
        assert torch.equal(q[..., P:], q_rot)  # rotated in place
    else:
        ptr, q_seen, k_seen = adapter.seen["prefill"]
        assert ptr == q[D:].data_ptr()  # a view of q, no copy
        assert torch.equal(q_seen[..., P:], q_rot[D:]) and torch.equal(k_seen[:, 0], k_rot[D:])
        assert torch.equal(q[D:, :, P:], q_rot[D:])
        assert torch.equal(q[..., :P], q0[..., :P]) and torch.equal(q[:D], q0[:D])
        assert plugin.stats()["prologue_calls"] == 1


# ------------------------------------------------------------------ the epilogue's step range


class _EpiStepAdapter(_StepAdapter):
    def decode_mqa(self, attn, q, cache, md):
        return torch_randn(q.shape[0], q.shape[1], 16)

    def decode_attention(self, attn, q, cache, md, output):
        self.seen["vllm_bmm"] = q.shape[0]


def torch_randn(*shape):
    import torch

    return torch.randn(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("tokens_env", ["measured", "all"])
def test_epilogue_runs_on_the_measured_step_sizes_only(monkeypatch, tokens_env):
    """FUSEMLA_VLLM_EPILOGUE=1: decode steps whose size lies in a span measured faster in vLLM
    (configs.fuse_token_spans; here spans with a gap, which the table may hold) run
    fusemla's epilogue, the others vLLM's W_UV bmm, decided per step (so per captured graph
    size) and counted; FUSEMLA_VLLM_EPILOGUE_TOKENS=all runs it on every step."""
    import torch

    from fusemla.integrations import vllm as plugin
    from fusemla.ops.epilogue import api as epi_api
    from fusemla.ops.epilogue import configs as epi_configs

    monkeypatch.setattr(plugin, "_stats", plugin.Counter())
    monkeypatch.setenv("FUSEMLA_VLLM_EPILOGUE_TOKENS", tokens_env)
    monkeypatch.setattr(
        epi_configs, "fuse_token_spans", lambda H, fp8, be, w=False: ((1, 1), (3, 3))
    )
    ran = []
    monkeypatch.setattr(epi_api, "mla_epilogue_step", lambda spec, o, out: ran.append(o.shape[0]))
    H, P, R, L, V = 2, 8, 4, 16, 8
    rotary = types.SimpleNamespace(cos_sin_cache=torch.randn(64, R), is_neox_style=False)
    w = torch.randn(L, H, P, dtype=torch.bfloat16).permute(1, 2, 0)
    layer = _layer("l0", rotary, w, P=P, R=R, L=L, V=V)
    layer.mla_attn.W_UV = torch.randn(H, L, V, dtype=torch.bfloat16)
    cache = torch.randn(4, 16, L + R, dtype=torch.bfloat16)
    for D in (1, 2, 3, 4):
        adapter = _EpiStepAdapter(D, D, cache)
        st = plugin._LayerState(adapter, layer, True, True, epilogue=True)
        st._checked = True  # the runtime check reads vLLM internals this fake does not have
        monkeypatch.setattr(st, "epilogue_spec", lambda: None)
        adapter.slots = torch.randperm(64)[:D]
        q = torch.randn(D, H, P + R, dtype=torch.bfloat16)
        st.run(
            q,
            torch.randn(D, L, dtype=torch.bfloat16),
            torch.randn(D, 1, R, dtype=torch.bfloat16),
            torch.randint(0, 64, (D,)),
            torch.empty(D, H * V, dtype=torch.bfloat16),
        )
        fused = tokens_env == "all" or D in (1, 3)
        assert (ran[-1:] == [D]) == fused and ("vllm_bmm" in adapter.seen) != fused, D
    s = plugin.stats()
    want = [1, 2, 3, 4] if tokens_env == "all" else [1, 3]
    assert ran == want
    assert s["epilogue_tokens"] == sum(want) and s.get("epilogue_vllm_tokens", 0) == 10 - sum(want)


@pytest.mark.parametrize("stored", [False, True])
def test_epilogue_range_is_that_of_the_w_uv_the_layer_reads(monkeypatch, stored):
    """The crossover table is keyed on the W_UV format: a layer that reads the checkpoint's
    block-FP8 W_UV (FUSEMLA_VLLM_W_UK=stored) takes that row, one on vLLM's bf16 W_UV the
    other, asked once per layer."""
    import torch

    from fusemla.integrations import vllm as plugin
    from fusemla.ops.epilogue import configs as epi_configs

    monkeypatch.setenv("FUSEMLA_VLLM_EPILOGUE_TOKENS", "measured")
    asked = []
    monkeypatch.setattr(
        epi_configs,
        "fuse_token_spans",
        lambda H, fp8, be, w=False: (
            asked.append((H, fp8, w)) or (((1, 32),) if w else ((1, 1), (32, 64)))
        ),
    )
    H, P, R, L, V = 2, 8, 4, 16, 8
    rotary = types.SimpleNamespace(cos_sin_cache=torch.randn(64, R), is_neox_style=False)
    w = torch.randn(L, H, P, dtype=torch.bfloat16).permute(1, 2, 0)
    layer = _layer("l0", rotary, w, P=P, R=R, L=L, V=V)
    adapter = _EpiStepAdapter(1, 1, torch.randn(4, 16, L + R, dtype=torch.bfloat16))
    st = plugin._LayerState(adapter, layer, True, True, epilogue=True)
    monkeypatch.setattr(st, "stored", lambda: ("w_uk_t", "w_uv") if stored else None)
    q = torch.randn(1, H, P + R, dtype=torch.bfloat16)
    want = ((1, 32),) if stored else ((1, 1), (32, 64))
    assert st.epilogue_tokens(q) == want and st.epilogue_tokens(q) == want
    assert asked == [(H, st.o_fp8 is not None, stored)]


@pytest.mark.parametrize(
    "heads,fp8_out,tokens,kept",
    [
        (16, True, "measured", True),  # 1-32 tokens (stored W_UV), 1 (vLLM's)
        (128, True, "measured", False),  # no step size measured faster
        (128, True, "all", True),
        (16, False, "measured", False),  # a bf16 output: nowhere measured faster
    ],
)
def test_epilogue_left_to_vllm_where_no_step_size_is_faster(
    monkeypatch, heads, fp8_out, tokens, kept
):
    """A layer built with FUSEMLA_VLLM_EPILOGUE=1 whose heads and output have no measured range
    (configs.fuse_token_spans, on CUDA) keeps vLLM's W_UV bmm on every step and hands o_proj
    bf16, as with the epilogue off: no FP8 handoff whose rows would all go through o_proj's
    quantization and a copy. Counted and logged when built; FUSEMLA_VLLM_EPILOGUE_TOKENS=all
    keeps it everywhere."""
    import torch

    from fusemla.integrations import vllm as plugin
    from fusemla.ops import common

    monkeypatch.setattr(plugin, "_stats", plugin.Counter())
    monkeypatch.setattr(plugin, "_layers", {})
    monkeypatch.setattr(plugin, "_logged", set())
    monkeypatch.setenv("FUSEMLA_VLLM_EPILOGUE", "1")
    monkeypatch.setenv("FUSEMLA_VLLM_EPILOGUE_TOKENS", tokens)
    monkeypatch.setattr(plugin, "_structural_reason", lambda w: None)
    monkeypatch.setattr(common, "backend_of", lambda device, info=None: "cuda")
    route = dict(dtype=torch.float8_e4m3fn, group_size=128, ue8m0=False, col_major=True)

    class Adapter(_FakeAdapter):
        def o_proj_fp8_route(self, w):
            return (dict(route, kernel="K"), None) if fp8_out else (None, "o_proj is bf16")

        def o_proj(self, w):
            return w.o_proj

        def mark_compile_cache(self, key, value):
            self.marked = value

    adapter = Adapter()
    monkeypatch.setattr(plugin, "_adapter", adapter)
    rotary = types.SimpleNamespace(cos_sin_cache=torch.randn(32, 4), is_neox_style=False)
    w_uk_t = torch.randn(heads, 8, 16, dtype=torch.bfloat16)

    class Base:
        def __init__(self):
            self.__dict__.update(vars(_layer("l0", rotary, w_uk_t)))
            self.num_heads, self.o_proj = heads, object()

    wrapper = plugin._make_wrapper_class(Base)()
    st = plugin._layers[wrapper._fusemla_layer_name]
    assert st.epilogue is kept
    assert (wrapper._fusemla_o_fp8 is not None) is (kept and fp8_out)
    assert (st.o_fp8 is not None) is (kept and fp8_out)
    s = plugin.stats()
    assert s.get("layers_epilogue_vllm", 0) == (0 if kept else 1), s
    assert s.get("layers_epilogue_fp8", 0) == (1 if kept and fp8_out else 0), s
    assert adapter.marked["epilogue"] is kept
    why = plugin._epilogue_nowhere(heads, fp8_out, "cuda")
    assert (why is None) is kept
    if why is not None:
        assert f"{heads} heads" in why and "FUSEMLA_VLLM_EPILOGUE_TOKENS=all" in why
    assert plugin._epilogue_nowhere(heads, fp8_out, "interpreter") is None  # tests: everywhere


def _flashmla_wrapper(kv_cache_dtype: str):
    """The attributes structural_reason reads of a DeepSeek-V3 layer on FLASHMLA."""
    backend = types.SimpleNamespace(get_name=lambda: "FLASHMLA")
    attn = types.SimpleNamespace(
        impl=types.SimpleNamespace(),
        attn_backend=backend,
        prefill_backend=object(),
        kv_cache_dtype=kv_cache_dtype,
        head_size=576,
    )
    return types.SimpleNamespace(
        mla_attn=attn, rotary_emb=object(), kv_lora_rank=512, qk_rope_head_dim=64
    )


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("cache", ["auto", "bfloat16", "fp8", "fp8_e4m3"])
@pytest.mark.parametrize("cls", [ad.Vllm032, ad.Vllm033])
def test_flashmla_under_full_graphs_per_version_and_cache(monkeypatch, cls, cache, full):
    """FLASHMLA under full CUDA graphs is left to vLLM unless the version's adapter lists the
    (backend, cache kind) pair verified: 0.33 fuses it with both caches (the GPU suite's judge:
    FP8 at de9c208, bf16 at 4f5ec9c once the PDL trigger moved to completion); 0.32 keeps
    vLLM's path for both. Eager (no full graphs) and forced runs are fused on both."""
    from fusemla.integrations.vllm import FORCE_ENV, UNVERIFIED_FULL_GRAPH_BACKENDS

    a = cls()
    monkeypatch.setattr(a, "full_cudagraphs", lambda: full)
    monkeypatch.setattr(a, "kv_transfer_configured", lambda: False)
    w = _flashmla_wrapper(cache)
    why = a.structural_reason(w, UNVERIFIED_FULL_GRAPH_BACKENDS, set(), FORCE_ENV)
    fp8 = cache.startswith("fp8")
    if full and cls is ad.Vllm032:
        kind = "fp8" if fp8 else "bf16"
        assert why is not None and f"FLASHMLA decode backend with a {kind} cache" in why, why
        assert FORCE_ENV in why
    else:
        assert why is None, why
    assert a.structural_reason(w, UNVERIFIED_FULL_GRAPH_BACKENDS, {"FLASHMLA"}, FORCE_ENV) is None
    assert ad.Vllm033.FULL_GRAPH_VERIFIED == {("FLASHMLA", "fp8"), ("FLASHMLA", "bf16")}
    assert not ad.Vllm032.FULL_GRAPH_VERIFIED


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("cache", ["auto", "fp8"])
def test_flashmla_left_to_vllm_while_the_early_pdl_trigger_is_on(monkeypatch, cache, full):
    """FUSEMLA_PDL_TRIGGER on lets the kernel after fusemla's start before fusemla's has
    written its query; FLASHMLA's decode kernel reads without waiting, so its layers go to vLLM
    in every graph mode while the trigger is on (the reason names the variable), unless
    FUSEMLA_VLLM_FORCE_BACKENDS names FLASHMLA. Other backends, and the trigger off, are fused."""
    from fusemla.integrations import vllm as plugin

    a = ad.Vllm033()
    monkeypatch.setattr(a, "full_cudagraphs", lambda: full)
    monkeypatch.setattr(a, "kv_transfer_configured", lambda: False)
    monkeypatch.setattr(plugin, "_adapter", a)
    w = _flashmla_wrapper(cache)
    monkeypatch.delenv("FUSEMLA_PDL_TRIGGER", raising=False)
    monkeypatch.delenv(plugin.FORCE_ENV, raising=False)
    assert plugin._structural_reason(w) is None
    monkeypatch.setenv("FUSEMLA_PDL_TRIGGER", "1")
    why = plugin._structural_reason(w)
    assert why is not None and "FUSEMLA_PDL_TRIGGER is on" in why and "FLASHMLA" in why, why
    other = _flashmla_wrapper(cache)
    other.mla_attn.attn_backend = types.SimpleNamespace(get_name=lambda: "FLASH_ATTN_MLA")
    assert plugin._structural_reason(other) is None
    monkeypatch.setenv(plugin.FORCE_ENV, "FLASHMLA")
    assert plugin._structural_reason(w) is None
