"""Levenshtein edit distance (weighted, with the alignment) and a dictionary spell corrector.

The dynamic program is written out for clarity and for weighted costs (and gives the alignment);
unit-cost distances go through `rapidfuzz`, which computes the same number much faster (tests
check it against the alignment's distance).
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


@dataclass(frozen=True)
class EditCosts:
    """What each edit operation costs; the default is the unit-cost Levenshtein distance."""

    insert: float = 1.0
    delete: float = 1.0
    substitute: float = 1.0

    def __post_init__(self) -> None:
        for name in ("insert", "delete", "substitute"):
            if getattr(self, name) < 0:
                raise LMForgeError(f"{name} cost must be >= 0, got {getattr(self, name)}")


UNIT_COSTS = EditCosts()


def _table(a: Sequence, b: Sequence, costs: EditCosts) -> list[list[float]]:
    """d[i][j] = cheapest cost of turning a[:i] into b[:j]."""
    ins, dele, sub = costs.insert, costs.delete, costs.substitute
    d = [[i * dele] + [0.0] * len(b) for i in range(len(a) + 1)]
    d[0] = [j * ins for j in range(len(b) + 1)]
    for i in range(1, len(a) + 1):
        row, prev = d[i], d[i - 1]
        for j in range(1, len(b) + 1):
            diag = prev[j - 1] + (0.0 if a[i - 1] == b[j - 1] else sub)
            row[j] = min(diag, prev[j] + dele, row[j - 1] + ins)
    return d


def edit_distance(
    a: Sequence[Hashable], b: Sequence[Hashable], costs: EditCosts = UNIT_COSTS
) -> float:
    """Minimum total cost of insertions, deletions and substitutions turning `a` into `b`."""
    if costs == UNIT_COSTS:
        return float(Levenshtein.distance(a, b))
    return _table(a, b, costs)[len(a)][len(b)]


def edit_alignment(
    a: Sequence[Hashable], b: Sequence[Hashable], costs: EditCosts = UNIT_COSTS
) -> tuple[float, list[EditOp]]:
    """The distance and one cheapest list of operations (matches included) from `a` to `b`.

    When several alignments cost the same, the backtrace prefers match/substitute, then delete,
    then insert, so the result is deterministic.
    """
    d = _table(a, b, costs)
    ops: list[EditOp] = []
    i, j = len(a), len(b)
    while i > 0 or j > 0:
        if i > 0 and j > 0:
            same = a[i - 1] == b[j - 1]
            if d[i][j] == d[i - 1][j - 1] + (0.0 if same else costs.substitute):
                ops.append(
                    EditOp("match" if same else "substitute", i - 1, j - 1, a[i - 1], b[j - 1])
                )
                i, j = i - 1, j - 1
                continue
        if i > 0 and d[i][j] == d[i - 1][j] + costs.delete:
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
        costs: EditCosts = UNIT_COSTS,
    ) -> None:
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
        self.costs = costs

    def distances(self, word: str) -> dict[str, float]:
        """Edit distance from `word` to every dictionary word."""
        return {w: edit_distance(word, w, self.costs) for w in self.words}

    def candidates(self, word: str) -> list[tuple[str, float]]:
        """(dictionary word, distance) pairs within max_distance, best first by the tie rule."""
        if self.costs == UNIT_COSTS:
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
