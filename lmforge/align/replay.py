"""Pretraining-text replay during post-training, so fine-tuning on a narrow task keeps language.

InstructGPT's PPO-ptx (Ouyang et al. 2022, eq. 2) adds γ · E_{x~D_pretrain}[log π(x)] to the RL
objective; the same term on any post-training loss is replay (or rehearsal) of the pretraining
distribution. Here it is one config section (`cfg.replay`) and one call in a trainer's `loss()`
(`AlignTrainer.with_replay`):

    loss = task_loss + replay_coef · next-token loss on `replay_batch_size` windows of
           `replay_block_size` tokens drawn from `replay_data`

For SFT this equals mixing pretraining windows into the batch with the plain LM loss, weighted
replay_coef against the response tokens; for DPO and GRPO it is PPO-ptx's term. `replay_data` is
a token shard written by `lmforge pretrain` (`OUT/data/train.bin`, with its meta.json: the ids
must come from the policy's tokenizer, which is checked against the shard's vocab_size) or any
text source `lmforge.data.read_documents` reads (file, folder, .jsonl, builtin:NAME), tokenized
with the policy's tokenizer. The windows of a step depend only on (seed, rank, step, call), so a
resumed run draws the same ones as an uninterrupted run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from lmforge.align.logprobs import lm_sft_loss
from lmforge.errors import ConfigError, DataError, require_positive_ints


@dataclass
class ReplayConfig:
    """The `cfg.replay` section of the post-training configs (SFT, DPO, GRPO)."""

    replay_data: str | None = None  # token shard (.bin beside meta.json) or text source; None off
    replay_coef: float = 1.0  # weight of the replayed next-token loss (used when replay_data set)
    replay_batch_size: int = 8  # windows per loss call
    replay_block_size: int = 128  # tokens per window (cut to the model's max_seq_len)
    replay_max_tokens: int = 4_000_000  # a text source: tokens kept after tokenizing

    def __post_init__(self) -> None:
        if self.replay_data in ("", "none"):
            self.replay_data = None
        if self.replay_coef < 0:
            raise ConfigError(f"replay_coef must be >= 0, got {self.replay_coef}")
        require_positive_ints(self, "replay_batch_size", "replay_block_size", "replay_max_tokens")
        shard = self.replay_data is not None and self.replay_data.endswith(".bin")
        if shard and not Path(self.replay_data).is_file():
            raise ConfigError(f"replay_data: token shard not found: {self.replay_data}")


def load_replay_tokens(source: str, tokenizer, max_tokens: int) -> np.ndarray:
    """The replay token stream: a pretraining shard as written, or a text source tokenized
    (documents joined by EOS, as pretraining joins them)."""
    if source.endswith(".bin"):
        from lmforge.data.shards import TokenShard

        shard = TokenShard.open(source)
        vocab = shard.meta.get("vocab_size")
        if vocab is not None and vocab != tokenizer.vocab_size:
            raise DataError(
                f"replay_data {source}: token ids for a vocabulary of {vocab}, the policy's "
                f"tokenizer has {tokenizer.vocab_size} (replay text of the model's own tokenizer)"
            )
        return np.asarray(shard.tokens[:max_tokens], dtype=np.int64)
    from lmforge.data import read_documents

    ids: list[int] = []
    for doc in read_documents(source):
        ids += tokenizer.encode(doc)
        if tokenizer.eos_id is not None:
            ids.append(tokenizer.eos_id)
        if len(ids) >= max_tokens:
            break
    return np.asarray(ids[:max_tokens], dtype=np.int64)


class Replay:
    """Draws windows of replay text and scores a model's next-token loss on them."""

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        block_size: int,
        seed: int,
        rank: int = 0,
        device: torch.device | str = "cpu",
        where: str = "replay_data",
    ):
        if len(tokens) < 2:
            raise DataError(f"{where}: fewer than 2 tokens to replay")
        block_size = min(block_size, len(tokens) - 1)
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens))
        self.batch_size, self.block_size = batch_size, block_size
        self.seed, self.rank, self.device = seed, rank, torch.device(device)
        self._step, self._call = -1, 0

    @classmethod
    def from_config(cls, cfg: ReplayConfig, trainer: Any) -> Replay:
        """The trainer's replay of `cfg.replay_data` (`AlignTrainer.with_replay` builds it)."""
        tokens = load_replay_tokens(cfg.replay_data, trainer.tokenizer, cfg.replay_max_tokens)
        block = min(cfg.replay_block_size, trainer.lm.config.max_seq_len)
        return cls(tokens, cfg.replay_batch_size, block, trainer.cfg.seed, trainer.dist.rank,
                   trainer.device, cfg.replay_data)  # fmt: skip

    def windows(self, step: int) -> Tensor:
        """[batch_size, block_size] token windows for `step`; a second call within the same
        step (several optimizer steps per rollout) draws fresh ones."""
        self._call = self._call + 1 if step == self._step else 0
        self._step = step
        key = ((self.seed * 1_000_003 + self.rank) * 1_000_003 + step) * 1_009 + self._call
        gen = torch.Generator().manual_seed(key % (2**63))
        starts = torch.randint(0, len(self.tokens) - self.block_size + 1, (self.batch_size,),
                               generator=gen)  # fmt: skip
        rows = [self.tokens[s : s + self.block_size] for s in starts.tolist()]
        return torch.stack(rows).to(self.device)

    def loss(self, model: nn.Module, step: int) -> Tensor:
        """Mean next-token cross-entropy of `model` on this step's windows."""
        ids = self.windows(step)
        return lm_sft_loss(model, ids, ids)
