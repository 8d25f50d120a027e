"""``engine_run.py``'s ``-fp8`` shapes: the same model as the plain shape, saved the way
DeepSeek-V3's checkpoint is (block-FP8 decoder-layer linear weights with ``weight_scale_inv``,
``quantization_config`` in config.json), and its ``-mtp`` shapes (one multi-token-prediction
layer more). Needs transformers and safetensors, not vLLM."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_run  # noqa: E402

SHAPE = "base"  # the smallest shape: 2 layers, hidden 256, q_lora 96 (partial 128-blocks)
LINEARS = (
    "self_attn.q_a_proj",
    "self_attn.q_b_proj",
    "self_attn.kv_a_proj_with_mqa",
    "self_attn.kv_b_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8models")
    plain, fp8 = root / SHAPE, root / (SHAPE + engine_run.FP8_SUFFIX)
    engine_run.make_model(str(plain), SHAPE)
    engine_run.make_model(str(fp8), SHAPE + engine_run.FP8_SUFFIX)
    return plain, fp8


def _fp8_error_ok(deq, w, scale_full) -> bool:
    # e4m3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 relative for normals, within
    # half the smallest subnormal (2^-10, in units of the block's scale) below them
    return bool(((deq - w).abs() <= w.abs() * 2.0**-4 + scale_full * 2.0**-10 + 1e-30).all())


def test_shape_names():
    assert engine_run.split_fp8("v3-h16-fp8") == ("v3-h16", True)
    assert engine_run.split_fp8("v3-h16") == ("v3-h16", False)
    assert engine_run.shape_dims("v3-h128-fp8") == engine_run.SHAPES["v3-h128"]
    assert engine_run.shape_dims("seed:3-fp8") == engine_run.shape_from_seed(3)
    assert "base-fp8" in engine_run.shape_names() and "base" in engine_run.shape_names()
    for bad in ("nope", "base-fp16", "seed:x"):
        with pytest.raises(Exception, match="unknown shape"):
            engine_run._shape_arg(bad)


def test_quantize_blocks_edges():
    torch.manual_seed(1)
    w = torch.randn(200, 130) * 0.05
    w[128:, 128:] = 0.0  # an all-zero (partial) block
    codes, scale = engine_run.quantize_fp8_blocks(w)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (2, 2)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    deq = engine_run.dequantize_fp8_blocks(codes, scale)
    assert torch.isfinite(deq).all() and (deq[128:, 128:] == 0).all()
    # every non-zero block's largest element is coded as +-448
    amax = codes.float().abs()
    assert amax[:128, :128].max() == 448 and amax[128:, :128].max() == 448
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :130]
    assert _fp8_error_ok(deq, w, full)


def test_fp8_checkpoint(models):
    plain, fp8 = models
    files = sorted(p.name for p in fp8.iterdir())
    assert "model.safetensors" in files and "model.safetensors.index.json" not in files
    assert not [f for f in files if f.startswith("model-")]
    cfg = json.loads((fp8 / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    }
    cfg_plain = json.loads((plain / "config.json").read_text())
    assert "quantization_config" not in cfg_plain
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == cfg_plain
    meta = json.loads((fp8 / "fusemla_shape.json").read_text())
    meta_plain = json.loads((plain / "fusemla_shape.json").read_text())
    assert meta.pop("fp8_blocks") == [128, 128] and meta == meta_plain

    ref = load_file(str(plain / "model.safetensors"))
    got = load_file(str(fp8 / "model.safetensors"))
    layers = cfg["num_hidden_layers"]
    quantized = {f"model.layers.{i}.{m}.weight" for i in range(layers) for m in LINEARS}
    assert quantized <= set(ref)
    assert set(got) == set(ref) | {k + "_scale_inv" for k in quantized}
    for name, w in ref.items():
        t = got[name]
        assert t.shape == w.shape, name
        if name not in quantized:  # embeddings, lm_head, norms: untouched
            assert w.dtype == torch.bfloat16 and t.dtype == torch.bfloat16, name
            assert torch.equal(t, w), name
            continue
        assert t.dtype == torch.float8_e4m3fn, name
        s = got[name + "_scale_inv"]
        n, k = w.shape
        assert s.dtype == torch.float32, name
        assert s.shape == (math.ceil(n / 128), math.ceil(k / 128)), (name, s.shape)
        deq = engine_run.dequantize_fp8_blocks(t, s)
        full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        wf = w.float()
        assert _fp8_error_ok(deq, wf, full), name
        # the block max maps to 448, so the error is at most half an e4m3 step at 256..448 (bf16
        # weights often sit exactly on such a tie: the slack is fp32 rounding of w / scale)
        assert ((deq - wf).abs() <= full * 16 * (1 + 1e-4)).all(), name
        assert torch.allclose(s * 448, _block_absmax(wf), rtol=1e-6, atol=0), name
    for i in range(layers):  # names vLLM's DeepSeek-V2/V3 loader reads
        assert f"model.layers.{i}.self_attn.kv_b_proj.weight_scale_inv" in got


def _block_absmax(w):
    n, k = w.shape
    gn, gk = math.ceil(n / 128), math.ceil(k / 128)
    p = torch.zeros(gn * 128, gk * 128)
    p[:n, :k] = w.abs()
    return p.view(gn, 128, gk, 128).amax(dim=(1, 3))


def test_mtp_shape(tmp_path):
    """``-mtp`` (before ``-fp8``): the shape's dims, one decoder layer more saved as DeepSeek-V3's
    multi-token-prediction layer: config ``num_hidden_layers`` the shape's, ``num_nextn_predict
    _layers`` 1, the MTP layer's own tensors beside its decoder weights (a MoE layer: the
    shape's layers are dense), the router's bias read by noaux_tc."""
    assert engine_run.split_mtp("v3-h16-mtp") == ("v3-h16", True)
    assert engine_run.split_mtp("v3-h16-mtp-fp8") == ("v3-h16-fp8", True)
    assert engine_run.split_mtp("v3-h16-fp8") == ("v3-h16-fp8", False)
    assert engine_run.shape_dims("base-mtp-fp8") == engine_run.SHAPES["base"]
    assert engine_run._shape_arg("seed:3-mtp") == "seed:3-mtp"
    path = tmp_path / "base-mtp"
    engine_run.make_model(str(path), "base-mtp")
    cfg = json.loads((path / "config.json").read_text())
    layers = engine_run.SHAPES["base"][4]
    assert cfg["num_hidden_layers"] == layers and cfg["num_nextn_predict_layers"] == 1
    assert cfg["topk_method"] == "noaux_tc"
    t = load_file(str(path / "model.safetensors"))
    pre = f"model.layers.{layers}."
    hidden = t["model.embed_tokens.weight"].shape[1]
    assert t[pre + "eh_proj.weight"].shape == (hidden, 2 * hidden)
    assert torch.equal(t[pre + "shared_head.head.weight"], t["lm_head.weight"])
    for k in ("enorm", "hnorm", "shared_head.norm"):
        assert torch.equal(
            t[pre + k + ".weight"], torch.ones(hidden, dtype=t[pre + k + ".weight"].dtype)
        )
    assert pre + "self_attn.kv_b_proj.weight" in t and pre + "mlp.gate.weight" in t
    assert pre + "mlp.gate.e_score_correction_bias" in t
    assert not any(k.startswith(f"model.layers.{layers + 1}.") for k in t)
    assert json.loads((path / "fusemla_shape.json").read_text())["mtp_layers"] == 1
