"""The speedrun's common yardstick: every model the pipeline made, measured the same way.

Each stage's trainer reports its own metric (val loss, pair accuracy, ...), but those are not
comparable across stages. Here every checkpoint gets the same numbers, so the report can show
what each stage added:

  perplexity   on the pretraining corpus' held-out tokens (did fine-tuning cost language?)
  bpb          bits per byte on those same tokens (comparable across tokenizers)
  accuracy     greedy exact match on held-out task problems (tasks.verify)
  reward       the trained reward model's mean score of the greedy answers to those problems
  kl           mean per-completion KL(π ‖ π_sft) of sampled answers (how far alignment moved)
  core         CORE (lmforge/eval/core.py) on a few fast tasks, when their files are on disk
  chatcore     with `chat_tasks`, ChatCORE (lmforge/eval/chat_eval.py: ARC letters, GSM8K pass@1
               with its lenient answer rule) and each task's accuracy, beside accuracy

and greedy replies to a fixed set of chat prompts (`chat_samples`), shown in the report.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lmforge.align import data as D
from lmforge.align.rollout import ModelReward, RolloutEngine
from lmforge.align.sft import greedy_accuracy
from lmforge.data.shards import TokenShard
from lmforge.errors import DataError
from lmforge.eval.perplexity import PerplexityResult, perplexity
from lmforge.lm import LM

if TYPE_CHECKING:
    from lmforge.eval.core import CoreTask


def heldout_perplexity(lm: LM, val_bin: Path, n_tokens: int) -> PerplexityResult:
    """Perplexity and bits per byte on the first `n_tokens` of the pretraining validation shard
    (bytes counted over exactly the scored tokens, by the model's tokenizer)."""
    ids = TokenShard.open(val_bin).tokens[:n_tokens].tolist()
    return perplexity(lm.model, ids, lm.tokenizer.token_byte_lengths())


def find_core_data(setting: str | None) -> Path | None:
    """The folder of CORE task files for plan `eval.core_data`: a path, None/"none" (off), or
    "auto": ../shared/data/core beside the working directory or beside the lmforge checkout,
    else lmforge's cache folder when it holds them. Never downloads (the speedrun runs offline)."""
    if setting in (None, "none"):
        return None
    if setting != "auto":
        return Path(setting)
    from lmforge.eval.core import default_data_dir

    checkout = Path(__file__).resolve().parents[2]
    for folder in (Path.cwd().parent / "shared" / "data" / "core",
                   checkout.parent / "shared" / "data" / "core", default_data_dir()):  # fmt: skip
        if folder.is_dir() and any(folder.glob("*.jsonl")):
            return folder
    return None


def core_tasks_in(folder: Path, tasks: str) -> list[CoreTask]:
    """The CORE tasks named in `tasks` (comma-separated labels), each of whose file must be in
    `folder`: a CORE figure is a mean over its task list, so a missing one is an error, never
    left out (which would report a different mean under the same name)."""
    from lmforge.eval.core import select_tasks

    chosen = select_tasks(tasks)
    if missing := [t.file for t in chosen if not (folder / t.file).is_file()]:
        raise DataError(f"{folder}: no CORE task file {', '.join(missing)} (named in {tasks!r})")
    return chosen


@torch.no_grad()
def chat_samples(lm: LM, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy replies to user turns, rendered with the model's chat template as SFT trains."""
    tok = lm.tokenizer
    ids = [D.prompt_ids({"prompt": [{"role": "user", "content": p}]}, tok) for p in prompts]
    outs = lm.generate(ids, max_new_tokens=max_new_tokens, temperature=0.0)
    return [tok.decode(o, skip_special_tokens=True).strip() for o in outs]


@torch.no_grad()
def mean_reward(lm: LM, records: list[dict], rm, max_new_tokens: int) -> float:
    """The reward model's mean score of the policy's greedy answers to `records`."""
    engine = RolloutEngine(lm.model, lm.tokenizer, max_new_tokens, 1.0)
    score = ModelReward(rm)
    prompts = [D.prompt_ids(r, lm.tokenizer) for r in records]
    scores = [
        score(engine.sample(prompts[i : i + 128], records[i : i + 128], greedy=True))
        for i in range(0, len(prompts), 128)
    ]
    return torch.cat(scores).mean().item()


@torch.no_grad()
def kl_to_reference(
    lm: LM, reference: LM, records: list[dict], max_new_tokens: int, seed: int = 0
) -> float:
    """Monte-Carlo KL(π ‖ π_ref): mean over sampled completions of Σ_t log π - log π_ref."""
    engine = RolloutEngine(lm.model, lm.tokenizer, max_new_tokens, 1.0, reference=reference.model)
    prompts = [D.prompt_ids(r, lm.tokenizer) for r in records]
    rollout = engine.sample(prompts, records, seed=seed, keep_logprobs=True)
    per_sample = ((rollout.old_logprobs - rollout.ref_logprobs) * rollout.completion_mask).sum(-1)
    return per_sample.mean().item()


def evaluate_models(
    ctx, models: dict[str, Path]
) -> tuple[dict[str, dict[str, float]], dict[str, list[dict[str, str]]]]:
    """({stage: {perplexity, bpb, accuracy, reward, kl, core, ...}}, {stage: greedy replies}) for
    each checkpoint in `models`, with the eval stage's RunContext `ctx` (stages.py; not imported:
    stages imports this module): its plan's `eval` settings, perplexity where pretraining left a
    validation shard, reward and KL where the reward and SFT stages ran, CORE where its task files
    are (core_data), ChatCORE with `chat_tasks`, and replies to settings["chat_prompts"]."""
    from lmforge.align.data import load_prompts
    from lmforge.align.reward import RewardModel
    from lmforge.eval.chat_eval import evaluate_chat, load_chat_data, select_chat_tasks
    from lmforge.eval.core import evaluate_core

    settings, device, log = ctx.plan["eval"], ctx.device, ctx.log
    records = load_prompts(ctx.task_source(), settings["n_problems"], seed=4242, split="test")
    val_bin = ctx.dir("pretrain") / "data" / "val.bin"
    core_data = find_core_data(settings.get("core_data", "auto"))
    if core_data is None and settings.get("core_data", "auto") == "auto":
        log("eval: no CORE task files (../shared/data/core or lmforge eval core's cache); "
            "CORE skipped")  # fmt: skip
    chat_data, per_task = None, settings.get("chat_per_task")
    if tasks := settings.get("chat_tasks"):  # ChatCORE's (ARC reads CORE's files)
        tasks = [t for t in select_chat_tasks(tasks) if core_data or t == "GSM8K"]
        chat_data = load_chat_data(tasks, core_data, settings["gsm8k"], per_task)
    reward_model, reference = ctx.done("reward"), ctx.done("sft")
    rm = RewardModel.load(reward_model, device=device)[0] if reward_model else None
    ref = LM.load(reference, device=device) if reference else None
    new_tokens = settings["max_new_tokens"]
    kl_records = records[: settings["kl_samples"]]
    out: dict[str, dict[str, float]] = {}
    samples: dict[str, list[dict[str, str]]] = {}
    for stage, path in models.items():
        lm = LM.load(path, device=device)
        lm.model.eval()
        row: dict[str, float] = {}
        if val_bin.is_file():
            heldout = heldout_perplexity(lm, val_bin, settings["ppl_tokens"])
            row["perplexity"], row["bpb"] = heldout.perplexity, heldout.bits_per_byte
        row["accuracy"] = greedy_accuracy(lm, records, new_tokens)
        if chat_data:  # ChatCORE's tasks; GSM8K's answer rule does not need SFT's format
            chat = evaluate_chat(lm, chat_data, new_tokens)
            row |= {k.lower(): v for k, v in chat.results.items()} | {"chatcore": chat.chatcore}
        if rm is not None:
            row["reward"] = mean_reward(lm, records, rm, new_tokens)
        if ref is not None:
            row["kl"] = kl_to_reference(lm, ref, kl_records, new_tokens)
        if core_data is not None:  # CORE: mean centered accuracy over the named tasks
            tasks = core_tasks_in(core_data, settings["core_tasks"])
            row["core"] = evaluate_core(lm, core_data, tasks, settings["core_per_task"]).core
        if prompts := settings.get("chat_prompts"):
            replies = chat_samples(lm, prompts, settings.get("sample_tokens", 48))
            samples[stage] = [{"prompt": p, "reply": r} for p, r in zip(prompts, replies)]
        if not all(math.isfinite(v) for v in row.values()):
            log(f"warning: {stage} has a non-finite metric: {row}")
        log("  " + f"{stage:<9}" + "  ".join(f"{k} {v:.4g}" for k, v in row.items()))
        out[stage] = row
    return out, samples
