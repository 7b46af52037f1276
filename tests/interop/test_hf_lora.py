"""LoRA adapters under Hugging Face PEFT module names, family by family: what lmforge's
save_adapter writes for a model loaded from a transformers checkpoint is what
`peft.PeftModel.from_pretrained` puts on that checkpoint (peft is the oracle: same logits), and
lmforge's load_adapter reads it back. Modules transformers does not hold as nn.Linear (Phi-3's
fused gate_up_proj, cut into our gate/up) keep lmforge's names rather than a wrong mapping."""

import json

import pytest
import torch

from lmforge.lm import LM
from lmforge.peft.lora import apply_lora, load_adapter, save_adapter

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

# case -> (our LoRA targets, the target_modules PEFT gets)
CASES = {
    "llama_gqa_bias_headdim_tied": (
        "qkv_proj,o_proj,gate_proj,up_proj,down_proj",
        ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
    ),
    "qwen2": ("qkv_proj,down_proj", ["down_proj", "k_proj", "q_proj", "v_proj"]),
    "qwen3": ("qkv_proj,o_proj", ["k_proj", "o_proj", "q_proj", "v_proj"]),
    "mistral_window": ("qkv_proj", ["k_proj", "q_proj", "v_proj"]),
    "phi3_window": ("qkv_proj,o_proj,down_proj", ["down_proj", "o_proj", "qkv_proj"]),
    "gpt2": ("qkv_proj,o_proj,up_proj,down_proj", None),  # c_attn/c_proj/c_fc: see below
}


def randomize_lora(model) -> None:
    """B is zero at init (no change to the output); random B makes the adapter matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)


def logits(model, x) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
    return getattr(out, "logits", out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_adapter_loads_in_peft_on_the_original_model(case, hf_checkpoint, random_ids, tmp_path):
    _hf, path = hf_checkpoint(case)
    ours_targets, hf_targets = CASES[case]
    lm = LM.load(path)
    apply_lora(lm.model, r=4, alpha=8, targets=ours_targets.split(","))
    randomize_lora(lm.model)
    save_adapter(lm.model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    if hf_targets is not None:
        assert sorted(config["target_modules"]) == hf_targets
    else:  # GPT-2's attention and MLP both have a c_proj: o_proj and down_proj are both adapted
        assert sorted(config["target_modules"]) == ["c_attn", "c_fc", "c_proj"]
        assert config["fan_in_fan_out"] is True  # its Conv1D stores [in, out]
    x = random_ids(batch=2, seq=20)
    lm.model.eval()
    expected = logits(lm.model, x)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with model.disable_adapter():
        assert (logits(model, x) - expected).abs().max() > 1e-2  # the adapter matters
    torch.testing.assert_close(logits(model, x), expected, rtol=0, atol=1e-4)
    again = LM.load(path)
    load_adapter(again.model, tmp_path / "adapter")
    torch.testing.assert_close(logits(again.model.eval(), x), expected, rtol=0, atol=1e-5)


def test_partial_qkv_adapter_from_peft_fills_zero_rows(hf_checkpoint, random_ids, tmp_path):
    """An HF adapter on q_proj alone (its A shared by nothing else) becomes a fused qkv_proj LoRA
    whose k and v rows of B are zero."""
    _hf, path = hf_checkpoint("llama")
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, lora).eval()
    model.save_pretrained(tmp_path / "q")
    lm = LM.load(path)
    load_adapter(lm.model, tmp_path / "q")
    x = random_ids(batch=2, seq=20)
    torch.testing.assert_close(logits(lm.model.eval(), x), logits(model, x), rtol=0, atol=1e-4)


def test_fused_gate_up_keeps_lmforge_names(hf_checkpoint, random_ids, tmp_path):
    """Phi-3 stores gate and up as one gate_up_proj; separate LoRAs on our gate/up cannot be
    written as one PEFT LoRA there, so the adapter keeps lmforge's names and still reloads."""
    _hf, path = hf_checkpoint("phi3_window")
    lm = LM.load(path)
    apply_lora(lm.model, r=4, alpha=8, targets=("gate_proj", "qkv_proj"))
    randomize_lora(lm.model)
    save_adapter(lm.model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert "blocks.0.mlp.gate_proj" in config["target_modules"]
    again = LM.load(path)
    load_adapter(again.model, tmp_path / "adapter")
    x = random_ids(batch=2, seq=20)
    expected = logits(lm.model.eval(), x)
    torch.testing.assert_close(logits(again.model.eval(), x), expected, rtol=0, atol=1e-5)
