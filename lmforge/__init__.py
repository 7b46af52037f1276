"""lmforge: train, fine-tune, align, serve and evaluate causal transformer language models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmforge.lm import LM
    from lmforge.model.config import ModelConfig

__all__ = ["LM", "ModelConfig"]
__version__ = "0.1.0"

# Resolved on first access, so that `import lmforge.cli.main` (and `lmforge --help`) does not
# pay for importing torch before a command that needs it runs.
_LAZY = {"LM": "lmforge.lm", "ModelConfig": "lmforge.model.config"}


def __getattr__(name: str) -> Any:
    """`from lmforge import LM` / `ModelConfig`: import the defining module when first asked."""
    if name not in _LAZY:
        raise AttributeError(f"module 'lmforge' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
