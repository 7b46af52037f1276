"""Constrained decoding: the sampler's constraint hook, and llguidance grammars through it.

The oracle for "valid JSON for the schema" is `jsonschema` (the reference validator), never our
own check."""

import json

import jsonschema
import pytest
import torch

from lmforge.errors import ConfigError
from lmforge.infer.engine import Engine
from lmforge.infer.params import GenerationParams
from lmforge.lm import LM

TEXT = 'hello {"name": "x", "age": 3, "ok": true, "tags": ["a", "b"]} [1, 2.5, null] world. '


@pytest.fixture(scope="module")
def lm(make_tiny_lm) -> LM:
    return make_tiny_lm(128, [TEXT * 20], 300, preset="llama-micro")


class OnlyThese:
    """A constraint allowing a fixed set of tokens; records what it was told."""

    def __init__(self, vocab: int, allowed: list[int]):
        self.mask = torch.zeros(vocab, dtype=torch.bool)
        self.mask[allowed] = True
        self.seen: list[int] = []

    def allowed(self) -> torch.Tensor:
        return self.mask

    def consume(self, token: int) -> None:
        self.seen.append(token)


def test_constraint_masks_every_draw_and_sees_every_token(lm):
    vocab = lm.config.vocab_size
    made: list[OnlyThese] = []

    def factory():
        made.append(OnlyThese(vocab, [7, 11, 13]))
        return made[-1]

    engine = Engine.from_lm(lm, max_batch=4)
    free = GenerationParams(max_new_tokens=12, temperature=1.0, seed=0, stop_token_ids=[])
    constrained = GenerationParams(max_new_tokens=12, temperature=1.0, seed=0, stop_token_ids=[],
                                   constraint=factory)  # fmt: skip
    greedy = GenerationParams(max_new_tokens=12, temperature=0, stop_token_ids=[],
                              constraint=factory)  # fmt: skip
    engine.add_request("hello", free)
    engine.add_request("hello", constrained, n=2)
    engine.add_request("world", greedy)
    outs: dict[tuple, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            outs.setdefault((out.request_id, out.index), []).extend(out.token_ids)
    assert len(made) == 3  # one constraint per sample
    rows = list(outs.values())
    assert any(t not in (7, 11, 13) for t in rows[0])  # the free row beside them is not masked
    for tokens in rows[1:]:
        assert len(tokens) == 12 and set(tokens) <= {7, 11, 13}
    assert sorted(tuple(c.seen) for c in made) == sorted(tuple(r) for r in rows[1:])


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
     "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "number"}},
     "required": ["kind", "n"], "additionalProperties": False},
]  # fmt: skip


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_output_validates_even_from_a_random_model(lm, schema):
    from lmforge.infer.structured import Grammars

    eos = lm.tokenizer.eos_id
    grammars = Grammars(lm.tokenizer, lm.config.vocab_size, [eos])
    params = GenerationParams(max_new_tokens=100, temperature=0.7, seed=3, stop_token_ids=[eos],
                              constraint=grammars.json_schema(schema))  # fmt: skip
    engine = Engine.from_lm(lm, max_batch=4)
    finished = 0
    for c in engine.generate(["hello", "world"], params, n=2):
        if c.finish_reason == "stop":  # a random model may run out of tokens mid-document
            jsonschema.validate(json.loads(c.text), schema)
            finished += 1
    assert finished >= 1


def test_any_json_object_and_invalid_schemas(lm):
    from lmforge.infer.structured import Grammars

    grammars = Grammars(lm.tokenizer, lm.config.vocab_size, [lm.tokenizer.eos_id])
    make = grammars.json_schema(None)
    constraint = make()
    first = torch.nonzero(constraint.allowed()[: lm.config.vocab_size]).flatten().tolist()
    assert first and all(lm.tokenizer.decode([t]).lstrip().startswith("{") for t in first)
    for bad in ({"type": "foo"}, {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}):
        with pytest.raises(ConfigError, match="invalid JSON schema"):
            grammars.json_schema(bad)
    with pytest.raises(ConfigError, match="must be an object"):
        grammars.json_schema(["not", "a", "schema"])


def test_speculative_decoding_refuses_a_constraint(lm):
    engine = Engine.from_lm(lm, draft=lm.model)
    with pytest.raises(ConfigError, match="constraint"):
        engine.add_request("hi", GenerationParams(constraint=lambda: None))
