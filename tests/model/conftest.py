import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def spec_exhibits():
    """tests/model/spec_exhibits.py: SPEC formulas nothing in lmforge uses (BatchNorm, the
    Perceiver latent block, the FP8 scaled GEMM), loaded by path because tests/ is no package."""
    path = Path(__file__).parent / "spec_exhibits.py"
    spec = importlib.util.spec_from_file_location("spec_exhibits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
