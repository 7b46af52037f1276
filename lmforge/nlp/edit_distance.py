"""Levenshtein edit distance (weighted, with the alignment) and a dictionary spell corrector.

The dynamic program is written out for clarity and for weighted costs; unit-cost distances go
through `rapidfuzz`, which computes the same number much faster (tests check they agree).
Both work on strings and on sequences of tokens (e.g. word lists, for word error rate).
"""

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from rapidfuzz import process
from rapidfuzz.distance import Levenshtein

from lmforge.errors import LMForgeError


@dataclass(frozen=True)
class EditOp:
    """One step of an alignment: 'match', 'substitute', 'insert' or 'delete'.

    `i` and `j` index the source and target; `src`/`dst` are the items involved (None when absent).
    """

    op: str
    i: int
    j: int
    src: Hashable | None
    dst: Hashable | None


def _check_costs(insert_cost: float, delete_cost: float, substitute_cost: float) -> None:
    for name, c in (
        ("insert", insert_cost),
        ("delete", delete_cost),
        ("substitute", substitute_cost),
    ):
        if c < 0:
            raise LMForgeError(f"{name}_cost must be >= 0, got {c}")


def _table(a: Sequence, b: Sequence, ins: float, dele: float, sub: float) -> list[list[float]]:
    """d[i][j] = cheapest cost of turning a[:i] into b[:j]."""
    d = [[0.0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        d[i][0] = i * dele
    for j in range(1, len(b) + 1):
        d[0][j] = j * ins
    for i in range(1, len(a) + 1):
        row, prev = d[i], d[i - 1]
        for j in range(1, len(b) + 1):
            diag = prev[j - 1] + (0.0 if a[i - 1] == b[j - 1] else sub)
            row[j] = min(diag, prev[j] + dele, row[j - 1] + ins)
    return d


def edit_distance(
    a: Sequence[Hashable],
    b: Sequence[Hashable],
    *,
    insert_cost: float = 1.0,
    delete_cost: float = 1.0,
    substitute_cost: float = 1.0,
) -> float:
    """Minimum total cost of insertions, deletions and substitutions turning `a` into `b`."""
    _check_costs(insert_cost, delete_cost, substitute_cost)
    if insert_cost == delete_cost == substitute_cost == 1.0:
        return float(Levenshtein.distance(a, b))
    return _table(a, b, insert_cost, delete_cost, substitute_cost)[len(a)][len(b)]


def edit_distance_dp(
    a: Sequence[Hashable],
    b: Sequence[Hashable],
    *,
    insert_cost: float = 1.0,
    delete_cost: float = 1.0,
    substitute_cost: float = 1.0,
) -> float:
    """The same distance as `edit_distance`, always by the explicit O(len(a) * len(b)) DP."""
    _check_costs(insert_cost, delete_cost, substitute_cost)
    return _table(a, b, insert_cost, delete_cost, substitute_cost)[len(a)][len(b)]


def edit_alignment(
    a: Sequence[Hashable],
    b: Sequence[Hashable],
    *,
    insert_cost: float = 1.0,
    delete_cost: float = 1.0,
    substitute_cost: float = 1.0,
) -> tuple[float, list[EditOp]]:
    """The distance and one cheapest list of operations (matches included) from `a` to `b`.

    When several alignments cost the same, the backtrace prefers match/substitute, then delete,
    then insert, so the result is deterministic.
    """
    _check_costs(insert_cost, delete_cost, substitute_cost)
    d = _table(a, b, insert_cost, delete_cost, substitute_cost)
    ops: list[EditOp] = []
    i, j = len(a), len(b)
    while i > 0 or j > 0:
        if i > 0 and j > 0:
            same = a[i - 1] == b[j - 1]
            if d[i][j] == d[i - 1][j - 1] + (0.0 if same else substitute_cost):
                ops.append(
                    EditOp("match" if same else "substitute", i - 1, j - 1, a[i - 1], b[j - 1])
                )
                i, j = i - 1, j - 1
                continue
        if i > 0 and d[i][j] == d[i - 1][j] + delete_cost:
            ops.append(EditOp("delete", i - 1, j, a[i - 1], None))
            i -= 1
        else:
            ops.append(EditOp("insert", i, j - 1, None, b[j - 1]))
            j -= 1
    ops.reverse()
    return d[len(a)][len(b)], ops


class SpellCorrector:
    """Suggest dictionary words within `max_distance` edits of a (possibly misspelled) word.

    Tie rule, documented and deterministic: lowest distance first, then highest frequency, then
    dictionary (alphabetical) order.
    """

    def __init__(
        self,
        words: Mapping[str, int] | Iterable[str],
        *,
        max_distance: float = 2,
        insert_cost: float = 1.0,
        delete_cost: float = 1.0,
        substitute_cost: float = 1.0,
    ) -> None:
        _check_costs(insert_cost, delete_cost, substitute_cost)
        if max_distance < 0:
            raise LMForgeError(f"max_distance must be >= 0, got {max_distance}")
        # A plain word list means every word has frequency 1 (ties then fall to alphabetical order).
        freqs = dict(words) if isinstance(words, Mapping) else dict.fromkeys(words, 1)
        if not freqs:
            raise LMForgeError("SpellCorrector needs a non-empty dictionary of words")
        for w, f in freqs.items():
            if not isinstance(w, str) or f < 0:
                raise LMForgeError(f"bad dictionary entry {w!r}: {f!r} (need word -> count >= 0)")
        self.frequencies = freqs
        self.words = sorted(freqs)
        self.max_distance = max_distance
        self.costs = (insert_cost, delete_cost, substitute_cost)

    def distances(self, word: str) -> dict[str, float]:
        """Edit distance from `word` to every dictionary word."""
        ins, dele, sub = self.costs
        return {
            w: edit_distance(word, w, insert_cost=ins, delete_cost=dele, substitute_cost=sub)
            for w in self.words
        }

    def candidates(self, word: str) -> list[tuple[str, float]]:
        """(dictionary word, distance) pairs within max_distance, best first by the tie rule."""
        if self.costs == (1.0, 1.0, 1.0):
            # rapidfuzz scans the whole dictionary in C and drops words beyond the cutoff.
            hits = process.extract(
                word,
                self.words,
                scorer=Levenshtein.distance,
                score_cutoff=int(self.max_distance),
                limit=None,
            )
            found = [(w, float(dist)) for w, dist, _ in hits]
        else:
            found = [(w, d) for w, d in self.distances(word).items() if d <= self.max_distance]
        return sorted(found, key=lambda wd: (wd[1], -self.frequencies[wd[0]], wd[0]))

    def correct(self, word: str) -> str:
        """The best candidate, or `word` unchanged when nothing is within max_distance."""
        found = self.candidates(word)
        return found[0][0] if found else word
