"""Continual-learning penalties: L2 / EWC known values, Fisher = mean squared gradient, distillation
against torch's KL."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmforge.align.regularizers import (
    diagonal_fisher,
    distillation_loss,
    ewc_penalty,
    l2_to_reference,
)
from lmforge.errors import LMForgeError


def test_l2_and_ewc():
    model = nn.Linear(3, 2)
    ref = {k: v.detach().clone() for k, v in model.named_parameters()}
    assert l2_to_reference(model, ref) == 0
    with torch.no_grad():
        model.weight += 1.0
    assert abs(l2_to_reference(model, ref).item() - 6.0) < 1e-5
    fisher = {k: torch.full_like(v, 2.0) for k, v in ref.items()}
    assert abs(ewc_penalty(model, ref, fisher).item() - 12.0) < 1e-5
    with pytest.raises(LMForgeError, match="missing"):
        l2_to_reference(model, {"weight": ref["weight"]})


def test_diagonal_fisher_is_mean_squared_gradient():
    model = nn.Linear(3, 1)
    batches = [torch.randn(4, 3) for _ in range(3)]
    loss_fn = lambda m, x: m(x).pow(2).mean()
    fisher = diagonal_fisher(model, batches, loss_fn)
    expect = torch.zeros_like(model.weight)
    for x in batches:
        (g,) = torch.autograd.grad(loss_fn(model, x), [model.weight])
        expect += g**2 / 3
    torch.testing.assert_close(fisher["weight"], expect)
    assert model.weight.grad is None


def test_distillation_loss():
    s, t = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    assert distillation_loss(t, t).abs() < 1e-6
    T = 2.0
    ref = F.kl_div(
        F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True, reduction="none"
    )
    torch.testing.assert_close(distillation_loss(s, t, T), ref.sum(-1).mean() * T * T)
