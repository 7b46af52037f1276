"""The decoder-only transformer: embeddings -> N blocks -> final norm -> LM head.

Read top to bottom like nanoGPT's model.py. Every variant (norm, position, MLP, attention kernel)
is a small component picked by the config; the block (blocks.py) wires attention and MLP into the
residual stream, this file wires the blocks into a model.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from lmforge.model.blocks import Block
from lmforge.model.cache import KVCache
from lmforge.model.config import ModelConfig
from lmforge.model.linear import Linear
from lmforge.model.masks import Window, build_mask, pattern_for
from lmforge.model.norms import build_norm
from lmforge.model.positions import ABSOLUTE_POSITIONS, LearnedPositions, RotaryEmbedding


class Transformer(nn.Module):
    """A causal language model: LongTensor [B, T] of token ids -> FloatTensor [B, T, vocab]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # on the meta device (shapes only) no init: there nn.Embedding's normal_ is a Python
        # decomposition that imports torch._dynamo, 3 s and 150 MB for a GGUF load
        table = torch.empty(config.vocab_size, config.d_model)
        kept = {"_weight": table} if table.is_meta else {}
        self.embed = nn.Embedding(config.vocab_size, config.d_model, **kept)
        self.abs_pos = None
        if config.pos in ABSOLUTE_POSITIONS:  # added to the embeddings; rope acts in attention
            self.abs_pos = ABSOLUTE_POSITIONS[config.pos](config.max_seq_len, config.d_model)
        self.rope = self.rope_local = None
        if config.pos == "rope":
            rope = partial(RotaryEmbedding, config.rope_dim, config.max_seq_len)
            self.rope = rope(config.rope_base, config.rope_interleaved, config.rope_scaling)
            if config.rope_local_base is not None:  # Gemma 3: windowed layers, own base, unscaled
                self.rope_local = rope(config.rope_local_base, config.rope_interleaved)
        self.embed_scale = math.sqrt(config.d_model) if config.embed_scale else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm = build_norm(config)
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
        self.pattern = pattern_for(config)  # sparse / windowed mask (masks.py), None = causal
        self.windowed = [config.windowed(i) for i in range(config.n_layer)]
        self.output_scale = 1 / math.sqrt(config.d_model) if config.logit_scaling else 1.0
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if not self.lm_head.weight.is_meta:  # on the meta device (shapes only) init is moot
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), zero biases, residual projections scaled by 1/sqrt(2 n_layer)
        (or zero with config.zero_init_proj); norms and learnable branch scales start at 1."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "norm" in name or name.endswith("branch_scales"):
                nn.init.ones_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                if self.config.zero_init_proj:
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, 0.0, std)

    def reset_buffers(self) -> None:
        """Recompute non-persistent tables (RoPE, sinusoids), which checkpoints do not store."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_buffers"):
                module.reset_buffers()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
        prefix_len: int | None = None,
    ) -> torch.Tensor:
        """Logits for every position (or only the last one, for decoding).

        attention_mask: [B, T] with 1 for real tokens and 0 for padding (no cache), used by
        reward models and batched scoring. With a cache, call `cache.set_padding` instead.
        prefix_len: prefix-LM; the first prefix_len positions see each other (masks.py).
        """
        h = self.hidden_states(input_ids, attention_mask, positions, cache, prefix_len)
        if last_only:
            h = h[:, -1:]
        return self.output_logits(self.norm(h))

    def output_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states -> logits: logit scaling, the LM head, Gemma's soft cap.
        Everything that applies the head by itself (chunked losses, scoring) calls this."""
        if self.output_scale != 1.0:  # logit scaling: / sqrt(d_model)
            h = h * self.output_scale
        logits = self.lm_head(h)
        if (cap := self.config.final_logit_softcap) is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits

    def hidden_states(
        self, input_ids, attention_mask=None, positions=None, cache=None, prefix_len=None
    ):
        """The residual stream after the last block, before the final norm: [B, T, d_model]."""
        b, t = input_ids.shape
        start = cache.length if cache is not None else 0
        end = start + t
        if end > self.config.max_seq_len:
            raise ValueError(
                f"sequence of {end} tokens exceeds max_seq_len={self.config.max_seq_len}"
            )
        key_mask = cache.key_mask if cache is not None else None
        if key_mask is None and attention_mask is not None:
            key_mask = attention_mask.bool()
        if positions is None:
            positions = self._positions(start, end, key_mask, input_ids.device)
        k_start = getattr(cache, "visible_start", 0) if cache is not None else 0
        args = (t, start, end, k_start, key_mask, cache is not None, prefix_len, input_ids.device)

        h = self.embed(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        if self.abs_pos is not None:
            h = h + self.abs_pos(positions)
        if self.training:  # dropout is the identity at inference; its call is not free
            h = self.drop(h)
        rope_tables = self.rope.tables(positions, h.dtype) if self.rope is not None else None
        full = local = (self.rope, rope_tables, *self._mask(*args, self.pattern))
        # Gemma 2/3: the windowed layers get their own mask (and Gemma 3 its own RoPE)
        if self.config.mixed_windows:
            rope = self.rope_local or self.rope
            tables = rope.tables(positions, h.dtype) if rope is not None else None
            local = (rope, tables, *self._mask(*args, Window(self.config.sliding_window)))
        for block, windowed in zip(self.blocks, self.windowed):
            h = block(h, *(local if windowed else full), cache)
        if cache is not None:
            cache.advance(t)
        return h

    @staticmethod
    def _positions(start: int, end: int, key_mask, device) -> torch.Tensor:
        """Absolute positions; with left padding each row counts from its first real token."""
        if key_mask is None:
            return torch.arange(start, end, device=device)
        return (key_mask[:, :end].long().cumsum(-1) - 1).clamp(min=0)[:, start:end]

    def _mask(self, t, start, end, k_start, key_mask, cached, prefix_len, device, pattern):
        """(mask, is_causal) for t new queries (positions start..end-1) over the keys k_start..
        end-1 under `pattern` (masks.py; None: causal), a prefix-LM's prefix_len and the padding
        in key_mask. A None mask takes the kernels' fast paths."""
        if isinstance(pattern, Window) and pattern.window >= end:
            pattern = None  # the window reaches back to the first key: plain causal
        if pattern is None and prefix_len is None and k_start == 0:
            if key_mask is None and t == end:
                return None, True
            if key_mask is None and t == 1:
                return None, False  # one new token may see every cached key
            if t == 1 and cached:
                # decoding: the cache marks the new column real, so the query sees exactly the
                # real keys (no causal part to build: one op instead of ten per token)
                return key_mask[:, None, None, :end], False
        if prefix_len is not None and not getattr(self.blocks[0].attn, "supports_masks", True):
            raise ValueError(f"prefix_len needs masks; attention={self.config.attention!r}")
        # from absolute positions: caches that keep only keys from k_start on (rolling window)
        keys = key_mask[:, k_start:end] if key_mask is not None else None
        q_pos = torch.arange(start, end, device=device)
        k_pos = torch.arange(k_start, end, device=device)
        return build_mask(q_pos, k_pos, pattern, prefix_len, keys), False

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the auxiliary losses of the last forward (MoE load balancing, already
        weighted by aux_loss_weight); None when no layer has one. Add it to the training loss."""
        losses = [
            b.mlp.aux_loss for b in self.blocks if getattr(b.mlp, "aux_loss", None) is not None
        ]
        return torch.stack(losses).sum() if losses else None

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.embed.weight.numel()
            if isinstance(self.abs_pos, LearnedPositions):
                n -= self.abs_pos.weight.numel()
        return n
