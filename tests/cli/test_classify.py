"""`lmforge classify`: the rule-built demo task, fine-tuning a BERT checkpoint to high accuracy,
HF-compatible output, prediction, and readable errors for bad input."""

import json
import os

import pytest
import torch

from lmforge.cli.main import main
from lmforge.errors import ConfigError, DataError
from lmforge.model.bert import BertConfig, BertForMaskedLM
from lmforge.train.classify import (
    NEGATIVE,
    POSITIVE,
    ClassifyTrainConfig,
    ClassifyTrainer,
    demo_dataset,
    encode,
    predict,
    read_labelled,
)
from lmforge.train.encoder import save_bert, train_bert_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rule(text: str) -> int:
    """The demo label, recomputed independently: the last clause decides; "not" flips it."""
    clause = text.split(" but ")[-1].split()
    positive = clause[-1] in POSITIVE
    assert positive or clause[-1] in NEGATIVE
    return int(positive != ("not" in clause))


def test_demo_dataset_follows_its_rule_and_holds_out_texts():
    train_rows, test_rows = demo_dataset(seed=3)
    assert (len(train_rows), len(test_rows)) == (2000, 400)
    assert demo_dataset(seed=3) == (train_rows, test_rows)  # deterministic
    assert not {t for t, _ in train_rows} & {t for t, _ in test_rows}
    assert all(label == rule(text) for text, label in train_rows + test_rows)
    assert 0.4 < sum(label for _, label in train_rows) / len(train_rows) < 0.6
    assert any(" but " in t for t, _ in test_rows) and any(" not " in t for t, _ in test_rows)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A randomly initialised encoder with a word tokenizer, saved as a HF BERT directory."""
    root = tmp_path_factory.mktemp("classify")
    texts = [t for t, _ in demo_dataset()[0]]
    tok = train_bert_tokenizer(texts, "word", 200)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, d_model=64, n_layer=2, n_head=2, d_ff=128,
                     max_position=32, use_pooler=False)  # fmt: skip
    save_bert(BertForMaskedLM(cfg), tok, root / "bert")
    return root


@pytest.mark.slow  # ~10 s: 150 steps of fine-tuning
def test_fine_tuning_reaches_high_accuracy_and_exports_for_hf(bert_dir):
    cfg = ClassifyTrainConfig(checkpoint=str(bert_dir / "bert"), out_dir=str(bert_dir / "cls"),
                              max_iters=150, lr=1.5e-3, warmup_iters=15, eval_interval=75,
                              progress=False, threads=1)  # fmt: skip
    result = ClassifyTrainer(cfg, log=lambda *_: None).run()
    assert result["val_acc"] >= 0.9 and result["val_acc"] > result["val_acc_before"] + 0.3, result
    out = bert_dir / "cls"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.csv", "loss.png"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "positive"}
    assert config["architectures"] == ["BertForSequenceClassification"]
    texts = ["the book was not bad", "the film was great but the ending was dull"]
    labels = [p[1] for p in predict(out, texts)]
    assert labels == ["positive", "negative"]

    transformers = pytest.importorskip("transformers")
    from lmforge.model.bert import BertForSequenceClassification, load_bert
    from lmforge.tokenizer import Tokenizer

    hf = transformers.BertForSequenceClassification.from_pretrained(out).eval()
    ours, _ = load_bert(out, BertForSequenceClassification)
    x, mask = encode(Tokenizer.load(out), texts, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, mask)[0], hf(x, attention_mask=mask).logits)


def test_cli_train_and_predict_from_jsonl(bert_dir, tmp_path, capsys):
    rows = [{"text": t, "label": "pos" if y else "neg"} for t, y in demo_dataset(200, 40)[0]]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "cls"
    argv = ["classify", "train", "--checkpoint", str(bert_dir / "bert"), "--data", str(data),
            "--out_dir", str(out), "--max_iters", "4", "--eval_interval", "2", "--progress",
            "false"]  # fmt: skip
    assert main(argv) == 0
    assert "val accuracy:" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["id2label"] == {"0": "neg", "1": "pos"}
    assert main(["classify", "predict", "--checkpoint", str(out), "--data", str(data),
                 "the food was good"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split("\t")[0] in ("neg", "pos") and lines[0].endswith("the food was good")
    assert len(lines) == 1 + len(rows) + 1 and lines[-1].startswith("accuracy: ")


def test_bad_input_raises_readable_errors(bert_dir, tmp_path, capsys):
    def jsonl(text: str):
        path = tmp_path / "bad.jsonl"
        path.write_text(text)
        return path

    with pytest.raises(DataError, match="bad.jsonl:2: invalid JSON"):
        read_labelled(jsonl('{"text": "a", "label": 1}\n{"text": \n'))
    with pytest.raises(DataError, match="bad.jsonl:1: needs fields 'text' and 'label'"):
        read_labelled(jsonl('{"text": "a"}\n'))
    with pytest.raises(DataError, match="bad.jsonl:2: label 'x' mixes integer and string"):
        read_labelled(jsonl('{"text": "a", "label": 1}\n{"text": "b", "label": "x"}\n'))
    with pytest.raises(DataError, match="bad.jsonl:1: 'text' must be a string"):
        read_labelled(jsonl('{"text": "a", "label": [1]}\n'))
    with pytest.raises(DataError, match="no examples"):
        read_labelled(jsonl("\n"))
    with pytest.raises(DataError, match="not found"):
        read_labelled(tmp_path / "missing.jsonl")
    one_class = jsonl("".join(json.dumps({"text": f"t {i}", "label": 0}) + "\n" for i in range(9)))
    cfg = ClassifyTrainConfig(checkpoint=str(bert_dir / "bert"), data=str(one_class),
                              out_dir=str(tmp_path / "o"), progress=False)  # fmt: skip
    with pytest.raises(DataError, match="need at least 2 classes"):
        ClassifyTrainer(cfg, log=lambda *_: None).run()
    with pytest.raises(ConfigError, match="checkpoint: give a BERT directory"):
        ClassifyTrainConfig()
    with pytest.raises(ConfigError, match="max_len must be >= 3"):
        ClassifyTrainConfig(checkpoint="x", max_len=2)

    def cli_error(argv) -> str:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err
        return err

    assert "config.json: not found" in cli_error(
        ["classify", "train", "--checkpoint", str(tmp_path / "nope"), "--progress", "false"]
    )
    assert "unknown key(s) step" in cli_error(["classify", "train", "--step", "3"])
    assert "give texts to label" in cli_error(
        ["classify", "predict", "--checkpoint", str(bert_dir / "bert")]
    )
