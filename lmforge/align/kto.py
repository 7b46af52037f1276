"""Kahneman-Tversky Optimisation (Ethayarajh et al. 2024; TRL's KTOTrainer): learn from
unpaired thumbs-up / thumbs-down completions against a frozen reference.

Every example is a prompt, one completion and a binary label; the loss is
`preference_losses.kto_loss` (checked against TRL in tests/align/trl_oracle/). Its
reference point z₀ estimates KL(π‖π_ref) as TRL does: each step pairs every prompt of the batch
with the completion of the previous row (a mismatched pair, "x with some other y") and scores
those pairs under π and π_ref without gradients. π_ref log-probs of the real pairs are computed
once up front.

Data (`data`, read by `data.load_unpaired`): JSONL lines {"prompt", "completion", "label":
true|false} (strings or message lists) or {"messages", "label"}; a paired line or a `task:` pair
gives two examples, chosen desirable and rejected undesirable (TRL's `unpair_preference_dataset`).

Held-out metric: the KTO reward margin, mean β·r over desirable completions minus mean β·r over
undesirable ones (0 at the start, since π = π_ref); it should rise as training separates them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmforge.align import data as D
from lmforge.align.dpo import PreferenceConfig, completion_logprob_sums
from lmforge.align.preference_losses import KTO_LOSS_TYPES, kto_loss
from lmforge.align.trainer import AlignTrainer, frozen_copy
from lmforge.errors import ConfigError, DataError, require_choice
from lmforge.peft.config import apply_peft
from lmforge.train.config import run_config


@run_config
class KTOConfig(PreferenceConfig):
    """A KTO run (`lmforge kto`). Fields on top of PreferenceConfig:

    - ``beta``: β, the scale of the implicit reward β·r inside the sigmoid (TRL default 0.1).
    - ``desirable_weight`` / ``undesirable_weight``: λ_D and λ_U. KTO's authors recommend
      λ_D·n_D / (λ_U·n_U) in [1, 4/3]; when the data is imbalanced raise the rarer side's weight
      (a ratio outside that range is logged, not refused).
    - ``loss_type``: ``kto`` (the paper's loss, with the KL reference point z₀) or
      ``apo_zero_unpaired`` (APO-zero: desirable pushed up, undesirable pushed down, no z₀).
    - ``kl_estimate``: compute z₀ from mismatched pairs each step (True, TRL's default); False
      fixes z₀ = 0, which saves the two extra forward passes (TRL's ``calculate_KL=False``).
    - ``precompute_ref``: score every example under π_ref once instead of every step.
    """

    out_dir: str = "out/kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_type: str = "kto"
    kl_estimate: bool = True
    precompute_ref: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("loss_type", self.loss_type, KTO_LOSS_TYPES)
        if self.desirable_weight <= 0 or self.undesirable_weight <= 0:
            raise ConfigError(
                "desirable_weight and undesirable_weight must be > 0, got "
                f"{self.desirable_weight}, {self.undesirable_weight}"
            )
        if self.loss_type == "apo_zero_unpaired":
            self.kl_estimate = False  # APO has no reference point: skip the KL passes


def mismatched(rows: list[D.SFTExample], max_len: int) -> list[D.SFTExample]:
    """Row i's prompt with row i-1's completion (TRL's KL pairs: the batch rotated by one)."""
    out = []
    for row, other in zip(rows, rows[-1:] + rows[:-1]):
        p, q = row.prompt_len, other.prompt_len
        ids = (row.input_ids[:p] + other.input_ids[q:])[:max_len]
        labels = ([D.IGNORE] * p + other.labels[q:])[:max_len]
        out.append(D.SFTExample(ids, labels))
    return out


class KTOTrainer(AlignTrainer):
    """KTO against a frozen copy of the starting policy."""

    name = "kto"
    curves = [("train", "loss"), ("eval", "loss"), ("train", "margin"), ("eval", "margin"),
              ("train", "kl"), ("eval", "kl")]  # fmt: skip

    def setup(self) -> None:
        cfg: KTOConfig = self.cfg
        self.load_examples(D.load_unpaired)
        n_good = sum(e.desirable for e in self.train_examples)
        n_bad = len(self.train_examples) - n_good
        if n_good == 0 or n_bad == 0:
            raise DataError(
                f"{cfg.data}: KTO needs desirable and undesirable examples; the training split "
                f"has {n_good} desirable and {n_bad} undesirable"
            )
        ratio = cfg.desirable_weight * n_good / (cfg.undesirable_weight * n_bad)
        if not 1 <= ratio <= 4 / 3:
            self.log(f"kto: λ_D·n_D / (λ_U·n_U) = {ratio:.2f} ({n_good} desirable, {n_bad} "
                     "undesirable); the KTO paper recommends 1 to 4/3")  # fmt: skip
        self.ref = frozen_copy(self.lm.model)  # before PEFT wraps the policy
        apply_peft(self.lm.model, cfg.peft)
        self.ref_train = self._ref_logps(self.train_examples) if cfg.precompute_ref else None
        self.ref_eval = self._ref_logps(self.eval_examples)

    def _ref_logps(self, examples: list[D.UnpairedExample]) -> Tensor:
        rows = [e.example for e in examples]
        return self.score_rows(rows, lambda b: completion_logprob_sums(self.ref, b))

    def _make_batch(self, examples: list[D.UnpairedExample], ref: Tensor | None) -> dict:
        rows = [e.example for e in examples]
        b = self.collate(rows)
        b["desirable"] = torch.tensor([e.desirable for e in examples], device=self.device)
        with torch.no_grad():
            b["ref"] = ref if ref is not None else completion_logprob_sums(self.ref, b)
            if self.cfg.kl_estimate and len(rows) > 1:
                kl = self.collate(mismatched(rows, self.cfg.max_len))
                # z₀ is detached in the loss, so neither pass needs gradients (as TRL)
                b["kl_policy"] = completion_logprob_sums(self.lm.model, kl)
                b["kl_ref"] = completion_logprob_sums(self.ref, kl)
        return b

    def batch(self, indices):
        ref = self.ref_train[indices] if self.ref_train is not None else None
        return self._make_batch([self.train_examples[i] for i in indices], ref)

    def _loss(self, b: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """(loss, z₀, β·r per row)."""
        cfg: KTOConfig = self.cfg
        policy = completion_logprob_sums(self.lm.model, b)
        loss, z0 = kto_loss(policy, b["ref"], b["desirable"], b.get("kl_policy"),
                            b.get("kl_ref"), cfg.beta, cfg.desirable_weight,
                            cfg.undesirable_weight, cfg.loss_type)  # fmt: skip
        return loss, z0, (cfg.beta * (policy - b["ref"])).detach()

    @staticmethod
    def _stats(rewards: Tensor, desirable: Tensor) -> dict[str, float]:
        sides = {"reward_desirable": rewards[desirable], "reward_undesirable": rewards[~desirable]}
        stats = {name: r.mean().item() for name, r in sides.items() if len(r)}
        if len(stats) == 2:
            stats["margin"] = stats["reward_desirable"] - stats["reward_undesirable"]
        return stats

    def loss(self, batch):
        loss, z0, rewards = self._loss(batch)
        stats = {"kl": z0.item(), **self._stats(rewards, batch["desirable"])}
        return self.with_replay(loss, stats)  # PPO-ptx: + replay_coef x LM loss on pretraining

    def evaluate(self) -> dict[str, float]:
        """Held-out loss, reference point z₀ and the desirable - undesirable reward margin."""
        batches = []  # (loss x rows, z0 x rows, rewards, labels) of each batch
        for i in range(0, len(self.eval_examples), 64):
            part = self.eval_examples[i : i + 64]
            b = self._make_batch(part, self.ref_eval[i : i + 64])
            loss, z0, r = self._loss(b)
            batches.append((loss.item() * len(part), z0.item() * len(part), r, b["desirable"]))
        losses, kls, rewards, labels = zip(*batches)
        n = len(self.eval_examples)
        return {"loss": sum(losses) / n, "kl": sum(kls) / n,
                **self._stats(torch.cat(rewards), torch.cat(labels))}  # fmt: skip
