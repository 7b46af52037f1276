"""Structured output on the real SmolLM2-135M-Instruct: 20 varied JSON schemas through
LM.chat(response_format=...) (the server's code path), every reply valid by `jsonschema`.

    LMFORGE_REAL_MODEL=1 pytest tests/serve/test_structured_real.py
"""

import json

import jsonschema
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

S, I, B, N = {"type": "string", "maxLength": 40}, {"type": "integer"}, {"type": "boolean"}, \
    {"type": "number"}  # fmt: skip


def obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}  # fmt: skip


SCHEMAS = {
    "person": ("Describe a person.", obj(name=S, age=I)),
    "book": ("Describe a book.", obj(title=S, author=S, year=I)),
    "flag": ("Is the sky blue?", obj(answer=B)),
    "enum": ("Pick a color.", obj(color={"enum": ["red", "green", "blue"]})),
    "list of strings": ("List three fruits.", obj(fruits={"type": "array", "items": S,
                                                           "minItems": 3, "maxItems": 3})),
    "list of ints": ("Give some primes.", {"type": "array", "items": I, "minItems": 1,
                                           "maxItems": 5}),
    "nested": ("Describe a city.", obj(city=S, country=obj(name=S, code=S))),
    "array of objects": ("List two people.", obj(people={"type": "array", "items":
                         obj(name=S, age=I), "minItems": 2, "maxItems": 2})),
    "number": ("Temperature in Paris?", obj(celsius=N)),
    "optional field": ("Describe a pet.", {"type": "object", "properties": {"name": S,
                       "species": S, "age": I}, "required": ["name", "species"],
                       "additionalProperties": False}),
    "nullable": ("Middle name of Ada Lovelace?", obj(middle={"anyOf": [S, {"type": "null"}]})),
    "const": ("Say ok.", obj(status={"const": "ok"}, detail=S)),
    "bounded int": ("Rate a movie from 1 to 5.", obj(stars={"type": "integer", "minimum": 1,
                                                             "maximum": 5})),
    "string pattern": ("Give a date.", obj(date={"type": "string",
                                                  "pattern": r"^\d{4}-\d{2}-\d{2}$"})),
    "one of": ("A shape.", {"oneOf": [obj(kind={"const": "circle"}, radius=N),
                                      obj(kind={"const": "square"}, side=N)]}),
    "top-level string": ("Name a planet.", {"type": "string", "maxLength": 30}),
    "top-level enum": ("Yes or no?", {"enum": ["yes", "no"]}),
    "map": ("Count some animals.", {"type": "object", "additionalProperties": I,
                                    "maxProperties": 3}),
    "recipe": ("A recipe.", obj(name=S, minutes=I, vegetarian=B, steps={"type": "array",
                                "items": S, "minItems": 1, "maxItems": 3})),
    "definitions": ("An address.", {"$defs": {"line": S}, "type": "object",
                    "properties": {"street": {"$ref": "#/$defs/line"},
                                   "town": {"$ref": "#/$defs/line"}},
                    "required": ["street", "town"], "additionalProperties": False}),
}  # fmt: skip


@pytest.fixture(scope="module")
def lm(smollm2_gguf):
    from lmforge.lm import LM

    return LM.load(smollm2_gguf)


def test_twenty_schemas_all_valid(lm):
    assert len(SCHEMAS) == 20
    failures = []
    for name, (question, schema) in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        messages = [{"role": "user", "content": f"{question} Answer in JSON."}]
        reply = lm.chat(messages, response_format=fmt, max_new_tokens=300, temperature=0.7,
                        seed=0)  # fmt: skip
        try:
            jsonschema.validate(json.loads(reply["content"]), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError) as err:
            failures.append(f"{name}: {reply['content']!r} ({err})")
    assert not failures, "\n".join(failures)
