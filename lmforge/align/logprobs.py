"""What every post-training loss is built from: per-token and per-sequence log-probs of labels,
masked statistics, and the SFT loss (next-token cross-entropy on response tokens). Preference
losses are in `preference_losses.py`, RL losses in `rl_losses.py`, continual-learning penalties
in `regularizers.py`.

The trainers never build the [B, T, V] logits tensor. `lm_token_stats` runs the model to its last
hidden states ([B, T, d], small) and sends them through the final norm and LM head a chunk of
tokens at a time (`map_token_chunks`), keeping only what the losses need per token (the label's
log-prob, the entropy, the vocabulary-mean log-prob); each chunk is recomputed in backward
(activation checkpointing), so at most one [chunk, V] block of logits exists at any moment, in
forward or backward. A vocabulary of 49,152 (SmolLM2) at sequence 1,024 and batch 8 would be
1.6 GB of fp32 logits, plus as much again for their gradient; chunked, it is 64 MB. The functions
on logits below compute the same values from a logits tensor the caller already has (tests,
inference-time scoring).

Conventions (as TRL's DPOTrainer): logits [B, T, V] are already aligned with labels [B, T] — the
caller passes ``logits[:, :-1]`` and ``labels = input_ids[:, 1:]`` — except ``sft_loss``, which
takes unshifted HF-style labels and shifts itself. Masks are 1 on real (completion) tokens and 0
elsewhere. Means over tokens are masked means. Everything is computed in fp32.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lmforge.errors import LMForgeError

# fp32 logits per chunk (2**24 = 64 MB): tokens per chunk = this // vocabulary size
CHUNK_ELEMENTS = 1 << 24

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


# ----------------------------------------------------------------------------- chunked LM head


def chunk_tokens(vocab_size: int, elements: int | None = None) -> int:
    """Tokens per chunk so that one chunk's logits hold about `elements` (default
    `CHUNK_ELEMENTS`) numbers."""
    return max(1, (elements or CHUNK_ELEMENTS) // max(1, vocab_size))


def map_token_chunks(
    fn: Callable[..., tuple[Tensor, ...]], tensors: Sequence[Tensor], chunk: int
) -> tuple[Tensor, ...]:
    """`fn` applied to consecutive row-chunks of `tensors` (all [N, ...], split along dim 0),
    its outputs ([n, ...] each) concatenated back to [N, ...].

    With gradients on, each chunk runs under non-reentrant activation checkpointing: what `fn`
    builds inside (the logits, their softmax) is freed as soon as the chunk's outputs exist and
    rebuilt, one chunk at a time, in backward. Gradients equal those of one unchunked call."""
    n = tensors[0].shape[0]
    parts = []
    for i in range(0, n, chunk):
        rows = [t[i : i + chunk] for t in tensors]
        if torch.is_grad_enabled():
            parts.append(checkpoint(fn, *rows, use_reentrant=False))
        else:
            parts.append(fn(*rows))
    if not parts:  # no rows: run fn on the empty slice for outputs of the right shape
        return fn(*tensors)
    return tuple(torch.cat(out) for out in zip(*parts))


class TokenStats(NamedTuple):
    """Per-token quantities of the next-token distribution, each [B, T] in fp32."""

    logp: Tensor  # log p(label); 0 where the label is ignore_index
    entropy: Tensor | None  # H(p) (PPO's entropy bonus); None unless asked for
    mean_logp: Tensor | None  # mean over the vocabulary of log p (label smoothing's term)


def head_token_stats(
    head: Callable[[Tensor], Tensor],
    hidden: Tensor,
    labels: Tensor,
    ignore_index: int = -100,
    entropy: bool = False,
    mean_logp: bool = False,
    chunk: int | None = None,
) -> TokenStats:
    """`TokenStats` of `head(hidden)` (logits) for `labels` [B, T], never holding more than
    `chunk` tokens' logits (default: `chunk_tokens` of the vocabulary, found from one row).

    `hidden` [B, T, d] is whatever `head` takes (a final-normed hidden state for an LM head);
    the per-token values equal those of `token_logprobs` / `entropy_from_logits` on the full
    logits, and so do their gradients (tests/align/test_chunked_head.py)."""
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
        shapes = f"{tuple(hidden.shape)} and {tuple(labels.shape)}"
        raise LMForgeError(f"hidden must be [B, T, d] and labels [B, T]; got {shapes}")
    b, t, d = hidden.shape
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels)).reshape(-1)

    def stats(h: Tensor, y: Tensor) -> tuple[Tensor, ...]:
        logits = head(h).float()
        lse = torch.logsumexp(logits, dim=-1)
        out = [logits.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse]
        if entropy:
            out.append(lse - (torch.softmax(logits, dim=-1) * logits).sum(-1))
        if mean_logp:
            out.append(logits.mean(-1) - lse)
        return tuple(out)

    if chunk is None:
        with torch.no_grad():
            vocab = head(hidden.reshape(-1, d)[:1]).shape[-1] if b * t else 1
        chunk = chunk_tokens(vocab)
    outs = list(map_token_chunks(stats, [hidden.reshape(-1, d), safe], chunk))
    logp = outs.pop(0).view(b, t) * valid
    ent = outs.pop(0).view(b, t) if entropy else None
    mean = outs.pop(0).view(b, t) if mean_logp else None
    return TokenStats(logp, ent, mean)


def lm_head_fn(model: nn.Module, temperature: float = 1.0) -> Callable[[Tensor], Tensor]:
    """Final-normed hidden states -> logits, as the model's forward computes them (with its
    logit scaling, `output_scale`), divided by a sampling temperature."""
    if (head := getattr(model, "output_logits", None)) is None:
        scale = getattr(model, "output_scale", 1.0)
        head = lambda h: model.lm_head(h * scale)  # noqa: E731
    if temperature in (0, 1):
        return head
    return lambda h: head(h) / temperature


def lm_token_stats(
    model: nn.Module,
    input_ids: Tensor,
    labels: Tensor,
    attention_mask: Tensor | None = None,
    start: int = 1,
    temperature: float = 1.0,
    entropy: bool = False,
    mean_logp: bool = False,
    ignore_index: int = -100,
) -> TokenStats:
    """`TokenStats` [B, T - start] of the tokens ``labels[:, start:]`` (HF-style, unshifted:
    ``labels[:, t]`` is predicted at position t-1; ``ignore_index`` marks tokens that do not
    count) under `model` (anything with `hidden_states`, `norm` and `lm_head`, as lmforge's
    Transformer), with the LM head applied a chunk of tokens at a time."""
    h = model.hidden_states(input_ids, attention_mask)[:, start - 1 : -1]
    head = lm_head_fn(model, temperature)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return head_token_stats(
        lambda x: head(model.norm(x)), h, labels[:, start:], ignore_index, entropy, mean_logp,
        chunk_tokens(vocab) if vocab else None,
    )  # fmt: skip


def lm_sequence_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    labels: Tensor,
    attention_mask: Tensor | None = None,
    average: bool = False,
    ignore_index: int = -100,
) -> Tensor:
    """`sequence_logprobs` of ``labels`` (HF-style, unshifted) under `model` -> [B], through the
    chunked LM head."""
    stats = lm_token_stats(model, input_ids, labels, attention_mask, ignore_index=ignore_index)
    mask = (labels[:, 1:] != ignore_index).to(stats.logp.dtype)
    total = (stats.logp * mask).sum(-1)
    return total / mask.sum(-1).clamp_min(1) if average else total


def nll_from_stats(stats: TokenStats, mask: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """Mean next-token cross-entropy over the tokens where `mask` [B, T] is true, from
    `TokenStats` (``mean_logp`` needed when label_smoothing > 0); what F.cross_entropy gives,
    including its label smoothing (1-ε)·NLL + ε·(-mean_v log p_v)."""
    per_token = -stats.logp
    if label_smoothing > 0:
        per_token = (1 - label_smoothing) * per_token - label_smoothing * stats.mean_logp
    mask = mask.to(per_token.dtype)
    if not mask.any():
        return per_token.sum() * 0.0  # nothing to learn from, but keep the graph for backward()
    return (per_token * mask).sum() / mask.sum()


def lm_sft_loss(
    model: nn.Module,
    input_ids: Tensor,
    labels: Tensor,
    attention_mask: Tensor | None = None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> Tensor:
    """`sft_loss(model(input_ids), labels)` through the chunked LM head (labels HF-style and
    unshifted)."""
    stats = lm_token_stats(model, input_ids, labels, attention_mask, ignore_index=ignore_index,
                           mean_logp=label_smoothing > 0)  # fmt: skip
    return nll_from_stats(stats, labels[:, 1:] != ignore_index, label_smoothing)
