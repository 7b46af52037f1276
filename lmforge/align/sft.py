"""Supervised fine-tuning: next-token loss on response tokens only, optionally packed, as full
fine-tuning or through a parameter-efficient method (`lmforge.peft`: LoRA, QLoRA, bottleneck
adapters; targets and saved files are described there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmforge.align import data as D
from lmforge.align.logprobs import lm_sft_loss
from lmforge.align.replay import ReplayConfig
from lmforge.align.trainer import AlignConfig, AlignTrainer, eval_source
from lmforge.errors import ConfigError
from lmforge.lm import LM
from lmforge.peft.config import PeftConfig, apply_peft
from lmforge.tasks.answers import verify
from lmforge.train.config import run_config, section


@dataclass
class GreedyEvalConfig:
    """The `cfg.greedy_eval` section: the periodic evaluation's greedy decoding of held-out
    prompts, scored by exact match."""

    eval_generate: int = 100  # held-out task:/file: prompts scored by greedy exact match
    max_new_tokens: int = 16


@run_config
class SFTConfig(AlignConfig):
    """An SFT run (`lmforge sft`; `lmforge lora` sets peft)."""

    out_dir: str = "out/sft"
    greedy_eval: GreedyEvalConfig = section(GreedyEvalConfig)
    replay: ReplayConfig = section(ReplayConfig)
    peft: PeftConfig = section(PeftConfig)
    packing: bool = False
    label_smoothing: float = 0.0


def generation_records(cfg) -> list[dict]:
    """The held-out prompt records a run's evaluation decodes (`eval_generate` of them; cfg an
    AlignConfig with a `greedy_eval` section): those of a task: or file: evaluation source,
    else none."""
    source, split = eval_source(cfg)
    if cfg.greedy_eval.eval_generate > 0 and str(source).startswith(("task:", "file:")):
        return D.load_prompts(source, cfg.greedy_eval.eval_generate, cfg.seed + 1, split)
    return []


def greedy_eval(trainer: AlignTrainer) -> dict[str, float]:
    """{"exact_match": `greedy_accuracy`} on the trainer's `eval_records`, {} without them."""
    if not trainer.eval_records:
        return {}
    cfg = trainer.cfg
    hits = greedy_accuracy(
        trainer.lm, trainer.eval_records, cfg.greedy_eval.max_new_tokens, cfg.add_bos
    )
    return {"exact_match": hits}


@torch.no_grad()
def greedy_accuracy(
    lm: LM, records: list[dict], max_new_tokens: int = 16, add_bos: bool = False, batch: int = 128
) -> float:
    """Fraction of records whose greedy completion passes `lmforge.tasks.answers.verify`."""
    if not records:
        return 0.0
    tok, hits = lm.tokenizer, 0.0
    for i in range(0, len(records), batch):
        chunk = records[i : i + batch]
        prompts = [D.prompt_ids(r, tok, add_bos) for r in chunk]
        outs = lm.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0)
        texts = tok.decode_batch(outs, skip_special_tokens=True)
        hits += sum(verify(r, text) for r, text in zip(chunk, texts))
    return hits / len(records)


class SFTTrainer(AlignTrainer):
    """Response-only next-token training (full or PEFT) with held-out loss and exact match."""

    name = "sft"
    curves = [("train", "loss"), ("eval", "loss"), ("eval", "exact_match")]

    def setup(self) -> None:
        cfg: SFTConfig = self.cfg
        if cfg.max_len > self.lm.config.max_seq_len:
            raise ConfigError(
                f"max_len={cfg.max_len} exceeds max_seq_len={self.lm.config.max_seq_len}"
            )
        self.load_examples(D.load_sft)
        if cfg.packing:
            self.train_examples = D.pack_sft(self.train_examples, cfg.max_len)
        self.eval_records = generation_records(cfg)
        self.peft_names = apply_peft(self.lm.model, cfg.peft)

    def loss(self, batch):
        # Right padding: causal attention never lets a real token see the padding after it,
        # so no attention mask is needed (and SDPA keeps its fast causal path).
        loss = lm_sft_loss(self.lm.model, batch["input_ids"], batch["labels"],
                           label_smoothing=self.cfg.label_smoothing)  # fmt: skip
        return self.with_replay(loss, {})  # + replay_coef x LM loss on pretraining text

    def loss_weight(self, batch) -> float:
        """Response tokens: the loss is a mean over them (see AlignTrainer.loss_weight)."""
        return float((batch["labels"][:, 1:] != D.IGNORE).sum())

    def eval_loss(self, examples: list[D.SFTExample]) -> float:
        """Mean response-token loss over examples (token-weighted)."""
        total, count = 0.0, 0
        for i in range(0, len(examples), self.cfg.batch_size):
            b = self.collate(examples[i : i + self.cfg.batch_size])
            n = self.loss_weight(b)
            total += lm_sft_loss(self.lm.model, b["input_ids"], b["labels"]).item() * n
            count += n
        return total / max(1, count)

    def evaluate(self) -> dict[str, float]:
        return {"loss": self.eval_loss(self.eval_examples), **greedy_eval(self)}
