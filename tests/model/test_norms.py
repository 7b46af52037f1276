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
    """RMSNorm: x / sqrt(mean(x^2) + eps). With a tiny-variance input and a large eps the two
    placements differ ~3x: mean(x^2) = 7.5e-4, so 1/sqrt(7.5e-4 + 1e-2) = 9.645 (inside) but
    1/(sqrt(7.5e-4) + 1e-2) = 26.75 (outside)."""
    x = torch.tensor([[0.01, -0.02, 0.03, 0.04]])
    out = RMSNorm(4, eps=1e-2)(x)
    inside = torch.tensor([[0.0964, -0.1929, 0.2893, 0.3858]])
    outside = torch.tensor([[0.2675, -0.5350, 0.8024, 1.0699]])
    assert torch.allclose(out, inside, atol=1e-4)
    assert not torch.allclose(out, outside, atol=1e-2)
    assert torch.equal(RMSNorm(4, eps=1e-6)(torch.zeros(1, 4)), torch.zeros(1, 4))


def test_rmsnorm_matches_torch():
    """torch.nn.RMSNorm (eps inside the root, as in Llama) is the oracle, with learned gammas and
    inputs whose mean square is comparable to eps, so where eps goes shows in the output."""
    x = torch.randn(4, 7, 16) * torch.logspace(-3, 0, 7)[None, :, None]
    ours = RMSNorm(16, eps=1e-3)
    ref = torch.nn.RMSNorm(16, eps=1e-3)
    with torch.no_grad():
        ours.weight.normal_()
        ref.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=1e-5)


def test_norms_compute_in_fp32_under_bf16():
    x = (torch.randn(2, 8, 32) * 100).bfloat16()
    for norm in (LayerNorm(32), RMSNorm(32)):
        out = norm.bfloat16()(x)
        assert out.dtype == torch.bfloat16
        ref = norm.float()(x.float())
        assert (out.float() - ref).abs().max() < 0.05
