"""Evaluate retrieval and RAG answers on a labelled question set.

A question set is a JSONL file, one question per line:

    {"id": "pydoc-001", "split": "validation", "topic": "break",
     "question": "What happens to a loop's optional else block when I jump out of the loop early?",
     "answer": "skipping the optional \\"else\\" clause",
     "evidence": "It terminates the nearest enclosing loop, skipping the optional \\"else\\" ..."}

`topic` is the one gold source (a chunk's source, "pydoc:" dropped for the built-in docs),
`answer` a short span of the docs, `evidence` the docs' sentence that contains it, and `split`
is "validation" (for choosing chunk size, k, fusion weights) or "test" (for reporting). The
shipped set, `PYDOC_QUESTIONS`, asks about the built-in Python docs (builtin:pydoc).

Retrieval is scored by recall@k (a chunk of the gold topic among the top k) and MRR@10; answers
by SQuAD v1.1 exact match and token F1 (lower-cased, punctuation and articles removed) after the
[n] citation markers are stripped, plus how often the answer cites a passage of the gold topic.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from lmforge.errors import DataError
from lmforge.fileio import read_jsonl
from lmforge.nlp.metrics import precision_recall_f1
from lmforge.retrieval.rag import RAG, strip_citations
from lmforge.retrieval.retriever import Retriever

PYDOC_QUESTIONS = Path(__file__).parent / "data" / "pydoc_questions.jsonl"
EVAL_SPLITS = ("validation", "test")
FIELDS = ("id", "split", "topic", "question", "answer", "evidence")


@dataclass(frozen=True)
class Question:
    id: str
    split: str
    topic: str  # the one gold source
    question: str
    answer: str  # a short span of the docs
    evidence: str  # the docs' sentence that contains `answer`


def load_questions(path: str | Path = PYDOC_QUESTIONS, split: str | None = None) -> list[Question]:
    """The questions of `path` (all, or one split); a malformed row is a DataError at file:line."""
    if split is not None and split not in EVAL_SPLITS:
        raise DataError(f"split {split!r}: expected one of {EVAL_SPLITS}")
    rows, seen = [], set()
    for line, row in read_jsonl(path):
        bad = [f for f in FIELDS if not isinstance(row.get(f), str) or not row[f].strip()]
        if bad:
            raise DataError(f"{path}:{line}: missing or empty string field(s) {', '.join(bad)}")
        if row["split"] not in EVAL_SPLITS:
            raise DataError(f"{path}:{line}: split {row['split']!r} is not one of {EVAL_SPLITS}")
        if row["id"] in seen:
            raise DataError(f"{path}:{line}: duplicate id {row['id']!r}")
        seen.add(row["id"])
        rows.append(Question(**{f: row[f] for f in FIELDS}))
    if not rows:
        raise DataError(f"{path}: no questions")
    return [q for q in rows if split is None or q.split == split]


def topic_of(source: str) -> str:
    """The topic name of a chunk source ("pydoc:break" -> "break"; other sources unchanged)."""
    return source.removeprefix("pydoc:")


def check_gold_topics(questions: Iterable[Question], retriever: Retriever, what: str) -> None:
    """DataError (one line) when a gold topic has no chunk in the index: such a question could
    never be retrieved, so every score would silently undercount."""
    indexed = {topic_of(c.source) for c in retriever.chunks}
    missing = sorted({q.topic for q in questions} - indexed)
    if missing:
        shown = ", ".join(repr(t) for t in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise DataError(
            f"{what}: {len(missing)} gold topic(s) not in the index: {shown} "
            "(build the index from the corpus the questions are about)"
        )


def topic_words(topic: str) -> list[str]:
    """The words that would give a topic's name away in a question ("string-methods" ->
    ["string", "methods"]); used to check that questions are paraphrased."""
    return [w for w in re.split(r"[-_\s]+", topic.lower()) if w]


def names_topic(question: str, topic: str) -> str | None:
    """The word of `question` that names its gold topic, or None. A word names a topic word when
    it equals it or, for topic words of 4+ letters, shares its stem (trailing "s" dropped): "lists"
    is named by "list" and "listing", "assert" by "assertion"; "del" only by "del"."""
    words = re.findall(r"[a-z0-9]+", question.lower())
    for name in topic_words(topic):
        stem = name[:-1] if len(name) > 4 and name.endswith("s") else name
        for w in words:
            if w == name or (len(stem) >= 4 and w.startswith(stem)):
                return w
    return None


# ---- SQuAD v1.1 answer scoring ---------------------------------------------------------------
def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def squad_exact_match(prediction: str, gold: str) -> float:
    """1.0 when prediction and gold are equal after SQuAD normalisation, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """SQuAD token F1 between the normalised prediction and gold answer."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    same = sum((Counter(pred) & Counter(ref)).values())
    return precision_recall_f1(same, len(pred) - same, len(ref) - same)[2]


# ---- evaluation ------------------------------------------------------------------------------
def retrieval_scores(
    retriever: Retriever, questions: list[Question], mode: str, ks: Iterable[int] = (1, 3, 5, 10)
) -> dict[str, float]:
    """recall@k for each k and MRR@10 of `mode` search (rank of the first gold-topic chunk)."""
    ks = sorted(set(ks))
    depth = max(10, *ks)
    ranks = []  # 1-based rank of the first gold chunk, None when absent from the top `depth`
    for q in questions:
        hits = retriever.search(q.question, depth, mode)
        ranks.append(next((h.rank for h in hits if topic_of(h.chunk.source) == q.topic), None))
    n = len(questions)
    out = {f"recall@{k}": sum(r is not None and r <= k for r in ranks) / n for k in ks}
    out["mrr@10"] = sum(1 / r for r in ranks if r is not None and r <= 10) / n
    return out


def answer_scores(rag: RAG, questions: list[Question]) -> tuple[dict[str, float | str], list]:
    """(summary, per-question rows) of RAG answers: exact match, F1, how often the gold topic
    was among the passages and among the cited ones. `kind` says whether the answers were
    generated or extractive (retrieved sentences, scored only as a baseline)."""
    answers = rag.ask_many([q.question for q in questions])
    rows = []
    for q, a in zip(questions, answers):
        text = strip_citations(a.text)
        rows.append(
            {
                **asdict(q),
                "kind": a.kind,
                "prediction": a.text,
                "sources": [topic_of(h.chunk.source) for h in a.sources],
                "cited": [topic_of(h.chunk.source) for h in a.cited],
                "em": squad_exact_match(text, q.answer),
                "f1": f1_score(text, q.answer),
                "notes": a.notes,
            }
        )
    n = len(rows)
    summary = {
        "kind": rag.kind,
        "questions": n,
        "exact_match": sum(r["em"] for r in rows) / n,
        "f1": sum(r["f1"] for r in rows) / n,
        "gold_in_passages": sum(r["topic"] in r["sources"] for r in rows) / n,
        "cites_gold": sum(r["topic"] in r["cited"] for r in rows) / n,
    }
    return summary, rows
