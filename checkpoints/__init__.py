"""Model loading: Hugging Face folders, orbax checkpoints, named random shapes, the default.

model = load_model()                       # the embedded stories260k
model = load_model("path/to/hf_folder")    # config, safetensors weights, tokenizer
model = load_model("smollm2-135m")         # random weights of a real shape
save_orbax(model, "out_dir"); load_model("out_dir")
"""

from __future__ import annotations

from checkpoints.hf_config import UnsupportedModelError
from checkpoints.loader import (
    DEFAULT_MODEL_DIR,
    LoadedModel,
    ModelLoadError,
    default_dtype,
    load_model,
    model_for,
)
from checkpoints.orbax_io import save_orbax
from checkpoints.random_weights import NAMED_SHAPES

__all__ = [
    "DEFAULT_MODEL_DIR",
    "NAMED_SHAPES",
    "LoadedModel",
    "ModelLoadError",
    "UnsupportedModelError",
    "default_dtype",
    "load_model",
    "model_for",
    "save_orbax",
]
