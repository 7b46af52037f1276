"""Request bodies of the OpenAI-compatible API (pydantic), strict so bad input is a clean 400.

`extra="forbid"` turns an unknown field into an error naming it, and strict mode refuses "0.7" for
a number or 1 for a boolean instead of guessing. Ranges follow the OpenAI API reference; top_k and
repetition_penalty are the usual vLLM extensions. The server applies its own limits (max_tokens,
context length) after parsing, because they depend on the loaded model. Text holding a lone
UTF-16 surrogate (JSON `"\\ud800"`, which Python's json accepts) is refused here, wherever it is:
it cannot be encoded, tokenized or echoed back.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

Probability = Annotated[float, Field(gt=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Stop = str | Annotated[list[str], Field(max_length=4)] | None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _surrogate_at(value: Any, path: str = "") -> str | None:
    """The path (e.g. 'messages.0.content') of the first text holding a lone surrogate, keys
    included (a bad key is reported at its object), or None."""
    if isinstance(value, str):
        return (path or "body") if _SURROGATE.search(value) else None
    if not isinstance(value, dict | list):
        return None
    for key, item in value.items() if isinstance(value, dict) else enumerate(value):
        if isinstance(key, str) and _SURROGATE.search(key):
            return path or "body"
        if found := _surrogate_at(item, f"{path}.{key}" if path else str(key)):
            return found
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _ValidText(_Strict):
    """A request body whose texts are all valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = _surrogate_at(data)
        if where is not None:
            raise PydanticCustomError(
                "invalid_unicode", "text must be valid Unicode; it holds a lone UTF-16 "
                "surrogate (an unpaired \\ud800-\\udfff escape)", {"param": where},
            )  # fmt: skip
        return data


class _Sampling(_ValidText):
    """Fields shared by both generation endpoints."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Probability = 1.0
    top_k: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] = 1.0
    user: str | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions: `prompt` is one text (or a list holding exactly one)."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: Literal[False] = False


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """A message; an assistant message may hold tool_calls instead of content, a `tool`
    message answers one of them (tool_call_id)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("missing", "content is required (only an assistant message "
                                      "with tool_calls may omit it)")  # fmt: skip
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("invalid", "only assistant messages carry tool_calls")
        if self.role == "developer":  # OpenAI's newer name for the system role
            self.role = "system"
        return self


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    """response_format.json_schema; the schema is always enforced (`strict` or not)."""

    name: str
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None


class EmbeddingRequest(_ValidText):
    """POST /v1/embeddings: a text, texts, or token ids (a list of ints or of such lists)."""

    input: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=2048)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[list[int]], Field(min_length=1, max_length=2048)]
    )
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = None
    user: str | None = None


class ConversationBody(_ValidText):
    """A conversation of the chat page (serve/store.py): a title and the page's own JSON."""

    title: Annotated[str, Field(max_length=300)]
    data: dict[str, Any]


class SearchBody(_ValidText):
    """POST /api/rag/search: the question, and how many passages."""

    query: Annotated[str, Field(min_length=1, max_length=4000)]
    k: Annotated[int, Field(ge=1, le=20)] = 4
