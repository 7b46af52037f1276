"""The causal transformer and its components."""

from lmforge.model.blocks import Block
from lmforge.model.cache import KVCache
from lmforge.model.config import PRESETS, ModelConfig
from lmforge.model.transformer import Transformer

__all__ = ["PRESETS", "Block", "KVCache", "ModelConfig", "Transformer"]
