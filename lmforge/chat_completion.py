"""One chat turn as the OpenAI chat-completions API defines it, shared by `LM.chat` and the
server's /v1/chat/completions: messages (with tool calls and tool results) + tools + tool_choice +
response_format -> prompt text and a grammar constraint; the generated text -> an assistant
message with `content` and `tool_calls`.

Tools reach the model through its chat template when the template renders them (it mentions
`tools`, as Qwen2.5's and Hermes' do; transformers passes them the same way), otherwise in a
generic format: the tool list appended to the system prompt as JSON, and this instruction:

    To call a function, reply with one or more blocks, each
    <tool_call>
    {"name": <function name>, "arguments": <arguments as a JSON object>}
    </tool_call>

Either way a call is parsed from `<tool_call>` blocks (the convention of those templates), and a
tool result is fed back as a `tool` message (through the template, or generically as a user turn
holding `<tool_response>...</tool_response>`). tool_choice "required" and a named function are
enforced by constrained decoding (infer/structured.py): the reply can only be such blocks, with
arguments valid for the function's JSON schema, so the call always parses. "auto" lets the model
choose (a block that does not parse stays text); "none" never parses calls. response_format
json_object / json_schema constrains the reply the same way.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmforge.errors import ConfigError
from lmforge.infer.params import TokenConstraint
from lmforge.infer.structured import JSON_LAYOUT
from lmforge.interop.chat_template import render_chat

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
GENERIC_TOOL_PROMPT = (
    "You can call these functions (JSON schemas of their arguments):\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one or more blocks, each\n"
    f'{CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n'
    f"{CALL_CLOSE}"
)


class ChatRequestError(ConfigError):
    """Bad chat input, naming the request field it is about (`param`, e.g. 'tool_choice')."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class ChatPlan:
    """What to generate for one turn: the prompt text, the constraint factory (None = free
    text) and whether to parse tool calls out of the reply."""

    prompt: str
    constraint: Callable[[], TokenConstraint] | None
    parse_tools: bool
    tool_names: frozenset[str]


def text_of(content: Any) -> str:
    """A message's content as text: a string, None, or a list of {"type": "text"} parts."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _function(tool: dict, i: int) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatRequestError(f"tools[{i}] must be {{'type': 'function', 'function': "
                               "{'name': ..., 'parameters': {...}}}", "tools")  # fmt: skip
    return fn


def check_tool_messages(messages: Sequence[dict]) -> None:
    """A `tool` message must answer a call made by an earlier assistant message (by its
    tool_call_id, when it gives one)."""
    calls: set[str | None] = set()  # the ids of the calls made so far (None: a call without one)
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            calls.update(call.get("id") or None for call in m.get("tool_calls") or [])
        elif m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            if not calls or (call_id is not None and call_id not in calls):
                what = f"tool_call_id {call_id!r}" if call_id else "no tool_call_id"
                raise ChatRequestError(f"messages[{i}] is a tool result ({what}) that answers no "
                                       "earlier assistant tool call", f"messages.{i}")  # fmt: skip


def _arguments_dict(arguments: Any) -> Any:
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: kept as the text it is
            return json.loads(arguments)
    return arguments


def _call_block(call: dict) -> str:
    fn = call.get("function") or {}
    body = {"name": fn.get("name"), "arguments": _arguments_dict(fn.get("arguments", {}))}
    return f"{CALL_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CALL_CLOSE}"


def render_prompt(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None) -> str:
    """The prompt text of the conversation, tools included (the template's way, else the
    generic format of this module's docstring)."""
    # a template that mentions `tools` renders them itself (as transformers passes them)
    native = bool(tools) and "tools" in (getattr(tokenizer, "chat_template", None) or "")
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        m["content"] = text_of(m.get("content"))
        calls = m.get("tool_calls")
        if calls and native:  # HF templates expect the arguments as an object
            m["tool_calls"] = [
                {**c, "function": {**c["function"],
                                   "arguments": _arguments_dict(c["function"].get("arguments"))}}
                for c in calls
            ]  # fmt: skip
        elif calls:
            blocks = "\n".join(_call_block(c) for c in calls)
            m = {"role": "assistant", "content": "\n".join(t for t in (m["content"], blocks) if t)}
        elif m["role"] == "tool" and not native:
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if tools and not native:
        listing = "\n".join(json.dumps(_function(t, i), ensure_ascii=False)
                            for i, t in enumerate(tools))  # fmt: skip
        block = GENERIC_TOOL_PROMPT.replace("{tools}", listing)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    extra = {"tools": list(tools)} if native else {}
    return render_chat(tokenizer, out, add_generation_prompt=True, **extra)


def _call_schema(fn: dict) -> dict:
    parameters = fn.get("parameters") or {"type": "object", "properties": {}}
    properties = {"name": {"const": fn["name"]}, "arguments": parameters}
    return {"type": "object", "properties": properties, "required": ["name", "arguments"],
            "additionalProperties": False}  # fmt: skip


def tool_call_grammar(functions: Sequence[dict], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) of one or more `<tool_call>` blocks calling one of
    `functions` with arguments valid for its schema."""
    schemas = [_call_schema(fn) for fn in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": JSON_LAYOUT}  # llguidance's compile options, in the schema
    call = f'"{CALL_OPEN}\\n" %json {json.dumps(schema)} "\\n{CALL_CLOSE}"'
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return f"{start}\ncall: {call}\n"


def _response_format_grammar(grammars_for: Callable[[], Any], response_format: dict | None):
    if not response_format or response_format.get("type", "text") == "text":
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return grammars_for().json_schema(None)
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if schema is None:
            raise ChatRequestError("response_format.json_schema.schema is missing",
                                   "response_format")  # fmt: skip
        try:
            return grammars_for().json_schema(schema)
        except ConfigError as err:
            raise ChatRequestError(str(err), "response_format.json_schema.schema") from None
    raise ChatRequestError(f"response_format type {kind!r} is not one of text, json_object, "
                           "json_schema", "response_format")  # fmt: skip


def plan_chat(
    tokenizer,
    grammars_for: Callable[[], Any],
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    tool_choice: str | dict | None = None,
    response_format: dict | None = None,
    parallel_tool_calls: bool = True,
) -> ChatPlan:
    """Prompt and constraint for one turn. `grammars_for()` returns the infer.structured
    Grammars of this tokenizer and its stop ids (called only when a grammar is needed)."""
    tools = list(tools or [])
    functions = [_function(t, i) for i, t in enumerate(tools)]
    names = frozenset(fn["name"] for fn in functions)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        match = [fn for fn in functions if fn["name"] == name]
        if not match:
            raise ChatRequestError(f"tool_choice names function {name!r}, which is not in tools "
                                   f"({', '.join(sorted(names)) or 'none given'})",
                                   "tool_choice")  # fmt: skip
        functions, mode = match, "named"
    elif tool_choice in ("auto", "none", "required"):
        mode = tool_choice
    else:
        raise ChatRequestError(f"tool_choice must be 'none', 'auto', 'required' or a function, "
                               f"got {tool_choice!r}", "tool_choice")  # fmt: skip
    if mode in ("required", "named") and not tools:
        raise ChatRequestError(f"tool_choice {mode!r} needs tools", "tool_choice")
    check_tool_messages(messages)
    prompt = render_prompt(tokenizer, messages, tools)
    if mode in ("required", "named"):
        grammar = tool_call_grammar(functions, parallel_tool_calls and mode == "required")
        constraint = grammars_for().lark(grammar)
    else:
        constraint = _response_format_grammar(grammars_for, response_format)
    return ChatPlan(prompt, constraint, mode != "none" and bool(tools), names)


def parse_tool_calls(text: str, names: frozenset[str]) -> tuple[str | None, list[dict]]:
    """(the text outside `<tool_call>` blocks or None when there is none, the calls in OpenAI's
    shape). A block that is not JSON of a known function stays in the text."""
    calls, content, rest = [], [], text
    while CALL_OPEN in rest:
        before, _, after = rest.partition(CALL_OPEN)
        body, closed, rest = after.partition(CALL_CLOSE)
        call = _parse_call(body, names)
        if call is None:
            content.append(before + CALL_OPEN + body + (CALL_CLOSE if closed else ""))
            continue
        content.append(before)
        calls.append(call)
    content.append(rest)
    joined = "".join(content).strip() if calls else "".join(content)
    return (joined or None) if calls else joined, calls


def _parse_call(body: str, names: frozenset[str]) -> dict | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    arguments = data.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": data["name"],
                         "arguments": json.dumps(arguments, ensure_ascii=False)}}  # fmt: skip


def assistant_message(text: str, plan: ChatPlan) -> tuple[dict, bool]:
    """The reply as an OpenAI assistant message, and whether it holds tool calls."""
    content, calls = parse_tool_calls(text, plan.tool_names) if plan.parse_tools else (text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls)


class ToolCallStream:
    """Splits one streamed reply into content to send now and tool calls to send at the end:
    text that could begin a `<tool_call>` block is held back until it cannot, and everything
    from a block's start on is kept for `finish`."""

    def __init__(self, plan: ChatPlan):
        self.plan, self.held = plan, ""
        self.in_call = False

    def push(self, delta: str) -> str:
        if not self.plan.parse_tools:
            return delta
        self.held += delta
        if self.in_call:
            return ""
        at = self.held.find(CALL_OPEN)
        if at >= 0:
            self.in_call = True
            out, self.held = self.held[:at], self.held[at:]
        else:  # keep the longest tail that is a prefix of CALL_OPEN
            keep = next((k for k in range(min(len(CALL_OPEN) - 1, len(self.held)), 0, -1)
                         if CALL_OPEN.startswith(self.held[-k:])), 0)  # fmt: skip
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content not sent yet, the calls) once the reply is complete."""
        held, self.held = self.held, ""  # empty unless the plan parses tool calls
        content, calls = parse_tool_calls(held, self.plan.tool_names)
        return content or "", calls
