"""model/linear.py: `Linear` on oneDNN computes what nn.Linear computes, forward and backward."""

import pytest
import torch
from torch import nn

from lmforge.model import linear as L


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 320), (2, 5, 320)])
def test_linear_matches_nn_linear_forward_and_backward(bias, shape):
    torch.manual_seed(0)
    ours = L.Linear(320, 256, bias=bias)
    torch_linear = nn.Linear(320, 256, bias=bias)
    torch_linear.load_state_dict(ours.state_dict())
    assert ours.weight.numel() >= L.MIN_WEIGHT  # the oneDNN route, where available
    x = torch.randn(*shape, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = ours(x), torch_linear(x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.weight.grad, torch_linear.weight.grad, rtol=1e-5, atol=1e-4)
    if bias:
        torch.testing.assert_close(ours.bias.grad, torch_linear.bias.grad, rtol=1e-5, atol=1e-4)


def test_frozen_weight_gets_no_gradient_and_input_still_does():
    layer = L.Linear(320, 256).requires_grad_(False)
    x = torch.randn(3, 320, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is None and x.grad is not None
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(3, -1), rtol=1e-5, atol=1e-5)


def test_other_dtypes_and_tiny_layers_keep_torchs_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(L, "_gemm", lambda *a: calls.append(a) or nn.functional.linear(*a))
    L.Linear(320, 256).to(torch.bfloat16)(torch.randn(2, 320, dtype=torch.bfloat16))
    L.Linear(8, 4)(torch.randn(2, 8))
    assert calls == []
    L.Linear(320, 256)(torch.randn(2, 320))
    assert len(calls) == int(L.onednn_available())


def test_plain_linear_names_the_layers_conversions_replace():
    assert L.plain_linear(nn.Linear(2, 2)) and L.plain_linear(L.Linear(2, 2))
    assert not L.plain_linear(nn.Identity())
