"""A tiny random-init LM with a BPE tokenizer trained on a small text: fast, offline. Its
320-token window holds the RAG chat prompt (instruction, question) plus a passage or two."""

import pytest

from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.tokenizer import Tokenizer

TEXT = (
    "Question: What is 2 plus 2? Answer: 4. The sky is blue. Paris is the capital of France. "
    "Let's think step by step. The answer is 42. Yes, you are right. No, that is not correct. "
)


@pytest.fixture(scope="session")
def tiny_lm() -> LM:
    tok = Tokenizer.train_bpe([TEXT] * 20, vocab_size=320)
    config = ModelConfig(vocab_size=320, n_layer=2, n_head=2, d_model=32, max_seq_len=320)
    return LM.from_config(config, tok, seed=0)
