"""CPU feature detection and the per-machine precision choice (`--dtype auto`), on /proc/cpuinfo
texts of three kinds of x86 CPU and an ARM one, plus this machine's (which must not crash)."""

import warnings

import pytest
import torch

from lmforge.errors import ConfigError
from lmforge.infer import quantize
from lmforge.infer.cpu_features import cpu_features, parse_cpuinfo, read_cpu_features
from lmforge.infer.quantize import auto_dtype, describe_kernels, resolve_dtype

ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx f16c fma avx2 bmi2 sha_ni
"""
SAPPHIRE_RAPIDS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
ZEN4 = """model name\t: AMD EPYC 9654
flags\t\t: avx2 avx512f avx512_vnni avx512_bf16
"""
GRAVITON = """processor\t: 0
Features\t: fp asimd bf16 i8mm sve
"""


def test_parse_cpuinfo_reads_the_first_processor():
    model, flags = parse_cpuinfo(ZEN3 + "\nprocessor\t: 1\nmodel name\t: other\nflags\t: sse\n")
    assert model == "AMD EPYC 7B13" and "avx2" in flags and "sse" not in flags


@pytest.mark.parametrize(
    "text, capability, native, amx",
    [
        (ZEN3, "AVX2", False, False),
        (SAPPHIRE_RAPIDS, "AVX512", True, True),
        (ZEN4, "AVX512", True, False),
        (ZEN4, "AVX2", False, False),
    ],  # fmt: skip
)
def test_native_bf16_needs_amx_or_avx512_bf16_kernels(monkeypatch, text, capability, native, amx):
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    f = read_cpu_features(text, capability)
    assert (f.native_bf16, f.amx, f.has("AVX2")) == (native, amx, True)
    dtype, why = auto_dtype("cpu", f)
    assert dtype == (torch.bfloat16 if native else torch.float32)
    assert f.model in why and ("run on AMX" in why) == amx
    assert ("no AMX" in f.summary()) != amx


def test_arm_and_missing_cpuinfo_fall_back_to_fp32(monkeypatch):
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    arm = read_cpu_features(GRAVITON, "DEFAULT")
    assert not arm.x86 and not arm.native_bf16 and "aarch64" in arm.summary()
    assert auto_dtype("cpu", arm)[0] == torch.float32
    empty = read_cpu_features("", "unknown")  # no /proc/cpuinfo (macOS, Windows)
    assert empty.flags == frozenset() and auto_dtype("cpu", empty)[0] == torch.float32


def test_this_machine_is_detected_once():
    assert cpu_features() is cpu_features()
    assert resolve_dtype("auto", announce=None) in (torch.float32, torch.bfloat16)


def test_resolve_dtype_names_and_auto_line(capsys, monkeypatch):
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    monkeypatch.setattr(quantize, "native_kernels", lambda: None)  # torch's kernels
    quantize._say_once.cache_clear()
    zen3 = read_cpu_features(ZEN3, "AVX2")
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype(None) is None
    assert resolve_dtype("auto", "cpu", zen3, announce="int8") is torch.float32
    line = capsys.readouterr().err.strip()
    assert (
        line.startswith("dtype auto: float32 (AMD EPYC 7B13 (AVX2;")
        and "_weight_int8pack_mm" in line
    )
    with pytest.raises(ConfigError, match="dtype must be one of"):
        resolve_dtype("int8")


def test_forced_bf16_on_an_emulating_cpu_warns_once_with_the_fallback(monkeypatch):
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    quantize._warn_once.cache_clear()
    zen3 = read_cpu_features(ZEN3, "AVX2")
    spr = read_cpu_features(SAPPHIRE_RAPIDS, "AVX512")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_dtype("bfloat16", "cpu", spr) is torch.bfloat16  # native: silent
        for _ in range(3):
            assert resolve_dtype("bfloat16", "cpu", zen3) is torch.bfloat16
    assert len(caught) == 1 and "--dtype auto would use float32" in str(caught[0].message)


def test_kernel_description_follows_the_activation_dtype(monkeypatch):
    monkeypatch.setattr(quantize, "native_kernels", lambda: None)  # torch's kernels
    zen3 = read_cpu_features(ZEN3, "AVX2")  # no bf16 units: the fp32 GEMM stays fp32
    monkeypatch.setattr(quantize, "cpu_features", lambda: zen3)
    fp32 = describe_kernels(torch.float32, "int8")
    assert "bfloat16-rounded inputs" in fp32 and "float32 GEMM on dequantised" in fp32
    bf16 = describe_kernels(torch.bfloat16, "int8")
    assert "rounded" not in bf16 and "bf16 copy of the int8 values" in bf16
    assert describe_kernels(torch.float32, None) == ""


def test_kernel_description_names_the_native_kernel_when_built(monkeypatch):
    class Built:
        variant = "avx2"

    monkeypatch.setattr(quantize, "native_kernels", lambda: Built())
    for mode in ("int8", "int4"):
        line = describe_kernels(torch.float32, mode)
        assert f"lmforge's avx2 {mode} kernel" in line and "pack_mm" not in line
        assert "every batch size" in line and "GEMM" not in line
    # unquantised 16-bit weights: the dense matmul, which arithmetic it uses, for which rows
    for variant, how, rows in (("avx512_bf16", "AVX512-BF16 dot", "up to 8 rows"),
                               ("avx2", "fp32 multiply-adds", "every batch size")):  # fmt: skip
        Built.variant = variant
        line = describe_kernels(torch.bfloat16, None)
        assert f"bf16 weights: lmforge's {variant} dense matmul" in line
        assert how in line and rows in line
    assert "fp16 weights" in describe_kernels(torch.float16, None)
    assert describe_kernels(torch.float32, None) == ""
    assert describe_kernels(torch.bfloat16, None, device="cuda") == ""
