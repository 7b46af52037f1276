"""Continual-learning penalties that keep a fine-tuned model near its previous self: L2 to the
reference weights, elastic weight consolidation with a diagonal Fisher (Kirkpatrick et al. 2017),
and Hinton-style distillation (Li & Hoiem 2016, "Learning without Forgetting") from the previous
model's outputs. Used by `continual.py`'s regularisers."""

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.align.logprobs import chunk_tokens, lm_head_fn, map_token_chunks, masked_mean
from lmforge.errors import LMForgeError

Params = nn.Module | Mapping[str, Tensor]


def _named(params: Params) -> dict[str, Tensor]:
    if isinstance(params, nn.Module):
        return {n: p for n, p in params.named_parameters() if p.requires_grad}
    return dict(params)


def _paired(params: Params, ref: Mapping[str, Tensor]) -> Iterable[tuple[str, Tensor, Tensor]]:
    named = _named(params)
    missing = sorted(set(named) - set(ref))
    if missing:
        raise LMForgeError(f"reference is missing parameters: {missing[:5]}")
    return ((n, p, ref[n].to(p.device, p.dtype)) for n, p in named.items())


def l2_to_reference(params: Params, ref_params: Mapping[str, Tensor]) -> Tensor:
    """Σ‖θ - θ_ref‖² over (trainable, for a module) parameters: stay close to the previous model."""
    terms = [((p - r) ** 2).sum() for _, p, r in _paired(params, ref_params)]
    return torch.stack(terms).sum() if terms else torch.zeros(())


def ewc_penalty(
    params: Params, ref_params: Mapping[str, Tensor], fisher: Mapping[str, Tensor]
) -> Tensor:
    """Elastic weight consolidation Σ F_i (θ_i - θ*_i)²; the caller applies the usual λ/2."""
    terms = [(fisher[n].to(p) * (p - r) ** 2).sum() for n, p, r in _paired(params, ref_params)]
    return torch.stack(terms).sum() if terms else torch.zeros(())


def diagonal_fisher(
    model: nn.Module, batches: Iterable, loss_fn: Callable[[nn.Module, object], Tensor]
) -> dict[str, Tensor]:
    """Empirical diagonal Fisher: squared gradients of ``loss_fn(model, batch)`` averaged over
    batches, for trainable parameters. Uses autograd.grad so existing ``.grad`` is left alone."""
    named = _named(model)
    fisher = {n: torch.zeros_like(p) for n, p in named.items()}
    count = 0
    for batch in batches:
        grads = torch.autograd.grad(loss_fn(model, batch), list(named.values()), allow_unused=True)
        for n, g in zip(named, grads):
            if g is not None:
                fisher[n] += g.detach() ** 2
        count += 1
    if count == 0:
        raise LMForgeError("diagonal_fisher needs at least one batch")
    return {n: f / count for n, f in fisher.items()}


def distillation_loss(
    student_logits: Tensor,
    teacher_logits: Tensor,
    temperature: float = 1.0,
    mask: Tensor | None = None,
) -> Tensor:
    """T²·KL(teacher_T ‖ student_T) per position, averaged (masked if ``mask`` given), Hinton-style.

    Softened by temperature T on both sides; T² keeps gradient scale independent of T.
    """
    kl = _softened_kl(student_logits, teacher_logits, temperature)
    return kl.mean() if mask is None else masked_mean(kl, mask)


def _softened_kl(student_logits: Tensor, teacher_logits: Tensor, t: float) -> Tensor:
    """T²·KL(softmax(teacher/T) ‖ softmax(student/T)) at each position (no gradient to the
    teacher)."""
    s = F.log_softmax(student_logits.float() / t, dim=-1)
    q = F.log_softmax(teacher_logits.float().detach() / t, dim=-1)
    return (q.exp() * (q - s)).sum(-1) * t * t


def lm_distillation_loss(
    student: nn.Module,
    teacher: nn.Module,
    input_ids: Tensor,
    temperature: float = 1.0,
    mask: Tensor | None = None,
) -> Tensor:
    """`distillation_loss(student(input_ids), teacher(input_ids), temperature, mask)` with both
    LM heads applied a chunk of tokens at a time (logprobs.map_token_chunks), so neither model's
    [B, T, V] logits are ever built."""
    with torch.no_grad():
        teacher_h = teacher.hidden_states(input_ids)
    student_h = student.hidden_states(input_ids)
    head_s, head_t = lm_head_fn(student), lm_head_fn(teacher)

    def kl(hs: Tensor, ht: Tensor) -> tuple[Tensor]:
        with torch.no_grad():
            teacher_logits = head_t(teacher.norm(ht))
        return (_softened_kl(head_s(student.norm(hs)), teacher_logits, temperature),)

    d = student_h.shape[-1]
    (per_token,) = map_token_chunks(
        kl, [student_h.reshape(-1, d), teacher_h.reshape(-1, d)],
        chunk_tokens(student.config.vocab_size),
    )  # fmt: skip
    return per_token.mean() if mask is None else masked_mean(per_token, mask.reshape(-1))
