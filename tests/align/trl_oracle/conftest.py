"""Fixtures of the TRL oracle tests: a tiny tokenizer, a tiny Llama policy and reference, and
a saved checkpoint of one; lmforge's LM head runs two tokens at a time in all of them."""

import copy
import tempfile

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
from trl_oracle_common import llama_config, perturb

from lmforge.align import logprobs


@pytest.fixture(autouse=True)
def two_token_chunks(monkeypatch):
    """lmforge's LM head runs two tokens at a time (logprobs.map_token_chunks): every loss below
    is checked against TRL, which builds the whole logits tensor, through chunk borders."""
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 2 * 32)  # vocabulary 32


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """A 32-word whitespace tokenizer: w0..w28 are single tokens 3..31."""
    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(29)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


@pytest.fixture
def policy_and_ref() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    torch.manual_seed(0)
    ref = LlamaForCausalLM(llama_config()).eval()
    policy = copy.deepcopy(ref)
    perturb(policy, 0.05, seed=1)
    return policy, ref.requires_grad_(False)


@pytest.fixture(scope="module")
def model_dir(tok) -> str:
    """A saved tiny Llama + tokenizer: GRPO/RLOO build their reference model from the path."""
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="trl_oracle_")
    LlamaForCausalLM(llama_config()).save_pretrained(path)
    tok.save_pretrained(path)
    return path
