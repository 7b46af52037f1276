"""Bad GGUF input and output: one clear line naming the problem, nothing written."""

import pytest
from gguf_files import (
    CORPUS,
    Q,
    gguf,
    our_llama,
    write_gguf,
)

from lmforge.cli.main import main
from lmforge.errors import CheckpointError, ConfigError
from lmforge.interop.gguf_write import export_gguf
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.tokenizer import Tokenizer


# ---- bad input ---------------------------------------------------------------------------------
def test_export_rejects_non_llama_without_writing(tmp_path):
    tok = Tokenizer.train_bpe(CORPUS, vocab_size=400, min_frequency=1)
    config = ModelConfig(vocab_size=tok.vocab_size, n_layer=1, d_model=32, n_head=2,
                         pos="learned", norm="layernorm", mlp="gelu")  # fmt: skip
    lm = LM.from_config(config, tokenizer=tok)
    with pytest.raises(ConfigError, match="cannot be written as a llama.cpp"):
        export_gguf(lm, tmp_path / "x.gguf")
    char = Tokenizer.train_char(CORPUS)
    with pytest.raises(ConfigError, match="cannot be written to GGUF"):
        export_gguf(our_llama(char), tmp_path / "x.gguf")
    with pytest.raises(ConfigError, match="dtype"):
        export_gguf(our_llama(tok), tmp_path / "x.gguf", dtype="q4_0")
    assert list(tmp_path.iterdir()) == []


def _one_line(err):
    message = str(err.value)
    assert "\n" not in message
    return message


def _unsupported_architecture(tmp_path, vocab, build_hf):
    hf = build_hf("LlamaConfig", len(vocab["tokens"]))
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", Q.F32, vocab)
    data = path.read_bytes().replace(b"llama", b"mamba")  # architecture and its metadata keys
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    path.unlink()
    return bad


def test_unsupported_architecture(tmp_path, bpe_vocab, build_hf):
    with pytest.raises(CheckpointError) as err:
        LM.load(_unsupported_architecture(tmp_path, bpe_vocab, build_hf))
    message = _one_line(err)
    assert "'mamba' is not supported" in message and "llama, qwen2, qwen3, phi3, gpt2" in message


def _unsupported_tensor_type(tmp_path, vocab, build_hf):
    hf = build_hf("LlamaConfig", len(vocab["tokens"]))
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", Q.F32, vocab)
    reader = gguf.GGUFReader(str(path))
    # Q8_1 is a ggml type gguf-py cannot dequantise: relabel one F32 tensor's type id in place
    # (its data shrinks to 36 bytes per 32 values, so the file stays long enough)
    field = next(t for t in reader.tensors if t.name == "blk.0.ffn_norm.weight").field
    type_offset = field.offset + sum(int(p.nbytes) for p in field.parts[:4])
    raw = bytearray(path.read_bytes())
    assert int.from_bytes(raw[type_offset : type_offset + 4], "little") == Q.F32
    raw[type_offset : type_offset + 4] = int(Q.Q8_1).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    return path


def test_unsupported_tensor_type(tmp_path, bpe_vocab, build_hf):
    with pytest.raises(CheckpointError) as err:
        LM.load(_unsupported_tensor_type(tmp_path, bpe_vocab, build_hf))
    message = _one_line(err)
    assert "Q8_1 are not supported" in message and "Q4_K" in message and "Q8_0" in message


def test_truncated_file(tmp_path, bpe_vocab, build_hf):
    hf = build_hf("LlamaConfig", len(bpe_vocab["tokens"]))
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", Q.Q8_0, bpe_vocab)
    data = path.read_bytes()
    for cut in (len(data) // 2, 40):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated") as err:
            LM.load(tmp_path / "cut.gguf")
        _one_line(err)
    out = tmp_path / "out"
    assert main(["convert", "--from-gguf", str(tmp_path / "cut.gguf"), "--out", str(out)]) == 2
    assert not out.exists()
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        LM.load(tmp_path / "notes.txt")


def _shapes_contradicting_metadata(tmp_path, vocab, build_hf):
    hf = build_hf("LlamaConfig", len(vocab["tokens"]))
    return write_gguf(tmp_path / "a.gguf", hf, "llama", Q.F32, vocab,
                      meta_overrides={"llama.feed_forward_length": 384})  # fmt: skip


def test_shapes_contradicting_metadata(tmp_path, bpe_vocab, build_hf):
    hf = build_hf("LlamaConfig", len(bpe_vocab["tokens"]))
    with pytest.raises(CheckpointError, match=r"ffn_\w+\.weight has shape .* metadata implies"):
        LM.load(_shapes_contradicting_metadata(tmp_path, bpe_vocab, build_hf))
    path = write_gguf(tmp_path / "b.gguf", hf, "llama", Q.F32, bpe_vocab,
                      drop={"blk.1.attn_v.weight"})  # fmt: skip
    with pytest.raises(CheckpointError, match="missing tensor.*blk.1.attn_v.weight"):
        LM.load(path)


@pytest.mark.parametrize(
    "make, message",
    [
        (_unsupported_architecture, "'mamba' is not supported"),
        (_unsupported_tensor_type, "Q8_1 are not supported"),
        (_shapes_contradicting_metadata, "metadata implies"),
    ],
)
def test_bad_file_convert_says_one_line_and_writes_nothing(tmp_path, bpe_vocab, capsys, make,
                                                           message, build_hf):  # fmt: skip
    bad = make(tmp_path, bpe_vocab, build_hf)
    out = tmp_path / "out"
    assert main(["convert", "--from-gguf", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err  # besides the error, stderr holds the progress bar
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [bad.name]
