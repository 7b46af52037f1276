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

How a global batch splits over ranks is in samplers.py; the optimizer state is saved with whole
tensors and re-sliced on load (parallel.py), so one file resumes on any world size and strategy.
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
