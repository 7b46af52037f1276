"""Post-training on sharded (FSDP2) or replicated (DDP) modules.

Two things break when the trained module is sharded: calls into it must happen inside one
forward of the sharded root module, whose pre-forward hook gathers the root-level parameters
(embedding, final norm, head) that `hidden_states` / `lm_head` calls read; and code that needs
every weight at once (generation with a KV cache, evaluation, export) must not run collectives
of its own, because ranks would call them different numbers of times (completions of different
lengths) and wait on each other forever. `LossModule` is that root: any loss function runs as
its forward. `WholeCopy` is the other half: an unsharded copy of the trained module, refreshed
from the shards by one gather that every rank joins at the same point, and `swapped_modules`
points the trainer's attributes (its module, an LM, a rollout engine's policy, a critic) at the
copy for the length of a block, so evaluation, export and sampling code runs on it unchanged.

A trainer's loop uses one of two ways to meet DDP/FSDP: `LoopWrapsLoss` (post-training, the
default: LossModule and, under FSDP, a WholeCopy) or `TrainerWrapsModel` (pretraining wraps its
own model). How a global batch splits over ranks is in samplers.py; the optimizer state is saved
with whole tensors and re-sliced on load (checkpoint.py), so one file resumes on any world size and
strategy.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


class LossModule(nn.Module):
    """A loss function as the forward of a module holding the trainable parameters: DDP or FSDP
    wraps this, so any loss (two forward passes, a reward head, a regulariser, an RL objective on
    a rollout) is one wrapped call and its gradients are all-reduced (DDP) or reduce-scattered
    (FSDP) in backward, with no change to the code that computes it."""

    def __init__(self, module: nn.Module, config: Any = None):
        super().__init__()
        self.inner = module
        self.config = config  # DDP looks for unused experts in MoE models

    def forward(self, batch: Any, fn: Callable[[Any], Any]) -> Any:
        return fn(batch)


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

    @torch.no_grad()
    def refresh(self, module: nn.Module, full_tensor: Callable, version: Any) -> None:
        """Collective: unless the copy already holds `version`, every rank joins the gather of
        `module`'s trainable parameters (one at a time, in the same order on every rank, so the
        peak is one whole parameter beyond the copy) and the keeping ranks write them in."""
        if self.version == version:
            return
        for name, p in module.named_parameters():
            if p.requires_grad:
                whole = full_tensor(p)  # on every rank, keeping or not
                if self.copy is not None:
                    self.copy.get_parameter(name).copy_(whole)
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


class LoopWrapsLoss:
    """Under torchrun the loop runs each loss inside one DDP/FSDP call of `LossModule(module)`;
    under FSDP a `WholeCopy` serves what needs whole weights: rank 0's, in CPU memory between
    uses (evaluation, export, the state file), or with `copy_on_every_rank` one per rank on the
    device (trainers that sample from the policy every step). `static_graph`: DDP may assume the
    same parameters take part in every step (not so for MoE, nor for PPO's critic warm-up)."""

    sharded_state = False  # the training state is one file, whatever the world size
    wraps_loss = True  # False: the trainer wraps its own model (TrainerWrapsModel)

    def __init__(self, copy_on_every_rank: bool = False, static_graph: bool = True):
        self.copy_on_every_rank, self.static_graph = copy_on_every_rank, static_graph
        self.loss_module: nn.Module | None = None  # what the loop calls the loss through
        self.whole: WholeCopy | None = None

    def attach(self, module: nn.Module, config: Any, dist: Any) -> None:
        """Called once the trained module exists; FSDP shards it here (DDP: `before_update`)."""
        self.module, self.config, self.dist = module, config, dist
        if dist.shards_parameters and self.wraps_loss:
            keep = dist.is_main or self.copy_on_every_rank
            self.whole = WholeCopy(module, keep, dist.device, not self.copy_on_every_rank)
            self.loss_module = dist.wrap(LossModule(module, config))

    def before_update(self) -> None:
        """Under torchrun, before an update's micro-batches: DDP wraps the LossModule at the
        first one (after the trainer's setup has set the DDP options)."""
        if self.loss_module is None and self.dist.world_size > 1 and self.wraps_loss:
            self.dist.static_graph = self.static_graph  # DDPParallel drops it for MoE
            self.loss_module = self.dist.wrap(LossModule(self.module, self.config))

    def updated(self) -> None:
        """The weights changed: whole copies are stale."""
        if self.whole is not None:
            self.whole.version = None

    @contextlib.contextmanager
    def whole_weights(self, owner: object, version: Any) -> Iterator[bool]:
        """See `Trainer.whole_weights`."""
        if self.whole is None:
            yield True
            return
        self.whole.refresh(self.module, self.dist.full_tensor, version)  # every rank joins
        if self.whole.copy is None:
            yield False
            return
        with self.whole.swapped_in(owner, self.module):
            yield True

    @contextlib.contextmanager
    def evaluating(self, owner: object, version: Any) -> Iterator[bool]:
        """Whether this rank evaluates: rank 0, on whole weights (the other ranks hold the same
        weights, or under FSDP join the gather of them, and go on to the next step, where the
        all-reduce waits for rank 0); every rank when the trainer wraps its model."""
        with self.whole_weights(owner, version) as whole:
            yield whole and (self.dist.is_main or not self.wraps_loss)


class TrainerWrapsModel(LoopWrapsLoss):
    """The trainer wraps its own model (pretraining: DDP, or FSDP2 in place, maybe compiled) and
    calls the wrapper in its loss, which the loop runs as it is (no LossModule, no whole copy);
    every rank evaluates (a sharded model's forward is a collective) and, under torchrun, writes
    its part of a sharded training state."""

    sharded_state = True
    wraps_loss = False
