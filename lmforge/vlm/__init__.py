"""Vision-language models: images as tokens in lmforge's causal transformer (LLaVA).

vision.py     ViT patch encoder on lmforge's shared Block (trainable or frozen; linear or conv stem)
hf_vision.py  load a CLIP / SigLIP vision tower from a Hugging Face directory
projector.py  vision features -> LM embeddings (linear W v + b, or a 2-layer MLP)
model.py      VisionLanguageModel: prompts with image blocks, text-only loss, cached generation,
              save/load in a Hugging Face-like directory
data.py       built-in synthetic shapes captions (random sizes/positions; train / validation /
              test / novel splits, Latin-square held-out colour x shape pairs), image loading
train.py      the training run behind `lmforge vlm train`
"""
