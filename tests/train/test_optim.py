"""The optimizers' and schedules' maths: Newton-Schulz against an SVD, Muon against
torch.optim.Muon, its AdamW part against torch.optim.AdamW, and the shapes of the schedules."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lmforge.errors import ConfigError
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.train.config import OptimConfig
from lmforge.train.optim import (
    NS_COEFFICIENTS,
    Muon,
    build_optimizer,
    cosine_lr,
    hidden_matrices,
    newton_schulz,
    wsd_lr,
)


def with_singular_values(m: int, n: int, s: torch.Tensor, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    k = min(m, n)
    return u[:, :k] @ torch.diag(s.double()) @ v[:, :k].T


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
def test_newton_schulz_is_an_odd_polynomial_of_the_singular_values(shape):
    """NS(G) = U p(S) V^T with G = U S V^T (reference: torch.linalg.svd), p the scalar
    quintic iterated 5 times on s / ||G||_F; and p(S) lies in [0.6, 1.25]: nearly U V^T."""
    m, n = shape
    s = torch.linspace(1.0, 0.05, min(m, n))
    g = with_singular_values(m, n, s)
    out = newton_schulz(g, steps=5)
    u, sv, vh = torch.linalg.svd(g, full_matrices=False)
    core = u.T @ out @ vh.T  # diagonal if NS keeps G's singular vectors
    off = core - torch.diag(torch.diagonal(core))
    assert off.abs().max() < 1e-9
    a, b, c = NS_COEFFICIENTS
    x = sv / g.norm()
    for _ in range(5):
        x = a * x + b * x**3 + c * x**5
    torch.testing.assert_close(torch.diagonal(core), x, atol=1e-6, rtol=1e-6)  # eps in the norm
    assert 0.6 <= x.min() and x.max() <= 1.25
    polar = u @ vh  # the exact orthogonalisation U V^T
    cos = (out * polar).sum() / (out.norm() * polar.norm())
    assert cos > 0.97


def test_newton_schulz_batches_independently():
    gs = torch.randn(3, 16, 48, dtype=torch.float64)
    batched = newton_schulz(gs)
    for i in range(3):
        torch.testing.assert_close(batched[i], newton_schulz(gs[i]))


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_torch_optim_muon(adjust, nesterov):
    """Three steps on the same matrices and gradients as torch.optim.Muon (the oracle, which
    runs Newton-Schulz in bf16, hence the tolerance)."""
    torch.manual_seed(0)
    shapes = [(48, 16), (16, 48), (16, 48), (32, 32)]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    start = [p.detach().clone() for p in ours]
    kw = dict(lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.1)
    opt = Muon([{"params": ours, "muon": True}], lr_adjust=adjust, **kw)
    oracle = torch.optim.Muon(ref, adjust_lr_fn=adjust, **kw)
    for _ in range(3):
        grads = [torch.randn(s) for s in shapes]
        for p, q, gr in zip(ours, ref, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt.step()
        oracle.step()
    for p, q, p0 in zip(ours, ref, start):
        ours_moved, ref_moved = p.detach() - p0, q.detach() - p0
        assert ref_moved.norm() > 0.1
        assert (ours_moved - ref_moved).norm() / ref_moved.norm() < 0.02  # bf16 in the oracle


def test_muon_adamw_groups_match_torch_adamw():
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = Muon([{"params": ours[:1]}, {"params": ours[1:], "weight_decay": 0.0}],
               lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)  # fmt: skip
    oracle = torch.optim.AdamW([{"params": ref[:1]}, {"params": ref[1:], "weight_decay": 0.0}],
                               lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)  # fmt: skip
    for _ in range(4):
        for p, q in zip(ours, ref):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        oracle.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.detach(), q.detach())
    # a saved state loads into a fresh optimizer and steps the same
    again = Muon([{"params": ours[:1]}, {"params": ours[1:], "weight_decay": 0.0}],
                 lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)  # fmt: skip
    again.load_state_dict(opt.state_dict())
    assert again.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])


def test_build_optimizer_splits_hidden_matrices_and_scales_lr():
    model = Transformer(ModelConfig(vocab_size=40, n_layer=2, d_model=32, n_head=2, bias=False,
                                    qk_norm=True))  # fmt: skip
    hidden = hidden_matrices(model)
    names = {n for n, p in model.named_parameters() if id(p) in hidden}
    assert names == {
        f"blocks.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.qkv_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj")
    }
    cfg = OptimConfig(optimizer="muon", lr=1e-3, weight_decay=0.1, beta2=0.99, muon_lr=0.02)
    opt = build_optimizer(model, cfg)
    muon = [g for g in opt.param_groups if g["muon"]]
    assert len(muon) == 1 and muon[0]["lr_scale"] == pytest.approx(20.0)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    with pytest.raises(ConfigError, match="optimizer must be one of"):
        build_optimizer(model, SimpleNamespace(**{**vars(cfg), "optimizer": "sgd"}))


def test_wsd_schedule_shape():
    lr, low, warm, total, frac = 1e-2, 1e-3, 10, 100, 0.3
    lrs = [wsd_lr(i, lr, low, warm, total, frac) for i in range(total + 5)]
    # warmup: the same ramp as the cosine schedule's
    assert lrs[:warm] == [cosine_lr(i, lr, low, warm, total) for i in range(warm)]
    assert all(x == lr for x in lrs[warm:70])  # stable until the last 30%
    cool = torch.tensor(lrs[70:101], dtype=torch.float64)
    assert cool[0] == lr and cool[-1] == pytest.approx(low)
    diffs = cool.diff()
    assert (diffs < 0).all() and torch.allclose(diffs, diffs[0].expand_as(diffs))  # a line
    assert lrs[100:] == [low] * 5


def test_config_schedule_and_optimizer_choices():
    cfg = OptimConfig(max_iters=100, lr=1e-2, min_lr=0.0, schedule="wsd", cooldown_frac=0.5)
    assert cfg.lr_at(49) == 1e-2 and cfg.lr_at(75) == pytest.approx(0.5e-2)
    with pytest.raises(ConfigError, match="schedule"):
        OptimConfig(schedule="linear")
    with pytest.raises(ConfigError, match="cooldown_frac"):
        OptimConfig(schedule="wsd", cooldown_frac=1.5)
    with pytest.raises(ConfigError, match="optimizer"):
        OptimConfig(optimizer="lion")
