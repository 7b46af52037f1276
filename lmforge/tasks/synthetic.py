"""Built-in tasks with verifiable answers, so every post-training method runs with no downloads.

Each task draws problems from a seeded RNG: arithmetic (`add`, `sub`, `mul`, `arith` = a mix, with
`digits` setting the level) and string manipulation (`reverse`, `upper`, `count`, `sort`, `strings`
= a mix). A problem is a record {"task", "prompt", "answer"}; prompts are short ("12+34=",
"reverse abc:") so a tiny character-level model can learn them in CPU minutes.

The train / validation / test split is by a hash of the prompt (test and validation 20% each), so
a held-out problem can never appear in training data whatever the seed: choose steps and
checkpoints on validation (the trainers' periodic evaluation), read test only to report.
`lmforge.tasks.answers.verify(record, completion)` is the reward.
Preference pairs pair the right answer (chosen) with a plausible wrong one (rejected, e.g. off by
one or ten, two letters swapped), and the verifier checks both labels.
"""

from __future__ import annotations

import itertools
import operator
import random
import string
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from lmforge.errors import ConfigError, DataError, require_choice
from lmforge.tasks.answers import verify

Record = dict[str, Any]
TEST_FRACTION = 0.2  # share of the problem space (by prompt hash) for test, as much for validation
# printable ASCII: the characters of the built-in tasks and of most small JSONL demos (the
# default alphabet of a post-training run's char tokenizer)
ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \n"


def in_split(prompt: str, split: str) -> bool:
    """Whether a prompt belongs to `split` ("train", "validation", "test" or "all"), by a stable
    hash: test and validation are disjoint buckets of TEST_FRACTION each, train the rest."""
    require_choice("split", split, ("train", "validation", "test", "all"))
    part = zlib.crc32(prompt.encode("utf-8")) % 1000 // int(TEST_FRACTION * 1000)
    return split in ("all", ("test", "validation")[part] if part < 2 else "train")


# ---------------------------------------------------------------------------- tasks


class Task(ABC):
    """A problem family: `sample(rng)` -> (prompt, answer), `wrong(rng, record)` -> wrong answer."""

    name = "task"

    @abstractmethod
    def sample(self, rng: random.Random) -> tuple[str, str]:
        """A random (prompt, answer)."""

    def record(self, rng: random.Random) -> Record:
        """One problem as a record, tagged with the task that made it."""
        prompt, answer = self.sample(rng)
        return {"task": self.name, "prompt": prompt, "answer": answer}

    @abstractmethod
    def wrong(self, rng: random.Random, record: Record) -> str:
        """A plausible wrong answer to `record` (never the right one)."""


ARITHMETIC = {"add": "+", "sub": "-", "mul": "*", "arith": "+-*"}  # task name -> its operators


class Arithmetic(Task):
    """`a<op>b=` with operands of 1..digits digits; subtraction never goes negative."""

    OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}

    def __init__(self, ops: str = "+-*", digits: int = 2):
        if digits < 1 or not ops or set(ops) - set(self.OPS):
            raise ConfigError(f"arithmetic needs digits >= 1 and ops from '+-*', got {ops!r}")
        self.ops, self.digits = ops, digits
        self.name = {o: name for name, o in ARITHMETIC.items()}.get(ops, "arith")

    def sample(self, rng: random.Random) -> tuple[str, str]:
        op = rng.choice(self.ops)
        a, b = (rng.randrange(10 ** rng.randint(1, self.digits)) for _ in range(2))
        if op == "-" and b > a:
            a, b = b, a
        return f"{a}{op}{b}=", str(self.OPS[op](a, b))

    def wrong(self, rng: random.Random, record: Record) -> str:
        value = int(record["answer"])
        offsets = [1, -1, 2, -2, 10, -10]
        candidates = [value + d for d in offsets if value + d >= 0]
        digits = list(str(value))
        if len(digits) > 1 and digits[0] != digits[1]:  # a transposition, a typical slip
            candidates.append(int("".join([digits[1], digits[0], *digits[2:]]).lstrip("0") or "0"))
        return str(rng.choice([c for c in candidates if c != value]))


def _word(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, length)))


def _swap_two(rng: random.Random, text: str) -> str:
    """`text` with two different characters swapped (a near miss); unchanged if impossible."""
    pairs = [(i, j) for i, j in itertools.combinations(range(len(text)), 2) if text[i] != text[j]]
    if not pairs:
        return text
    i, j = rng.choice(pairs)
    chars = list(text)
    chars[i], chars[j] = chars[j], chars[i]
    return "".join(chars)


class StringTask(Task):
    """One string operation on a random lower-case word of 2..length letters."""

    def __init__(self, op: str, length: int = 6):
        if op not in STRING_OPS or length < 2:
            raise ConfigError(f"string op must be one of {sorted(STRING_OPS)} and length >= 2")
        self.op, self.length, self.name = op, length, op

    def sample(self, rng: random.Random) -> tuple[str, str]:
        word = _word(rng, self.length)
        if self.op == "count":
            letter = rng.choice(word) if rng.random() < 0.7 else rng.choice(string.ascii_lowercase)
            return f"count {letter} in {word}:", str(word.count(letter))
        return f"{self.op} {word}:", STRING_OPS[self.op](word)

    def wrong(self, rng: random.Random, record: Record) -> str:
        answer = record["answer"]
        if self.op == "count":
            return str(max(0, int(answer) + rng.choice([1, -1])) if answer != "0" else 1)
        word = record["prompt"].split(" ", 1)[1].rstrip(":")
        options = {_swap_two(rng, answer), word, answer[:-1], answer + answer[-1]}
        if self.op == "upper":
            options.add(word[:1].upper() + word[1:])
        options.discard(answer)
        return rng.choice(sorted(options))


STRING_OPS: dict[str, Callable[[str], str]] = {  # in the order the `strings` mixture draws
    "reverse": lambda w: w[::-1],
    "upper": str.upper,
    "count": lambda w: w,  # handled in StringTask.sample (needs the letter too)
    "sort": lambda w: "".join(sorted(w)),
}


class Mixture(Task):
    """Draw each problem from one of several tasks, uniformly."""

    def __init__(self, tasks: list[Task], name: str):
        self.tasks, self.name = tasks, name

    def record(self, rng: random.Random) -> Record:
        return rng.choice(self.tasks).record(rng)

    def sample(self, rng: random.Random) -> tuple[str, str]:
        r = self.record(rng)
        return r["prompt"], r["answer"]

    def wrong(self, rng: random.Random, record: Record) -> str:
        member = next((t for t in self.tasks if t.name == record["task"]), None)
        if member is None:
            raise DataError(f"task {self.name!r} has no member {record.get('task')!r}")
        return member.wrong(rng, record)


TASKS = (*ARITHMETIC, *STRING_OPS, "strings")  # "strings": a mixture of the string tasks


def get_task(name: str, digits: int = 2, length: int = 6) -> Task:
    """A task by name (see TASKS); `digits` sets the arithmetic level, `length` the word size."""
    if name in ARITHMETIC:
        return Arithmetic(ARITHMETIC[name], digits)
    if name in STRING_OPS:
        return StringTask(name, length)
    if name == "strings":
        return Mixture([StringTask(op, length) for op in STRING_OPS], name)
    raise ConfigError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")


def problems(
    task: str | Task, n: int, seed: int = 0, split: str = "train", **level: int
) -> list[Record]:
    """`n` distinct problems {"task", "prompt", "answer"} from `split`, deterministic in `seed`."""
    task = get_task(task, **level) if isinstance(task, str) else task
    rng = random.Random(seed)
    found: dict[str, Record] = {}  # prompt -> its first record, in drawing order
    for _ in range(100 * n + 1000):
        if len(found) == n:
            break
        record = task.record(rng)
        if in_split(record["prompt"], split):
            found.setdefault(record["prompt"], record)
    if len(found) < n:
        raise ConfigError(
            f"task {task.name!r}: only {len(found)} distinct {split} problems found for n={n}; "
            "raise digits/length or ask for fewer"
        )
    return list(found.values())


def sft_records(task: str | Task, n: int, seed: int = 0, split: str = "train", **level: int):
    """SFT data: {"prompt", "response"} with the correct answer as the response."""
    return [
        {"prompt": r["prompt"], "response": r["answer"]}
        for r in problems(task, n, seed, split, **level)
    ]


def preference_pairs(
    task: str | Task, n: int, seed: int = 0, split: str = "train", **level: int
) -> list[Record]:
    """Verifier-labelled pairs {"prompt", "chosen", "rejected", "answer"}: chosen is correct,
    rejected a plausible wrong answer; both labels are checked with `verify`."""
    task_obj = get_task(task, **level) if isinstance(task, str) else task
    rng = random.Random(seed + 7919)
    pairs = []
    for r in problems(task_obj, n, seed, split):
        rejected = task_obj.wrong(rng, r)
        if verify(r, r["answer"]) != 1.0 or verify(r, rejected) != 0.0:
            raise DataError(f"task {r['task']}: bad pair for {r['prompt']!r} ({rejected!r})")
        pairs.append({"prompt": r["prompt"], "chosen": r["answer"], "rejected": rejected, **r})
    return pairs
