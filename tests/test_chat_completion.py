"""One chat turn (lmforge.chat_completion) and LM.chat: tool prompts, tool_choice grammars,
tool-call parsing (whole and streamed), response_format, and the clear errors."""

import json

import jsonschema
import pytest
from chat_tools import TOOL_TEXT, WEATHER

from lmforge.chat_completion import (
    CALL_CLOSE,
    CALL_OPEN,
    ChatPlan,
    ChatRequestError,
    ToolCallStream,
    parse_tool_calls,
    plan_chat,
    render_prompt,
)
from lmforge.errors import ConfigError
from lmforge.lm import LM

TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
    "additionalProperties": False}}}  # fmt: skip
NAMES = frozenset({"weather", "time"})


@pytest.fixture(scope="module")
def lm(make_tiny_lm) -> LM:
    return make_tiny_lm(1024, [TOOL_TEXT * 20], 300, preset="llama-micro")


def test_generic_tool_prompt_lists_tools_and_feeds_results_back(lm):
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    prompt = render_prompt(lm.tokenizer, messages, [WEATHER])
    assert '"name": "weather"' in prompt and "today's weather" in prompt  # the tool listing
    assert f'{CALL_OPEN}\n{{"name": "weather", "arguments": {{"city": "Paris"}}}}' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    assert prompt.index("weather in Paris?") < prompt.index("sunny")


def test_tool_choice_errors_name_the_field(lm):
    def plan(**kw):
        return plan_chat(lm.tokenizer, lm.grammars, kw.pop("messages", [{"role": "user",
                         "content": "hi"}]), **kw)  # fmt: skip

    cases = [
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice", "not in tools"),
        (dict(tool_choice="required"), "tool_choice", "needs tools"),
        (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", "must be"),
        (dict(messages=[{"role": "user", "content": "hi"},
                        {"role": "tool", "tool_call_id": "x", "content": "42"}]),
         "messages.1", "answers no earlier assistant tool call"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "s",
              "schema": {"type": "nonsense"}}}), "response_format.json_schema.schema",
         "invalid JSON schema"),
        (dict(response_format={"type": "yaml"}), "response_format", "not one of"),
    ]  # fmt: skip
    for kw, param, message in cases:
        with pytest.raises(ChatRequestError, match=message) as err:
            plan(**kw)
        assert err.value.param == param


def test_parse_tool_calls_whole_and_streamed():
    text = (f'Let me check.\n{CALL_OPEN}\n{{"name": "weather", "arguments": {{"city": "Rome"}}}}'
            f'\n{CALL_CLOSE}\n{CALL_OPEN}\n{{"name": "time", "arguments": {{"utc": true}}}}\n'
            f"{CALL_CLOSE}")  # fmt: skip
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["weather", "time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    # a block that is not a known function's JSON stays text
    bad = f'{CALL_OPEN}{{"name": "rm -rf"}}{CALL_CLOSE} ok'
    assert parse_tool_calls(bad, NAMES) == (bad, [])
    assert parse_tool_calls("plain <tool", NAMES) == ("plain <tool", [])

    plan = ChatPlan("", None, True, NAMES)
    for size in (1, 3, 7):  # deltas of any size: the same content and calls
        stream = ToolCallStream(plan)
        sent = "".join(stream.push(text[i : i + size]) for i in range(0, len(text), size))
        rest, streamed = stream.finish()
        assert sent == "Let me check.\n" and rest == ""
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]
    stream = ToolCallStream(plan)  # text that only looked like the start of a block
    assert stream.push("a <tool") == "a " and stream.push("box") == "<toolbox"
    assert stream.finish() == ("", [])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "time"}}])
def test_lm_chat_required_and_named_tool_calls_always_parse(lm, choice):
    for seed in range(2):
        message = lm.chat([{"role": "user", "content": "hello"}], tools=[WEATHER, TIME],
                          tool_choice=choice, temperature=1.0, seed=seed,
                          max_new_tokens=200)  # fmt: skip
        calls = message["tool_calls"]
        assert calls and message["role"] == "assistant"
        for call in calls:
            fn = call["function"]
            tool = {"weather": WEATHER, "time": TIME}[fn["name"]]
            jsonschema.validate(json.loads(fn["arguments"]), tool["function"]["parameters"])
            if isinstance(choice, dict):
                assert fn["name"] == "time"


def test_lm_chat_response_format_json_schema(lm):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
              "city": {"enum": ["Paris", "Rome"]}}, "required": ["ok", "city"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    message = lm.chat([{"role": "user", "content": "hi"}], response_format=fmt, seed=0)
    jsonschema.validate(json.loads(message["content"]), schema)
    assert "tool_calls" not in message


def test_generate_on_text_says_what_to_use(lm):
    with pytest.raises(ConfigError, match="LM.complete"):
        lm.generate(["Hello"])
    with pytest.raises(ConfigError, match="token ids"):
        lm.generate("Hello")
