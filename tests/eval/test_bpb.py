"""Bits per byte: summed NLL over the scored tokens / (ln 2 x the UTF-8 bytes of exactly those
tokens), byte lengths from the tokenizer with special tokens counting 0."""

import math

import pytest
import torch

from lmforge.eval.perplexity import perplexity
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.byte_counts import bits_per_byte, target_bytes, token_bytes_table

TRAIN = ["The café's naïve owner sold crème brûlée — twice. 東京 is far; 7 + 35 = 42.\n"] * 20
TINY = "the cat sat on the mat, twice. 42"  # ASCII: every token decodes to itself


def tokenizers() -> dict[str, Tokenizer]:
    return {
        "bpe": Tokenizer.train_bpe(TRAIN, vocab_size=300),
        "char": Tokenizer.train_char(TRAIN + [TINY]),
        "word": Tokenizer.train_word(TRAIN + [TINY], vocab_size=200),
    }


def decoded_bytes(tok: Tokenizer, ids: list[int]) -> list[int]:
    """The direct computation: decode each token on its own and count its UTF-8 bytes; the
    tokenizer's special tokens are not text and count 0."""
    special = {tok.token_to_id(t) for t in tok.special_tokens.values()}
    return [0 if i in special else len(tok.decode([i]).encode("utf-8")) for i in ids]


@pytest.mark.parametrize("kind", ["bpe", "char", "word"])
def test_byte_lengths_are_the_decoded_tokens_bytes(kind):
    tok = tokenizers()[kind]
    ids = [tok.bos_id] + tok.encode(TINY) + [tok.eos_id] + tok.encode(TINY[:9]) + [tok.eos_id]
    lengths = tok.token_byte_lengths()
    assert len(lengths) >= tok.vocab_size
    assert [lengths[i] for i in ids] == decoded_bytes(tok, ids)
    targets = torch.tensor(ids[1:])
    n = int(target_bytes(targets, token_bytes_table(tok)))
    assert n == sum(decoded_bytes(tok, ids[1:])) == len(TINY.encode()) + 9  # BOS/EOS: 0 bytes


def test_byte_level_pieces_of_a_character_count_one_byte_each():
    """An unseen character is split into its UTF-8 bytes by byte-level BPE: decoding one piece
    alone gives U+FFFD (3 bytes), the byte length is 1, and the pieces add up to the text."""
    tok = tokenizers()["bpe"]
    text = "snow ☃ and 𝄞 over café"
    ids = tok.encode(text)
    lengths = tok.token_byte_lengths()
    pieces = [i for i in ids if tok.decode([i]) == "\ufffd"]
    assert len(pieces) >= 7  # ☃ is 3 bytes, 𝄞 is 4, neither was in the training text
    assert all(lengths[i] == 1 for i in pieces)
    assert (
        sum(lengths[i] for i in ids)
        == len(text.encode("utf-8"))
        == len(tok.decode(ids).encode("utf-8"))
    )


def test_target_bytes_skips_ignored_positions_and_bits_per_byte_divides():
    table = torch.tensor([0, 1, 2, 3, 4])
    targets = torch.tensor([[1, 2, -100], [4, -100, 0]])
    assert int(target_bytes(targets, table)) == 1 + 2 + 4 + 0
    assert bits_per_byte(7 * math.log(2), 7) == pytest.approx(1.0)
    assert bits_per_byte(3.0, 4) == pytest.approx(3.0 / (math.log(2) * 4))
    assert math.isnan(bits_per_byte(1.0, 0))  # only special tokens scored: no text


def test_perplexity_bits_per_byte_is_the_direct_computation():
    tok = tokenizers()["char"]
    text = "naïve crème — 東京, 42"
    ids = tok.encode(text) + [tok.eos_id] + tok.encode("café")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, d_model=16,
                                    max_seq_len=64)).eval()  # fmt: skip
    result = perplexity(model, ids, tok.token_byte_lengths())

    # one forward over the whole sequence (it fits the window): every target has all its context
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), -1)
    nats = -logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum().item()
    n_bytes = sum(decoded_bytes(tok, ids[1:]))
    assert n_bytes == len(text.encode()) - len(text[0].encode()) + len("café".encode())
    assert result.bytes == n_bytes and result.tokens == len(ids) - 1
    assert result.bits_per_byte == pytest.approx(nats / (math.log(2) * n_bytes), rel=1e-5)
    assert result.nll == pytest.approx(nats / (len(ids) - 1), rel=1e-5)
