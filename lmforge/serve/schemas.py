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
        found = _surrogate_at(item, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

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


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
