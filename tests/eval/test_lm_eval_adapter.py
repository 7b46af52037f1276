"""The lm-evaluation-harness adapter: its three request types, and a local harness task."""

import json

import pytest

from lmforge.eval.multiple_choice import evaluate_choices, load_choices
from lmforge.eval.scoring import generate_texts, loglikelihood, rolling_loglikelihood

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from lmforge.eval.lm_eval_adapter import LMForgeHarnessModel  # noqa: E402


def _req(kind: str, args: tuple) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def test_registered_under_lmforge():
    assert get_model("lmforge") is LMForgeHarnessModel


def test_methods_match_lmforge_scoring(tiny_lm, tmp_path):
    tiny_lm.save(tmp_path / "ckpt")
    model = LMForgeHarnessModel.create_from_arg_string(f"pretrained={tmp_path / 'ckpt'}")
    pairs = [("The sky is", " blue"), ("", "Paris")]
    got = model.loglikelihood([_req("loglikelihood", p) for p in pairs])
    want = loglikelihood(tiny_lm, pairs)
    assert [g[1] for g in got] == [w[1] for w in want]  # is-greedy flags
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-4)
    text = "Paris is the capital of France. " * 3
    assert model.loglikelihood_rolling([_req("loglikelihood_rolling", (text,))]) == pytest.approx(
        [rolling_loglikelihood(tiny_lm, text)], abs=1e-3
    )
    gen = model.generate_until(
        [
            _req("generate_until", ("The sky", {"until": ["\n"], "max_gen_toks": 5})),
            _req("generate_until", ("Paris", {"until": "\n", "max_gen_toks": 5})),
        ]
    )
    assert gen[0] == generate_texts(tiny_lm, ["The sky"], 5, ["\n"], temperature=0.0)[0]
    assert all("\n" not in g for g in gen)


@pytest.mark.slow
def test_simple_evaluate_on_a_local_multiple_choice_task(tiny_lm, tmp_path, monkeypatch):
    """The harness runs a YAML task over a local JSONL file, offline, through our adapter, and
    reports the same accuracy as lmforge's own multiple-choice scorer."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [
        {"question": "What is 2 plus 2?", "choices": ["4", "5", "22"], "answer": 0},
        {"question": "Capital of France?", "choices": ["Rome", "Paris"], "answer": 1},
        {"question": "Color of the sky?", "choices": ["blue", "green"], "answer": 0},
        {"question": "Opposite of yes?", "choices": ["no", "maybe", "yes"], "answer": 0},
    ]
    data = tmp_path / "mc.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "lmforge_local_mc.yaml").write_text(
        "task: lmforge_local_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=LMForgeHarnessModel(lm=tiny_lm),
        tasks=["lmforge_local_mc"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        bootstrap_iters=0,
        log_samples=False,
    )
    acc, _ = evaluate_choices(tiny_lm, load_choices(data))
    assert results["results"]["lmforge_local_mc"]["acc,none"] == pytest.approx(acc.accuracy)
