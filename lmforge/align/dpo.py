"""Direct Preference Optimisation: fit the policy to preference pairs with no reward model.

L = -log σ(β[(log πθ(y⁺|x) - log π_ref(y⁺|x)) - (log πθ(y⁻|x) - log π_ref(y⁻|x))]) (Rafailov et al.
2023), with sequence log-probs summed over completion tokens only and π_ref a frozen copy of the
starting policy. Chosen and rejected rows go through the model in ONE forward pass ([2B, T]), and
`precompute_ref` scores the whole dataset under π_ref once up front (as TRL's
precompute_ref_log_probs), so a training step is one policy forward + backward. Label smoothing ε
gives conservative DPO, which is also the probability variant: with p the chance that "chosen"
really is better, ε = 1 - p. `loss_type` swaps in TRL's robust, hinge (SLiC) or IPO losses on the
same log-ratios (`preference_losses.dpo_loss`; tests/align/trl_oracle/ checks them
against TRL). The implicit reward β(log π - log π_ref) scores held-out pairs: its preference
accuracy is the headline metric.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from lmforge.align import data as D
from lmforge.align.logprobs import lm_token_stats
from lmforge.align.preference_losses import DPO_LOSS_TYPES, dpo_loss, preference_accuracy
from lmforge.align.replay import ReplayConfig
from lmforge.align.reward import PairSourceConfig, pair_loader
from lmforge.align.sft import GreedyEvalConfig, generation_records, greedy_eval
from lmforge.align.trainer import AlignConfig, AlignTrainer, frozen_copy
from lmforge.errors import ConfigError, require_choice
from lmforge.model.modes import eval_mode
from lmforge.peft.config import PeftConfig, apply_peft
from lmforge.peft.lora import adapters_disabled
from lmforge.train.config import run_config, section


@run_config(optim=dict(lr=1e-4, warmup_iters=10))
class PreferenceConfig(AlignConfig):
    """What every preference run (DPO, KTO, ORPO, SimPO) adds to AlignConfig: PEFT, replay and
    ``beta``, which scales the implicit reward (each method's docstring says how)."""

    replay: ReplayConfig = section(ReplayConfig)
    peft: PeftConfig = section(PeftConfig)
    beta: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta <= 0:
            raise ConfigError(f"beta must be > 0, got {self.beta}")


@run_config
class DPOConfig(PreferenceConfig):
    """A DPO run (`lmforge dpo`); `peft` trains LoRA/adapters against the frozen reference.
    `pairs_from: policy` builds the pairs from the starting model's own verifier-labelled
    samples (iterative RPO's on-policy pairs; see PairSourceConfig); `eval_generate` > 0 adds
    greedy exact match on held-out prompts to the evaluation (what the task asks, beside the
    implicit-reward accuracy DPO optimises). `data` holds preference pairs: JSONL
    (prompt/chosen/rejected or HH) or task:."""

    out_dir: str = "out/dpo"
    pairs: PairSourceConfig = section(PairSourceConfig)
    greedy_eval: GreedyEvalConfig = section(GreedyEvalConfig, eval_generate=0)
    label_smoothing: float = 0.0  # ε: conservative DPO (0 = plain DPO); robust: flip rate < 0.5
    # sigmoid (DPO) | robust (rDPO) | hinge (SLiC) | ipo (length-normalised, as TRL): see dpo_loss
    loss_type: str = "sigmoid"
    # RPO (Pang et al. 2024; TRL's rpo_alpha): + α · per-token NLL of the chosen responses, which
    # keeps DPO from lowering the likelihood of the right answers along with the wrong ones.
    rpo_alpha: float = 0.0
    precompute_ref: bool = True  # score every pair under π_ref once instead of every step

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("loss_type", self.loss_type, DPO_LOSS_TYPES)
        if self.loss_type == "robust" and not self.label_smoothing < 0.5:
            raise ConfigError(f"robust DPO needs label_smoothing < 0.5, got {self.label_smoothing}")
        if not 0 <= self.label_smoothing <= 1 or self.rpo_alpha < 0:
            raise ConfigError(f"need 0 <= label_smoothing <= 1 and rpo_alpha >= 0, got "
                              f"{self.label_smoothing}, {self.rpo_alpha}")  # fmt: skip


def completion_logprob_sums(model, batch: dict[str, Tensor]) -> Tensor:
    """Σ log p(token) over completion tokens for every row of a right-padded batch -> [rows]:
    the model's forward to its last hidden states, then the chunked LM head (`lm_token_stats`:
    the [rows, T, vocab] logits are never built; ignored labels count 0)."""
    # Right padding never changes the real tokens' logits under causal attention: no mask needed.
    return lm_token_stats(model, batch["input_ids"], batch["labels"]).logp.sum(-1)


class PreferenceTrainer(AlignTrainer, abc.ABC):
    """Pairwise preference training: the pairs (chosen rows then rejected rows, one [2B, T]
    batch), metrics, evaluation and export that DPO and the reference-free ORPO / SimPO share. A
    subclass gives `pair_loss(batch) -> (loss, r⁺, r⁻)`; `setup_reference` is DPO's hook."""

    curves = [("train", "loss"), ("eval", "loss"), ("train", "accuracy"), ("eval", "accuracy"),
              ("train", "margin"), ("eval", "margin")]  # fmt: skip
    collate_rows = staticmethod(D.collate_preferences)  # chosen rows, then rejected: [2B, T]

    def setup(self) -> None:
        cfg = self.cfg
        self.load_examples(pair_loader(self))
        self.setup_reference()  # before PEFT wraps the policy: π_ref is the starting model
        apply_peft(self.lm.model, cfg.peft)

    def setup_reference(self) -> None:
        """Build what scores the pairs under a reference model (none here)."""

    def eval_batch(self, start: int, stop: int) -> dict[str, Tensor]:
        """The held-out pairs start..stop as one batch."""
        return self.collate(self.eval_examples[start:stop])

    @abc.abstractmethod
    def pair_loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """(loss, chosen rewards, rejected rewards) of a batch of pairs."""

    def loss(self, batch):
        loss, rc, rr = self.pair_loss(batch)
        stats = {"accuracy": preference_accuracy(rc, rr).item(), "margin": (rc - rr).mean().item()}
        stats.update(reward_chosen=rc.mean().item(), reward_rejected=rr.mean().item())
        return self.with_replay(loss, stats)  # PPO-ptx: + replay_coef x LM loss on pretraining

    def evaluate(self) -> dict[str, float]:
        """Held-out loss, implicit-reward preference accuracy and reward margin."""
        losses, pairs = [], []  # per batch: loss x pairs, (chosen rewards, rejected rewards)
        for i in range(0, len(self.eval_examples), 64):
            loss, rc, rr = self.pair_loss(self.eval_batch(i, i + 64))
            losses.append(loss.item() * len(rc))
            pairs.append((rc, rr))
        rc, rr = (torch.cat(side) for side in zip(*pairs))
        return {"loss": sum(losses) / len(rc), "accuracy": preference_accuracy(rc, rr).item(),
                "margin": (rc - rr).mean().item()}  # fmt: skip


class DPOTrainer(PreferenceTrainer):
    """DPO against the starting policy π_ref (how it is kept: `setup_reference`)."""

    name = "dpo"

    def setup(self) -> None:
        super().setup()
        self.eval_records = generation_records(self.cfg)

    def evaluate(self) -> dict[str, float]:
        return {**super().evaluate(), **greedy_eval(self)}

    def setup_reference(self) -> None:
        """Runs before PEFT wraps the policy, which is then still π_ref: it scores the held-out
        pairs (and every training pair with precompute_ref) itself. A per-step reference is a
        frozen copy, or for LoRA the policy with its adapters switched off (no second copy of
        the weights, as TRL with a PEFT model; not under FSDP, whose shards the reference
        forward outside the loss would not see whole)."""
        cfg = self.cfg
        lora_off = cfg.peft.method == "lora" and not self.dist.shards_parameters
        self.ref = None if cfg.precompute_ref or lora_off else frozen_copy(self.lm.model)
        score = self.reference_logprobs
        self.ref_train = self.score_rows(self.train_examples, score) if cfg.precompute_ref else None
        self.ref_eval = self.score_rows(self.eval_examples, score)

    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """π_ref for the body, in eval mode: the frozen copy, else the policy with its LoRA
        adapters off (before PEFT: the policy itself)."""
        if self.ref is not None:
            yield self.ref
            return
        with eval_mode(self.lm.model), adapters_disabled(self.lm.model) as model:
            yield model

    @torch.no_grad()
    def reference_logprobs(self, batch: dict[str, Tensor]) -> Tensor:
        """[pairs, 2] reference log-probs (chosen, rejected) of a collated batch."""
        with self.reference() as ref:
            return completion_logprob_sums(ref, batch).view(2, -1).T

    def batch(self, indices):
        b = super().batch(indices)
        b["ref"] = self.reference_logprobs(b) if self.ref_train is None else self.ref_train[indices]
        return b

    def eval_batch(self, start, stop):
        return {**super().eval_batch(start, stop), "ref": self.ref_eval[start:stop]}

    def pair_loss(self, b):
        chosen, rejected = completion_logprob_sums(self.lm.model, b).chunk(2)
        # completion tokens per row (IPO divides each log-ratio by its completion's length)
        lengths = (b["labels"][:, 1:] != D.IGNORE).sum(-1)
        loss, rc, rr = dpo_loss(chosen, rejected, *b["ref"].T, self.cfg.beta,
                                self.cfg.label_smoothing, self.cfg.loss_type,
                                *lengths.chunk(2))  # fmt: skip
        if self.cfg.rpo_alpha > 0:  # + α · mean NLL per chosen completion token
            n_chosen = lengths[: len(chosen)].sum().clamp(min=1)
            loss = loss - self.cfg.rpo_alpha * chosen.sum() / n_chosen
        return loss, rc, rr
