"""Turning logits into next tokens, for a running batch where every row has its own settings.

Rows of the engine's batch belong to different requests: one is greedy, another samples at
temperature 0.7 with top-p 0.9 and a seed, a third wants log-probabilities. Settings live in
per-row tensors so filtering is one vectorized pass. Randomness is drawn when a request arrives:
each sample gets its own row of uniforms (from the request's seed, else from torch's global
generator), and each step consumes one per row by inverse-CDF lookup. So a seeded request gets
the same tokens whatever else is in the batch, and a step costs the same few ops for 1 row or
500 (a torch.Generator per row cost one small op per row per step).

The filtering rule (top-k, then top-p on what is left, at a temperature) is `filter_top_k_top_p`,
used by the engine's sampler and by speculative decoding alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmforge.infer.params import GenerationParams, TokenConstraint, TokenLogprobs
from lmforge.infer.penalties import PenaltyState


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """Per-row top-k then top-p (nucleus) filtering: logits [B, V], top_k [B] long, top_p [B];
    dropped tokens get -inf.

    top-k keeps the k largest logits and any tied with the k-th (as transformers'
    TopKLogitsWarper). top-p keeps the smallest set of most likely tokens whose probability
    reaches p: a token is dropped when the more likely tokens before it already reach p, so the
    most likely token always survives (transformers' TopPLogitsWarper; Holtzman et al. 2020).
    """
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    kth = sorted_logits.gather(-1, (top_k.clamp(1, logits.shape[-1]) - 1)[:, None])
    drop = sorted_logits < kth
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(-1) - probs
    drop |= before >= top_p[:, None]
    drop[:, 0] = False  # even when p underflows to 0 in float32
    drop = torch.zeros_like(drop).scatter(-1, order, drop)
    return logits.masked_fill(drop, float("-inf"))


def sampling_probs(logits: torch.Tensor, params: GenerationParams) -> torch.Tensor:
    """[N, V] logits -> the distribution a row with these settings draws from (temperature
    > 0): softmax(filter(logits / temperature))."""
    scaled = (logits.float() / params.temperature).clamp(-1e30, 1e30)
    if params.top_k is not None or params.top_p is not None:
        n, vocab = scaled.shape
        top_k = torch.full((n,), min(params.top_k or vocab, vocab), device=scaled.device)
        top_p = torch.full((n,), params.top_p or 1.0, device=scaled.device)
        scaled = filter_top_k_top_p(scaled, top_k, top_p)
    return torch.softmax(scaled, dim=-1)


def draw(probs: torch.Tensor, u: torch.Tensor, block: int = 64) -> torch.Tensor:
    """One token per row of probs [n, V] by inverse CDF, from uniforms u [n] in [0, 1).

    In two levels, because a float64 cumulative sum over the whole vocabulary is the slowest
    op of a sampled step: the CDF over blocks of `block` tokens picks the block, then the CDF
    inside that one block picks the token (the same token as the one-level search)."""
    n, vocab = probs.shape
    blocks = -(-vocab // block)
    if vocab % block:
        probs = F.pad(probs, (0, blocks * block - vocab))
    parts = probs.view(n, blocks, block)
    cdf = parts.sum(-1).double().cumsum(-1)
    target = u.double() * cdf[:, -1]
    b = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp(max=blocks - 1)
    before = cdf.gather(-1, (b - 1).clamp(min=0)[:, None])[:, 0] * (b > 0)
    inside = parts[torch.arange(n, device=probs.device), b]
    j = torch.searchsorted(inside.double().cumsum(-1), (target - before)[:, None], right=True)
    # rounding between the two levels must not land on a token of probability 0 (filtered out)
    last = (torch.arange(block, device=probs.device) * (inside > 0)).amax(-1)
    picked = b * block + torch.minimum(j[:, 0], last)
    # u * total can round up to total: fall back to the most likely token (measure zero; the
    # check is one small op, the argmax over the vocabulary runs only then).
    over = (picked >= vocab) | (inside.sum(-1) == 0)
    return torch.where(over, probs[:, :vocab].argmax(-1), picked) if bool(over.any()) else picked


def request_uniforms(
    n: int, steps: int, seed: int | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[n, steps] uniforms for the n samples of one request: from a generator seeded with
    `seed`, else from torch's global generator (so torch.manual_seed reproduces a run)."""
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    return torch.rand(n, steps, generator=generator, dtype=torch.float64, device=device)


class RowSampler:
    """Per-row temperature / top-k / top-p / penalties / suppressed tokens / uniforms for up to
    `rows` running sequences of up to `steps` new tokens each."""

    def __init__(self, rows: int, vocab_size: int, steps: int, device: torch.device | str = "cpu"):
        self.vocab_size, self.device = vocab_size, device
        self.temperature = torch.zeros(rows, device=device)
        self.top_k = torch.full((rows,), vocab_size, dtype=torch.long, device=device)
        self.top_p = torch.ones(rows, device=device)
        self.uniforms = torch.zeros(rows, steps, dtype=torch.float64, device=device)
        self.drawn = torch.zeros(rows, dtype=torch.long, device=device)  # uniforms used so far
        self.greedy = [True] * rows
        self.filtered = [False] * rows
        self.penalized = [False] * rows
        self.suppress: list[torch.Tensor | None] = [None] * rows
        self.logprobs = [None] * rows  # None = off, k >= 0 = chosen token plus k alternatives
        self.constraints: list[TokenConstraint | None] = [None] * rows
        self.penalties: PenaltyState | None = None  # allocated when a request first needs it

    def start_row(
        self, row: int, params: GenerationParams, prompt: list[int], uniforms: torch.Tensor | None
    ) -> None:
        """Load a new sequence's settings into `row`; `uniforms` [steps] (None when greedy)."""
        self.temperature[row] = params.temperature
        self.top_k[row] = min(params.top_k or self.vocab_size, self.vocab_size)
        self.top_p[row] = params.top_p or 1.0
        self.greedy[row] = params.temperature == 0
        if uniforms is not None:
            steps = min(uniforms.shape[0], self.uniforms.shape[1])
            self.uniforms[row, :steps] = uniforms[:steps]
            self.drawn[row] = 0
        self.filtered[row] = params.top_k is not None or params.top_p is not None
        self.penalized[row] = params.has_penalties
        ids = params.suppress_token_ids
        self.suppress[row] = torch.as_tensor(ids, device=self.device) if ids else None
        self.logprobs[row] = params.logprobs
        self.constraints[row] = params.constraint() if params.constraint is not None else None
        if params.has_penalties and self.penalties is None:
            self.penalties = PenaltyState(len(self.greedy), self.vocab_size, self.device)
        if self.penalties is not None:
            self.penalties.start_row(row, prompt, params)

    def move_row(self, src: int, dst: int) -> None:
        per_row = (self.temperature, self.top_k, self.top_p, self.uniforms, self.drawn,
                   self.greedy, self.filtered, self.penalized, self.suppress, self.logprobs,
                   self.constraints)  # fmt: skip
        for values in per_row:  # tensors and lists alike
            values[dst] = values[src]
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
        if any(s is not None for s in self.suppress[rows]):
            logits = logits.clone()
            for i, ids in enumerate(self.suppress[rows]):
                if ids is not None:
                    logits[i, ids] = float("-inf")
            greedy = None
        if self.penalties is not None and any(self.penalized[rows]):
            # Extreme penalties can overflow; keep logits finite so softmax stays a distribution.
            logits = self.penalties.apply(logits, rows).clamp(-1e30, 1e30)
            greedy = None
        constraints = self.constraints[rows]
        constrained = any(c is not None for c in constraints)
        if constrained:  # a grammar's mask: what it forbids is never drawn (nor reported)
            logits = logits.clone()
            for i, c in enumerate(constraints):
                if c is not None:
                    allowed = c.allowed()[: logits.shape[-1]].to(logits.device, non_blocking=True)
                    logits[i].masked_fill_(~allowed, float("-inf"))
            greedy = None
        greedy_rows = self.greedy[rows]
        if greedy is None and any(greedy_rows):
            # max().indices: argmax's first-maximum rule, faster than argmax on CPU
            greedy = logits.max(dim=-1).indices
        if all(greedy_rows):
            tokens = greedy
        else:
            sampled = [i for i, g in enumerate(greedy_rows) if not g]
            pick = slice(None) if len(sampled) == n else torch.as_tensor(sampled)
            scaled = logits[pick]
            temperature = self.temperature[rows][pick]
            if bool((temperature != 1).any()):  # RL samples at 1: skip the division
                scaled = (scaled / temperature[:, None].clamp(min=1e-5)).clamp(-1e30, 1e30)
            if any(self.filtered[rows]):
                scaled = filter_top_k_top_p(scaled, self.top_k[rows][pick], self.top_p[rows][pick])
            at = torch.arange(lo, lo + n, device=logits.device)[pick]
            u = self.uniforms[at, self.drawn[at]]
            self.drawn[at] += 1
            drawn = draw(torch.softmax(scaled, dim=-1), u)
            if greedy is None:
                tokens = drawn
            else:
                tokens = greedy.clone()
                tokens[pick] = drawn
        if self.penalties is not None:
            self.penalties.observe(tokens, lo)
        token_list = tokens.tolist()
        if constrained:
            for c, token in zip(constraints, token_list):
                if c is not None:
                    c.consume(token)
        wanted = self.logprobs[rows]
        if all(k is None for k in wanted):
            return tokens, token_list, [None] * n
        return tokens, token_list, self._logprobs(logits, tokens, wanted)

    @staticmethod
    def _logprobs(logits, tokens, wanted) -> list[TokenLogprobs | None]:
        """Log-probabilities under the model's distribution (after penalties, before
        temperature and filtering, as the OpenAI API reports them)."""
        logp = torch.log_softmax(logits, dim=-1)
        chosen = logp.gather(-1, tokens[:, None])[:, 0].tolist()
        k = max(w for w in wanted if w is not None)
        top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], tokens[:, None][:, :0])
        top_v, top_i, toks = top_v.tolist(), top_i.tolist(), tokens.tolist()
        return [
            None if w is None
            else TokenLogprobs(toks[row], chosen[row], list(zip(top_i[row][:w], top_v[row][:w])))
            for row, w in enumerate(wanted)
        ]  # fmt: skip
