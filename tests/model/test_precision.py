import math

import pytest
import torch

from lmforge.cli.main import main
from lmforge.model.precision import (
    dequantize_fp8,
    dtype_table,
    fp8_round_trip,
    fp8_scale,
    has_fp8_matmul,
    quantize_fp8,
)
from lmforge.train.optim import LossScaler


def row(name):
    return next(r for r in dtype_table() if r["name"] == name)


def test_dtype_table_spec_corrections():
    assert row("float16")["max"] == 65504
    assert row("float8_e4m3fn")["max"] == 448
    assert row("float8_e4m3fn")["smallest_normal"] == 2.0**-6
    assert row("float8_e5m2")["max"] == 57344
    assert row("float8_e5m2")["smallest_normal"] == 2.0**-14
    assert (row("int4")["min"], row("int4")["max"]) == (-8, 7)
    assert (row("int8")["min"], row("int8")["max"]) == (-128, 127)
    assert row("bfloat16")["eps"] == 2.0**-7 and row("float16")["eps"] == 2.0**-10


@pytest.mark.parametrize("fmt, mantissa_bits", [("e4m3", 3), ("e5m2", 2)])
@pytest.mark.parametrize("dim", [None, 0, 1])
def test_fp8_round_trip_error_is_within_half_an_ulp(fmt, mantissa_bits, dim):
    torch.manual_seed(0)
    x = torch.randn(64, 32) * 5
    q, scale = quantize_fp8(x, fmt, dim)
    assert q.dtype == {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    back = dequantize_fp8(q, scale)
    normal = (x.abs() * scale) >= torch.finfo(q.dtype).smallest_normal
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -(mantissa_bits + 1) + 1e-6
    assert (x * scale).abs().max() <= torch.finfo(q.dtype).max * (1 + 1e-6)


def test_scale_maps_amax_to_format_max():
    x = torch.tensor([[1.0, -4.0], [0.5, 0.25]])
    assert fp8_scale(x).item() == 448 / 4
    assert torch.equal(fp8_scale(x, dim=0).flatten(), torch.tensor([448 / 4, 448 / 0.5]))
    assert torch.equal(fp8_scale(x, "e5m2", dim=1).flatten(), torch.tensor([57344, 57344 / 4]))


def test_per_channel_scales_rescue_small_channels():
    torch.manual_seed(0)
    w = torch.randn(4, 64) * torch.tensor([[1e-4], [1e-2], [1.0], [100.0]])
    small = slice(0, 1)
    tensor_err = (fp8_round_trip(w)[small] - w[small]).norm() / w[small].norm()
    channel_err = (fp8_round_trip(w, dim=0)[small] - w[small]).norm() / w[small].norm()
    assert channel_err < 0.05 < tensor_err


def test_scaled_gemm_reference_matches_fp32_gemm(spec_exhibits):
    """O = GEMM(X·S_X, W·S_W) / (S_X·S_W) approximates X Wᵀ to FP8 precision."""
    torch.manual_seed(0)
    x, w = torch.randn(16, 64), torch.randn(32, 64) * 0.05
    exact = x @ w.t()
    out = spec_exhibits.fp8_matmul_reference(x, w)
    assert (out - exact).norm() / exact.norm() < 0.05
    assert spec_exhibits.fp8_matmul(x, w).dtype == torch.bfloat16  # CPU: the reference path


@pytest.mark.skipif(not has_fp8_matmul(), reason="needs a GPU with FP8 tensor cores")
def test_scaled_mm_matches_reference_on_fp8_hardware(spec_exhibits):
    torch.manual_seed(0)
    x, w = torch.randn(64, 128, device="cuda"), torch.randn(32, 128, device="cuda")
    ref = spec_exhibits.fp8_matmul_reference(x, w)
    assert torch.allclose(spec_exhibits.fp8_matmul(x, w).float(), ref, rtol=2e-2, atol=2e-2)


def test_loss_scaler_skips_overflow_halves_and_grows():
    p = torch.nn.Parameter(torch.ones(3))
    scaler = LossScaler(init_scale=2.0**16, growth_interval=2)
    p.grad = torch.tensor([1.0, math.inf, 0.0])
    assert not scaler.unscale_and_check([p]) and scaler.scale == 2.0**15
    for _ in range(2):
        p.grad = torch.full((3,), scaler.scale)
        assert scaler.unscale_and_check([p])
        assert torch.equal(p.grad, torch.ones(3))  # unscaled back to the true gradient
    assert scaler.scale == 2.0**16
    state = scaler.state_dict()
    fresh = LossScaler()
    fresh.load_state_dict(state)
    assert fresh.scale == scaler.scale


def test_loss_scaling_recovers_fp16_gradients_that_would_underflow():
    g = torch.tensor(1e-8)
    assert g.half().item() == 0.0  # below fp16's smallest subnormal
    scaler = LossScaler(init_scale=2.0**16)
    p = torch.nn.Parameter(torch.zeros(()))
    p.grad = (g * scaler.scale).half().float()  # the scaled fp16 gradient survives
    assert scaler.unscale_and_check([p])
    assert abs(p.grad.item() - 1e-8) / 1e-8 < 1e-2


def test_precision_cli(capsys):
    assert main(["precision"]) == 0
    out = capsys.readouterr().out
    assert "65504" in out and "float8_e4m3fn" in out and "448" in out
    # the kernel each layer kind runs, for int8 and int4 among others
    assert "\nint8, " in out and "int4, " in out and "attention, decoding" in out
