import pytest
import torch

from lmforge.errors import CheckpointError
from lmforge.model.config import ModelConfig
from lmforge.model.io import load_lmforge_model, save_model
from lmforge.model.transformer import Transformer

# the variants of the whole catalogue (cached decoding, one training step) are in test_catalogue.py
LLAMA = dict(
    pos="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, bias=False, tie_embeddings=False
)


def tiny(**kw) -> Transformer:
    return Transformer(ModelConfig(vocab_size=40, n_layer=2, d_model=32, n_head=4, **kw)).eval()


@pytest.mark.parametrize("kw", [{}, LLAMA], ids=["gpt2", "llama"])
def test_left_padding_gives_the_same_logits(kw):
    model = tiny(**kw)
    short = torch.randint(0, 40, (1, 5))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    assert torch.allclose(model(padded, attention_mask=mask)[:, 3:], model(short), atol=1e-5)


def test_weight_tying_and_dropout_identity_at_eval():
    model = tiny(dropout=0.5)
    assert model.lm_head.weight is model.embed.weight
    ids = torch.randint(0, 40, (1, 6))
    assert torch.equal(model(ids), model(ids))  # eval: dropout off
    model.train()
    assert not torch.equal(model(ids), model(ids))


def test_inverted_dropout_scaling():
    drop = torch.nn.Dropout(0.25).train()
    out = drop(torch.ones(100_000))
    kept = out[out > 0]
    assert torch.allclose(kept, torch.full_like(kept, 1 / 0.75))
    assert abs(out.mean().item() - 1.0) < 0.02


def test_sequence_longer_than_context_fails_clearly():
    model = tiny(max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_save_load_roundtrip_and_corrupt_file(tmp_path):
    model = tiny(**LLAMA)
    save_model(model, tmp_path)
    loaded = load_lmforge_model(tmp_path)
    ids = torch.randint(0, 40, (2, 7))
    assert torch.equal(model(ids), loaded(ids))
    assert not list(tmp_path.glob("*.tmp"))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_lmforge_model(tmp_path)


def test_load_rejects_weights_that_do_not_match_config(tmp_path):
    save_model(tiny(), tmp_path)
    other = tmp_path / "other"
    save_model(Transformer(ModelConfig(vocab_size=40, n_layer=2, d_model=64, n_head=4)), other)
    (tmp_path / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="shape"):
        load_lmforge_model(tmp_path)


def test_native_loader_refuses_a_hugging_face_checkpoint_and_names_the_reader(tmp_path):
    """lmforge.model.io reads only lmforge checkpoints (the HF/GGUF readers sit above the model
    package); the message says where the HF ones are read."""
    save_model(tiny(), tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(CheckpointError, match=r"'llama'.*lmforge\.interop\.checkpoint"):
        load_lmforge_model(tmp_path)


def test_cpu_bf16_autocast_trains_and_stays_close_to_fp32():
    model = tiny(**LLAMA).train()
    ids = torch.randint(0, 40, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(ids)
    assert (low.float() - model(ids)).abs().max() < 0.1
    loss = torch.nn.functional.cross_entropy(low.float().reshape(-1, 40), ids.reshape(-1))
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_relu2_mlp_matches_transformers_relu_squared():
    from transformers.activations import ACT2FN  # the oracle: HF's ReLUSquaredActivation

    model = tiny(mlp="relu2")
    mlp = model.blocks[0].mlp
    x = torch.randn(3, 5, 32)
    expected = mlp.down_proj(ACT2FN["relu2"](mlp.up_proj(x)))
    torch.testing.assert_close(mlp(x), expected)


def test_zero_init_proj_starts_every_block_as_the_identity():
    model = tiny(zero_init_proj=True)
    for block in model.blocks:
        assert not block.attn.o_proj.weight.any() and not block.mlp.down_proj.weight.any()
        assert block.mlp.up_proj.weight.std() > 0.01  # the rest keeps its random init
    ids = torch.randint(0, 40, (2, 7))
    embedded = model.embed(ids) + model.abs_pos(torch.arange(7))
    torch.testing.assert_close(model.hidden_states(ids), embedded)
