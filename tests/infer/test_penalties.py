"""Penalties on hand-computed logits."""

import torch

from lmforge.infer.params import GenerationParams
from lmforge.infer.penalties import (
    PenaltyState,
    apply_presence_frequency_penalty,
    apply_repetition_penalty,
)


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert torch.allclose(out, torch.tensor([[1.0, -2.0, 0.5, 3.0]]))


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(2, 11)
    ids = torch.tensor([[1, 4, 4, 7], [0, 2, 9, 10]])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    seen = torch.zeros(2, 11, dtype=torch.bool).scatter(1, ids, True)
    assert torch.allclose(apply_repetition_penalty(logits, seen, torch.tensor([1.3, 1.3])), ref)


def test_presence_and_frequency_penalties():
    logits = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    counts = torch.tensor([[0.0, 1.0, 3.0], [2.0, 0.0, 0.0]])
    out = apply_presence_frequency_penalty(
        logits, counts, torch.tensor([0.5, 0.0]), torch.tensor([0.25, 1.0])
    )
    # row 0: 1 - 0.25*c - 0.5*[c>0]; row 1: -1.0*c
    assert torch.allclose(out, torch.tensor([[1.0, 0.25, -0.25], [-2.0, 0.0, 0.0]]))


def test_state_tracks_prompt_and_generated_tokens():
    state = PenaltyState(rows=2, vocab_size=5)
    state.start_row(1, [0, 0, 3], GenerationParams(repetition_penalty=2.0, presence_penalty=1.0))
    state.observe(torch.tensor([4]), lo=1)
    state.observe(torch.tensor([4]), lo=1)
    assert state.seen[1].tolist() == [True, False, False, True, True]
    assert state.counts[1].tolist() == [0, 0, 0, 0, 2]  # prompt tokens are not "generated"
    out = state.apply(torch.full((1, 5), 2.0), slice(1, 2))
    assert out.tolist() == [[1.0, 2.0, 2.0, 1.0, 0.0]]


def test_sampler_ignores_a_precomputed_argmax_on_penalised_rows():
    """The compiled decode step hands the sampler its argmax: greedy rows take it as given,
    but once a row is penalised the tokens come from the penalised logits."""
    from lmforge.infer.sampling import RowSampler

    sampler = RowSampler(2, 4, steps=4)
    sampler.start_row(0, GenerationParams(temperature=0.0), [3], None)
    sampler.start_row(1, GenerationParams(temperature=0.0), [3], None)
    logits = torch.tensor([[0.0, 0.0, 1.0, 2.0], [0.0, 0.0, 1.0, 2.0]])
    given = torch.tensor([3, 1])  # row 1's differs from its logits: shows it is taken as given
    assert sampler.sample(logits, greedy=given)[1] == [3, 1]
    sampler.start_row(0, GenerationParams(temperature=0.0, repetition_penalty=4.0), [3], None)
    assert sampler.sample(logits, greedy=given)[1] == [2, 3]  # token 3 (in the prompt): 2 / 4
