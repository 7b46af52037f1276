"""The registry of post-training methods: each `lmforge <verb>` and speedrun stage finds its config
and trainer class here (classes, not import paths, so readers and IDEs can follow them).

Adding a method is one line in METHODS: its config dataclass, its trainer class (an AlignTrainer
that supplies a loss and an evaluation), a one-line help and example overrides for `--help`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.align.continual import ContinualConfig, ContinualTrainer
from lmforge.align.dpo import DPOConfig, DPOTrainer
from lmforge.align.grpo import GRPOConfig, GRPOTrainer
from lmforge.align.kto import KTOConfig, KTOTrainer
from lmforge.align.ppo import PPOConfig, PPOTrainer
from lmforge.align.reference_free import ORPOConfig, ORPOTrainer, SimPOConfig, SimPOTrainer
from lmforge.align.reward import RewardConfig, RewardTrainer
from lmforge.align.rsft import RSFTConfig, RSFTTrainer
from lmforge.align.sft import SFTConfig, SFTTrainer
from lmforge.align.trainer import AlignConfig, AlignTrainer


@dataclass(frozen=True)
class Method:
    """One post-training method: how to configure it, what trains it, how `--help` shows it."""

    config: type[AlignConfig]
    trainer: type[AlignTrainer]
    help: str
    example: str  # `--key value` overrides shown in the verb's description


METHODS: dict[str, Method] = {
    "sft": Method(SFTConfig, SFTTrainer, "supervised fine-tuning (response-only loss, packing)",
                  "--init out/pretrain --data task:add --max_iters 300"),
    "lora": Method(SFTConfig, SFTTrainer, "LoRA / QLoRA / bottleneck-adapter fine-tuning",
                   "--init out/sft --data task:add --r 16 --targets qkv_proj,o_proj"),
    "reward": Method(RewardConfig, RewardTrainer, "train a reward model on preference pairs",
                     "--init out/sft --data pairs.jsonl --max_iters 300"),
    "dpo": Method(DPOConfig, DPOTrainer,
                  "direct preference optimisation against a frozen reference",
                  "--init out/sft --data pairs.jsonl --beta 0.1"),
    "kto": Method(KTOConfig, KTOTrainer, "KTO: unpaired good/bad completions against a reference",
                  "--init out/sft --data labelled.jsonl --desirable_weight 1.0"),
    "orpo": Method(ORPOConfig, ORPOTrainer, "ORPO: SFT + odds-ratio preference, no reference",
                   "--init out/pretrain --data pairs.jsonl --beta 0.1"),
    "simpo": Method(SimPOConfig, SimPOTrainer,
                    "SimPO / CPO (loss_type simpo|sigmoid|hinge|ipo): no reference model",
                    "--init out/sft --data pairs.jsonl --beta 2.0 --simpo_gamma 0.5"),
    "continual": Method(ContinualConfig, ContinualTrainer,
                        "learn a new task with L2 / EWC / replay against forgetting",
                        "--init out/sft --data task:sub --old_data task:add --regularizer ewc"),
    "ppo": Method(PPOConfig, PPOTrainer,
                  "PPO (RLHF): policy + value head against a reward model, KL-shaped rewards, GAE",
                  "--init out/sft --reward out/reward --variant kl_loss --kl_target 0.5"),
    "grpo": Method(GRPOConfig, GRPOTrainer,
                   "GRPO / RL from verifiable rewards: group sampling, group-relative advantages",
                   "--init out/sft --data task:add:2 --group_size 8 --beta 0.04"),
    "rsft": Method(RSFTConfig, RSFTTrainer,
                   "rejection-sampling fine-tuning: sample N, keep the best, SFT on them, repeat",
                   "--init out/sft --select top_k --top_k 2 --max_iters 5"),
}  # fmt: skip
