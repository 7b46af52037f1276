import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lmforge.errors import CheckpointError, ConfigError
from lmforge.model.linear import plain_linear
from lmforge.peft.lora import (
    LoRALinear,
    apply_lora,
    load_adapter,
    lora_modules,
    lora_state_dict,
    merge_lora,
    save_adapter,
    unmerge_lora,
)


def _randomise_b(model: nn.Module) -> None:
    """B starts at zero; give it values so the adapter actually changes outputs."""
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.normal_()


def test_lora_linear_starts_as_base_and_computes_the_update():
    base = nn.Linear(8, 6)
    lora = LoRALinear(base, r=4, alpha=8)
    x = torch.randn(3, 8)
    torch.testing.assert_close(lora(x), base(x))
    assert torch.all(lora.lora_B.weight == 0)
    bound = 1 / math.sqrt(8)  # kaiming_uniform(a=√5) on fan_in 8, as PEFT
    assert lora.lora_A.weight.abs().max() <= bound and lora.lora_A.weight.std() > bound / 4
    assert not lora.weight.requires_grad and not lora.bias.requires_grad
    with torch.no_grad():
        lora.lora_B.weight.normal_()
    W = base.weight + 2.0 * lora.lora_B.weight @ lora.lora_A.weight
    torch.testing.assert_close(lora(x), x @ W.T + base.bias)


def test_merge_unmerge_round_trip():
    base = nn.Linear(8, 6)
    w0 = base.weight.detach().clone()
    lora = LoRALinear(base, r=2, alpha=16)
    with torch.no_grad():
        lora.lora_B.weight.normal_()
    x = torch.randn(5, 8)
    y = lora(x)
    lora.merge()
    lora.merge()  # a second merge must not add the update twice
    assert lora.merged
    torch.testing.assert_close(lora(x), y)
    lora.unmerge()
    assert not lora.merged
    torch.testing.assert_close(lora.weight, w0, atol=1e-6, rtol=0)
    torch.testing.assert_close(lora(x), y)


def test_lora_dropout_only_in_training():
    lora = LoRALinear(nn.Linear(8, 8), r=4, alpha=4, dropout=0.5)
    with torch.no_grad():
        lora.lora_B.weight.normal_()
    x = torch.randn(4, 8)
    lora.eval()
    assert torch.equal(lora(x), lora(x))
    lora.train()
    assert not torch.equal(lora(x), lora(x))


def test_apply_lora_targets_and_freezing(toy):
    model = toy()
    names = apply_lora(model)
    assert names == [f"blocks.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 8
    # base checkpoint keys are unchanged, so a base state dict still loads
    base_keys = set(toy().state_dict())
    assert base_keys <= set(model.state_dict())
    model.load_state_dict(toy().state_dict(), strict=False)


def test_apply_lora_glob_and_errors(toy):
    model = toy()
    names = apply_lora(model, targets="blocks.1.*proj")
    assert names == [f"blocks.1.attn.{p}_proj" for p in "qkvo"] + ["blocks.1.mlp.proj"]
    with pytest.raises(ConfigError, match=r"available: \['blocks.0.attn.q_proj'"):
        apply_lora(toy(), targets=("query",))
    with pytest.raises(ConfigError, match="r > 0"):
        apply_lora(toy(), r=0)


def test_training_moves_only_the_adapter(toy, ids):
    model = toy()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, targets=("q_proj", "v_proj", "fc"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        model(ids).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert any(m.lora_B.weight.abs().sum() > 0 for m in lora_modules(model).values())


def test_save_and_load_adapter_round_trip(toy, ids, tmp_path):
    model = toy()
    apply_lora(model, r=4, alpha=8, targets=("q_proj", "o_proj"))
    _randomise_b(model)
    out = save_adapter(model, tmp_path / "adapter", {"base_model_name_or_path": "toy"})
    files = sorted(p.name for p in out.iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert cfg["lora_dropout"] == 0.0 and cfg["base_model_name_or_path"] == "toy"
    assert "blocks.0.attn.q_proj" in cfg["target_modules"]
    keys = load_file(str(out / "adapter_model.safetensors"))
    assert "base_model.model.blocks.0.attn.q_proj.lora_A.weight" in keys and len(keys) == 8
    assert set(lora_state_dict(model)) == {k.removeprefix("base_model.model.") for k in keys}

    fresh = toy()
    names = load_adapter(fresh, out)
    assert len(names) == 4
    torch.testing.assert_close(fresh(ids), model(ids))


def test_load_adapter_errors(toy, tmp_path):
    with pytest.raises(CheckpointError, match="adapter_config.json"):
        load_adapter(toy(), tmp_path)
    model = toy()
    apply_lora(model, r=4)
    save_adapter(model, tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = next(iter(tensors))
    save_file({**tensors, key: torch.zeros(3, 3)}, str(weights))
    with pytest.raises(CheckpointError, match="shape"):
        load_adapter(toy(), tmp_path)
    del tensors[key]
    save_file(tensors, str(weights))
    with pytest.raises(CheckpointError, match="missing tensors"):
        load_adapter(toy(), tmp_path)
    other = toy()
    apply_lora(other, r=4, alpha=32)
    with pytest.raises(CheckpointError, match="alpha"):
        load_adapter(other, tmp_path)


def test_merge_lora_export_and_in_place(toy, ids):
    model = toy()
    apply_lora(model)
    _randomise_b(model)
    y = model(ids)
    merge_lora(model, replace=False)
    torch.testing.assert_close(model(ids), y)
    unmerge_lora(model)
    torch.testing.assert_close(model(ids), y)
    merged = merge_lora(model)
    assert len(merged) == 4 and not lora_modules(model)
    assert plain_linear(model.blocks[0].attn.q_proj)
    torch.testing.assert_close(model(ids), y)
    assert set(model.state_dict()) == set(toy().state_dict())
