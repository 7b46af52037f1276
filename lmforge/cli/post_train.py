"""`lmforge sft | lora | reward | dpo | continual | ppo | grpo | rsft`: post-training runs from
YAML + `--key value` overrides, one verb per entry of lmforge.align.methods.METHODS.

Any config field can be overridden with `--key value` (model fields for `--init scratch` as
`--model.KEY value`). Data may be a JSONL file or a built-in task (task:add, task:arith:3,
task:reverse); RL prompts may also be GSM8K. The RL reward is 'verifier' (exact answer match) or
a reward-model directory from `lmforge reward`. `lora` adds LoRA/QLoRA/adapter flags to `sft`.
"""

from __future__ import annotations

import argparse

from lmforge.align.methods import METHODS
from lmforge.cli.main import add_run_parser, config_from_args


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
    from lmforge.train.config import parse_overrides

    method = METHODS[args.method]
    overrides = parse_overrides(args.overrides)
    if args.method == "lora":
        overrides = {**lora_overrides(args), **overrides}
    cfg = config_from_args(args, method.config, overrides)
    result = method.trainer(cfg, resume=args.resume).run()
    shown = {k: v for k, v in result.items() if isinstance(v, float)}
    print("\nfinal: " + "  ".join(f"{k} {v:.4g}" for k, v in shown.items()))
    print(
        f"checkpoint: {cfg.out_dir}   metrics: {cfg.out_dir}/metrics.csv   plot: {result['plot']}"
    )
    return 0
