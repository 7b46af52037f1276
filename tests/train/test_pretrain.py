import csv
import json
import math
from pathlib import Path

import pytest
import torch
from corpus_config import corpus_config

from lmforge.errors import CheckpointError, ConfigError, NonFiniteLoss
from lmforge.train.config import TrainConfig, build_config, parse_overrides
from lmforge.train.optim import LossScaler, cosine_lr
from lmforge.train.pretrain import Pretrainer

TEXT = (
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 40
)


def config(tmp_path, **kw) -> TrainConfig:
    base = dict(
        out_dir=str(tmp_path / "run"), tokenizer="char", batch_size=4,
        block_size=16, max_iters=12, eval_interval=4, eval_iters=2, log_interval=1,
        warmup_iters=2, progress=False, samples=0, seed=3,
        model=dict(n_layer=1, n_head=2, d_model=16, max_seq_len=16),
    )  # fmt: skip
    return corpus_config(TrainConfig, tmp_path, TEXT, base, **kw)


def train_losses(out_dir) -> list[float]:
    with open(out_dir / "metrics.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r["split"] == "train" and r["metric"] == "loss"]
    return [float(r["value"]) for r in rows]


def test_run_writes_checkpoint_metrics_and_plot(tmp_path):
    cfg = config(tmp_path)
    result = Pretrainer(cfg, log=lambda *_: None).run()
    out = tmp_path / "run"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.csv", "loss.png",
                 "training_state.safetensors"):  # fmt: skip
        assert (out / name).is_file(), name
    assert result["step"] == 12 and result["val_loss"] > 0
    assert train_losses(out)[-1] < train_losses(out)[0]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_continues_exactly(tmp_path, optimizer):
    # two data lanes and dropout: both lane streams and the masks must continue exactly
    model = dict(n_layer=1, n_head=2, d_model=16, max_seq_len=16, dropout=0.1)
    lanes = dict(grad_accum=2, optimizer=optimizer, model=model)
    full = Pretrainer(config(tmp_path / "a", **lanes), log=lambda *_: None)
    reference = [full.train_step() for _ in range(12)]

    first = config(tmp_path / "b", max_iters=12, **lanes)
    first.max_time = None
    trainer = Pretrainer(first, log=lambda *_: None)
    while trainer.step < 5:  # stop part-way, as an interrupted run would
        trainer.train_step()
        trainer.metrics.log(trainer.step, "train", loss=0.0)
    trainer.save_checkpoint()
    torch.rand(100)  # a fresh process's RNG is not where the saving one left it
    resumed = Pretrainer(config(tmp_path / "b", **lanes), resume=True, log=lambda *_: None)
    assert resumed.step == 5
    losses = [resumed.train_step() for _ in range(7)]
    assert losses == reference[5:]  # bit-for-bit on CPU


def test_resume_without_state_fails(tmp_path):
    with pytest.raises(CheckpointError, match="no training state"):
        Pretrainer(config(tmp_path), resume=True)


def test_nan_loss_stops_and_keeps_last_checkpoint(tmp_path):
    cfg = config(tmp_path, max_iters=8)
    trainer = Pretrainer(cfg, log=lambda *_: None)
    trainer.train_step()
    trainer.save_checkpoint()
    saved = (tmp_path / "run" / "model.safetensors").read_bytes()
    with torch.no_grad():
        trainer.model.embed.weight.fill_(float("nan"))
    # every weight but the (tied) embedding, which is NaN by now
    before = {k: v.clone() for k, v in trainer.model.state_dict().items() if v.isfinite().all()}
    assert any(k.startswith("blocks.") for k in before)
    adam_steps = [s["step"].item() for s in trainer.optimizer.state.values()]
    with pytest.raises(NonFiniteLoss, match="last good checkpoint"):
        trainer.run()
    assert (tmp_path / "run" / "model.safetensors").read_bytes() == saved
    # the check comes before opt.step(): NaN gradients (clipped to NaN everywhere) never reached
    # the other weights or AdamW's moments, and the step counter did not move
    assert trainer.step == 1
    assert [s["step"].item() for s in trainer.optimizer.state.values()] == adam_steps
    for name, value in before.items():
        assert torch.equal(trainer.model.state_dict()[name], value), name


def test_cosine_schedule():
    assert cosine_lr(0, 1.0, 0.1, 10, 100) == pytest.approx(1 / 11)
    assert cosine_lr(10, 1.0, 0.1, 10, 100) == pytest.approx(1.0)
    assert cosine_lr(55, 1.0, 0.1, 10, 100) == pytest.approx(0.55)
    assert cosine_lr(100, 1.0, 0.1, 10, 100) == pytest.approx(0.1)
    assert cosine_lr(500, 1.0, 0.1, 10, 100) == 0.1


def test_loss_scaler_skips_inf_and_grows():
    p = torch.nn.Parameter(torch.ones(3))
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    p.grad = torch.tensor([8.0, 16.0, float("inf")])
    assert not scaler.unscale_and_check([p]) and scaler.scale == 4.0
    for _ in range(2):
        p.grad = torch.tensor([4.0, 4.0, 4.0])
        assert scaler.unscale_and_check([p])
    assert torch.equal(p.grad, torch.ones(3)) and scaler.scale == 8.0


def test_config_overrides_and_unknown_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_iters: 10\nmodel:\n  n_layer: 2\n")
    cfg = build_config(TrainConfig, path, parse_overrides(["--lr", "3e-4", "--model.d_model=64"]))
    assert cfg.optim.max_iters == 10 and cfg.optim.lr == 3e-4
    assert cfg.model == {"n_layer": 2, "d_model": 64}
    with pytest.raises(ConfigError, match="max_iter.*valid keys"):
        build_config(TrainConfig, None, {"max_iter": 3})
    path.write_text("max_iters: [1,\n")
    with pytest.raises(ConfigError, match="c.yaml:"):
        build_config(TrainConfig, path, {})


def test_ctrl_c_mid_step_finishes_the_step_then_saves(tmp_path):
    """A real SIGINT during step 4: the loop finishes that step, saves, and raises; a second one
    during a step stops at once without saving (the saved step-4 state is kept)."""
    import os
    import signal

    trainer = Pretrainer(config(tmp_path, max_iters=50), log=lambda *_: None)
    real_step = trainer.learn

    def interrupted(batch):
        if trainer.step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the handler only asks for a stop
        return real_step(batch)

    trainer.learn = interrupted
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert trainer.step == 4
    resumed = Pretrainer(config(tmp_path, max_iters=50), resume=True, log=lambda *_: None)
    assert resumed.step == 4

    def twice(batch):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the second one raises here, mid-step
        return real_step(batch)

    resumed.learn = twice
    with pytest.raises(KeyboardInterrupt):
        resumed.run()
    assert Pretrainer(config(tmp_path, max_iters=50), resume=True, log=print).step == 4


def test_validation_reports_bits_per_byte_of_the_scored_tokens(tmp_path):
    """val_bpb = summed NLL of the validation targets scored / (ln 2 x their UTF-8 bytes), the
    bytes counted by decoding each target token: in the result, final_metrics.json, metrics.csv
    and the eval line. Multi-byte characters make bytes != tokens != characters-as-bytes."""
    text = "Ça a été très bien — naïve café, 東京.\n" * 60
    cfg = config(tmp_path, eval_iters=3, max_iters=4, eval_interval=2)
    Path(cfg.data).write_text(text)
    trainer = Pretrainer(cfg, log=lambda *_: None)
    result = trainer.run()

    T, n_blocks = cfg.block_size, cfg.eval_iters * cfg.batch_size
    tokens = torch.as_tensor(trainer.val_shard.tokens.astype("int64"))
    assert (len(tokens) - 1) // T >= n_blocks  # the val split holds every block scored
    x = tokens[: n_blocks * T].view(n_blocks, T)
    y = tokens[1 : n_blocks * T + 1].view(n_blocks, T)
    with torch.no_grad():
        logp = torch.log_softmax(trainer.model.eval()(x).double(), -1)
    nats = -logp.gather(-1, y[..., None]).sum().item()
    tok = trainer.tokenizer
    n_bytes = sum(len(tok.decode([int(t)]).encode("utf-8")) for t in y.flatten())
    assert n_bytes > y.numel()  # multi-byte characters are scored
    expected = nats / (math.log(2) * n_bytes)
    assert result["val_bpb"] == pytest.approx(expected, rel=1e-4)
    assert result["val_loss"] == pytest.approx(nats / y.numel(), rel=1e-4)

    saved = json.loads((Path(cfg.out_dir) / "final_metrics.json").read_text())
    assert saved["val_bpb"] == pytest.approx(expected, rel=1e-4)
    with open(Path(cfg.out_dir) / "metrics.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r["split"] == "val" and r["metric"] == "bpb"]
    assert [int(r["step"]) for r in rows] == [2, 4]
    assert float(rows[-1]["value"]) == pytest.approx(expected, rel=1e-4)
    assert f"val bpb {expected:.4f}" in trainer.eval_line(result)


def test_redirected_run_logs_plain_lines(tmp_path, capsys):
    """stderr not a terminal (pytest's capture, a redirected log): no carriage-return bar."""
    Pretrainer(config(tmp_path, progress=True, eval_interval=6), log=lambda *_: None).run()
    err = capsys.readouterr().err
    assert "\r" not in err
    assert "pretraining: 12/12 it" in err and "step 6: train" in err
    # whole lines only: progress (every 5 s and a closing one), tokenizing, evaluations
    kinds = ("pretraining: ", "tokenizing: ", "step ")
    assert all(line.startswith(kinds) for line in err.splitlines())


def test_loss_milestones_and_target_loss(tmp_path):
    cfg = config(tmp_path, loss_milestones=[9.0, 0.0], target_loss=4.0, max_iters=40,
                 eval_interval=4, lr=1e-2)  # fmt: skip
    assert cfg.loss_milestones == [9.0, 4.0, 0.0]  # the target is a milestone too
    lines = []
    trainer = Pretrainer(cfg, log=lines.append)
    result = trainer.run()
    reached = result["milestones"]
    assert set(reached) == {"9", "4"}  # 0.0 is never reached
    assert reached["9"]["step"] <= reached["4"]["step"] == result["step"] < 40  # stopped there
    assert reached["4"]["val_loss"] <= 4.0 and reached["4"]["seconds"] > 0
    saved = json.loads((tmp_path / "run" / "final_metrics.json").read_text())
    assert saved["milestones"] == reached


def test_muon_wsd_run_learns(tmp_path):
    cfg = config(tmp_path, optimizer="muon", schedule="wsd", muon_lr=0.05, lr=1e-2, max_iters=30,
                 model=dict(n_layer=1, n_head=2, d_model=16, max_seq_len=16, mlp="relu2",
                            qk_norm=True, zero_init_proj=True))  # fmt: skip
    result = Pretrainer(cfg, log=lambda *_: None).run()
    losses = train_losses(tmp_path / "run")
    assert losses[-1] < losses[0] - 0.5 and math.isfinite(result["val_loss"])


def test_mfu_reported_against_a_given_peak(tmp_path, capsys):
    """On a CPU MFU needs peak_tflops; then every logged throughput window and the final report
    carry it: tokens/s x training FLOPs per token (of the trained block) / peak."""
    from lmforge.model.info import flops_per_token

    plain = Pretrainer(config(tmp_path / "a", max_iters=4), log=lambda *_: None).run()
    assert "mfu" not in plain and plain["tokens_per_s"] > 0
    cfg = config(tmp_path / "b", max_iters=4, peak_tflops=0.5, progress=True)
    trainer = Pretrainer(cfg, log=lambda *_: None)
    result = trainer.run()
    flops = flops_per_token(trainer.model_config, cfg.block_size)["training"]
    assert trainer.model_config.max_seq_len == 16 and flops > 0
    assert result["mfu"] == pytest.approx(result["tokens_per_s"] * flops / 0.5e12)
    with open(tmp_path / "b" / "run" / "metrics.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r["split"] == "train"]
    rates = {r["step"]: float(r["value"]) for r in rows if r["metric"] == "tokens_per_s"}
    mfus = {r["step"]: float(r["value"]) for r in rows if r["metric"] == "mfu"}
    assert set(mfus) == set(rates) == {"1", "2", "3", "4"}
    for step, mfu in mfus.items():
        assert mfu == pytest.approx(rates[step] * flops / 0.5e12, rel=1e-4)  # CSV: 6 digits
    assert "mfu=" in capsys.readouterr().err  # the progress line shows it
    # and over the steps after the first log_interval (1 here: steps 2-4 of 4)
    assert result["warmup_steps"] == 1 and result["tokens_per_s_after_warmup"] > 0
    assert result["mfu_after_warmup"] == pytest.approx(
        result["tokens_per_s_after_warmup"] * flops / 0.5e12
    )
    with pytest.raises(ConfigError, match="peak_tflops"):
        config(tmp_path / "c", peak_tflops=0)


def test_fast_shakespeare_config_is_no_larger_than_nanogpts_recipe(nanogpt):
    """configs/shakespeare-char-fast.yaml keeps to the parameter count of nanoGPT's CPU recipe
    (its own model.py builds the reference: 4 layers, 4 heads, 128 wide, block 64, 65 chars)."""
    from lmforge.model.transformer import Transformer
    from lmforge.tokenizer import DEFAULT_SPECIAL_TOKENS

    ref = nanogpt.GPT(nanogpt.GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4,
                                        n_embd=128, dropout=0.0, bias=False))  # fmt: skip
    ref_params = sum(p.numel() for p in ref.parameters())  # position table included
    root = Path(__file__).resolve().parents[2]
    cfg = build_config(TrainConfig, root / "configs" / "shakespeare-char-fast.yaml", {})
    ours = Transformer(cfg.model_config(65 + len(DEFAULT_SPECIAL_TOKENS)))  # chars + specials
    assert ours.num_parameters() <= ref_params
    assert cfg.eval_iters * cfg.batch_size == 20 * 12  # nanoGPT's recipe scores 240 blocks


def test_gpt2_small_gpu_config_is_gpt2_small():
    """configs/gpt2-small-gpu.yaml: GPT-2 small's 124M parameters (vocabulary padded to 50,304,
    whatever the tokenizer's size), sequence 1,024, ~0.5M tokens per step, bf16 and compiled."""
    from lmforge.model.transformer import Transformer

    root = Path(__file__).resolve().parents[2]
    cfg = build_config(TrainConfig, root / "configs" / "gpt2-small-gpu.yaml", {})
    config = cfg.model_config(cfg.vocab_size)
    shape = (config.n_layer, config.n_head, config.d_model, config.vocab_size)
    assert shape == (12, 12, 768, 50304)
    with torch.device("meta"):
        assert 124e6 < Transformer(config).num_parameters() < 125e6
    assert cfg.block_size == config.max_seq_len == 1024
    assert cfg.batch_size * cfg.block_size * cfg.optim.grad_accum == 524_288
    assert (cfg.dtype, cfg.compile, cfg.device) == ("bfloat16", True, "cuda")
