"""Batched, KV-cached scoring of token continuations (the fast path of `lmforge eval core`).

An example is a few token sequences (one per answer option) that usually share a long prefix:
the few-shot examples and the question. Each option is scored over its continuation tokens
[start, end): the mean cross-entropy of those tokens and whether greedy decoding reproduces every
one of them. Done naively (nanochat's core_eval), every option runs a full forward, so a
4-choice 10-shot question pays for its 10-shot context four times.

Here each batch runs two forwards:

1. the examples' shared prefixes, right-padded into one batch, which fills a KV cache;
2. the cache rows are repeated once per option and every option's remaining tokens (the
   continuation plus the last shared token, whose logit predicts the first continuation token)
   run as one right-padded batch on top of it.

Only the hidden states at the scored positions go through the final norm and the LM head, so
logits are never materialised for the context. The prefixes' padding is hidden from the options
by the cache's key mask and positions count real keys only, so every real token sees exactly the
keys and positions it would see alone: the numbers equal a plain per-option forward up to float
rounding (tests/eval/test_core.py checks the decisions agree exactly).

A one-option example (language modelling) has nothing to share, so it skips the cache too and
runs as one right-padded row: right padding needs no attention mask (causal attention never lets
a real token see the padding after it), which keeps SDPA on its unmasked fast path. Batches are
cut where padding would exceed PAD_SLACK of the real tokens plus PAD_FREE: on a CPU a wider batch
buys almost nothing for prompts of hundreds of tokens, while every padded position costs a full
token.

Models whose attention is not plain softmax over every key (sliding window, latent, recurrent)
skip the cache: their options run as full right-padded sequences, still batched.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

import torch
import torch.nn.functional as F

from lmforge.data.batches import pad_collate
from lmforge.model.cache import KVCache, full_attention
from lmforge.model.modes import eval_mode

HEAD_CHUNK = 512  # scored positions per LM-head call: bounds the [N, vocab] logits in memory
# A batch's padding may add PAD_SLACK of its real tokens plus PAD_FREE positions: short rows
# (0-shot tasks) batch freely, where a forward's fixed cost outweighs a few padded tokens.
PAD_SLACK, PAD_FREE = 0.15, 512


@dataclass
class OptionSet:
    """One example: token sequences of its options and, per option, the scored span [start, end)
    (start >= 1: the token before it is the one whose logits predict tokens[start])."""

    seqs: list[list[int]]
    starts: list[int]
    ends: list[int]

    def prefix_len(self) -> int:
        """Tokens every option shares and that no option scores: computed once, in phase 1.
        Zero for a single option: there is nothing to share, and one plain forward is cheaper."""
        if len(self.seqs) == 1:
            return 0
        common = common_prefix_len(self.seqs)
        return max(0, min(common, min(self.starts) - 1))


def common_prefix_len(seqs: Sequence[list[int]]) -> int:
    """Length of the longest prefix all token lists share (os.path.commonprefix compares lists
    item by item, not only strings)."""
    return len(os.path.commonprefix(list(seqs)))


def common_suffix_len(seqs: Sequence[list[int]]) -> int:
    """Length of the longest suffix all token lists share."""
    return common_prefix_len([s[::-1] for s in seqs])


def lm_head(model, h: torch.Tensor) -> torch.Tensor:
    """The model's logits for hidden states h: the same final norm and output head as
    Transformer.forward applies (so the scored positions alone go through the head)."""
    return model.output_logits(model.norm(h))


def _batches(sets: list[OptionSet], order: list[int], max_len: int, max_tokens: int):
    """Greedy packing in `order` (longest first): a batch's widest prefix plus its longest
    remainder must fit the model's context, rows x width the token budget, and its padded
    positions at most PAD_SLACK x its real ones + PAD_FREE."""
    batch: list[int] = []
    width = rest = rows = real = 0
    for i in order:
        s = sets[i]
        p = s.prefix_len()
        tails = [e - p for e in s.ends]
        r, n = max(tails), len(tails)
        w2, r2, rows2, real2 = max(width, p), max(rest, r), rows + n, real + p + sum(tails)
        padded = (len(batch) + 1) * w2 + rows2 * r2
        too_padded = padded > (1 + PAD_SLACK) * real2 + PAD_FREE
        if batch and (w2 + r2 > max_len or rows2 * (w2 + r2) > max_tokens or too_padded):
            yield batch
            batch, w2, r2, rows2, real2 = [], p, r, n, p + sum(tails)
        batch.append(i)
        width, rest, rows, real = w2, r2, rows2, real2
    if batch:
        yield batch


@torch.inference_mode()
def score_option_sets(
    model, sets: list[OptionSet], max_tokens: int = 16384
) -> list[list[tuple[float, bool]]]:
    """For every example and option: (mean cross-entropy over its continuation tokens, True when
    the argmax at every scored position is the next token). Order of `sets` is kept.

    max_tokens bounds rows x padded width of one batch (KV cache and activations)."""
    use_cache = full_attention(model.config)
    # Longest shared prefix first, then longest remainder: neighbours pad each other least.
    order = sorted(range(len(sets)), key=lambda i: (-sets[i].prefix_len(), -max(sets[i].ends)))
    out: list[list[tuple[float, bool]] | None] = [None] * len(sets)
    with eval_mode(model):
        for batch in _batches(sets, order, model.config.max_seq_len, max_tokens):
            scored = _score_batch(model, [sets[i] for i in batch], use_cache)
            for i, result in zip(batch, scored):
                out[i] = result
    return out  # type: ignore[return-value]


def _score_batch(model, sets: list[OptionSet], use_cache: bool) -> list[list[tuple[float, bool]]]:
    device = model.embed.weight.device
    prefixes = [s.prefix_len() if use_cache else 0 for s in sets]
    width = max(prefixes)
    cache = _prefill(model, sets, prefixes, width, device) if width > 0 else None
    # Phase 2: one row per option with the tokens after its example's prefix, right-padded
    # (padding comes after every real token, so causal attention never lets a real token see it).
    row_of = [i for i, s in enumerate(sets) for _ in s.seqs]
    tails = [seq[p:end] for s, p in zip(sets, prefixes) for seq, end in zip(s.seqs, s.ends)]
    ids, _ = pad_collate(tails, 0)
    if cache is not None:
        cache.reorder(torch.as_tensor(row_of, device=device))  # copy each prefix per option
    h = model.hidden_states(ids.to(device), cache=cache)
    # Scored positions: the logit at column c predicts the token at column c + 1.
    rows, cols, targets, lengths = [], [], [], []
    r = 0
    for s, p in zip(sets, prefixes):
        for seq, start, end in zip(s.seqs, s.starts, s.ends):
            n = end - start
            rows += [r] * n
            cols += range(start - 1 - p, end - 1 - p)
            targets += seq[start:end]
            lengths.append(n)
            r += 1
    losses, hits = _score_positions(model, h, rows, cols, targets, device)
    scores = iter(zip(losses.split(lengths), hits.split(lengths)))
    return [[(loss.mean().item(), bool(hit.all())) for loss, hit in islice(scores, len(s.seqs))]
            for s in sets]  # fmt: skip


def _prefill(model, sets, prefixes, width, device) -> KVCache:
    """Phase 1: the shared prefixes, right-padded to `width`, written into a fresh cache sized
    for the longest option that follows.

    Right padding lets this forward run without a mask (causal attention never shows a real
    token the padding after it), so SDPA takes its causal path, which skips the blocks above the
    diagonal: with a padding mask it computes every block, twice the work at the few-shot
    lengths of BoolQ (~3k tokens). The padding is hidden afterwards, for the options that
    follow, by a key mask with a hole in each short row; positions count real keys only, so an
    option's first token sits right after its own prefix."""
    config = model.config
    rest = max(e - p for s, p in zip(sets, prefixes) for e in s.ends)
    dtype = model.embed.weight.dtype
    if not dtype.is_floating_point:  # e.g. an int8-quantized embedding: cache in the compute dtype
        dtype = torch.float32
    cache = KVCache(config.n_layer, len(sets), config.n_kv_head, width + rest, config.head_dim,
                    dtype, device)  # fmt: skip
    ids, real = pad_collate([s.seqs[0][:p] for s, p in zip(sets, prefixes)], 0)
    model.hidden_states(ids.to(device), cache=cache)
    if not bool(real.all()):  # equal prefixes keep the unmasked fast path in phase 2 as well
        cache.set_padding(real.bool().to(device))
    return cache


def _score_positions(model, h, rows, cols, targets, device):
    """Cross-entropy (float32) and greedy hit per scored position, through the head in chunks."""
    if not rows:
        empty = torch.zeros(0)
        return empty, empty.bool()
    rows_t = torch.as_tensor(rows, device=device)
    cols_t = torch.as_tensor(cols, device=device)
    targets_t = torch.as_tensor(targets, device=device)
    losses, hits = [], []
    for lo in range(0, len(rows), HEAD_CHUNK):
        sl = slice(lo, lo + HEAD_CHUNK)
        logits = lm_head(model, h[rows_t[sl], cols_t[sl]]).float()
        losses.append(F.cross_entropy(logits, targets_t[sl], reduction="none").cpu())
        hits.append((logits.argmax(-1) == targets_t[sl]).cpu())
    return torch.cat(losses), torch.cat(hits)
