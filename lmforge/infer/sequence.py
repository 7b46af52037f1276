"""One running sample of a request inside the engine: its prompt, sampling parameters and the
tokens made so far, and the rule that finishes it (`push`: a stop token or string,
max_new_tokens, the end of the context)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from lmforge.infer.detokenize import IncrementalDecoder, StopMatcher
from lmforge.infer.params import GenerationParams, StepOutput, TokenLogprobs


@dataclass
class RunningSequence:
    """A sample the engine runs (index `index` of request `request_id`)."""

    request_id: str
    index: int
    prompt: list[int]
    params: GenerationParams
    stop_ids: frozenset[int]
    uniforms: torch.Tensor | None  # [steps] this sample's randomness (None: greedy)
    decoder: IncrementalDecoder | None
    matcher: StopMatcher
    embeds: torch.Tensor | None = None  # [len(prompt), d_model] prompt embeddings
    generator: torch.Generator | None = None  # speculative decoding's random stream
    output: list[int] = field(default_factory=list)
    rounds: Iterator[list[int]] | None = None  # speculative decoding: tokens per round

    @property
    def prefix_key(self) -> tuple:
        """Sequences with equal keys share one prefill."""
        return (tuple(self.prompt), id(self.embeds) if self.embeds is not None else None)

    def push(self, tokens: list[int], logprobs: list[TokenLogprobs] | None, max_len: int,
             full: bool = False) -> StepOutput:  # fmt: skip
        """Record new tokens up to the first that finishes the sequence (stop token or string,
        max_new_tokens, a context of `max_len`; `full`: no room for another token)."""
        taken, text, reason = [], "", None
        limit = min(self.params.max_new_tokens, max_len - len(self.prompt))  # new tokens
        for token in tokens:
            self.output.append(token)
            taken.append(token)
            if token in self.stop_ids:
                reason = "stop"
            elif len(self.output) >= limit or full:
                reason = "length"
            if self.decoder is not None:
                delta = self.decoder.push(token)
                if reason is not None:
                    delta += self.decoder.flush()
                text += self.matcher.push(delta)
                if self.matcher.stopped:
                    reason = "stop"
                elif reason is not None:
                    text += self.matcher.flush()
            if reason is not None:
                break
        return StepOutput(self.request_id, self.index, taken, text, logprobs, reason)
