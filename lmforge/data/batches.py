"""Batches from token shards: random blocks for training (resumable), sequential blocks for
evaluation, and a padding collate for variable-length sequences (SFT, classification, generation).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from lmforge.data.shards import TokenShard
from lmforge.errors import DataError, require_choice, require_int


def _gather(shard: TokenShard, starts: np.ndarray, width: int) -> torch.Tensor:
    """Rows tokens[s : s + width] for each start, read with ONE numpy fancy-index call."""
    index = starts[:, None] + np.arange(width, dtype=np.int64)
    return torch.from_numpy(np.asarray(shard.tokens[index]).astype(np.int64))


def _split_xy(buf: torch.Tensor, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # contiguous so callers can .view(-1) the targets, as nanoGPT's loss does
    x, y = buf[:, :-1].contiguous(), buf[:, 1:].contiguous()
    if torch.device(device).type == "cuda":  # pinned host memory lets the copy overlap compute
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def _check_block(shard: TokenShard, batch_size: int, block_size: int) -> None:
    require_int("batch_size", batch_size)
    require_int("block_size", block_size)
    if len(shard) < block_size + 1:
        raise DataError(
            f"{shard.name}: has {len(shard)} tokens, fewer than block_size + 1 = {block_size + 1}"
        )


class BatchSampler:
    """Random (x, y) blocks from a shard, y being x shifted left by one token.

    Start offsets come from a seeded torch.Generator; `state_dict` captures that generator and the
    batch count, so a run resumed from a checkpoint sees exactly the batches it would have seen.
    """

    def __init__(
        self,
        shard: TokenShard,
        batch_size: int,
        block_size: int,
        seed: int = 0,
        device: str | torch.device = "cpu",
    ):
        _check_block(shard, batch_size, block_size)
        self.shard, self.batch_size, self.block_size = shard, batch_size, block_size
        self.seed, self.device = seed, device
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: int64 tensors [batch_size, block_size] on self.device."""
        high = len(self.shard) - self.block_size  # last start still leaves block_size + 1 tokens
        starts = torch.randint(high, (self.batch_size,), generator=self.generator).numpy()
        self.batches_drawn += 1
        return _split_xy(_gather(self.shard, starts, self.block_size + 1), self.device)

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state: the generator state as a list of byte values, plus the batch count."""
        return {
            "seed": self.seed,
            "batches_drawn": self.batches_drawn,
            "generator_state": self.generator.get_state().tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the exact random stream saved by `state_dict`."""
        try:
            self.generator.set_state(torch.as_tensor(state["generator_state"], dtype=torch.uint8))
            self.batches_drawn = int(state["batches_drawn"])
            self.seed = int(state.get("seed", self.seed))
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise DataError(f"invalid BatchSampler state ({type(e).__name__}: {e})") from e


def iterate_eval_batches(
    shard: TokenShard,
    batch_size: int,
    block_size: int,
    max_batches: int | None = None,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic, non-overlapping blocks in order, for eval loss and perplexity.

    Block i predicts tokens[i*T + 1 : (i+1)*T + 1] from tokens[i*T : (i+1)*T], so every token after
    the first is a target exactly once (up to the ragged end). The last batch may be smaller.
    """
    _check_block(shard, batch_size, block_size)
    n_blocks = (len(shard) - 1) // block_size
    starts = np.arange(n_blocks, dtype=np.int64) * block_size
    for lo in range(0, n_blocks, batch_size)[:max_batches]:  # [:None]: every batch
        yield _split_xy(_gather(shard, starts[lo : lo + batch_size], block_size + 1), device)


def pad_collate(
    sequences: list[list[int]], pad_id: int, side: str = "right"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad id lists to the longest: ids [B, Tmax] and attention mask [B, Tmax] (1 real, 0 pad).

    Left padding keeps every sequence's last token in the last column, which batched generation
    needs; right padding is the usual choice for training.
    """
    require_choice("pad_collate side", side, ("left", "right"))
    if not sequences:
        raise DataError("pad_collate got no sequences")
    rows = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    ids = pad_sequence(rows, batch_first=True, padding_value=pad_id, padding_side=side)
    mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_side=side)
    return ids, mask
