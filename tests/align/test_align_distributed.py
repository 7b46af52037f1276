"""Post-training under torchrun: 2 gloo processes on CPU against one process, same global batch.

One `torchrun --standalone --nproc_per_node 2` launch runs this file as a worker (the
`__main__` block): SFT through the CLI (`lmforge sft`, as users run it, and `--resume` of a
1-process run stopped half way), then DPO, reward and GRPO through the Python API, each rank
saving its own copy of the trained parameters so the test can check that the ranks agree. The
one-process references run in the pytest process.

The same launch then repeats SFT (CLI, and `--resume` of the same 1-process state), DPO and reward
with `parallel: fsdp` (FSDP2 shards), which must match one process as DDP does, and saves a
2-rank FSDP training state half way that the test resumes on one process.

GRPO's sampled completions depend on each rank's seed, so its 2-process run cannot match one
process step for step; what can be compared is the update from a FIXED rollout: each rank learns
from its share of the groups, the gradient all-reduce makes it the one-process update. Under
FSDP the same holds (gradients reduce-scattered instead), and since every rank samples from a
whole copy gathered from the shards with the same per-rank seeds as DDP, the 2-process FSDP GRPO
run is the 2-process DDP run; PPO (policy and critic sharded together) likewise.
"""

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.align.continual import ContinualConfig, ContinualTrainer
from lmforge.align.dpo import DPOConfig, DPOTrainer
from lmforge.align.grpo import GRPOConfig, GRPOTrainer
from lmforge.align.ppo import PPOConfig, PPOTrainer
from lmforge.align.reward import RewardConfig, RewardTrainer
from lmforge.align.rsft import RSFTConfig, RSFTTrainer
from lmforge.align.sft import SFTConfig, SFTTrainer
from lmforge.errors import ConfigError

TINY = {"n_layer": 1, "n_head": 2, "d_model": 16, "max_seq_len": 32}
COMMON = dict(init="scratch", model=TINY, max_len=32, n_train=64, n_eval=16, batch_size=8,
              max_iters=4, eval_interval=2, log_interval=1, progress=False, threads=1,
              device="cpu", seed=5)  # fmt: skip
RUNS = {
    "sft": (SFTConfig, SFTTrainer, dict(data="task:add", eval_generate=4, lr=3e-3)),
    "lora": (SFTConfig, SFTTrainer, dict(data="task:add", eval_generate=0, lr=3e-3, peft="lora")),
    "dpo": (DPOConfig, DPOTrainer, dict(data="task:add", lr=3e-3)),
    "reward": (RewardConfig, RewardTrainer, dict(data="task:add", lr=3e-3)),
    "grpo": (GRPOConfig, GRPOTrainer, dict(data="task:add:1", n_train=48, batch_size=4,
                                           group_size=4, max_new_tokens=4, max_iters=3, n_eval=8)),
    "ppo": (PPOConfig, PPOTrainer, dict(data="task:add:1", n_train=48, batch_size=4,
                                        group_size=2, max_new_tokens=4, max_iters=3, n_eval=8,
                                        lr=1e-3, minibatch_size=2, ppo_epochs=2,
                                        value_detach=False)),
}  # fmt: skip
quiet = lambda *args, **kwargs: None  # noqa: E731


def distinct(record: dict, completion: str) -> float:
    """A reward a random policy's groups differ in (the verifier gives them all 0)."""
    return float(len(set(completion)))


def make(name: str, out: Path, **kw):
    config_cls, trainer_cls, fields = RUNS[name]
    cfg = config_cls(**{**COMMON, **fields, "out_dir": str(out), **kw})
    rl = name in ("grpo", "ppo")
    return trainer_cls(cfg, log=quiet, **({"reward": distinct} if rl else {}))


def cli_args(name: str, out: Path) -> list[str]:
    fields = {**COMMON, **RUNS[name][2], "out_dir": str(out)}
    args = [name]
    for key, value in fields.items():
        pairs = [(f"model.{k}", v) for k, v in value.items()] if key == "model" else [(key, value)]
        for k, v in pairs:
            args += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    return args


def save_params(module: torch.nn.Module, path: Path) -> None:
    save_file({n: p.detach().clone() for n, p in module.named_parameters()}, str(path))


def fixed_rollout(t: GRPOTrainer):
    """A scored rollout of the first 4 prompts from a fixed seed (the same on every rank)."""
    rollout = t.sample(t.prompts[:4], t.records[:4], n=4, seed=11, keep_logprobs=False)
    rollout.rewards = t.reward(rollout)
    return rollout


def grpo_fixed_update(root: Path, rank: int, world: int, **kw) -> None:
    """A fresh policy takes one update from its rank's share of a fixed rollout; each rank
    saves the whole weights it ends with (under FSDP, its whole copy gathered from the shards)."""
    t = make("grpo", root, **kw)
    rollout = fixed_rollout(t)
    share = len(rollout) // world
    t.update(rollout.select(torch.arange(rank * share, (rank + 1) * share)))
    with t.whole_weights():
        save_params(t.module, root / f"rank{rank}.safetensors")


def worker(root: Path) -> None:
    """What each torchrun rank runs (see the module docstring)."""
    from lmforge.cli.main import main as cli

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert cli(cli_args("sft", root / "sft")) == 0
    assert cli([*cli_args("sft", root / "resumed"), "--resume"]) == 0
    for name in ("dpo", "reward", "grpo"):
        t = make(name, root / name)
        t.run()
        save_params(t.module, root / name / f"rank{rank}.safetensors")
    grpo_fixed_update(root / "grpo_fixed", rank, world)
    fsdp = ["--parallel", "fsdp"]
    assert cli([*cli_args("sft", root / "fsdp_sft"), *fsdp]) == 0
    assert cli([*cli_args("sft", root / "fsdp_resumed"), *fsdp, "--resume"]) == 0
    for name in ("lora", "dpo", "reward"):
        make(name, root / f"fsdp_{name}", parallel="fsdp").run()
    make("ppo", root / "ppo").run()
    for name in ("grpo", "ppo"):
        t = make(name, root / f"fsdp_{name}", parallel="fsdp")
        t.run()
        with t.whole_weights():  # every rank's copy, refreshed from the shards
            save_params(t.module, root / f"fsdp_{name}" / f"rank{rank}.safetensors")
    grpo_fixed_update(root / "fsdp_grpo_fixed", rank, world, parallel="fsdp")
    half = make("sft", root / "fsdp_half", parallel="fsdp")  # 2 of 4 steps, then the state
    for _ in range(2):
        half.train_step()
    half.save_checkpoint()


# ---- tests -------------------------------------------------------------------------------------
def losses(out: Path) -> np.ndarray:
    with open(out / "metrics.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r["split"] == "train" and r["metric"] == "loss"]
    return np.array([float(r["value"]) for r in rows])


def assert_close(a: dict, b: dict, atol: float) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    """Output root of the 2-process torchrun launch."""
    root = tmp_path_factory.mktemp("two")
    half = make("sft", root / "resumed")  # 2 of 4 steps on one process, then the state file
    for _ in range(2):
        half.train_step()
    half.save_checkpoint()
    shutil.copytree(root / "resumed", root / "fsdp_resumed")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           __file__, str(root)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("final: ") == 4  # one summary per CLI run: rank 0 alone prints
    return root


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> Path:
    """Output root of the 1-process references (each trainer run once, when first needed)."""
    return tmp_path_factory.mktemp("one")


def reference(one: Path, name: str) -> Path:
    if not (one / name / "final_metrics.json").is_file():
        make(name, one / name).run()
    return one / name


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("name", ["sft", "dpo", "reward"])
def test_two_processes_match_one(two, one, name, parallel):
    out = two / (name if parallel == "ddp" else f"fsdp_{name}")
    ref = reference(one, name)
    assert len(losses(ref)) == len(losses(out)) == COMMON["max_iters"]
    np.testing.assert_allclose(losses(out), losses(ref), atol=1e-5, rtol=0)
    drop = {"norm.bias"} if name == "reward" else set()  # a pair's loss is blind to the final
    # norm's bias (it shifts both rewards): its gradient is rounding noise, which Adam scales to
    # lr-sized steps
    kept = lambda out: {k: v for k, v in weights(out).items() if k not in drop}  # noqa: E731
    assert_close(kept(out), kept(ref), atol=1e-5)
    assert (out / "training_state.safetensors").is_file()
    assert not list(out.glob("*rank*training*"))  # one state file, written by rank 0


@pytest.mark.slow
def test_fsdp_lora_matches_one_process(two, one):
    """Frozen base weights and trained LoRA factors sharded together; the adapter and the
    merged model that rank 0 exports from its whole copy are the 1-process ones."""
    ref, out = reference(one, "lora"), two / "fsdp_lora"
    np.testing.assert_allclose(losses(out), losses(ref), atol=1e-5, rtol=0)
    assert_close(weights(out), weights(ref), atol=1e-5)
    adapter = lambda out: load_file(str(out / "adapter" / "adapter_model.safetensors"))  # noqa: E731
    assert_close(adapter(out), adapter(ref), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_one_process_state_resumes_on_two(two, parallel):
    prefix = "" if parallel == "ddp" else "fsdp_"
    assert_close(weights(two / f"{prefix}resumed"), weights(two / f"{prefix}sft"), atol=1e-5)


@pytest.mark.slow
def test_fsdp_state_resumes_on_one_process(two, tmp_path):
    """The state 2 FSDP ranks saved half way holds whole weights and Adam moments."""
    shutil.copytree(two / "fsdp_half", tmp_path / "half")
    config_cls, trainer_cls, fields = RUNS["sft"]
    cfg = config_cls(**{**COMMON, **fields, "out_dir": str(tmp_path / "half")})
    t = trainer_cls(cfg, resume=True, log=quiet)
    assert t.step == 2
    t.run()
    assert_close(weights(tmp_path / "half"), weights(two / "fsdp_sft"), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dpo", "reward", "grpo", "fsdp_grpo", "fsdp_ppo"])
def test_ranks_end_with_identical_weights(two, name):
    rank0, rank1 = (load_file(str(two / name / f"rank{r}.safetensors")) for r in (0, 1))
    assert_close(rank0, rank1, atol=0)
    start = make(name.removeprefix("fsdp_"), two / "fresh" / name).module.state_dict()
    assert any(not torch.equal(start[n], rank0[n]) for n in rank0)  # it trained
    assert np.isfinite(losses(two / name)).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_fsdp_rl_run_matches_ddp(two, name):
    """Same per-rank prompts and rollout seeds, the same mean gradient: sharding changes
    nothing, so the FSDP run samples the DDP run's completions and ends with its weights (and,
    for PPO, its critic: a value head trained through the shared trunk)."""
    fsdp, ddp = two / f"fsdp_{name}", two / name
    np.testing.assert_allclose(losses(fsdp), losses(ddp), atol=1e-5, rtol=0)
    assert_close(weights(fsdp), weights(ddp), atol=1e-5)
    if name == "ppo":
        critic = lambda out: load_file(str(out / "critic.safetensors"))  # noqa: E731
        assert_close(critic(fsdp), critic(ddp), atol=1e-5)
    assert (fsdp / "training_state.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_grpo_update_from_a_fixed_rollout_matches_one_process(two, tmp_path, parallel):
    t = make("grpo", tmp_path / "grpo")
    start = {n: p.detach().clone() for n, p in t.module.named_parameters()}
    rollout = fixed_rollout(t)
    assert rollout.rewards.view(4, 4).std(-1).gt(0).all()  # every group has a gradient
    t.update(rollout)
    ref = {n: p.detach() for n, p in t.module.named_parameters()}
    assert any(not torch.equal(start[n], ref[n]) for n in ref)
    out = two / ("grpo_fixed" if parallel == "ddp" else "fsdp_grpo_fixed")
    for rank in (0, 1):
        assert_close(load_file(str(out / f"rank{rank}.safetensors")), ref, 1e-5)


def test_batch_not_divisible_by_world_size_fails_before_any_step(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    for name in ("sft", "grpo"):
        with pytest.raises(ConfigError, match=r"batch_size=\d+ is not divisible by the world size"):
            make(name, tmp_path / name)
        assert not (tmp_path / name).exists()  # nothing loaded, nothing written


def test_fsdp_is_refused_where_the_loop_uses_whole_weights(tmp_path):
    with pytest.raises(ConfigError, match="parallel must be one of ddp, fsdp"):
        SFTConfig(parallel="zero3")
    refused = [("rsft", RSFTConfig, RSFTTrainer), ("continual", ContinualConfig, ContinualTrainer)]
    for name, config_cls, trainer_cls in refused:
        cfg = config_cls(**{**COMMON, "out_dir": str(tmp_path / name), "parallel": "fsdp"})
        with pytest.raises(ConfigError, match=f"parallel=fsdp: {name} uses the model outside"):
            trainer_cls(cfg, log=quiet)
        assert not (tmp_path / name).exists()  # refused before anything loads or is written


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
