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


def _layer(name, rotary, w_uk_t, P=8, R=4, L=16):
    attn = types.SimpleNamespace(layer_name=name, W_UK_T=w_uk_t, kv_cache_dtype="auto")
    return types.SimpleNamespace(
        mla_attn=attn,
        rotary_emb=rotary,
        qk_nope_head_dim=P,
        qk_rope_head_dim=R,
        kv_lora_rank=L,
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
