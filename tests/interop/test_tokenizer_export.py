"""Tokenizers we train, exported with a model, behave identically in transformers.AutoTokenizer."""

import pytest
import torch

from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TRAIN = [
    "It was the best of times, it was the worst of times.",
    "Gödel, Escher, Bach — ein Endloses Geflochtenes Band. Ça va? ¿Qué tal?",
    "def add(a, b):\n\treturn a + b  # tabs\tand  double  spaces",
    "数学是科学的语言。 日本語のテキスト。 🙂🚀 emoji",
    "Numbers 1234567890 and symbols !@#$%^&*()[]{}<>~`|\\/",
] * 20
SAMPLE = [
    "It was the best of times.",
    "  leading and trailing spaces  ",
    "Gödel 数学 🙂 — mixed scripts\nnew line\r\nwindows line",
    "<|bos|>special tokens in text<|eos|>",
    "tabs\tand  double  spaces",
    "",
]


@pytest.mark.parametrize("kind", ["bpe", "char", "word"])
def test_autotokenizer_matches_ours(tmp_path, kind):
    if kind == "bpe":
        tok = Tokenizer.train_bpe(TRAIN, vocab_size=400)
    elif kind == "char":
        tok = Tokenizer.train_char(TRAIN)
    else:
        tok = Tokenizer.train_word(TRAIN, vocab_size=300)
    config = ModelConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, d_model=16)
    LM.from_config(config, tokenizer=tok).export_hf(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in SAMPLE:
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert hf.decode(ids) == tok.decode(ids)
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
    assert hf.bos_token == "<|bos|>" and hf.eos_token_id == tok.eos_id
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.eos_token_id == tok.eos_id
    assert model(torch.tensor([tok.encode("It was")])).logits.shape[-1] == tok.vocab_size
