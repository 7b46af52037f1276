"""Perplexity and bits per byte of a model on a text: exp(mean NLL) over every predicted token.

Bits per byte is the one loss number comparable across tokenizers: the summed NLL of the scored
tokens divided by ln 2 times the UTF-8 bytes those same tokens stand for. The byte count comes
from the tokenizer's per-token byte lengths (`Tokenizer.token_byte_lengths`, special tokens 0,
as nanochat counts them), so it covers exactly the tokens scored. Pretraining's validation, this
module's `perplexity` and the speedrun's yardstick all count bytes with
`lmforge.tokenizer.byte_counts`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmforge.errors import DataError
from lmforge.tokenizer.byte_counts import bits_per_byte, target_bytes


@dataclass
class PerplexityResult:
    nll: float  # mean negative log-likelihood per token (nats)
    perplexity: float
    bits_per_byte: float
    tokens: int
    bytes: int  # UTF-8 bytes of the scored tokens

    def __str__(self) -> str:
        return (
            f"tokens {self.tokens:,}  nll {self.nll:.4f}  perplexity {self.perplexity:.3f}  "
            f"bits/byte {self.bits_per_byte:.4f}"
        )


@torch.inference_mode()
def windowed_nll(
    model, ids: Sequence[int], window: int | None = None, stride: int | None = None
) -> float:
    """The summed negative log-likelihood (nats) of every token of `ids` after the first, each
    scored once, with windows of `window` tokens (default and at most the model's context) moved
    by `stride`. Default stride = window (no overlap). With stride < window, each window after
    the first scores only its last `stride` tokens, so each has at least window - stride of
    context."""
    window = min(window or model.config.max_seq_len, model.config.max_seq_len)
    stride = min(stride or window, window)
    device = next(model.parameters()).device
    data = torch.as_tensor(ids, dtype=torch.long)
    total_nll, pos = 0.0, 0
    model.eval()
    while pos < len(ids) - 1:
        end = min(pos + (window if pos == 0 else stride), len(ids) - 1)
        begin = max(0, end - window)
        x, y = data[begin:end][None].to(device), data[begin + 1 : end + 1][None].to(device)
        logits = model(x)[0, pos - begin :]
        total_nll += F.cross_entropy(logits.float(), y[0, pos - begin :], reduction="sum").item()
        pos = end
    return total_nll


def perplexity(
    model,
    ids: Sequence[int],
    token_bytes: torch.Tensor | Sequence[int],
    window: int | None = None,
    stride: int | None = None,
) -> PerplexityResult:
    """Every token of `ids` after the first scored once (`windowed_nll`: windows of `window`
    tokens moved by `stride`); bits per byte divides by the bytes of exactly those tokens
    (`token_bytes`: the tokenizer's per-id byte lengths, `Tokenizer.token_byte_lengths()` or
    `byte_counts.token_bytes_table`)."""
    if len(ids) < 2:
        raise DataError("need at least 2 tokens to measure perplexity")
    total_nll, tokens = windowed_nll(model, ids, window, stride), len(ids) - 1
    targets = torch.as_tensor(ids[1:], dtype=torch.long)
    n_bytes = int(target_bytes(targets, torch.as_tensor(token_bytes, dtype=torch.long)))
    mean, bpb = total_nll / tokens, bits_per_byte(total_nll, n_bytes)
    return PerplexityResult(mean, math.exp(min(mean, 700.0)), bpb, tokens, n_bytes)
