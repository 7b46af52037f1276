"""GGUF export: lmforge's models written as llama.cpp GGUF files, read back by transformers'
GGUF loader and by lmforge."""

import pytest
import torch
from gguf_files import (
    CORPUS,
    TEMPLATE,
    TEXTS,
    Q,
    batch_ids,
    gguf,
    hf_from_gguf,
    hf_tokenizer,
    our_llama,
)

from lmforge.cli.main import main
from lmforge.interop.gguf_write import export_gguf
from lmforge.lm import LM
from lmforge.tokenizer import Tokenizer


@pytest.mark.parametrize(
    "dtype,kw",
    [("f16", {}), ("bf16", {"tie_embeddings": True}), ("q8_0", {"rope_interleaved": True})],
)
def test_export_loads_in_transformers_and_back(tmp_path, dtype, kw):
    tok = Tokenizer.train_bpe(CORPUS, vocab_size=400, min_frequency=1)
    tok.chat_template = TEMPLATE
    lm = our_llama(tok, **kw)
    path = export_gguf(lm, tmp_path / "out.gguf", dtype=dtype)
    ref = hf_from_gguf(path)
    back = LM.load(path, dtype="float32")
    x = batch_ids(lm.config.vocab_size)
    with torch.no_grad():
        theirs, ours, original = ref(x).logits, back.model(x), lm.model(x)
    assert (theirs - ours).abs().max().item() <= 1e-4  # same file, same numbers
    tol = {"f16": 2e-2, "bf16": 1e-1, "q8_0": 1e-1}[dtype]  # what the weight rounding costs
    assert (theirs - original).abs().max().item() <= tol * original.abs().max().item()
    ref_tok = hf_tokenizer(path)
    for text in TEXTS:
        assert ref_tok(text, add_special_tokens=False).input_ids == tok.encode(text)
        assert back.tokenizer.encode(text) == tok.encode(text)
    assert back.tokenizer.chat_template == TEMPLATE
    assert back.tokenizer.eos_id == tok.eos_id


def test_export_cli(tmp_path, capsys):
    tok = Tokenizer.train_bpe(CORPUS, vocab_size=400, min_frequency=1)
    our_llama(tok).save(tmp_path / "ckpt")
    out = tmp_path / "m.gguf"
    args = ["convert", "--to-gguf", str(out), "--checkpoint", str(tmp_path / "ckpt")]
    assert main([*args, "--dtype", "q8_0"]) == 0
    assert "llama GGUF, q8_0" in capsys.readouterr().out
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(out)).tensors}
    assert types["blk.0.attn_q.weight"] == Q.Q8_0 and types["blk.0.attn_norm.weight"] == Q.F32
