"""The two things every evaluation asks of an LM: continue a prompt, and score a continuation.

`generate_texts` fits each prompt into the context window (keeping its end, where the question
is), generates in batches and cuts at stop strings. `loglikelihood` returns log P(continuation |
context) and whether greedy decoding would produce it, the way lm-evaluation-harness defines it:
context and continuation are tokenized separately and joined, so the continuation's tokens are
the same whatever the context. `rolling_loglikelihood` scores a whole text in windows, each token
once, for perplexity-style tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F

from lmforge.data.batches import pad_collate
from lmforge.errors import ConfigError
from lmforge.eval.perplexity import windowed_nll
from lmforge.infer.engine import Engine
from lmforge.infer.params import GenerationParams
from lmforge.model.modes import eval_mode
from lmforge.progress import progress_bar


def prefix_id(lm) -> int:
    """The token that conditions an empty context: BOS, else EOS, else 0."""
    tok = lm.require_tokenizer("evaluation")
    return next((i for i in (tok.bos_id, tok.eos_id) if i is not None), 0)


def fit_prompt(ids: list[int], room: int) -> list[int]:
    """Keep the last `room` tokens: the end of a prompt (the question) matters most."""
    if room < 1:
        raise ConfigError(f"no room for the prompt in the context window ({room} tokens)")
    return ids[-room:]


def generate_texts(
    lm,
    prompts: Sequence[str],
    max_new_tokens: int = 64,
    stop: Sequence[str] = (),
    batch_size: int = 8,
    progress: bool = False,
    **sampling,
) -> list[str]:
    """One completion per prompt (special tokens dropped, cut at the first stop string), on
    the engine: `batch_size` sequences decode together, a finished one's slot taken by the next
    prompt at once. `sampling`: GenerationParams fields (temperature, top_p, seed, ...)."""
    tok = lm.require_tokenizer("evaluation")
    room = lm.config.max_seq_len - max_new_tokens
    params = GenerationParams(max_new_tokens, stop=[s for s in stop if s], **sampling)
    eos = [tok.eos_id] if tok.eos_id is not None else []
    rows = [fit_prompt(tok.encode(p) or [prefix_id(lm)], room) for p in prompts]
    if not rows:
        return []
    out: list[str] = []
    chunk = 8 * batch_size  # progress granularity; the engine keeps its batch full within it
    with eval_mode(lm.model):
        engine = Engine(lm.model, tok, max_batch=min(batch_size, len(rows)), eos_ids=eos)
        for s in progress_bar(range(0, len(rows), chunk), desc="generating", disable=not progress):
            seeded = params if params.seed is None else replace(params, seed=params.seed + s)
            out += [c.text for c in engine.generate(rows[s : s + chunk], seeded)]
    return out


@torch.inference_mode()
def _score_rows(lm, rows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
    """For each (tokens, n_scored): log-prob of the last n_scored tokens given the ones before."""
    model = lm.model
    model.eval()
    device = next(model.parameters()).device
    # right padding: causal attention never lets a real token see it
    x, _ = pad_collate([t[:-1] for t, _ in rows], 0)
    logp = F.log_softmax(model(x.to(device)).float(), dim=-1)
    out = []
    for i, (t, n) in enumerate(rows):
        target = torch.as_tensor(t[-n:], device=device)
        lp = logp[i, len(t) - 1 - n : len(t) - 1]
        out.append(
            (float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
        )
    return out


def loglikelihood(
    lm, pairs: Sequence[tuple[str, str]], batch_size: int = 16, progress: bool = False
) -> list[tuple[float, bool]]:
    """(log P(continuation | context), is_greedy) for each (context, continuation) pair.

    Long inputs keep their last max_seq_len + 1 tokens (the continuation is always scored).
    """
    tok = lm.require_tokenizer("evaluation")
    window = lm.config.max_seq_len
    rows = []
    for context, continuation in pairs:
        cont = tok.encode(continuation)
        if not cont:
            raise ConfigError(f"continuation {continuation!r} encodes to no tokens")
        if len(cont) > window:
            raise ConfigError(
                f"continuation of {len(cont)} tokens exceeds the {window}-token window"
            )
        ctx = tok.encode(context) if context else [prefix_id(lm)]
        rows.append(((ctx + cont)[-(window + 1) :], len(cont)))
    out: list[tuple[float, bool]] = []
    for s in progress_bar(range(0, len(rows), batch_size), desc="scoring", disable=not progress):
        out += _score_rows(lm, rows[s : s + batch_size])
    return out


def rolling_loglikelihood(lm, text: str) -> float:
    """log P(text | prefix token), every token scored once with up to max_seq_len of context."""
    seq = [prefix_id(lm)] + lm.require_tokenizer("evaluation").encode(text)
    return -windowed_nll(lm.model, seq)
