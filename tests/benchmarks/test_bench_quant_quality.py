"""benchmarks/bench_quant_quality.py's core, `compare`, on a tiny model: fp32 against itself is
exact, its perplexity is lmforge's eval perplexity over the same windows, and the quantised
precisions show an error that grows as bits shrink."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from lmforge.eval.perplexity import perplexity
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_quant_quality import compare  # noqa: E402


def test_compare_precisions_against_fp32():
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=64, n_layer=1, n_head=2, d_model=64, max_seq_len=32, pos="rope",
        norm="rmsnorm", mlp="swiglu", bias=False, d_ff=128,
    )  # fmt: skip
    model = Transformer(config).eval()
    for p in model.parameters():  # larger than init so that 4 bits visibly cost something
        p.data.mul_(4)
    ids = torch.randint(0, 64, (97,)).tolist()
    same = {"a copy": copy.deepcopy(model)}
    result = compare(model, ids, 32, ("fp32", "bf16", "int8", "int4"), same)
    assert set(result) == {"fp32", "bf16", "int8", "int4", "a copy"}
    assert result["a copy"] == result["fp32"]
    fp32 = result["fp32"]
    assert fp32["tokens"] == 96
    assert fp32["relative_logit_error"] == 0 and fp32["top1_agreement"] == 1
    assert fp32["perplexity"] == pytest.approx(perplexity(model, ids, [1] * 64, 32).perplexity)
    for p in ("bf16", "int8", "int4"):
        assert result[p]["relative_logit_error"] > 0
        assert 0 <= result[p]["top1_agreement"] <= 1
    assert result["int8"]["relative_logit_error"] < result["int4"]["relative_logit_error"]
    assert result["int4"]["relative_logit_error"] < 0.5
    assert result["int4"]["top1_agreement"] < 1
