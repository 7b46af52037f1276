"""`lmforge sft | lora | reward | dpo | kto | orpo | simpo | continual | ppo | grpo | rsft`:
post-training runs from YAML + `--key value` overrides, one verb per entry of METHODS (adding a
method is one line there: its config dataclass, its trainer class, an AlignTrainer that supplies
a loss and an evaluation, a one-line help and example overrides for `--help`).

Any config field can be overridden with `--key value` (model fields for `--init scratch` as
`--model.KEY value`). Data may be a JSONL file or a built-in task (task:add, task:arith:3,
task:reverse); RL prompts may also be GSM8K. The RL reward is 'verifier' (exact answer match) or
a reward-model directory from `lmforge reward`. `lora` adds LoRA/QLoRA/adapter flags to `sft`.
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

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
from lmforge.cli.main import add_run_parser, config_from_args


class Method(NamedTuple):
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


def register(sub) -> None:
    for name, method in METHODS.items():
        p = add_run_parser(
            sub, name, method.config.__name__, run, help=method.help, example=method.example,
            lead=f"{method.help[0].upper()}{method.help[1:]}. ",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )  # fmt: skip
        p.set_defaults(method=name)
        if name == "lora":
            p.add_argument("--r", type=int, help="LoRA rank (default 8)")
            p.add_argument("--alpha", type=float, help="LoRA alpha (default 16)")
            p.add_argument(
                "--targets",
                help="modules to adapt (default qkv_proj,o_proj; also up_proj,down_proj,gate_proj)",
            )  # fmt: skip
            p.add_argument("--qlora", action="store_true", help="NF4 4-bit frozen base (QLoRA)")
            p.add_argument(
                "--adapter", choices=["bottleneck"], help="bottleneck adapters, not LoRA"
            )


def lora_overrides(args) -> dict:
    """The config fields `lmforge lora`'s own flags stand for (`peft` unless the YAML sets it)."""
    from lmforge.fileio import load_yaml

    given = load_yaml(args.config) if args.config else {}
    flags = {"lora_r": args.r, "lora_alpha": args.alpha, "lora_targets": args.targets}
    flags = {k: v for k, v in flags.items() if v is not None}
    if args.adapter or args.qlora or "peft" not in given:
        flags["peft"] = "adapter" if args.adapter else "qlora" if args.qlora else "lora"
    if "out_dir" not in given:
        flags["out_dir"] = "out/lora"
    return flags


def run(args) -> int:
    method = METHODS[args.method]
    flags = lora_overrides(args) if args.method == "lora" else {}
    cfg = config_from_args(args, method.config, flags)
    result = method.trainer(cfg, resume=args.resume).run()
    shown = {k: v for k, v in result.items() if isinstance(v, float)}
    print("\nfinal: " + "  ".join(f"{k} {v:.4g}" for k, v in shown.items()))
    print(
        f"checkpoint: {cfg.out_dir}   metrics: {cfg.out_dir}/metrics.csv   plot: {result['plot']}"
    )
    return 0
