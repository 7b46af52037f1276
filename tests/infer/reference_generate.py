"""The plain reference the engine is compared with: autoregressive generation over one
left-padded batch, with or without the model's own KV cache, sampling with the textbook filters.

This was lmforge's second generation stack (lmforge/infer/generate.py until the engine became
the only one, issue 17). Tests load it through the `reference_generate` fixture (conftest.py);
benchmarks/bench_rollout.py times it as the old rollout path.

Prompts of different lengths are left-padded so every row writes the cache at the same offset;
padding is hidden from attention and positions count from each row's first real token. The
prompt is processed in one forward pass (prefill), then one token per step (decode), each step
projecting only the new token and attending over the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmforge.infer.params import GenerationParams
from lmforge.model.cache import new_cache
from lmforge.model.transformer import Transformer


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits per row, plus any tied with the k-th value."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose cumulative probability reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    before = probs.cumsum(-1) - probs  # dropped when the tokens before it already reach p
    drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= p)
    return logits.masked_fill(drop, float("-inf"))


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """Next token ids [B] from last-position logits [B, V]."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0, device="cpu"):
    """ids [B, T] and attention mask [B, T] (1 = real token) with padding on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    params: GenerationParams,
    eos_ids: Sequence[int] = (),
    use_cache: bool = True,
) -> list[list[int]]:
    """New tokens for each prompt: a row finishes on an EOS id (included, nothing after it) or
    after max_new_tokens."""
    config = model.config
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, 0, device)
    batch, width = ids.shape
    # Without a cache there is no limit but the context window: crop like nanoGPT does.
    budget = params.max_new_tokens
    if use_cache:
        budget = min(budget, config.max_seq_len - width)
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    out: list[list[int]] = [[] for _ in prompts]

    cache = None
    if use_cache:
        dtype = next(model.parameters()).dtype
        cache = new_cache(config, batch, width + budget, dtype, device)
        if not bool(mask.all()):
            cache.set_padding(mask)
        logits = model(ids, cache=cache, last_only=True)[:, -1]
    else:
        logits = model(ids, attention_mask=mask, last_only=True)[:, -1]

    for step in range(budget):
        token = sample_next(logits, params.temperature, params.top_k, params.top_p, generator)
        for row in active.nonzero().flatten().tolist():
            out[row].append(int(token[row]))
        if eos.numel():
            active &= ~torch.isin(token, eos)
        if not bool(active.any()) or step == budget - 1:
            break
        if use_cache:
            logits = model(token[:, None], cache=cache)[:, -1]
        else:
            ids = torch.cat([ids, token[:, None]], dim=1)[:, -config.max_seq_len :]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)[:, -config.max_seq_len :]
            logits = model(ids, attention_mask=mask, last_only=True)[:, -1]
    return out
