"""Log-likelihood scoring and generation helpers shared by every task and the harness adapter."""

import pytest
import torch
import torch.nn.functional as F

from lmforge.errors import ConfigError
from lmforge.eval.perplexity import perplexity
from lmforge.eval.scoring import (
    fit_prompt,
    generate_texts,
    loglikelihood,
    prefix_id,
    rolling_loglikelihood,
)


def _reference(lm, context: str, continuation: str) -> tuple[float, bool]:
    """Sum of log-probs of the continuation tokens from one unbatched forward pass."""
    tok = lm.tokenizer
    ctx = tok.encode(context) if context else [prefix_id(lm)]
    cont = tok.encode(continuation)
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = F.log_softmax(lm.model(ids[:, :-1]).float(), -1)[0, len(ctx) - 1 :]
    target = torch.tensor(cont)
    return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


def test_loglikelihood_matches_unbatched_forward(tiny_lm):
    pairs = [("The sky is", " blue"), ("Question: What is 2 plus 2? Answer:", " 4."), ("", "Paris")]
    got = loglikelihood(tiny_lm, pairs, batch_size=2)  # batched with right padding
    for (lp, greedy), pair in zip(got, pairs):
        ref_lp, ref_greedy = _reference(tiny_lm, *pair)
        assert lp == pytest.approx(ref_lp, abs=1e-4) and greedy == ref_greedy
        assert lp < 0


def test_is_greedy_is_true_for_the_models_own_greedy_continuation(tiny_lm):
    context = "The sky is"
    new = tiny_lm.generate([tiny_lm.tokenizer.encode(context)], max_new_tokens=3, temperature=0)
    cont = tiny_lm.tokenizer.decode(new[0])
    if tiny_lm.tokenizer.encode(context) + tiny_lm.tokenizer.encode(cont) != (
        tiny_lm.tokenizer.encode(context) + new[0]
    ):
        pytest.skip("greedy tokens do not re-tokenize identically")
    assert loglikelihood(tiny_lm, [(context, cont)])[0][1] is True


def test_rolling_loglikelihood_equals_perplexity_windows(tiny_lm):
    text = "Paris is the capital of France. The sky is blue. " * 12  # longer than the window
    ids = [prefix_id(tiny_lm)] + tiny_lm.tokenizer.encode(text)
    assert len(ids) > 2 * tiny_lm.config.max_seq_len
    total = rolling_loglikelihood(tiny_lm, text)
    ppl = perplexity(tiny_lm.model, ids, tiny_lm.tokenizer.token_byte_lengths())
    assert total == pytest.approx(-ppl.nll * ppl.tokens, rel=1e-5)


def test_generate_texts_fits_long_prompts_and_cuts_at_stop(tiny_lm):
    long_prompt = "The sky is blue. " * 100  # far beyond the 128-token window
    out = generate_texts(tiny_lm, [long_prompt, "Paris"], max_new_tokens=5, temperature=0.0)
    assert len(out) == 2 and all(isinstance(t, str) for t in out)
    greedy = generate_texts(tiny_lm, ["Paris"], max_new_tokens=8, temperature=0.0)[0]
    if len(greedy) > 2:
        cut = generate_texts(tiny_lm, ["Paris"], 8, stop=[greedy[1:3]], temperature=0.0)[0]
        assert cut == greedy[: greedy.index(greedy[1:3])]
    assert fit_prompt([1, 2, 3, 4], 2) == [3, 4]
    with pytest.raises(ConfigError, match="no room"):
        fit_prompt([1], 0)


def test_continuation_errors(tiny_lm):
    with pytest.raises(ConfigError, match="encodes to no tokens"):
        loglikelihood(tiny_lm, [("a", "")])
