"""CUDA-graph decoding on a GPU: same tokens as the dynamic step, graphs recorded per bucket.

These run only where a GPU is present (CI has none; the static step's logic is also checked on
CPU in test_steps.py::test_static_decode_step_decodes_the_same_tokens)."""

import pytest
import torch

from lmforge.infer.engine import Engine, GenerationParams
from lmforge.infer.steps import GraphStep
from lmforge.lm import LM
from lmforge.model.config import ModelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("preset", ["llama-micro", "gpt2-micro"])
def test_graphs_decode_the_same_tokens(preset):
    config = ModelConfig.from_preset(preset, vocab_size=97, max_seq_len=64)
    model = LM.from_config(config, seed=0).model.cuda()
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17], [3], [5, 6, 7]]
    params = GenerationParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[])
    plain = Engine(model, max_batch=4, eos_ids=[], cuda_graphs=False)
    graphed = Engine(model, max_batch=4, eos_ids=[])  # on by default on a GPU
    assert isinstance(graphed.decode_step, GraphStep) and graphed.decode_step.use_graphs
    want = [c.token_ids for c in plain.generate(prompts, params)]
    assert [c.token_ids for c in graphed.generate(prompts, params)] == want
    assert set(graphed.decode_step.graphs) <= {1, 2, 4}  # recorded for the batch sizes seen


def test_seeded_sampling_with_graphs_is_reproducible():
    config = ModelConfig.from_preset("llama-micro", vocab_size=97, max_seq_len=64)
    model = LM.from_config(config, seed=0).model.cuda()
    params = GenerationParams(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=3)
    runs = []
    for _ in range(2):
        engine = Engine(model, max_batch=2, eos_ids=[])
        runs.append([c.token_ids for c in engine.generate([[1, 2]] * 3, params)])
    assert runs[0] == runs[1]
