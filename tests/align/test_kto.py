"""KTO trainer: unpaired labelled data (JSONL, chat and paired forms), the mismatched-pair KL
reference point, training moves the held-out reward margin, and bad lines are one-line errors."""

import json
import math
import random

import pytest
import torch

from lmforge.align import data as D
from lmforge.align.kto import KTOConfig, KTOTrainer, mismatched
from lmforge.align.trainer import load_lm
from lmforge.errors import ConfigError, DataError

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2}
QUIET = dict(log=lambda *a: None)


def write_unpaired(path, n, seed):
    """Prompts of random letters; the desirable completion is 'yes', the undesirable 'no' (a
    pattern a tiny model can learn and that carries over to unseen prompts)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            prompt = "".join(rng.choice("abcdefgh") for _ in range(6)) + "?"
            good = i % 2 == 0
            f.write(json.dumps({"prompt": prompt, "completion": "yes" if good else "no",
                                "label": good}) + "\n")  # fmt: skip
    return str(path)


def cfg(tmp_path, **kw):
    base = dict(out_dir=str(tmp_path / "out"), model=TINY, max_len=24, batch_size=8,
                max_iters=4, eval_interval=4, progress=False, threads=1, warmup_iters=1,
                lr=1e-3)  # fmt: skip
    return KTOConfig(**{**base, **kw})


def test_loader_accepts_labelled_chat_and_paired_lines(tmp_path):
    tok = load_lm("scratch", TINY, 32, 0, "cpu").tokenizer
    rows = [
        {"prompt": "1+1=", "completion": "2", "label": True},
        {"prompt": [{"role": "user", "content": "1+2="}], "completion": "4", "label": False},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
         "label": True},
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
    ]  # fmt: skip
    ds = D.load_unpaired(rows, tok, 32)
    assert [e.desirable for e in ds.examples] == [True, False, True, True, False]
    # the paired line keeps its prompt masked and trains on the completion (+ EOS) only
    e = ds.examples[3].example
    assert tok.decode([t for t in e.labels if t != D.IGNORE]).startswith("4")
    assert e.prompt_len == len(tok.encode("2+2="))


def test_mismatched_pairs_rotate_completions():
    tok = load_lm("scratch", TINY, 32, 0, "cpu").tokenizer
    rows = [D.encode_sft({"prompt": p, "response": c}, tok, 32)
            for p, c in (("ab=", "x"), ("cde=", "yy"), ("f=", "zzz"))]  # fmt: skip
    kl = mismatched(rows, 32)
    text = [tok.decode(r.input_ids) for r in kl]
    assert text[0].startswith("ab=zzz") and text[1].startswith("cde=x")
    assert text[2].startswith("f=yy")
    assert all(r.prompt_len == rows[i].prompt_len for i, r in enumerate(kl))


def test_loss_at_init_and_reference_point(tmp_path):
    data = write_unpaired(tmp_path / "d.jsonl", 40, 0)
    t = KTOTrainer(cfg(tmp_path, data=data), **QUIET)
    b = t.batch(list(range(8)))
    loss, stats = t.loss(b)
    # π = π_ref: r = 0 and z₀ = max(0, 0) = 0, so every row costs 1 - σ(0) = 0.5
    assert loss.item() == pytest.approx(0.5, abs=1e-6) and stats["kl"] == pytest.approx(0, abs=1e-6)
    with torch.no_grad():  # a changed policy: z₀ comes from its log-ratios on mismatched pairs
        for p in t.lm.model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    b = t.batch(list(range(8)))
    assert b["kl_policy"].shape == (8,) and not torch.allclose(b["kl_policy"], b["kl_ref"])
    z0 = max(0.0, (b["kl_policy"] - b["kl_ref"]).mean().item())
    assert t.loss(b)[1]["kl"] == pytest.approx(z0, abs=1e-6)
    assert "kl_policy" not in t.batch([0])  # one row has no other completion to pair with


def test_training_moves_the_held_out_margin(tmp_path):
    train = write_unpaired(tmp_path / "train.jsonl", 64, 1)
    held_out = write_unpaired(tmp_path / "val.jsonl", 32, 2)
    t = KTOTrainer(cfg(tmp_path, data=train, eval_data=held_out, max_iters=15, lr=3e-3,
                       eval_interval=15), **QUIET)  # fmt: skip
    r = t.run()
    assert r["initial_margin"] == pytest.approx(0.0, abs=1e-6)
    assert r["margin"] > 0.05 and r["reward_desirable"] > r["reward_undesirable"]
    assert r["loss"] < r["initial_loss"] and math.isfinite(r["kl"])
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_line_without_label_is_one_line_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "completion": "b", "label": true}\n'
                    '{"prompt": "c", "completion": "d"}\n')  # fmt: skip
    with pytest.raises(DataError, match=r"bad\.jsonl:2: missing field 'label'") as err:
        KTOTrainer(cfg(tmp_path, data=str(path)), **QUIET)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out" / "model.safetensors").exists()
    path.write_text('{"prompt": "c", "completion": "d", "label": "yes"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: 'label' must be true or false"):
        KTOTrainer(cfg(tmp_path, data=str(path)), **QUIET)


def test_one_sided_data_and_bad_config(tmp_path):
    path = tmp_path / "good_only.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "completion": "x", "label": True})
                            + "\n" for i in range(10)))  # fmt: skip
    with pytest.raises(DataError, match="9 desirable and 0 undesirable"):
        KTOTrainer(cfg(tmp_path, data=str(path)), **QUIET)
    with pytest.raises(ConfigError, match="loss_type"):
        KTOConfig(loss_type="dpo")
    with pytest.raises(ConfigError, match="undesirable_weight"):
        KTOConfig(undesirable_weight=0)


def test_cli_verb_prints_one_line(tmp_path, capsys):
    from lmforge.cli.main import main

    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "c", "completion": "d"}\n')
    out = tmp_path / "out"
    status = main(["kto", "--data", str(path), "--out_dir", str(out), "--model.n_layer", "1"])
    err = capsys.readouterr().err.strip()
    assert status != 0 and f"{path}:1: missing field 'label'" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1
