"""fusemla.platform: platform facts from (backend, arch), device detection against a faked torch,
and the kernel-variant choices with their environment overrides. No kernel runs here."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from fusemla import cli, config
from fusemla import platform as plat
from fusemla.errors import FuseMLAError, FuseMLATypeError, FuseMLAValueError
from fusemla.ops.prologue import policy
from fusemla.ops.prologue.policy import (
    choose_mxfp4_path,
    choose_prologue_variant,
    mxfp4_tiles_fit,
)
from fusemla.platform import (
    PlatformInfo,
    default_fp8_weight_dtype,
    detect,
    platform_from,
    report_lines,
)

E4M3FN, E4M3FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
ENV_VARS = ("FUSEMLA_MXFP4_PATH", "FUSEMLA_PDL")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """No override from the caller's shell leaks in, and no cached GPU query leaks out."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    plat.clear_cache()
    yield
    plat.clear_cache()


def H200() -> PlatformInfo:
    return platform_from("cuda", "sm_90", "NVIDIA H200")


# --------------------------------------------------------------------------------------------
# platform_from
# --------------------------------------------------------------------------------------------

# backend, arch, fp8 dtype, native fp8, native fp4
PLATFORMS = [
    ("cuda", "sm_90", E4M3FN, True, False),  # H100 / H200
    ("cuda", "sm_90a", E4M3FN, True, False),
    ("cuda", "sm_89", E4M3FN, True, False),  # Ada
    ("cuda", "sm_86", E4M3FN, False, False),
    ("cuda", "sm_80", E4M3FN, False, False),  # A100
    ("cuda", "sm_100", E4M3FN, True, True),  # B200
    ("cuda", "sm_100a", E4M3FN, True, True),
    ("cuda", "sm_103", E4M3FN, True, True),
    ("cuda", "sm_110", E4M3FN, True, True),
    ("cuda", "sm_120", E4M3FN, True, True),  # RTX 50xx
    ("cuda", "sm_121", E4M3FN, True, True),
    ("rocm", "gfx942", E4M3FNUZ, True, False),  # MI300X / MI325X
    ("rocm", "gfx940", E4M3FNUZ, True, False),
    ("rocm", "gfx941", E4M3FNUZ, True, False),
    ("rocm", "gfx950", E4M3FN, True, True),  # MI350 / MI355X
    ("rocm", "gfx90a", E4M3FN, False, False),  # MI250
    ("rocm", "gfx1100", E4M3FN, False, False),  # RDNA3
    ("interpreter", None, E4M3FN, True, False),
    ("cpu", None, E4M3FN, False, False),
]


@pytest.mark.parametrize(
    "backend, arch, fp8, native_fp8, native_fp4",
    PLATFORMS,
    ids=[f"{b}-{a}" for b, a, *_ in PLATFORMS],
)
def test_platform_from(backend, arch, fp8, native_fp8, native_fp4):
    info = platform_from(backend, arch, "some device")
    assert info.backend == backend
    assert info.arch == arch
    assert info.device_name == "some device"
    assert info.fp8_dtype == fp8
    assert default_fp8_weight_dtype(info) == fp8
    assert info.native_fp8 is native_fp8
    assert info.native_fp4 is native_fp4
    assert info.torch_version == torch.__version__
    # the version of the triton this process imports (None only where none is installed)
    try:
        import triton

        expected = triton.__version__
    except ImportError:
        expected = None
    assert info.triton_version == expected


def test_h200_facts():
    info = H200()
    assert (info.fp8_dtype, info.native_fp8, info.native_fp4) == (E4M3FN, True, False)
    assert info.device_name == "NVIDIA H200"


def test_platform_info_is_frozen():
    with pytest.raises(AttributeError):
        H200().native_fp4 = True  # type: ignore[misc]


def test_platform_from_normalizes():
    full = platform_from("ROCm", "gfx942:sramecc+:xnack-")
    assert (full.backend, full.arch, full.fp8_dtype) == ("rocm", "gfx942", E4M3FNUZ)
    assert platform_from("hip", "gfx950").backend == "rocm"
    assert platform_from(" CUDA ", "SM_90A").arch == "sm_90a"
    assert platform_from("cpu").device_name is None


@pytest.mark.parametrize(
    "backend, arch, argument",
    [
        ("vulkan", None, "backend"),
        ("", None, "backend"),
        (None, None, "backend"),
        ("cuda", None, "arch"),  # a GPU backend needs its arch
        ("rocm", None, "arch"),
        ("cuda", "gfx942", "arch"),  # arch of the other vendor
        ("rocm", "sm_90", "arch"),
        ("cuda", "sm90", "arch"),
        ("cuda", "sm_9", "arch"),
        ("cuda", "sm_90x", "arch"),
        ("cuda", "sm_05", "arch"),
        ("rocm", "gfx", "arch"),
        ("rocm", "gfx94z", "arch"),
        ("cuda", 90, "arch"),
        ("cpu", "sm_90", "arch"),  # no arch without a GPU
        ("interpreter", "gfx942", "arch"),
    ],
)
def test_platform_from_rejects(backend, arch, argument):
    with pytest.raises(FuseMLAValueError, match=rf"^{argument}:"):
        platform_from(backend, arch)


def test_platform_from_rejects_device_name_type():
    with pytest.raises(FuseMLATypeError, match="^device_name:"):
        platform_from("cuda", "sm_90", device_name=0)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# choose_mxfp4_path
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend, arch, path",
    [
        ("cuda", "sm_90", "dequant"),
        ("cuda", "sm_80", "dequant"),
        ("cuda", "sm_100", "dot_scaled"),
        ("cuda", "sm_120", "dot_scaled"),
        ("rocm", "gfx942", "dequant"),
        ("rocm", "gfx950", "dot_scaled"),
        ("interpreter", None, "dequant"),
        ("cpu", None, "dequant"),
    ],
)
def test_mxfp4_path_auto(monkeypatch, backend, arch, path):
    info = platform_from(backend, arch)
    assert choose_mxfp4_path(info) == path
    monkeypatch.setenv("FUSEMLA_MXFP4_PATH", "auto")
    assert choose_mxfp4_path(info) == path


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "gfx942", "gfx950", None])
def test_mxfp4_path_forced_dequant(monkeypatch, arch):
    monkeypatch.setenv("FUSEMLA_MXFP4_PATH", "Dequant")
    backend = "cpu" if arch is None else ("cuda" if arch.startswith("sm") else "rocm")
    assert choose_mxfp4_path(platform_from(backend, arch)) == "dequant"


def test_mxfp4_path_forced_dot_scaled(monkeypatch):
    monkeypatch.setenv("FUSEMLA_MXFP4_PATH", "dot_scaled")
    assert choose_mxfp4_path(platform_from("cuda", "sm_100")) == "dot_scaled"
    assert choose_mxfp4_path(platform_from("rocm", "gfx950")) == "dot_scaled"
    # the interpreter emulates tl.dot_scaled, so the variant can be tested on a CPU
    assert choose_mxfp4_path(platform_from("interpreter")) == "dot_scaled"
    monkeypatch.setenv("FUSEMLA_MXFP4_PATH", "dot-scaled")
    assert choose_mxfp4_path(platform_from("cuda", "sm_100")) == "dot_scaled"


@pytest.mark.parametrize(
    "backend, arch, why",
    [
        ("cuda", "sm_90", "no hardware FP4"),
        ("rocm", "gfx942", "no hardware FP4"),
        ("cpu", None, "PyTorch fallback"),
    ],
)
def test_mxfp4_path_dot_scaled_without_fp4_raises(monkeypatch, backend, arch, why):
    monkeypatch.setenv("FUSEMLA_MXFP4_PATH", "dot_scaled")
    with pytest.raises(FuseMLAValueError, match="FUSEMLA_MXFP4_PATH=dot_scaled") as err:
        choose_mxfp4_path(platform_from(backend, arch))
    assert why in str(err.value)
    if arch is not None:
        assert arch in str(err.value)


def test_mxfp4_path_invalid_env(monkeypatch):
    monkeypatch.setenv("FUSEMLA_MXFP4_PATH", "fp4")
    with pytest.raises(FuseMLAValueError, match="FUSEMLA_MXFP4_PATH.*'fp4'"):
        choose_mxfp4_path(platform_from("cuda", "sm_100"))
    with pytest.raises(FuseMLATypeError, match="^info:"):
        choose_mxfp4_path(None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# detect(): this machine, and faked ROCm / CUDA devices
# --------------------------------------------------------------------------------------------


def test_detect_without_gpu_follows_triton_interpret(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    info = detect()
    assert (info.backend, info.arch, info.device_name) == ("interpreter", None, None)
    assert detect("cpu").backend == "interpreter"
    # the flag is re-read on every call: setting it after import (or unsetting it) takes effect
    monkeypatch.delenv("TRITON_INTERPRET")
    info = detect()
    assert (info.backend, info.arch) == ("cpu", None)
    assert info.native_fp8 is False and info.fp8_dtype == E4M3FN
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert detect(torch.device("cpu")).backend == "cpu"


def test_detect_on_this_machine(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert detect().backend == "interpreter"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert detect().backend == "cpu"
    with pytest.raises(FuseMLAValueError, match="^device:.*no CUDA/ROCm GPU"):
        detect("cuda")


def _fake_gpus(monkeypatch, *, hip: str | None, count: int = 1, current: int = 0):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    calls: list[tuple[str, int]] = []
    return calls


def fake_rocm(
    monkeypatch, gcn: str = "gfx942:sramecc+:xnack-", name: str = "AMD Instinct MI300X", **kw
) -> list:
    calls = _fake_gpus(monkeypatch, hip="6.2.41133", **kw)

    def props(index):
        calls.append(("props", index))
        return SimpleNamespace(gcnArchName=gcn, name=name, major=9, minor=4)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    return calls


def fake_cuda(monkeypatch, capability=(9, 0), name: str = "NVIDIA H200", **kw) -> list:
    calls = _fake_gpus(monkeypatch, hip=None, **kw)

    def cap(index):
        calls.append(("capability", index))
        return capability

    def dev_name(index=None):
        calls.append(("name", index))
        return name

    monkeypatch.setattr(torch.cuda, "get_device_capability", cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", dev_name)
    return calls


def test_detect_fake_rocm_mi300(monkeypatch):
    fake_rocm(monkeypatch)
    info = detect()
    assert (info.backend, info.arch, info.device_name) == ("rocm", "gfx942", "AMD Instinct MI300X")
    assert info.fp8_dtype == E4M3FNUZ
    assert (info.native_fp8, info.native_fp4) == (True, False)
    assert choose_mxfp4_path(info) == "dequant"
    assert detect("cuda") == info == detect(torch.device("cuda:0")) == detect(0)


def test_detect_fake_rocm_mi355_and_mi250(monkeypatch):
    fake_rocm(monkeypatch, gcn="gfx950:sramecc+:xnack-", name="AMD Instinct MI355X")
    info = detect()
    assert (info.arch, info.fp8_dtype, info.native_fp8, info.native_fp4) == (
        "gfx950",
        E4M3FN,
        True,
        True,
    )
    assert choose_mxfp4_path(info) == "dot_scaled"
    plat.clear_cache()
    fake_rocm(monkeypatch, gcn="gfx90a:sramecc+:xnack-", name="AMD Instinct MI250X")
    info = detect()
    assert (info.arch, info.native_fp8, info.native_fp4) == ("gfx90a", False, False)


def test_detect_fake_rocm_without_arch_name(monkeypatch):
    fake_rocm(monkeypatch, gcn="")
    with pytest.raises(FuseMLAError, match="gcnArchName"):
        detect()


def test_detect_fake_cuda_h200(monkeypatch):
    calls = fake_cuda(monkeypatch)
    info = detect()
    assert info == platform_from("cuda", "sm_90", "NVIDIA H200")
    assert (info.fp8_dtype, info.native_fp8, info.native_fp4) == (E4M3FN, True, False)
    assert choose_mxfp4_path(info) == "dequant"
    assert calls == [("capability", 0), ("name", 0)]


def test_detect_fake_cuda_blackwell(monkeypatch):
    fake_cuda(monkeypatch, capability=(10, 0), name="NVIDIA B200")
    info = detect()
    assert (info.arch, info.native_fp8, info.native_fp4) == ("sm_100", True, True)
    assert choose_mxfp4_path(info) == "dot_scaled"


def test_detect_caches_per_device_index(monkeypatch):
    calls = fake_cuda(monkeypatch, count=2, current=1)
    first = detect()
    assert calls == [("capability", 1), ("name", 1)]  # the current device, not device 0
    assert detect() is first and detect("cuda:1") is first
    assert len(calls) == 2  # cached
    detect("cuda:0")
    assert calls[2:] == [("capability", 0), ("name", 0)]
    # the cache is not consulted while the interpreter flag is set ...
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert detect().backend == "interpreter"
    # ... and is used again once it is cleared
    monkeypatch.delenv("TRITON_INTERPRET")
    assert detect() is first
    plat.clear_cache()
    assert detect() == first and len(calls) == 6


def test_detect_gpu_with_interpreter_or_cpu_device(monkeypatch):
    fake_cuda(monkeypatch)
    assert detect("cpu").backend == "cpu"  # CPU tensors without the interpreter: the fallback
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert detect().backend == "interpreter"  # kernels are interpreted even on GPU tensors
    assert detect("cuda").backend == "interpreter"


@pytest.mark.parametrize(
    "device, exc, match",
    [
        ("cuda:1", FuseMLAValueError, "sees 1 GPU"),
        ("meta", FuseMLAValueError, "CPU or CUDA/ROCm"),
        ("not a device", FuseMLAValueError, "not a device"),
        (-1, FuseMLAValueError, "not a device"),
        (3, FuseMLAValueError, "sees 1 GPU"),
        (1.5, FuseMLATypeError, "torch.device, str, int or None"),
    ],
)
def test_detect_rejects_bad_devices(monkeypatch, device, exc, match):
    fake_cuda(monkeypatch)
    with pytest.raises(exc, match=f"^device:.*{match}"):
        detect(device)


# --------------------------------------------------------------------------------------------
# report and `fusemla info`
# --------------------------------------------------------------------------------------------


def _report(info: PlatformInfo) -> str:
    """The platform report and the environment table, as ``fusemla info`` prints them."""
    from fusemla import envs

    lines = report_lines(info) + policy.report_lines(info) + envs.report()
    assert all(isinstance(line, str) for line in lines)
    return "\n".join(lines)


def test_report_h200():
    text = _report(H200())
    assert "platform: cuda, sm_90, NVIDIA H200" in text
    assert "FP8 dtype: float8_e4m3fn" in text
    assert "native FP8 dots: yes" in text and "native FP4 (MX) dots: no" in text
    assert "FP8 weights: upcast to the activations' dtype (bf16/fp16) in registers" in text
    assert "pick a weight format for memory, not prologue speed" in text
    assert "MXFP4 weights: dequant" in text
    assert "FUSEMLA_MXFP4_PATH: not set -> 'auto'" in text


def test_report_mi300_with_overrides(monkeypatch):
    monkeypatch.setenv("FUSEMLA_MXFP4_PATH", "dequant")
    text = _report(platform_from("rocm", "gfx942", "AMD Instinct MI300X"))
    assert "float8_e4m3fnuz" in text
    assert "FP8 weights: upcast to the activations' dtype" in text
    assert "FUSEMLA_MXFP4_PATH: 'dequant' -> 'dequant'" in text


def test_report_never_raises_on_bad_env(monkeypatch):
    monkeypatch.setenv("FUSEMLA_PDL", "sometimes")
    monkeypatch.setenv("FUSEMLA_MXFP4_PATH", "dot_scaled")
    text = _report(H200())
    assert "FUSEMLA_PDL: INVALID" in text and "'sometimes'" in text
    assert "programmatic dependent launch: error:" in text
    assert "MXFP4 weights: error:" in text and "no hardware FP4" in text


@pytest.mark.parametrize("backend", ["interpreter", "cpu"])
def test_report_without_gpu(backend):
    text = _report(platform_from(backend))
    assert f"platform: {backend}, no GPU arch, CPU" in text


def test_info_lines_include_the_platform(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lines = cli.info_lines()
    assert lines[0].startswith("fusemla ")
    assert any(line.startswith("platform: interpreter") for line in lines), lines
    fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    text = "\n".join(cli.info_lines())
    assert "platform: cuda, sm_90, NVIDIA H200" in text
    assert "GPU: CUDA available, 1 device(s): NVIDIA H200" in text


def test_info_lines_survive_a_detection_failure(monkeypatch):
    fake_rocm(monkeypatch, gcn="")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "AMD Instinct MI300X")
    lines = cli.info_lines()
    assert any(line.startswith("platform: unknown (detection failed") for line in lines), lines


def test_import_does_not_import_triton():
    code = (
        "import sys, fusemla.platform as p; assert 'triton' not in sys.modules; "
        "p.platform_from('cpu'); print('ok')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


# --------------------------------------------------------------------------------------------
# choose_prologue_variant: the one decision the launcher and `info` share
# --------------------------------------------------------------------------------------------


def test_prologue_variant_plain_and_fp8():
    v = choose_prologue_variant(H200(), weight_format="plain")
    assert (v.weight_format, v.mxfp4_path) == ("plain", None)
    assert v.kernel_flags == (0, False)
    # FP8 weights have one variant (upcast in registers), whatever the chip
    for info in (H200(), platform_from("cuda", "sm_80"), platform_from("rocm", "gfx942")):
        v = choose_prologue_variant(info, weight_format="fp8")
        assert (v.weight_format, v.mxfp4_path, v.kernel_flags) == ("fp8", None, (1, False))
    with pytest.raises(FuseMLAValueError, match="weight_format"):
        choose_prologue_variant(H200(), weight_format="int4")


@pytest.mark.parametrize(
    "P,L,block_l,fits",
    [
        (128, 512, 128, True),
        (128, 512, 256, True),
        (96, 512, 128, False),
        (64, 48, 32, False),
        (16, 64, 32, False),
    ],
)
def test_mxfp4_tiles_fit(P, L, block_l, fits):
    assert mxfp4_tiles_fit(P, L, block_l) is fits


def test_prologue_variant_mxfp4(monkeypatch):
    sm100 = platform_from("cuda", "sm_100")
    monkeypatch.delenv("FUSEMLA_MXFP4_PATH", raising=False)
    dims = dict(P=128, L=512, block_l=128)
    assert choose_prologue_variant(sm100, weight_format="mxfp4", **dims).kernel_flags == (2, True)
    assert choose_prologue_variant(H200(), weight_format="mxfp4", **dims).mxfp4_path == "dequant"
    # auto on a native-FP4 chip with tiles tl.dot_scaled cannot take: dequant, by design
    odd = dict(P=96, L=512, block_l=128)
    assert choose_prologue_variant(sm100, weight_format="mxfp4", **odd).mxfp4_path == "dequant"
    # forced: raises instead of downgrading silently
    monkeypatch.setenv("FUSEMLA_MXFP4_PATH", "dot_scaled")
    with pytest.raises(FuseMLAValueError, match=r"FUSEMLA_MXFP4_PATH=dot_scaled.*P=96"):
        choose_prologue_variant(sm100, weight_format="mxfp4", **odd)
    with pytest.raises(FuseMLAValueError, match=r"FUSEMLA_MXFP4_PATH=dot_scaled"):
        choose_prologue_variant(H200(), weight_format="mxfp4", **dims)


def test_report_shows_the_layer_flags(monkeypatch):
    monkeypatch.setenv("FUSEMLA_FUSED_PREFILL", "off")
    monkeypatch.setenv("FUSEMLA_FUSED_DECODE", "maybe")
    text = _report(H200())
    assert "FUSEMLA_FUSED_PREFILL: 'off' -> False" in text
    assert "FUSEMLA_FUSED_DECODE: INVALID" in text  # reported, never raised


@pytest.mark.parametrize(
    "value, mode",
    [
        *[(v, "on") for v in ("on", "1", "true", "TRUE", " On ", "yes")],
        *[(v, "off") for v in ("off", "0", "false", "OFF", "no")],
        *[(v, "auto") for v in ("auto", "AUTO", "", "  ")],
    ],
)
def test_pdl_mode_spellings(monkeypatch, value, mode):
    monkeypatch.setenv("FUSEMLA_PDL", value)
    assert config.pdl_mode() == mode


@pytest.mark.parametrize("value", ["maybe", "2", "enable"])
def test_pdl_mode_invalid(monkeypatch, value):
    monkeypatch.setenv("FUSEMLA_PDL", value)
    with pytest.raises(FuseMLAValueError, match="FUSEMLA_PDL") as err:
        config.pdl_mode()
    assert repr(value) in str(err.value)


def test_pdl_choice(monkeypatch):
    monkeypatch.delenv("FUSEMLA_PDL", raising=False)
    h200 = platform_from("cuda", "sm_90")
    ok = plat.supports_pdl(h200)
    assert ok is (tuple(int(x) for x in h200.triton_version.split(".")[:2]) >= (3, 4))
    assert plat.supports_pdl(platform_from("cuda", "sm_89")) is False
    assert plat.supports_pdl(platform_from("rocm", "gfx942")) is False
    assert plat.supports_pdl(platform_from("interpreter")) is False
    assert policy.choose_pdl(h200) is ok
    monkeypatch.setenv("FUSEMLA_PDL", "off")
    assert policy.choose_pdl(h200) is False
    monkeypatch.setenv("FUSEMLA_PDL", "on")
    with pytest.raises(FuseMLAValueError, match=r"FUSEMLA_PDL=on.*sm_89"):
        policy.choose_pdl(platform_from("cuda", "sm_89"))
    monkeypatch.setenv("FUSEMLA_PDL", "sometimes")
    with pytest.raises(FuseMLAValueError, match="FUSEMLA_PDL"):
        policy.choose_pdl(h200)


def test_info_prints_the_plan():
    """`fusemla info` asks the plan function (no second derivation): under the interpreter one
    row per weight format and decode batch, with the bucket the tile tables give that batch."""
    from fusemla.ops.epilogue import configs as epi_configs
    from fusemla.ops.prologue import configs

    rows = cli.plan_lines(platform_from("interpreter"))
    assert rows[0].startswith("  launch plan at H=16")
    body, epi = rows[1:7], rows[7:]
    assert not any("error" in r for r in rows), rows
    for r, n in zip(body, (1, 64, 512, 1, 64, 512)):
        assert f"{n:>3} decode tokens: {configs.batch_bucket(n)} tiles" in r, r
    # the epilogue's plan: 2 weight formats x 2 outputs x 4 batches, its own buckets; the
    # interpreter's tiles are the tensor cores' form (MMA) at every batch
    ns = cli.EPILOGUE_INFO_TOKENS
    assert epi[0].startswith("  epilogue plan at H=16") and len(epi) == 2 + 4 * len(ns), epi
    rows_ = epi[1:-1]
    for r, n in zip(rows_, ns * 4):
        assert f"{n:>3} tokens: {epi_configs.batch_bucket(n)} tiles" in r, r
        assert " MMA" in r and "GEMV" not in r, r
    assert all("fp8 out" in r and "BLOCK_V=128" in r for r in rows_ if "fp8 out" in r)
    # then where the vLLM plugin keeps vLLM's bmm: the crossover table itself
    r = epi_configs.describe_spans(epi_configs.fuse_token_spans(16, True, "cuda"))
    want = f"16 heads fp8 out {r}"
    assert "epilogue in vLLM, fused on steps of" in epi[-1] and want in epi[-1], epi[-1]
    # on an H200 (planned here, on the CPU) the few-token rows name the GEMV forms the table
    # picks: one token per program at one token, two-row tiles in turn at four (bf16 out)
    cuda = cli.epilogue_plan_lines(platform_from("cuda", "sm_90"), torch.device("cpu"))
    picked = {
        (r.split(",")[0].strip(), r.split(",")[1].strip(), int(r.split(":")[0].split()[-2])): r
        for r in cuda[1:-1]
    }
    one = picked["bf16 W_UV", "bf16 out", 1]
    assert " GEMV," in one and "BLOCK_T=1 " in one, one
    assert " GEMV rows," in picked["bf16 W_UV", "bf16 out", 4]
    assert " GEMV rows," in picked["fp8-block W_UV", "bf16 out", 4]
    assert " GEMV SPLIT=2," in picked["fp8-block W_UV", "fp8 out", 1]
    assert " MMA" in picked["bf16 W_UV", "bf16 out", 64]
    assert cli.plan_lines(platform_from("cpu")) == [
        "  launch plan: none (no Triton backend here: the PyTorch fallback runs)"
    ]
