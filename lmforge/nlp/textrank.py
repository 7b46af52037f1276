"""PageRank by power iteration, and TextRank keyword and sentence extraction built on it.

PageRank on a weighted directed graph: each node passes its score to its out-neighbours in
proportion to edge weight; a dangling node (no out-edges) spreads its score over all nodes; with
probability 1 - d the walk jumps to a random node:

    x <- d * (W^T x + (dangling mass) / N) + (1 - d) / N

TextRank (Mihalcea & Tarau, 2004) runs PageRank on an undirected graph of text units: words that
co-occur within a window (keywords), or sentences linked by word overlap (extractive summary).
"""

import math
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from itertools import combinations

import numpy as np

from lmforge.errors import LMForgeError, require_int
from lmforge.nlp.text import resolve_stopwords, split_sentences, tokenize

Graph = Mapping[Hashable, Mapping[Hashable, float]]


def pagerank(
    graph: Graph,
    *,
    damping: float = 0.85,
    tol: float = 1e-8,
    max_iter: int = 200,
) -> dict[Hashable, float]:
    """PageRank scores (summing to 1) of a graph given as {node: {neighbour: weight}}.

    Edges are directed; list both directions for an undirected graph. Nodes that appear only as
    neighbours are included. Stops when the L1 change per node falls below `tol` (as networkx).
    """
    if not 0.0 <= damping <= 1.0:
        raise LMForgeError(f"damping must be in [0, 1], got {damping}")
    nodes = list(dict.fromkeys([*graph, *(v for nbrs in graph.values() for v in nbrs)]))
    n = len(nodes)
    if n == 0:
        return {}
    index = {v: i for i, v in enumerate(nodes)}
    # Edge lists rather than an N x N matrix, so word graphs of long texts stay small.
    edges = [(u, v, weight) for u, nbrs in graph.items() for v, weight in nbrs.items()]
    for u, v, weight in edges:
        if weight < 0 or not math.isfinite(weight):
            raise LMForgeError(f"edge {u!r} -> {v!r} has invalid weight {weight}")
    src = np.array([index[u] for u, _, _ in edges], dtype=np.int64)
    dst = np.array([index[v] for _, v, _ in edges], dtype=np.int64)
    wts = np.array([weight for _, _, weight in edges], dtype=np.float64)
    out = np.bincount(src, weights=wts, minlength=n)
    dangling = out == 0
    # Each edge carries its share of the source's out-weight, so a node hands out its own score.
    share = wts / np.where(dangling, 1.0, out)[src]
    x = np.full(n, 1.0 / n)
    for _ in range(max_iter):
        prev = x
        flow = np.bincount(dst, weights=prev[src] * share, minlength=n)
        x = damping * (flow + prev[dangling].sum() / n) + (1.0 - damping) / n
        if np.abs(x - prev).sum() < n * tol:
            return {v: float(s) for v, s in zip(nodes, x / x.sum())}
    raise LMForgeError(f"PageRank did not converge to tol={tol} in {max_iter} iterations")


def _undirected(edges: Counter, nodes: Iterable[Hashable]) -> dict[Hashable, Counter]:
    """A symmetric {node: {neighbour: weight}} graph from counted (a, b) pairs; every one of
    `nodes` is in it, so isolated ones still get the random-jump share."""
    graph = defaultdict(Counter, {node: Counter() for node in nodes})
    for (a, b), weight in edges.items():
        graph[a][b] += weight
        graph[b][a] += weight
    return graph


def textrank_keywords(
    text: str,
    k: int = 10,
    *,
    window: int = 2,
    stopwords: bool | Iterable[str] | None = True,
    min_length: int = 2,
    damping: float = 0.85,
) -> list[tuple[str, float]]:
    """The top-k keywords of `text` as (word, score), best first (ties alphabetical).

    Candidates are lowercase words that are not stopwords, have at least `min_length` characters
    and contain a letter. Two candidates are linked (weight = number of times) when they fall
    within `window` consecutive candidates of each other in the same sentence.
    """
    if k < 1 or window < 2:
        raise LMForgeError(f"need k >= 1 and window >= 2, got k={k}, window={window}")
    stop = resolve_stopwords(stopwords)
    edges: Counter = Counter()
    words: set[str] = set()
    for sentence in split_sentences(text):
        cands = [
            t
            for t in tokenize(sentence)
            if t not in stop and len(t) >= min_length and any(c.isalpha() for c in t)
        ]
        words.update(cands)
        edges.update(
            (a, b) for i, a in enumerate(cands) for b in cands[i + 1 : i + window] if a != b
        )
    if not words:
        return []
    scores = pagerank(_undirected(edges, sorted(words)), damping=damping)
    return sorted(scores.items(), key=lambda ws: (-ws[1], ws[0]))[:k]


def sentence_similarity(a: Sequence[str], b: Sequence[str]) -> float:
    """TextRank's overlap similarity |a & b| / (log|a| + log|b|) of two tokenized sentences.

    The log lengths stop long sentences from winning just by size. When both sentences have a
    single word the denominator is 0; they are then similar (1.0) only if the word is shared.
    """
    overlap = len(set(a) & set(b))
    if overlap == 0:
        return 0.0
    denom = math.log(len(a)) + math.log(len(b))
    return overlap / denom if denom > 0 else 1.0


def textrank_sentences(
    text: str | Sequence[str],
    k: int = 3,
    *,
    stopwords: bool | Iterable[str] | None = True,
    damping: float = 0.85,
) -> list[tuple[int, str, float]]:
    """An extractive summary: the top-k sentences as (index, sentence, score) in original order.

    `text` is a text (split into sentences) or a list of sentences. Ties in score go to the
    earlier sentence.
    """
    require_int("k", k)
    sentences = split_sentences(text) if isinstance(text, str) else list(text)
    if not sentences:
        return []
    tokens = [tokenize(s, stopwords=resolve_stopwords(stopwords)) for s in sentences]
    pairs = combinations(range(len(sentences)), 2)
    sims = {(i, j): sentence_similarity(tokens[i], tokens[j]) for i, j in pairs}
    edges = Counter({pair: sim for pair, sim in sims.items() if sim > 0})
    scores = pagerank(_undirected(edges, range(len(sentences))), damping=damping)
    best = sorted(range(len(sentences)), key=lambda i: (-scores[i], i))[:k]
    return [(i, sentences[i], scores[i]) for i in sorted(best)]
