"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers` tokenizer, and written back.

A GGUF has no tokenizer.json: llama.cpp stores the vocabulary (`tokenizer.ggml.tokens`), its
kind (`tokenizer.ggml.model`: "gpt2" = byte-level BPE with `merges`, "llama" = SentencePiece with
`scores`), each token's type (normal, control, user-defined, byte, ...), the pre-tokenizer's name
(`tokenizer.ggml.pre`), the special token ids and the chat template. We rebuild exactly the
tokenizer transformers builds from the same metadata (transformers/integrations/gguf/
gguf_tokenizer_mapping.py: GPT2Tokenizer / LlamaTokenizer backends, control tokens added as
special, user-defined ones as plain added tokens, the split regex chosen by the pre-tokenizer
name), so token ids match its `AutoTokenizer.from_pretrained(..., gguf_file=...)`. transformers
itself is not imported: it is only a dev dependency.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from lmforge.errors import CheckpointError, ConfigError
from lmforge.tokenizer import Tokenizer

# llama.cpp's token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_TOKENIZERS = ("gpt2", "llama")

# The split regex each llama.cpp pre-tokenizer name stands for (transformers' table; names it does
# not list keep GPT-2's own ByteLevel regex, as transformers does).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
         "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}  # fmt: skip
# GPT-2's spelling of bytes as printable characters, which byte-level BPE vocabularies use
BYTE_SPELLING = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
BYTE_ALPHABET = frozenset(pre_tokenizers.ByteLevel.alphabet())


def generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two
    vocabulary pieces, ranked by the token's score (best first). transformers' generate_merges."""
    merges = []
    for token, score in scores.items():
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _byte_level_backend(meta: dict[str, Any]) -> Backend:
    vocab = {}
    for i, token in enumerate(meta["tokenizer.ggml.tokens"]):
        # A token outside the byte alphabet (a mislabelled special written as raw text) is
        # respelled byte by byte, as transformers does.
        if not set(token) <= BYTE_ALPHABET:
            token = "".join(piece for piece, _ in BYTE_SPELLING.pre_tokenize_str(token))
        vocab.setdefault(token, i)
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges") or []]
    backend = Backend(
        BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
            end_of_word_suffix="", fuse_unk=False)
    )  # fmt: skip
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        split_step = pre_tokenizers.Split(Regex(split), behavior="isolated")
        byte_step = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.pre_tokenizer = pre_tokenizers.Sequence([split_step, byte_step])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(meta: dict[str, Any]) -> Backend:
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # a repeated token: first id
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise CheckpointError("tokenizer.ggml.scores is missing or not one score per token")
        merges = generate_merges(vocab, dict(zip(tokens, scores)))
    backend = Backend(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    if meta.get("general.architecture") == "phi3":
        # Phi-3 prepends the word marker with a normalizer, not a Metaspace pre-tokenizer (this
        # only differs on text starting with a space); transformers chooses it by architecture.
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )
    else:
        # LlamaTokenizer (legacy=False): a word marker before the first word only.
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first", split=False
        )
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(content=" ", left=1)]
    )  # fmt: skip
    return backend


def tokenizer_from_gguf(meta: dict[str, Any], source: str) -> tuple[Tokenizer, bool]:
    """(Tokenizer, add_bos) from a GGUF's metadata dict (key -> value). add_bos says whether
    llama.cpp prepends BOS when encoding a prompt (SentencePiece files default to yes)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise CheckpointError(f"{source}: no tokenizer in the metadata (tokenizer.ggml.tokens)")
    if kind not in SUPPORTED_TOKENIZERS:
        raise CheckpointError(
            f"{source}: tokenizer.ggml.model {kind!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_TOKENIZERS)}"
        )
    byte_level = kind == "gpt2"
    backend = _byte_level_backend(meta) if byte_level else _sentencepiece_backend(meta)
    types = meta.get("tokenizer.ggml.token_type") or []
    if types and len(types) != len(tokens):
        raise CheckpointError(
            f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    alphabet = BYTE_ALPHABET if byte_level else None
    # Control tokens (<|im_start|>, <s>) are matched whole in text and skippable on decode;
    # in a byte-level vocabulary a "control" token outside the byte alphabet is a llama.cpp
    # mislabel that transformers skips, and so do we.
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, types)
        if ty == CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    vocab = backend.get_vocab()
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, types)
        if ty == USER_DEFINED and t in vocab
    ]
    specials: dict[str, str] = {}
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if (token_id := meta.get(f"tokenizer.ggml.{key}_token_id")) is None:
            continue
        if not 0 <= token_id < len(tokens):
            raise CheckpointError(
                f"{source}: tokenizer.ggml.{key}_token_id={token_id} is outside the "
                f"{len(tokens)}-token vocabulary"
            )
        token = backend.id_to_token(token_id)
        specials[role] = token
        if all(a.content != token for a in control):
            # transformers registers bos/eos/unk/pad as special tokens too (matched whole in text).
            control.append(AddedToken(token, normalized=False, special=True))
    backend.add_special_tokens(control)
    backend.add_tokens(user)
    default_bos = kind == "llama"  # llama.cpp prepends BOS to a SentencePiece vocabulary by default
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)) and "bos" in specials
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and "eos" in specials
    _set_post_processor(backend, specials, add_bos, add_eos)
    return Tokenizer(backend, "bpe", specials, meta.get("tokenizer.chat_template")), add_bos


def _set_post_processor(backend: Backend, specials: dict[str, str], bos: bool, eos: bool) -> None:
    """BOS/EOS as the file asks, for tools that read the saved tokenizer.json (transformers);
    lmforge's own encode() adds them only when asked."""
    single, pair, used = "$A:0", "$A:0 $B:1", []
    if bos:
        single, pair = f"{specials['bos']}:0 {single}", f"{specials['bos']}:0 {pair}"
        used.append(specials["bos"])
    if eos:
        single, pair = f"{single} {specials['eos']}:0", f"{pair} {specials['eos']}:1"
        used.append(specials["eos"])
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, backend.token_to_id(t)) for t in used]
    )


# ---- writing -----------------------------------------------------------------------------------
def gguf_pre_name(backend: Backend) -> str:
    """llama.cpp's name for a byte-level tokenizer's pre-tokenizer (text splitting before BPE)."""
    pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers", [])
        kinds = [step.get("type") for step in steps]
        if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
            regex = steps[0].get("pattern", {}).get("Regex")
            for name in ("llama-bpe", "qwen2", "tekken", "gpt-4o"):
                if PRE_TOKENIZER_SPLITS[name] == regex:
                    return name
    raise ConfigError(
        "this tokenizer's pre-tokenizer has no llama.cpp equivalent (supported: GPT-2 ByteLevel, "
        "or the llama-bpe/qwen2/tekken/gpt-4o split regexes followed by ByteLevel)"
    )


def tokenizer_to_gguf(tok: Tokenizer, n_vocab: int) -> dict[str, Any]:
    """GGUF tokenizer metadata for a byte-level BPE Tokenizer, the vocabulary padded to the
    model's `n_vocab` rows with unused "[PAD<i>]" tokens (as llama.cpp's converter does): a
    dict {name: value} whose names are gguf.GGUFWriter's `add_<name>` methods."""
    data = json.loads(tok.backend.to_str())
    model = data.get("model") or {}
    if model.get("type") != "BPE" or (data.get("decoder") or {}).get("type") != "ByteLevel":
        raise ConfigError(
            f"a {tok.kind!r} tokenizer cannot be written to GGUF: only byte-level BPE tokenizers "
            "(lmforge's 'bpe' kind, GPT-2/Llama-3/Qwen style) are supported"
        )
    pre = gguf_pre_name(tok.backend)
    if tok.vocab_size > n_vocab:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens, the model {n_vocab} rows")
    added = {a["id"]: CONTROL if a.get("special") else USER_DEFINED
             for a in data.get("added_tokens", [])}  # fmt: skip
    tokens = [tok.backend.id_to_token(i) for i in range(n_vocab)]
    types = [UNUSED if t is None else added.get(i, NORMAL) for i, t in enumerate(tokens)]
    tokens = [f"[PAD{i}]" if t is None else t for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta: dict[str, Any] = {"tokenizer_model": "gpt2", "tokenizer_pre": pre, "token_list": tokens,
                            "token_types": types, "token_merges": merges}  # fmt: skip
    ids = {f"{role}_token_id": getattr(tok, f"{role}_id") for role in ("bos", "eos", "unk", "pad")}
    meta.update({key: token_id for key, token_id in ids.items() if token_id is not None})
    meta["add_bos_token"] = False  # lmforge models are trained without an implicit BOS
    if tok.chat_template:
        meta["chat_template"] = tok.chat_template
    return meta
