"""Retrieval-augmented generation: retrieve chunks, put them before the question, answer, cite.

    answer = RAG(retriever, lm).ask("How do I leave a loop early?")
    print(answer.format())          # the answer, then "[1] break (pydoc:break)" ...

With an LM, the top-m chunks are numbered [1]..[m] in a prompt that must fit the model's context
window together with the generated tokens: chunks are added best first while they fit, the one
that does not is cut to the room left, the rest are dropped, and `Answer.notes` says so. Without
an LM (`RAG(retriever)`), the answer is extractive: the sentences of the retrieved chunks closest
to the question, each marked with its source, so `lmforge rag ask` is useful before any model is
trained.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lmforge.errors import ConfigError
from lmforge.nlp import BM25Scorer, reciprocal_rank_fusion, split_sentences
from lmforge.retrieval.retriever import Hit, Retriever

INSTRUCTION = "Answer the question using the numbered context. Cite sources like [1].\n\n"
MIN_CHUNK_TOKENS = 16  # a cut chunk shorter than this is noise, so it is dropped instead
_UNDERLINE = re.compile(r"[*=\-~^]{4,}")  # reST heading underlines in the Python docs


@dataclass
class Answer:
    text: str
    sources: list[Hit]  # the chunks the answer may cite, [1] = sources[0]
    prompt: str = ""
    notes: list[str] = field(default_factory=list)  # truncation and other caveats

    def format(self) -> str:
        """The answer followed by its numbered sources (and any notes), for printing."""
        lines = [self.text.strip() or "(empty answer)", "", "Sources:"]
        for n, hit in enumerate(self.sources, 1):
            lines.append(f"[{n}] {hit.chunk.title} ({hit.chunk.source}, score {hit.score:.3f})")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _context_block(n: int, hit: Hit, text: str) -> str:
    return f"[{n}] {hit.chunk.title}\n{text.strip()}\n\n"


def _question_block(question: str) -> str:
    return f"Question: {question.strip()}\nAnswer:"


class LMAnswerer:
    """Generates the answer with an lmforge LM from a prompt that fits its context window."""

    def __init__(self, lm, max_new_tokens: int = 128, temperature: float = 0.0, **sampling):
        if lm.tokenizer is None:
            raise ConfigError("RAG needs an LM with a tokenizer")
        self.lm, self.max_new_tokens = lm, max_new_tokens
        self.sampling = {"temperature": temperature, **sampling}

    def build_prompt(self, question: str, hits: list[Hit]) -> tuple[str, list[Hit], list[str]]:
        """(prompt, hits placed in it, notes) with prompt tokens + max_new_tokens <= window."""
        tok = self.lm.tokenizer
        window = self.lm.config.max_seq_len
        budget = window - self.max_new_tokens
        fixed = len(tok.encode(INSTRUCTION + _question_block(question)))
        if fixed > budget:
            raise ConfigError(
                f"the question takes {fixed} tokens but only {budget} fit in the model's "
                f"{window}-token window with max_new_tokens={self.max_new_tokens}"
            )
        room, context, placed, notes = budget - fixed, "", [], []
        for hit in hits:
            block = _context_block(len(placed) + 1, hit, hit.chunk.text)
            cost = len(tok.encode(block))
            if cost <= room:
                context, room = context + block, room - cost
                placed.append(hit)
                continue
            header = len(tok.encode(_context_block(len(placed) + 1, hit, "")))
            keep = room - header - 1  # one token of slack: re-encoding a cut text can merge
            if keep >= MIN_CHUNK_TOKENS:
                text = tok.decode(tok.encode(hit.chunk.text)[:keep])
                context += _context_block(len(placed) + 1, hit, text)
                placed.append(hit)
                notes.append(f"chunk [{len(placed)}] truncated to {keep} tokens to fit")
            break
        if len(placed) < len(hits):
            notes.append(
                f"context window of {window} tokens: kept {len(placed)} of {len(hits)} chunks"
            )
        return INSTRUCTION + context + _question_block(question), placed, notes

    def answer(self, question: str, hits: list[Hit]) -> Answer:
        prompt, placed, notes = self.build_prompt(question, hits)
        text = self.lm.complete(
            prompt, max_new_tokens=self.max_new_tokens, stop=["\nQuestion:"], **self.sampling
        )[0]
        return Answer(text.strip(), placed, prompt, notes)


def _is_prose(sentence: str) -> bool:
    """A sentence worth quoting: several words, ending like a sentence; not a heading or a
    grammar rule ("nonlocal_stmt ::= ...")."""
    return len(sentence.split()) >= 4 and sentence[-1] in ".!?:" and "::=" not in sentence


class ExtractiveAnswerer:
    """Answers with the retrieved sentences that best match the question (no model needed)."""

    def __init__(self, retriever: Retriever, n_sentences: int = 3, rrf_k: float = 10.0):
        self.retriever, self.n_sentences, self.rrf_k = retriever, n_sentences, rrf_k

    def _scores(self, question: str, sentences: list[str]) -> list[float]:
        if self.retriever.embeddings is not None:  # meaning, when an encoder is at hand
            enc = self.retriever.encoder
            return (enc.encode(sentences) @ enc.encode([question])[0]).tolist()
        return BM25Scorer(sentences, stopwords=True).scores(question).tolist()

    def answer(self, question: str, hits: list[Hit]) -> Answer:
        pool = []  # (hit index, sentence), in retrieval order
        for i, hit in enumerate(hits):
            for s in split_sentences(_UNDERLINE.sub(" ", hit.chunk.text)):
                s = " ".join(s.split())
                if _is_prose(s):
                    pool.append((i, s))
        if not pool:
            return Answer("", hits, notes=["no sentence in the retrieved chunks"])
        # Fuse two rankings: how well a sentence matches the question, and how well its chunk
        # did in retrieval (a chunk-level judgement that sees more context than one sentence).
        scores = self._scores(question, [s for _, s in pool])
        by_match = sorted(range(len(pool)), key=lambda j: (-scores[j], j))
        fused = reciprocal_rank_fusion([by_match, list(range(len(pool)))], k=self.rrf_k)
        cited: list[int] = []  # hit indices in first-cited order -> source numbers
        lines = []
        for j, _ in fused[: self.n_sentences]:
            i, sentence = pool[j]
            if i not in cited:
                cited.append(i)
            lines.append(f"{sentence} [{cited.index(i) + 1}]")
        return Answer("\n".join(lines), [hits[i] for i in cited], notes=["extractive answer"])


class RAG:
    """Retrieve the top `k` chunks for a question, then answer from them with citations."""

    def __init__(
        self,
        retriever: Retriever,
        lm=None,
        k: int = 5,
        mode: str = "hybrid",
        max_new_tokens: int = 128,
        **sampling,
    ):
        self.retriever, self.k = retriever, k
        # A BM25-only index still answers; the note in each Answer says the mode changed.
        self.mode = mode if mode in retriever.modes else "bm25"
        self._fallback = "" if mode == self.mode else f"mode {mode!r} needs embeddings: used bm25"
        self.answerer = (
            ExtractiveAnswerer(retriever)
            if lm is None
            else LMAnswerer(lm, max_new_tokens, **sampling)
        )

    def retrieve(self, question: str) -> list[Hit]:
        return self.retriever.search(question, self.k, self.mode)

    def ask(self, question: str) -> Answer:
        """Retrieve, then answer; `Answer.sources` are the chunks the answer was built from."""
        hits = self.retrieve(question)
        answer = self.answerer.answer(question, hits)
        if self._fallback:
            answer.notes.append(self._fallback)
        return answer
