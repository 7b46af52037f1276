"""Reward models: a transformer backbone, its final norm and a scalar head on one pooled vector.

Pooling picks the vector that sums up a sequence: `last` (the last non-PAD token — the usual
choice, it has read everything), `mean` (average over real tokens), `eos` (the last EOS token,
falling back to the last real token) or `match`: the mean over positions of h[t-1] * w[y[t]], the
elementwise terms of the logit the backbone's own LM head gave each actual next token (w = its
output row). `match` lets the head read how well a text agrees with the model's predictions; it
matters where correctness is a token-level fact the backbone already predicts: on near-miss
pairs (off by 1, 2 or 10, swapped digits) a last-token head must grow a new circuit to compare
each digit with the prediction made one position earlier, and learns far more slowly. The
attention mask drives positions as well as attention, so left- and right-padded batches give
the same rewards.

Losses (Ouyang et al. 2022; TRL's RewardTrainer): Bradley–Terry -log σ(r⁺ - r⁻), hinge max(0, m -
Δ), MSE to a target gap, and K-way listwise (softmax CE; with pairs, K = 2). `lm_weight` adds the
next-token loss on chosen responses: a full fine-tune on a 1-bit preference signal otherwise erases
what the backbone knew (held-out exact match of the add:2 SFT model fell from ~90% to 0% at lr
1e-3).

Pairs come from `pairs_from`: `data` (the preference file, or a task's canned near misses) or
`policy`: InstructGPT's recipe, where labellers compare the policy's own outputs. For each prompt
of `data` the starting model (`init`, i.e. the policy PPO will start from) samples
`pair_samples` completions; the verifier labels them and a correct one is paired with a wrong one.
The reward model then learns to rank exactly the samples PPO will show it, token for token (the
pairs keep the sampled ids, stop token included, so nothing is re-tokenised). Canned pairs give
an RM whose score on the policy's own samples barely separates right from wrong within a prompt,
so PPO cannot raise it; on-policy pairs fix that (configs/align/reward_onpolicy.yaml,
benchmarks/rl_targets.py).

Saved as an HF-layout backbone (config.json, model.safetensors, tokenizer) plus
`reward_head.safetensors` and `reward_config.json`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from lmforge.align import data as D
from lmforge.align.logprobs import head_token_stats, last_index, lm_head_fn, nll_from_stats
from lmforge.align.preference_losses import (
    bradley_terry_loss,
    hinge_loss,
    listwise_loss,
    mse_gap_loss,
    preference_accuracy,
    reward_centering,
)
from lmforge.align.rollout import RolloutEngine
from lmforge.align.trainer import AlignConfig, AlignTrainer
from lmforge.errors import ConfigError, DataError, require_choice
from lmforge.fileio import load_tensors, read_json, save_tensors, write_json, write_text
from lmforge.lm import LM
from lmforge.model.transformer import Transformer
from lmforge.tasks.answers import verify
from lmforge.train.config import run_config, section

HEAD_FILE, CONFIG_FILE = "reward_head.safetensors", "reward_config.json"


# A pooling maps (final-norm hidden states [B, T, d], mask [B, T], ids [B, T], the RewardModel)
# to one vector per row; it may read the model's eos_id or backbone.


def pool_last(h: Tensor, mask: Tensor, ids: Tensor, rm) -> Tensor:
    return h[torch.arange(h.shape[0], device=h.device), last_index(mask)]


def pool_mean(h: Tensor, mask: Tensor, ids: Tensor, rm) -> Tensor:
    m = mask.to(h.dtype).unsqueeze(-1)
    return (h * m).sum(1) / m.sum(1).clamp(min=1)


def pool_eos(h: Tensor, mask: Tensor, ids: Tensor, rm) -> Tensor:
    eos_id = rm.eos_id
    is_eos = (ids == eos_id) & mask.bool() if eos_id is not None else torch.zeros_like(mask.bool())
    index = torch.where(is_eos.any(-1), last_index(is_eos), last_index(mask))
    return h[torch.arange(h.shape[0], device=h.device), index]


def pool_match(h: Tensor, mask: Tensor, ids: Tensor, rm) -> Tensor:
    """Mean over real (t-1, t) position pairs of h[t-1] * w[y[t]] * scale: summed over d, each
    term is the logit the backbone gave the token that actually came next."""
    backbone = rm.backbone
    terms = h[:, :-1] * backbone.lm_head.weight[ids[:, 1:]] * backbone.output_scale
    m = (mask[:, 1:] * mask[:, :-1]).to(h.dtype).unsqueeze(-1)  # both positions real
    return (terms * m).sum(1) / m.sum(1).clamp(min=1)


POOLING = {"last": pool_last, "mean": pool_mean, "eos": pool_eos, "match": pool_match}


class RewardModel(nn.Module):
    """Transformer backbone -> final norm -> pooled vector -> Linear(d_model, 1): one reward."""

    def __init__(self, backbone: Transformer, pooling: str = "last", eos_id: int | None = None):
        super().__init__()
        require_choice("pooling", pooling, POOLING)
        self.backbone, self.pooling, self.eos_id = backbone, pooling, eos_id
        self.head = nn.Linear(backbone.config.d_model, 1)
        nn.init.normal_(self.head.weight, std=1.0 / (backbone.config.d_model + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Rewards [B] for token ids [B, T] (attention_mask 1 = real token, 0 = padding)."""
        return self.rewards_and_hidden(input_ids, attention_mask)[0]

    def rewards_and_hidden(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(rewards [B], the backbone's final-normed hidden states [B, T, d]) from one pass; the
        hidden states feed the backbone's LM head for the optional language-modelling loss."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        h = self.backbone.norm(self.backbone.hidden_states(input_ids, attention_mask))
        pooled = POOLING[self.pooling](h, attention_mask, input_ids, self)
        return self.head(pooled).squeeze(-1).float(), h

    def save(self, path: str | Path, tokenizer=None) -> None:
        LM(self.backbone, tokenizer).save(path)
        save_tensors(Path(path) / HEAD_FILE, dict(self.head.state_dict()))
        write_json(Path(path) / CONFIG_FILE, {"pooling": self.pooling, "eos_id": self.eos_id})

    @classmethod
    def load(cls, path: str | Path, device="cpu") -> tuple[RewardModel, object]:
        """(reward model, tokenizer) from a directory written by `save`."""
        meta = read_json(Path(path) / CONFIG_FILE, "reward model config")
        lm = LM.load(path, device=device)
        rm = cls(lm.model, meta.get("pooling", "last"), meta.get("eos_id"))
        rm.head.load_state_dict(load_tensors(Path(path) / HEAD_FILE, device))
        return rm.to(device).eval(), lm.tokenizer

    @torch.no_grad()
    def score(self, texts: list[str], tokenizer, batch: int = 64) -> Tensor:
        """Rewards for whole texts (prompt + response), EOS appended as in training."""
        out = []
        eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
        for i in range(0, len(texts), batch):
            rows = [ids + eos for ids in tokenizer.encode_batch(texts[i : i + batch])]
            b = D.collate_sft([D.SFTExample(r, r) for r in rows], pad)
            out.append(self(b["input_ids"].to(self.head.weight.device), b["attention_mask"]))
        return torch.cat(out)


# ----------------------------------------------------------------------------- preference sources


def policy_pairs(
    model: nn.Module,
    tokenizer,
    records: list[dict],
    samples: int = 8,
    pairs_per_prompt: int = 1,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    max_len: int = 64,
    seed: int = 0,
    add_bos: bool = False,
    judge: Callable[[dict, str], float] | None = None,
    rejected: str = "sample",
) -> tuple[D.Dataset, int]:
    """(on-policy preference pairs, prompts that gave none): `samples` completions per prompt
    from `model`, labelled by `judge` (default tasks.verify; > 0.5 = right); up to
    `pairs_per_prompt` (right, wrong) pairs of distinct completions per prompt; prompts whose
    samples are all right or all wrong give none. Examples hold the sampled token ids, so the
    reward model trains on exactly what it scores during PPO.

    `rejected="greedy"` targets what greedy decoding answers, the figure a task scores: the
    model's greedy completion is the rejected reply of every prompt where the verifier finds it
    wrong, paired with up to `pairs_per_prompt` distinct verified-correct samples or, where no
    sample is right, with the record's reference `answer` as a bare reply (its tokens and the
    end token, the form a right sample takes); a prompt whose greedy answer is right gives
    none. Sampled pairs can both be far from the argmax; these move it where it is wrong."""
    require_choice("rejected", rejected, PAIR_REJECTED)
    judge = judge or verify
    engine = RolloutEngine(model, tokenizer, max_new_tokens, temperature)
    out, unpaired = D.Dataset([]), 0
    for start in range(0, len(records), 64):  # 64 prompts per generation batch
        chunk = records[start : start + 64]
        prompts = [D.prompt_ids(r, tokenizer, add_bos) for r in chunk]
        sampled = engine.generate(prompts, samples, seed + start)
        texts = tokenizer.decode_batch(sampled, skip_special_tokens=True)
        if rejected == "greedy":
            greedy = engine.generate(prompts, 1, seed + start, greedy=True)
            greedy_texts = tokenizer.decode_batch(greedy, skip_special_tokens=True)
        for i, (record, prompt) in enumerate(zip(chunk, prompts)):
            right: dict[tuple, None] = {}  # distinct completions, in sampling order
            wrong: dict[tuple, None] = {}
            for row in range(i * samples, (i + 1) * samples):
                (right if judge(record, texts[row]) > 0.5 else wrong)[tuple(sampled[row])] = None
            if rejected == "greedy":
                wrong = {} if judge(record, greedy_texts[i]) > 0.5 else {tuple(greedy[i]): None}
                if wrong and not right and isinstance(record.get("answer"), str | int):
                    right[reference_reply(tokenizer, record["answer"])] = None
            if not right or not wrong:
                unpaired += 1
                continue
            right_ids, wrong_ids = list(right), list(wrong)
            for k in range(min(pairs_per_prompt, max(len(right_ids), len(wrong_ids)))):
                pair = [
                    D.SFTExample(
                        (prompt + list(c))[:max_len], ([D.IGNORE] * len(prompt) + list(c))[:max_len]
                    )
                    for c in (right_ids[k % len(right_ids)], wrong_ids[k % len(wrong_ids)])
                ]
                out.examples.append(D.PreferenceExample(*pair))
    if not out.examples:
        raise DataError(f"no on-policy pairs: all {len(records)} prompts had "
                        f"{PAIR_REJECTED[rejected]} ({samples} samples each); raise pair_samples "
                        "or pair_temperature")  # fmt: skip
    return out, unpaired


# policy_pairs' rejected replies (a wrong sample | the greedy answer where it is wrong), each with
# what a prompt that gives no pair had
PAIR_REJECTED = {
    "sample": "only right or only wrong samples",
    "greedy": "a right greedy answer, or no right sample and no reference answer",
}


def reference_reply(tokenizer, answer: str | int) -> tuple[int, ...]:
    """A reference answer as the token ids of a bare reply: its tokens and the end token."""
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    return tuple(tokenizer.encode(str(answer)) + eos)


REWARD_LOSSES: dict[str, Callable[..., Tensor]] = {
    "bt": lambda rc, rr, margin, gap: bradley_terry_loss(rc, rr),
    "hinge": lambda rc, rr, margin, gap: hinge_loss(rc, rr, margin),
    "mse": lambda rc, rr, margin, gap: mse_gap_loss(rc, rr, gap),
    # a pair is a 2-way list whose winner is the chosen response (index 0)
    "listwise": lambda rc, rr, margin, gap: listwise_loss(
        torch.stack([rc, rr], dim=1), torch.zeros_like(rc, dtype=torch.long)
    ),
}


@dataclass
class PairSourceConfig:
    """Where a pairwise trainer (`lmforge reward`, `lmforge dpo`) gets its preference pairs:
    `pairs_from: data` reads them from `data` (a preference file, or a task's canned near
    misses); `pairs_from: policy` samples `pair_samples` completions per prompt of `data` from the
    starting model (or `pair_policy`) and pairs a verifier-approved one with a rejected one, as
    InstructGPT's labellers compared the policy's own outputs and iterative RPO (Pang et al. 2024)
    builds DPO pairs from the model's correct and incorrect answers."""

    pairs_from: str = "data"  # data (pairs in `data`) | policy (verifier-labelled init samples)
    pair_policy: str | None = None  # pairs_from policy: checkpoint that samples (None = init)
    pair_samples: int = 8  # pairs_from policy: completions sampled per prompt
    pairs_per_prompt: int = 1  # pairs_from policy: at most this many (right, wrong) per prompt
    pair_temperature: float = 1.0  # pairs_from policy: sampling temperature (PPO's, usually)
    pair_max_new_tokens: int = 8  # pairs_from policy: completion length (PPO's max_new_tokens)
    # pairs_from policy: the rejected reply is a wrong `sample`, or the model's `greedy` answer
    # where it is wrong (chosen: a right sample, else the reference answer; see policy_pairs)
    pairs_rejected: str = "sample"

    def __post_init__(self) -> None:
        require_choice("pairs_from", self.pairs_from, PAIR_SOURCES)
        require_choice("pairs_rejected", self.pairs_rejected, PAIR_REJECTED)
        if self.pair_samples < 2 or self.pairs_per_prompt < 1 or self.pair_temperature <= 0:
            raise ConfigError("pair_samples must be >= 2, pairs_per_prompt >= 1, temperature > 0")


@run_config(optim=dict(lr=3e-4))
class RewardConfig(AlignConfig):
    """A reward-model run on preference pairs (`lmforge reward`): `data` is JSONL
    (prompt/chosen/rejected or HH) or task:."""

    out_dir: str = "out/reward"
    pairs: PairSourceConfig = section(PairSourceConfig)
    pooling: str = "last"  # last | mean | eos | match
    loss: str = "bt"  # bt | hinge | mse | listwise
    margin: float = 1.0  # hinge margin
    target_gap: float = 1.0  # mse target reward gap
    lm_weight: float = 0.0  # + lm_weight * next-token loss on chosen responses (keeps the skill)
    center_rewards: float = 0.0  # + c·mean((r⁺ + r⁻)²) (TRL's center_rewards_coefficient)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("loss", self.loss, REWARD_LOSSES)
        require_choice("pooling", self.pooling, POOLING)
        if self.center_rewards < 0:
            raise ConfigError(f"center_rewards must be >= 0, got {self.center_rewards}")


def pair_loader(trainer: AlignTrainer) -> Callable[..., D.Dataset]:
    """`AlignTrainer.load_examples`' loader of a pairwise trainer's preference pairs: those
    written in `data` (or a task's canned wrong answers), or with `pairs_from: policy` the
    starting model's verifier-labelled samples (`sampled_pairs`)."""
    pairs = getattr(trainer.cfg, "pairs", None)  # ORPO and SimPO read their pairs from data
    if pairs is not None and pairs.pairs_from == "policy":
        return functools.partial(sampled_pairs, trainer)
    return D.load_preferences


def sampled_pairs(trainer: AlignTrainer, source, tokenizer, max_len: int, skip_invalid=False,
                  add_bos=False, n=1000, seed=0, split="train") -> D.Dataset:  # fmt: skip
    """Verifier-labelled pairs of the starting model's own samples for the prompts of `source`
    (trainer.cfg.pairs says how); written as text to OUT_DIR/policy_pairs_train.jsonl (the
    training pairs) or policy_pairs_eval.jsonl (the held-out ones) as {"prompt": the rendered
    prompt, "chosen", "rejected"}, for a baseline to train on."""
    how = trainer.cfg.pairs
    records = D.load_prompts(source, n=n, seed=seed, split=split)
    policy = trainer.lm
    if how.pair_policy is not None:  # e.g. a weaker PPO start than the reward model's backbone
        policy = LM.load(how.pair_policy, device=trainer.device)
        if policy.tokenizer.backend.get_vocab() != tokenizer.backend.get_vocab():
            raise ConfigError(f"pair_policy {how.pair_policy} uses a different tokenizer from init")
    pairs, unpaired = policy_pairs(
        policy.model, tokenizer, records, how.pair_samples, how.pairs_per_prompt,
        how.pair_temperature, how.pair_max_new_tokens, max_len, seed, add_bos,
        rejected=how.pairs_rejected,
    )  # fmt: skip
    trainer.log(f"{split}: {len(pairs)} on-policy pairs from {len(records)} prompts "
                f"({unpaired} gave none: {PAIR_REJECTED[how.pairs_rejected]})")  # fmt: skip
    if trainer.dist.is_main:
        lines = [json.dumps(pair_text(p, tokenizer)) + "\n" for p in pairs.examples]
        role = "train" if split == "train" else "eval"
        write_text(Path(trainer.cfg.out_dir) / f"policy_pairs_{role}.jsonl", "".join(lines))
    return pairs


def pair_text(pair: D.PreferenceExample, tokenizer) -> dict[str, str]:
    """A pair of token ids as text: the prompt as rendered (special tokens kept), each reply
    without its stop token."""
    cut = pair.chosen.prompt_len
    return {"prompt": tokenizer.decode(pair.chosen.input_ids[:cut]),
            **{side: tokenizer.decode(getattr(pair, side).input_ids[cut:],
                                      skip_special_tokens=True)
               for side in ("chosen", "rejected")}}  # fmt: skip


PAIR_SOURCES = ("data", "policy")  # where `pair_loader` takes the pairs from


class RewardTrainer(AlignTrainer):
    """Train a RewardModel on (chosen, rejected) pairs; report held-out pair accuracy."""

    name = "reward"
    curves = [("train", "loss"), ("eval", "loss"), ("train", "accuracy"), ("eval", "accuracy")]
    collate_rows = staticmethod(D.collate_preferences)

    def setup(self) -> None:
        cfg: RewardConfig = self.cfg
        self.load_examples(pair_loader(self))
        self.rm = RewardModel(self.lm.model, cfg.pooling, self.tokenizer.eos_id).to(self.device)

    def trainable_module(self) -> nn.Module:
        return self.rm

    def loss(self, batch):
        r, hidden = self.rm.rewards_and_hidden(batch["input_ids"], batch["attention_mask"])
        rc, rr = r.chunk(2)
        loss = REWARD_LOSSES[self.cfg.loss](rc, rr, self.cfg.margin, self.cfg.target_gap)
        if self.cfg.center_rewards:
            loss = loss + self.cfg.center_rewards * reward_centering(rc, rr)
        stats = {"accuracy": preference_accuracy(rc, rr).item(), "margin": (rc - rr).mean().item()}
        if self.cfg.lm_weight > 0:  # next-token loss on the chosen responses, chunked head
            labels = batch["labels"][: len(rc), 1:]
            chosen = head_token_stats(lm_head_fn(self.rm.backbone), hidden[: len(rc), :-1], labels)
            lm_loss = nll_from_stats(chosen, labels != D.IGNORE)
            loss = loss + self.cfg.lm_weight * lm_loss
            stats["lm_loss"] = lm_loss.item()
        return loss, stats

    def evaluate(self) -> dict[str, float]:
        pairs = lambda b: self.rm(b["input_ids"], b["attention_mask"]).view(2, -1).T  # noqa: E731
        rc, rr = self.score_rows(self.eval_examples, pairs, self.cfg.batch_size).T
        loss = REWARD_LOSSES[self.cfg.loss](rc, rr, self.cfg.margin, self.cfg.target_gap)
        return {"loss": loss.item(), "accuracy": preference_accuracy(rc, rr).item()}

    def export(self, path: Path) -> None:
        self.rm.save(path, self.tokenizer)
