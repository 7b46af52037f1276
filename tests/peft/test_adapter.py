import pytest
import torch
from torch import nn

from lmforge.errors import ConfigError
from lmforge.peft.adapter import Adapter, AdapterWrapper, apply_adapters


def test_adapter_is_identity_at_init_and_follows_the_formula():
    adapter = Adapter(16, bottleneck=4, activation="relu")
    h = torch.randn(2, 3, 16)
    torch.testing.assert_close(adapter(h), h)
    with torch.no_grad():
        adapter.up.weight.normal_()
    expect = h + adapter.up(torch.relu(adapter.down(h)))
    torch.testing.assert_close(adapter(h), expect)
    with pytest.raises(ConfigError):
        Adapter(16, 4, activation="swishy")


def test_apply_adapters_wraps_freezes_and_trains(toy, ids):
    model, reference = toy(), toy()
    names = apply_adapters(model, "mlp", bottleneck=8)
    assert names == ["blocks.0.mlp", "blocks.1.mlp"]
    assert isinstance(model.blocks[0].mlp, AdapterWrapper)
    torch.testing.assert_close(model(ids), reference(ids))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".adapter." in n for n in trainable)
    model(ids).logsumexp(-1).mean().backward()
    assert model.blocks[0].mlp.adapter.up.weight.grad.abs().sum() > 0
    assert model.lm_head.weight.grad is None


def test_apply_adapters_glob_tuple_outputs_and_errors(toy):
    model = toy()
    assert apply_adapters(model, "blocks.*.attn.o_proj", bottleneck=4) == [
        "blocks.0.attn.o_proj",
        "blocks.1.attn.o_proj",
    ]
    pair = nn.Module()
    pair.inner = nn.LSTM(4, 6, batch_first=True)  # returns (output, (h, c))
    apply_adapters(pair, "inner", d_model=6, freeze_base=False)
    out, (h, _) = pair.inner(torch.randn(1, 3, 4))
    assert out.shape == (1, 3, 6) and h.shape == (1, 1, 6)
    with pytest.raises(ConfigError, match="no module matched"):
        apply_adapters(toy(), "decoder")
    holder = nn.Module()
    holder.act = nn.ReLU()
    with pytest.raises(ConfigError, match="d_model"):
        apply_adapters(holder, "act", bottleneck=4)
