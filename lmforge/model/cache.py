"""Decoding caches: what each attention kind keeps from earlier tokens.

Memory is allocated once for the longest sequence the caller plans to generate, so decoding
never reallocates or concatenates. All rows share one write offset (`length`); prompts of
different lengths are left-padded and `key_mask` hides the padding from attention.

    KVCache          softmax attention: every past key and value
    RollingKVCache   softmax under a sliding window / block-local mask: only the keys still visible
    LatentKVCache    MLA (mla.py): the compressed latent and shared RoPE key per token
    LinearStateCache linear attention (linear_attention.py): two running sums, fixed size

Every kind lives here, below the attention modules that fill it, so `new_cache(config)` (and
`KVCache.for_model`) can pick one without importing upwards.
"""

from __future__ import annotations

import torch

from lmforge.model.masks import pattern_for


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
        """A cache sized for `config` (a ModelConfig), of the kind its attention needs (full,
        rolling window, compressed latent or recurrent state): `new_cache`."""
        if cls is KVCache:
            return new_cache(config, batch_size, max_len, dtype, device)
        return cls(
            config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim, dtype, device
        )

    @property
    def visible_start(self) -> int:
        """Absolute position of the first key `update` returns (0: this cache keeps them all)."""
        return 0

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

    @classmethod
    def for_model(cls, config, batch_size, max_len, dtype=torch.float32, device="cpu", keep=0):
        return cls(
            config.n_layer, batch_size, config.n_kv_head, keep, config.head_dim, max_len,
            dtype, device,
        )  # fmt: skip

    @property
    def visible_start(self) -> int:
        return self.length - min(self.length, self.keep)

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        if self.length + k_new.shape[2] > self.max_len:
            raise ValueError(
                f"KV cache full: {self.length + k_new.shape[2]} positions requested, "
                f"capacity {self.max_len}"
            )
        kept = min(self.length, self.keep)
        k = torch.cat([self.k[layer, :, :, self.keep - kept :], k_new], dim=2)
        v = torch.cat([self.v[layer, :, :, self.keep - kept :], v_new], dim=2)
        n = min(self.keep, k.shape[2])
        if n:  # right-align the newest n positions in the buffer
            self.k[layer, :, :, self.keep - n :] = k[:, :, k.shape[2] - n :]
            self.v[layer, :, :, self.keep - n :] = v[:, :, v.shape[2] - n :]
        return k, v


class LatentKVCache(KVCache):
    """KVCache whose "keys" are the latents c [L,B,1,S,kv_lora_rank] and whose "values" are the
    shared RoPE keys k_R [L,B,1,S,qk_rope_head_dim]; bookkeeping is inherited unchanged."""

    def __init__(self, n_layer, batch_size, max_len, latent_dim, rope_dim, dtype, device):
        super().__init__(n_layer, batch_size, 1, max_len, latent_dim, dtype, device)
        self.v = torch.zeros(n_layer, batch_size, 1, max_len, rope_dim, dtype=dtype, device=device)

    @classmethod
    def for_model(cls, config, batch_size, max_len, dtype=torch.float32, device="cpu"):
        return cls(
            config.n_layer, batch_size, max_len, config.kv_lora_rank, config.qk_rope_head_dim,
            dtype, device,
        )  # fmt: skip

    def nbytes(self) -> int:
        return (self.k.numel() + self.v.numel()) * self.k.element_size()


class LinearStateCache:
    """Recurrent state of every layer for O(1)-per-token decoding: S [L,B,H,F,D], z [L,B,H,F].

    Same bookkeeping as KVCache (`length`, `key_mask`, `set_padding`, `advance`, `reorder`), so
    the Transformer and `generate` use it unchanged; the size does not grow with the sequence."""

    def __init__(self, n_layer, batch_size, n_head, feat_dim, head_dim, max_len, device="cpu"):
        self.s = torch.zeros(n_layer, batch_size, n_head, feat_dim, head_dim, device=device)
        self.z = torch.zeros(n_layer, batch_size, n_head, feat_dim, device=device)
        self.max_len = max_len
        self.length = 0
        self.key_mask: torch.Tensor | None = None

    @classmethod
    def for_model(cls, config, batch_size, max_len, dtype=torch.float32, device="cpu"):
        """States are fp32 whatever the model dtype: they are sums over the whole history."""
        feat = config.head_dim  # every feature map here has head_dim features
        return cls(
            config.n_layer, batch_size, config.n_head, feat, config.head_dim, max_len, device
        )

    @property
    def batch_size(self) -> int:
        return self.s.shape[1]

    @property
    def visible_start(self) -> int:
        return self.length  # no keys are kept: the state summarises them

    def state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.s[layer], self.z[layer]

    def write(self, layer: int, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.s[layer], self.z[layer] = state

    def set_padding(self, attention_mask: torch.Tensor) -> None:
        mask = torch.ones(self.batch_size, self.max_len, dtype=torch.bool, device=self.s.device)
        mask[:, : attention_mask.shape[1]] = attention_mask.bool()
        self.key_mask = mask

    def advance(self, n: int) -> None:
        self.length += n

    def reorder(self, index: torch.Tensor) -> None:
        self.s, self.z = self.s[:, index], self.z[:, index]
        if self.key_mask is not None:
            self.key_mask = self.key_mask[index]

    def nbytes(self) -> int:
        return (self.s.numel() + self.z.numel()) * self.s.element_size()


def softmax_cache(config, batch_size, max_len, dtype=torch.float32, device="cpu") -> KVCache:
    """A rolling buffer when the mask pattern bounds how far back a query looks, else full."""
    pattern = pattern_for(config)
    if pattern is not None and pattern.keep is not None:
        return RollingKVCache.for_model(config, batch_size, max_len, dtype, device, pattern.keep)
    return KVCache(
        config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim, dtype, device
    )


# config.attention -> the cache that attention kind decodes with. The keys are those of
# blocks.ATTENTION_CLASSES (tests/model/test_catalogue.py checks they agree).
CACHES = {
    "softmax": softmax_cache,
    "linear": LinearStateCache.for_model,
    "mla": LatentKVCache.for_model,
}


def new_cache(
    config, batch_size: int, max_len: int, dtype=torch.float32, device="cpu"
) -> KVCache | LinearStateCache:
    """The decoding cache `config`'s attention kind needs, sized for `batch_size` rows of up to
    `max_len` positions."""
    return CACHES[getattr(config, "attention", "softmax")](
        config, batch_size, max_len, dtype, device
    )
