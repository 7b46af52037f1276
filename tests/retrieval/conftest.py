"""The retrieval tests' tiny LM: its 320-token window holds the RAG chat prompt (instruction,
question) plus a passage or two."""

import pytest


@pytest.fixture(scope="session")
def tiny_lm(make_tiny_lm):
    return make_tiny_lm(320)
