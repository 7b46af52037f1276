import pytest
import torch

from lmforge.errors import ConfigError
from lmforge.model.config import ModelConfig
from lmforge.model.mlp import build_mlp
from lmforge.model.moe import MoE, Router
from lmforge.model.transformer import Transformer


def test_router_renormalises_top_k_spec_vector():
    router = Router(3, 3, top_k=2)
    with torch.no_grad():
        router.weight.copy_(torch.eye(3))
    x = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))  # softmax(x) = [0.5, 0.3, 0.2]
    routing = router(x)
    assert torch.allclose(routing.probs, torch.tensor([[0.5, 0.3, 0.2]]))
    assert routing.experts.tolist() == [[0, 1]]
    assert torch.allclose(routing.gates, torch.tensor([[0.625, 0.375]]))


def _moe(seed=0, d=16, ff=24, experts=4, k=2):
    torch.manual_seed(seed)
    moe = build_mlp("moe", d, ff, False, 0.0, n_experts=experts, top_k=k)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def test_batched_dispatch_equals_per_token_reference():
    moe = _moe()
    x = torch.randn(3, 5, 16)
    out = moe(x)
    for b in range(3):
        for t in range(5):
            token = x[b, t]
            probs = torch.softmax(moe.router.weight @ token, -1)
            top, idx = probs.topk(2)
            top = top / top.sum()
            want = sum(g * moe.experts[int(e)](token) for g, e in zip(top, idx))
            assert torch.allclose(out[b, t], want, atol=1e-6)


def test_matches_transformers_mixtral_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4,
                                        num_experts_per_tok=2)  # fmt: skip
    block = MixtralSparseMoeBlock(config).eval()
    moe = _moe()
    with torch.no_grad():
        block.gate.weight.copy_(moe.router.weight)
        for e, expert in enumerate(moe.experts):
            block.experts.gate_up_proj[e].copy_(
                torch.cat([expert.gate_proj.weight, expert.up_proj.weight])
            )
            block.experts.down_proj[e].copy_(expert.down_proj.weight)
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        assert torch.allclose(moe(x), block(x), atol=1e-6)


def test_moe_model_trains_and_every_expert_gets_gradient():
    config = ModelConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, mlp="moe", n_experts=4,
                         experts_top_k=2, pos="rope", norm="rmsnorm", bias=False)  # fmt: skip
    model = Transformer(config)
    assert isinstance(model.blocks[0].mlp, MoE)
    ids = torch.randint(0, 32, (4, 16))
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
    loss.backward()
    assert model.blocks[0].mlp.router.weight.grad.abs().sum() > 0
    assert all(e.down_proj.weight.grad is not None for e in model.blocks[0].mlp.experts)


def test_top_k_larger_than_experts_fails_at_config():
    with pytest.raises(ConfigError, match=r"experts_top_k \(3\) must be between 1 and n_experts"):
        ModelConfig(mlp="moe", n_experts=2, experts_top_k=3)
