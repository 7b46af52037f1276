"""Fine-tuning a BERT checkpoint for sequence classification, and predicting with it
(`lmforge classify`).

The demo task needs no download: short reviews built by rule, whose label is the polarity of the
adjective, flipped by "not", and taken from the clause after "but" when there are two. A bag of
words cannot solve it (same words, opposite labels); word order and negation have to be read.
The output is a Hugging Face BertForSequenceClassification directory.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from lmforge.data.batches import pad_collate
from lmforge.errors import ConfigError, DataError, require_positive_ints
from lmforge.fileio import read_json, read_jsonl
from lmforge.model.bert import BertForSequenceClassification, BertModel, load_bert
from lmforge.tokenizer import Tokenizer
from lmforge.train.config import SmallRunConfig, require_fraction, run_config
from lmforge.train.encoder import bert_token_ids, save_bert
from lmforge.train.loop import Trainer
from lmforge.train.parallel import Parallel

POSITIVE = "good great excellent superb wonderful delightful brilliant charming lovely fine".split()
NEGATIVE = "bad awful terrible dull boring poor dreadful bland mediocre clumsy".split()
SUBJECTS = "film movie plot acting food service hotel book music ending".split()
DEMO_LABELS = ["negative", "positive"]


def demo_review(rng: random.Random) -> tuple[str, int]:
    """One rule-built review and its label (1 positive, 0 negative)."""

    def clause() -> tuple[str, int]:
        positive, negated = rng.random() < 0.5, rng.random() < 0.4
        adj = rng.choice(POSITIVE if positive else NEGATIVE)
        verb = rng.choice(["was", "is", "felt", "seemed"])
        adverb = rng.choice(["", "really ", "very ", "quite ", "truly "])
        text = f"the {rng.choice(SUBJECTS)} {verb} {'not ' if negated else ''}{adverb}{adj}"
        return text, int(positive != negated)

    first, label = clause()
    if rng.random() < 0.3:  # "A but B": B decides
        second, label = clause()
        first = f"{first} but {second}"
    return first, label


def demo_dataset(n_train: int = 2000, n_test: int = 400, seed: int = 0):
    """(train, test) lists of (text, label); no test text occurs in train."""
    rng, labels = random.Random(seed), {}
    while len(labels) < n_train + n_test:
        text, label = demo_review(rng)
        labels.setdefault(text, label)  # a repeated text keeps its first draw
    rows = list(labels.items())
    return rows[:n_train], rows[n_train:]


def read_labelled(path: str | Path, text_field: str = "text", label_field: str = "label"):
    """(text, label) pairs from a .jsonl file; labels are ints or strings, one kind per file."""
    rows = []
    for lineno, row in read_jsonl(path):
        if text_field not in row or label_field not in row:
            raise DataError(f"{path}:{lineno}: needs fields {text_field!r} and {label_field!r}")
        text, label = row[text_field], row[label_field]
        if not isinstance(text, str) or type(label) not in (int, str):
            raise DataError(f"{path}:{lineno}: {text_field!r} must be a string and "
                            f"{label_field!r} an integer or a string")  # fmt: skip
        if rows and type(label) is not type(rows[0][1]):
            raise DataError(f"{path}:{lineno}: label {label!r} mixes integer and string "
                            "labels")  # fmt: skip
        rows.append((text, label))
    if not rows:
        raise DataError(f"{path}: no examples")
    return rows


@run_config(optim=dict(max_iters=400, lr=3e-4, min_lr=3e-5, warmup_iters=40, eval_interval=100))
class ClassifyTrainConfig(SmallRunConfig):
    """A fine-tuning run: a BERT checkpoint, labelled texts (or the demo task), AdamW + cosine."""

    checkpoint: str | None = None  # a BERT directory (ours or Hugging Face's)
    out_dir: str = "out/classify"
    data: str | None = None  # .jsonl of {"text", "label"}; None: the built-in demo task
    val_data: str | None = None  # None: hold out val_fraction of `data`
    val_fraction: float = 0.2
    text_field: str = "text"
    label_field: str = "label"
    max_len: int = 64  # tokens per text, [CLS] and [SEP] included (longer texts are truncated)

    def __post_init__(self) -> None:
        if not self.checkpoint:
            raise ConfigError("checkpoint: give a BERT directory (e.g. from `lmforge pretrain "
                              "--objective mlm`)")  # fmt: skip
        super().__post_init__()
        require_positive_ints(self, "max_len")
        require_fraction(self, "val_fraction")
        if self.max_len < 3:
            raise ConfigError(f"max_len must be >= 3 ([CLS] text [SEP]), got {self.max_len}")


def encode(tok, texts: list[str], max_len: int):
    """[CLS] text [SEP] rows, truncated to max_len and padded: (input_ids, attention_mask)."""
    ids = bert_token_ids(tok)
    rows = [[ids["cls"], *t[: max_len - 2], ids["sep"]] for t in tok.encode_batch(texts)]
    return pad_collate(rows, ids["pad"])


def load_classifier(checkpoint: str | Path, num_labels: int):
    """A BertForSequenceClassification whose encoder comes from `checkpoint` and whose
    classifier (and pooler, when the checkpoint has none, as after MLM) starts fresh."""
    encoder, cfg = load_bert(checkpoint, BertModel)
    cfg.num_labels, cfg.use_pooler = num_labels, True
    model = BertForSequenceClassification(cfg)
    # Every encoder tensor is loaded; only the pooler may be missing (then it stays fresh).
    model.bert.load_state_dict(encoder.state_dict(), strict=False)
    return model, Tokenizer.load(checkpoint)


def accuracy(model, x, mask, labels, batch_size: int = 256) -> float:
    """The fraction of rows of x the model labels as `labels` (in eval mode, batched)."""
    model.eval()
    with torch.no_grad():
        preds = [model(x[i : i + batch_size], mask[i : i + batch_size])[0].argmax(-1)
                 for i in range(0, len(x), batch_size)]  # fmt: skip
    return (torch.cat(preds) == labels).float().mean().item()


def _splits(cfg: ClassifyTrainConfig):
    """(train, val, label names): the demo task, or the data file(s) with labels indexed."""
    if cfg.data is None:
        return *demo_dataset(seed=cfg.seed), DEMO_LABELS
    train = read_labelled(cfg.data, cfg.text_field, cfg.label_field)
    if cfg.val_data:
        val = read_labelled(cfg.val_data, cfg.text_field, cfg.label_field)
    else:
        random.Random(cfg.seed).shuffle(train)
        n_val = max(1, round(len(train) * cfg.val_fraction))
        train, val = train[n_val:], train[:n_val]
    if isinstance(train[0][1], int):
        names = [str(i) for i in range(max(y for _, y in train + val) + 1)]
        if min(y for _, y in train + val) < 0:
            raise DataError(f"{cfg.data}: integer labels must be >= 0")
    else:
        names = sorted({y for _, y in train + val})
    if len(names) < 2 or not train:
        raise DataError(f"{cfg.data}: need at least 2 classes and 2 examples")
    index = {name: i for i, name in enumerate(names)}
    fix = lambda rows: [(t, y if isinstance(y, int) else index[y]) for t, y in rows]
    return fix(train), fix(val), names


class ClassifyTrainer(Trainer):
    """Fine-tunes a BertForSequenceClassification on random batches of the training texts;
    validation accuracy before training, every eval_interval steps, and train accuracy at the
    end. On CPU (BERT-sized demos)."""

    name = "classify"
    curves = [("train", "loss"), ("val", "acc")]
    plot_file = "loss.png"
    eval_split = "val"

    def __init__(self, cfg: ClassifyTrainConfig, resume: bool = False, log=print):
        torch.manual_seed(cfg.seed)
        # data and checkpoint first: a bad input fails before out_dir is written
        train_rows, val_rows, self.names = _splits(cfg)
        self.model, self.tokenizer = load_classifier(cfg.checkpoint, len(self.names))
        max_len = min(cfg.max_len, self.model.config.max_position)
        self.x, self.mask = encode(self.tokenizer, [t for t, _ in train_rows], max_len)
        self.y = torch.tensor([label for _, label in train_rows])
        self.vx, self.vmask = encode(self.tokenizer, [t for t, _ in val_rows], max_len)
        self.vy = torch.tensor([label for _, label in val_rows])
        self.open_run(cfg, Parallel(torch.device("cpu")), resume, log, evaluate_first=True)
        unk_id = self.tokenizer.unk_id
        if unk_id is not None and (unk := (self.x == unk_id).sum() / self.mask.sum()) > 0.05:
            log(f"warning: {unk:.0%} of the training tokens are unknown to {cfg.checkpoint}'s "
                "tokenizer")  # fmt: skip
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.start(self.model)
        log(f"{len(train_rows)} train / {len(val_rows)} val examples, {len(self.names)} classes")

    def next_batch(self):
        idx = torch.randint(len(self.x), (self.cfg.batch_size,), generator=self.generator)
        width = int(self.mask[idx].sum(1).max())
        return self.x[idx, :width], self.mask[idx, :width], self.y[idx]

    def loss(self, batch):
        x, mask, y = batch
        return self.model(x, mask, labels=y)[1], {}

    def evaluate(self) -> dict[str, float]:
        return {"val_acc": accuracy(self.model, self.vx, self.vmask, self.vy)}

    def log_evaluation(self, result: dict[str, float]) -> None:
        self.metrics.log(self.step, "val", acc=result["val_acc"])

    def eval_line(self, result: dict[str, float]) -> str:
        return f"step {self.step}: val accuracy {result['val_acc']:.1%}"

    def export(self, path: Path) -> None:
        save_bert(self.model, self.tokenizer, path, label_names=self.names)

    def signature(self) -> dict:
        return {"checkpoint": str(self.cfg.checkpoint), "labels": self.names}

    def finish(self, result: dict) -> dict:
        if "initial_val_acc" in result:
            result["val_acc_before"] = result.pop("initial_val_acc")
        result["train_acc"] = accuracy(self.model, self.x, self.mask, self.y)
        return result


def predict(checkpoint: str | Path, texts: list[str], max_len: int = 512):
    """[(label index, label name, probability)] per text, from a `classify train` directory."""
    model, cfg = load_bert(checkpoint, BertForSequenceClassification)
    id2label = read_json(Path(checkpoint) / "config.json", "config").get("id2label") or {}
    x, mask = encode(Tokenizer.load(checkpoint), texts, min(max_len, cfg.max_position))
    with torch.no_grad():
        probs = model(x, mask)[0].softmax(-1)
    best = probs.max(-1)
    pairs = zip(best.indices.tolist(), best.values.tolist())
    return [(i, id2label.get(str(i), str(i)), p) for i, p in pairs]
