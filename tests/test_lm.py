import pytest
import torch

from lmforge import LM, ModelConfig
from lmforge.errors import CheckpointError, ConfigError
from lmforge.infer.params import GenerationParams
from lmforge.tokenizer import Tokenizer

TEXT = "the quick brown fox jumps over the lazy dog. " * 20


@pytest.fixture(scope="module")
def lm() -> LM:
    tok = Tokenizer.train_char([TEXT])
    config = ModelConfig(vocab_size=tok.vocab_size, n_layer=2, d_model=32, n_head=4, max_seq_len=64)
    return LM.from_config(config, tokenizer=tok, seed=0)


@pytest.fixture(scope="module")
def llama_lm() -> LM:
    config = ModelConfig(
        vocab_size=50, n_layer=2, d_model=32, n_head=4, n_kv_head=2, max_seq_len=64,
        pos="rope", norm="rmsnorm", mlp="swiglu", bias=False,
    )  # fmt: skip
    return LM.from_config(config, seed=0)


@pytest.mark.parametrize("which", ["lm", "llama_lm"])
def test_greedy_equals_the_uncached_reference(which, request, reference_generate):
    model = request.getfixturevalue(which)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [4]]
    cached = model.generate(prompts, max_new_tokens=20, temperature=0.0, eos_ids=[])
    params = GenerationParams(max_new_tokens=20, temperature=0.0)
    assert cached == reference_generate.generate(model.model, prompts, params, use_cache=False)
    assert all(len(row) == 20 for row in cached)


def test_generate_leaves_a_training_model_training(llama_lm):
    llama_lm.model.train()
    llama_lm.generate([[1, 2]], max_new_tokens=2)
    assert llama_lm.model.training
    llama_lm.model.eval()


def test_batched_prompts_of_different_lengths_match_single(llama_lm):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    batched = llama_lm.generate(prompts, max_new_tokens=10, temperature=0.0, eos_ids=[])
    single = [
        llama_lm.generate([p], max_new_tokens=10, temperature=0.0, eos_ids=[])[0] for p in prompts
    ]
    assert batched == single


def test_the_engine_is_freed_before_its_memory_is_handed_back(lm, monkeypatch):
    """LM calls give their engine's KV cache and work buffers back to the OS (malloc_trim), which
    only helps once nothing holds the engine any more."""
    import gc
    import weakref

    import lmforge.lm as lm_module
    from lmforge.infer.engine import Engine

    engines, alive_at_trim = [], []
    real_init = Engine.__init__

    def init(self, *args, **kwargs):
        engines.append(weakref.ref(self))
        real_init(self, *args, **kwargs)

    def trim():
        alive_at_trim.append([engine() is not None for engine in engines])

    monkeypatch.setattr(Engine, "__init__", init)
    monkeypatch.setattr(lm_module, "return_freed_memory", trim)
    gc.disable()  # freed by its reference count alone, not by a collection that happens to run
    try:
        lm.generate([[1, 2, 3]], max_new_tokens=3, eos_ids=[])
        "".join(lm.stream("the", max_new_tokens=3))
    finally:
        gc.enable()
    assert alive_at_trim == [[False], [False, False]]


def test_n_samples_and_seed(llama_lm):
    a = llama_lm.generate([[1, 2, 3]], max_new_tokens=8, n=3, seed=7, eos_ids=[])
    b = llama_lm.generate([[1, 2, 3]], max_new_tokens=8, n=3, seed=7, eos_ids=[])
    assert a == b and len(a) == 3
    assert len({tuple(r) for r in a}) > 1  # samples differ from each other


def test_eos_stops_a_row(llama_lm):
    first = llama_lm.generate([[1, 2, 3]], max_new_tokens=5, temperature=0.0, eos_ids=[])[0]
    stopped = llama_lm.generate([[1, 2, 3]], max_new_tokens=5, temperature=0.0, eos_ids=[first[1]])
    assert stopped[0] == first[: first.index(first[1]) + 1]


def test_complete_stop_strings_and_stream(lm):
    text = lm.complete("the ", max_new_tokens=30, temperature=0.0)[0]
    assert len(text) > 0
    if len(text) > 3:
        stop = text[2:4]
        cut = lm.complete("the ", max_new_tokens=30, temperature=0.0, stop=[stop])[0]
        assert cut == text[: text.find(stop)]
    streamed = "".join(lm.stream("the ", max_new_tokens=30, temperature=0.0))
    assert streamed == text


def test_bad_generation_input(lm):
    with pytest.raises(ConfigError, match="max_seq_len"):
        lm.generate([[1] * 65], max_new_tokens=2)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        lm.generate([[1]], max_new_tokens=0)
    with pytest.raises(ConfigError, match="temperature"):
        lm.complete("x", temperature=-1)
    with pytest.raises(ConfigError, match="top_p"):
        lm.complete("x", top_p=1.5)


def test_save_and_load(lm, tmp_path):
    lm.save(tmp_path / "ck")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "ck").iterdir()
    }
    loaded = LM.load(tmp_path / "ck")
    ids = torch.randint(0, lm.config.vocab_size, (2, 10))
    assert torch.equal(loaded.model(ids), lm.model(ids))
    assert loaded.tokenizer.encode(TEXT) == lm.tokenizer.encode(TEXT)
    with pytest.raises(CheckpointError, match="not found"):
        LM.load(tmp_path / "missing")
