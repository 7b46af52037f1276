"""The chunked LM head (logprobs.map_token_chunks and what is built on it) gives the values AND
the parameter gradients of the plain path that builds the whole [B, T, V] logits tensor, to 1e-5,
while no call of the LM head ever sees more than one chunk of tokens, in forward or backward.

The plain path here is the logits-based functions (`token_logprobs`, `sft_loss`,
`distillation_loss`, `entropy_from_logits`) on `model(input_ids)`; tests/align/trl_oracle/
runs every trainer loss against TRL with chunks of two tokens.
"""

import pytest
import torch
from torch import nn

from lmforge.align import logprobs as LP
from lmforge.align.logprobs import (
    head_token_stats,
    lm_sequence_logprobs,
    lm_sft_loss,
    lm_token_stats,
    sequence_logprobs,
    sft_loss,
    token_logprobs,
)
from lmforge.align.regularizers import distillation_loss, lm_distillation_loss
from lmforge.align.rl_losses import entropy_from_logits
from lmforge.align.trainer import frozen_copy, load_lm

TOL = 1e-5
TINY = {"n_layer": 2, "d_model": 32, "n_head": 2}
CHUNK = 3  # tokens per chunk: B*T = 2*11 tokens cross several chunk borders


@pytest.fixture
def lm():
    torch.manual_seed(0)
    lm = load_lm("scratch", TINY, 32, 0, "cpu")
    for p in lm.model.parameters():  # away from the tiny GPT-2 init: larger, distinct logits
        p.data.add_(torch.randn_like(p) * 0.05)
    return lm


@pytest.fixture
def small_chunks(monkeypatch, lm):
    """CHUNK tokens per chunk for everything that sizes chunks from the vocabulary."""
    monkeypatch.setattr(LP, "CHUNK_ELEMENTS", CHUNK * lm.config.vocab_size)


class ChunkSpy(nn.Module):
    """Wraps the LM head; records the most tokens one call (forward, or its recomputation in
    backward) ever saw."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head, self.most = head, 0

    def forward(self, h):
        self.most = max(self.most, h.reshape(-1, h.shape[-1]).shape[0])
        return self.head(h)


def batch(lm, rows=2, width=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, lm.config.vocab_size, (rows, width), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt
    labels[1, -3:] = -100  # right padding
    return ids, labels


def grads(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_same_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=TOL, rtol=TOL, msg=name)


def test_token_stats_and_their_gradients_equal_the_full_logits(lm, small_chunks):
    model = lm.model
    ids, labels = batch(lm)
    weights = torch.randn(ids.shape[0], ids.shape[1] - 1)  # any downstream use of each value

    def chunked():
        s = lm_token_stats(model, ids, labels, entropy=True, mean_logp=True)
        return s, (weights * (s.logp + 0.3 * s.entropy - 0.2 * s.mean_logp)).sum()

    def full():
        logits = model(ids)[:, :-1]
        lp = token_logprobs(logits, labels[:, 1:])
        ent = entropy_from_logits(logits)
        mean = torch.log_softmax(logits.float(), -1).mean(-1)
        return (lp, ent, mean), (weights * (lp + 0.3 * ent - 0.2 * mean)).sum()

    (s, loss_c), (ref, loss_f) = chunked(), full()
    for got, want in zip(s, ref):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    assert_same_grads(grads(model, loss_c), grads(model, loss_f))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_sft_loss_and_gradients_equal_the_full_logits(lm, small_chunks, smoothing):
    model = lm.model
    ids, labels = batch(lm)
    chunked = lm_sft_loss(model, ids, labels, label_smoothing=smoothing)
    full = sft_loss(model(ids), labels, label_smoothing=smoothing)
    torch.testing.assert_close(chunked, full, atol=TOL, rtol=TOL)
    assert_same_grads(grads(model, chunked), grads(model, full))


def test_sequence_logprobs_equal_the_full_logits(lm, small_chunks):
    model = lm.model
    ids, labels = batch(lm)
    for average in (False, True):
        chunked = lm_sequence_logprobs(model, ids, labels, average=average)
        full = sequence_logprobs(model(ids)[:, :-1], labels[:, 1:], average=average)
        torch.testing.assert_close(chunked, full, atol=TOL, rtol=TOL)
        w = torch.tensor([1.0, -0.5])
        assert_same_grads(grads(model, (w * chunked).sum()), grads(model, (w * full).sum()))


def test_distillation_loss_equals_the_full_logits(lm, small_chunks):
    teacher = frozen_copy(lm.model)
    for p in lm.model.parameters():  # the student has moved away from its teacher
        p.data.add_(torch.randn_like(p) * 0.05)
    ids, _ = batch(lm)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    chunked = lm_distillation_loss(lm.model, teacher, ids, 2.0, mask)
    full = distillation_loss(lm.model(ids), teacher(ids), 2.0, mask)
    assert chunked.item() > 1e-4
    torch.testing.assert_close(chunked, full, atol=TOL, rtol=TOL)
    assert_same_grads(grads(lm.model, chunked), grads(lm.model, full))


def test_the_head_never_sees_more_than_one_chunk(lm, small_chunks):
    model = lm.model
    model.lm_head = spy = ChunkSpy(model.lm_head)
    ids, labels = batch(lm, rows=4, width=16)
    lm_sft_loss(model, ids, labels, label_smoothing=0.1).backward()
    assert 0 < spy.most <= CHUNK  # 60 tokens went through, CHUNK at a time
    assert model.embed.weight.grad is not None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_linear_head_equals_the_full_logits(lm, small_chunks, temperature):
    """A plain linear LM head goes through HeadLogprobs (its own backward): values and the
    gradients of the parameters (the tied head included) and of the hidden states as autograd
    gives them on the whole logits."""
    model = lm.model
    head = LP.lm_head_fn(model, temperature)
    assert isinstance(head, LP.LinearHead) and head.fusable()
    ids, labels = batch(lm)
    weights = torch.randn(ids.shape[0], ids.shape[1] - 1)

    def run(fused: bool):
        hidden = model.norm(model.hidden_states(ids)[:, :-1]).detach().requires_grad_()
        if fused:
            logp = head_token_stats(head, hidden, labels[:, 1:]).logp
        else:
            logp = token_logprobs(model.output_logits(hidden) / temperature, labels[:, 1:])
        loss = (weights * logp).sum()
        model.zero_grad(set_to_none=True)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logp, hidden.grad, grads

    (logp, grad_h, g), (logp_ref, grad_h_ref, g_ref) = run(True), run(False)
    torch.testing.assert_close(logp, logp_ref, atol=TOL, rtol=TOL)
    torch.testing.assert_close(grad_h, grad_h_ref, atol=TOL, rtol=TOL)
    assert "lm_head.weight" in g or "embed.weight" in g
    assert_same_grads(g, g_ref)


def test_head_token_stats_without_gradients_and_without_tokens():
    head = nn.Linear(4, 7)
    h, labels = torch.randn(2, 5, 4), torch.randint(0, 7, (2, 5))
    with torch.no_grad():
        got = head_token_stats(head, h, labels, chunk=2).logp
    torch.testing.assert_close(got, token_logprobs(head(h), labels), atol=TOL, rtol=TOL)
    empty = head_token_stats(head, h[:, :0], labels[:, :0], entropy=True)
    assert empty.logp.shape == (2, 0) and empty.entropy.shape == (2, 0)


def test_activation_checkpointing_trains_the_same(tmp_path, tiny_run):
    """`activation_checkpointing: true` recomputes each block in backward in post-training too,
    with the same losses."""
    from lmforge.align.sft import SFTConfig, SFTTrainer

    losses = {}
    for on in (False, True):
        t = SFTTrainer(tiny_run(SFTConfig, tmp_path / str(on), activation_checkpointing=on),
                       log=lambda *a: None)  # fmt: skip
        assert ("forward" in vars(t.lm.model.blocks[0])) == on  # the block is patched
        losses[on] = [t.train_step()["loss"] for _ in range(3)]
    assert losses[True] == pytest.approx(losses[False], abs=1e-5)
