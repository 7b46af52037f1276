"""What the trainers write loads in the Hugging Face stack as written: each output folder of a
model that came from a transformers family with `AutoModelForCausalLM.from_pretrained`, a LoRA
adapter with `peft.PeftModel.from_pretrained` on the original model. transformers and peft are
the oracles: their logits (and rewards built on their hidden states) must equal ours."""

import json

import pytest
import torch

from lmforge.align.dpo import DPOConfig, DPOTrainer
from lmforge.align.reward import RewardConfig, RewardModel, RewardTrainer
from lmforge.align.sft import SFTConfig, SFTTrainer
from lmforge.errors import CheckpointError, ConfigError
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.peft.lora import apply_lora, load_adapter
from lmforge.tasks.synthetic import ALPHABET
from lmforge.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL_LINEAR = "qkv_proj,o_proj,gate_proj,up_proj,down_proj"
HF_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """A random-init Llama written by transformers itself, plus a char tokenizer for the tasks."""
    path = tmp_path_factory.mktemp("hf_base")
    tok = Tokenizer.train_char([ALPHABET])
    config = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save(path)
    return path


def common(hf_base, out, **kw):
    return dict(init=str(hf_base), out_dir=str(out), max_len=24, n_train=16, n_eval=8,
                batch_size=4, max_iters=3, eval_interval=3, progress=False, threads=1,
                warmup_iters=1, lr=1e-2, **kw)  # fmt: skip


def ids(hf_base) -> torch.Tensor:
    vocab = json.loads((hf_base / "config.json").read_text())["vocab_size"]
    return torch.randint(0, vocab, (2, 14), generator=torch.Generator().manual_seed(1))


def hf_logits(path, x) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(x).logits


def ours(model, x) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(x)


def assert_same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def assert_trained(hf_base, out, x):
    """The folder holds the trained weights, not the base ones (else the test could not fail)."""
    assert (hf_logits(out, x) - hf_logits(hf_base, x)).abs().max() > 1e-3


def test_sft_output_loads_in_transformers(hf_base, tmp_path):
    t = SFTTrainer(SFTConfig(**common(hf_base, tmp_path, eval_generate=0)), log=lambda *a: None)
    t.run()
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "llama" and written["architectures"] == ["LlamaForCausalLM"]
    x = ids(hf_base)
    assert_same(hf_logits(tmp_path, x), ours(t.lm.model, x))
    assert_same(ours(LM.load(tmp_path).model, x), ours(t.lm.model, x))  # and ours reads it back
    assert_trained(hf_base, tmp_path, x)


def test_lora_output_and_adapter_load_in_transformers_and_peft(hf_base, tmp_path):
    cfg = SFTConfig(**common(hf_base, tmp_path, eval_generate=0, peft="lora",
                             lora_targets=ALL_LINEAR))  # fmt: skip
    t = SFTTrainer(cfg, log=lambda *a: None)
    t.run()
    x = ids(hf_base)
    trained = ours(t.lm.model, x)
    assert_same(hf_logits(tmp_path, x), trained)  # the merged model
    assert_trained(hf_base, tmp_path, x)
    adapter = tmp_path / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and sorted(config["target_modules"]) == HF_LINEAR
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        assert_same(model(x).logits, trained)
    # and lmforge reads its own HF-named adapter back onto the original model
    lm = LM.load(hf_base)
    assert sorted(load_adapter(lm.model, adapter))[0] == "blocks.0.attn.o_proj"
    assert_same(ours(lm.model, x), trained)


def test_dpo_output_loads_in_transformers(hf_base, tmp_path):
    t = DPOTrainer(DPOConfig(**common(hf_base, tmp_path, beta=0.5)), log=lambda *a: None)
    t.run()
    x = ids(hf_base)
    assert_same(hf_logits(tmp_path, x), ours(t.lm.model, x))
    assert_trained(hf_base, tmp_path, x)


def test_reward_output_backbone_loads_in_transformers(hf_base, tmp_path):
    """The reward model's folder is the backbone in the family's layout (plus the scalar head,
    which has a bias and its own pooling, in reward_head.safetensors): transformers' final
    hidden states through our head give our rewards."""
    t = RewardTrainer(RewardConfig(**common(hf_base, tmp_path)), log=lambda *a: None)
    t.run()
    x = ids(hf_base)
    rm, _tok = RewardModel.load(tmp_path)
    assert_same(hf_logits(tmp_path, x), ours(t.rm.backbone, x))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = hf.model(x).last_hidden_state  # after the final norm, as ours pools it
        assert_same(rm.head(hidden[:, -1]).squeeze(-1), t.rm.eval()(x))
    assert_trained(hf_base, tmp_path, x)


def test_adapter_made_by_peft_loads_in_lmforge(hf_base, tmp_path):
    """The other direction: an adapter HF PEFT wrote (random A and B, so it changes the
    output) loads onto lmforge's copy of the same base and gives PEFT's logits; q/k/v LoRAs with
    different A matrices cannot become one fused qkv_proj LoRA and say so."""
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"],
                           init_lora_weights=False)  # fmt: skip
    model = peft.get_peft_model(base, lora).eval()
    model.save_pretrained(tmp_path / "ok")
    x = ids(hf_base)
    lm = LM.load(hf_base)
    load_adapter(lm.model, tmp_path / "ok")
    with torch.no_grad():
        expected = model(x).logits
        with model.disable_adapter():
            assert (expected - model(x).logits).abs().max() > 1e-3
    assert_same(ours(lm.model, x), expected)
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    qv = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(base, qv).save_pretrained(tmp_path / "qv")
    with pytest.raises(CheckpointError, match="different LoRA A matrices"):
        load_adapter(LM.load(hf_base).model, tmp_path / "qv")


def test_save_formats(hf_base, tmp_path):
    """An lmforge-born model keeps lmforge's format unless asked; a model still wrapped in LoRA
    cannot be written under HF names (its adapters would be dropped) and nothing is written."""
    born = LM.from_config(ModelConfig(vocab_size=40, n_layer=1, d_model=16, n_head=2))
    born.save(tmp_path / "ours")
    assert json.loads((tmp_path / "ours/config.json").read_text())["model_type"] == "lmforge"
    born.save(tmp_path / "gpt2", format="hf")
    x = torch.randint(0, 40, (2, 6))
    assert_same(hf_logits(tmp_path / "gpt2", x), ours(born.model, x))
    with pytest.raises(ConfigError, match="save format"):
        born.save(tmp_path / "bad", format="onnx")
    lm = LM.load(hf_base)
    apply_lora(lm.model, targets=("qkv_proj",))
    with pytest.raises(ConfigError, match="merge LoRA"):
        lm.save(tmp_path / "wrapped")
    assert not (tmp_path / "wrapped").exists()


@pytest.mark.real_model
def test_smollm2_lora_outputs_load_in_transformers_and_peft(smollm2_gguf, shared_data, tmp_path):
    """The real SmolLM2-135M-Instruct (from its GGUF), 2 LoRA steps on GSM8K rows in chat form:
    the merged folder loads in transformers and the adapter in PEFT on the original weights,
    both with our logits to 1e-5 of the largest logit (30 layers of fp32 sums in two attention
    kernels, and the merged weights W0 + ΔW rounded once, differ by ~1e-4 at logits ~30)."""
    base = LM.load(smollm2_gguf, dtype="float32").save(
        tmp_path / "base"
    )  # llama layout: the GGUF's family
    rows = [json.loads(line) for line in (shared_data / "gsm8k_train.jsonl").open()][:8]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": r["question"]},
        {"role": "assistant", "content": r["answer"]}]}) + "\n" for r in rows))  # fmt: skip
    cfg = SFTConfig(init=str(base), out_dir=str(tmp_path / "out"), data=str(data), peft="lora",
                    max_len=160, n_train=8, batch_size=2, max_iters=2, eval_interval=2,
                    eval_generate=0, progress=False, warmup_iters=1, lr=1e-3)  # fmt: skip
    t = SFTTrainer(cfg, log=lambda *a: None)
    t.run()
    x = torch.tensor([t.train_examples[0].input_ids[:48]])
    trained = ours(t.lm.model, x)
    tol = 1e-5 * trained.abs().max().item()
    out = tmp_path / "out"
    assert (hf_logits(out, x) - trained).abs().max().item() <= tol
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf_base, out / "adapter").eval()
    with torch.no_grad():
        with model.disable_adapter():
            assert (model(x).logits - trained).abs().max().item() > 1e-3  # the steps did move it
        assert (model(x).logits - trained).abs().max().item() <= tol
