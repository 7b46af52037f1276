"""The `Tokenizer`: a `tokenizers.Tokenizer` backend plus named special tokens and a chat template.

Three kinds are trained here, all on the Hugging Face `tokenizers` library so that the saved
`tokenizer.json` loads unchanged in `transformers.AutoTokenizer`:

- "bpe":  byte-level BPE (GPT-2 style). The initial alphabet holds all 256 bytes, so any Unicode
          text encodes without UNK and decodes back exactly.
- "char": one id per character seen in training (nanoGPT's shakespeare_char); unseen chars -> UNK.
- "word": one id per word, punctuation mark and whitespace character, so decoding a text made
          of known words gives the text back exactly; unseen words -> UNK.

Special tokens take the lowest ids (0..n-1) in the order of the `special_tokens` dict. Like Hugging
Face tokenizers, `encode` matches special-token strings that occur literally in raw text (the text
"<|eos|>" encodes to the EOS id); callers that feed untrusted text into chat prompts should strip or
escape those strings first.
"""

from __future__ import annotations

import itertools
import json
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

from lmforge.errors import ConfigError, DataError, LMForgeError
from lmforge.fileio import read_json, remove_stale_temps, write_text

DEFAULT_SPECIAL_TOKENS: dict[str, str] = {
    "bos": "<|bos|>",
    "eos": "<|eos|>",
    "pad": "<|pad|>",
    "unk": "<|unk|>",
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "end": "<|end|>",
}

# Words, single punctuation marks and single whitespace characters. The pieces concatenate back to
# the text, and a word has one id wherever it appears (GPT-2's " word" pieces would give "the" and
# " the" different ids, so a known word at the start of a text would be UNK). Single whitespace
# characters cost length but never turn an unusual run of spaces into UNK.
WORD_PATTERN = r"\w+|[^\w\s]|\s"
# Hugging Face's "no limit" value for model_max_length.
HF_NO_MAX_LENGTH = 1000000000000000019884624838656
_HF_ROLES = ("bos", "eos", "pad", "unk")
Specials = dict[str, str]  # role ("bos", "user", ...) -> token string


def _token_content(value: Any) -> str | None:
    """A special token from a HF config: a plain string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _role_id(role: str) -> property:
    """A Tokenizer property: the id of the special token of `role`, None when it has none."""

    def role_id(tok: Tokenizer) -> int | None:
        token = tok.special_tokens.get(role)
        return None if token is None else tok.backend.token_to_id(token)

    return property(role_id, doc=f"The id of the {role!r} special token (None: there is none).")


class Tokenizer:
    """A trained tokenizer: encode/decode text, know its special tokens, save/load HF-compatibly."""

    def __init__(
        self,
        backend: Backend,
        kind: str,
        special_tokens: Specials | None = None,
        chat_template: str | None = None,
        model_max_length: int | None = None,
    ):
        self.backend = backend
        self.kind = kind
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        for role, token in self.special_tokens.items():
            if backend.token_to_id(token) is None:
                raise ConfigError(f"special token {role}={token!r} is not in the vocabulary")

    # ---------------------------------------------------------------- training

    @staticmethod
    def _specials(special_tokens: Specials | None, need_unk: bool = False) -> Specials:
        specials = dict(DEFAULT_SPECIAL_TOKENS if special_tokens is None else special_tokens)
        if len(set(specials.values())) != len(specials):
            raise ConfigError(f"special_tokens has duplicate token strings: {specials}")
        if need_unk and "unk" not in specials:
            raise ConfigError("special_tokens needs an 'unk' entry for char/word tokenizers")
        return specials

    @staticmethod
    def _added(specials: Specials) -> list[AddedToken]:
        # normalized=False: match the raw string; special=True: never split, skippable on decode.
        return [AddedToken(t, special=True, normalized=False) for t in specials.values()]

    @classmethod
    def train_bpe(
        cls,
        texts: Iterable[str],
        vocab_size: int = 4096,
        special_tokens: Specials | None = None,
        min_frequency: int = 2,
        show_progress: bool = False,
        split_digits: bool = False,
    ) -> Tokenizer:
        """Train a byte-level BPE tokenizer whose round trip is exact for any Unicode text.

        `split_digits` makes every digit its own token (as Llama and nanochat do), so numbers
        share one set of ten digit ids and arithmetic is learnable digit by digit.
        """
        specials = cls._specials(special_tokens)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(specials) + len(alphabet):
            raise ConfigError(
                f"vocab_size={vocab_size} is too small for byte-level BPE: it needs at least "
                f"{len(specials) + len(alphabet)} ({len(specials)} special tokens + 256 bytes)"
            )
        backend = Backend(models.BPE())
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            if split_digits
            else byte_level
        )
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=cls._added(specials),
            initial_alphabet=alphabet,
            show_progress=show_progress,
        )
        backend.train_from_iterator(texts, trainer)
        return cls(backend, "bpe", specials)

    @staticmethod
    def _split_backend(unk: str, pattern: str, vocab: dict[str, int] | None = None) -> Backend:
        """A WordLevel model over the pieces `pattern` isolates, decoded by concatenation (the
        default decoder would join them with spaces)."""
        backend = Backend(models.WordLevel(vocab, unk_token=unk))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        backend.decoder = decoders.Fuse()
        return backend

    @classmethod
    def train_char(cls, texts: Iterable[str], special_tokens: Specials | None = None) -> Tokenizer:
        """Build a character tokenizer: specials first, then each character seen, sorted."""
        specials = cls._specials(special_tokens, need_unk=True)
        seen = set(itertools.chain.from_iterable(texts)) - set(specials.values())
        if not seen:
            raise DataError("train_char: the training texts contain no characters")
        vocab = {t: i for i, t in enumerate([*specials.values(), *sorted(seen)])}
        # [\s\S] matches any single code point, newlines included, in every regex dialect.
        backend = cls._split_backend(specials["unk"], r"[\s\S]", vocab)
        backend.add_special_tokens(cls._added(specials))
        return cls(backend, "char", specials)

    @classmethod
    def train_word(
        cls, texts: Iterable[str], vocab_size: int = 8192, special_tokens: Specials | None = None
    ) -> Tokenizer:
        """Train a word-level tokenizer keeping the `vocab_size` most frequent words/punctuation."""
        specials = cls._specials(special_tokens, need_unk=True)
        if vocab_size <= len(specials):
            raise ConfigError(
                f"vocab_size={vocab_size} leaves no room for words after {len(specials)} specials"
            )
        backend = cls._split_backend(specials["unk"], WORD_PATTERN)
        trainer = trainers.WordLevelTrainer(
            vocab_size=vocab_size, special_tokens=cls._added(specials), show_progress=False
        )
        backend.train_from_iterator(texts, trainer)
        if backend.get_vocab_size() <= len(specials):
            raise DataError("train_word: the training texts contain no words")
        return cls(backend, "word", specials)

    # ---------------------------------------------------------------- save / load

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json and a Hugging Face-style tokenizer_config.json into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(directory)  # temps of a save that was killed before its rename
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **{f"{r}_token": self.special_tokens.get(r) for r in _HF_ROLES},
            "additional_special_tokens": [
                t for r, t in self.special_tokens.items() if r not in _HF_ROLES
            ],
            "model_max_length": self.model_max_length or HF_NO_MAX_LENGTH,
            "clean_up_tokenization_spaces": False,
            "lmforge_kind": self.kind,
            "lmforge_special_tokens": self.special_tokens,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        write_text(directory / "tokenizer.json", self.backend.to_str(pretty=True))
        write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Load a directory holding tokenizer.json (ours or a Hugging Face one), or that file."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"tokenizer not found: {file} does not exist")
        try:
            backend = Backend.from_file(str(file))
        except Exception as e:
            raise DataError(f"{file}: not a valid tokenizer.json ({e})") from e
        config = cls._read_json(file.parent / "tokenizer_config.json")
        token_map = cls._read_json(file.parent / "special_tokens_map.json")

        if isinstance(config.get("lmforge_special_tokens"), dict):
            specials = dict(config["lmforge_special_tokens"])
        else:
            # A foreign tokenizer: take our default tokens if present, then the HF role names.
            specials = {role: token for role, token in DEFAULT_SPECIAL_TOKENS.items()
                        if backend.token_to_id(token) is not None}  # fmt: skip
            for role in _HF_ROLES:
                token = _token_content(config.get(f"{role}_token", token_map.get(f"{role}_token")))
                if token is not None:
                    specials[role] = token
        for role, token in list(specials.items()):
            if backend.token_to_id(token) is None:
                msg = f"{file}: special token {role}={token!r} is not in the vocabulary; ignored"
                warnings.warn(msg, stacklevel=2)
                del specials[role]

        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # HF's list of named templates
            named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
            chat_template = named.get("default", next(iter(named.values()), None))
        jinja = file.parent / "chat_template.jinja"  # newer transformers save it separately
        if chat_template is None and jinja.is_file():
            chat_template = jinja.read_text(encoding="utf-8")

        kind = config.get("lmforge_kind")
        if kind is None:
            model_type = json.loads(backend.to_str())["model"]["type"]
            kind = {"BPE": "bpe", "WordLevel": "word"}.get(model_type, model_type.lower())
        max_len = config.get("model_max_length")
        max_len = max_len if isinstance(max_len, int) and max_len < HF_NO_MAX_LENGTH else None
        return cls(backend, kind, specials, chat_template, max_len)

    @staticmethod
    def _read_json(path: Path) -> dict[str, Any]:
        """An optional config file beside tokenizer.json ({} when absent)."""
        data = read_json(path, error=DataError) if path.is_file() else {}
        if not isinstance(data, dict):
            raise DataError(f"{path}: expected a JSON object")
        return data

    # ---------------------------------------------------------------- encode / decode

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (the model's embedding needs at least this)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    bos_id = _role_id("bos")
    eos_id = _role_id("eos")
    pad_id = _role_id("pad")
    unk_id = _role_id("unk")

    def _wrap(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
        for role, wanted in (("bos", add_bos), ("eos", add_eos)):
            if wanted and getattr(self, f"{role}_id") is None:
                raise LMForgeError(f"add_{role}=True: this tokenizer has no {role!r} special token")
        bos = [self.bos_id] if add_bos else []
        return bos + ids + ([self.eos_id] if add_eos else [])

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids for `text`; BOS/EOS only when asked (the backend adds nothing itself)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return self._wrap(ids, add_bos, add_eos)

    def encode_batch(
        self, texts: list[str], add_bos: bool = False, add_eos: bool = False
    ) -> list[list[int]]:
        """Encode many texts at once on the backend's thread pool (much faster than a loop)."""
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets, which we never use.
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        encodings = encode(list(texts), add_special_tokens=False)
        return [self._wrap(e.ids, add_bos, add_eos) for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids` (a list, tensor or array). Ids outside the vocabulary are dropped."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        """Decode many id sequences at once."""
        seqs = [s.tolist() if hasattr(s, "tolist") else list(s) for s in sequences]
        return self.backend.decode_batch(seqs, skip_special_tokens=skip_special_tokens)

    def token_byte_lengths(self) -> list[int]:
        """How many UTF-8 bytes of text each id stands for (list index = id), for bits per byte.

        Special tokens (and ids with no token) count 0, as in nanochat: they are not text. A
        byte-level BPE token (ours, GPT-2's) is exactly one byte per character of its vocabulary
        string, so partial UTF-8 characters count right and the lengths of a sequence add up to
        the bytes of its decoded text. A byte-fallback token `<0xNN>` is one byte. Any other
        token counts the bytes it adds when decoded after a plain one-token anchor, so decoders
        that strip the first token's leading space (SentencePiece's Metaspace) still count it.
        Computed once per vocabulary size and cached."""
        vocab = self.backend.get_vocab(with_added_tokens=True)
        size = max(self.vocab_size, max(vocab.values(), default=-1) + 1)
        cached = getattr(self, "_token_bytes", None)
        if cached is not None and len(cached) == size:
            return cached
        added = self.backend.get_added_tokens_decoder()
        specials = {i for i, tok in added.items() if tok.special}
        specials |= {vocab[t] for t in self.special_tokens.values() if t in vocab}
        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        byte_level = isinstance(self.backend.decoder, decoders.ByteLevel)
        byte_fallback = "ByteFallback" in json.dumps(decoder)
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        lengths = [0] * size
        other: list[int] = []
        for token, i in vocab.items():
            if i in specials:
                continue
            if byte_level and i not in added:
                lengths[i] = sum(1 if c in alphabet else len(c.encode("utf-8")) for c in token)
            elif byte_fallback and len(token) == 6 and token.startswith("<0x") and token[-1] == ">":
                lengths[i] = 1
            else:
                other.append(i)
        if other:
            # the anchor: a plain word piece ("lo", not "▁lo" or "##lo"), decoded unchanged
            anchor = next(
                ([i] for t, i in sorted(vocab.items(), key=lambda kv: kv[1])
                 if i not in specials and t.isascii() and t.isalnum()),
                [],
            )  # fmt: skip
            base = len(self.backend.decode(anchor).encode("utf-8"))
            texts = self.backend.decode_batch([anchor + [i] for i in other])
            for i, text in zip(other, texts, strict=True):
                lengths[i] = max(0, len(text.encode("utf-8")) - base)
        self._token_bytes = lengths
        return lengths

    def chat_stop_ids(self, eos_ids: Iterable[int]) -> list[int]:
        """`eos_ids` plus the chat template's end-of-turn token (the built-in template's
        `<|end|>`) when this vocabulary has one: the ids a chat reply stops at."""
        end = self.token_to_id(self.special_tokens.get("end", "<|end|>"))
        return sorted(set(eos_ids) | ({end} if end is not None else set()))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size})"
