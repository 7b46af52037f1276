"""Speculative decoding with a draft model (Leviathan et al. 2023; Chen et al. 2023).

Decoding one token reads every weight of the target once, so a large model is bandwidth-bound
and scoring K+1 positions in one forward costs about as much as scoring one. A small draft model
proposes K tokens one by one (cheap); the target scores them all in ONE forward over its KV
cache, and a rejection rule keeps the output distributed exactly as the target's own sampling:

    draft token x (drawn from q) is accepted with probability min(1, p(x) / q(x));
    at the first rejection the token is drawn from normalize(max(0, p - q)) and the round ends;
    when all K are accepted, one bonus token is drawn from the target's next distribution.

p and q are the *processed* distributions (temperature, top-k, top-p: `sampling.sampling_probs`,
the engine's own rule), so the output follows what plain sampling with those settings gives.
Greedy (temperature 0) accepts while the draft token is the target's argmax and then takes the
target's argmax: the same tokens as the target's own greedy decoding (up to float rounding of
one multi-token forward versus single-token steps, which can only matter on exact ties).

Rolling back after a rejection is setting `cache.length` back: `KVCache.update` writes at
`length` and returns keys up to the write end, so positions past it are never read again and
are overwritten by the next forward. Caches that cannot be rewound that way (rolling windows,
linear-attention states) are refused. One prompt at a time (batch size 1): rows of a batch
accept different numbers of tokens, so their caches would need per-row lengths.

The engine runs this (`Engine(model, draft=draft_model)`, infer/engine.py): one `stream` per
sequence, whose rounds the engine records like any other tokens (stop strings, limits, text).

    engine = Engine(target_model, tokenizer, draft=draft_model, draft_tokens=4)
    engine.generate(["Once upon"], GenerationParams(64, temperature=0.0))
    engine.speculative_stats.acceptance_rate, engine.speculative_stats.target_calls
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

from lmforge.errors import ConfigError
from lmforge.infer.params import GenerationParams
from lmforge.infer.sampling import sampling_probs
from lmforge.model.cache import KVCache, LatentKVCache, new_cache

# Caches whose update writes at `length` and reads only up to it: rewinding = lowering length.
REWINDABLE = (KVCache, LatentKVCache)


@dataclass
class SpeculativeStats:
    """Counters of one generation: draft tokens proposed / accepted and forwards run
    (target_calls counts verification forwards; the prompt's prefill is not one of them)."""

    proposed: int = 0
    accepted: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    new_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (1.0 when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else 1.0

    @property
    def tokens_per_target_call(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0


def rewind(cache: KVCache, length: int) -> None:
    """Forget every position from `length` on (the next forward overwrites them) in a cache of
    one of the REWINDABLE kinds (SpeculativeDecoder checks its models' caches are)."""
    if not 0 <= length <= cache.length:
        raise ValueError(f"cannot rewind a cache of length {cache.length} to {length}")
    cache.length = length


class _Side:
    """One model's decoding state: its forward, its cache, and the committed tokens the cache
    has not seen yet (they lead its next forward)."""

    def __init__(self, forward: Callable, cache: KVCache, pending: list[int], device):
        self.forward, self.cache, self.pending, self.device = forward, cache, pending, device

    @property
    def committed(self) -> int:
        return self.cache.length + len(self.pending)

    def feed(self, tokens: list[int], last_only: bool) -> torch.Tensor:
        """Run pending + tokens through the model; logits [T or 1, V] of the positions from
        the last pending token on (or of the last position only)."""
        if len(self.pending) > 1 and not last_only:  # a prompt: prefill it without the LM head
            ids = torch.tensor([self.pending[:-1]], dtype=torch.long, device=self.device)
            self.forward(ids, cache=self.cache, last_only=True)
            self.pending = self.pending[-1:]
        ids = torch.tensor([self.pending + tokens], dtype=torch.long, device=self.device)
        self.pending = []
        return self.forward(ids, cache=self.cache, last_only=last_only)[0]

    def commit(self, base: int, accepted: list[int], last: int) -> None:
        """After a round that started with `base` committed tokens: keep the accepted drafts
        the cache already holds, drop the rest, and queue what it has not seen."""
        if self.pending:  # this side did not run this round
            self.pending += [*accepted, last]
            return
        keep = min(self.cache.length - base, len(accepted))
        rewind(self.cache, base + keep)
        self.pending = [*accepted[keep:], last]


class SpeculativeDecoder:
    """Generate from `target` with `draft` proposing `draft_tokens` tokens per target forward.

    Both models must share the vocabulary (the engine passes its inference copies of both,
    in its precision)."""

    def __init__(self, target, draft, draft_tokens: int = 4):
        t_vocab, d_vocab = target.config.vocab_size, draft.config.vocab_size
        if t_vocab != d_vocab:
            raise ConfigError(
                f"draft and target must share the vocabulary: target vocab_size={t_vocab}, "
                f"draft vocab_size={d_vocab}"
            )
        if not isinstance(draft_tokens, int) or draft_tokens < 1:
            raise ConfigError(f"draft_tokens must be an integer >= 1, got {draft_tokens}")
        self.target, self.draft, self.k = target, draft, draft_tokens
        for model in (target, draft):
            cache = new_cache(model.config, 1, 1)
            if type(cache) not in REWINDABLE:
                raise ConfigError(
                    f"speculative decoding needs a cache it can rewind; this model's attention "
                    f"uses a {type(cache).__name__}"
                )
        self.target_side: _Side | None = None  # state of the latest stream (tests inspect it)
        self.draft_side: _Side | None = None

    def _side(self, model, prompt: list[int], max_len: int) -> _Side:
        weight = model.embed.weight
        dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        cache = new_cache(model.config, 1, max_len, dtype, weight.device)
        return _Side(model, cache, list(prompt), weight.device)

    @torch.inference_mode()
    def stream(
        self,
        prompt: Sequence[int],
        params: GenerationParams,
        eos_ids: Collection[int] = (),
        budget: int | None = None,
        generator: torch.Generator | None = None,
        stats: SpeculativeStats | None = None,
    ) -> Iterator[list[int]]:
        """Yield the new tokens of each round (1 to draft_tokens + 1 of them) until an EOS id
        or `budget` new tokens (default: max_new_tokens, within max_seq_len); the finishing
        token is the last one yielded. The counters are added to `stats`.

        generator: the random stream (None: torch's global one)."""
        prompt = [int(t) for t in prompt]
        room = self.target.config.max_seq_len - len(prompt)
        budget = min(params.max_new_tokens if budget is None else budget, room)
        draft_max = min(self.draft.config.max_seq_len, len(prompt) + budget)
        draft = self._side(self.draft, prompt, draft_max)
        target = self._side(self.target, prompt, len(prompt) + budget)
        self.target_side, self.draft_side = target, draft
        stats = stats if stats is not None else SpeculativeStats()
        eos, produced = set(int(e) for e in eos_ids), 0
        while produced < budget:
            base = target.committed
            # a round yields at most k + 1 tokens; the draft can only see its context window
            k = max(0, min(self.k, budget - produced - 1, draft_max - base + 1))
            drafts, q = self._propose(draft, k, params, generator)
            p_logits = target.feed(drafts, last_only=k == 0)[-(k + 1) :]
            n, last = self._verify(p_logits, drafts, q, params, generator)
            target.commit(base, drafts[:n], last)
            draft.commit(base, drafts[:n], last)
            stats.proposed, stats.accepted = stats.proposed + k, stats.accepted + n
            stats.target_calls, stats.draft_calls = stats.target_calls + 1, stats.draft_calls + k
            new = [*drafts[:n], last]
            new = new[: next((i + 1 for i, token in enumerate(new) if token in eos), len(new))]
            produced += len(new)
            stats.new_tokens += len(new)
            yield new
            if new[-1] in eos:
                return

    def _propose(self, draft: _Side, k: int, params: GenerationParams, generator):
        """k draft tokens, drawn one by one, and the distributions they were drawn from."""
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        if k == 0:
            return tokens, None
        logits = draft.feed([], last_only=True)[-1:]
        for i in range(k):
            if params.temperature == 0:
                tokens.append(int(logits.argmax(-1)))
            else:
                q = sampling_probs(logits, params)
                tokens.append(int(torch.multinomial(q, 1, generator=generator)))
                probs.append(q[0])
            if i < k - 1:
                logits = draft.feed(tokens[-1:], last_only=True)[-1:]
        return tokens, torch.stack(probs) if probs else None

    @staticmethod
    def _verify(p_logits, drafts: list[int], q, params: GenerationParams, generator):
        """(number of drafts accepted, the token that ends the round) from the target's logits
        at the k + 1 positions after the last committed token."""
        k = len(drafts)
        x = torch.tensor(drafts, dtype=torch.long, device=p_logits.device)
        if params.temperature == 0:
            best = p_logits.argmax(-1)
            n = int((x == best[:k]).long().cumprod(0).sum()) if k else 0
            return n, int(best[n])
        p = sampling_probs(p_logits, params)
        n = 0
        if k:
            rows = torch.arange(k, device=p.device)
            u = torch.rand(k, generator=generator, device=p.device)
            accept = u * q[rows, x] < p[rows, x]  # u < p(x) / q(x); q(x) > 0 as x was drawn
            n = int(accept.long().cumprod(0).sum())
        dist = p[n]
        if n < k:  # rejected: draw from the part of p that q under-proposes
            residual = (p[n] - q[n]).clamp(min=0)
            if float(residual.sum()) > 0:  # zero only if p == q, where rejection cannot happen
                dist = residual
        return n, int(torch.multinomial(dist / dist.sum(), 1, generator=generator))
