"""`lmforge sft | lora | reward | dpo | continual`: post-training runs from YAML + overrides.

Each subcommand maps to a trainer in lmforge.align; any config field can be overridden with
`--key value` (model fields for `--init scratch` as `--model.KEY value`).
"""

from __future__ import annotations

import argparse

from lmforge.train.config import build_config, parse_overrides

# subcommand -> (module, config class, trainer class, one-line help)
TRAINERS = {
    "sft": ("lmforge.align.sft", "SFTConfig", "SFTTrainer",
            "supervised fine-tuning (response-only loss, packing)"),
    "lora": ("lmforge.align.sft", "SFTConfig", "SFTTrainer",
             "LoRA / QLoRA / bottleneck-adapter fine-tuning"),
    "reward": ("lmforge.align.reward", "RewardConfig", "RewardTrainer",
               "train a reward model on preference pairs"),
    "dpo": ("lmforge.align.dpo", "DPOConfig", "DPOTrainer",
            "direct preference optimisation against a frozen reference"),
    "continual": ("lmforge.align.continual", "ContinualConfig", "ContinualTrainer",
                  "learn a new task with L2 / EWC / replay against forgetting"),
}  # fmt: skip


def register(sub) -> None:
    for name, (_, cfg_name, _, help_text) in TRAINERS.items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=f"{help_text[0].upper()}{help_text[1:]}. Every {cfg_name} field can be "
            "overridden with --key value, e.g. --init out/sft --data pairs.jsonl --max_iters 300; "
            "data may be a JSONL file or a built-in task (task:add, task:arith:3, task:reverse).",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("--config", help=f"YAML file of {cfg_name} fields (optional)")
        p.add_argument("--resume", action="store_true", help="continue from out_dir's state")
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
        p.set_defaults(func=run, accepts_overrides=True, trainer=name)


def run(args) -> int:
    import importlib

    module_name, cfg_name, trainer_name, _ = TRAINERS[args.trainer]
    module = importlib.import_module(module_name)
    overrides = parse_overrides(args.overrides)
    if args.trainer == "lora":
        from lmforge.fileio import load_yaml

        given = load_yaml(args.config) if args.config else {}
        flags = {"lora_r": args.r, "lora_alpha": args.alpha, "lora_targets": args.targets}
        flags = {k: v for k, v in flags.items() if v is not None}
        if args.adapter or args.qlora or "peft" not in given:
            flags["peft"] = "adapter" if args.adapter else "qlora" if args.qlora else "lora"
        if "out_dir" not in given:
            flags["out_dir"] = "out/lora"
        overrides = {**flags, **overrides}
    cfg = build_config(getattr(module, cfg_name), args.config, overrides)
    args.out_dir = cfg.out_dir  # named if a write there fails without a file name
    return train_and_report(getattr(module, trainer_name), cfg, args.resume)


def train_and_report(trainer_cls, cfg, resume: bool) -> int:
    """Run a post-training trainer, then print its final numbers and where its outputs are."""
    result = trainer_cls(cfg, resume=resume).run()
    shown = {k: v for k, v in result.items() if isinstance(v, float)}
    print("\nfinal: " + "  ".join(f"{k} {v:.4g}" for k, v in shown.items()))
    print(
        f"checkpoint: {cfg.out_dir}   metrics: {cfg.out_dir}/metrics.csv   plot: {result['plot']}"
    )
    return 0
