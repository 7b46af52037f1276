"""OpenAI response bodies and SSE chunks for completions and chat completions.

A format object knows one endpoint's JSON shapes (ids, `object` names, where text and logprobs
go); `collect` builds a whole response from the engine's outputs and `sse_stream` turns them into
server-sent events. Token strings in logprobs are each token decoded alone, as OpenAI reports them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from lmforge.chat_completion import ChatPlan, ToolCallStream, assistant_message
from lmforge.infer.engine import StepOutput
from lmforge.serve.guards import APIError


class EngineFailure(RuntimeError):
    """A step raised; the requests that were running get this instead of more tokens."""


def sse(data) -> str:
    return f"data: {json.dumps(data)}\n\n"


class _Format:
    object = chunk_object = prefix = ""

    def __init__(self, tokenizer, model: str, prompt_tokens: int, top_logprobs: int | None):
        self.tok, self.model, self.prompt_tokens = tokenizer, model, prompt_tokens
        self.top = top_logprobs
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex[:24]}", int(time.time())
        self.offsets: dict[int, int] = {}  # text offset per choice (completions logprobs)

    def head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict:
        total = self.prompt_tokens + completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": total}  # fmt: skip

    def piece(self, token: int) -> str:
        return self.tok.decode([token])

    def chunk(self, out: StepOutput, first: bool) -> dict:
        """One stream chunk: the sample's new output (`first`: its first chunk) as a choice."""
        return {**self.head(self.chunk_object), "choices": [self.delta(out, first)]}

    def entry(self, c: StepOutput, body: dict, finish: str | None) -> dict:
        """A choice: index, `body` (its text, message or delta), logprobs and finish reason."""
        logprobs = self.logprobs(c) if self.top is not None and c.logprobs else None
        return {"index": c.index, **body, "logprobs": logprobs, "finish_reason": finish}


class CompletionFormat(_Format):
    object = chunk_object = "text_completion"
    prefix = "cmpl"

    def logprobs(self, c: StepOutput) -> dict:
        pieces = [self.piece(lp.token) for lp in c.logprobs]
        offsets = list(itertools.accumulate(map(len, pieces), initial=self.offsets.get(c.index, 0)))
        self.offsets[c.index] = offsets.pop()  # where the choice's next chunk starts
        top = [{self.piece(t): v for t, v in lp.top} for lp in c.logprobs]
        logprobs = [lp.logprob for lp in c.logprobs]
        return dict(tokens=pieces, token_logprobs=logprobs, top_logprobs=top, text_offset=offsets)

    def choice(self, c: StepOutput) -> dict:
        return self.entry(c, {"text": c.text}, c.finish_reason)

    def delta(self, out: StepOutput, first: bool) -> dict:
        return self.choice(out)  # a completion chunk is shaped as a whole response's choice


class ChatFormat(_Format):
    """Chat completions; with a ChatPlan that parses tool calls, a reply's `<tool_call>` blocks
    become `tool_calls` (finish_reason "tool_calls"): whole in a response, and in a stream as
    one delta when the sample finishes (text that could open a block is held back until then)."""

    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, tokenizer, model: str, prompt_tokens: int, top_logprobs: int | None,
                 plan: ChatPlan | None = None):  # fmt: skip
        super().__init__(tokenizer, model, prompt_tokens, top_logprobs)
        self.plan = plan
        self.streams: dict[int, ToolCallStream] = {}

    def logprobs(self, c: StepOutput) -> dict:
        def entry(token: int, value: float) -> dict:
            piece = self.piece(token)
            return {"token": piece, "logprob": value, "bytes": list(piece.encode())}

        content = [
            {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in c.logprobs
        ]
        return {"content": content}

    def delta(self, out: StepOutput, first: bool) -> dict:
        text, calls, finish = out.text, [], out.finish_reason
        if self.plan is not None and self.plan.parse_tools:
            stream = self.streams.setdefault(out.index, ToolCallStream(self.plan))
            text = stream.push(out.text)
            if out.finished:
                rest, calls = stream.finish()
                text += rest
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            finish = "tool_calls"
        return self.entry(out, {"delta": delta}, finish)

    def choice(self, c: StepOutput) -> dict:
        finish = c.finish_reason
        if self.plan is None:
            message = {"role": "assistant", "content": c.text}
        else:
            message, called = assistant_message(c.text, self.plan)
            finish = "tool_calls" if called else finish
        return self.entry(c, {"message": message}, finish)


async def collect(outputs: AsyncIterator[list], fmt: _Format, n: int) -> dict:
    """The whole (non-streamed) response: each sample's outputs merged into one choice."""
    merged = {m.index: m for m in merge([out async for outs in outputs for out in outs])}
    choices = [merged.get(i) or StepOutput("", i, [], "", None) for i in range(n)]
    return {**fmt.head(fmt.object), "choices": [fmt.choice(c) for c in choices],
            "usage": fmt.usage(sum(len(c.token_ids) for c in choices))}  # fmt: skip


def merge(outs: list[StepOutput]) -> list[StepOutput]:
    """Consecutive outputs of one request folded into one per sample (in first-seen order):
    tokens, text and logprobs concatenated, the last finish reason kept."""
    merged: dict[int, StepOutput] = {}
    for out in outs:
        m = merged.get(out.index)
        if m is None:
            merged[out.index] = dataclasses.replace(out, token_ids=list(out.token_ids))
            continue
        m.token_ids += out.token_ids
        m.text += out.text
        if out.logprobs:
            m.logprobs = (m.logprobs or []) + out.logprobs
        m.finish_reason = out.finish_reason or m.finish_reason
    return list(merged.values())


async def sse_stream(
    outputs: AsyncIterator[list], fmt: _Format, n: int, include_usage: bool, interval: float = 0,
    pause: Callable[[float], Awaitable] = asyncio.sleep,
):  # fmt: skip
    """Server-sent events: one chunk per sample for each batch of outputs that has text (or
    logprobs, or a finish). After a write the stream waits `interval` seconds and then sends
    everything produced meanwhile as the next batch (the first token goes out at once): each
    write costs a socket send, HTTP framing and a client wake-up, which at one write per token
    per client costs more CPU than the model's whole decode step (benchmarks/load_test.py).
    `pause(interval)` does the waiting (tests pass one that produces tokens instead)."""
    started: set[int] = set()
    tokens = finished = 0
    try:
        async for outs in outputs:
            events = []
            for out in merge(outs):
                tokens += len(out.token_ids)
                finished += out.finished
                if not (out.text or out.finished or out.logprobs) and out.index in started:
                    continue
                events.append(sse(fmt.chunk(out, out.index not in started)))
                started.add(out.index)
            if events:
                yield "".join(events)
                if interval and finished < n:
                    await pause(interval)
        if include_usage:
            yield sse({**fmt.head(fmt.chunk_object), "choices": [], "usage": fmt.usage(tokens)})
    except EngineFailure as err:
        yield sse(APIError(500, str(err), type="server_error").body())
    yield "data: [DONE]\n\n"
