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

from lmforge.vlm.data import ShapesDataset, load_image, to_pixels
from lmforge.vlm.hf_vision import load_hf_vision_tower
from lmforge.vlm.model import IMAGE, VisionLanguageModel, build_vlm_tokenizer
from lmforge.vlm.projector import PROJECTORS, build_projector
from lmforge.vlm.vision import VisionConfig, VisionEncoder

__all__ = [
    "IMAGE",
    "PROJECTORS",
    "ShapesDataset",
    "VisionConfig",
    "VisionEncoder",
    "VisionLanguageModel",
    "build_projector",
    "build_vlm_tokenizer",
    "load_hf_vision_tower",
    "load_image",
    "to_pixels",
]
