"""The FSDP helpers on one process: the whole copy takes only trainable weights and only when
they changed, and the swap of the trainer's attributes is undone even when the body raises.
(The 2-process FSDP runs are in test_align_distributed.py.)"""

import pytest
import torch
from torch import nn

from lmforge.train.whole_copy import WholeCopy, swapped_modules


class Engine:  # a plain object holding the model, like a rollout engine
    def __init__(self, policy: nn.Module):
        self.policy = policy


class Owner:
    def __init__(self):
        self.model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        self.model[0].requires_grad_(False)
        self.engine = Engine(self.model)
        self.head = self.model[1]


def test_whole_copy_refreshes_trainable_weights_once_per_version():
    owner = Owner()
    whole = WholeCopy(owner.model, keep=True, device=torch.device("cpu"), offload=True)
    calls = []

    def full_tensor(p):
        calls.append(p)
        return p.detach()

    with torch.no_grad():
        for p in owner.model.parameters():
            p.add_(1.0)
    whole.refresh(owner.model, full_tensor, version=1)
    assert len(calls) == 2  # the trainable Linear's weight and bias, not the frozen one's
    torch.testing.assert_close(whole.copy[1].weight, owner.model[1].weight)
    assert not torch.equal(whole.copy[0].weight, owner.model[0].weight)  # frozen: copied once
    whole.refresh(owner.model, full_tensor, version=1)
    assert len(calls) == 2  # same version: no gather


def test_swapped_modules_points_attributes_at_the_copy_and_back():
    owner = Owner()
    copy = Owner().model
    model, head = owner.model, owner.head
    with pytest.raises(RuntimeError), swapped_modules(owner, model, copy):
        assert owner.model is copy and owner.engine.policy is copy and owner.head is copy[1]
        raise RuntimeError("evaluation failed")
    assert owner.model is model and owner.engine.policy is model and owner.head is head
