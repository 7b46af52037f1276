"""A preallocated key/value cache for incremental decoding.

Memory is allocated once for the longest sequence the caller plans to generate, so decoding
never reallocates or concatenates. All rows share one write offset (`length`); prompts of
different lengths are left-padded and `key_mask` hides the padding from attention.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer: k, v of shape [n_layer, B, n_kv_head, max_len, head_dim]."""

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
        shape = (n_layer, batch_size, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # positions written so far (same for every row)
        self.key_mask: torch.Tensor | None = None  # [B, max_len] bool, True = real token

    @classmethod
    def for_model(cls, config, batch_size: int, max_len: int, dtype=torch.float32, device="cpu"):
        """A cache sized for `config` (a ModelConfig)."""
        return cls(
            config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim, dtype, device
        )

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Write this step's keys/values at the current offset; return every cached position."""
        start, end = self.length, self.length + k_new.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} positions requested, capacity {self.max_len}")
        self.k[layer, :, :, start:end] = k_new
        self.v[layer, :, :, start:end] = v_new
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def set_padding(self, attention_mask: torch.Tensor) -> None:
        """Record which prompt positions are padding ([B, T] with 1 = real), before prefill."""
        mask = torch.ones(self.batch_size, self.max_len, dtype=torch.bool, device=self.k.device)
        mask[:, : attention_mask.shape[1]] = attention_mask.bool()
        self.key_mask = mask

    def advance(self, n: int) -> None:
        self.length += n

    def reorder(self, index: torch.Tensor) -> None:
        """Keep/reorder batch rows (beam search, dropping finished rows)."""
        self.k = self.k[:, index]
        self.v = self.v[:, index]
        if self.key_mask is not None:
            self.key_mask = self.key_mask[index]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
