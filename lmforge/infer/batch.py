"""KV memory for continuous batching: a fixed set of slots that sequences join and leave.

Layout: per layer, k and v of shape [slots, n_kv_head, max_len, head_dim], allocated once. The
running sequences always occupy rows 0..n-1 (when one finishes, the last row moves into its
place), so each decode step runs one dense batch with no gather. All rows write their next
token at the same column `length`; a row's tokens fill columns [start, length) and `mask` hides
the columns before `start`. Positions (for RoPE / learned embeddings) are tracked per row, so
where a sequence's keys sit in the buffer never matters: attention is order-free over keys once
they are rotated.

Joining: the new prompts are prefilled straight into their rows, right-aligned to end at column
`length` (if a prompt is longer than `length`, the running rows shift right first). Running out
of columns: every row moves left by the smallest `start` (rare; costs one copy of the cache).

The class duck-types `KVCache` (length / key_mask / update / advance) for `Transformer.forward`.
"""

from __future__ import annotations

import torch


class SlotCache:
    """Keys/values, padding mask and next position for up to `slots` running sequences."""

    def __init__(self, config, slots: int, max_len: int, dtype=torch.float32, device="cpu"):
        shape = (slots, config.n_kv_head, max_len, config.head_dim)
        # One tensor per layer (not one 5-D buffer): torch.compile can then write a layer's
        # new column in place; slices of a shared buffer were functionalised into full copies.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.mask = torch.zeros(slots, max_len, dtype=torch.bool, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.starts = [0] * slots  # first column of each row's tokens (host copy, no syncs)
        self.slots, self.max_len = slots, max_len
        self.n = 0  # running rows
        self.length = 0  # next write column, shared by all rows
        self.key_mask: torch.Tensor | None = None  # set by begin_decode

    # ---- the KVCache interface Transformer.forward uses (decode steps) ------------------------
    def begin_decode(self) -> None:
        """Before a decode step: free a column if needed, mark it real for every running row,
        and set `key_mask`, None while every row starts at column 0 (the model then skips
        masking). A plain attribute, not a property: a compiled step reads it without tracing
        (and guarding on) the host-side row bookkeeping."""
        self.make_column()
        self.mask[: self.n, self.length] = True
        self.key_mask = self.mask[: self.n] if any(self.starts[: self.n]) else None

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        end = self.length + k_new.shape[2]
        n, k, v = k_new.shape[0], self.k[layer], self.v[layer]  # n: the running rows
        k[:n, :, self.length : end] = k_new
        v[:n, :, self.length : end] = v_new
        return k[:n, :, :end], v[:n, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    # ---- joining, leaving, running out of room ------------------------------------------------
    def room_for(self, width: int) -> int:
        """Make the shared column at least `width` so a prompt of that many tokens can end there
        (shifting running rows right if needed); return the column prompts end at."""
        if self.n == 0:
            self.length = width
        elif width > self.length:
            self._shift(width - self.length)
        return self.length

    def make_column(self) -> None:
        """Before a decode step: free a column when the buffer is full, and drop the dead
        columns before every row's start once they are over half the width (rows move left).
        Attention reads all `length` columns, so with requests coming and going the dead
        prefix would otherwise grow to the whole buffer and double a decode step's cost; the
        copy happens at most once per (live width) steps."""
        shift = min(self.starts[: self.n], default=0)
        if self.length < self.max_len and 2 * shift <= self.length:
            return
        if shift == 0:
            raise RuntimeError("slot cache full: a row reached max_len without finishing")
        self._shift(-shift)

    def _shift(self, d: int) -> None:
        """Move the running rows' columns by d (right if positive, left if negative)."""
        n, L = self.n, self.length
        src, dst = (slice(0, L), slice(d, L + d)) if d > 0 else (slice(-d, L), slice(0, L + d))
        for buf in self.k + self.v:
            buf[:n, :, dst] = buf[:n, :, src].clone()
        self.mask[:n, dst] = self.mask[:n, src].clone()
        if d > 0:
            self.mask[:n, :d] = False
        self.starts[:n] = [s + d for s in self.starts[:n]]
        self.length = L + d

    def prefill_view(self, lo: int, hi: int, width: int, pad_mask: torch.Tensor | None):
        """A cache for prefilling rows [lo, hi) with prompts `width` wide ending at `length`."""
        return _PrefillView(self, lo, hi, self.length - width, pad_mask)

    def start_rows(self, lo: int, lengths: list[int], positions: list[int]) -> None:
        """Mark rows lo.. as holding prompts of `lengths` tokens ending at column `length`."""
        for i, (count, pos) in enumerate(zip(lengths, positions)):
            row = lo + i
            self.mask[row] = False
            self.mask[row, self.length - count : self.length] = True
            self.starts[row] = self.length - count
            self.positions[row] = pos

    def copy_kv(self, src: int, dst: int, first_col: int = 0) -> None:
        """Copy a row's keys/values from `first_col` up to `length` (prefix reuse)."""
        cols = slice(first_col, self.length)
        for buf in self.k + self.v:
            buf[dst, :, cols] = buf[src, :, cols]

    def copy_row(self, src: int, dst: int) -> None:
        """Move a whole row (keys, values, mask, position) into another slot."""
        self.copy_kv(src, dst, self.starts[src])  # columns before start are masked
        self.mask[dst] = self.mask[src]
        self.positions[dst] = self.positions[src]
        self.starts[dst] = self.starts[src]


class _PrefillView:
    """Looks like an empty cache to the model; writes the prompt's keys into the slot rows."""

    length = 0

    def __init__(self, cache: SlotCache, lo: int, hi: int, col: int, pad_mask):
        self.cache, self.lo, self.hi, self.col = cache, lo, hi, col
        self.key_mask = pad_mask  # [rows, width] bool (True = real token) or None

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        cols = slice(self.col, self.col + k_new.shape[2])
        self.cache.k[layer][self.lo : self.hi, :, cols] = k_new
        self.cache.v[layer][self.lo : self.hi, :, cols] = v_new
        return k_new, v_new

    def advance(self, n: int) -> None:
        pass
