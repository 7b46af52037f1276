"""The command line: --help everywhere, and one readable error line (exit 2) for bad input."""

import pytest

from lmforge.cli.main import build_parser, main

TEXT = "All the world's a stage, and all the men and women merely players.\n" * 30


def subcommands(parser, prefix=()):
    for action in parser._actions:
        if hasattr(action, "choices") and isinstance(action.choices, dict):
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from subcommands(sub, (*prefix, name))


def test_help_everywhere(capsys):
    commands = list(subcommands(build_parser()))
    assert ("pretrain",) in commands and ("tokenizer", "train") in commands
    for cmd in commands:
        with pytest.raises(SystemExit) as exit_info:
            main([*cmd, "--help"])
        assert exit_info.value.code == 0
        assert "usage:" in capsys.readouterr().out


def run_err(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


def test_bad_input_messages(capsys, tmp_path):
    assert "unknown key(s) max_iter" in run_err(capsys, ["pretrain", "--max_iter", "3"])
    missing = tmp_path / "nope.txt"
    err = run_err(capsys, ["pretrain", "--data", str(missing), "--out_dir", str(tmp_path / "o")])
    assert str(missing) in err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    err = run_err(capsys, ["pretrain", "--data", str(empty), "--out_dir", str(tmp_path / "e")])
    assert "empty.txt" in err
    assert "not found" in run_err(
        capsys, ["generate", "--checkpoint", str(tmp_path), "--prompt", "x"]
    )
    assert "config file not found" in run_err(capsys, ["pretrain", "--config", str(missing)])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    data = root / "play.txt"
    data.write_text(TEXT)
    out = root / "run"
    argv = ["pretrain", "--data", str(data), "--out_dir", str(out), "--tokenizer", "char",
            "--max_iters", "6", "--eval_interval", "3", "--eval_iters", "1", "--batch_size", "2",
            "--block_size", "16", "--progress", "false", "--samples", "1", "--sample_tokens", "8",
            "--model.n_layer", "1", "--model.d_model", "16", "--model.n_head", "2",
            "--model.max_seq_len", "32"]  # fmt: skip
    assert main(argv) == 0
    return out, data


def test_pretrain_generate_eval_and_model_info(checkpoint, capsys):
    out, data = checkpoint
    assert (out / "loss.png").is_file()
    args = ["generate", "--checkpoint", str(out), "--prompt", "All", "--max-new-tokens", "5"]
    assert main(args) == 0
    assert "All" in capsys.readouterr().out
    assert main(["eval", "perplexity", "--checkpoint", str(out), "--data", str(data)]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert main(["model-info", "--checkpoint", str(out)]) == 0
    assert "KV cache bytes/token" in capsys.readouterr().out
    too_long = ["generate", "--checkpoint", str(out), "--prompt", "a" * 40]
    assert "max_seq_len" in run_err(capsys, too_long)
    bad = ["generate", "--checkpoint", str(out), "--prompt", "a", "--temperature", "-1"]
    assert "temperature" in run_err(capsys, bad)


def test_corrupt_weights_named(checkpoint, capsys, tmp_path):
    out, _ = checkpoint
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in out.iterdir():
        if f.is_file():
            (broken / f.name).write_bytes(f.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    err = run_err(capsys, ["generate", "--checkpoint", str(broken), "--prompt", "All"])
    assert "model.safetensors" in err


def test_tokenizer_train_cli(tmp_path, capsys):
    data = tmp_path / "t.txt"
    data.write_text(TEXT)
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--data", str(data), "--kind", "bpe", "--vocab-size", "300",
                 "--out", str(out)]) == 0  # fmt: skip
    assert (out / "tokenizer.json").is_file()


def test_generate_wraps_prompts_in_the_chat_template(checkpoint, capsys, tmp_path, monkeypatch):
    """An instruct checkpoint (one with a chat template) gets each prompt as a user turn, says so
    on stderr and prints the reply alone; --raw continues the bare text."""
    from lmforge.lm import LM

    out, _ = checkpoint
    lm = LM.load(out)
    lm.tokenizer.chat_template = (
        "{% for m in messages %}men: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}players: {% endif %}"
    )
    chat_dir = tmp_path / "chat"
    lm.save(chat_dir)
    seen = []
    real_complete = LM.complete

    def spy(self, texts, **kwargs):
        seen.append(list(texts))
        return real_complete(self, texts, **kwargs)

    monkeypatch.setattr(LM, "complete", spy)
    args = ["generate", "--checkpoint", str(chat_dir), "--prompt", "all", "--max-new-tokens", "3"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert seen[-1] == ["men: all\nplayers: "]
    assert "chat template" in captured.err
    assert "men: all" not in captured.out  # the reply, not the rendered template
    assert main([*args, "--raw"]) == 0
    assert seen[-1] == ["all"] and capsys.readouterr().out.count("all") >= 1
    assert main(["generate", "--checkpoint", str(out), "--prompt", "all",
                 "--max-new-tokens", "3"]) == 0  # fmt: skip
    assert seen[-1] == ["all"] and "chat template" not in capsys.readouterr().err
