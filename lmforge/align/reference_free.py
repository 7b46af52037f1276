"""Reference-free preference optimisation: ORPO and SimPO / CPO (TRL's ORPOTrainer and
CPOTrainer). Neither keeps a frozen reference model, so a step is one forward + backward of the
policy on chosen and rejected rows together ([2B, T]) and the memory of a DPO reference is saved.

- ORPO (Hong et al. 2024, `lmforge orpo`): NLL(chosen) - β·log σ(log odds(y⁺) - log odds(y⁻)),
  odds from length-averaged completion log-probs; the NLL term is TRL's (mean next-token loss
  over the whole chosen sequence, prompt included). Trains from the base model in one stage, no
  separate SFT needed.
- SimPO (Meng et al. 2024, `lmforge simpo`): -log σ(β(avg logπ(y⁺) - avg logπ(y⁻)) - γ); its
  `loss_type` covers TRL's CPOTrainer family on the same data: ``sigmoid`` is CPO (Xu et al.
  2024; summed log-probs), ``hinge`` and ``ipo``; ``cpo_alpha`` adds the CPO NLL term
  (α·NLL of the chosen responses), which is how TRL spells CPO-SimPO.

The formulas are `preference_losses.orpo_loss / cpo_loss / simpo_loss`, checked against TRL in
tests/align/test_trl_oracle.py. Data is the DPO loader's: {"prompt", "chosen", "rejected"} lines
(strings or message lists) or HH dialogues or `task:NAME`; a line lacking chosen/rejected is a
DataError naming file:line. The held-out metrics are the loss, preference accuracy of the
implicit reward (β·log-prob as TRL logs it: averaged for ORPO/SimPO/IPO, summed for CPO/hinge)
and its chosen - rejected margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lmforge.align import data as D
from lmforge.align.logprobs import sequence_logprobs, sft_loss
from lmforge.align.preference_losses import (
    CPO_LOSS_TYPES,
    cpo_loss,
    orpo_loss,
    preference_accuracy,
)
from lmforge.align.replay import ReplayConfig, with_replay
from lmforge.align.sft import split_dataset
from lmforge.align.trainer import AlignConfig, AlignTrainer
from lmforge.errors import ConfigError
from lmforge.peft.config import PeftConfig, apply_peft
from lmforge.peft.export import export_peft


@dataclass
class ORPOConfig(ReplayConfig, PeftConfig, AlignConfig):
    """An ORPO run (`lmforge orpo`). On top of AlignConfig / PeftConfig / ReplayConfig:

    - ``data``: preference pairs (as `lmforge dpo`).
    - ``beta``: λ of the paper, the weight of the odds-ratio term against the NLL (TRL 0.1).
    """

    out_dir: str = "out/orpo"
    beta: float = 0.1
    lr: float = 1e-4
    warmup_iters: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta <= 0:
            raise ConfigError(f"beta must be > 0, got {self.beta}")


@dataclass
class SimPOConfig(ReplayConfig, PeftConfig, AlignConfig):
    """A SimPO / CPO run (`lmforge simpo`). On top of AlignConfig / PeftConfig / ReplayConfig:

    - ``loss_type``: ``simpo`` (default), ``sigmoid`` (CPO), ``hinge`` (SLiC) or ``ipo``.
    - ``beta``: the reward scale β (SimPO's paper uses 2.0-2.5; TRL's CPO default is 0.1).
    - ``simpo_gamma``: SimPO's target reward margin γ (TRL's ``simpo_gamma``; used by simpo only;
      the loss subtracts γ/β from the log-prob difference, i.e. γ from β·difference).
    - ``label_smoothing``: ε for sigmoid / simpo (conservative labels), 0 = off.
    - ``cpo_alpha``: weight of the NLL of the chosen responses (CPO uses 1.0; 0 = pure SimPO).
    """

    out_dir: str = "out/simpo"
    loss_type: str = "simpo"
    beta: float = 2.0
    simpo_gamma: float = 0.5
    label_smoothing: float = 0.0
    cpo_alpha: float = 0.0
    lr: float = 1e-4
    warmup_iters: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_type not in CPO_LOSS_TYPES:
            raise ConfigError(
                f"loss_type must be one of {', '.join(CPO_LOSS_TYPES)}, got {self.loss_type!r}"
            )
        if self.beta <= 0 or self.cpo_alpha < 0 or not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(
                "need beta > 0, cpo_alpha >= 0 and 0 <= label_smoothing < 0.5, got "
                f"{self.beta}, {self.cpo_alpha}, {self.label_smoothing}"
            )


class PreferenceTrainer(AlignTrainer):
    """Reference-free pairwise training: data, batches, evaluation and export shared by ORPO and
    SimPO/CPO; a subclass gives `pair_loss(logits, batch) -> (loss, r⁺, r⁻)`."""

    curves = [("train", "loss"), ("eval", "loss"), ("train", "accuracy"), ("eval", "accuracy"),
              ("train", "margin"), ("eval", "margin")]  # fmt: skip

    def setup(self) -> None:
        cfg = self.cfg
        loader = lambda src, **kw: D.load_preferences(  # noqa: E731
            src, self.tokenizer, cfg.max_len, add_bos=cfg.add_bos, **kw
        )
        train = loader(cfg.data, skip_invalid=cfg.skip_invalid, n=cfg.n_train, seed=cfg.seed)
        if train.skipped:
            self.log(f"skipped {train.skipped} invalid records (first: {train.reasons[0]})")
        self.train_examples, self.eval_examples = split_dataset(train, cfg, loader)
        apply_peft(self.lm.model, cfg)

    def _collate(self, rows) -> dict[str, Tensor]:
        return {k: v.to(self.device) for k, v in D.collate_preferences(rows, self.pad_id).items()}

    def num_examples(self) -> int:
        return len(self.train_examples)

    def batch(self, indices):
        return self._collate([self.train_examples[i] for i in indices])

    def logprobs(self, logits: Tensor, batch: dict[str, Tensor], average: bool) -> Tensor:
        """Completion log-probs of every row (summed, or averaged over completion tokens)."""
        return sequence_logprobs(logits[:, :-1], batch["labels"][:, 1:], average=average)

    def pair_loss(self, logits: Tensor, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """(loss, chosen rewards, rejected rewards): ORPO and SimPO/CPO each define their own."""
        raise NotImplementedError

    def _loss(self, batch):
        return self.pair_loss(self.lm.model(batch["input_ids"]), batch)

    def loss(self, batch):
        loss, rc, rr = self._loss(batch)
        stats = {
            "accuracy": preference_accuracy(rc, rr).item(),
            "margin": (rc - rr).mean().item(),
            "reward_chosen": rc.mean().item(),
            "reward_rejected": rr.mean().item(),
        }
        return with_replay(self, loss, stats)  # PPO-ptx: + replay_coef x LM loss on pretraining

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss, implicit-reward preference accuracy and reward margin."""
        losses, rcs, rrs = [], [], []
        for i in range(0, len(self.eval_examples), 64):
            loss, rc, rr = self._loss(self._collate(self.eval_examples[i : i + 64]))
            losses.append(loss.item() * len(rc))
            rcs.append(rc)
            rrs.append(rr)
        rc, rr = torch.cat(rcs), torch.cat(rrs)
        return {"loss": sum(losses) / len(rc), "accuracy": preference_accuracy(rc, rr).item(),
                "margin": (rc - rr).mean().item()}  # fmt: skip

    def export(self, path: Path) -> None:
        export_peft(self.lm.model, self.tokenizer, path, self.cfg)


class ORPOTrainer(PreferenceTrainer):
    """ORPO: SFT on the chosen responses plus an odds-ratio preference term, no reference."""

    name = "orpo"

    def pair_loss(self, logits, batch):
        n = len(logits) // 2
        avg = self.logprobs(logits, batch, average=True)
        # TRL's NLL: every real token of the chosen rows, prompt included (attention mask)
        ids = batch["input_ids"][:n]
        nll = sft_loss(logits[:n], ids.masked_fill(batch["attention_mask"][:n] == 0, D.IGNORE))
        loss, _ = orpo_loss(avg[:n], avg[n:], nll, self.cfg.beta)
        rewards = (self.cfg.beta * avg).detach()
        return loss, rewards[:n], rewards[n:]


class SimPOTrainer(PreferenceTrainer):
    """SimPO and the CPO family (`loss_type`), with an optional CPO NLL term."""

    name = "simpo"

    def pair_loss(self, logits, batch):
        cfg: SimPOConfig = self.cfg
        n = len(logits) // 2
        # SimPO and IPO compare length-averaged log-probs, CPO and hinge summed ones (as TRL)
        lp = self.logprobs(logits, batch, average=cfg.loss_type in ("simpo", "ipo"))
        loss = cpo_loss(lp[:n], lp[n:], cfg.beta, cfg.loss_type, cfg.label_smoothing,
                        cfg.simpo_gamma)  # fmt: skip
        if cfg.cpo_alpha > 0:  # NLL of the chosen responses only (labels mask the prompt)
            loss = loss + cfg.cpo_alpha * sft_loss(logits[:n], batch["labels"][:n])
        rewards = (cfg.beta * lp).detach()
        return loss, rewards[:n], rewards[n:]
