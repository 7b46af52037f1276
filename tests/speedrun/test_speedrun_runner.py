"""The speedrun runner with stand-in stages: skipping, --from, refusing a foreign folder, and
keeping finished stages through an interruption or a full disk."""

import errno
import json

import pytest
import torch

from lmforge.errors import ConfigError, LMForgeError
from lmforge.speedrun import Speedrun, resolve_plan
from lmforge.speedrun import runner as runner_mod
from lmforge.speedrun.stages import Stage

ORDER = ["tokenizer", "pretrain", "sft"]


class Counting(Stage):
    """Records each run; optionally fails the way a real stage might."""

    def __init__(self, name, calls, fail=None):
        self.name, self.title, self.calls, self.fail = name, name, calls, fail

    def run(self, ctx):
        self.calls.append(self.name)
        (ctx.dir(self.name) / "model.txt").write_text(self.name)
        if self.fail is not None:
            raise self.fail
        return {"value": float(len(self.calls))}


@pytest.fixture
def stages(monkeypatch):
    calls = []
    fakes = {name: Counting(name, calls) for name in ORDER}
    monkeypatch.setattr(runner_mod, "STAGES", fakes)
    monkeypatch.setattr(runner_mod, "write_report", lambda out, plan, results: out / "report.md")
    return calls, fakes


def plan(**over):
    return resolve_plan("cpu-tiny", overrides={"stages": ORDER, **over})


def test_rerun_skips_finished_stages_and_from_redoes_the_rest(tmp_path, stages):
    calls, _ = stages
    Speedrun(plan(), tmp_path, log=lambda *a: None).run()
    assert calls == ORDER
    Speedrun(plan(), tmp_path, log=lambda *a: None).run()
    assert calls == ORDER  # nothing ran again
    Speedrun(plan(), tmp_path, log=lambda *a: None).run("pretrain")
    assert calls == ORDER + ["pretrain", "sft"]
    mark = json.loads((tmp_path / "sft" / "stage.json").read_text())
    assert mark["numbers"] == {"value": 5.0} and mark["settings"]["shared"]["task"] == "add:2"


def test_a_stage_that_runs_again_invalidates_the_later_ones(tmp_path, stages):
    calls, _ = stages
    Speedrun(plan(), tmp_path, log=lambda *a: None).run()
    (tmp_path / "pretrain" / "stage.json").unlink()  # e.g. interrupted while being redone
    Speedrun(plan(), tmp_path, log=lambda *a: None).run()
    assert calls == ORDER + ["pretrain", "sft"]


def test_folder_from_another_preset_or_settings_is_refused(tmp_path, stages):
    calls, _ = stages
    Speedrun(plan(), tmp_path, log=lambda *a: None).run()
    other = resolve_plan("cpu-small", overrides={"stages": ORDER})
    with pytest.raises(ConfigError, match="holds a 'cpu-tiny' speedrun"):
        Speedrun(other, tmp_path, log=lambda *a: None).run()
    changed = plan(**{"pretrain.max_iters": 7})
    with pytest.raises(ConfigError, match=r"pretrain finished with other settings.*max_iters"):
        Speedrun(changed, tmp_path, log=lambda *a: None).run()
    assert calls == ORDER  # refused before anything ran
    Speedrun(changed, tmp_path, log=lambda *a: None).run("pretrain")
    assert calls == ORDER + ["pretrain", "sft"]


@pytest.mark.parametrize(
    "failure, error",
    [
        (OSError(errno.ENOSPC, "No space left on device"), LMForgeError),
        # safetensors re-raises the OS error as its own type, with the message inside
        (
            RuntimeError("Error while serializing: IoError(No space left on device (os error 28))"),
            LMForgeError,
        ),
        (KeyboardInterrupt(), KeyboardInterrupt),
    ],  # fmt: skip
)
def test_failed_stage_keeps_finished_ones_and_continues_later(tmp_path, stages, failure, error):
    calls, fakes = stages
    fakes["sft"].fail = failure
    with pytest.raises(error) as info:
        Speedrun(plan(), tmp_path, log=lambda *a: None).run()
    if error is LMForgeError:
        assert "disk full during stage sft" in str(info.value)
    assert (tmp_path / "pretrain" / "stage.json").is_file()
    assert not (tmp_path / "sft" / "stage.json").exists()
    fakes["sft"].fail = None
    Speedrun(plan(), tmp_path, log=lambda *a: None).run()
    assert calls == ORDER + ["sft"]


def test_deterministic_runs_one_thread_and_restores_the_settings(tmp_path, monkeypatch):
    seen = []

    class Probe(Stage):
        name = title = "tokenizer"

        def run(self, ctx):
            seen.append((torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()))
            return {}

    monkeypatch.setattr(runner_mod, "STAGES", {"tokenizer": Probe()})
    monkeypatch.setattr(runner_mod, "write_report", lambda out, plan, results: out / "report.md")
    before = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    p = resolve_plan("cpu-tiny", overrides={"stages": ["tokenizer"], "deterministic": True})
    Speedrun(p, tmp_path, log=lambda *a: None).run()
    assert seen == [(1, True)]
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == before


def test_plan_layers_and_bad_keys():
    p = resolve_plan("cpu-tiny", overrides={"sft.max_iters": 5, "task": "sub:2"})
    assert p["sft"]["max_iters"] == 5 and p["sft"]["lr"] == 1.0e-3 and p["task"] == "sub:2"
    assert "ppo" not in p["stages"] and "ppo" in resolve_plan("cpu-small")["stages"]
    assert resolve_plan("gpu-8")["nproc"] == 8
    with pytest.raises(ConfigError, match="unknown preset"):
        resolve_plan("tpu-9000")
    with pytest.raises(ConfigError, match="unknown key.*colour"):
        resolve_plan("cpu-tiny", overrides={"colour": "red"})
    with pytest.raises(ConfigError, match="'bogus' is not a stage"):
        resolve_plan("cpu-tiny", overrides={"bogus.lr": 1})
    with pytest.raises(ConfigError, match="--from 'ppo'"):
        Speedrun(resolve_plan("cpu-tiny"), "unused").run("ppo")


def test_a_folder_that_is_not_a_speedrun_is_refused(tmp_path, stages):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a speedrun folder"):
        Speedrun(plan(), tmp_path, log=lambda *a: None).run()
    assert stages[0] == []


@pytest.mark.parametrize("preset", ["cpu-tiny", "cpu-small", "gpu-1", "gpu-8"])
def test_every_preset_builds_valid_trainer_configs(tmp_path, preset):
    from lmforge.speedrun.stages import STAGES, TRAINERS, RunContext
    from lmforge.train.config import build_config

    ctx = RunContext(resolve_plan(preset), tmp_path)
    shard = tmp_path / "pretrain" / "data" / "train.bin"  # what pretraining leaves for replay
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"\0\0")
    for stage, (_, config_class, _) in TRAINERS.items():
        cfg = build_config(config_class, None, STAGES[stage].config(ctx))
        assert cfg.out_dir == str(tmp_path / stage)
        if stage != "pretrain":
            assert cfg.data.endswith(":chat") and cfg.data.startswith("task:")
        if stage in ("sft", "dpo", "grpo"):  # they replay the pretraining text
            assert cfg.replay.replay_data == str(shard) and cfg.replay.replay_coef > 0
