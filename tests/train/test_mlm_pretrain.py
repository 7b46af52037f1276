"""BERT pretraining (MLM, MLM+NSP): loss on selected positions only, training lowers it, resume is
exact, and the saved directory loads in transformers with the same logits."""

import os

import pytest
import torch
import torch.nn.functional as F
from corpus_config import corpus_config

from lmforge.cli.main import main
from lmforge.errors import CheckpointError, ConfigError, DataError
from lmforge.model.bert import (
    BertConfig,
    BertForMaskedLM,
    BertForPreTraining,
    load_bert,
    mask_tokens,
)
from lmforge.tokenizer import Tokenizer
from lmforge.train.encoder import (
    BERT_SPECIAL_TOKENS,
    EncoderPretrainer,
    EncoderTrainConfig,
    bert_losses,
    bert_token_ids,
    nsp_sentences,
    train_bert_tokenizer,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Paragraphs of short sentences: enough rows for MLM and enough documents for NSP.
TOPICS = ["cat", "dog", "bird", "fish", "horse", "mouse", "lion", "bear"]
TEXT = "\n\n".join(
    f"The {a} sat on the mat. The {a} saw a {b}! Did the {b} run away? "
    f"Then the {a} slept; the {b} ate. A {a} and a {b} met again."
    for a in TOPICS
    for b in TOPICS
    if a != b
)


def config(tmp_path, **kw) -> EncoderTrainConfig:
    base = dict(
        out_dir=str(tmp_path / "bert"), tokenizer="word", vocab_size=200,
        block_size=24, batch_size=16, max_iters=8, eval_interval=4, eval_iters=2, log_interval=1,
        warmup_iters=2, lr=2e-3, progress=False, threads=1, seed=5,
        model=dict(d_model=32, n_layer=1, n_head=2, d_ff=64, dropout=0.0, attn_dropout=0.0),
    )  # fmt: skip
    return corpus_config(EncoderTrainConfig, tmp_path, TEXT, base, **kw)


def quiet(*_):
    pass


def test_mlm_loss_is_computed_on_selected_positions_only():
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=50, d_model=32, n_layer=1, n_head=2, d_ff=64))
    model.eval()
    ids = torch.randint(5, 50, (4, 20))
    ids[:, 0], ids[:, -1] = 2, 3  # [CLS] ... [SEP]
    special = torch.isin(ids, torch.tensor([0, 2, 3]))
    inputs, labels = mask_tokens(ids, special, 50, 4, generator=torch.Generator().manual_seed(1))
    selected = labels != -100
    assert 0 < selected.sum() < ids.numel() // 2 and not (selected & special).any()
    batch = {"input_ids": inputs, "attention_mask": torch.ones_like(inputs)}
    ours = bert_losses(model, batch, labels)
    logits = model(inputs)[0]
    reference = F.cross_entropy(logits[selected], ids[selected])
    torch.testing.assert_close(ours["mlm_loss"], reference)
    torch.testing.assert_close(ours["loss"], model(inputs, labels=labels)[1])
    # The loss ignores what the model predicts at every other position: gradients reach the
    # logits only where a token was selected.
    full = model(inputs)[0].detach().requires_grad_()
    F.cross_entropy(full.flatten(0, 1), labels.flatten()).backward()
    assert (full.grad.abs().sum(-1)[~selected] == 0).all()
    assert (full.grad.abs().sum(-1)[selected] > 0).all()


def test_tokenizer_has_bert_tokens_and_wraps_for_hf(tmp_path):
    tok = train_bert_tokenizer([TEXT], "word", 200)
    ids = bert_token_ids(tok)
    assert ids == {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
    assert ids["cls"] not in tok.encode("The cat sat")  # ours adds nothing
    assert tok.backend.encode("The cat").ids[0] == ids["cls"]  # HF's encode wraps
    assert nsp_sentences("A b. C d!\n\nE f? G") == ["A b.", "C d!", "E f?", "G"]


def test_training_lowers_mlm_loss_and_writes_run_files(tmp_path):
    trainer = EncoderPretrainer(config(tmp_path, max_iters=120, eval_interval=60), log=quiet)
    before = trainer.evaluate()
    result = trainer.run()
    assert result["mlm_loss"] < 0.8 * before["mlm_loss"], (before, result)
    assert result["mlm_acc"] > before["mlm_acc"] + 0.3
    out = tmp_path / "bert"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.csv", "loss.png",
                 "training_state.safetensors", "final_metrics.json"):  # fmt: skip
        assert (out / name).is_file(), name


def test_nsp_pairs_train_and_report_accuracy(tmp_path):
    trainer = EncoderPretrainer(config(tmp_path, objective="mlm+nsp"), log=quiet)
    rows = trainer.train_rows
    assert (rows["token_type_ids"] == 1).any()
    assert set(rows["next_sentence_label"].tolist()) == {0, 1}
    assert (rows["input_ids"][:, 0] == trainer.ids["cls"]).all()
    result = trainer.run()
    assert 0.0 <= result["nsp_acc"] <= 1.0 and result["nsp_loss"] > 0
    assert result["loss"] == pytest.approx(result["mlm_loss"] + result["nsp_loss"], rel=1e-5)


@pytest.mark.parametrize("objective", ["mlm", "mlm+nsp"])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, objective):
    transformers = pytest.importorskip("transformers")
    EncoderPretrainer(config(tmp_path, objective=objective), log=quiet).run()
    out = tmp_path / "bert"
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.mask_token == "[MASK]" and hf_tok.pad_token_id == 0
    enc = hf_tok(["The cat [MASK] on the mat.", "A dog"], ["The bird ate.", "ran"],
                 padding=True, return_tensors="pt")  # fmt: skip
    assert enc["input_ids"][0, 0] == hf_tok.cls_token_id and (enc["token_type_ids"] == 1).any()
    assert (enc["attention_mask"] == 0).any()
    args = (enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    ours_cls = {"mlm": BertForMaskedLM, "mlm+nsp": BertForPreTraining}[objective]
    hf_cls = ours_cls.__name__
    hf = getattr(transformers, hf_cls).from_pretrained(out).eval()
    ours, cfg = load_bert(out, ours_cls)
    with torch.no_grad():
        ref, got = hf(*args), ours(*args)
    if objective == "mlm":
        torch.testing.assert_close(got[0], ref.logits, atol=1e-5, rtol=1e-5)
        assert not cfg.use_pooler  # like HF's BertForMaskedLM: no unused pooler weights
    else:
        torch.testing.assert_close(got[0], ref.prediction_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], ref.seq_relationship_logits, atol=1e-5, rtol=1e-5)
    # Every HF MLM model loads the same weights, whichever objective trained them.
    mlm = transformers.BertForMaskedLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(mlm(*args).logits, got[0], atol=1e-5, rtol=1e-5)


def test_resume_continues_exactly(tmp_path):
    model = dict(d_model=32, n_layer=1, n_head=2, d_ff=64)  # dropout on: the RNG must resume
    straight = EncoderPretrainer(config(tmp_path / "a", model=model), log=quiet)
    reference = [straight.train_step()["loss"] for _ in range(6)]
    first = EncoderPretrainer(config(tmp_path / "b", model=model), log=quiet)
    _ = [first.train_step() for _ in range(3)]
    first.save_checkpoint()
    resumed = EncoderPretrainer(config(tmp_path / "b", model=model), resume=True, log=quiet)
    assert resumed.step == 3
    assert [resumed.train_step()["loss"] for _ in range(3)] == pytest.approx(reference[3:])


def test_cli_pretrain_mlm_and_bad_input(tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    argv = ["pretrain", "--objective", "mlm", "--data", str(data), "--out_dir",
            str(tmp_path / "cli"), "--tokenizer", "word", "--max_iters", "2", "--eval_interval",
            "2", "--block_size", "16", "--progress", "false", "--model.d_model", "16",
            "--model.n_layer", "1", "--model.n_head", "2", "--model.d_ff", "32"]  # fmt: skip
    assert main(argv) == 0
    assert "val mlm_loss" in capsys.readouterr().out
    assert (tmp_path / "cli" / "model.safetensors").is_file()

    def error(extra: list[str]) -> str:
        assert main(argv + extra) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err
        return err

    assert "unknown key(s) max_iter" in error(["--max_iter", "3"])
    assert "unknown BertConfig field(s) n_layers" in error(["--model.n_layers", "3"])
    with pytest.raises(SystemExit):  # argparse: invalid choice
        main(["pretrain", "--objective", "nsp"])


def test_bad_input_raises_readable_errors(tmp_path):
    with pytest.raises(ConfigError, match="objective must be one of mlm, mlm\\+nsp"):
        config(tmp_path, objective="clm")
    with pytest.raises(ConfigError, match="mask_prob"):
        config(tmp_path, mask_prob=1.5)
    with pytest.raises(ConfigError, match="max_position=16 < block_size=24"):
        config(tmp_path, model=dict(max_position=16)).bert_config(100)
    # a tokenizer without BERT's tokens
    plain = Tokenizer.train_word([TEXT], vocab_size=100)
    plain.save(tmp_path / "plain")
    with pytest.raises(ConfigError, match=r"lacks BERT special token\(s\) \[CLS\], \[SEP\]"):
        EncoderPretrainer(config(tmp_path, tokenizer=str(tmp_path / "plain")), log=quiet)
    # NSP needs more than one sentence
    one = tmp_path / "one.txt"
    one.write_text("Only one sentence here")
    with pytest.raises(DataError, match="one.txt: make_nsp_pairs needs two documents"):
        EncoderPretrainer(config(tmp_path, objective="mlm+nsp", data=str(one),
                                 out_dir=str(tmp_path / "o")), log=quiet)  # fmt: skip
    with pytest.raises(CheckpointError, match="--resume: no training state"):
        EncoderPretrainer(config(tmp_path, out_dir=str(tmp_path / "new")), resume=True, log=quiet)
    # resuming with another architecture
    trainer = EncoderPretrainer(config(tmp_path, out_dir=str(tmp_path / "r")), log=quiet)
    trainer.save_checkpoint()
    changed = dict(trainer.cfg.model, d_ff=48)
    with pytest.raises(CheckpointError, match="different model config"):
        EncoderPretrainer(config(tmp_path, out_dir=str(tmp_path / "r"), model=changed),
                          resume=True, log=quiet)  # fmt: skip
    assert set(BERT_SPECIAL_TOKENS) == {"pad", "unk", "cls", "sep", "mask"}
