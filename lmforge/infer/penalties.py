"""Repetition, presence and frequency penalties on a batch of next-token logits.

Two conventions are in use and both are supported, each with its own per-row strength:
- CTRL / Hugging Face `repetition_penalty` r: for every token the sequence has seen (prompt
  included), a positive logit is divided by r and a negative one multiplied by r.
- OpenAI `presence_penalty` a and `frequency_penalty` b: over the tokens generated so far,
  logit -= a * [count > 0] + b * count.
The engine keeps `seen` and `counts` as [rows, vocab] tensors updated in place every step, so a
penalty costs a few vectorized ops per step however long the sequences grow.
"""

from __future__ import annotations

import torch

from lmforge.infer.params import GenerationParams


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """logits [B, V]; seen [B, V] bool; penalty [B] (1 = off)."""
    p = penalty[:, None].to(logits.dtype)
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency_penalty(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """logits [B, V]; counts [B, V] of generated tokens; presence, frequency [B] (0 = off)."""
    counts = counts.to(logits.dtype)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


class PenaltyState:
    """What the penalties need to remember for each batch row: tokens seen and generated."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device | str = "cpu"):
        self.seen = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)
        self.repetition = torch.ones(rows, device=device)
        self.presence = torch.zeros(rows, device=device)
        self.frequency = torch.zeros(rows, device=device)

    def start_row(self, row: int, prompt: list[int], params: GenerationParams) -> None:
        """Reset `row` for a new sequence whose prompt is `prompt`, with `params`' penalties."""
        self.seen[row] = False
        self.seen[row, torch.as_tensor(prompt, dtype=torch.long, device=self.seen.device)] = True
        self.counts[row] = 0
        self.repetition[row] = params.repetition_penalty
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty

    def move_row(self, src: int, dst: int) -> None:
        for t in (self.seen, self.counts, self.repetition, self.presence, self.frequency):
            t[dst] = t[src]

    def observe(self, tokens: torch.Tensor, lo: int = 0) -> None:
        """Record the tokens just sampled for rows lo..lo+len(tokens)-1."""
        rows = torch.arange(lo, lo + tokens.shape[0], device=tokens.device)
        self.seen[rows, tokens] = True
        self.counts[rows, tokens] += 1

    def apply(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        """Penalized logits for batch rows `rows` (logits [rows, V])."""
        logits = apply_repetition_penalty(logits, self.seen[rows], self.repetition[rows])
        return apply_presence_frequency_penalty(
            logits, self.counts[rows], self.presence[rows], self.frequency[rows]
        )
