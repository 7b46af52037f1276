"""chat and serve compile their decode step by default where a compiler exists, say once how
long it took, and --no-compile turns it off."""

import io
import sys
from argparse import Namespace

import pytest

from lmforge.cli import generate
from lmforge.cli.main import build_parser, main
from lmforge.infer.engine import Engine
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tok = Tokenizer.train_bpe(["the cat sat on the mat. " * 40], vocab_size=280)
    config = ModelConfig.from_preset("llama-micro", vocab_size=tok.vocab_size, max_seq_len=32,
                                     n_layer=1)  # fmt: skip
    lm = LM.from_config(config, tokenizer=tok, seed=0)
    folder = tmp_path_factory.mktemp("compile") / "lm"
    lm.save(folder)
    return lm, folder


def test_default_follows_the_compiler(tiny, monkeypatch):
    lm, _ = tiny
    args = Namespace(compile=None, device="cpu")
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(generate.shutil, "which", lambda name: None)
    assert generate.compile_wanted(args, lm.model) is False
    monkeypatch.setattr(generate.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert generate.compile_wanted(args, lm.model) is True
    assert generate.compile_wanted(Namespace(compile=False, device="cpu"), lm.model) is False


def test_both_commands_take_the_switch():
    parser = build_parser()
    for command in ("chat", "serve"):
        args = parser.parse_args([command, "--checkpoint", "x", "--no-compile"])
        assert args.compile is False
        assert parser.parse_args([command, "--checkpoint", "x"]).compile is None


def test_chat_warms_up_once_and_says_how_long(tiny, monkeypatch, capsys, tmp_path):
    _, folder = tiny
    calls = []

    def fake_warm_up(self, progress=print, cache_dir=None):  # the compile itself: test_warmup
        calls.append(cache_dir)
        progress("compiling the decode step for 1 running row(s)")
        progress("  rows 1-1: compiled in 0.0 s")

    monkeypatch.setattr(Engine, "warm_up", fake_warm_up)
    monkeypatch.setattr(sys, "stdin", io.StringIO("/exit\n"))
    argv = ["chat", "--checkpoint", str(folder), "--compile", "--compile-cache", str(tmp_path)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert [str(c) for c in calls] == [str(tmp_path)], calls
    assert err.count("decode step compiled in") == 1
    assert "rows 1-1" not in err  # one line, not the per-range progress

    calls.clear()
    assert main([*argv[:3], "--no-compile"]) == 0
    assert calls == [] and "decode step" not in capsys.readouterr().err
