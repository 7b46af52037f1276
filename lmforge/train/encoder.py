"""Encoder (BERT) pretraining: masked-language modelling, optionally with next-sentence prediction.

`lmforge pretrain --objective mlm` (or `mlm+nsp`) runs EncoderPretrainer. Documents are cut into
[CLS] ... [SEP] rows (or NSP sentence pairs [CLS] A [SEP] B [SEP]) once; every step draws a batch
and masks it afresh (15% of non-special tokens, 80/10/10; RoBERTa's dynamic masking), so the model
never sees the same corruption twice. The MLM head runs only on the selected positions: the loss
is defined there alone, and the other ~85% of vocabulary projections would be wasted work.
The result is a Hugging Face BERT directory (config.json, model.safetensors, tokenizer.json) that
`transformers.BertForMaskedLM.from_pretrained` and `lmforge.model.bert.load_bert` both load.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.data.batches import pad_collate
from lmforge.errors import (
    ConfigError,
    DataError,
    LMForgeError,
    require_choice,
    require_device,
    require_int,
    require_positive_ints,
)
from lmforge.fileio import read_json, save_tensors, write_json
from lmforge.model.bert import (
    BertConfig,
    BertForMaskedLM,
    BertForPreTraining,
    hf_name,
    make_nsp_pairs,
    mask_tokens,
)
from lmforge.tokenizer import Tokenizer
from lmforge.train.checkpoint import model_state
from lmforge.train.config import SmallRunConfig, require_fraction, run_config
from lmforge.train.loop import Trainer
from lmforge.train.parallel import Parallel
from lmforge.train.pretrain import build_tokenizer, train_tokenizer

# BERT's spellings; "pad" first so that [PAD] gets id 0, BERT's padding id.
BERT_SPECIAL_TOKENS = {
    "pad": "[PAD]",
    "unk": "[UNK]",
    "cls": "[CLS]",
    "sep": "[SEP]",
    "mask": "[MASK]",
}


@run_config(optim=dict(lr=5e-4, min_lr=5e-5, warmup_iters=50))
class EncoderTrainConfig(SmallRunConfig):
    """A BERT pretraining run. Defaults: a 2-layer encoder on the built-in Python docs."""

    out_dir: str = "out/bert"
    objective: str = "mlm"  # mlm | mlm+nsp
    data: str = "builtin:pydoc"  # any lmforge.data source
    text_field: str = "text"
    tokenizer: str = "bpe"  # bpe | word | char (trained here with BERT's tokens) or a path
    vocab_size: int = 4096
    val_fraction: float = 0.1
    model: dict[str, Any] = field(
        default_factory=lambda: {"d_model": 128, "n_layer": 2, "n_head": 4, "d_ff": 512}
    )  # BertConfig fields; vocab_size and max_position come from the tokenizer and block_size
    block_size: int = 64  # tokens per row, [CLS] and [SEP] included
    mask_prob: float = 0.15
    eval_iters: int = 10
    seed: int = 1337
    device: str = "auto"

    def __post_init__(self) -> None:
        require_choice("objective", self.objective, CURVES)
        super().__post_init__()
        require_positive_ints(self, "eval_iters")
        require_fraction(self, "mask_prob")
        require_fraction(self, "val_fraction")
        require_int("block_size", self.block_size, low=8)

    def bert_config(self, vocab_size: int, use_pooler: bool = True) -> BertConfig:
        """The model's BertConfig: `model:` fields plus vocabulary and positions from this run."""
        fields = {f.name for f in dataclasses.fields(BertConfig)}
        if unknown := sorted(set(self.model) - fields):
            raise ConfigError(f"model: unknown BertConfig field(s) {', '.join(unknown)}; "
                              f"valid: {', '.join(sorted(fields))}")  # fmt: skip
        kw = {"max_position": self.block_size, "use_pooler": use_pooler, **self.model}
        kw["vocab_size"] = vocab_size
        if kw["max_position"] < self.block_size:
            raise ConfigError(f"model.max_position={kw['max_position']} < block_size="
                              f"{self.block_size}")  # fmt: skip
        return BertConfig(**kw)


# ---- tokenizer and the HF directory ----------------------------------------------------------
def train_bert_tokenizer(texts, kind: str = "bpe", vocab_size: int = 4096) -> Tokenizer:
    """A tokenizer with BERT's special tokens whose tokenizer.json wraps inputs as HF's does."""
    from tokenizers.processors import TemplateProcessing

    tok = train_tokenizer(kind, texts, vocab_size, BERT_SPECIAL_TOKENS)
    ids = bert_token_ids(tok)
    # Only Hugging Face's encode adds these (ours passes add_special_tokens=False).
    tok.backend.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["cls"]), ("[SEP]", ids["sep"])],
    )  # fmt: skip
    return tok


def bert_token_ids(tok: Tokenizer) -> dict[str, int]:
    """Ids of [PAD] [UNK] [CLS] [SEP] [MASK], by role or by BERT's spelling; missing -> error."""
    ids = {
        role: tok.token_to_id(tok.special_tokens.get(role, default))
        for role, default in BERT_SPECIAL_TOKENS.items()
    }
    if missing := [BERT_SPECIAL_TOKENS[r] for r, i in ids.items() if i is None]:
        raise ConfigError(f"tokenizer lacks BERT special token(s) {', '.join(missing)}")
    return ids


def save_bert(
    model: nn.Module, tokenizer: Tokenizer | None, directory: str | Path, label_names=None
) -> Path:
    """Write a Hugging Face BERT directory: config.json, model.safetensors (HF tensor names,
    `bert.` prefix on the encoder), tokenizer.json + tokenizer_config.json naming the tokens."""
    directory = Path(directory)
    cfg: BertConfig = model.config
    tensors = {}
    for name, tensor in model_state(model).items():
        key = hf_name(name)
        tensors[key if key.startswith(("cls.", "classifier.")) else f"bert.{key}"] = tensor
    save_tensors(directory / "model.safetensors", tensors, metadata={"format": "pt"})
    write_json(directory / "config.json", cfg.to_hf_dict(type(model).__name__, label_names))
    if tokenizer is not None:
        tokenizer.save(directory)
        config = read_json(directory / "tokenizer_config.json", "tokenizer config")
        specials = {role: tokenizer.id_to_token(i) for role, i in bert_token_ids(tokenizer).items()}
        config |= {f"{role}_token": token for role, token in specials.items()}
        config["model_max_length"] = cfg.max_position
        config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
        write_json(directory / "tokenizer_config.json", config)
    return directory


# ---- data ------------------------------------------------------------------------------------
def mlm_rows(
    docs: list[list[int]], ids: dict[str, int], block_size: int
) -> dict[str, torch.Tensor]:
    """Each document cut into [CLS] chunk [SEP] rows of at most `block_size` tokens, padded."""
    n = block_size - 2
    rows = [[ids["cls"], *d[i : i + n], ids["sep"]] for d in docs for i in range(0, len(d), n)]
    if not rows:
        raise DataError("no tokens to train on")
    x, mask = pad_collate(rows, ids["pad"])
    return {"input_ids": x, "attention_mask": mask}


_SEGMENT_BREAK = re.compile(r"(?<=[.!?;:])\s+|\n\s*\n")


def nsp_sentences(text: str) -> list[str]:
    """Sentences (text ending in . ! ? ; : or a blank line), stripped, empty ones dropped."""
    return [s.strip() for s in _SEGMENT_BREAK.split(text) if s.strip()]


def nsp_rows(texts: list[str], tok: Tokenizer, ids: dict[str, int], block_size: int, seed: int):
    """NSP pairs from documents' sentences. One document (a single text file) is split into
    paragraphs, so that "random" second sentences still come from elsewhere."""
    if len(texts) == 1:
        texts = [p for p in re.split(r"\n\s*\n", texts[0]) if p.strip()]
    sentences = [nsp_sentences(t) for t in texts]
    flat = iter(tok.encode_batch([s for doc in sentences for s in doc]))
    docs = [[s for s in itertools.islice(flat, len(doc)) if s] for doc in sentences]
    g = torch.Generator().manual_seed(seed)
    return make_nsp_pairs(docs, ids["cls"], ids["sep"], ids["pad"], block_size, g)


# the metrics each objective plots (train and val)
CURVES = {"mlm": ("mlm_loss", "mlm_acc"),
          "mlm+nsp": ("loss", "mlm_loss", "nsp_loss", "mlm_acc", "nsp_acc")}  # fmt: skip


def bert_losses(model: nn.Module, batch: dict, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"loss": the total to minimise, and its parts / accuracies as tensors}: masked-language
    modelling on the selected positions only, plus BERT's binary is-next-sentence loss on [CLS]
    for a batch of NSP pairs (objective mlm+nsp, a BertForPreTraining)."""
    h, pooled = model.bert(batch["input_ids"], batch["attention_mask"],
                           batch.get("token_type_ids"))  # fmt: skip
    selected = labels != -100
    logits = model.mlm(h[selected], model.bert.embeddings.word.weight)
    target, n = labels[selected], max(1, int(selected.sum()))
    loss = F.cross_entropy(logits.float(), target, reduction="sum") / n
    out = {"loss": loss, "mlm_loss": loss, "mlm_acc": (logits.argmax(-1) == target).sum() / n}
    if "next_sentence_label" in batch:
        logits, labels = model.nsp(pooled).float(), batch["next_sentence_label"]
        out["nsp_loss"] = F.cross_entropy(logits, labels)
        out["nsp_acc"] = (logits.argmax(-1) == labels).float().mean()
        out["loss"] = loss + out["nsp_loss"]
    return out


def trim(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the padding columns no row of this batch uses (rows are padded to the longest)."""
    width = int(batch["attention_mask"].sum(1).max())
    return {k: (v[:, :width] if v.dim() == 2 else v) for k, v in batch.items()}


# ---- the trainer -----------------------------------------------------------------------------
class EncoderPretrainer(Trainer):
    """One BERT pretraining run, from an EncoderTrainConfig to a HF BERT directory."""

    plot_file = "loss.png"
    eval_split = "val"

    def __init__(self, cfg: EncoderTrainConfig, resume: bool = False, log=print):
        from lmforge.data import read_documents

        self.name = cfg.objective
        self.open_run(cfg, Parallel(require_device(cfg.device)), resume, log)
        torch.manual_seed(cfg.seed)
        nsp = cfg.objective == "mlm+nsp"
        self.curves = [(split, m) for m in CURVES[cfg.objective] for split in ("train", "val")]
        texts = list(read_documents(cfg.data, text_field=cfg.text_field))
        train = lambda: train_bert_tokenizer(texts, cfg.tokenizer, cfg.vocab_size)  # noqa: E731
        self.tokenizer = build_tokenizer(cfg, self.out_dir, train)
        self.ids = bert_token_ids(self.tokenizer)
        self.special_ids = torch.tensor(sorted(set(self.ids.values())))
        try:
            if nsp:
                rows = nsp_rows(texts, self.tokenizer, self.ids, cfg.block_size, cfg.seed)
            else:
                rows = mlm_rows(self.tokenizer.encode_batch(texts), self.ids, cfg.block_size)
        except LMForgeError as err:
            raise DataError(f"{cfg.data}: {err}") from None
        n = len(rows["input_ids"])
        n_val = max(1, round(n * cfg.val_fraction))
        if n - n_val < 1:
            raise DataError(f"{cfg.data}: only {n} row(s) of {cfg.block_size} tokens; need 2+")
        self.train_rows = {k: v[: n - n_val] for k, v in rows.items()}
        self.val_rows = {k: v[n - n_val :] for k, v in rows.items()}
        # the NSP head reads tanh(W h_[CLS] + b); MLM alone has no pooler, as HF's
        # BertForMaskedLM (a classifier fine-tuned on it starts a new one)
        self.model_config = cfg.bert_config(self.tokenizer.vocab_size, use_pooler=nsp)
        model_cls = BertForPreTraining if nsp else BertForMaskedLM
        self.model = model_cls(self.model_config).to(self.device)
        self.generator = torch.Generator().manual_seed(cfg.seed)  # batches and masking
        self.start(self.model)
        params = sum(p.numel() for p in self.model.parameters())
        self.log(f"data: {n - n_val:,} train / {n_val:,} val rows of <= {cfg.block_size} tokens; "
                 f"model: {params:,} parameters, {cfg.objective}; {self.device}")  # fmt: skip

    def _mask(self, batch: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """The batch trimmed and masked afresh, its MLM targets as `labels`, on the device."""
        batch = trim(batch)
        special = torch.isin(batch["input_ids"], self.special_ids)
        inputs, labels = mask_tokens(batch["input_ids"], special, self.model_config.vocab_size,
                                     self.ids["mask"], self.cfg.mask_prob, generator)  # fmt: skip
        batch = batch | {"input_ids": inputs, "labels": labels}
        return {k: v.to(self.device) for k, v in batch.items()}

    def next_batch(self) -> dict[str, torch.Tensor]:
        """A random batch of rows, freshly masked."""
        n = len(self.train_rows["input_ids"])
        idx = torch.randint(n, (self.cfg.batch_size,), generator=self.generator)
        return self._mask({k: v[idx] for k, v in self.train_rows.items()}, self.generator)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        out = bert_losses(self.model, batch, batch["labels"])  # the model reads its inputs only
        return out["loss"], {k: v for k, v in out.items() if k != "loss"}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean metrics over up to `eval_iters` validation batches, masked the same way each
        time (a fixed seed), so successive evaluations are comparable."""
        self.model.eval()  # the loop restores training mode after an evaluation
        g, totals, count = torch.Generator().manual_seed(self.cfg.seed + 1), {}, 0
        n, bs = len(self.val_rows["input_ids"]), self.cfg.batch_size
        for start in range(0, min(n, bs * self.cfg.eval_iters), bs):
            batch = self._mask({k: v[start : start + bs] for k, v in self.val_rows.items()}, g)
            loss, stats = self.loss(batch)
            for k, v in {"loss": loss, **stats}.items():
                totals[k] = totals.get(k, 0.0) + v.item()
            count += 1
        return {k: v / count for k, v in totals.items()}

    def eval_line(self, result: dict[str, float]) -> str:
        return f"step {self.step}: " + "  ".join(
            f"val {k} {v:.4f}" for k, v in result.items() if k != "loss"
        )

    def export(self, path: Path) -> None:
        save_bert(self.model, self.tokenizer, path)

    def signature(self) -> dict[str, Any]:
        return {"model": dataclasses.asdict(self.model_config), "objective": self.cfg.objective}
