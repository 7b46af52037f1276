import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lmforge.errors import ConfigError, LMForgeError
from lmforge.model.linear import plain_linear
from lmforge.peft.lora import LoRALinear, load_adapter, lora_modules, merge_lora, save_adapter
from lmforge.peft.qlora import (
    NF4_CODE,
    NF4Linear,
    QLoRALinear,
    apply_qlora,
    dequantize_absmax,
    dequantize_nf4,
    nf4_code,
    pack_4bit,
    quantize_nf4,
    unpack_4bit,
)

# bitsandbytes' published NF4 table (functional.py); the task brief lists -0.1848449 for the
# sixth value, 7e-5 away from the published -0.18477343 — both within 1e-4 of the computed code.
PUBLISHED_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]  # fmt: skip
MAX_HALF_GAP = ((NF4_CODE[1:] - NF4_CODE[:-1]).max() / 2).item()


def test_nf4_code_matches_published_table():
    code = nf4_code()
    assert code.shape == (16,) and code[7] == 0
    torch.testing.assert_close(code, torch.tensor(PUBLISHED_NF4), atol=1e-4, rtol=0)
    assert abs(code[5].item() - -0.1848449) < 1e-4


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=1, max_size=40).filter(lambda c: len(c) % 2 == 0))
def test_pack_unpack_is_exact(codes):
    codes = torch.tensor(codes, dtype=torch.uint8)
    packed = pack_4bit(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == codes.numel() // 2
    assert torch.equal(unpack_4bit(packed), codes)
    assert packed[0] == codes[0] * 16 + codes[1]  # first element in the high nibble


@pytest.mark.parametrize("double_quant", [False, True])
def test_round_trip_error_bound(double_quant):
    w = torch.randn(96, 80) * 0.02
    q = quantize_nf4(w, block_size=64, double_quant=double_quant)
    w_hat = dequantize_nf4(q)
    assert w_hat.shape == w.shape
    blocks, blocks_hat = w.flatten().view(-1, 64), w_hat.flatten().view(-1, 64)
    absmax = blocks.abs().amax(1)
    absmax_err = (dequantize_absmax(q) - absmax).abs()
    bound = absmax * MAX_HALF_GAP + absmax_err + 1e-7
    assert torch.all((blocks - blocks_hat).abs().amax(1) <= bound)
    assert (w - w_hat).abs().mean() < 0.1 * w.std()
    if double_quant:
        assert q.absmax.dtype == torch.int8 and q.absmax_scale.dtype == torch.float32
        assert torch.all(absmax_err <= q.absmax_scale.max() / 254 + 1e-7)  # half an 8-bit step
    else:
        assert torch.all(absmax_err == 0)


def test_code_values_round_trip_exactly_and_odd_sizes():
    scale = torch.tensor([0.5, 2.0]).repeat_interleave(16)
    w = NF4_CODE.repeat(2) * scale  # every block holds ±absmax, so scales are exact
    assert torch.equal(dequantize_nf4(quantize_nf4(w, 16, double_quant=False)), w)
    odd = torch.randn(7, 5)  # 35 values: padded inside, trimmed on the way out
    assert dequantize_nf4(quantize_nf4(odd, 8)).shape == (7, 5)
    assert torch.all(dequantize_nf4(quantize_nf4(torch.zeros(10), 4)) == 0)
    with pytest.raises(ConfigError):
        quantize_nf4(odd, block_size=7)


def _nbytes(module: nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def test_nf4_linear_forward_memory_and_state_dict():
    linear = nn.Linear(256, 128)
    nf4 = NF4Linear.from_linear(linear)
    assert not list(nf4.parameters())
    assert _nbytes(nf4) < 0.3 * _nbytes(linear)
    x = torch.randn(3, 256)
    expect = x @ nf4.dequantized_weight().T + linear.bias
    torch.testing.assert_close(nf4(x), expect)
    assert (nf4(x) - linear(x)).abs().max() < 0.1 * linear(x).abs().max()
    copy = NF4Linear(torch.zeros(128, 256), torch.zeros(128))
    copy.load_state_dict(nf4.state_dict())
    assert torch.equal(copy(x), nf4(x))
    half = NF4Linear.from_linear(linear, compute_dtype=torch.bfloat16)
    assert half(x).dtype == torch.float32
    assert (half(x) - nf4(x)).abs().max() < 0.05


def test_apply_qlora_quantises_blocks_and_trains_only_lora(toy, ids):
    model = toy()
    names = apply_qlora(model, r=4, alpha=8)
    assert names == [f"blocks.{i}.attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    assert plain_linear(model.lm_head)
    assert isinstance(model.blocks[0].attn.q_proj, QLoRALinear)
    assert type(model.blocks[1].attn.k_proj) is NF4Linear
    assert type(model.blocks[1].mlp.fc) is NF4Linear
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{m}.weight" for n in names for m in "AB"}

    model(ids).logsumexp(-1).mean().backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None) == (n in trainable), n
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


def test_qlora_starts_as_quantised_model_and_exports(toy, ids, tmp_path):
    model = toy()
    apply_qlora(model, targets=("q_proj", "fc"), keep=("lm_head", "blocks.1.mlp.fc"))
    assert isinstance(model.blocks[1].mlp.fc, LoRALinear)  # kept full precision, still LoRA
    assert not isinstance(model.blocks[1].mlp.fc, QLoRALinear)
    y0 = model(ids)
    assert (y0 - toy()(ids)).abs().max() < 0.1 * toy()(ids).abs().max()
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.weight.normal_(std=0.1)
    y = model(ids)
    with pytest.raises(LMForgeError, match="4-bit"):
        model.blocks[0].attn.q_proj.merge()

    save_adapter(model, tmp_path)
    other = toy()
    apply_qlora(other, targets=("q_proj", "fc"), keep=("lm_head", "blocks.1.mlp.fc"))
    load_adapter(other, tmp_path)
    torch.testing.assert_close(other(ids), y)

    merge_lora(model)
    assert plain_linear(model.blocks[0].attn.q_proj)
    torch.testing.assert_close(model(ids), y, atol=1e-5, rtol=1e-5)


def test_apply_qlora_needs_a_target(toy):
    with pytest.raises(ConfigError, match="available"):
        apply_qlora(toy(), targets="nothing")


def test_lora_matrices_are_never_targets(toy):
    model = toy()
    apply_qlora(model, targets="*")  # every Linear but lm_head (kept) gets LoRA
    assert all(isinstance(m.lora_A, nn.Linear) for m in lora_modules(model).values())
    assert len(lora_modules(model)) == 13  # 2 blocks x 6 Linears + lm_head
