import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmforge.data import builtin_corpus
from lmforge.errors import ConfigError, DataError, LMForgeError
from lmforge.tokenizer import DEFAULT_SPECIAL_TOKENS, Tokenizer

WORD_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "A dog, a cat and a bird: all friends!",
    "It's 42 degrees today; the fox is hot.",
    "Over the hill  and far away...",
]
WORD_TEXT = "\n".join(WORD_LINES)


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.train_bpe(builtin_corpus("pydoc")[:30], vocab_size=512)


@pytest.fixture(scope="module")
def char() -> Tokenizer:
    return Tokenizer.train_char([WORD_TEXT, "héllo 😀 中文\t"])


@pytest.fixture(scope="module")
def word() -> Tokenizer:
    return Tokenizer.train_word([WORD_TEXT], vocab_size=200)


@pytest.fixture(scope="module", params=["bpe", "char", "word"])
def any_tok(request, bpe, char, word) -> Tokenizer:
    return {"bpe": bpe, "char": char, "word": word}[request.param]


def test_special_tokens_take_lowest_ids_in_order(any_tok):
    assert any_tok.special_tokens == DEFAULT_SPECIAL_TOKENS
    for i, token in enumerate(DEFAULT_SPECIAL_TOKENS.values()):
        assert any_tok.token_to_id(token) == i
        assert any_tok.id_to_token(i) == token
    assert (any_tok.bos_id, any_tok.eos_id, any_tok.pad_id, any_tok.unk_id) == (0, 1, 2, 3)


def test_encode_adds_specials_only_when_asked(bpe):
    ids = bpe.encode("hello world")
    assert not set(ids) & set(range(len(DEFAULT_SPECIAL_TOKENS)))
    assert bpe.encode("hello world", add_bos=True, add_eos=True) == [0, *ids, 1]
    assert bpe.encode_batch(["hello", "world"], add_eos=True) == [
        bpe.encode("hello", add_eos=True),
        bpe.encode("world", add_eos=True),
    ]


def test_special_strings_in_raw_text_are_matched_like_hf(bpe):
    # Documented behaviour: literal "<|eos|>" in text becomes the EOS id, and decodes back.
    ids = bpe.encode("a<|eos|>b")
    assert bpe.eos_id in ids
    assert bpe.decode(ids) == "a<|eos|>b"
    assert bpe.decode(ids, skip_special_tokens=True) == "ab"


def test_bpe_vocab_size_and_byte_alphabet(bpe):
    assert bpe.kind == "bpe"
    assert bpe.vocab_size == len(bpe) == 512
    assert bpe.unk_id not in bpe.encode("\x00\x7f\u00ff\U0010ffff")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text())
def test_bpe_round_trip_any_unicode(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


@pytest.mark.parametrize(
    "text", ["😀👩‍👩‍👧 中文テキスト", "\x00\x01\r\n\t  \n\n   x", "", "é" * 50]
)
def test_bpe_round_trip_examples(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text
    assert bpe.decode_batch(bpe.encode_batch([text, text])) == [text, text]


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=sorted(set(WORD_TEXT + "héllo 😀 中文\t"))))
def test_char_round_trip(char, text):
    ids = char.encode(text)
    assert len(ids) == len(text)
    assert char.decode(ids) == text


def test_char_unseen_is_unk(char):
    ids = char.encode("a§b")
    assert ids[1] == char.unk_id
    assert char.decode(ids) == "a<|unk|>b"
    assert char.decode(ids, skip_special_tokens=True) == "ab"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(WORD_LINES), min_size=1, max_size=6))
def test_word_round_trip_known_words(word, lines):
    text = "\n".join(lines)
    ids = word.encode(text)
    assert word.unk_id not in ids
    assert word.decode(ids) == text


def test_word_tokens_are_words_and_unknowns_are_unk(word):
    assert word.kind == "word"
    ids = word.encode("the quick zebra")
    assert len(ids) == 5 and ids[4] == word.unk_id
    assert word.decode(ids[:4]) == "the quick "


def test_save_load_identity(any_tok, tmp_path):
    any_tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        any_tok.save(tmp_path / "tok")
    finally:
        any_tok.chat_template = None
    loaded = Tokenizer.load(tmp_path / "tok")
    assert loaded.kind == any_tok.kind
    assert loaded.special_tokens == any_tok.special_tokens
    assert loaded.chat_template.startswith("{% for m")
    assert loaded.backend.get_vocab() == any_tok.backend.get_vocab()
    for text in WORD_LINES:
        assert loaded.encode(text) == any_tok.encode(text)
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["eos_token"] == "<|eos|>" and config["lmforge_kind"] == any_tok.kind
    assert not list((tmp_path / "tok").glob("*.tmp"))  # atomic writes leave no temp files
    # the tokenizer.json file path works too
    assert Tokenizer.load(tmp_path / "tok" / "tokenizer.json").encode("fox") == any_tok.encode(
        "fox"
    )


def test_load_plain_hf_directory(tmp_path):
    specials = {"bos": "<s>", "eos": "</s>", "unk": "<unk>"}
    tok = Tokenizer.train_bpe(WORD_LINES, vocab_size=300, special_tokens=specials)
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": {"__type": "AddedToken", "content": "<s>"},
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",  # not in the vocabulary: ignored with a warning
        "model_max_length": 2048,
        "chat_template": [{"name": "default", "template": "T"}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="pad=.*not in the vocabulary"):
        loaded = Tokenizer.load(tmp_path)
    assert loaded.special_tokens == specials
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (0, 1, None)
    assert loaded.kind == "bpe" and loaded.chat_template == "T"
    assert loaded.model_max_length == 2048
    with pytest.raises(LMForgeError, match="no 'bos'"):
        Tokenizer.train_bpe(WORD_LINES, vocab_size=300, special_tokens={}).encode("x", add_bos=True)


@pytest.mark.parametrize("kind", ["bpe", "char", "word"])
def test_transformers_autotokenizer_parity(kind, bpe, char, word, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = {"bpe": bpe, "char": char, "word": word}[kind]
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    texts = WORD_LINES + ["Über 中文 😀  spaces\n\nnewlines", "def f(x):\n    return x"]
    if kind != "bpe":
        texts = WORD_LINES
    for text in texts:
        ours = tok.encode(text)
        assert hf(text, add_special_tokens=False)["input_ids"] == ours
        assert hf(text)["input_ids"] == ours  # no post-processor adds BOS/EOS behind our back
        assert hf.decode(ours) == tok.decode(ours) == text
    assert (hf.bos_token, hf.eos_token, hf.pad_token, hf.unk_token) == (
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
        "<|unk|>",
    )
    assert (hf.eos_token_id, hf.pad_token_id) == (tok.eos_id, tok.pad_id)


def test_bad_inputs(tmp_path):
    with pytest.raises(DataError, match=str(tmp_path / "nope")):
        Tokenizer.load(tmp_path / "nope")
    with pytest.raises(ConfigError, match="at least 264"):
        Tokenizer.train_bpe(WORD_LINES, vocab_size=200)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)
    with pytest.raises(ConfigError, match="unk"):
        Tokenizer.train_char(WORD_LINES, special_tokens={"eos": "<e>"})
    with pytest.raises(ConfigError, match="duplicate"):
        Tokenizer.train_bpe(WORD_LINES, special_tokens={"bos": "<s>", "eos": "<s>"})
    with pytest.raises(DataError, match="no characters"):
        Tokenizer.train_char([""])


def test_bpe_split_digits_gives_one_token_per_digit_and_exact_round_trip():
    tok = Tokenizer.train_bpe(builtin_corpus("pydoc")[:30], vocab_size=512, split_digits=True)
    text = "12+345=357 in 2024, x1"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    digit_pieces = [tok.id_to_token(i) for i in tok.encode("9876543210")]
    assert digit_pieces == list("9876543210")
    merged = Tokenizer.train_bpe(["1000 2000 3000 " * 50] * 20, vocab_size=300)
    assert len(merged.encode("1000")) < 4  # without the option, frequent numbers merge
