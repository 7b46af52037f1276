"""lmforge: train, fine-tune, align, serve and evaluate causal transformer language models."""

from lmforge.lm import LM
from lmforge.model.config import ModelConfig

__all__ = ["LM", "ModelConfig"]
__version__ = "0.1.0"
