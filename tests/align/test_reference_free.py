"""ORPO and SimPO/CPO trainers: no reference model, the loss terms they add, held-out preference
accuracy moves the right way, and preference lines lacking chosen/rejected are one-line errors."""

import json
import random

import pytest
import torch

from lmforge.align import data as D
from lmforge.align.reference_free import ORPOConfig, ORPOTrainer, SimPOConfig, SimPOTrainer
from lmforge.errors import ConfigError, DataError

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2}
QUIET = dict(log=lambda *a: None)


def write_pairs(path, n, seed):
    """Random-letter prompts; chosen 'yes', rejected 'no': learnable, and it carries over."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = "".join(rng.choice("abcdefgh") for _ in range(6)) + "?"
            f.write(json.dumps({"prompt": prompt, "chosen": "yes", "rejected": "no"}) + "\n")
    return str(path)


def base(tmp_path, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = dict(out_dir=str(tmp_path / "out"), model=TINY, max_len=24, batch_size=8, max_iters=4,
               eval_interval=4, progress=False, threads=1, warmup_iters=1, lr=1e-3,
               data=write_pairs(tmp_path / "train.jsonl", 48, 1),
               eval_data=write_pairs(tmp_path / "val.jsonl", 16, 2))  # fmt: skip
    return {**cfg, **kw}


def nll(logits, labels):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                             ignore_index=D.IGNORE)  # fmt: skip


def test_orpo_is_whole_sequence_nll_plus_odds_term(tmp_path):
    t = ORPOTrainer(ORPOConfig(**base(tmp_path, beta=1e-6)), **QUIET)
    assert not hasattr(t, "ref")  # reference-free: no frozen copy
    b = t.batch([0, 1, 2, 3])
    loss, stats = t.loss(b)
    with torch.no_grad():
        logits = t.lm.model(b["input_ids"][:4])
        whole = b["input_ids"][:4].masked_fill(b["attention_mask"][:4] == 0, D.IGNORE)
        assert loss.item() == pytest.approx(nll(logits, whole).item(), abs=1e-4)  # β → 0
        assert loss.item() != pytest.approx(nll(logits, b["labels"][:4]).item(), abs=1e-4)
    assert 0 <= stats["accuracy"] <= 1


@pytest.mark.parametrize("loss_type", ["simpo", "sigmoid", "hinge", "ipo"])
def test_cpo_alpha_adds_the_chosen_response_nll(tmp_path, loss_type):
    plain = SimPOTrainer(SimPOConfig(**base(tmp_path / "a", loss_type=loss_type)), **QUIET)
    cpo = SimPOTrainer(SimPOConfig(**base(tmp_path / "b", loss_type=loss_type, cpo_alpha=0.5)),
                       **QUIET)  # fmt: skip
    b = plain.batch([0, 1, 2, 3])
    with torch.no_grad():
        response_nll = nll(plain.lm.model(b["input_ids"][:4]), b["labels"][:4]).item()
        expect = plain.loss(b)[0].item() + 0.5 * response_nll
        assert cpo.loss(b)[0].item() == pytest.approx(expect, abs=1e-5)


@pytest.mark.parametrize(
    "trainer,config,kw",
    [(ORPOTrainer, ORPOConfig, {"beta": 0.5}),
     (SimPOTrainer, SimPOConfig, {"beta": 2.0, "simpo_gamma": 0.5}),
     (SimPOTrainer, SimPOConfig, {"loss_type": "sigmoid", "beta": 0.5, "cpo_alpha": 1.0})],
)  # fmt: skip
def test_training_moves_held_out_accuracy_and_margin(tmp_path, trainer, config, kw):
    r = trainer(config(**base(tmp_path, max_iters=12, eval_interval=12, lr=3e-3, **kw)),
                **QUIET).run()  # fmt: skip
    assert r["margin"] > r["initial_margin"] and r["accuracy"] == 1.0
    assert r["loss"] < r["initial_loss"]
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_pair_lacking_rejected_is_one_line_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
                    '{"prompt": "a", "chosen": "b"}\n')  # fmt: skip
    for trainer, config in ((ORPOTrainer, ORPOConfig), (SimPOTrainer, SimPOConfig)):
        with pytest.raises(DataError, match=r"bad\.jsonl:2: missing field 'rejected'") as err:
            trainer(config(**{**base(tmp_path), "data": str(path)}), **QUIET)
        assert "\n" not in str(err.value)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_bad_configs():
    with pytest.raises(ConfigError, match="loss_type"):
        SimPOConfig(loss_type="kto")
    with pytest.raises(ConfigError, match="beta"):
        ORPOConfig(beta=0)
    with pytest.raises(ConfigError, match="label_smoothing"):
        SimPOConfig(label_smoothing=0.7)
