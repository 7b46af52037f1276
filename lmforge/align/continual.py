"""Continual learning: learn a new task while forgetting as little of the old one as possible.

The parameters split into frozen and trainable parts (as compared in Biderman et al. 2024, "LoRA
Learns Less and Forgets Less"): `full` (everything), `lora` (low-rank updates), `bias` (bias vectors
only) or `mlp` (a small bottleneck MLP after each block's MLP). The loss is L_new + λΩ with Ω one
of: `l2` (Σ‖θ - θ_prev‖²), `ewc` (½ Σ F_i (θ_i - θ_prev,i)², diagonal Fisher from the old task) or
`replay` (distillation from the frozen previous model on replayed old-task inputs). Training can
stop when the held-out new-task loss reaches `stop_at_new_loss`, so methods are compared at equal
new-task loss. The forgetting report (`forgetting.json`) holds old- and new-task losses before and
after.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch
from torch import Tensor

from lmforge.align import data as D
from lmforge.align.logprobs import lm_sft_loss
from lmforge.align.regularizers import (
    diagonal_fisher,
    ewc_penalty,
    l2_to_reference,
    lm_distillation_loss,
)
from lmforge.align.sft import SFTConfig, SFTTrainer
from lmforge.align.trainer import frozen_copy
from lmforge.errors import require_choice
from lmforge.fileio import write_json
from lmforge.train.config import run_config


@run_config(greedy_eval=dict(eval_generate=0))
class ContinualConfig(SFTConfig):
    """A continual-learning run (`lmforge continual`): `data` = new task, `old_data` = old."""

    out_dir: str = "out/continual"
    data: str = "task:sub"
    old_data: str = "task:add"  # the task the starting model knows (a task: or SFT JSONL)
    trainable: str = "full"  # full | lora | bias | mlp
    regularizer: str = "none"  # none | l2 | ewc | replay
    reg_weight: float = 1.0  # λ
    fisher_batches: int = 8  # old-task batches for the EWC Fisher
    replay_temperature: float = 1.0
    stop_at_new_loss: float | None = None  # stop when the held-out new-task loss gets here

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("trainable", self.trainable, TRAINABLE)
        require_choice("regularizer", self.regularizer, REGULARIZERS)
        self.peft = dataclasses.replace(self.peft, method=TRAINABLE[self.trainable])


# trainable part -> the PEFT method that makes it (bias-only is plain weights, frozen elsewhere)
TRAINABLE = {"full": "none", "lora": "lora", "bias": "none", "mlp": "adapter"}


class Regularizer:
    """Ω = 0 (plain fine-tuning)."""

    def __init__(self, trainer: ContinualTrainer):
        self.trainer = trainer

    def penalty(self) -> Tensor:
        return torch.zeros((), device=self.trainer.device)


class L2(Regularizer):
    """Ω = Σ‖θ - θ_prev‖² over the trainable parameters."""

    def __init__(self, trainer: ContinualTrainer):
        super().__init__(trainer)
        self.ref = {n: p.detach().clone() for n, p in trainer.trainable_params().items()}

    def penalty(self) -> Tensor:
        return l2_to_reference(self.trainer.trainable_params(), self.ref)


class EWC(L2):
    """Ω = ½ Σ F_i (θ_i - θ_prev,i)², F the diagonal Fisher of the old-task loss."""

    def __init__(self, trainer: ContinualTrainer):
        super().__init__(trainer)
        old, bs = trainer.old_train, trainer.cfg.batch_size
        n = min(len(old), bs * trainer.cfg.fisher_batches)
        batches = [trainer.collate(old[i : i + bs]) for i in range(0, n, bs)]
        loss_fn = lambda model, b: lm_sft_loss(model, b["input_ids"], b["labels"])
        self.fisher = diagonal_fisher(trainer.lm.model, batches, loss_fn)

    def penalty(self) -> Tensor:
        return 0.5 * ewc_penalty(self.trainer.trainable_params(), self.ref, self.fisher)


class OldTaskReplay(Regularizer):
    """Ω = T²·KL(previous model ‖ current model) on a batch of replayed old-task sequences."""

    def __init__(self, trainer: ContinualTrainer):
        super().__init__(trainer)
        self.teacher = frozen_copy(trainer.lm.model)
        self.rng = random.Random(trainer.cfg.seed)

    def penalty(self) -> Tensor:
        t = self.trainer
        b = t.collate(self.rng.sample(t.old_train, min(t.cfg.batch_size, len(t.old_train))))
        return lm_distillation_loss(t.lm.model, self.teacher, b["input_ids"],
                                    t.cfg.replay_temperature, b["attention_mask"])  # fmt: skip


REGULARIZERS = {"none": Regularizer, "l2": L2, "ewc": EWC, "replay": OldTaskReplay}


class ContinualTrainer(SFTTrainer):
    """SFT on a new task with a frozen/trainable split and a forgetting regulariser."""

    name = "continual"
    curves = [("train", "loss"), ("eval", "loss"), ("eval", "old_loss"), ("train", "penalty")]

    def setup(self) -> None:
        cfg: ContinualConfig = self.cfg
        super().setup()
        if cfg.trainable == "bias":  # BitFit: everything frozen but the bias vectors
            for name, p in self.lm.model.named_parameters():
                p.requires_grad_(name.endswith("bias"))
        load = lambda split, n, seed: D.load_sft(  # noqa: E731
            cfg.old_data, self.tokenizer, cfg.max_len, add_bos=cfg.add_bos, n=n, seed=seed,
            split=split,
        )  # fmt: skip
        is_task = str(cfg.old_data).startswith("task:")
        self.old_train = load("train", cfg.n_train, cfg.seed + 2).examples
        self.old_eval = load("validation", cfg.n_eval, cfg.seed + 3).examples if is_task else (
            self.old_train[-max(1, len(self.old_train) // 20) :])  # fmt: skip
        self.before = self.task_losses()
        self.regularizer = REGULARIZERS[cfg.regularizer](self)

    @torch.no_grad()
    def task_losses(self) -> dict[str, float]:
        """Held-out loss on the old task and on the new one."""
        return {"old_loss": self.eval_loss(self.old_eval),
                "new_loss": self.eval_loss(self.eval_examples)}  # fmt: skip

    def trainable_params(self) -> dict[str, Tensor]:
        return {n: p for n, p in self.lm.model.named_parameters() if p.requires_grad}

    def loss(self, batch):
        new, _ = super().loss(batch)
        penalty = self.regularizer.penalty()
        stats = {"new_loss": new.item(), "penalty": penalty.item()}
        return new + self.cfg.reg_weight * penalty, stats

    def evaluate(self) -> dict[str, float]:
        return {**super().evaluate(), "old_loss": self.eval_loss(self.old_eval)}

    def should_stop(self, evaluated: dict[str, float]) -> bool:
        target = self.cfg.stop_at_new_loss
        return target is not None and evaluated.get("loss", float("inf")) <= target

    def run(self) -> dict[str, Any]:
        result = super().run()
        self.lm.model.eval()
        after = self.task_losses()
        report = {
            "trainable": self.cfg.trainable,
            "regularizer": self.cfg.regularizer,
            "steps": self.step,
            "before": self.before,
            "after": after,
            "forgetting": after["old_loss"] - self.before["old_loss"],
        }
        write_json(self.out_dir / "forgetting.json", report)
        return {**result, "forgetting": report["forgetting"], "old_loss_before":
                self.before["old_loss"], "old_loss_after": after["old_loss"],
                "new_loss_after": after["new_loss"]}  # fmt: skip
