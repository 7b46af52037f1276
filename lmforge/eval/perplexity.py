"""Perplexity and bits-per-byte of a model on a text: exp(mean NLL) over every predicted token."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmforge.errors import DataError


@dataclass
class PerplexityResult:
    nll: float  # mean negative log-likelihood per token (nats)
    perplexity: float
    bits_per_byte: float
    tokens: int

    def __str__(self) -> str:
        return (
            f"tokens {self.tokens:,}  nll {self.nll:.4f}  perplexity {self.perplexity:.3f}  "
            f"bits/byte {self.bits_per_byte:.4f}"
        )


@torch.inference_mode()
def perplexity(
    model, ids: list[int], n_bytes: int, window: int | None = None, stride: int | None = None
) -> PerplexityResult:
    """Score every token of `ids` once, with windows of `window` tokens moved by `stride`.

    Default stride = window (no overlap). With stride < window, each window after the first
    scores only its last `stride` tokens, so each has at least window - stride of context.
    """
    window = min(window or model.config.max_seq_len, model.config.max_seq_len)
    stride = min(stride or window, window)
    if len(ids) < 2:
        raise DataError("need at least 2 tokens to measure perplexity")
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
    tokens = len(ids) - 1
    mean = total_nll / tokens
    return PerplexityResult(
        nll=mean,
        perplexity=math.exp(min(mean, 700.0)),
        bits_per_byte=total_nll / math.log(2) / max(1, n_bytes),
        tokens=tokens,
    )
