"""Interoperability with Hugging Face: checkpoints (load/export), configs, chat templates."""

from lmforge.interop.chat_template import render_chat
from lmforge.interop.families import FAMILIES
from lmforge.interop.hf import export_hf, hf_config_to_ours, load_hf_model

__all__ = ["FAMILIES", "export_hf", "hf_config_to_ours", "load_hf_model", "render_chat"]
