"""Direct Preference Optimisation: fit the policy to preference pairs with no reward model.

L = -log σ(β[(log πθ(y⁺|x) - log π_ref(y⁺|x)) - (log πθ(y⁻|x) - log π_ref(y⁻|x))]) (SPEC §10), with
sequence log-probs summed over completion tokens only and π_ref a frozen copy of the starting
policy. Chosen and rejected rows go through the model in ONE forward pass ([2B, T]), and
`precompute_ref` scores the whole dataset under π_ref once up front (as TRL's
precompute_ref_log_probs), so a training step is one policy forward + backward. Label smoothing ε
gives conservative DPO, which is also the probability variant: with p the chance that "chosen"
really is better, ε = 1 - p. `loss_type` swaps in TRL's robust, hinge (SLiC) or IPO losses on the
same log-ratios (`preference_losses.dpo_loss`; tests/align/test_trl_oracle.py checks them
against TRL). The implicit reward β(log π - log π_ref) scores held-out pairs: its preference
accuracy is the headline metric.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lmforge.align import data as D
from lmforge.align.logprobs import sequence_logprobs
from lmforge.align.preference_losses import DPO_LOSS_TYPES, dpo_loss, preference_accuracy
from lmforge.align.replay import ReplayConfig, with_replay
from lmforge.align.sft import split_dataset
from lmforge.align.trainer import AlignConfig, AlignTrainer
from lmforge.errors import ConfigError
from lmforge.peft.config import PeftConfig, apply_peft
from lmforge.peft.export import export_peft


@dataclass
class DPOConfig(ReplayConfig, PeftConfig, AlignConfig):
    """A DPO run (`lmforge dpo`); `peft` trains LoRA/adapters against the frozen reference."""

    out_dir: str = "out/dpo"
    data: str = "task:add"  # preference pairs: JSONL (prompt/chosen/rejected or HH) or task:
    beta: float = 0.1
    label_smoothing: float = 0.0  # ε: conservative DPO (0 = plain DPO); robust: flip rate < 0.5
    # sigmoid (DPO) | robust (rDPO) | hinge (SLiC) | ipo (length-normalised, as TRL): see dpo_loss
    loss_type: str = "sigmoid"
    # RPO (Pang et al. 2024; TRL's rpo_alpha): + α · per-token NLL of the chosen responses, which
    # keeps DPO from lowering the likelihood of the right answers along with the wrong ones.
    rpo_alpha: float = 0.0
    precompute_ref: bool = True  # score every pair under π_ref once instead of every step
    lr: float = 1e-4
    warmup_iters: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ConfigError(
                f"loss_type must be one of {', '.join(DPO_LOSS_TYPES)}, got {self.loss_type!r}"
            )
        if self.loss_type == "robust" and not self.label_smoothing < 0.5:
            raise ConfigError(f"robust DPO needs label_smoothing < 0.5, got {self.label_smoothing}")
        if self.beta <= 0 or not 0 <= self.label_smoothing <= 1 or self.rpo_alpha < 0:
            raise ConfigError(f"need beta > 0, 0 <= label_smoothing <= 1 and rpo_alpha >= 0, got "
                              f"{self.beta}, {self.label_smoothing}, {self.rpo_alpha}")  # fmt: skip


def completion_logprobs(model, batch: dict[str, Tensor]) -> Tensor:
    """Σ log p(token) over completion tokens for every row of a right-padded batch -> [rows]."""
    # Right padding never changes the real tokens' logits under causal attention: no mask needed.
    logits = model(batch["input_ids"])
    return sequence_logprobs(logits[:, :-1], batch["labels"][:, 1:])


class DPOTrainer(AlignTrainer):
    """DPO against a frozen copy of the starting policy."""

    name = "dpo"
    curves = [("train", "loss"), ("eval", "loss"), ("train", "accuracy"), ("eval", "accuracy"),
              ("train", "margin"), ("eval", "margin")]  # fmt: skip

    def setup(self) -> None:
        cfg: DPOConfig = self.cfg
        loader = lambda src, **kw: D.load_preferences(  # noqa: E731
            src, self.tokenizer, cfg.max_len, add_bos=cfg.add_bos, **kw
        )
        train = loader(cfg.data, skip_invalid=cfg.skip_invalid, n=cfg.n_train, seed=cfg.seed)
        if train.skipped:
            self.log(f"skipped {train.skipped} invalid records (first: {train.reasons[0]})")
        self.train_examples, self.eval_examples = split_dataset(train, cfg, loader)
        self.ref = copy.deepcopy(self.lm.model).eval().requires_grad_(False)
        apply_peft(self.lm.model, cfg)
        self.ref_train = self._ref_logps(self.train_examples) if cfg.precompute_ref else None
        self.ref_eval = self._ref_logps(self.eval_examples)

    @torch.no_grad()
    def _ref_logps(self, examples) -> Tensor:
        """[N, 2] reference log-probs (chosen, rejected) for every pair."""
        out = []
        for i in range(0, len(examples), 64):
            b = self._collate(examples[i : i + 64])
            out.append(completion_logprobs(self.ref, b).view(2, -1).T)
        return torch.cat(out)

    def _collate(self, rows) -> dict[str, Tensor]:
        return {k: v.to(self.device) for k, v in D.collate_preferences(rows, self.pad_id).items()}

    def num_examples(self) -> int:
        return len(self.train_examples)

    def batch(self, indices):
        b = self._collate([self.train_examples[i] for i in indices])
        if self.ref_train is not None:
            b["ref"] = self.ref_train[indices]
        else:
            with torch.no_grad():
                b["ref"] = completion_logprobs(self.ref, b).view(2, -1).T
        return b

    def _loss(self, b) -> tuple[Tensor, Tensor, Tensor]:
        chosen, rejected = completion_logprobs(self.lm.model, b).chunk(2)
        ref = b["ref"]
        # completion tokens per row (IPO divides each log-ratio by its completion's length)
        lengths = (b["labels"][:, 1:] != D.IGNORE).sum(-1)
        loss, rc, rr = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], self.cfg.beta,
                                self.cfg.label_smoothing, self.cfg.loss_type,
                                *lengths.chunk(2))  # fmt: skip
        if self.cfg.rpo_alpha > 0:
            n_chosen = (b["labels"][: len(chosen), 1:] != D.IGNORE).sum().clamp(min=1)
            loss = loss - self.cfg.rpo_alpha * chosen.sum() / n_chosen
        return loss, rc, rr

    def loss(self, batch):
        loss, rc, rr = self._loss(batch)
        stats = {"accuracy": preference_accuracy(rc, rr).item(), "margin": (rc - rr).mean().item()}
        stats.update(reward_chosen=rc.mean().item(), reward_rejected=rr.mean().item())
        return with_replay(self, loss, stats)  # PPO-ptx: + replay_coef x LM loss on pretraining

    def evaluate(self) -> dict[str, float]:
        """Held-out loss, implicit-reward preference accuracy and reward margin."""
        losses, rcs, rrs = [], [], []
        for i in range(0, len(self.eval_examples), 64):
            b = self._collate(self.eval_examples[i : i + 64])
            b["ref"] = self.ref_eval[i : i + 64]
            loss, rc, rr = self._loss(b)
            losses.append(loss.item() * len(rc))
            rcs.append(rc)
            rrs.append(rr)
        rc, rr = torch.cat(rcs), torch.cat(rrs)
        return {"loss": sum(losses) / len(rc), "accuracy": preference_accuracy(rc, rr).item(),
                "margin": (rc - rr).mean().item()}  # fmt: skip

    def export(self, path: Path) -> None:
        export_peft(self.lm.model, self.tokenizer, path, self.cfg)
