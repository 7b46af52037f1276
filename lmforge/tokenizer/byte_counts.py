"""UTF-8 bytes per token and bits per byte: the loss number comparable across tokenizers.

A tokenizer's per-id byte lengths (`Tokenizer.token_byte_lengths`, special tokens 0, as nanochat
counts them) give the bytes of exactly the target tokens scored; the summed NLL over those tokens
divided by ln 2 times their bytes is bits per byte. Pretraining's validation and
`lmforge.eval.perplexity` both count with these functions.
"""

from __future__ import annotations

import math

import torch


def token_bytes_table(tokenizer, device: str | torch.device = "cpu") -> torch.Tensor:
    """The tokenizer's byte length of every id as an int64 tensor (index = id), for
    `target_bytes`; build it once per run and keep it on the device the targets live on."""
    return torch.tensor(tokenizer.token_byte_lengths(), dtype=torch.long, device=device)


def target_bytes(targets: torch.Tensor, token_bytes: torch.Tensor) -> torch.Tensor:
    """UTF-8 bytes of the scored target ids (a 0-d int64 tensor on the targets' device, so a
    loop can add it up without a host sync). Ignored positions (negative, e.g. -100) count 0."""
    table = token_bytes.to(targets.device)
    scored = targets >= 0
    return torch.where(scored, table[targets.clamp(min=0)], 0).sum()


def bits_per_byte(total_nats: float, n_bytes: int) -> float:
    """Bits per byte: summed NLL in nats over the scored tokens / (ln 2 × their UTF-8 bytes).
    NaN when the scored tokens hold no text bytes (only special tokens)."""
    n_bytes = int(n_bytes)
    if n_bytes <= 0:
        return math.nan
    return float(total_nats) / (math.log(2) * n_bytes)
