import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.errors import CheckpointError, ConfigError
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


def test_load_matches_transformers_logits(hf_checkpoint, random_ids, hf_case):
    hf, path = hf_checkpoint(hf_case)
    lm = LM.load(path)
    x = random_ids()
    with torch.no_grad():
        ref, ours = hf(x).logits, lm.model(x)
    assert ref.abs().max() > 1.0  # a real signal, not near-zero logits
    assert (ref - ours).abs().max().item() <= 1e-4


@pytest.mark.parametrize(
    "name", ["llama_gqa_bias_headdim_tied", "llama_rope_dynamic", "mistral_window", "qwen2_window",
             "qwen3_window", "phi3_window", "mixtral", "gpt2", "gemma2_window", "gemma3_window"],
)  # fmt: skip
def test_greedy_generation_matches_transformers(hf_checkpoint, random_ids, name):
    hf, path = hf_checkpoint(name)
    lm = LM.load(path)
    prompts = [random_ids(2, 1, 12)[0].tolist(), random_ids(3, 1, 7)[0].tolist()]  # left pad
    ours = lm.generate(prompts, max_new_tokens=26, temperature=0.0, eos_ids=[])
    ids = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, 12 - len(p) :], mask[row, 12 - len(p) :] = torch.tensor(p), 1
    out = hf.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=26, min_new_tokens=26,
        do_sample=False, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    assert out[:, 12:].tolist() == ours


def test_export_roundtrip_from_pretrained(hf_checkpoint, random_ids, tmp_path, hf_case):
    name = hf_case
    hf, path = hf_checkpoint(name)
    lm = LM.load(path)
    lm.export_hf(tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = random_ids()
    with torch.no_grad():
        assert (back(x).logits - lm.model(x)).abs().max().item() <= 1e-4
    written = json.loads((tmp_path / "out/config.json").read_text())
    assert written["model_type"] == hf.config.model_type


def test_sharded_checkpoint_loads(hf_checkpoint, random_ids):
    hf, path = hf_checkpoint("mixtral", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 2
    x = random_ids()
    with torch.no_grad():
        assert (hf(x).logits - LM.load(path).model(x)).abs().max().item() <= 1e-4


def test_sharded_export_loads_in_transformers(hf_checkpoint, random_ids, tmp_path):
    _, path = hf_checkpoint("llama")
    lm = LM.load(path)
    lm.export_hf(tmp_path / "out", max_shard_bytes=20_000)
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 2
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = random_ids()
    with torch.no_grad():
        assert (back(x).logits - lm.model(x)).abs().max().item() <= 1e-4


def _texts():
    return ["The quick brown fox jumps over the lazy dog. " * 3, "Zwölf Boxkämpfer jagen Viktor.",
            "def f(x):\n    return x ** 2  # 🙂"] * 20  # fmt: skip


_GPT2_STYLE = dict(vocab_size=300, n_layer=2, n_head=2, d_model=32, max_seq_len=48)
_LLAMA_STYLE = dict(_GPT2_STYLE, n_head=4, pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)
_YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8}


@pytest.mark.parametrize(
    "fields, family",
    [
        (_GPT2_STYLE, "gpt2"),
        (dict(_LLAMA_STYLE, n_kv_head=2, tie_embeddings=False, rope_interleaved=True), "llama"),
        (dict(_LLAMA_STYLE, attention_bias=True, sliding_window=5,
              rope_scaling={"rope_type": "ntk", "factor": 4.0}), "qwen2"),
        (dict(_LLAMA_STYLE, mlp="geglu_tanh", qk_norm=True, rope_scaling=_YARN), "qwen3"),
        (dict(_LLAMA_STYLE, mlp="moe", n_experts=3, experts_top_k=2), "mixtral"),
    ],
)  # fmt: skip
def test_our_models_export_with_tokenizer(tmp_path, fields, family):
    config = ModelConfig(**fields)
    tok = Tokenizer.train_bpe(_texts(), vocab_size=300)
    lm = LM.from_config(config, tokenizer=tok, seed=0)
    with torch.no_grad():
        for p in lm.model.parameters():
            p.normal_(0.0, 0.2)
    lm.export_hf(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert model.config.model_type == family
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "The lazy dog jumps. 🙂"
    ids = torch.tensor([hf_tok.encode(text, add_special_tokens=False)] * 2)
    assert ids[0].tolist() == tok.encode(text)
    with torch.no_grad():
        assert (model(ids).logits - lm.model(ids)).abs().max().item() <= 1e-4
    # and back again: the HF directory loads into the same model
    again = LM.load(tmp_path / "hf")
    with torch.no_grad():
        assert (again.model(ids) - lm.model(ids)).abs().max().item() <= 1e-5
    assert again.tokenizer.encode(text) == tok.encode(text)


def test_unrepresentable_model_is_a_clear_error(tmp_path):
    lm = LM.from_config(ModelConfig(vocab_size=64, n_layer=1, d_model=32, pos="sinusoidal"))
    with pytest.raises(ConfigError, match="cannot be written as a Hugging Face.*pos='sinusoidal'"):
        lm.export_hf(tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "change",
    [{"embed_scale": True}, {"norm_position": "sandwich"}, {"parallel_block": True},
     {"logit_scaling": True}, {"attn_logit_softcap": 50.0}, {"attention": "mla"},
     {"attention_pattern": {"type": "block_local", "block_size": 16}}],
)  # fmt: skip
def test_a_llama_with_math_no_config_json_holds_is_refused(tmp_path, change):
    """A Llama-shaped model with a block feature Llama's config.json cannot state is refused,
    not written as a Llama that transformers would run without it."""
    llama = dict(vocab_size=64, n_layer=1, d_model=32, n_head=2, pos="rope", norm="rmsnorm",
                 mlp="swiglu", bias=False)  # fmt: skip
    LM.from_config(ModelConfig(**llama)).export_hf(tmp_path / "plain")  # the plain one is written
    field = next(iter(change))
    lm = LM.from_config(ModelConfig(**llama, **change))
    with pytest.raises(ConfigError, match=f"cannot be written as a Hugging Face.*llama: {field}="):
        lm.export_hf(tmp_path / "x")
    assert not (tmp_path / "x").exists()


# ---- bad input: one clear error each, never a half-loaded model --------------------------------
@pytest.mark.parametrize(
    "edit, error, match",
    [
        ({"model_type": "t5"}, CheckpointError, "'t5' is not supported; supported: gemma, "),
        (
            {"rope_parameters": {"rope_type": "warp", "factor": 2.0, "rope_theta": 10000.0}},
            ConfigError, "unknown rope_scaling type 'warp'; supported: default",
        ),
    ],
)  # fmt: skip
def test_bad_config_json(hf_checkpoint, edit, error, match):
    _, path = hf_checkpoint("llama")
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, **edit}))
    with pytest.raises(error, match=match):
        LM.load(path)


def test_missing_shard(hf_checkpoint):
    _, path = hf_checkpoint("llama", max_shard_size="40KB")
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"shard {victim.name} is missing"):
        LM.load(path)


@pytest.mark.parametrize(
    "case, changed, dropped, match",
    [
        ("llama", {"model.layers.1.mlp.up_proj.weight": torch.zeros(40, 32)}, None,
         r"model.layers.1.mlp.up_proj.weight has shape \(40, 32\), config.json implies \(48, 32\)"),
        ("qwen2", {"model.layers.0.self_attn.k_proj.bias": torch.zeros(8)}, None,
         r"k_proj.bias has shape \(8,\).*implies \(16,\)"),
        ("llama", {"model.layers.0.self_attn.q_norm.weight": torch.ones(8)}, None,
         "unexpected tensor.*q_norm"),
        ("llama", {}, "model.norm.weight", "missing tensor.*model.norm.weight"),
    ],
)  # fmt: skip
def test_bad_tensors_are_named(hf_checkpoint, case, changed, dropped, match):
    _, path = hf_checkpoint(case)
    state = {**load_file(path / "model.safetensors"), **changed}
    state.pop(dropped, None)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=match):
        LM.load(path)


def test_pickle_only_checkpoint_is_refused(tmp_path, hf_model):
    hf_model("gpt2").config.to_json_file(tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="only safetensors"):
        LM.load(tmp_path)
