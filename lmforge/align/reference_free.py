"""Reference-free preference optimisation: ORPO and SimPO / CPO (TRL's ORPOTrainer and
CPOTrainer). Neither keeps a frozen reference model, so a step is one forward + backward of the
policy on chosen and rejected rows together ([2B, T]) and the memory of a DPO reference is saved.

- ORPO (`lmforge orpo`, `preference_losses.orpo_loss`) trains from the base model in one stage,
  no separate SFT needed.
- SimPO (`lmforge simpo`, `preference_losses.cpo_loss`): its `loss_type` covers TRL's CPOTrainer
  family on the same data: ``sigmoid`` is CPO, ``hinge`` and ``ipo``; ``cpo_alpha`` adds the CPO
  NLL term, which is how TRL spells CPO-SimPO.

Both are checked against TRL in tests/align/trl_oracle/. Data, batches and held-out
metrics are `dpo.PreferenceTrainer`'s; the implicit reward is β·log-prob as TRL logs it
(averaged for ORPO/SimPO/IPO, summed for CPO/hinge).
"""

from __future__ import annotations

from lmforge.align import data as D
from lmforge.align.dpo import PreferenceConfig, PreferenceTrainer
from lmforge.align.logprobs import lm_token_stats, masked_mean
from lmforge.align.preference_losses import CPO_LOSS_TYPES, cpo_loss, orpo_loss
from lmforge.errors import ConfigError, require_choice
from lmforge.train.config import run_config


@run_config
class ORPOConfig(PreferenceConfig):
    """An ORPO run (`lmforge orpo`): ``data`` holds preference pairs (as `lmforge dpo`);
    ``beta`` is λ of the paper, the weight of the odds-ratio term against the NLL (TRL 0.1)."""

    out_dir: str = "out/orpo"


@run_config
class SimPOConfig(PreferenceConfig):
    """A SimPO / CPO run (`lmforge simpo`). On top of PreferenceConfig:

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

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("loss_type", self.loss_type, CPO_LOSS_TYPES)
        if self.cpo_alpha < 0 or not 0 <= self.label_smoothing < 0.5:
            raise ConfigError("need cpo_alpha >= 0 and 0 <= label_smoothing < 0.5, got "
                              f"{self.cpo_alpha}, {self.label_smoothing}")  # fmt: skip


class ORPOTrainer(PreferenceTrainer):
    """ORPO: SFT on the chosen responses plus an odds-ratio preference term, no reference."""

    name = "orpo"

    def pair_loss(self, batch):
        ids = batch["input_ids"]
        n = len(ids) // 2
        # log-probs of every real token (one chunked head pass): TRL's NLL counts the chosen
        # rows' prompt too (attention mask), the odds ratio only completions (labels)
        real = ids.masked_fill(batch["attention_mask"] == 0, D.IGNORE)
        stats = lm_token_stats(self.lm.model, ids, real)
        avg = masked_mean(stats.logp, batch["labels"][:, 1:] != D.IGNORE, -1)  # completions
        nll = masked_mean(-stats.logp[:n], real[:n, 1:] != D.IGNORE)  # over the chosen rows
        loss, _ = orpo_loss(avg[:n], avg[n:], nll, self.cfg.beta)
        return loss, *(self.cfg.beta * avg).detach().chunk(2)


class SimPOTrainer(PreferenceTrainer):
    """SimPO and the CPO family (`loss_type`), with an optional CPO NLL term."""

    name = "simpo"

    def pair_loss(self, batch):
        cfg: SimPOConfig = self.cfg
        labels = batch["labels"]
        n = len(labels) // 2
        stats = lm_token_stats(self.lm.model, batch["input_ids"], labels)
        # SimPO and IPO compare length-averaged log-probs, CPO and hinge summed ones (as TRL)
        if cfg.loss_type in ("simpo", "ipo"):
            lp = masked_mean(stats.logp, labels[:, 1:] != D.IGNORE, -1)
        else:
            lp = stats.logp.sum(-1)  # 0 on prompt and padding tokens
        loss = cpo_loss(lp[:n], lp[n:], cfg.beta, cfg.loss_type, cfg.label_smoothing,
                        cfg.simpo_gamma)  # fmt: skip
        if cfg.cpo_alpha > 0:  # NLL of the chosen responses only (labels mask the prompt)
            loss = loss + cfg.cpo_alpha * masked_mean(-stats.logp[:n], labels[:n, 1:] != D.IGNORE)
        return loss, *(cfg.beta * lp).detach().chunk(2)
