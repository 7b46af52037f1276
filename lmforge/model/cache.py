"""Decoding caches: what each attention kind keeps from earlier tokens.

Memory is allocated once for the longest sequence the caller plans to generate, so decoding
never reallocates or concatenates. Keys and values are one tensor per layer ([B, n_kv_head,
max_len, head_dim]): a compiled decode step can then write a layer's new column in place, where
slices of one shared 5-D buffer were functionalised into full copies.

    KVCache          softmax attention: every past key and value; all rows share one write
                     offset (`length`), prompts are left-padded and `key_mask` hides the padding
    SlotCache        the engine's KVCache (infer/engine.py): sequences join and leave rows while
                     the others keep decoding, each with its own start column and position
    RollingKVCache   softmax under a sliding window / block-local mask: only the keys still visible
    LatentKVCache    MLA (mla.py): the compressed latent and shared RoPE key per token
    LinearStateCache linear attention (linear_attention.py): two running sums, fixed size

Every kind lives here, below the attention modules that fill it, so `new_cache(config)` can pick
one without importing upwards. `full_attention(config)` says whether a config's keys may sit in
any column of a KVCache (the one place that decides between the engine's slot batching and its
per-kind path).
"""

from __future__ import annotations

import torch

from lmforge.model.masks import pattern_for


def full_attention(config) -> bool:
    """True when every query sees every earlier key through softmax attention: the case where a
    plain KV cache with a key mask reproduces the uncached forward exactly, and where keys may
    sit in any column (attention is order-free over rotated keys)."""
    return (
        getattr(config, "attention", "softmax") == "softmax"
        and getattr(config, "attention_pattern", None) is None
        and getattr(config, "sliding_window", None) is None
    )


class _Bookkeeping:
    """What every cache tracks besides its tensors: positions written so far (`length`, the same
    for every row), the capacity `max_len`, and `key_mask` [B, max_len] (True = real token).
    The tensors are two lists `k` and `v` of one [B, ...] tensor per layer."""

    length = 0
    key_mask: torch.Tensor | None = None
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def reorder(self, index: torch.Tensor) -> None:
        """Keep / repeat / reorder batch rows: a shared prefix copied per continuation
        (eval/core_scoring.py, the engine's per-kind path), finished rows dropped."""
        self.k = [t[index] for t in self.k]
        self.v = [t[index] for t in self.v]
        if self.key_mask is not None:
            self.key_mask = self.key_mask[index]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def set_padding(self, attention_mask: torch.Tensor) -> None:
        """Record which of the first T positions are padding ([B, T] with 1 = real): before a
        left-padded prefill, or after a right-padded one (eval/core_scoring.py) to hide the
        padding from the tokens that follow; positions count real keys only."""
        mask = torch.ones(self.batch_size, self.max_len, dtype=torch.bool, device=self.device)
        mask[:, : attention_mask.shape[1]] = attention_mask.bool()
        self.key_mask = mask

    def advance(self, n: int) -> None:
        self.length += n


class KVCache(_Bookkeeping):
    """Keys and values of every layer: k[layer], v[layer] of shape [B, n_kv_head, max_len, D]."""

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_kv_head: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (batch_size, n_kv_head, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.max_len = max_len

    @property
    def visible_start(self) -> int:
        """Absolute position of the first key `update` returns (0: this cache keeps them all)."""
        return 0

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Write this step's keys/values at the current offset; return every cached position."""
        start, end = self.length, self.length + k_new.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} positions requested, capacity {self.max_len}")
        k, v = self.k[layer], self.v[layer]
        k[:, :, start:end] = k_new
        v[:, :, start:end] = v_new
        return k[:, :, :end], v[:, :, :end]


class SlotCache(KVCache):
    """The engine's KV memory for continuous batching: `slots` rows that sequences join and
    leave while the others keep decoding.

    The running sequences always occupy rows 0..n-1 (when one finishes, the last row moves into
    its place), so each decode step runs one dense batch with no gather. All rows write their
    next token at the same column `length`; a row's tokens fill columns [start, length) and
    `mask` hides the columns before `start`. Positions (for RoPE / learned embeddings) are
    tracked per row, so where a sequence's keys sit in the buffer never matters: attention is
    order-free over keys once they are rotated (hence `full_attention` configs only).

    Joining: the new prompts are prefilled straight into their rows, right-aligned to end at
    column `length` (if a prompt is longer than `length`, the running rows shift right first).
    Running out of columns: every row moves left by the smallest `start` (rare; one copy).
    """

    def __init__(self, config, slots: int, max_len: int, dtype=torch.float32, device="cpu"):
        super().__init__(
            config.n_layer, slots, config.n_kv_head, max_len, config.head_dim, dtype, device
        )
        self.mask = torch.zeros(slots, max_len, dtype=torch.bool, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.starts = [0] * slots  # first column of each row's tokens (host copy, no syncs)
        self.slots = slots
        self.n = 0  # running rows

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

    def copy_kv(self, src: int | list[int], dst: int | list[int], first_col: int = 0) -> None:
        """Copy rows' keys/values from `first_col` up to `length` (prefix reuse: a list of
        rows is one indexed copy per buffer, not one per row)."""
        cols = slice(first_col, self.length)
        if isinstance(src, list):
            device = self.mask.device
            src, dst = torch.as_tensor(src, device=device), torch.as_tensor(dst, device=device)
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


class RollingKVCache(KVCache):
    """A KV cache that holds only the `keep` newest positions (Mistral's rolling buffer).

    With a sliding window W (or a block-local pattern) no query ever looks further back than
    W - 1 keys, so memory stays O(W) however long the generation. `update` returns the kept
    keys followed by the new ones, oldest first, starting at absolute position `visible_start`
    (masks are built from absolute positions, so they need no other change); then it keeps the
    newest `keep` of them. `max_len` is still the longest sequence (for positions and padding).
    """

    def __init__(self, n_layer, batch_size, n_kv_head, keep, head_dim, max_len, dtype, device):
        super().__init__(n_layer, batch_size, n_kv_head, keep, head_dim, dtype, device)
        self.keep, self.max_len = keep, max_len

    @property
    def visible_start(self) -> int:
        return self.length - min(self.length, self.keep)

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        if (end := self.length + k_new.shape[2]) > self.max_len:
            raise ValueError(f"KV cache full: {end} positions requested, capacity {self.max_len}")
        kept = min(self.length, self.keep)
        k_buf, v_buf = self.k[layer], self.v[layer]
        k = torch.cat([k_buf[:, :, self.keep - kept :], k_new], dim=2)
        v = torch.cat([v_buf[:, :, self.keep - kept :], v_new], dim=2)
        n = min(self.keep, k.shape[2])
        if n:  # right-align the newest n positions in the buffer
            k_buf[:, :, self.keep - n :] = k[:, :, k.shape[2] - n :]
            v_buf[:, :, self.keep - n :] = v[:, :, v.shape[2] - n :]
        return k, v


class LatentKVCache(KVCache):
    """KVCache whose "keys" are the latents c [B,1,S,kv_lora_rank] and whose "values" are the
    shared RoPE keys k_R [B,1,S,qk_rope_head_dim] of each layer; bookkeeping is inherited."""

    def __init__(self, n_layer, batch_size, max_len, latent_dim, rope_dim, dtype, device):
        super().__init__(n_layer, batch_size, 1, max_len, latent_dim, dtype, device)
        shape = (batch_size, 1, max_len, rope_dim)
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]


class LinearStateCache(_Bookkeeping):
    """Recurrent state of every layer for O(1)-per-token decoding: the running sums S
    [B, H, F, D] (in `k`) and z [B, H, F] (in `v`), fp32 whatever the model dtype.

    Same bookkeeping as KVCache (`length`, `key_mask`, `set_padding`, `advance`, `reorder`), so
    the Transformer and the engine's per-kind path use it unchanged; the size does not grow
    with the sequence."""

    def __init__(self, n_layer, batch_size, n_head, feat_dim, head_dim, max_len, device="cpu"):
        shape = (batch_size, n_head, feat_dim)
        self.k = [torch.zeros(*shape, head_dim, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device) for _ in range(n_layer)]
        self.max_len = max_len

    @property
    def visible_start(self) -> int:
        return self.length  # no keys are kept: the state summarises them

    def state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def write(self, layer: int, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.k[layer], self.v[layer] = state


def softmax_cache(config, batch_size, max_len, dtype=torch.float32, device="cpu") -> KVCache:
    """A rolling buffer when the mask pattern bounds how far back a query looks, else full."""
    keep = getattr(pattern_for(config), "keep", None)
    shape = (config.n_layer, batch_size, config.n_kv_head)
    if keep is not None:
        return RollingKVCache(*shape, keep, config.head_dim, max_len, dtype, device)
    return KVCache(*shape, max_len, config.head_dim, dtype, device)


# config.attention -> the cache that attention kind decodes with. The keys are those of
# blocks.ATTENTION_CLASSES (tests/model/test_catalogue.py checks they agree).
CACHES = {
    "softmax": softmax_cache,
    "mla": lambda c, batch, max_len, dtype=torch.float32, device="cpu": LatentKVCache(
        c.n_layer, batch, max_len, c.kv_lora_rank, c.qk_rope_head_dim, dtype, device
    ),
    # states are fp32 whatever the model dtype (sums over the whole history); every feature map
    # here has head_dim features
    "linear": lambda c, batch, max_len, dtype=torch.float32, device="cpu": LinearStateCache(
        c.n_layer, batch, c.n_head, c.head_dim, c.head_dim, max_len, device
    ),
}


def new_cache(
    config, batch_size: int, max_len: int, dtype=torch.float32, device="cpu"
) -> KVCache | LinearStateCache:
    """The decoding cache `config`'s attention kind needs, sized for `batch_size` rows of up to
    `max_len` positions."""
    return CACHES[getattr(config, "attention", "softmax")](
        config, batch_size, max_len, dtype, device
    )
