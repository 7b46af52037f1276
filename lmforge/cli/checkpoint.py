"""`lmforge checkpoint`: tools for the sharded training state that runs under torchrun write
(per-rank safetensors + JSON, lmforge/train/sharded_checkpoint.py); `consolidate` turns it into one
model.safetensors. Reading a checkpoint runs no code from it: the old torch.distributed.checkpoint
format, whose metadata is a pickle, is refused with one line."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("checkpoint", help="inspect or consolidate sharded (multi-process) "
                       "checkpoints", description="Tools for the sharded checkpoints written by "
                       "runs under torchrun.")  # fmt: skip
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    c = actions.add_parser("consolidate", help="merge a sharded checkpoint into one "
                           "model.safetensors (HF layout)", description="Read the latest sharded "
                           "checkpoint of DIR (a run's out_dir, its checkpoints/ folder or one "
                           "step_* folder) in one process, on any machine, and write config.json "
                           "+ model.safetensors (+ the run's tokenizer) for LM.load / lmforge "
                           "generate.")  # fmt: skip
    c.add_argument("dir", metavar="DIR", help="run out_dir, checkpoints/ folder or step_* folder")
    c.add_argument("--out", help="output directory (default: the run's out_dir)")
    c.set_defaults(func=run_consolidate)


def run_consolidate(args) -> int:
    from lmforge.train.sharded_checkpoint import consolidate as consolidate_checkpoint

    path = consolidate_checkpoint(args.dir, args.out)
    print(f"wrote {path}")
    return 0
