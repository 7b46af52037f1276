"""SSE chunking: outputs that pile up are merged into one chunk per sample, and a stream with an
interval writes fewer, larger chunks that carry the same text, tokens and finish."""

import asyncio
import json

from lmforge.infer.engine import StepOutput
from lmforge.serve.responses import CompletionFormat, merge, sse_stream


class _Tok:
    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)


def _outputs(n_tokens: int, samples: int = 1):
    return [
        StepOutput("r", i, [t], chr(97 + t), None, "length" if t == n_tokens - 1 else None)
        for t in range(n_tokens)
        for i in range(samples)
    ]


def test_merge_folds_each_sample_in_order():
    merged = merge(_outputs(3, samples=2))
    assert [(m.index, m.token_ids, m.text, m.finish_reason) for m in merged] == [
        (0, [0, 1, 2], "abc", "length"),
        (1, [0, 1, 2], "abc", "length"),
    ]


class _Producer:
    """Stands in for AsyncEngine.generate: each ask gets everything that piled up since the
    last one, or waits for the next token. Tokens pile up only when `produce` is called (by the
    stream's pause hook below), so what one chunk carries is set by the test, not by timing."""

    def __init__(self, outputs: list):
        self.todo, self.pending = list(outputs), []

    def produce(self, k: int) -> None:
        self.pending += self.todo[:k]
        del self.todo[:k]

    async def outputs(self):
        while self.todo or self.pending:
            if not self.pending:  # the consumer waits for the next token
                self.produce(1)
            batch, self.pending = self.pending, []
            yield batch


def _run(interval: float, per_pause: int = 4) -> tuple[list[dict], list[float]]:
    producer, pauses = _Producer(_outputs(20)), []

    async def pause(seconds: float) -> None:  # the engine makes `per_pause` tokens meanwhile
        pauses.append(seconds)
        producer.produce(per_pause)

    async def main():
        fmt = CompletionFormat(_Tok(), "m", 2, None)
        stream = sse_stream(producer.outputs(), fmt, 1, True, interval, pause)
        return [chunk async for chunk in stream]

    events = "".join(asyncio.run(main())).split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e[len("data: ") :]) for e in events[:-2]], pauses


def test_interval_coalesces_chunks_without_changing_the_stream():
    for interval in (0.0, 0.04):
        chunks, pauses = _run(interval)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == "abcdefghijklmnopqrst"
        assert chunks[-1]["usage"]["completion_tokens"] == 20
        assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
        sizes = [len(c["choices"][0]["text"]) for c in chunks[:-1]]
        if interval == 0:  # no pauses: every token is its own chunk
            assert pauses == [] and sizes == [1] * 20
        else:  # the first token at once, then what piled up during each pause
            assert sizes == [1, 4, 4, 4, 4, 3]
            assert pauses == [0.04] * 5  # none after the finish
