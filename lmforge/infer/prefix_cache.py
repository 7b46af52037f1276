"""Prefix caching across requests: prompt blocks whose keys and values were computed once are
reused by later requests that start the same way (a shared system prompt, a long conversation
growing turn by turn), so only the new tokens are prefilled.

    engine = Engine.from_lm(lm, max_batch=16, prefix_cache_bytes=512 * 2**20)  # the option

A prompt is cut into blocks of `block_size` tokens; block i is known by a hash of its tokens and
of block i-1's hash (so a block stands for the whole prefix up to its end, as in vLLM's automatic
prefix caching). After a prefill, the keys and values of every whole block of the prompt are
copied out of the slot cache into a pool (least recently used first out once the pool passes its
byte budget; a lookup refreshes a chain from its last block to its first, so a chain loses its
tail before its head and never becomes unreachable in the middle). When a request arrives, its
longest chain of cached blocks is copied into its cache row and only the rest of the prompt
(at least one token, whose logits start the reply) runs through the model, attending to the
copied keys. The keys were rotated at the positions they have in every prompt that shares
them (a prefix starts at position 0), so they are reused as they are.

It applies to the slot-cache path (full softmax attention, no draft model) and to prompts given
as token ids without prompt embeddings; anything else is prefilled as usual. The engine holds
one `PrefixCache` when `prefix_cache_bytes` > 0 and asks it, per prefill, which prompts it can
start from cached blocks (`split`), to prefill those from their blocks (`prefill`) and to keep
the blocks of every prompt prefilled (`store`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from itertools import takewhile

import torch

from lmforge.errors import ConfigError
from lmforge.model.cache import SlotCache


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up and found (hit / queried is the hit rate /metrics reports)."""

    queried: int = 0
    hit: int = 0


@dataclass
class _Block:
    k: torch.Tensor  # [n_layer, n_kv_head, block_size, head_dim]
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class PrefixCache:
    """Blocks of keys and values by the hash of the prefix they end, within a byte budget."""

    def __init__(self, block_size: int = 16, max_bytes: int = 256 * 2**20):
        if block_size < 1 or max_bytes < 0:
            raise ConfigError("prefix cache: block_size must be >= 1 and max_bytes >= 0")
        self.block_size, self.max_bytes = block_size, max_bytes
        self.blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self.bytes = 0
        self.stats = PrefixCacheStats()

    def keys(self, tokens: list[int]) -> list[bytes]:
        """The hash of every whole block of `tokens` (each chained to the ones before)."""
        out, previous, b = [], b"", self.block_size
        for i in range(len(tokens) // b):
            block = tokens[i * b : (i + 1) * b]
            previous = hashlib.blake2b(previous + repr(block).encode(), digest_size=16).digest()
            out.append(previous)
        return out

    def lookup(self, tokens: list[int]) -> list[_Block]:
        """The longest chain of cached blocks that `tokens` starts with, leaving at least one
        token after it; counted in the stats and refreshed (tail first, head last)."""
        found = list(takewhile(lambda key: key in self.blocks, self.keys(tokens[:-1])))
        for key in reversed(found):
            self.blocks.move_to_end(key)
        self.stats.queried += len(tokens)
        self.stats.hit += len(found) * self.block_size
        return [self.blocks[key] for key in found]

    def insert(self, tokens: list[int], read_block) -> None:
        """Store the whole blocks of `tokens` not stored yet; `read_block(i)` -> (k, v) of block
        i. Evicts least recently used blocks beyond the budget."""
        for i, key in enumerate(self.keys(tokens)):
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            k, v = read_block(i)
            block = _Block(k.clone(), v.clone())
            if block.nbytes > self.max_bytes:
                return
            self.blocks[key] = block
            self.bytes += block.nbytes
        while self.bytes > self.max_bytes and self.blocks:
            _, old = self.blocks.popitem(last=False)
            self.bytes -= old.nbytes

    def clear(self) -> None:
        self.blocks.clear()
        self.bytes = 0

    # ---- the engine's side: prefills over a SlotCache ----------------------------------------
    def split(self, seqs: list) -> tuple[list, list[tuple[object, list[_Block]]]]:
        """(the sequences to prefill in full, [(sequence, its cached blocks)] for the others):
        prompts given as token ids that start with at least one cached block."""
        misses, hits = [], []
        for seq in seqs:
            blocks = self.lookup(seq.prompt) if seq.embeds is None else []
            if blocks:
                hits.append((seq, blocks))
            else:
                misses.append(seq)
        return misses, hits

    def prefill(self, model, cache: SlotCache, row: int, prompt: list[int],
                blocks: list[_Block]) -> torch.Tensor:  # fmt: skip
        """Copy `blocks` into the free cache row `row` and run the rest of `prompt` through
        `model`, attending to them -> the last position's logits [1, V]."""
        total, cached = len(prompt), len(blocks) * self.block_size
        cache.room_for(total)
        col = cache.length - total
        k = torch.cat([b.k for b in blocks], dim=2)  # [n_layer, n_kv_head, cached, head_dim]
        v = torch.cat([b.v for b in blocks], dim=2)
        for layer in range(len(cache.k)):
            cache.k[layer][row, :, col : col + cached] = k[layer]
            cache.v[layer][row, :, col : col + cached] = v[layer]
        ids = torch.as_tensor(prompt[cached:], device=cache.k[0].device)[None]
        return model(ids, cache=_SuffixView(cache, row, col, cached), last_only=True)[:, -1]

    def store(self, cache: SlotCache, row: int, prompt: list[int]) -> None:
        """Keep the whole blocks of row's prompt, just prefilled."""
        first, b = cache.starts[row], self.block_size

        def read_block(i: int):
            cols = slice(first + i * b, first + (i + 1) * b)
            k = torch.stack([layer[row, :, cols] for layer in cache.k])
            v = torch.stack([layer[row, :, cols] for layer in cache.v])
            return k, v

        self.insert(prompt, read_block)


class _SuffixView:
    """The rest of a prompt prefilled into slot-cache row `row`, whose first `length` tokens'
    keys are already in columns col..col+length: the model sees a cache of that length."""

    key_mask = None

    def __init__(self, cache, row: int, col: int, length: int):
        self.cache, self.row, self.col, self.length = cache, row, col, length

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        end = self.col + self.length + k_new.shape[2]
        rows, cols = slice(self.row, self.row + 1), slice(self.col + self.length, end)
        k, v = self.cache.k[layer], self.cache.v[layer]
        k[rows, :, cols] = k_new
        v[rows, :, cols] = v_new
        return k[rows, :, self.col : end], v[rows, :, self.col : end]

    def advance(self, n: int) -> None:
        pass
