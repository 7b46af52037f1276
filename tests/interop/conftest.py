"""Tiny random-init Hugging Face models built offline with transformers (a dev dependency)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 101
SEQ = 40  # longer than every sliding window (6) and original context (16) below

_LLAMA_LIKE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip
_GPT2 = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}  # fmt: skip

# Gemma 2, 2 layers: the first windowed, the second full; soft caps small enough to bite
_GEMMA2 = dict(head_dim=16, sliding_window=6, query_pre_attn_scalar=12,
               attn_logit_softcapping=5.0, final_logit_softcapping=3.0)  # fmt: skip

# name -> (config class name, kwargs): every family and every rope_scaling type.
HF_CASES = {
    "llama": ("LlamaConfig", {}),
    "llama_gqa_bias_headdim_tied": (
        "LlamaConfig",
        dict(attention_bias=True, mlp_bias=True, head_dim=16, tie_word_embeddings=True),
    ),
    "llama_mqa": ("LlamaConfig", dict(num_key_value_heads=1)),
    "llama_rope_linear": ("LlamaConfig", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama_rope_dynamic": (
        "LlamaConfig",
        dict(max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
    ),
    "llama_rope_yarn": ("LlamaConfig", dict(rope_scaling=_YARN)),
    "llama_rope_yarn_mscale": (
        "LlamaConfig",
        dict(
            rope_scaling={
                **_YARN,
                "mscale": 0.8,
                "mscale_all_dim": 0.5,
                "beta_fast": 16,
                "truncate": False,
            }
        ),
    ),  # fmt: skip
    "llama_rope_llama3": ("LlamaConfig", dict(rope_scaling=_LLAMA3, rope_theta=500000.0)),
    "mistral_window": ("MistralConfig", dict(sliding_window=6)),
    "qwen2": ("Qwen2Config", {}),
    "qwen2_window": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=0),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6),
    ),
    "llama_geglu_tanh": ("LlamaConfig", dict(hidden_act="gelu_pytorch_tanh")),
    "qwen3": ("Qwen3Config", dict(head_dim=16, attention_bias=True)),
    "qwen3_window": (
        "Qwen3Config",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=0),
    ),
    "phi3_window": ("Phi3Config", dict(sliding_window=6, pad_token_id=0)),
    "gemma": ("GemmaConfig", dict(head_dim=16)),
    "gemma2_window": ("Gemma2Config", _GEMMA2),
    "gemma3_window": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            },
        ),
    ),  # fmt: skip
    "gpt2": ("GPT2Config", dict(n_inner=80, bos_token_id=1, eos_token_id=2)),
    "gpt2_untied_relu": ("GPT2Config", dict(activation_function="relu", tie_word_embeddings=False)),
}


def random_hf(cls_name: str, config: dict, seed: int = 0, std: float = 0.15, **from_config):
    """A random transformers model of config class `cls_name`, every weight drawn (norm weights
    around 1, everything else N(0, std), biases too), fp32, in eval mode."""
    hf_config = getattr(transformers, cls_name)(**config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, **from_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, std)
    return model.eval()


def build_hf_case(name: str, seed: int = 0):
    """The random transformers model for HF_CASES[name]."""
    cls_name, kwargs = HF_CASES[name]
    base = _GPT2 if cls_name == "GPT2Config" else _LLAMA_LIKE
    # transformers' SDPA path has no soft cap: Gemma's reference is its eager attention
    attention = "eager" if cls_name.startswith("Gemma") else "sdpa"
    return random_hf(cls_name, {**base, **kwargs}, seed, attn_implementation=attention)


@pytest.fixture
def random_hf_model():
    """random_hf(cls_name, config, seed=0, std=0.15, **from_config) (see there)."""
    return random_hf


@pytest.fixture
def hf_checkpoint(tmp_path):
    """save_pretrained (safetensors) a random model; returns (model, directory)."""

    def make(name: str, **save_kwargs):
        model = build_hf_case(name)
        model.save_pretrained(tmp_path / name, **save_kwargs)
        return model, tmp_path / name

    return make


@pytest.fixture(params=sorted(HF_CASES))
def hf_case(request) -> str:
    """Each HF_CASES name in turn (a test taking this runs once per model family/variant)."""
    return request.param


@pytest.fixture
def hf_model():
    """hf_model(name): the random transformers model for HF_CASES[name], not saved."""
    return build_hf_case


@pytest.fixture
def random_ids():
    """random_ids(seed=1, batch=3, seq=SEQ): a (batch, seq) tensor of ids below VOCAB, the
    same for the same seed; SEQ is longer than every sliding window and original context."""

    def make(seed: int = 1, batch: int = 3, seq: int = SEQ) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, VOCAB, (batch, seq), generator=generator)

    return make


# ---- for the GGUF tests (gguf_files.py writes the files) ---------------------------------------


@pytest.fixture
def build_hf(random_hf_model):
    """build_hf(cls_name, vocab_size, seed=0, **config): a random transformers model, wider
    than conftest's HF_CASES (a Q4/Q8 block is 32 columns), weights N(0, 0.08)."""

    def make(cls_name, vocab_size, seed=0, **kwargs):
        base = dict(
            vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        if cls_name == "GPT2Config":
            # transformers' GGUF loader ignores the context length (n_positions stays 1024)
            base = dict(vocab_size=vocab_size, n_embd=128, n_layer=2, n_head=4, n_positions=1024)
        return random_hf_model(cls_name, {**base, **kwargs}, seed, std=0.08)

    return make


@pytest.fixture(scope="module")
def bpe_vocab():
    from gguf_files import make_bpe_vocab

    return make_bpe_vocab()


@pytest.fixture(scope="module")
def spm_vocab():
    from gguf_files import make_spm_vocab

    return make_spm_vocab()
