"""Interoperability with Hugging Face and llama.cpp: checkpoints (hf.py, gguf.py), configs
(families.py), chat templates (chat_template.py). Import the submodule you need: this package
imports nothing, so a chat template does not pull in torch and the model."""
