"""Structured output: a grammar (a JSON schema, a Lark grammar) enforced token by token.

    grammars = Grammars(tokenizer, vocab_size=model.config.vocab_size, stop_ids=[eos])
    params = GenerationParams(constraint=grammars.json_schema({"type": "object"}))

The grammar engine is llguidance (https://github.com/guidance-ai/llguidance), chosen over
xgrammar and outlines-core by its per-token cost on CPU and its compile time
(benchmarks/bench_serve_grammar.py; the figures are in docs/benchmarks.md). Each sample gets its
own `GrammarConstraint` (the `constraint` factory of GenerationParams); the engine's sampler asks
it for the allowed tokens before each draw (infer/sampling.py), so constrained and free requests
share one batch and stream as usual. A grammar the engine cannot compile is refused when the
factory is made (ConfigError), before anything is queued.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from lmforge.errors import ConfigError

# The JSON the grammar allows for response_format {"type": "json_object"}: any object.
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
# Whitespace between JSON tokens: exactly json.dumps's (", " and ": ", nothing else), so a small
# model cannot loop on newlines inside a valid but endless document.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ll_tokenizer(tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
    """llguidance's view of `tokenizer` (building it reads the whole vocabulary, ~0.2 s for
    SmolLM2's 49k tokens): cached per tokenizer, vocabulary width and stop ids."""
    import llguidance

    per_tokenizer = _TOKENIZERS.setdefault(tokenizer, {})
    key = (vocab_size, stop_ids)
    if key not in per_tokenizer:
        per_tokenizer[key] = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(stop_ids)
        )
    return per_tokenizer[key]


class GrammarConstraint:
    """One sample's grammar state (infer/params.py TokenConstraint): an llguidance matcher.

    Once the grammar is complete only the stop tokens are allowed, so the sample ends. Should
    the matcher fail (it cannot once its own masks are obeyed), the stop tokens are allowed so
    the sample still ends rather than drawing from an empty distribution."""

    def __init__(self, matcher, vocab_size: int, stop_ids: Sequence[int]):
        import llguidance.numpy as llnp

        self.matcher, self.vocab_size = matcher, vocab_size
        self._fill = llnp.fill_next_token_bitmask
        self._bits = llnp.allocate_token_bitmask(1, vocab_size)
        self._stop = torch.zeros(vocab_size, dtype=torch.bool)
        self._stop[list(stop_ids)] = True

    def allowed(self) -> torch.Tensor:
        if self.matcher.is_error() or self.matcher.is_stopped():
            return self._stop
        self._fill(self.matcher, self._bits, 0)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab_size].view(np.bool_))

    def consume(self, token: int) -> None:
        if not self.matcher.is_error() and not self.matcher.is_stopped():
            self.matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """True when the text so far is a whole sentence of the grammar."""
        return self.matcher.is_accepting()


class Grammars:
    """Compiles grammars for one tokenizer; each method returns a GenerationParams.constraint
    factory (or raises ConfigError naming what is wrong with the grammar)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        if not stop_ids:
            raise ConfigError("structured output needs a stop token (the model has no EOS id)")
        self.vocab_size, self.stop_ids = vocab_size, tuple(int(i) for i in stop_ids)
        self.tokenizer = _ll_tokenizer(tokenizer, vocab_size, self.stop_ids)

    def json_schema(self, schema: dict[str, Any] | None = None) -> Callable[[], GrammarConstraint]:
        """JSON valid against `schema` (None: any JSON object)."""
        import llguidance

        schema = ANY_JSON_OBJECT if schema is None else schema
        if not isinstance(schema, dict):
            raise ConfigError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
        except ValueError as err:
            raise ConfigError(f"invalid JSON schema: {err}") from None
        return self.grammar(grammar, "JSON schema")

    def lark(self, grammar: str) -> Callable[[], GrammarConstraint]:
        """Text in the language of a Lark grammar (llguidance's dialect: `%json {schema}` embeds
        a JSON schema as a rule)."""
        import llguidance

        return self.grammar(llguidance.LLMatcher.grammar_from_lark(grammar), "grammar")

    def grammar(self, grammar: str, what: str) -> Callable[[], GrammarConstraint]:
        """A factory of constraints for llguidance's serialized `grammar` (checked now)."""
        import llguidance

        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if failed:
            raise ConfigError(f"invalid {what}: {messages[0] if messages else 'rejected'}")

        def make() -> GrammarConstraint:
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            return GrammarConstraint(matcher, self.vocab_size, self.stop_ids)

        return make
