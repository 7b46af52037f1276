"""benchmarks/gpu_check.py, the prepared GPU check, proven on a CPU with --smoke: the same steps
as on the GPU, shrunk (the full recipes + speedrun part is slow)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def run_smoke(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)  # results under tmp_path, not a device call's $OUT
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke",
         "--out", str(tmp_path / "out"), *extra],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env,
    )  # fmt: skip


def test_a_failed_pretraining_is_retried_smaller_or_eager():
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.14 GiB"
    assert gpu_check.retry_settings(oom) == {"batch_size": 16, "grad_accum": 32}
    assert gpu_check.retry_settings("torch._inductor.exc.InductorError: ...") == {"compile": False}
    args = gpu_check.pretrain_args("gpu", Path("run"), {"compile": False})
    assert args[args.index("--compile") + 1] == "false"  # the retry's setting wins


def test_smoke_pretraining_records_tokens_per_s_and_mfu(tmp_path):
    done = run_smoke(tmp_path, "--only", "pretrain")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    summary = json.loads((out / "gpu_check_summary.json").read_text())
    assert [s["name"] for s in summary["steps"]] == ["pretrain gpt2-small"]
    table = json.loads((out / "gpu_pretrain_gpt2_small.json").read_text())
    row = dict(zip(table["columns"], table["rows"][0]))
    assert row["device"] == "CPU" and row["steps timed"] == 8 and row["warm-up steps"] == 4
    final = json.loads((out / "runs" / "gpt2-small" / "final_metrics.json").read_text())
    assert row["tokens/s"] == pytest.approx(final["tokens_per_s_after_warmup"], rel=1e-3)
    # MFU = tokens/s x training FLOPs per token / the given peak (0.05 TFLOPS)
    from lmforge.model.info import flops_per_token
    from lmforge.train.config import TrainConfig, build_config

    cfg = build_config(TrainConfig, out / "runs" / "gpt2-small" / "train_config.json", {})
    flops = flops_per_token(cfg.model_config(cfg.vocab_size), cfg.block_size)["training"]
    assert cfg.model_config(0).n_layer == 1 and cfg.peak_tflops == 0.05
    assert row["MFU"] == pytest.approx(row["tokens/s"] * flops / 0.05e12, rel=1e-3, abs=1e-4)
    assert "MFU" in done.stdout and "mfu=" in done.stdout  # the final report, the progress line
    # smoke figures stay out of the repository's results
    assert "--smoke" in table["command"] and (out / "results" / "benchmarks.md").is_file()
    assert not (ROOT / "benchmarks" / "results" / "gpu_pretrain_gpt2_small.json").exists() or (
        "--smoke"
        not in (ROOT / "benchmarks" / "results" / "gpu_pretrain_gpt2_small.json").read_text()
    )


@pytest.mark.slow
def test_smoke_runs_every_gpu_recipe_and_the_smol_gpu_speedrun(tmp_path):
    from lmforge.data.corpus import shared_data_dir

    missing = [n for n in gpu_check.DATA_FILES if not (shared_data_dir() / n).is_file()]
    if missing:
        pytest.skip(f"shared data missing: {', '.join(missing)}")
    done = run_smoke(tmp_path, "--only", "recipes", "--budget", "3000")
    assert done.returncode == 0, done.stdout[-5000:]
    summary = json.loads((tmp_path / "out" / "gpu_check_summary.json").read_text())
    names = [s["name"] for s in summary["steps"] if s["ok"]]
    assert names == [*gpu_check.RECIPES, "speedrun smol-gpu"]
    assert sorted(gpu_check.RECIPES) == sorted(
        p.stem for p in (ROOT / "configs" / "recipes").glob("*-gpu.yaml")
    )  # every -gpu recipe is checked


def test_weights_travel_in_halves_and_are_joined_only_when_whole(tmp_path, monkeypatch):
    """One device call carries at most 64 MiB: the GGUF goes in halves over two calls, joined
    on the machine once both came and only if the SHA-256 matches."""
    blob = os.urandom(1001)
    (tmp_path / "model.gguf").write_bytes(blob)
    monkeypatch.setattr(gpu_check, "CARRY", tmp_path / "carry")
    monkeypatch.setattr(gpu_check, "WEIGHTS", tmp_path / "weights")
    monkeypatch.setattr(gpu_check, "RECEIVED", tmp_path / "received")
    (tmp_path / "carry").mkdir()
    gpu_check.split_weights(tmp_path / "model.gguf")
    halves = sorted((tmp_path / "weights").iterdir())
    assert [p.name for p in halves] == ["0", "1"] and sum(p.stat().st_size for p in halves) == 1001
    kept = {p.name: p.read_bytes() for p in halves}
    (tmp_path / "weights" / "1").unlink()  # the first call carries half 0 only
    assert gpu_check.receive_weights() is None
    (tmp_path / "weights" / "0").unlink()  # the second, half 1 only
    (tmp_path / "weights" / "1").write_bytes(kept["1"])
    joined = gpu_check.receive_weights()
    assert joined is not None and joined.read_bytes() == blob
    # a corrupted half is refused
    joined.unlink()
    (tmp_path / "received" / "0").write_bytes(b"x" + kept["0"][1:])
    assert gpu_check.receive_weights() is None


def test_whole_recipes_keep_their_yaml_sizes():
    start = "/tmp/SmolLM2.gguf"
    shrunk = gpu_check.recipe_args("dpo-arith-gpu", "gpu", start, Path("/s"), Path("/d"))
    whole = gpu_check.recipe_args("dpo-arith-gpu", "gpu", start, Path("/s"), Path("/d"), True)
    assert shrunk[shrunk.index("--max_iters") + 1] == "4" and "--max_iters" not in whole
    assert "--pairs_from" not in whole  # real weights: the policy's own pairs, as the YAML says
    random = gpu_check.recipe_args("dpo-arith-gpu", "gpu", "/tmp/start", Path("/s"), Path("/d"))
    assert random[random.index("--pairs_from") + 1] == "data"
