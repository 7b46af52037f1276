"""The causal transformer and its components."""

from lmforge.model.cache import KVCache
from lmforge.model.config import PRESETS, ModelConfig
from lmforge.model.transformer import Block, Transformer

__all__ = ["PRESETS", "Block", "KVCache", "ModelConfig", "Transformer"]
