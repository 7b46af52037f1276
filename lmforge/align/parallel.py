"""How post-training code written for one whole model runs on FSDP2 shards.

Two things break when the trained module is sharded (lmforge/train/distributed.py): calls into
it must happen inside one forward of the sharded root module, whose pre-forward hook gathers the
root-level parameters (embedding, final norm, head) that `hidden_states` / `lm_head` calls
read; and code that needs every weight at once (generation with a KV cache, evaluation, export)
must not run collectives of its own, because ranks would call them different numbers of times
(completions of different lengths) and wait on each other forever.

`LossModule` is that root: any loss function runs as its forward. `WholeCopy` is the other half:
an unsharded copy of the trained module, refreshed from the shards by one gather that every rank
joins at the same point, and `swapped_modules` points the trainer's attributes (self.module,
self.lm.model, a rollout engine's policy, a PPO critic) at the copy for the length of a block,
so evaluation, export and sampling code runs on it unchanged.

The rest is how a global batch and a saved state split over ranks: `EpochSampler` gives each
rank its slice of the same shuffled order, and the optimizer state is saved with whole tensors
and re-sliced on load, so one file resumes on any world size and either strategy.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lmforge.errors import ConfigError


class LossModule(nn.Module):
    """A trainer's `loss(batch)` as the forward of a module holding its trainable parameters:
    DDP or FSDP wraps this, so any loss (two forward passes, a reward head, a regulariser, an RL
    objective on a rollout) is one wrapped call and its gradients are all-reduced (DDP) or
    reduce-scattered (FSDP) in backward, with no change to the subclass."""

    def __init__(self, trainer: Any, module: nn.Module):
        super().__init__()
        self.inner = module
        self.loss_fn = trainer.loss
        self.config = trainer.lm.config  # DDP looks for unused experts in MoE models

    def forward(self, batch: Any, fn: Callable[[Any], Any] | None = None) -> Any:
        """`loss(batch)`, or `fn(batch)` for a trainer whose update has its own loss."""
        return (fn or self.loss_fn)(batch)


@contextlib.contextmanager
def swapped_modules(owner: object, module: nn.Module, replacement: nn.Module) -> Iterator[None]:
    """For the body, every attribute of `owner` and of the plain objects it holds (an LM, a
    rollout engine) that refers to `module` or one of its submodules refers instead to the
    same-named submodule of `replacement`, a copy with the same structure. This is how
    evaluation, export and sampling code, written against the trainer's own attributes, runs
    unchanged on a whole copy of a sharded model."""
    twin = dict(replacement.named_modules(remove_duplicate=False))
    mapping = {id(m): twin[n] for n, m in module.named_modules(remove_duplicate=False)}
    holders = [owner] + [
        v for v in vars(owner).values()
        if hasattr(v, "__dict__") and not isinstance(v, (nn.Module, torch.Tensor, type))
    ]  # fmt: skip
    changed = []
    for obj in holders:
        for key, value in list(vars(obj).items()):
            if isinstance(value, nn.Module) and id(value) in mapping:
                changed.append((obj, key, value))
                setattr(obj, key, mapping[id(value)])
    try:
        yield
    finally:
        for obj, key, value in changed:
            setattr(obj, key, value)


class WholeCopy:
    """An unsharded copy of a module about to be sharded, kept on the ranks that need whole
    weights (`keep`) and refreshed from the shards when they change.

    `offload` keeps the copy in CPU memory between uses (rank 0's copy for evaluation and
    export, used every few hundred steps); a copy used every step (rollouts) stays on `device`.
    Frozen parameters are copied once here and never gathered again.
    """

    def __init__(self, module: nn.Module, keep: bool, device: torch.device, offload: bool):
        self.device, self.offload = device, offload
        self.copy = copy.deepcopy(module).to("cpu" if offload else device) if keep else None
        self.version: Any = None  # what the copy holds (the trainer's step), None: stale

    def refresh(self, module: nn.Module, full_tensor: Callable, version: Any) -> None:
        """Collective: unless the copy already holds `version`, every rank joins the gather of
        `module`'s trainable parameters (one at a time, in the same order on every rank, so the
        peak is one whole parameter beyond the copy) and the keeping ranks write them in."""
        if self.version == version:
            return
        params = dict(self.copy.named_parameters()) if self.copy is not None else {}
        for name, p in module.named_parameters():
            if p.requires_grad:
                whole = full_tensor(p)
                if params:
                    with torch.no_grad():
                        params[name].copy_(whole)
        self.version = version

    @contextlib.contextmanager
    def swapped_in(self, owner: object, module: nn.Module) -> Iterator[None]:
        """For the body, `owner`'s references to `module` point at the copy (on `device`)."""
        try:
            with swapped_modules(owner, module, self.copy.to(self.device)):
                yield
        finally:
            if self.offload:
                self.copy.to("cpu")  # GPU memory holds only the shards between uses


def check_world_size(batch_size: int, world_size: int, what: str = "batch_size") -> None:
    """The global batch must split evenly over the ranks (before any step)."""
    if batch_size % world_size:
        raise ConfigError(
            f"{what}={batch_size} is not divisible by the world size {world_size}: it is the "
            f"global batch of one step across all ranks (each rank takes {what} / world size); "
            f"set it to a multiple of {world_size}"
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


def whole_optimizer_state(optimizer: torch.optim.Optimizer, dist: Any) -> dict[str, Any]:
    """optimizer.state_dict() with whole tensors (collective under FSDP, same order on every
    rank), so a saved state does not depend on how the run was split."""
    state = optimizer.state_dict()
    if dist.shards_parameters:
        state["state"] = {
            i: {k: dist.full_tensor(v) if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in sorted(state["state"].items())
        }
    return state


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, dist: Any) -> None:
    """Load a state saved by `whole_optimizer_state`; under FSDP each rank keeps its slice of
    the moments (no communication)."""
    if dist.shards_parameters:
        by_index = [p for g in optimizer.param_groups for p in g["params"]]
        for i, s in state["state"].items():
            p = by_index[int(i)]
            for k, v in s.items():
                if torch.is_tensor(v) and v.shape == p.shape:
                    s[k] = dist.shard_like(v, p)
    optimizer.load_state_dict(state)
