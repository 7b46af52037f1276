import math

import pytest
import torch

from lmforge.errors import ConfigError
from lmforge.model.config import ModelConfig
from lmforge.model.feedforward import build_mlp
from lmforge.model.moe import (
    MoE,
    Router,
    Routing,
    apply_capacity,
    expert_capacity,
    load_balancing_loss,
)
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


# ---- training extras: load-balancing loss, capacity, shared experts (Switch, DeepSeekMoE) ----


def test_aux_loss_uniform_routing_gives_k():
    n, e, k = 64, 4, 2
    probs = torch.full((n, e), 1 / e)
    experts = torch.stack([torch.arange(n) % e, (torch.arange(n) + 1) % e], 1)
    assert math.isclose(load_balancing_loss(probs, experts).item(), k, rel_tol=1e-6)


def test_aux_loss_collapse_with_k1_gives_e():
    probs = torch.zeros(10, 8)
    probs[:, 3] = 1.0
    assert load_balancing_loss(probs, torch.full((10, 1), 3)).item() == 8


def test_capacity_formula_and_drop_on_overflow():
    assert expert_capacity(n_tokens=10, n_experts=4, top_k=2, factor=1.0) == 5
    assert expert_capacity(10, 4, 1, 1.25) == 3
    # 4 tokens all pick expert 0 first, expert 1 second; capacity 2
    experts = torch.tensor([[0, 1]] * 4)
    gates = torch.full((4, 2), 0.5)
    routing = Routing(torch.zeros(4, 3), torch.full((4, 3), 1 / 3), experts, gates)
    dropped, kept = apply_capacity(routing, capacity=2)
    assert kept.tolist() == [[True, True], [True, True], [False, False], [False, False]]
    assert dropped.experts[2:].eq(-1).all() and dropped.gates[2:].eq(0).all()


def test_first_choices_claim_slots_before_second_choices():
    experts = torch.tensor([[1, 0], [0, 1]])  # token 0's second choice vs token 1's first
    routing = Routing(torch.zeros(2, 2), torch.full((2, 2), 0.5), experts, torch.ones(2, 2))
    _, kept = apply_capacity(routing, capacity=1)
    assert kept.tolist() == [[True, False], [True, False]]


def moe(**kw) -> MoE:
    torch.manual_seed(0)
    layer = MoE(16, 32, "silu", False, 0.0, n_experts=4, top_k=2, **kw)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    return layer


def test_aux_loss_does_not_change_the_output():
    x = torch.randn(2, 5, 16)
    plain, weighted = moe().train(), moe(aux_loss_weight=0.5).train()
    assert torch.equal(weighted(x), plain(x))
    assert plain.aux_loss is None and weighted.aux_loss is not None


def test_dropped_tokens_lose_only_the_dropped_experts_output():
    x = torch.randn(3, 8, 16)
    full, capped = moe(), moe(capacity_factor=0.25)
    out_full, out_capped = full(x), capped(x)
    assert 0 < capped.dropped_fraction < 1
    assert not torch.allclose(out_full, out_capped)
    assert moe(capacity_factor=100.0)(x).allclose(out_full)  # huge capacity drops nothing


def test_shared_experts_add_an_always_on_branch():
    layer = moe(n_shared_experts=1)
    routed_only = moe()
    state = {k: v for k, v in layer.state_dict().items() if not k.startswith("shared.")}
    routed_only.load_state_dict(state)
    x = torch.randn(2, 3, 16)
    assert torch.allclose(layer(x), routed_only(x) + layer.shared(x), atol=1e-6)


def test_aux_loss_reaches_the_model_and_has_gradients_to_the_router():
    config = ModelConfig(vocab_size=30, n_layer=2, d_model=32, n_head=4, mlp="moe", n_experts=4,
                         aux_loss_weight=0.01, capacity_factor=1.25)  # fmt: skip
    model = Transformer(config).train()
    model(torch.randint(0, 30, (2, 8)))
    aux = model.aux_loss()
    assert aux is not None and 0.01 * 2 * 0.5 < aux.item() < 0.01 * 2 * 4
    aux.backward()
    assert model.blocks[0].mlp.router.weight.grad.abs().sum() > 0
    model.eval()
    model(torch.randint(0, 30, (2, 8)))
    assert model.aux_loss() is None  # evaluation adds nothing
    assert Transformer(ModelConfig(vocab_size=30)).aux_loss() is None


def test_pretraining_adds_the_aux_loss(tmp_path):
    from lmforge.train.config import TrainConfig
    from lmforge.train.pretrain import Pretrainer

    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    cfg = TrainConfig(out_dir=str(tmp_path / "run"), data=str(corpus), tokenizer="char",
                      max_iters=1, batch_size=2, block_size=16, progress=False, device="cpu",
                      model=dict(n_layer=1, d_model=32, n_head=2, mlp="moe", n_experts=4,
                                 aux_loss_weight=1.0))  # fmt: skip
    trainer = Pretrainer(cfg, log=lambda *a: None)
    calls = []
    original = trainer.model.aux_loss
    trainer.model.aux_loss = lambda: calls.append(1) or original()
    trainer.train_step()
    assert calls
