"""Every trainer runs the one loop (lmforge/train/loop.py), so every trainer stops on Ctrl-C and on
SIGTERM after the step it is in, saves, and resumes to exactly the weights of a run that was never
interrupted.

Each case trains a tiny model for 4 steps three ways: straight through; with a real signal sent to
this process during step 2 (the loop's handler only asks for a stop, so step 2 completes, the
state is saved and KeyboardInterrupt / Terminated is raised); and resumed from that state to the
end. The resumed run's trained parameters must equal the straight run's bit for bit (CPU). One
more test does the same through the CLI in a subprocess that receives SIGTERM from outside.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lmforge.errors import ConfigError, Terminated

TINY = {"n_layer": 1, "n_head": 2, "d_model": 16, "max_seq_len": 32}
STEPS, STOP_IN = 4, 2  # the signal arrives during step STOP_IN
LOOP = dict(max_iters=STEPS, eval_interval=STEPS, log_interval=1, progress=False)
ALIGN = dict(init="scratch", model=TINY, max_len=32, n_train=32, n_eval=4, batch_size=4,
             threads=1, device="cpu", seed=5, **LOOP)  # fmt: skip
RL = dict(data="task:add:1", batch_size=2, group_size=2, max_new_tokens=4, n_eval=2, lr=1e-3)
TEXT = "The cat sat on the mat. The dog ate the bone. A bird sang in the tree.\n\n" * 30


def distinct(record: dict, completion: str) -> float:
    """A reward a random policy's samples differ in (the verifier gives them all 0)."""
    return float(len(set(completion)))


def build(name: str, out: Path, shared: Path, resume: bool = False):
    """The trainer `name` writing to `out` (`shared`: inputs made once per session)."""
    quiet = lambda *a, **k: None  # noqa: E731
    if name == "pretrain":
        from lmforge.train.config import TrainConfig
        from lmforge.train.pretrain import Pretrainer

        cfg = TrainConfig(out_dir=str(out), data=str(shared / "corpus.txt"), tokenizer="char",
                          batch_size=2, block_size=16, grad_accum=2, eval_iters=1, samples=0,
                          device="cpu", model=dict(TINY, max_seq_len=16), warmup_iters=1,
                          **LOOP)  # fmt: skip
        return Pretrainer(cfg, resume=resume, log=quiet)
    if name in ("sft", "lora", "reward", "dpo", "kto", "orpo", "simpo", "grpo", "ppo", "rsft"):
        from lmforge.align.dpo import DPOConfig, DPOTrainer
        from lmforge.align.grpo import GRPOConfig, GRPOTrainer
        from lmforge.align.kto import KTOConfig, KTOTrainer
        from lmforge.align.ppo import PPOConfig, PPOTrainer
        from lmforge.align.reference_free import ORPOConfig, ORPOTrainer, SimPOConfig, SimPOTrainer
        from lmforge.align.reward import RewardConfig, RewardTrainer
        from lmforge.align.rsft import RSFTConfig, RSFTTrainer
        from lmforge.align.sft import SFTConfig, SFTTrainer

        config_cls, trainer_cls, fields = {
            "sft": (SFTConfig, SFTTrainer, dict(eval_generate=0, grad_accum=2)),
            "lora": (SFTConfig, SFTTrainer, dict(eval_generate=0, peft="lora", lr=3e-3)),
            "reward": (RewardConfig, RewardTrainer, dict(grad_accum=2)),
            "dpo": (DPOConfig, DPOTrainer, dict(lr=3e-3)),
            "kto": (KTOConfig, KTOTrainer, dict(lr=3e-3, warmup_iters=1)),
            "orpo": (ORPOConfig, ORPOTrainer, dict(lr=3e-3)),
            "simpo": (SimPOConfig, SimPOTrainer, dict(lr=3e-3)),
            "grpo": (GRPOConfig, GRPOTrainer, RL),
            "ppo": (PPOConfig, PPOTrainer, dict(RL, minibatch_size=2, ppo_epochs=1)),
            "rsft": (RSFTConfig, RSFTTrainer, dict(RL, minibatch_size=2, sft_epochs=1)),
        }[name]
        cfg = config_cls(**{**ALIGN, **fields, "out_dir": str(out)})
        extra = {"reward": distinct} if name in ("grpo", "ppo", "rsft") else {}
        return trainer_cls(cfg, resume=resume, log=quiet, **extra)
    if name == "bert":
        from lmforge.train.encoder import EncoderPretrainer, EncoderTrainConfig

        cfg = EncoderTrainConfig(out_dir=str(out), data=str(shared / "corpus.txt"),
                                 tokenizer="char", block_size=16, batch_size=4, eval_iters=1,
                                 model={"d_model": 16, "n_layer": 1, "n_head": 2, "d_ff": 32},
                                 device="cpu", **LOOP)  # fmt: skip
        return EncoderPretrainer(cfg, resume=resume, log=quiet)
    if name == "classify":
        from lmforge.train.classify import ClassifyTrainConfig, ClassifyTrainer

        cfg = ClassifyTrainConfig(checkpoint=str(shared / "bert"), out_dir=str(out), max_len=16,
                                  batch_size=4, threads=1, **LOOP)  # fmt: skip
        return ClassifyTrainer(cfg, resume=resume, log=quiet)
    if name == "seq2seq":
        from lmforge.train.seq2seq import Seq2SeqTrainConfig, Seq2SeqTrainer

        cfg = Seq2SeqTrainConfig(out_dir=str(out), max_number=100, batch_size=4, beam=1,
                                 model={"d_model": 16, "d_ff": 32, "n_head": 2},
                                 **LOOP)  # fmt: skip
        return Seq2SeqTrainer(cfg, resume=resume, log=quiet)
    if name == "vlm":
        from lmforge.vlm.train import VLMTrainConfig, VLMTrainer

        cfg = VLMTrainConfig(out_dir=str(out), batch_size=2, eval_size=2, vision_layers=1,
                             vision_heads=2, vision_dim=16, report=False, text_dropout=0.1,
                             model={"n_layer": 1, "n_head": 2, "d_model": 16}, threads=1,
                             **LOOP)  # fmt: skip
        return VLMTrainer(cfg, resume=resume, log=quiet)
    raise ValueError(name)


TRAINERS = ["pretrain", "sft", "lora", "reward", "dpo", "kto", "orpo", "simpo", "grpo", "ppo",
            "rsft", "bert", "classify", "seq2seq", "vlm"]  # fmt: skip


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """A text corpus and a random BERT checkpoint (the classifier's starting point)."""
    from lmforge.model.bert import BertConfig, BertForMaskedLM
    from lmforge.train.classify import demo_dataset
    from lmforge.train.encoder import save_bert, train_bert_tokenizer

    root = tmp_path_factory.mktemp("shared")
    (root / "corpus.txt").write_text(TEXT)
    tok = train_bert_tokenizer([t for t, _ in demo_dataset(200, 10)[0]], "word", 200)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.vocab_size, d_model=16, n_layer=1, n_head=2, d_ff=32,
                     max_position=16, use_pooler=False)  # fmt: skip
    save_bert(BertForMaskedLM(cfg), tok, root / "bert")
    return root


def trained(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.module.named_parameters()}


@pytest.fixture(scope="module")
def straight(shared, tmp_path_factory):
    """name -> the trained parameters of an uninterrupted run (each made when first needed)."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def get(name: str) -> dict[str, torch.Tensor]:
        if name not in cache:
            trainer = build(name, tmp_path_factory.mktemp(name), shared)
            trainer.run()
            cache[name] = trained(trainer)
        return cache[name]

    return get


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
@pytest.mark.parametrize("name", TRAINERS)
def test_interrupted_run_resumes_to_the_same_weights(name, signum, shared, straight, tmp_path):
    trainer = build(name, tmp_path / "run", shared)
    learn = trainer.learn

    def learn_and_get_signalled(batch):
        if trainer.step == STOP_IN - 1:
            os.kill(os.getpid(), signum)  # mid-step: the handler only asks for a stop
        return learn(batch)

    trainer.learn = learn_and_get_signalled
    expected = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    with pytest.raises(expected):
        trainer.run()
    assert trainer.step == STOP_IN  # the step in progress was finished, then saved

    resumed = build(name, tmp_path / "run", shared, resume=True)
    assert resumed.step == STOP_IN
    resumed.run()
    reference = straight(name)
    weights = trained(resumed)
    assert sorted(weights) == sorted(reference)
    for key, value in weights.items():
        assert torch.equal(value, reference[key]), f"{name}: {key} differs after the resume"


def test_old_names_say_the_new_one(tmp_path):
    from lmforge.train.config import TrainConfig, build_config
    from lmforge.vlm.train import VLMTrainConfig

    with pytest.raises(ConfigError, match="^command line: steps is now called max_iters$"):
        build_config(VLMTrainConfig, None, {"steps": 10})
    path = tmp_path / "old.yaml"
    path.write_text("warmup: 5\n")
    with pytest.raises(ConfigError, match=r"old.yaml: warmup is now called warmup_iters$"):
        build_config(TrainConfig, path, {})


def metrics_rows(path: Path) -> int:
    if not path.is_file():
        return 0
    with open(path, newline="") as fh:
        return sum(row["split"] == "train" for row in csv.DictReader(fh))


def test_sigterm_from_outside_then_resume_matches_a_straight_run(tmp_path):
    """`lmforge sft` in a subprocess, SIGTERM from this process once it has logged a step (so at
    whatever point of a step it happens to be): exit status 128+15, a saved step; `--resume`
    in this process then ends with the weights of a run that was never stopped."""
    from safetensors.torch import load_file

    from lmforge.cli.main import main

    steps = 150
    args = ["--init", "scratch", "--data", "task:add", "--max_len", "32", "--n_train", "32",
            "--n_eval", "4", "--batch_size", "4", "--max_iters", str(steps), "--eval_interval",
            str(steps), "--log_interval", "1", "--eval_generate", "0", "--progress", "false",
            "--threads", "1", "--device", "cpu", "--seed", "5", "--model.n_layer", "1",
            "--model.n_head", "2", "--model.d_model", "16"]  # fmt: skip
    assert main(["sft", *args, "--out_dir", str(tmp_path / "straight")]) == 0

    out = tmp_path / "stopped"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", "sft", *args, "--out_dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    deadline = time.monotonic() + 300
    while metrics_rows(out / "metrics.csv") < 1:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no training step logged"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "interrupted: checkpoint saved at step" in stdout, stdout + stderr
    assert main(["sft", *args, "--out_dir", str(out), "--resume"]) == 0
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(out / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
