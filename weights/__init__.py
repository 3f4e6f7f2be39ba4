"""Model weights: locating checkpoints and the tiny random checkpoints shipped for tests and demos."""

from .latte import TINY_LATTE_DIR, resolve_latte
from .registry import (
    TINY_LORAS,
    TINY_MODELS,
    TRAINED_MODELS,
    generation_defaults,
    pipeline_class,
    read_model_index,
    resolve_lora,
    resolve_model,
    tiny_label,
)

__all__ = ["TINY_LATTE_DIR", "TINY_LORAS", "TINY_MODELS", "TRAINED_MODELS", "generation_defaults", "pipeline_class",
           "read_model_index", "resolve_latte", "resolve_lora", "resolve_model", "tiny_label"]
