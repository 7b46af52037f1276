"""Our BERT against Hugging Face's on random tiny checkpoints, plus the MLM and NSP recipes."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.errors import CheckpointError, ConfigError, LMForgeError
from lmforge.model.bert import (
    BertConfig,
    BertForMaskedLM,
    BertForPreTraining,
    BertForSequenceClassification,
    BertModel,
    load_bert,
    make_nsp_pairs,
    mask_tokens,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

V, T = 99, 12


def _hf_config(**kw):
    shape = {"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    return transformers.BertConfig(**shape, intermediate_size=37, max_position_embeddings=64, **kw)


def _save_hf(model, path):
    # Random init leaves biases at 0 and LayerNorms at 1; perturb everything so each tensor matters.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval().save_pretrained(path)
    return model


def _batch():
    ids = torch.randint(1, V, (3, T))
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, 7:], mask[2, 3:] = 0, 0
    ids[mask == 0] = 0
    types = torch.zeros(3, T, dtype=torch.long)
    types[:, 5:] = 1
    return ids, mask, types


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu"])
def test_bert_model_matches_hf_on_padded_batch(tmp_path, act):
    hf = _save_hf(transformers.BertModel(_hf_config(hidden_act=act)), tmp_path)
    ours, cfg = load_bert(tmp_path)
    assert cfg.d_model == cfg.hidden_size == 32 and cfg.use_pooler and not ours.training
    ids, mask, types = _batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
        h, pooled = ours(ids, mask, types)
    assert (h - ref.last_hidden_state).abs().max() <= 1e-5
    assert (pooled - ref.pooler_output).abs().max() <= 1e-5


def test_mlm_and_encoder_from_mlm_checkpoint_match_hf(tmp_path):
    hf = _save_hf(transformers.BertForMaskedLM(_hf_config()), tmp_path)  # `bert.` prefix, no pooler
    ids, mask, types = _batch()
    ours, _ = load_bert(tmp_path, BertForMaskedLM)
    body, cfg = load_bert(tmp_path)
    with torch.no_grad():
        ref = hf(
            input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True
        )
        logits, loss = ours(ids, mask, types)
        h, pooled = body(ids, mask, types)
    assert logits.shape == (3, T, V) and loss is None
    assert (logits - ref.logits).abs().max() <= 1e-5
    assert (h - ref.hidden_states[-1]).abs().max() <= 1e-5
    assert not cfg.use_pooler and torch.equal(pooled, h[:, 0])


def test_pretraining_and_classifier_heads_match_hf(tmp_path):
    ids, mask, types = _batch()
    hf = _save_hf(transformers.BertForPreTraining(_hf_config()), tmp_path / "pt")
    ours, _ = load_bert(tmp_path / "pt", BertForPreTraining)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
        mlm, nsp, _ = ours(ids, mask, types)
    assert (mlm - ref.prediction_logits).abs().max() <= 1e-5
    assert (nsp - ref.seq_relationship_logits).abs().max() <= 1e-5

    hf = _save_hf(
        transformers.BertForSequenceClassification(_hf_config(num_labels=3)), tmp_path / "c"
    )
    ours, cfg = load_bert(tmp_path / "c", BertForSequenceClassification)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
        logits, _ = ours(ids, mask, types)
    assert cfg.num_labels == 3 and (logits - ref.logits).abs().max() <= 1e-5


class _Payload:
    """Unpickling this runs os.mkdir(marker): the refusal test sees whether anything unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_pytorch_bin_is_refused_not_unpickled(tmp_path):
    # An older Hugging Face checkpoint: the same state dict pickled as pytorch_model.bin.
    hf = _save_hf(transformers.BertModel(_hf_config()), tmp_path / "bin")
    weights = load_file(tmp_path / "bin" / "model.safetensors")
    torch.save(weights, tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*save_pretrained"):
        load_bert(tmp_path / "bin")

    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "config.json").write_text((tmp_path / "bin" / "config.json").read_text())
    marker = tmp_path / "unpickled"
    torch.save({"w": _Payload(marker)}, evil / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors"):
        load_bert(evil)
    assert not marker.exists()

    # The conversion the message names, by transformers itself, gives a folder we load exactly.
    converted = transformers.BertModel.from_pretrained(tmp_path / "bin")
    converted.save_pretrained(tmp_path / "bin")  # safetensors: transformers' only format now
    ours, _ = load_bert(tmp_path / "bin")
    ids, mask, types = _batch()
    with torch.no_grad():
        diff = (
            ours(ids, mask, types)[0]
            - hf(input_ids=ids, attention_mask=mask, token_type_ids=types)[0]
        )
    assert diff.abs().max() <= 1e-5


def test_bad_checkpoints_raise_readable_errors(tmp_path):
    _save_hf(transformers.BertModel(_hf_config()), tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())

    (tmp_path / "config.json").write_text(json.dumps(config | {"vocab_size": 100}))
    with pytest.raises(CheckpointError, match=r"word_embeddings.weight.*\(99, 32\).*\(100, 32\)"):
        load_bert(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))

    del weights["encoder.layer.1.attention.self.key.bias"], weights["pooler.dense.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"missing tensors encoder.layer.1.attention.self.key.bias"
    ):
        load_bert(tmp_path)
    # The bare encoder does without a pooler; the classifier head reads it.
    with pytest.raises(CheckpointError, match="pooler.dense.weight"):
        load_bert(tmp_path, BertForSequenceClassification)

    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_bert(tmp_path)
    with pytest.raises(ConfigError, match="model_type='gpt2'"):
        BertConfig.from_hf_dict(config | {"model_type": "gpt2"})
    with pytest.raises(ConfigError, match="'num_hidden_layers'"):
        BertConfig.from_hf_dict({k: v for k, v in config.items() if k != "num_hidden_layers"})


def test_pretraining_loss_trains():
    cfg = BertConfig(vocab_size=V, d_model=32, n_layer=2, n_head=4, d_ff=64, max_position=32)
    model = BertForPreTraining(cfg)
    ids, mask, types = _batch()
    labels = torch.where(torch.rand(ids.shape) < 0.3, ids, -100)
    _, _, loss = model(ids, mask, types, labels=labels, nsp_labels=torch.tensor([0, 1, 0]))
    # At init the MLM loss is about ln V and NSP about ln 2.
    assert abs(loss.item() - (torch.log(torch.tensor(V * 2.0)))) < 1.0
    loss.backward()
    assert model.bert.embeddings.word.weight.grad.abs().sum() > 0


def test_mask_tokens_proportions_and_specials():
    n, vocab, mask_id = 400_000, 1000, 3
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (n,), generator=g)
    special = torch.rand(n, generator=g) < 0.2
    ids[special] = 1
    before = ids.clone()
    inputs, labels = mask_tokens(ids, special, vocab, mask_id, generator=g)
    assert torch.equal(ids, before)  # never in place
    sel = labels != -100
    assert not sel[special].any() and torch.equal(inputs[special], ids[special])
    assert torch.equal(labels[sel], ids[sel])
    assert torch.equal(inputs[~sel], ids[~sel])
    assert abs(sel.sum().item() / (~special).sum().item() - 0.15) < 0.003
    k = sel.sum().item()
    masked = (inputs[sel] == mask_id).sum().item() / k
    same = (inputs[sel] == ids[sel]).sum().item() / k
    assert (
        abs(masked - 0.8) < 0.01 and abs(same - 0.1) < 0.01 and abs(1 - masked - same - 0.1) < 0.01
    )


def test_make_nsp_pairs_layout_and_balance():
    # Sentence i of document d is the tokens [10 + 10 d + i] repeated (i + 1) times: easy to trace.
    docs = [[[10 + 10 * d + i] * (i + 1) for i in range(6)] for d in range(40)]
    batch = make_nsp_pairs(docs, cls_id=1, sep_id=2, generator=torch.Generator().manual_seed(0))
    ids, types, attn, nsp = (
        batch[k] for k in ("input_ids", "token_type_ids", "attention_mask", "next_sentence_label")
    )
    assert ids.shape[0] == 40 * 5 and abs(nsp.float().mean().item() - 0.5) < 0.1
    for row, seg, m, label in zip(ids.tolist(), types.tolist(), attn.tolist(), nsp.tolist()):
        n = sum(m)
        assert row[0] == 1 and row[n - 1] == 2 and row[n:] == [0] * (len(row) - n)
        s = row.index(2)
        a, b = row[1:s], row[s + 1 : n - 1]
        assert seg[: s + 1] == [0] * (s + 1) and seg[s + 1 : n] == [1] * (n - s - 1)
        same_doc = (a[0] - 10) // 10 == (b[0] - 10) // 10
        assert (b[0] == a[0] + 1) if label == 0 else not same_doc
    short = make_nsp_pairs([[[5] * 30, [6] * 30], [[7]]], cls_id=1, sep_id=2, max_len=20)
    assert short["input_ids"].shape[1] == 20
    with pytest.raises(LMForgeError):
        make_nsp_pairs([[[5], [6]]], cls_id=1, sep_id=2)


def test_dropout_only_in_training():
    cfg = BertConfig(
        vocab_size=V, d_model=32, n_layer=1, n_head=4, d_ff=64, max_position=32, dropout=0.5
    )
    model = BertModel(cfg)
    ids = torch.randint(0, V, (2, 8))
    assert not torch.equal(model(ids)[0], model(ids)[0])
    model.eval()
    assert torch.equal(model(ids)[0], model(ids)[0])
