"""Sampling for a running batch where every row has its own settings.

Rows of the engine's batch belong to different requests: one is greedy, another samples at
temperature 0.7 with top-p 0.9 and a seed, a third wants log-probabilities. Settings live in
per-row tensors so filtering is one vectorized pass; only the final draw loops over rows, because
each request owns its `torch.Generator` (a seeded request gets the same tokens whatever else is
in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmforge.infer.penalties import PenaltyState


@dataclass
class TokenLogprobs:
    """Log-probability of the chosen token and of the most likely alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """Per-row top-k then top-p (nucleus) filtering: logits [B, V], top_k [B] long, top_p [B].

    Same rule as sampling.top_p_filter: a token is dropped when the more likely tokens before it
    already reach p, so the most likely token always survives.
    """
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    drop = ranks[None, :] >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(-1) - probs
    drop |= before >= top_p[:, None]
    drop[:, 0] = False  # even when p underflows to 0 in float32
    drop = torch.zeros_like(drop).scatter(-1, order, drop)
    return logits.masked_fill(drop, float("-inf"))


def _draw(probs: torch.Tensor, generators: list) -> torch.Tensor:
    """One token per row of probs [n, V] by inverse CDF: a uniform from each row's own
    generator (so a seeded row is independent of the batch), then one vectorized search. A
    torch.multinomial per row costs ~25 us each; this is one small op per row plus two."""
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=probs.device)
                   for g in generators])  # fmt: skip
    cdf = probs.double().cumsum(-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # u * total can round up to total: fall back to the most likely token (measure zero).
    return torch.where(picked < probs.shape[-1], picked, probs.argmax(-1))


class BatchSampler:
    """Per-row temperature / top-k / top-p / penalties / generator for up to `rows` sequences."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device | str = "cpu"):
        self.vocab_size, self.device = vocab_size, device
        self.temperature = torch.zeros(rows, device=device)
        self.top_k = torch.full((rows,), vocab_size, dtype=torch.long, device=device)
        self.top_p = torch.ones(rows, device=device)
        self.generators: list[torch.Generator | None] = [None] * rows
        self.greedy = [True] * rows
        self.filtered = [False] * rows
        self.penalized = [False] * rows
        self.logprobs = [None] * rows  # None = off, k >= 0 = chosen token plus k alternatives
        self.penalties: PenaltyState | None = None  # allocated when a request first needs it

    def start_row(self, row: int, params, prompt: list[int], generator) -> None:
        """Load a new sequence's settings (params: engine.GenerationParams) into `row`."""
        self.temperature[row] = params.temperature
        self.top_k[row] = min(params.top_k or self.vocab_size, self.vocab_size)
        self.top_p[row] = params.top_p or 1.0
        self.generators[row] = generator
        self.greedy[row] = params.temperature == 0
        self.filtered[row] = params.top_k is not None or params.top_p is not None
        self.penalized[row] = params.has_penalties
        self.logprobs[row] = params.logprobs
        if params.has_penalties and self.penalties is None:
            rows = self.temperature.shape[0]
            self.penalties = PenaltyState(rows, self.vocab_size, self.device)
        if self.penalties is not None:
            p = params
            self.penalties.start_row(
                row, prompt, p.repetition_penalty, p.presence_penalty, p.frequency_penalty
            )

    def move_row(self, src: int, dst: int) -> None:
        for t in (self.temperature, self.top_k, self.top_p):
            t[dst] = t[src]
        for lst in (self.generators, self.greedy, self.filtered, self.penalized, self.logprobs):
            lst[dst] = lst[src]
        if self.penalties is not None:
            self.penalties.move_row(src, dst)

    def sample(self, logits: torch.Tensor, lo: int = 0, greedy: torch.Tensor | None = None):
        """Next tokens for rows lo..lo+n-1 from their last-position logits [n, V] (`greedy`:
        their argmax, when the caller computed it; not used for penalised rows).

        Returns (tokens tensor [n], the same as a list, per-row TokenLogprobs or None); the
        `.tolist()` is the step's one host sync.
        """
        n = logits.shape[0]
        rows = slice(lo, lo + n)
        logits = logits.float()
        if self.penalties is not None and any(self.penalized[rows]):
            # Extreme penalties can overflow; keep logits finite so softmax stays a distribution.
            logits = self.penalties.apply(logits, rows).clamp(-1e30, 1e30)
            greedy = None
        # max().indices: argmax's first-maximum rule, ~2x faster on CPU
        tokens = logits.max(dim=-1).indices if greedy is None else greedy
        sampled = [i for i in range(n) if not self.greedy[lo + i]]
        if sampled:
            scaled = (logits / self.temperature[rows, None].clamp(min=1e-5)).clamp(-1e30, 1e30)
            if any(self.filtered[rows]):
                scaled = filter_top_k_top_p(scaled, self.top_k[rows], self.top_p[rows])
            probs = torch.softmax(scaled, dim=-1)
            tokens[sampled] = _draw(probs[sampled], [self.generators[lo + i] for i in sampled])
        if self.penalties is not None:
            self.penalties.observe(tokens, lo)
        wanted = self.logprobs[rows]
        if all(k is None for k in wanted):
            return tokens, tokens.tolist(), [None] * n
        return tokens, tokens.tolist(), self._logprobs(logits, tokens, wanted)

    @staticmethod
    def _logprobs(logits, tokens, wanted) -> list[TokenLogprobs | None]:
        """Log-probabilities under the model's distribution (after penalties, before
        temperature and filtering, as the OpenAI API reports them)."""
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(-1, tokens[:, None])[:, 0].tolist()
        k = max(w for w in wanted if w is not None)
        top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], tokens[:, None][:, :0])
        top_v, top_i, toks = top_v.tolist(), top_i.tolist(), tokens.tolist()
        out: list[TokenLogprobs | None] = []
        for row, w in enumerate(wanted):
            if w is None:
                out.append(None)
                continue
            top = list(zip(top_i[row][:w], top_v[row][:w]))
            out.append(TokenLogprobs(toks[row], chosen[row], top))
        return out
