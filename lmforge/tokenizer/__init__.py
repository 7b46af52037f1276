"""Tokenizers: byte-level BPE, char-level and word-level, saved in Hugging Face format."""

from lmforge.tokenizer.tokenizer import DEFAULT_SPECIAL_TOKENS, Tokenizer

__all__ = ["DEFAULT_SPECIAL_TOKENS", "Tokenizer"]
