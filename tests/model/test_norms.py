import torch

from lmforge.model.norms import LayerNorm, RMSNorm


def test_layernorm_spec_vector():
    out = LayerNorm(3, eps=1e-5)(torch.tensor([[1.0, 2.0, 3.0]]))
    assert torch.allclose(out, torch.tensor([[-1.2247, 0.0, 1.2247]]), atol=1e-4)


def test_layernorm_matches_torch():
    x = torch.randn(4, 7, 16)
    ours = LayerNorm(16)
    ref = torch.nn.LayerNorm(16)
    with torch.no_grad():
        ours.weight.normal_()
        ours.bias.normal_()
        ref.weight.copy_(ours.weight)
        ref.bias.copy_(ours.bias)
    assert torch.allclose(ours(x), ref(x), atol=1e-6)


def test_rmsnorm_spec_vector():
    out = RMSNorm(2, eps=0.0)(torch.tensor([[3.0, 4.0]]))
    assert torch.allclose(out, torch.tensor([[0.8485, 1.1314]]), atol=1e-4)


def test_rmsnorm_eps_inside_root():
    x = torch.zeros(1, 4)
    assert torch.isfinite(RMSNorm(4, eps=1e-6)(x)).all()


def test_norms_compute_in_fp32_under_bf16():
    x = (torch.randn(2, 8, 32) * 100).bfloat16()
    for norm in (LayerNorm(32), RMSNorm(32)):
        out = norm.bfloat16()(x)
        assert out.dtype == torch.bfloat16
        ref = norm.float()(x.float())
        assert (out.float() - ref).abs().max() < 0.05
