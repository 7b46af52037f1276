"""The evaluation tests' tiny LM: a 128-token window, so long prompts must be cut to fit."""

import pytest


@pytest.fixture(scope="session")
def tiny_lm(make_tiny_lm):
    return make_tiny_lm(128)
