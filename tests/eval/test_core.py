"""`lmforge eval core`: the batched, KV-cached CORE evaluation against a plain reference.

The reference below implements the protocol from its description (nanochat's core_eval.py),
one example at a time, one full forward per option, no cache and no batching. The fast path
must make the same decision on every example, hence the same accuracy per task.
"""

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmforge.cli.main import main
from lmforge.data.corpus import builtin_corpus
from lmforge.errors import ConfigError, DataError
from lmforge.eval import core
from lmforge.eval.core_scoring import OptionSet, score_option_sets
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.tokenizer import Tokenizer


# ---- the reference --------------------------------------------------------------------------
def ref_prompts(kind, item, delim, shots):
    if kind == "multiple_choice":
        head = ""
        for ex in shots:
            head += ex["query"] + delim + ex["choices"][ex["gold"]] + "\n\n"
        return [head + item["query"] + delim + c for c in item["choices"]]
    if kind == "schema":
        head = ""
        for ex in shots:
            head += ex["context_options"][ex["gold"]] + delim + ex["continuation"] + "\n\n"
        return [head + c + delim + item["continuation"] for c in item["context_options"]]
    head = ""
    for ex in shots:
        head += ex["context"].strip() + delim + ex["continuation"] + "\n\n"
    body = head + item["context"].strip() + delim
    return [body.strip(), body + item["continuation"]]


def prefix_len(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def ref_example(model, tok, kind, data, idx, delim, shots_n, max_len):
    """(is_correct, per-option mean losses or None) for data[idx]."""
    item = data[idx]
    shots = []
    if shots_n > 0:
        others = [i for i in range(len(data)) if i != idx]
        picks = random.Random(1234 + idx).sample(others, min(shots_n, len(others)))
        shots = [data[i] for i in picks]
    prompts = ref_prompts(kind, item, delim, shots)
    bos = tok.bos_id if tok.bos_id is not None else tok.eos_id
    toks = [[bos] + tok.encode(p) for p in prompts]
    if kind == "multiple_choice":
        start = min(prefix_len(toks[0], t) for t in toks)
        spans = [(t, start, len(t)) for t in toks]
    elif kind == "schema":
        rev = [t[::-1] for t in toks]
        suffix = min(prefix_len(rev[0], r) for r in rev)
        spans = [(t, len(t) - suffix, len(t)) for t in toks]
    else:
        spans = [(toks[1], prefix_len(toks[0], toks[1]), len(toks[1]))]
    losses, hits = [], []
    for t, s, e in spans:
        cut = max(0, len(t) - max_len)
        t, s, e = t[cut:], max(1, s - cut), max(1, e - cut)
        ids = torch.tensor([t])
        with torch.no_grad():
            logits = model(ids)[0].float()
        ce = F.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")
        losses.append(ce[s - 1 : e - 1].mean().item())
        hits.append(bool((logits[s - 1 : e - 1].argmax(-1) == ids[0, s:e]).all()))
    if kind == "language_modeling":
        return hits[0], None
    return losses.index(min(losses)) == item["gold"], losses


def ref_accuracy(lm, folder, task, max_per_task):
    data = [json.loads(line) for line in (Path(folder) / task.file).read_text().splitlines()]
    random.Random(1337).shuffle(data)
    data = data[:max_per_task]
    model = lm.model.eval()
    results = [
        ref_example(model, lm.tokenizer, task.kind, data, i, task.delimiter, task.shots,
                    lm.config.max_seq_len)
        for i in range(len(data))
    ]  # fmt: skip
    return sum(ok for ok, _ in results) / len(data)


# ---- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def core_lm(make_tiny_lm) -> LM:
    """A tiny random model whose context (96) is shorter than many 10-shot prompts (cropping)."""
    return make_tiny_lm(96, builtin_corpus("pydoc")[:200], 400)


@pytest.fixture
def core_dir(shared_data) -> Path:
    return shared_data / "core"


TASKS = [
    "copa",  # multiple choice, 0-shot, options share their first words
    "arc_easy",  # multiple choice, 10-shot, "\nAnswer: " delimiter, cropped
    "commonsense_qa",  # lettered choices
    "winograd",  # schema
    "lambada_openai",  # language modelling, long contexts
    "bigbench_operators",  # language modelling, 10-shot
]


def test_registry_matches_the_data_readme(core_dir):
    """File, type, shots, delimiter and baseline of the 18 shared tasks, as the README lists."""
    rows = re.findall(
        r"^\| (\w+) \| (\S+\.jsonl) \| (\w+) \| (\d+) \| `(.+?)` \| ([\d.]+) \| \d+ \|$",
        (core_dir / "README.md").read_text(encoding="utf-8"),
        re.M,
    )
    assert len(rows) == 18
    for label, file, kind, shots, delim, base in rows:
        task = core.TASKS_BY_LABEL[label]
        assert (task.file, task.kind, task.shots) == (file, kind, int(shots))
        assert task.delimiter == json.loads(delim)
        assert task.baseline == float(base)
    assert len(core.CORE_TASKS) == 22


def test_prompts_follow_the_core_layout():
    shot = {"query": "Q1?", "choices": ["no", "yes"], "gold": 1}
    item = {"query": "Q2?", "choices": ["a", "b"], "gold": 0}
    assert core.render_mc(item, "\nAnswer: ", [shot]) == [
        "Q1?\nAnswer: yes\n\nQ2?\nAnswer: a",
        "Q1?\nAnswer: yes\n\nQ2?\nAnswer: b",
    ]
    shot = {"context_options": ["X did", "Y did"], "continuation": "it.", "gold": 1}
    item = {"context_options": ["A saw", "B saw"], "continuation": "that.", "gold": 0}
    assert core.render_schema(item, " ", [shot]) == [
        "Y did it.\n\nA saw that.",
        "Y did it.\n\nB saw that.",
    ]
    shot = {"context": " The sky is  ", "continuation": "blue"}
    item = {"context": "Grass is ", "continuation": "green"}
    assert core.render_lm(item, " ", [shot]) == [
        "The sky is blue\n\nGrass is",
        "The sky is blue\n\nGrass is green",
    ]
    assert core.render_lm(item, "\nAnswer: ", []) == [
        "Grass is\nAnswer:",
        "Grass is\nAnswer: green",
    ]


def test_fewshot_draws_match_sampling_from_the_list():
    for n in (2, 7, 60, 3000):
        for i in {0, n // 2, n - 1}:
            k = min(10, n - 1)
            want = random.Random(1234 + i).sample([j for j in range(n) if j != i], k)
            assert core.fewshot_indices(i, n, 10) == want


@pytest.mark.parametrize("label", TASKS)
def test_fast_path_agrees_with_reference(core_lm, core_dir, label):
    task = core.TASKS_BY_LABEL[label]
    result = core.evaluate_core(core_lm, core_dir, [task], max_per_task=14)
    assert result.results[label] == ref_accuracy(core_lm, core_dir, task, 14)
    assert result.centered[label] == pytest.approx(
        (result.results[label] - task.baseline / 100) / (1 - task.baseline / 100)
    )


def test_option_losses_and_greedy_hits_match_plain_forwards(core_lm):
    """Per option, not just per decision; continuations the model itself predicts greedily must
    count as hits (the language-modelling path is otherwise all misses on a random model)."""
    model = core_lm.model.eval()
    gen = torch.Generator().manual_seed(1)
    sets, expected = [], []
    for n_ctx in (5, 17, 40, 3):
        ctx = torch.randint(1, 300, (n_ctx,), generator=gen).tolist()
        options = []
        for k in range(3):
            seq = ctx + torch.randint(1, 300, (k + 1,), generator=gen).tolist()
            options.append(seq)
        greedy = list(ctx)  # the model's own greedy continuation: every token a hit
        for _ in range(4):
            with torch.no_grad():
                greedy.append(int(model(torch.tensor([greedy]))[0, -1].argmax()))
        options.append(greedy)
        sets.append(OptionSet(options, [n_ctx] * 4, [len(o) for o in options]))
        for seq in options:
            with torch.no_grad():
                logits = model(torch.tensor([seq]))[0]
            ce = F.cross_entropy(logits[:-1], torch.tensor(seq[1:]), reduction="none")
            hit = (logits[n_ctx - 1 : -1].argmax(-1) == torch.tensor(seq[n_ctx:])).all()
            expected.append((ce[n_ctx - 1 :].mean().item(), bool(hit)))
    got = [pair for per in score_option_sets(model, sets, max_tokens=200) for pair in per]
    assert [h for _, h in got] == [h for _, h in expected]
    assert sum(h for _, h in got) >= 4  # at least every greedy option
    assert [loss for loss, _ in got] == pytest.approx([loss for loss, _ in expected], rel=1e-5)


def test_context_is_computed_once_per_example(core_lm, core_dir, monkeypatch):
    """The caching is real: the forwards see each example's shared context once, not once per
    option, and examples share forward calls."""
    task = core.TASKS_BY_LABEL["copa"]  # 2 options, 0-shot
    rows = core.shuffled_subset(core.load_task_rows(core_dir, task), 16)
    sets = core.build_option_sets(core_lm.tokenizer, task, rows, 96, core_lm.tokenizer.bos_id)
    calls = []
    original = core_lm.model.hidden_states

    def counting(ids, *args, cache=None, **kwargs):
        calls.append((ids.shape, cache.key_mask is not None))
        return original(ids, *args, cache=cache, **kwargs)

    monkeypatch.setattr(core_lm.model, "hidden_states", counting)
    score_option_sets(core_lm.model, sets)
    per_option_tokens = sum(len(s) for x in sets for s in x.seqs)
    assert len(calls) == 2  # one prefill, one pass over every option of all 16 examples
    # The prefixes differ in length, yet the prefill runs unmasked (right padding, SDPA's causal
    # path); only the options after it need the key mask that hides the padding.
    assert len({x.prefix_len() for x in sets}) > 1
    assert [masked for _, masked in calls] == [False, True]
    real = sum(x.prefix_len() for x in sets) + sum(e - x.prefix_len() for x in sets for e in x.ends)
    assert real < 0.75 * per_option_tokens


def test_one_option_examples_run_unpadded_without_a_cache(core_lm, monkeypatch):
    """Language modelling has nothing to share: its rows skip the cache (no attention mask), and
    a row far shorter than its neighbours gets its own batch instead of hundreds of pad tokens."""
    from lmforge.eval import core_scoring

    sets = [OptionSet([list(range(1, n + 1))], [n - 3], [n]) for n in (20, 90, 88, 86)]
    order = sorted(range(4), key=lambda i: -len(sets[i].seqs[0]))
    monkeypatch.setattr(core_scoring, "PAD_FREE", 0)
    assert list(core_scoring._batches(sets, order, 96, 10**6)) == [[1, 2, 3], [0]]
    calls = []
    original = core_lm.model.hidden_states

    def counting(ids, *args, cache=None, **kwargs):
        calls.append((tuple(ids.shape), cache))
        return original(ids, *args, cache=cache, **kwargs)

    monkeypatch.setattr(core_lm.model, "hidden_states", counting)
    score_option_sets(core_lm.model, sets)
    assert calls == [((3, 90), None), ((1, 20), None)]


def test_sliding_window_model_uses_the_uncached_batched_path(core_dir):
    tok = Tokenizer.train_bpe(["the cat sat on the mat. " * 50], vocab_size=300)
    config = ModelConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, d_model=32,
                         max_seq_len=96, sliding_window=16)  # fmt: skip
    lm = LM.from_config(config, tok, seed=3)
    task = core.TASKS_BY_LABEL["winograd"]
    got = core.evaluate_core(lm, core_dir, [task], max_per_task=10).results["winograd"]
    assert got == ref_accuracy(lm, core_dir, task, 10)


# ---- input checks and the CLI ---------------------------------------------------------------
def test_unknown_task_lists_the_available_ones():
    with pytest.raises(ConfigError, match="unknown task 'arc_medium'.*available: hellaswag_zero"):
        core.select_tasks("copa,arc_medium")


@pytest.fixture
def checkpoint(core_lm, tmp_path) -> Path:
    out = tmp_path / "ckpt"
    core_lm.save(out)
    return out


def _cli(checkpoint, *extra):
    return main(["eval", "core", "--checkpoint", str(checkpoint), *extra])


def test_cli_writes_json(checkpoint, core_dir, tmp_path, capsys):
    out = tmp_path / "res" / "core.json"
    args = ["--data", str(core_dir), "--tasks", "copa,winograd", "--max-per-task", "8"]
    assert _cli(checkpoint, *args, "--json", str(out)) == 0
    got = json.loads(out.read_text())
    assert set(got) == {"results", "centered", "core"}
    assert set(got["results"]) == {"copa", "winograd"}
    assert got["core"] == pytest.approx(sum(got["centered"].values()) / 2)
    assert "CORE (2 tasks)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tasks", "copa,nope"], "unknown task 'nope'; available: hellaswag_zeroshot, jeopardy"),
        (["--tasks", "copa", "--max-per-task", "0"], "--max-per-task must be a positive integer"),
        (["--tasks", "hellaswag"], "no task file hellaswag.jsonl"),
    ],
)
def test_cli_bad_input_one_message_nothing_written(
    checkpoint, core_dir, tmp_path, capsys, extra, message
):
    out = tmp_path / "core.json"
    assert _cli(checkpoint, "--data", str(core_dir), *extra, "--json", str(out)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_cli_malformed_line_names_file_and_line(checkpoint, core_dir, tmp_path, capsys):
    data = tmp_path / "core"
    data.mkdir()
    shutil.copy(core_dir / "winograd_wsc.jsonl", data)
    lines = (core_dir / "copa.jsonl").read_text().splitlines()
    lines[6] = json.dumps({"query": "q", "choices": ["a", "b"], "gold": 2})
    (data / "copa.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "core.json"
    assert _cli(checkpoint, "--data", str(data), "--tasks", "winograd,copa",
                "--json", str(out)) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert f"{data / 'copa.jsonl'}:7: 'gold' must be an index into 'choices'" in err
    assert not out.exists()
    lines[6] = "{not json"
    (data / "copa.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"copa.jsonl:7: invalid JSON"):
        core.load_task_rows(data, core.TASKS_BY_LABEL["copa"])


def test_default_folder_without_network_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(core, "EVAL_BUNDLE_URL", (tmp_path / "absent.zip").as_uri())
    with pytest.raises(DataError, match="could not be downloaded.*pass --data DIR"):
        core.resolve_tasks(core.select_tasks("copa"), None, explicit=True)


def test_default_folder_is_filled_from_the_bundle(tmp_path, monkeypatch, core_dir):
    """The bundle keeps task files in category folders; they land flat in the cache."""
    import zipfile

    bundle = tmp_path / "eval_bundle.zip"
    with zipfile.ZipFile(bundle, "w") as z:
        z.write(core_dir / "copa.jsonl", "eval_bundle/eval_data/commonsense_reasoning/copa.jsonl")
    monkeypatch.setenv("LMFORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(core, "EVAL_BUNDLE_URL", bundle.as_uri())
    folder, present, missing = core.resolve_tasks(core.select_tasks("copa"), None, True)
    assert folder == tmp_path / "cache" / "core" and not missing
    assert (folder / "copa.jsonl").read_bytes() == (core_dir / "copa.jsonl").read_bytes()


# ---- SmolLM2 (slow) -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(smollm2_gguf) -> LM:
    return LM.load(smollm2_gguf, dtype="float32")


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize(
    "label, n",
    [("arc_easy", 6), ("winogrande", 10), ("lambada_openai", 8), ("bigbench_qa_wikidata", 8)],
)
def test_smollm2_fast_path_agrees_with_reference(smollm2, core_dir, label, n):
    """A real 135M model (SmolLM2-Instruct, Q4_1 GGUF dequantised): same decisions per task."""
    task = core.TASKS_BY_LABEL[label]
    got = core.evaluate_core(smollm2, core_dir, [task], max_per_task=n).results[label]
    assert got == ref_accuracy(smollm2, core_dir, task, n)
