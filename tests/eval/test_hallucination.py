"""Hallucination rate E[1 - V(claim)] over a decoding grid, with and without RAG."""

import json
from dataclasses import replace

import pytest

import lmforge.eval.scoring as scoring
from lmforge import LM
from lmforge.errors import ConfigError, DataError
from lmforge.eval.hallucination import (
    ContainsAnswer,
    decoding_grid,
    hallucination_rate,
    load_qa,
    sweep,
)
from lmforge.retrieval import RAG, Retriever
from lmforge.retrieval.chunking import Document, chunk_documents

ROWS = [
    {"question": "What is the capital of France?", "answer": "Paris"},
    {"question": "What color is the sky?", "answers": ["blue", "azure"]},
]


def test_rate_is_mean_of_one_minus_verdicts():
    assert hallucination_rate([1.0, 0.0, 0.5, 0.0]) == pytest.approx(0.625)
    with pytest.raises(ConfigError):
        hallucination_rate([])
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        hallucination_rate([1.5])


def test_contains_answer_verifier():
    v = ContainsAnswer()
    assert v("It is Paris, of course.", ROWS[0]) == 1.0
    assert v("Parisian food", ROWS[0]) == 0.0  # whole words only
    assert v("Azure!", ROWS[1]) == 1.0 and v("grey", ROWS[1]) == 0.0


def test_decoding_grid_keeps_one_greedy_cell():
    grid = decoding_grid([0.0, 0.7], [1.0, 0.9])
    assert [(s.temperature, s.top_p) for s in grid] == [(0.0, 1.0), (0.7, 1.0), (0.7, 0.9)]
    assert grid[2].label == "T=0.7, top-p=0.9"


def test_sweep_with_a_real_lm_counts_every_sample(tiny_lm):
    calls = []
    verifier = lambda claim, row: calls.append(claim) or 1.0  # noqa: E731
    out = sweep(tiny_lm, ROWS, verifier, decoding_grid([0.0, 1.0], [1.0]), samples=3,
                max_new_tokens=4)  # fmt: skip
    assert [(r.temperature, r.rag, r.n, r.rate) for r in out] == [
        (0.0, False, 2, 0.0),
        (1.0, False, 6, 0.0),
    ]
    assert len(calls) == 8


def test_rag_lowers_the_rate_when_the_answer_is_in_the_context(tiny_lm, monkeypatch):
    """A stand-in model that copies the first context line when there is one: closed-book it
    knows nothing (rate 1), with retrieval it answers from the right chunk (rate 0)."""

    def fake_generate(lm, prompts, *args, **kwargs):
        # the line after the first passage's "[1] title" header, else no knowledge at all
        head = "\n[1] "
        return [p.split(head, 1)[1].split("\n")[1] if head in p else "I do not know"
                for p in prompts]  # fmt: skip

    monkeypatch.setattr(scoring, "generate_texts", fake_generate)
    docs = [
        Document("fr", "France", "Paris is the capital of France."),
        Document("sky", "Sky", "The sky is blue because of Rayleigh scattering."),
    ]
    # the RAG prompt (instruction, numbered passages, question in a chat turn) needs more than the
    # shared fixture's 128-token window
    lm = LM.from_config(replace(tiny_lm.config, max_seq_len=512), tiny_lm.tokenizer, seed=0)
    rag = RAG(Retriever.build(chunk_documents(docs), encoder=None), lm, k=1, mode="bm25",
              max_new_tokens=8)  # fmt: skip
    out = sweep(lm, ROWS, settings=decoding_grid([0.0], [1.0]), rag=rag)
    assert [(r.rag, r.rate) for r in out] == [(False, 1.0), (True, 0.0)]


def test_load_qa(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    assert load_qa(path) == ROWS
    path.write_text('{"question": "q"}\n')
    with pytest.raises(DataError, match="qa.jsonl:1: expected 'answer'"):
        load_qa(path)
