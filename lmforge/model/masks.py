"""Attention masks beyond plain causal: sparse patterns (block-local, strided), prefix-LM.

Every mask here is a function of absolute query and key positions, so it works unchanged when a
KV cache holds the earlier keys, and when a rolling cache has dropped the keys no query can see
any more (it returns the surviving keys with their positions). `True` means "may attend".

Patterns are small classes chosen by the config's `attention_pattern` dict (HF-style
`{"type": ..., size}`); `keep` says how many past keys a query can ever need, which is what a
rolling cache must hold (None: all of them).
"""

from __future__ import annotations

import torch

from lmforge.errors import ConfigError, require_int


def causal(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[t, s] bool: key j is visible from query i when j <= i."""
    return k_pos[None, :] <= q_pos[:, None]


class BlockLocal:
    """Queries see earlier keys of their own block of `block_size` positions (Sparse Transformer
    "local" pattern). A query needs at most block_size - 1 past keys."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.keep = block_size - 1

    def __call__(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        same = (q_pos[:, None] // self.block_size) == (k_pos[None, :] // self.block_size)
        return same & causal(q_pos, k_pos)


class Strided:
    """Child et al. (2019) strided pattern: the previous `stride` keys plus every key a multiple
    of `stride` back, so any two positions connect in two hops. Needs every past key."""

    keep = None

    def __init__(self, stride: int):
        self.stride = stride

    def __call__(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        dist = q_pos[:, None] - k_pos[None, :]
        return (dist >= 0) & ((dist < self.stride) | (dist % self.stride == 0))


class Window:
    """Mistral-style sliding window: query i sees keys i - window < j <= i."""

    def __init__(self, window: int):
        self.window = window
        self.keep = window - 1

    def __call__(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        dist = q_pos[:, None] - k_pos[None, :]
        return (dist >= 0) & (dist < self.window)


# attention_pattern["type"] -> (class, the dict key holding its size)
PATTERNS: dict[str, tuple[type, str]] = {
    "block_local": (BlockLocal, "block_size"),
    "strided": (Strided, "stride"),
    "sliding_window": (Window, "window"),
}


def build_pattern(spec: dict | None):
    """The pattern object for a config's `attention_pattern` dict (None: plain causal)."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") not in PATTERNS:
        raise ConfigError(
            f"attention_pattern must be a dict with type one of {', '.join(PATTERNS)}; got {spec!r}"
        )
    cls, size_key = PATTERNS[spec["type"]]
    require_int(f"attention_pattern[{size_key!r}] (type {spec['type']!r})", spec.get(size_key))
    return cls(spec[size_key])


def build_mask(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    pattern=None,
    prefix_len: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[t, s] (or [B, 1, t, s] with key_mask [B, s]) bool mask for queries/keys at absolute
    positions. Prefix keys (position < prefix_len) are visible to every query; padding keys
    (key_mask False) to none, except each query's own position so no row is empty."""
    allowed = pattern(q_pos, k_pos) if pattern is not None else causal(q_pos, k_pos)
    if prefix_len is not None:
        allowed = allowed | (k_pos[None, :] < prefix_len)
    if key_mask is None:
        return allowed
    own = q_pos[:, None] == k_pos[None, :]
    return (key_mask[:, None, None, :] & allowed) | own


def pattern_for(config):
    """The mask pattern a ModelConfig asks for: `attention_pattern`, else `sliding_window`."""
    pattern = build_pattern(getattr(config, "attention_pattern", None))
    window = getattr(config, "sliding_window", None)
    if getattr(config, "full_attention_layers", None) is not None:
        return None  # some layers see every key: one pattern does not describe the model
    if pattern is None and window is not None:
        pattern = Window(window)
    return pattern
