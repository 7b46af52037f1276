import json

import pytest

from lmforge.cli.main import main
from lmforge.errors import ConfigError
from lmforge.train.config import build_config
from lmforge.vlm.train import VLMTrainConfig


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown key"):
        build_config(VLMTrainConfig, None, {"stepz": 3})
    with pytest.raises(ConfigError, match="text_dropout"):
        VLMTrainConfig(text_dropout=1.5)
    with pytest.raises(ConfigError, match="steps must be a positive integer"):
        VLMTrainConfig(steps=0)
    cfg = build_config(VLMTrainConfig, "configs/vlm-shapes.yaml", {"model.n_layer": 1})
    assert cfg.model["n_layer"] == 1 and cfg.model["pos"] == "rope"


def test_cli_errors_exit_2(tmp_path, capsys):
    assert main(["vlm", "caption", "--checkpoint", str(tmp_path / "nope"), "--image", "x.png"]) == 2
    assert "checkpoint directory not found" in capsys.readouterr().err
    assert main(["vlm", "train", "--projector", "conv", "--out_dir", str(tmp_path)]) == 2
    assert "projector must be one of" in capsys.readouterr().err


@pytest.mark.slow
def test_train_checkpoint_and_caption_cli(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["vlm", "train", "--config", "configs/vlm-shapes.yaml", "--out_dir", str(out),
            "--steps", "4", "--eval_interval", "2", "--eval_size", "4", "--max_time", "null",
            "--progress", "false", "--log_interval", "1", "--vision_layers", "1",
            "--model.n_layer", "1"]  # fmt: skip
    assert main(args) == 0
    assert "exact match: held-out images" in capsys.readouterr().out
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.csv", "loss.png"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "final_metrics.json").read_text())
    assert metrics["steps"] == 4 and 0 <= metrics["novel_exact"] <= 1

    assert main(["vlm", "samples", "--out_dir", str(tmp_path / "png"), "--n", "2"]) == 0
    capsys.readouterr()
    images = [str(tmp_path / "png" / f"novel_{i}.png") for i in range(2)]
    assert main(["vlm", "caption", "--checkpoint", str(out), "--image", images[0]]) == 0
    assert "error" not in capsys.readouterr().err  # an untrained model may print an empty line
    code = main(["vlm", "caption", "--checkpoint", str(out), "--image", images[0],
                 "--image", images[1]])  # fmt: skip
    assert code == 0 and capsys.readouterr().out.count("novel_") == 2
    # Two images but one slot in a joint prompt: a clear error.
    code = main(["vlm", "caption", "--checkpoint", str(out), "--joint", "--prompt",
                 "<|image|> left of", "--image", images[0], "--image", images[1]])  # fmt: skip
    assert code == 2 and "2 images given but the prompt has 1 image slot" in capsys.readouterr().err
    (tmp_path / "bad.png").write_text("not a png")
    assert (
        main(["vlm", "caption", "--checkpoint", str(out), "--image", str(tmp_path / "bad.png")])
        == 2
    )
    assert "bad.png: not a readable image" in capsys.readouterr().err
