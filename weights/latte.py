"""Locate and validate Latte-format (diffusers ``LattePipeline``) checkpoints.

``resolve_latte("tiny-latte")`` returns the tiny checkpoint shipped in this package (trained on procedural
clips: weights/README.md);
any other string or path is taken as a local directory in diffusers layout, e.g. a local
copy of ``maxin-cn/Latte-1``::

    model_index.json                 {"_class_name": "LattePipeline", ...}
    transformer/config.json          {"_class_name": "LatteTransformer3DModel", ...}
    transformer/*.safetensors|*.bin
    vae/config.json, vae/*.safetensors|*.bin
    text_encoder/config.json, text_encoder/*.safetensors|*.bin
    tokenizer/tokenizer.json and/or tokenizer/spiece.model
    scheduler/scheduler_config.json

Validation is the generic one of :mod:`weights.registry` (every component model_index.json
lists) plus what a LattePipeline needs on top: the class names and all five components.
Nothing here downloads anything or imports torch/diffusers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .registry import TINY_MODELS, read_model_index, resolve_model

TINY_LATTE_DIR = TINY_MODELS["tiny-latte"].resolve()

#: ``model_index.json`` ``_class_name`` values accepted as a Latte pipeline.
LATTE_PIPELINE_CLASSES = frozenset({"LattePipeline"})
LATTE_TRANSFORMER_CLASS = "LatteTransformer3DModel"
#: Components a LattePipeline cannot run without (it has no optional ones).
LATTE_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")

#: Latte-1's transformer config (``maxin-cn/Latte-1``, transformer/config.json, diffusers
#: format; its text encoder is T5-v1.1-XXL, d_model 4096 = caption_channels).
LATTE_1_TRANSFORMER_CONFIG: dict[str, Any] = {
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "attention_head_dim": 72,
    "caption_channels": 4096,
    "cross_attention_dim": 1152,
    "dropout": 0.0,
    "in_channels": 4,
    "norm_elementwise_affine": False,
    "norm_eps": 1e-06,
    "norm_type": "ada_norm_single",
    "num_attention_heads": 16,
    "num_embeds_ada_norm": 1000,
    "num_layers": 28,
    "out_channels": 8,
    "patch_size": 2,
    "sample_size": 64,
    "video_length": 16,
}


def resolve_latte(name_or_path: str | os.PathLike) -> Path:
    """Return the absolute directory of a Latte-format diffusers pipeline checkpoint.

    ``name_or_path`` is a short name from :data:`TINY_MODELS` (a ``str`` only, e.g.
    ``"tiny-latte"``) or a local directory.  Hub ids such as ``"maxin-cn/Latte-1"`` are not
    downloaded: fetch them first (``huggingface-cli download maxin-cn/Latte-1 --local-dir DIR``)
    and pass ``DIR``.

    Raises ``FileNotFoundError`` when the directory or a required file/folder is missing and
    ``ValueError`` when something exists but is not what a Latte pipeline needs; the message
    names the path and the component at fault.
    """
    root = resolve_model(name_or_path, pipeline_classes=LATTE_PIPELINE_CLASSES)
    _check_latte_index(root, read_model_index(root))
    return root


def _check_latte_index(root: Path, index: dict[str, Any]) -> None:
    # The generic check only covers the components model_index.json lists; a LattePipeline
    # also needs all five of them, and its transformer must be Latte's.
    for comp in LATTE_COMPONENTS:
        entry = index.get(comp)
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and all(entry)):
            raise ValueError(
                f"model_index.json {root / 'model_index.json'} has no usable entry for component {comp!r} "
                f"(found {entry!r}; expected [library, class], e.g. as LattePipeline.save_pretrained writes)"
            )
    if index["transformer"][1] != LATTE_TRANSFORMER_CLASS:
        raise ValueError(
            f"model_index.json {root / 'model_index.json'} names transformer class "
            f"{index['transformer'][1]!r}, expected {LATTE_TRANSFORMER_CLASS!r}"
        )


__all__ = [
    "LATTE_1_TRANSFORMER_CONFIG",
    "TINY_LATTE_DIR",
    "TINY_MODELS",
    "resolve_latte",
]
