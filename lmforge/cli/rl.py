"""`lmforge ppo | grpo | rsft`: RL post-training runs from YAML + `--key value` overrides.

Each subcommand maps to a trainer in lmforge.align: PPO against a reward model (or verifier),
GRPO against a verifier, and rejection-sampling fine-tuning. Prompts come from a JSONL file
({"prompt", "answer"} or GSM8K) or a built-in task (task:add:2, task:arith:3, task:reverse).
"""

from __future__ import annotations

import argparse

from lmforge.train.config import build_config, parse_overrides

# subcommand -> (module, config class, trainer class, one-line help, example overrides)
TRAINERS = {
    "ppo": ("lmforge.align.ppo", "PPOConfig", "PPOTrainer",
            "PPO (RLHF): policy + value head against a reward model, KL-shaped rewards, GAE",
            "--init out/sft --reward out/reward --variant kl_loss --kl_target 0.5"),
    "grpo": ("lmforge.align.grpo", "GRPOConfig", "GRPOTrainer",
             "GRPO / RL from verifiable rewards: group sampling, group-relative advantages",
             "--init out/sft --data task:add:2 --group_size 8 --beta 0.04"),
    "rsft": ("lmforge.align.rsft", "RSFTConfig", "RSFTTrainer",
             "rejection-sampling fine-tuning: sample N, keep the best, SFT on them, repeat",
             "--init out/sft --select top_k --top_k 2 --max_iters 5"),
}  # fmt: skip


def register(sub) -> None:
    for name, (_, cfg_name, _, help_text, example) in TRAINERS.items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=f"{help_text[0].upper()}{help_text[1:]}. Every {cfg_name} field can be "
            f"overridden with --key value, e.g. {example}. The reward is 'verifier' (exact answer "
            "match) or a reward-model directory from `lmforge reward`.",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("--config", help=f"YAML file of {cfg_name} fields (optional)")
        p.add_argument("--resume", action="store_true", help="continue from out_dir's state")
        p.set_defaults(func=run, accepts_overrides=True, trainer=name)


def run(args) -> int:
    import importlib

    module_name, cfg_name, trainer_name, _, _ = TRAINERS[args.trainer]
    module = importlib.import_module(module_name)
    from lmforge.cli.align import train_and_report

    cfg = build_config(getattr(module, cfg_name), args.config, parse_overrides(args.overrides))
    args.out_dir = cfg.out_dir  # named if a write there fails without a file name
    return train_and_report(getattr(module, trainer_name), cfg, args.resume)
