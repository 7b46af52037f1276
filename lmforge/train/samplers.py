"""How a global batch splits over ranks, and how each rank draws its share.

Pretraining draws the global batch as `grad_accum` random streams ("lanes"), lane j seeded from
(seed, j); rank r draws lanes [r*k, (r+1)*k) with k = grad_accum / world_size, so a run on any
number of processes trains on the same data and resumes on another number. Post-training shuffles
one order of examples per epoch (`EpochSampler`) and gives each rank its slice.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lmforge.data import BatchSampler, TokenShard
from lmforge.errors import ConfigError, DataError


def lane_seed(seed: int, lane: int) -> int:
    """Seed of data lane `lane`; lane 0 uses `seed` itself (a plain BatchSampler's stream)."""
    return seed + 1_000_003 * lane


def micro_batch_seed(seed: int, step: int, lane: int) -> int:
    """Seed of the model's own randomness (dropout) for lane `lane` of optimizer step `step`.

    Seeding the global RNG with it before each micro-batch gives that micro-batch the same
    dropout masks on whichever rank, and after however many others, it runs: one process and N
    ranks apply the same masks, and a resume on another world size continues them exactly.
    """
    mixed = np.random.SeedSequence([seed, step, lane]).generate_state(2, np.uint32)
    return (int(mixed[0]) << 31) ^ int(mixed[1])  # < 2**63, what torch.manual_seed accepts


class LaneSampler:
    """This rank's share of the global batch: lanes [first, first + count), one BatchSampler each,
    drawn round-robin so call i of a step reads lane `lanes[i]` (all lanes on a single process)."""

    def __init__(self, shard: TokenShard, batch_size: int, block_size: int, seed: int,
                 lanes: range, device: str | torch.device = "cpu"):  # fmt: skip
        self.lanes = lanes
        self.samplers = {
            j: BatchSampler(shard, batch_size, block_size, lane_seed(seed, j), device)
            for j in lanes
        }
        self._calls = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        lane = self.lanes[self._calls % len(self.lanes)]
        self._calls += 1
        return self.samplers[lane].next_batch()

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: {"lanes": {lane: BatchSampler state}} for this rank's lanes."""
        return {"lanes": {str(j): s.state_dict() for j, s in self.samplers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take this rank's lanes from a merged {"lanes": ...} of every saving rank."""
        if "lanes" not in state and "generator_state" in state:
            # a single-process checkpoint of an earlier lmforge: one BatchSampler stream, which is
            # lane 0's (lane_seed(seed, 0) == seed); it continues exactly only as the sole lane
            if len(self.lanes) != 1 or self.lanes[0] != 0:
                raise DataError(
                    "the checkpoint holds one data stream (a single-process run of an earlier "
                    "lmforge), which continues exactly only with grad_accum 1, not "
                    f"{len(self.lanes)}: start a new out_dir"
                )
            state = {"lanes": {"0": state}}
        saved = state.get("lanes", {})
        for j, sampler in self.samplers.items():
            if str(j) not in saved:
                raise DataError(
                    f"data lane {j} is not in the checkpoint (it has lanes "
                    f"{sorted(map(int, saved))}); resume with the same grad_accum"
                )
            sampler.load_state_dict(saved[str(j)])
        self._calls = 0


def check_world_size(
    count: int, world_size: int, what: str = "batch_size", unit: str = "examples"
) -> None:
    """The global batch (`count` `unit` of one step) must split evenly over the ranks (checked
    before any step)."""
    if count % world_size:
        raise ConfigError(
            f"{what}={count} is not divisible by the world size {world_size}: it counts the "
            f"{unit} of one step across all ranks (each rank takes {what} / world size); set it "
            f"to a multiple of {world_size}"
        )


class EpochSampler:
    """Shuffled minibatch indices, epoch after epoch; its position is part of the saved state.

    Every rank shuffles the same order and `next()` returns rank `rank`'s contiguous slice of
    the global batch, so the state is the same on every rank and resumes on any world size.
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        if n < 1:
            raise ConfigError("no training examples")
        self.n, self.batch_size, self.seed = n, min(batch_size, n), seed
        check_world_size(self.batch_size, world_size, f"batch_size (capped at {n} examples)")
        self.rank, self.world_size = rank, world_size
        self.epoch, self.pos = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def next(self) -> list[int]:
        if self.pos + self.batch_size > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._shuffle()
        idx = self._order[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        share = self.batch_size // self.world_size
        return idx[self.rank * share : (self.rank + 1) * share]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._shuffle()
