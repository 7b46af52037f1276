"""Turning a growing list of token ids into text deltas, and cutting at stop strings.

Decoding the whole output every step costs O(n^2) and can emit half a UTF-8 character (byte-level
BPE splits multi-byte characters across tokens). `IncrementalDecoder` decodes a short window of
recent tokens twice (with and without the newest ones) and emits the difference once it no longer
ends in U+FFFD, the same scheme vLLM and TGI use. `StopMatcher` holds back text that could be the
beginning of a stop string, so a stream never shows text that a later stop would have removed.
"""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDecoder:
    """Feed token ids one at a time; get the new text each one completes."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: decoding from here gives stable text
        self.read_offset = 0  # tokens before this have been emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Text of tokens still held back (an incomplete character at the very end)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


class StopMatcher:
    """Accumulates text; reports when a stop string appears and what is safe to emit."""

    def __init__(self, stop: Sequence[str] = ()):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0  # characters of `text` already emitted
        self.stopped = False

    def push(self, delta: str) -> str:
        """Add generated text; return the newly safe-to-emit part (the stop string excluded)."""
        if self.stopped:
            return ""
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        if self.stop:
            hits = [i for s in self.stop if (i := self.text.find(s, start)) != -1]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self.flush()
        safe = len(self.text) - self._partial_stop_len()
        out = self.text[self.sent : safe]  # empty unless safe > sent
        self.sent = max(self.sent, safe)
        return out

    def flush(self) -> str:
        """Everything not yet emitted (at the end of generation)."""
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return out

    def _partial_stop_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
