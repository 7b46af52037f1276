import json

import pytest
import torch

from lmforge.cli.main import main
from lmforge.lm import LM
from lmforge.model.config import ModelConfig

transformers = pytest.importorskip("transformers")


def test_convert_both_directions(tmp_path, capsys):
    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, sliding_window=4)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    assert (
        main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
    )
    written = json.loads((tmp_path / "ours/config.json").read_text())
    assert written["model_type"] == "lmforge" and written["sliding_window"] == 4
    args = ["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "back")]
    assert main([*args, "--max-shard-mb", "0.02"]) == 0
    assert "mistral layout" in capsys.readouterr().out
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    x = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert (back(x).logits - hf(x).logits).abs().max() <= 1e-4


def test_convert_bad_input_exits_2(tmp_path, capsys):
    LM.from_config(ModelConfig(vocab_size=32, n_layer=1, d_model=16, n_head=2,
                               pos="sinusoidal")).save(tmp_path / "m")  # fmt: skip
    assert main(["convert", "--to-hf", str(tmp_path / "m"), "--out", str(tmp_path / "o")]) == 2
    assert "error: this model cannot be written as a Hugging Face" in capsys.readouterr().err
    assert main(["convert", "--from-hf", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2


def test_convert_help(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    assert "--from-hf" in capsys.readouterr().out
