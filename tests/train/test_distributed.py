"""Multi-process pretraining: torchrun with gloo on CPU, DDP and FSDP2, sharded checkpoints.

The slow tests launch `torchrun --standalone --nproc_per_node 2 -m lmforge pretrain` as a
subprocess and compare it with the plain `lmforge pretrain` a user starts with (run in this
process, no launcher start-up), which keeps the module well under two minutes. Dropout is on, so
the comparisons also cover the model's own randomness.
"""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint

from lmforge.cli.main import main as cli
from lmforge.data import BatchSampler, TokenShard
from lmforge.errors import CheckpointError, ConfigError, DataError
from lmforge.train.config import TrainConfig
from lmforge.train.parallel import setup_parallel
from lmforge.train.pretrain import Pretrainer, lm_loss
from lmforge.train.samplers import LaneSampler
from lmforge.train.sharded_checkpoint import consolidate

TEXT = (
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 40
)
STEPS = 24
ARGS = dict(
    tokenizer="char", batch_size=4, block_size=16, grad_accum=4, max_iters=STEPS,
    lr_decay_iters=STEPS, eval_interval=12, eval_iters=2, log_interval=1, warmup_iters=2,
    progress=False, samples=0, seed=3, device="cpu",
    model=dict(n_layer=2, n_head=2, d_model=16, max_seq_len=16, dropout=0.1),
)  # fmt: skip


def corpus(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "corpus.txt").write_text(TEXT)
    return root / "corpus.txt"


def config(root: Path, out: str, **kw) -> TrainConfig:
    return TrainConfig(**{**ARGS, "out_dir": str(root / out), "data": str(corpus(root)), **kw})


def cli_args(cfg: TrainConfig) -> list[str]:
    args = []
    for key, value in cfg.to_dict().items():
        if key == "model":
            args += [a for k, v in value.items() for a in (f"--model.{k}", str(v))]
        elif value is not None and key in {*ARGS, "out_dir", "data", "checkpoint_interval",
                                           "parallel"}:  # fmt: skip
            args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return args


def torchrun(
    cfg: TrainConfig, nproc: int, resume: bool = False, script: Path | None = None
) -> subprocess.Popen:
    """`torchrun ... -m lmforge pretrain` (or `torchrun ... script pretrain`) on cfg."""
    entry = [str(script)] if script else ["-m", "lmforge"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *entry, "pretrain", *cli_args(cfg)]  # fmt: skip
    if resume:
        cmd.append("--resume")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out.decode()[-3000:]
    return out.decode()


def plain_run(cfg: TrainConfig) -> Path:
    """`lmforge pretrain` as a user types it, without torchrun (in this process)."""
    assert not {"RANK", "WORLD_SIZE"} & set(os.environ), "the plain run must not see torchrun"
    assert cli(["pretrain", *cli_args(cfg)]) == 0
    return Path(cfg.out_dir)


def run_in_process(world_of_one, cfg: TrainConfig, resume: bool = False) -> Path:
    with world_of_one():
        Pretrainer(cfg, resume=resume, log=lambda *_: None).run()
    return Path(cfg.out_dir)


def losses(out: Path, split: str = "train") -> np.ndarray:
    """Logged losses of a run, in step order ("train": every step; "val": every evaluation)."""
    with open(out / "metrics.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r["split"] == split and r["metric"] == "loss"]
    return np.array([float(r["value"]) for r in rows])


def assert_same_run(a: Path, b: Path) -> None:
    """Same logged losses (metrics.csv keeps 6 significant digits, hence 1e-4), same evaluations
    at the same steps, same final weights."""
    np.testing.assert_allclose(losses(a), losses(b), atol=1e-4, rtol=0)
    np.testing.assert_allclose(losses(a, "val"), losses(b, "val"), atol=1e-4, rtol=0)
    assert_same_weights(a, b, atol=1e-5)


def assert_same_weights(a: Path, b: Path, atol: float) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(wa) == sorted(wb)
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=atol, rtol=0, msg=name)


def latest_step(out: Path) -> int:
    try:
        return json.loads((out / "checkpoints" / "latest.json").read_text())["step"]
    except (OSError, ValueError):
        return 0


# ---- fast: configuration, data lanes, single-process features -------------------------------
def test_world_size_must_divide_grad_accum(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="grad_accum=4 is not divisible by the world size 3"):
        setup_parallel(config(tmp_path, "run"), torch.device("cpu"))


def test_unknown_parallel_strategy(tmp_path):
    with pytest.raises(ConfigError, match="parallel must be one of ddp, fsdp"):
        Pretrainer(config(tmp_path, "run", parallel="zero3"))


def test_lanes_give_the_same_global_batch_on_any_world_size():
    shard = TokenShard(np.arange(500, dtype=np.uint16))
    one = LaneSampler(shard, 2, 8, seed=5, lanes=range(0, 4))
    two = [LaneSampler(shard, 2, 8, seed=5, lanes=range(r * 2, r * 2 + 2)) for r in range(2)]
    for _ in range(3):  # three optimizer steps of 4 micro-batches
        global_batch = [one.next_batch()[0] for _ in range(4)]
        split = [rank.next_batch()[0] for rank in two for _ in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(global_batch, split))
        assert not torch.equal(global_batch[0], global_batch[1])  # lanes are distinct streams
    lane0 = LaneSampler(shard, 2, 8, seed=5, lanes=range(1))
    torch.testing.assert_close(lane0.next_batch(), BatchSampler(shard, 2, 8, seed=5).next_batch())


def test_single_stream_state_of_an_earlier_plain_run():
    """A plain run used to draw every micro-batch from one BatchSampler: that stream is lane 0's,
    so it continues exactly with grad_accum 1 and is refused (naming why) otherwise."""
    shard = TokenShard(np.arange(500, dtype=np.uint16))
    old = BatchSampler(shard, 2, 8, seed=5)
    old.next_batch()
    lanes = LaneSampler(shard, 2, 8, seed=5, lanes=range(1))
    lanes.load_state_dict(old.state_dict())
    torch.testing.assert_close(lanes.next_batch(), old.next_batch())
    with pytest.raises(DataError, match="one data stream.*grad_accum 1, not 2"):
        LaneSampler(shard, 2, 8, seed=5, lanes=range(2)).load_state_dict(old.state_dict())


def test_plain_run_is_a_torchrun_world_of_one(tmp_path, world_of_one):
    """`lmforge pretrain` draws the torchrun lanes itself (grad_accum 4, dropout on): the same
    losses, evaluations and weights as the distributed code path."""
    short = dict(max_iters=4, eval_interval=2)
    plain = plain_run(config(tmp_path, "plain", **short))
    one = run_in_process(world_of_one, config(tmp_path, "one", **short))
    assert len(losses(plain)) == 4 and len(losses(plain, "val")) == 2
    assert_same_run(plain, one)


def test_logged_loss_is_one_forward_over_the_global_batch(tmp_path):
    """Step 1's logged loss is the mean over all batch_size x grad_accum sequences, i.e. what
    one forward pass over the whole global batch (every lane) scores."""
    trainer = Pretrainer(config(tmp_path, "run", model={**ARGS["model"], "dropout": 0.0}))
    lanes = LaneSampler(trainer.train_shard, 4, 16, seed=3, lanes=range(4))
    x, y = (torch.cat(parts) for parts in zip(*(lanes.next_batch() for _ in range(4))))
    assert x.shape == (16, 16)
    with torch.no_grad():
        expected = lm_loss(trainer.model(x), y).item()
    assert trainer.train_step()["loss"] == pytest.approx(expected, abs=1e-6)


def test_init_ignores_what_the_data_step_did_with_the_rng(tmp_path, monkeypatch):
    """Under torchrun only rank 0 trains the tokenizer and builds the shards; whatever that uses
    of the global RNG must not change the weights it starts from (FSDP2 keeps each rank's own)."""
    quiet = lambda *_: None
    reference = Pretrainer(config(tmp_path, "a"), log=quiet).model.state_dict()
    from lmforge.train import pretrain

    real = pretrain.prepare_corpus

    def prepare_corpus_using_the_rng(*args, **kwargs):
        torch.rand(1000)
        return real(*args, **kwargs)

    monkeypatch.setattr(pretrain, "prepare_corpus", prepare_corpus_using_the_rng)
    other = Pretrainer(config(tmp_path, "b"), log=quiet).model.state_dict()
    for name, tensor in reference.items():
        torch.testing.assert_close(other[name], tensor, atol=0, rtol=0, msg=name)


def test_activation_checkpointing_leaves_the_losses_unchanged(tmp_path):
    quiet = lambda *_: None
    plain = Pretrainer(config(tmp_path, "a"), log=quiet)
    recompute = Pretrainer(config(tmp_path, "b", activation_checkpointing=True), log=quiet)
    assert all(block.forward.func is checkpoint for block in recompute.model.blocks)
    for _ in range(3):
        assert recompute.train_step()["loss"] == pytest.approx(plain.train_step()["loss"], abs=1e-6)


# ---- in-process world of one: sharded checkpoints and their errors --------------------------
@pytest.fixture
def sharded_run(tmp_path, world_of_one) -> Path:
    return run_in_process(world_of_one, config(tmp_path, "run", max_iters=3, eval_interval=3))


def test_consolidate_matches_the_exported_model(sharded_run, tmp_path, capsys):
    assert cli(["checkpoint", "consolidate", str(sharded_run), "--out", str(tmp_path / "c")]) == 0
    assert_same_weights(sharded_run, tmp_path / "c", atol=0)
    assert (tmp_path / "c" / "tokenizer.json").is_file()
    assert cli(["checkpoint", "consolidate", str(tmp_path / "nowhere")]) == 2
    assert "no sharded checkpoint" in capsys.readouterr().err


def test_resume_with_another_model_config_fails_before_training(
    sharded_run, tmp_path, world_of_one
):
    cfg = config(tmp_path, "run", max_iters=6, model={**ARGS["model"], "d_model": 32})
    with world_of_one(), pytest.raises(CheckpointError, match=r"different model config.*d_model"):
        Pretrainer(cfg, resume=True)


def test_missing_shard_fails_before_training(sharded_run, tmp_path, world_of_one):
    step_dir = next((sharded_run / "checkpoints").glob("step_*"))
    (step_dir / "rank0.safetensors").unlink()
    with world_of_one(), pytest.raises(CheckpointError, match=r"missing shard .*rank0.safetensors"):
        Pretrainer(config(tmp_path, "run", max_iters=6), resume=True)
    with pytest.raises(CheckpointError, match="missing shard"):
        consolidate(sharded_run, tmp_path / "c")


# ---- slow: torchrun with 2 processes ---------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def reference(root) -> Path:
    """The plain single-process run (no torchrun), global batch batch_size 4 x grad_accum 4."""
    return plain_run(config(root, "ref"))


@pytest.fixture(scope="module")
def ddp(root) -> Path:
    cfg = config(root, "ddp")
    finish(torchrun(cfg, 2))
    return Path(cfg.out_dir)


@pytest.mark.slow
def test_ddp_two_processes_match_the_plain_run(reference, ddp):
    ref = losses(reference)
    assert len(ref) == len(losses(ddp)) == STEPS and len(losses(ddp, "val")) == 2
    assert ref[-1] < ref[0] - 0.1  # it learns
    assert_same_run(ddp, reference)
    assert sorted(p.name for p in (ddp / "checkpoints").glob("step_*/*.safetensors")) == [
        "rank0.safetensors", "rank1.safetensors"
    ]  # fmt: skip


@pytest.mark.slow
def test_fsdp2_two_processes_match_the_plain_run_on_cpu(reference, root):
    cfg = config(root, "fsdp", parallel="fsdp")
    out = finish(torchrun(cfg, 2))
    assert out.count("final: step") == 1  # rank 0 alone prints
    assert len(losses(Path(cfg.out_dir))) == STEPS
    assert_same_run(Path(cfg.out_dir), reference)  # weights gathered to rank 0
    consolidate(cfg.out_dir, root / "fsdp_consolidated")
    assert_same_weights(root / "fsdp_consolidated", Path(cfg.out_dir), atol=0)


KILL_AT = 6
# a torchrun entry point: `lmforge` whose rank 1 SIGKILLs itself before step KILL_AT + 1, once
# rank 0 has pointed latest.json at step KILL_AT's complete checkpoint. The kill is tied to a
# step, not to a clock, so a fast or a slow machine kills at the same place.
KILL_RANK_1 = """
import json, os, signal, sys, time
from pathlib import Path

from lmforge.cli.main import main
from lmforge.train.pretrain import Pretrainer

KILL_AT = {kill_at}
train_step = Pretrainer.train_step


def saved_step(out_dir):
    try:
        return json.loads((Path(out_dir) / "checkpoints" / "latest.json").read_text())["step"]
    except (OSError, ValueError):  # not there yet, or caught mid-write
        return 0


def train_step_or_die(self):
    if self.step == KILL_AT and os.environ["RANK"] == "1":
        deadline = time.monotonic() + 120
        while saved_step(self.out_dir) < KILL_AT:
            if time.monotonic() > deadline:
                print("rank 0 never wrote the step", KILL_AT, "checkpoint", force=True)
                os._exit(3)
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    return train_step(self)


Pretrainer.train_step = train_step_or_die
sys.exit(main())
"""


@pytest.mark.slow
def test_killed_rank_resumes_to_the_same_weights(ddp, root, world_of_one):
    cfg = config(root, "killed", checkpoint_interval=1)
    script = root / "kill_rank_1.py"
    script.write_text(KILL_RANK_1.format(kill_at=KILL_AT))
    proc = torchrun(cfg, 2, script=script)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, log.decode()[-3000:]
    out = Path(cfg.out_dir)
    # rank 0 cannot finish step KILL_AT + 1 (its gradient all-reduce needs rank 1)
    assert latest_step(out) == KILL_AT, log.decode()[-3000:]
    shutil.copytree(out, root / "killed_copy")

    finish(torchrun(config(root, "killed"), 2, resume=True))
    assert_same_weights(out, ddp, atol=0)  # bit-for-bit: same world size, same reductions

    # the same checkpoint on ONE process: DCP reshards, lanes continue, same weights
    run_in_process(world_of_one, config(root, "killed_copy"), resume=True)
    assert_same_weights(root / "killed_copy", ddp, atol=1e-5)
