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


async def _paced(outputs, delay: float):
    """Like AsyncEngine.generate: one output per `delay`, handed over in what piled up."""
    pending: list = []

    async def produce():
        for out in outputs:
            await asyncio.sleep(delay)
            pending.append(out)

    task = asyncio.ensure_future(produce())
    while not (task.done() and not pending):
        await asyncio.sleep(0.001)
        if pending:
            batch, pending[:] = list(pending), []
            yield batch


def _run(interval: float) -> list[dict]:
    async def main():
        fmt = CompletionFormat(_Tok(), "m", 2, None)
        stream = sse_stream(_paced(_outputs(20), 0.005), fmt, 1, True, interval)
        return [chunk async for chunk in stream]

    events = "".join(asyncio.run(main())).split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    return [json.loads(e[len("data: ") :]) for e in events[:-2]]


def test_interval_coalesces_chunks_without_changing_the_stream():
    for interval in (0.0, 0.04):
        chunks = _run(interval)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == "abcdefghijklmnopqrst"
        assert chunks[-1]["usage"]["completion_tokens"] == 20
        assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
        if interval == 0:
            assert len(chunks) > 15
        else:
            assert len(chunks) < 10  # ~100 ms of tokens in chunks 40 ms apart
