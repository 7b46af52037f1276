"""The CORE metric (DCLM paper, arXiv 2406.11794) computed the way nanochat's core_eval.py does.

22 in-context-learning tasks of three kinds, each scored without generating text:

- multiple choice {"query", "choices", "gold"}: one prompt per choice, the continuation is the
  choice; the pick is the choice with the lowest mean cross-entropy over its own tokens (the
  tokens after the prompts' longest common prefix);
- schema {"context_options", "continuation", "gold"}: one prompt per context, the continuation
  is shared; the pick is the context under which the continuation (the prompts' longest common
  suffix) has the lowest mean cross-entropy;
- language modelling {"context", "continuation"}: correct only when greedy decoding reproduces
  every continuation token.

Protocol (nanochat's, exactly): per task the rows are shuffled with random.Random(1337) and the
first max_per_task kept; item i's few-shot examples are random.Random(1234 + i).sample of the
other kept items; few-shot examples are separated by a blank line and the continuation follows
the task's delimiter; BOS is prepended; sequences longer than the model's context lose tokens on
the left. Accuracy is centered on the task's random baseline b (percent),
(acc - b/100) / (1 - b/100), and CORE is the mean centered accuracy over the tasks.

The scoring itself is batched and KV-cached (core_scoring.py).
"""

from __future__ import annotations

import io
import random
import sys
import urllib.request
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from lmforge.errors import ConfigError, DataError, require_int
from lmforge.eval.core_scoring import (
    OptionSet,
    common_prefix_len,
    common_suffix_len,
    score_option_sets,
)
from lmforge.fileio import atomic_write, cache_root, read_rows

# The published eval bundle nanochat downloads (all 22 task files, in category folders).
EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"

MC, SCHEMA, LM = "multiple_choice", "schema", "language_modeling"


@dataclass(frozen=True)
class CoreTask:
    """One CORE task: where its rows are, how they are prompted, and its random baseline (%)."""

    label: str
    file: str
    kind: str
    shots: int
    delimiter: str
    baseline: float


# DCLM's eval/heavy.yaml (shots, delimiters) and eval_meta_data_v1.csv (baselines), in
# nanochat's core.yaml order.
CORE_TASKS: tuple[CoreTask, ...] = (
    CoreTask("hellaswag_zeroshot", "hellaswag.jsonl", MC, 0, " ", 25),
    CoreTask("jeopardy", "jeopardy_all.jsonl", LM, 10, "\nAnswer: ", 0),
    CoreTask("bigbench_qa_wikidata", "bigbench_qa_wikidata.jsonl", LM, 10, " ", 0),
    CoreTask("arc_easy", "arc_easy.jsonl", MC, 10, "\nAnswer: ", 25),
    CoreTask("arc_challenge", "arc_challenge.jsonl", MC, 10, "\nAnswer: ", 25),
    CoreTask("copa", "copa.jsonl", MC, 0, " ", 50),
    CoreTask("commonsense_qa", "commonsense_qa.jsonl", MC, 10, " ", 20),
    CoreTask("piqa", "piqa.jsonl", MC, 10, "\nAnswer: ", 50),
    CoreTask("openbook_qa", "openbook_qa.jsonl", MC, 0, " ", 25),
    CoreTask("lambada_openai", "lambada_openai.jsonl", LM, 0, " ", 0),
    CoreTask("hellaswag", "hellaswag.jsonl", MC, 10, " ", 25),
    CoreTask("winograd", "winograd_wsc.jsonl", SCHEMA, 0, " ", 50),
    CoreTask("winogrande", "winogrande.jsonl", SCHEMA, 0, " ", 50),
    CoreTask("bigbench_dyck_languages", "bigbench_dyck_languages.jsonl", LM, 10, " ", 0),
    CoreTask("agi_eval_lsat_ar", "agi_eval_lsat_ar.jsonl", MC, 3, " ", 20),
    CoreTask("bigbench_cs_algorithms", "bigbench_cs_algorithms.jsonl", LM, 10, " ", 0),
    CoreTask("bigbench_operators", "bigbench_operators.jsonl", LM, 10, " ", 0),
    CoreTask("bigbench_repeat_copy_logic", "bigbench_repeat_copy_logic.jsonl", LM, 10, " ", 0),
    CoreTask("squad", "squad.jsonl", LM, 10, " ", 0),
    CoreTask("coqa", "coqa.jsonl", LM, 0, " ", 0),
    CoreTask("boolq", "boolq.jsonl", MC, 10, "\nAnswer: ", 62),
    CoreTask(
        "bigbench_language_identification",
        "bigbench_language_identification.jsonl",
        MC,
        10,
        " ",
        9.1,
    ),
)
TASKS_BY_LABEL = {t.label: t for t in CORE_TASKS}


def default_data_dir() -> Path:
    """Where `lmforge eval core` keeps the task files: $LMFORGE_CACHE/core (~/.cache/lmforge)."""
    return cache_root() / "core"


def task_names(names: str | Sequence[str] | None, available: Sequence[str], key=str) -> list[str]:
    """The available names asked for (comma-separated text or a list; None = all), in the order
    given, without repeats; `key` folds a name for comparison (str.lower: any case). No name or
    an unknown one raises a ConfigError listing the available ones."""
    if names is None:
        return list(available)
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise ConfigError("--tasks: no task named")
    by_key = {key(t): t for t in available}
    unknown = [n for n in names if key(n) not in by_key]
    if unknown:
        raise ConfigError(
            f"--tasks: unknown task {', '.join(map(repr, unknown))}; available: "
            + ", ".join(available)
        )
    return list(dict.fromkeys(by_key[key(n)] for n in names))


def select_tasks(names: str | Sequence[str] | None) -> list[CoreTask]:
    """CORE tasks by label (see task_names); None = all 22."""
    return [TASKS_BY_LABEL[n] for n in task_names(names, list(TASKS_BY_LABEL))]


def check_max_per_task(value: int | None) -> None:
    if value is not None:  # None: every row
        require_int("--max-per-task", value)


def fetch_bundle(folder: Path, files: Sequence[str]) -> None:
    """Fill `folder` with the named task files from the published eval bundle (one download).
    A DataError says what is missing and how to point at local files instead."""
    try:
        with urllib.request.urlopen(EVAL_BUNDLE_URL, timeout=60) as response:
            blob = response.read()
        archive = zipfile.ZipFile(io.BytesIO(blob))
    except (OSError, zipfile.BadZipFile) as e:
        raise DataError(
            f"{folder}: task file(s) {', '.join(files)} missing and the eval bundle could not be "
            f"downloaded from {EVAL_BUNDLE_URL} ({e}); pass --data DIR with the task files"
        ) from e
    by_name = {Path(n).name: n for n in archive.namelist() if n.endswith(".jsonl")}
    absent = [f for f in files if f not in by_name]
    if absent:
        raise DataError(f"{EVAL_BUNDLE_URL}: the bundle has no {', '.join(absent)}")
    folder.mkdir(parents=True, exist_ok=True)
    for name in files:
        data = archive.read(by_name[name])
        atomic_write(folder / name, lambda tmp, data=data: Path(tmp).write_bytes(data))


def resolve_tasks(
    tasks: list[CoreTask], data: str | Path | None, explicit: bool
) -> tuple[Path, list[CoreTask], list[CoreTask]]:
    """(folder, tasks whose files are there, tasks left out). With the default folder, missing
    files are downloaded; with a given folder, tasks asked for by name must be present, while
    the default full list keeps those present (the shared folder has 18 of the 22)."""
    folder = Path(data) if data is not None else default_data_dir()
    missing = sorted({t.file for t in tasks if not (folder / t.file).is_file()})
    if missing and data is None:
        fetch_bundle(folder, missing)
        missing = []
    if data is not None and not folder.is_dir():
        raise DataError(f"--data: folder not found: {folder}")
    if missing and explicit:
        raise DataError(f"{folder}: no task file {', '.join(missing)} (asked for by --tasks)")
    present = [t for t in tasks if t.file not in missing]
    if not present:
        raise DataError(f"{folder}: none of the CORE task files are there")
    return folder, present, [t for t in tasks if t.file in missing]


# ---- task rows ----------------------------------------------------------------------------------
# kind -> (its text fields, its options field); every option field comes with a 'gold' index
ROW_FIELDS = {
    MC: (("query",), "choices"),
    SCHEMA: (("continuation",), "context_options"),
    LM: (("context", "continuation"), None),
}


def _check_row(row: dict, where: str, kind: str) -> dict:
    """Each kind's fields, with types, so that a bad row fails here and not mid-evaluation."""
    texts, options = ROW_FIELDS[kind]
    if options is not None:
        v = row.get(options)
        if not isinstance(v, list) or len(v) < 2 or not all(isinstance(c, str) for c in v):
            raise DataError(f"{where}: {options!r} must be a list of at least 2 strings")
        gold = row.get("gold")
        if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(v):
            index = f"an index into {options!r} (0..{len(v) - 1})"
            raise DataError(f"{where}: 'gold' must be {index}, got {gold!r}")
    for key in texts:  # a continuation must say something: it is what gets scored
        nonempty = key == "continuation"
        if not isinstance(row.get(key), str) or (nonempty and not row[key].strip()):
            raise DataError(f"{where}: {key!r} must be a {'non-empty ' if nonempty else ''}string")
    return row


def load_task_rows(folder: str | Path, task: CoreTask) -> list[dict]:
    """Every row of a task file, checked; a bad line raises DataError naming file:line."""
    return read_rows(Path(folder) / task.file, partial(_check_row, kind=task.kind))


def shuffled_subset(rows: list[dict], max_per_task: int | None) -> list[dict]:
    """nanochat's order: shuffled with random.Random(1337), then the first max_per_task."""
    rows = list(rows)
    random.Random(1337).shuffle(rows)
    return rows if max_per_task is None else rows[:max_per_task]


class _AllBut(Sequence):
    """range(n) without `skip`, as a lazy sequence: random.sample draws the same indices from it
    as from the list nanochat builds, without an O(n) list per item (O(n^2) per task)."""

    def __init__(self, n: int, skip: int):
        self.n, self.skip = n, skip

    def __len__(self) -> int:
        return self.n - 1

    def __getitem__(self, j: int) -> int:  # random.sample indexes one item at a time
        if not -len(self) <= j < len(self):
            raise IndexError(j)
        j %= len(self)
        return j if j < self.skip else j + 1


def fewshot_indices(i: int, n: int, shots: int) -> list[int]:
    """Item i's few-shot examples: random.Random(1234 + i).sample of the other n - 1 items."""
    if shots <= 0:
        return []
    return random.Random(1234 + i).sample(_AllBut(n, i), min(shots, n - 1))


# ---- prompts (nanochat's Jinja templates, as plain string building) ------------------------------
def render_mc(item: dict, delimiter: str, shots: Sequence[dict]) -> list[str]:
    """One prompt per choice: solved examples, a blank line after each, then query+delim+choice."""
    head = "".join(f"{ex['query']}{delimiter}{ex['choices'][ex['gold']]}\n\n" for ex in shots)
    return [f"{head}{item['query']}{delimiter}{choice}" for choice in item["choices"]]


def render_schema(item: dict, delimiter: str, shots: Sequence[dict]) -> list[str]:
    """One prompt per context option, each followed by the shared continuation."""
    head = "".join(
        f"{ex['context_options'][ex['gold']]}{delimiter}{ex['continuation']}\n\n" for ex in shots
    )
    return [f"{head}{ctx}{delimiter}{item['continuation']}" for ctx in item["context_options"]]


def render_lm(item: dict, delimiter: str, shots: Sequence[dict]) -> list[str]:
    """[prompt without the continuation, prompt with it]; contexts are trimmed and the prompt
    without is stripped (trailing spaces would otherwise merge into the continuation's first
    token and break the token-space prefix)."""
    head = "".join(f"{ex['context'].strip()}{delimiter}{ex['continuation']}\n\n" for ex in shots)
    without = f"{head}{item['context'].strip()}{delimiter}"
    return [without.strip(), without + item["continuation"]]


RENDER = {MC: render_mc, SCHEMA: render_schema, LM: render_lm}


def spans(kind: str, tokens: list[list[int]]) -> tuple[list[list[int]], list[int], list[int]]:
    """(sequences, starts, ends) of the scored continuation tokens, as nanochat finds them: for
    multiple choice after the options' common prefix, for schema the common suffix, for language
    modelling after the prompt without the continuation."""
    if kind == MC:
        start = common_prefix_len(tokens)
        return tokens, [start] * len(tokens), [len(t) for t in tokens]
    if kind == SCHEMA:
        suffix = common_suffix_len(tokens)
        return tokens, [len(t) - suffix for t in tokens], [len(t) for t in tokens]
    without, with_ = tokens
    # nanochat asserts the prompt without is a token prefix of the one with; a tokenizer that
    # merges across the boundary would crash it, so score from where the two part instead.
    start = common_prefix_len([without, with_])
    return [with_], [start], [len(with_)]


def crop(seqs, starts, ends, max_len: int):
    """Keep the last max_len tokens of each sequence and shift its span; the span keeps at
    least one token before it (only a continuation as long as the context would lose it)."""
    cuts = [max(0, len(seq) - max_len) for seq in seqs]
    return (
        [seq[cut:] for seq, cut in zip(seqs, cuts)],
        [max(1, s - cut) for s, cut in zip(starts, cuts)],
        [max(1, e - cut) for e, cut in zip(ends, cuts)],
    )


def build_option_sets(
    tokenizer, task: CoreTask, rows: list[dict], max_len: int, bos: int
) -> list[OptionSet]:
    """Render, tokenize (BOS first), find spans and crop every item of a task."""
    render = RENDER[task.kind]
    prompts: list[list[str]] = []
    for i, item in enumerate(rows):
        shots = [rows[j] for j in fewshot_indices(i, len(rows), task.shots)]
        prompts.append(render(item, task.delimiter, shots))
    flat = iter(tokenizer.encode_batch([p for group in prompts for p in group]))
    tokens = [[[bos] + next(flat) for _ in group] for group in prompts]
    return [OptionSet(*crop(*spans(task.kind, t), max_len)) for t in tokens]


def bos_id(tokenizer) -> int:
    """The id CORE prompts start with: BOS, else EOS (GPT-2's <|endoftext|> plays both)."""
    token = next((t for t in (tokenizer.bos_id, tokenizer.eos_id) if t is not None), None)
    if token is None:
        raise ConfigError("the tokenizer has neither a BOS nor an EOS token to start CORE prompts")
    return token


def centered(accuracy: float, baseline: float) -> float:
    """Accuracy rescaled so the random baseline (percent) is 0 and a perfect score 1."""
    return (accuracy - 0.01 * baseline) / (1.0 - 0.01 * baseline)


# ---- evaluation ---------------------------------------------------------------------------------
@dataclass
class CoreResult:
    """Accuracy and centered accuracy per task; `core` is the mean centered accuracy."""

    results: dict[str, float] = field(default_factory=dict)  # accuracy per task
    centered: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # examples scored per task
    missing: list[str] = field(default_factory=list)  # tasks whose files were not there

    @property
    def core(self) -> float:
        return sum(self.centered.values()) / len(self.centered)

    def to_json(self) -> dict:
        return {"results": self.results, "centered": self.centered, "core": self.core}

    def add(self, label: str, accuracy: float, baseline: float, n: int, log: str = "") -> None:
        """Record a task's accuracy over `n` items (`baseline` in percent); with `log`, print it
        followed by the two scores to stderr."""
        self.results[label], self.counts[label] = accuracy, n
        self.centered[label] = centered(accuracy, baseline)
        if log:
            print(f"{log}  accuracy {accuracy:.4f}  centered {self.centered[label]:+.4f}",
                  file=sys.stderr)  # fmt: skip


def evaluate_task(lm, task: CoreTask, rows: list[dict], max_tokens: int = 16384) -> float:
    """Accuracy of `lm` on already-shuffled-and-cut rows of one task."""
    sets = build_option_sets(lm.tokenizer, task, rows, lm.config.max_seq_len, bos_id(lm.tokenizer))
    scores = score_option_sets(lm.model, sets, max_tokens)
    correct = 0
    for item, per_option in zip(rows, scores):
        if task.kind == LM:
            correct += per_option[0][1]
        else:
            losses = [loss for loss, _ in per_option]
            correct += losses.index(min(losses)) == item["gold"]
    return correct / len(rows)


def evaluate_core(
    lm,
    folder: str | Path,
    tasks: Sequence[CoreTask] = CORE_TASKS,
    max_per_task: int | None = None,
    max_tokens: int = 16384,
    progress: bool = False,
) -> CoreResult:
    """CORE over `tasks` read from `folder`. Every task file is read and checked before the
    first forward pass, so a malformed line fails fast."""
    check_max_per_task(max_per_task)
    bos_id(lm.require_tokenizer("CORE"))
    data = {t.label: shuffled_subset(load_task_rows(folder, t), max_per_task) for t in tasks}
    result = CoreResult()
    for task in tasks:
        rows = data[task.label]
        if progress and task.shots >= len(rows):
            print(f"  {task.label}: {len(rows)} items; few-shot drawn from the {len(rows) - 1} "
                  f"others (fewer than {task.shots})", file=sys.stderr)  # fmt: skip
        acc = evaluate_task(lm, task, rows, max_tokens)
        log = f"{task.label:34} {task.shots:2}-shot {len(rows):6} items" if progress else ""
        result.add(task.label, acc, task.baseline, len(rows), log)
    return result
