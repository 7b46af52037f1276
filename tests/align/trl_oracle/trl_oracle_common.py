"""Shared by the TRL oracle tests (test_preference_oracle.py, test_rl_oracle.py).

TRL is the oracle for every post-training loss lmforge shares with it.

Each test builds one tiny random Llama (Hugging Face transformers) and one batch, then computes the
loss AND its gradients twice on that same model: once with TRL's own trainer code (a real
``DPOTrainer``/``GRPOTrainer``/... built on the tiny model, calling the method TRL's training step
calls) and once with lmforge (the trainer's loss method where one exists, else the pure functions
in ``lmforge.align.preference_losses`` / ``rl_losses`` on log-probs from ``lmforge.align``
helpers). Losses and every parameter gradient must agree to 1e-5. lmforge's side applies the LM
head two tokens at a time (its chunked path), TRL's to the whole batch.

lmforge's side sees the HF model through `LMForgeView`, which only exposes the interface lmforge's
trainers call (``model(ids) -> logits``, ``hidden_states``, ``norm``, ``lm_head``), so both sides
differentiate the very same parameters.
"""

import importlib
import tempfile
import warnings

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

TOL = 1e-5
PAD, EOS = 0, 1


def llama_config(**kw) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None, **kw,
    )  # fmt: skip


def perturb(model: nn.Module, scale: float, seed: int) -> None:
    """Move every weight a little, so policy ≠ reference (and π ≠ π_old): no ratio is exactly 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))


class LMForgeView(nn.Module):
    """An HF causal LM seen through the interface lmforge's align code calls on its Transformer."""

    def __init__(self, hf: LlamaForCausalLM):
        super().__init__()
        self.hf = hf
        self.norm = nn.Identity()  # HF's backbone output is already final-normed
        self.lm_head = hf.lm_head

    def forward(self, input_ids):
        return self.hf(input_ids=input_ids).logits

    def hidden_states(self, input_ids, attention_mask):
        return self.hf.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def loss_and_grads(model: nn.Module, compute) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = compute()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


def assert_same(model: nn.Module, trl_compute, ours_compute) -> torch.Tensor:
    """TRL's and lmforge's loss and every parameter gradient agree to TOL (and are not trivial)."""
    trl_loss, trl_grads = loss_and_grads(model, trl_compute)
    our_loss, our_grads = loss_and_grads(model, ours_compute)
    torch.testing.assert_close(our_loss, trl_loss, atol=TOL, rtol=0)
    assert trl_grads and our_grads.keys() == trl_grads.keys()
    assert sum(g.abs().sum() for g in trl_grads.values()) > 0, "the oracle's gradient is all zero"
    for name, g in trl_grads.items():
        torch.testing.assert_close(our_grads[name], g, atol=TOL, rtol=TOL, msg=name)
    return trl_loss


def trl_experimental(name: str):
    """A trl.experimental module (ORPO, CPO/SimPO live there), without its import warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(f"trl.experimental.{name}")


def trl_args(config_cls, **kw):
    """A TRL config for a CPU run in fp32 (TRL defaults to bf16 autocast), writing nothing."""
    return config_cls(output_dir=tempfile.mkdtemp(prefix="trl_oracle_out_"), report_to=[],
                      use_cpu=True, seed=0, bf16=False, **kw)  # fmt: skip


def first_batch(trainer) -> dict:
    return next(iter(trainer.get_train_dataloader()))


PAIRS = {
    "prompt": ["w1 w2", "w3", "w4 w5 w6", "w7"],
    "chosen": [" w8 w9", " w10", " w11 w12 w13", " w14"],
    "rejected": [" w15", " w16 w17", " w18", " w19 w20 w21"],
}
