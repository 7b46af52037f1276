"""What every post-training loss is built from, as pure functions on tensors: per-token and
per-sequence log-probs of labels, masked statistics, and the SFT loss (next-token cross-entropy on
response tokens). Preference losses are in `preference_losses.py`, RL losses in `rl_losses.py`,
continual-learning penalties in `regularizers.py`.

Conventions (as TRL's DPOTrainer): logits [B, T, V] are already aligned with labels [B, T] — the
caller passes ``logits[:, :-1]`` and ``labels = input_ids[:, 1:]`` — except ``sft_loss``, which
takes unshifted HF-style labels and shifts itself. Masks are 1 on real (completion) tokens and 0
elsewhere. Means over tokens are masked means. Everything is computed in fp32.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from lmforge.errors import LMForgeError

# ----------------------------------------------------------------------------- log-probs, masks


def _check_aligned(logits: Tensor, labels: Tensor) -> None:
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        shapes = f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        raise LMForgeError(f"logits must be [B, T, V] and labels [B, T]; got {shapes}")


def token_logprobs(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """log p(label_t) for every position, [B, T] in fp32; 0 where the label is ``ignore_index``.

    Uses logit[label] - logsumexp(logits), one row at a time, so the full [B, T, V] log-softmax is
    never materialised and at most one row is up-cast to fp32 (this is what dominates memory).
    """
    _check_aligned(logits, labels)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels)).unsqueeze(-1)
    rows = []
    for row_logits, row_labels in zip(logits, safe):
        row = row_logits.float()
        rows.append(row.gather(-1, row_labels).squeeze(-1) - torch.logsumexp(row, dim=-1))
    return torch.stack(rows) * valid


def sequence_logprobs(
    logits: Tensor,
    labels: Tensor,
    mask: Tensor | None = None,
    ignore_index: int = -100,
    average: bool = False,
) -> Tensor:
    """Sum of log p(label_t) over positions where ``mask`` is 1 → [B] (the DPO sequence log-prob).

    ``mask`` defaults to ``labels != ignore_index``; pass the completion mask so prompt tokens
    do not count. ``average=True`` divides by the number of counted tokens (the length-normalised
    log-prob of SimPO, ORPO and CPO's ipo).
    """
    lp = token_logprobs(logits, labels, ignore_index)
    if mask is None:
        mask = labels != ignore_index
    mask = mask.to(lp.dtype)
    total = (lp * mask).sum(-1)
    return total / mask.sum(-1).clamp_min(1) if average else total


def last_index(mask: Tensor) -> Tensor:
    """Index of the last nonzero entry in each row of a [B, T] mask (left or right padding
    alike); -1 for a row without one."""
    return torch.where(mask.bool(), torch.arange(mask.shape[-1], device=mask.device), -1).amax(-1)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero (weighted by mask); 0 if none are."""
    mask = mask.to(x.dtype)
    num = (x * mask).sum() if dim is None else (x * mask).sum(dim)
    den = mask.sum() if dim is None else mask.sum(dim)
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(x.dtype).tiny), num * 0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over masked positions (Bessel-corrected like TRL when ``unbiased``)."""
    var = masked_mean((x - masked_mean(x, mask)) ** 2, mask)
    n = mask.to(x.dtype).sum()
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std with statistics from masked positions only (PPO advantage whitening).

    Unmasked positions are transformed too but do not influence the statistics. With
    ``shift_mean=False`` the mean is added back (TRL uses this for rewards).
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    return out if shift_mean else out + mean


# ----------------------------------------------------------------------------- SFT


def sft_loss(
    logits: Tensor, labels: Tensor, ignore_index: int = -100, label_smoothing: float = 0.0
) -> Tensor:
    """Next-token cross-entropy on response tokens, mean over the tokens that count.

    ``labels`` are HF-style and unshifted (a copy of input_ids with prompt and padding positions
    set to ``ignore_index``); this function shifts: logits[:, t] predicts labels[:, t+1].
    """
    _check_aligned(logits, labels)
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    if not (labels != ignore_index).any():
        return logits.sum() * 0.0  # nothing to learn from, but keep the graph for backward()
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )
