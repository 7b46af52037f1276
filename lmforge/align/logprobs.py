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
from lmforge.model.linear import linear, plain_linear

IGNORE = -100  # the label of a position that is not scored (HF's and F.cross_entropy's default)
# fp32 logits per chunk (2**24 = 64 MB): tokens per chunk = this // vocabulary size
CHUNK_ELEMENTS = 1 << 24

# ----------------------------------------------------------------------------- log-probs, masks


def _check_aligned(x: Tensor, labels: Tensor, what: str = "logits must be [B, T, V]") -> None:
    if x.dim() != 3 or labels.shape != x.shape[:2]:
        shapes = f"{tuple(x.shape)} and {tuple(labels.shape)}"
        raise LMForgeError(f"{what} and labels [B, T]; got {shapes}")


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """log p(label_t) for every position, [B, T] in fp32; 0 where the label is IGNORE.
    (The trainers never build the logits: they go through `head_token_stats`.)"""
    _check_aligned(logits, labels)
    valid = labels != IGNORE
    safe = torch.where(valid, labels, torch.zeros_like(labels)).unsqueeze(-1)
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, safe).squeeze(-1) * valid


def sequence_logprobs(
    logits: Tensor, labels: Tensor, mask: Tensor | None = None, average: bool = False
) -> Tensor:
    """Sum of log p(label_t) over positions where ``mask`` is 1 → [B] (the DPO sequence log-prob).

    ``mask`` defaults to ``labels != IGNORE``; pass the completion mask so prompt tokens
    do not count. ``average=True`` divides by the number of counted tokens (the length-normalised
    log-prob of SimPO, ORPO and CPO's ipo).
    """
    lp = token_logprobs(logits, labels)
    mask = labels != IGNORE if mask is None else mask
    return masked_mean(lp, mask, -1) if average else (lp * mask).sum(-1)


def last_index(mask: Tensor) -> Tensor:
    """Index of the last nonzero entry in each row of a [B, T] mask (left or right padding
    alike); -1 for a row without one."""
    return torch.where(mask.bool(), torch.arange(mask.shape[-1], device=mask.device), -1).amax(-1)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero (weighted by mask); 0 if none are."""
    mask = mask.to(x.dtype)
    num, den = (x * mask).sum(dim), mask.sum(dim)
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(x.dtype).tiny), num * 0)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std with statistics from masked positions only (PPO advantage whitening); the
    variance is Bessel-corrected like TRL's.

    Unmasked positions are transformed too but do not influence the statistics. With
    ``shift_mean=False`` the mean is added back (TRL uses this for rewards).
    """
    mean = masked_mean(x, mask)
    var, n = masked_mean((x - mean) ** 2, mask), mask.to(x.dtype).sum()
    if n > 1:
        var = var * n / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    return out if shift_mean else out + mean


# ----------------------------------------------------------------------------- SFT


def sft_loss(logits: Tensor, labels: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """Next-token cross-entropy on response tokens, mean over the tokens that count.

    ``labels`` are HF-style and unshifted (a copy of input_ids with prompt and padding positions
    set to IGNORE); this function shifts: logits[:, t] predicts labels[:, t+1].
    """
    _check_aligned(logits, labels)
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    if not (labels != IGNORE).any():
        return logits.sum() * 0.0  # nothing to learn from, but keep the graph for backward()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), label_smoothing=label_smoothing)


# ----------------------------------------------------------------------------- chunked LM head


def chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk so that one chunk's logits hold about `CHUNK_ELEMENTS` numbers."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab_size))


def map_token_chunks(
    fn: Callable[..., tuple[Tensor, ...]], tensors: Sequence[Tensor], chunk: int
) -> tuple[Tensor, ...]:
    """`fn` applied to consecutive row-chunks of `tensors` (all [N, ...], split along dim 0),
    its outputs ([n, ...] each) concatenated back to [N, ...].

    With gradients on, each chunk runs under non-reentrant activation checkpointing: what `fn`
    builds inside (the logits, their softmax) is freed as soon as the chunk's outputs exist and
    rebuilt, one chunk at a time, in backward. Gradients equal those of one unchunked call."""
    parts, grad = [], torch.is_grad_enabled()
    for i in range(0, tensors[0].shape[0], chunk):
        rows = [t[i : i + chunk] for t in tensors]
        parts.append(checkpoint(fn, *rows, use_reentrant=False) if grad else fn(*rows))
    if not parts:  # no rows: run fn on the empty slice for outputs of the right shape
        return fn(*tensors)
    return tuple(torch.cat(out) for out in zip(*parts))


class TokenStats(NamedTuple):
    """Per-token quantities of the next-token distribution, each [B, T] in fp32."""

    logp: Tensor  # log p(label); 0 where the label is IGNORE
    entropy: Tensor | None  # H(p) (PPO's entropy bonus); None unless asked for
    mean_logp: Tensor | None  # mean over the vocabulary of log p (label smoothing's term)


class HeadLogprobs(torch.autograd.Function):
    """log softmax(h Wᵀ + b) / temperature at `labels`, for hidden states h [N, d], a chunk of
    `chunk` rows at a time: the linear LM head and the log-softmax in one function whose backward
    is written out. It is the same computation as `map_token_chunks` over the generic head (each
    chunk's logits rebuilt in backward, never more than one chunk of them alive), in fewer passes
    over those [chunk, V] logits: backward turns the rebuilt logits into their gradient in place,
    g·(onehot(label) - softmax) (/ temperature), where autograd's log-softmax and gather
    backwards allocated and filled several [chunk, V] tensors per chunk."""

    @staticmethod
    def forward(ctx, h, weight, bias, labels, temperature, chunk):
        logp, lse = h.new_empty(2, h.shape[0], dtype=torch.float32)
        for i in range(0, h.shape[0], chunk):
            logits = HeadLogprobs._logits(h[i : i + chunk], weight, bias, temperature)
            lse[i : i + chunk] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(-1, labels[i : i + chunk, None])[:, 0]
            logp[i : i + chunk] = picked - lse[i : i + chunk]
        ctx.save_for_backward(h, weight, bias, labels, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp

    @staticmethod
    def _logits(h, weight, bias, temperature) -> Tensor:
        logits = linear(h, weight, bias).float()
        return logits if temperature in (0, 1) else logits.div_(temperature)

    @staticmethod
    def backward(ctx, grad):
        h, weight, bias, labels, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        grad = grad.float()
        for i in range(0, h.shape[0], chunk):
            rows, g = h[i : i + chunk], grad[i : i + chunk, None]
            d_logits = HeadLogprobs._logits(rows, weight, bias, temperature)
            d_logits.sub_(lse[i : i + chunk, None]).exp_().mul_(-g)  # -g · softmax
            d_logits.scatter_add_(-1, labels[i : i + chunk, None], g)  # + g at the label
            if temperature not in (0, 1):
                d_logits.div_(temperature)
            d_logits = d_logits.to(weight.dtype)
            if need_h:
                grad_h[i : i + chunk] = linear(d_logits, weight.t())
            if need_w:
                grad_w += linear(d_logits.t(), rows.t())
            if grad_b is not None:
                grad_b += d_logits.sum(0)
        return grad_h, grad_w, grad_b, None, None, None


def head_token_stats(
    head: Callable[[Tensor], Tensor],
    hidden: Tensor,
    labels: Tensor,
    entropy: bool = False,
    mean_logp: bool = False,
    chunk: int | None = None,
) -> TokenStats:
    """`TokenStats` of `head(hidden)` (logits) for `labels` [B, T], never holding more than
    `chunk` tokens' logits (default: `chunk_tokens` of the vocabulary, found from one row).

    `hidden` [B, T, d] is whatever `head` takes (a final-normed hidden state for an LM head);
    the per-token values equal those of `token_logprobs` / `entropy_from_logits` on the full
    logits, and so do their gradients (tests/align/test_chunked_head.py)."""
    _check_aligned(hidden, labels, "hidden must be [B, T, d]")
    b, t, d = hidden.shape
    valid = labels != IGNORE
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

    flat = hidden.reshape(-1, d)
    fused = isinstance(head, LinearHead) and not (entropy or mean_logp) and head.fusable()
    if chunk is None and fused:
        chunk = chunk_tokens(head.linear.weight.shape[0])
    elif chunk is None:  # the vocabulary size, from one row's logits
        with torch.no_grad():
            chunk = chunk_tokens(head(flat[:1]).shape[-1] if b * t else 1)
    if fused and b * t:
        linear = head.linear
        flat = flat * head.scale if head.scale != 1.0 else flat
        logp = HeadLogprobs.apply(flat, linear.weight, linear.bias, safe, head.temperature, chunk)
        return TokenStats(logp.view(b, t) * valid, None, None)
    outs = list(map_token_chunks(stats, [flat, safe], chunk))
    logp = outs.pop(0).view(b, t) * valid
    ent = outs.pop(0).view(b, t) if entropy else None
    mean = outs.pop(0).view(b, t) if mean_logp else None
    return TokenStats(logp, ent, mean)


class LinearHead:
    """An LM head that is one plain linear layer: logits = lm_head(h · output_scale) / temperature
    (no soft cap, no adapter on the head). Called, it is the model's `output_logits` divided by
    the temperature; `head_token_stats` multiplies it in its fused form (`HeadLogprobs`)."""

    def __init__(self, model: nn.Module, temperature: float):
        self.model, self.temperature = model, temperature
        self.linear, self.scale = model.lm_head, getattr(model, "output_scale", 1.0)

    def __call__(self, h: Tensor) -> Tensor:
        logits = self.model.output_logits(h)
        return logits if self.temperature in (0, 1) else logits / self.temperature

    def fusable(self) -> bool:
        """Whether the weights are plain tensors (not, e.g., FSDP's sharded DTensors)."""
        return all(t is None or type(t) in (nn.Parameter, Tensor)
                   for t in (self.linear.weight, self.linear.bias))  # fmt: skip


def lm_head_fn(model: nn.Module, temperature: float = 1.0) -> Callable[[Tensor], Tensor]:
    """Final-normed hidden states -> logits, as the model's forward computes them (with its
    logit scaling, `output_scale`), divided by a sampling temperature: a `LinearHead` where the
    head is one plain linear layer (what `head_token_stats` fuses)."""
    config = getattr(model, "config", None)  # an HF-style model has none, and no output_logits
    if config is not None and config.final_logit_softcap is None and plain_linear(model.lm_head):
        return LinearHead(model, temperature)
    head = getattr(model, "output_logits", model.lm_head)
    if temperature in (0, 1):
        return head
    return lambda h: head(h) / temperature


def lm_token_stats(model: nn.Module, input_ids: Tensor, labels: Tensor,
                   attention_mask: Tensor | None = None, **stats) -> TokenStats:  # fmt: skip
    """`TokenStats` [B, T - 1] of the tokens ``labels[:, 1:]`` (HF-style, unshifted:
    ``labels[:, t]`` is predicted at position t-1; IGNORE marks tokens that do not count)
    under `model` (anything with `hidden_states`, `norm` and `lm_head`, as lmforge's Transformer),
    with the LM head applied a chunk of tokens at a time (`stats`: head_token_stats' entropy,
    mean_logp): the forward to the last hidden states, then the final norm and the LM head
    together, a chunk at a time."""
    h = model.hidden_states(input_ids, attention_mask)[:, :-1]
    head, vocab = lm_head_fn(model), getattr(getattr(model, "config", None), "vocab_size", None)
    chunk = chunk_tokens(vocab) if vocab else None  # None: head_token_stats probes one row
    return head_token_stats(lambda x: head(model.norm(x)), h, labels[:, 1:], chunk=chunk, **stats)


def lm_sequence_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    labels: Tensor,
    attention_mask: Tensor | None = None,
    average: bool = False,
) -> Tensor:
    """`sequence_logprobs` of ``labels`` (HF-style, unshifted) under `model` -> [B], through the
    chunked LM head."""
    logp = lm_token_stats(model, input_ids, labels, attention_mask).logp
    return masked_mean(logp, labels[:, 1:] != IGNORE, -1) if average else logp.sum(-1)


def nll_from_stats(stats: TokenStats, mask: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """Mean next-token cross-entropy over the tokens where `mask` [B, T] is true, from
    `TokenStats` (``mean_logp`` needed when label_smoothing > 0); what F.cross_entropy gives,
    including its label smoothing (1-ε)·NLL + ε·(-mean_v log p_v)."""
    per_token = -stats.logp
    if label_smoothing > 0:
        per_token = (1 - label_smoothing) * per_token - label_smoothing * stats.mean_logp
    return masked_mean(per_token, mask)  # 0 (with a graph for backward) when nothing counts


def lm_sft_loss(
    model: nn.Module,
    input_ids: Tensor,
    labels: Tensor,
    attention_mask: Tensor | None = None,
    label_smoothing: float = 0.0,
) -> Tensor:
    """`sft_loss(model(input_ids), labels)` through the chunked LM head (labels HF-style and
    unshifted)."""
    stats = lm_token_stats(model, input_ids, labels, attention_mask, mean_logp=label_smoothing > 0)
    return nll_from_stats(stats, labels[:, 1:] != IGNORE, label_smoothing)
