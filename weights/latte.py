"""Locate and validate Latte-format (diffusers ``LattePipeline``) checkpoints.

``resolve_latte("tiny-latte")`` returns the tiny random checkpoint shipped in this package;
any other string or path is taken as a local directory in diffusers layout, e.g. a local
copy of ``maxin-cn/Latte-1``::

    model_index.json                 {"_class_name": "LattePipeline", ...}
    transformer/config.json          {"_class_name": "LatteTransformer3DModel", ...}
    transformer/*.safetensors|*.bin
    vae/config.json, vae/*.safetensors|*.bin
    text_encoder/config.json, text_encoder/*.safetensors|*.bin
    tokenizer/tokenizer.json and/or tokenizer/spiece.model
    scheduler/scheduler_config.json

Nothing here downloads anything or imports torch/diffusers: validation only reads the file
system, so it is cheap enough to run before spawning workers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TINY_LATTE_DIR = Path(__file__).resolve().parent / "tiny-latte"

#: Short model names -> shipped checkpoint directories.
TINY_MODELS: dict[str, Path] = {"tiny-latte": TINY_LATTE_DIR}

#: ``model_index.json`` ``_class_name`` values accepted as a Latte pipeline.
LATTE_PIPELINE_CLASSES = frozenset({"LattePipeline"})
LATTE_TRANSFORMER_CLASS = "LatteTransformer3DModel"

#: Component subfolder -> (config file or None, whether it must hold weight files).
LATTE_COMPONENTS: dict[str, tuple[str | None, bool]] = {
    "transformer": ("config.json", True),
    "vae": ("config.json", True),
    "text_encoder": ("config.json", True),
    "tokenizer": (None, False),
    "scheduler": ("scheduler_config.json", False),
}
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
TOKENIZER_FILES = ("tokenizer.json", "spiece.model")

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


def _read_json(path: Path, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text: {e}") from None


def _known_names() -> str:
    return ", ".join(sorted(TINY_MODELS))


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
    if isinstance(name_or_path, str) and name_or_path in TINY_MODELS:
        root = TINY_MODELS[name_or_path]
        if not root.is_dir():
            raise FileNotFoundError(
                f"shipped checkpoint {name_or_path!r} is missing: no directory {root} "
                f"(rebuild it with `python -m weights.build_tiny_latte`)"
            )
    else:
        if not isinstance(name_or_path, (str, os.PathLike)):
            raise TypeError(f"expected a model name or a path, got {type(name_or_path).__name__}")
        raw = os.fspath(name_or_path)
        if not raw:
            raise ValueError(f"empty model name or path (known names: {_known_names()})")
        root = Path(raw).expanduser()
        if not root.exists():
            raise FileNotFoundError(
                f"Latte checkpoint directory not found: {raw!r} is neither a known model name "
                f"(known names: {_known_names()}) nor an existing directory; nothing is "
                f"downloaded, so pass a local diffusers-format LattePipeline directory"
            )
        if not root.is_dir():
            raise ValueError(f"Latte checkpoint path {root} is not a directory")
    root = root.resolve()
    validate_latte_dir(root)
    return root


def validate_latte_dir(root: str | os.PathLike) -> dict[str, Any]:
    """Check that ``root`` holds a Latte-format diffusers pipeline; return its model_index."""
    root = Path(root)
    index_path = root / "model_index.json"
    if not index_path.is_file():
        raise FileNotFoundError(
            f"{root} is not a diffusers pipeline: model_index.json is missing ({index_path})"
        )
    index = _read_json(index_path, "model_index.json")
    if not isinstance(index, dict):
        raise ValueError(f"model_index.json {index_path} must hold a JSON object")
    cls = index.get("_class_name")
    if cls not in LATTE_PIPELINE_CLASSES:
        raise ValueError(
            f"{index_path} names pipeline class {cls!r}, not a Latte pipeline "
            f"(expected _class_name {' or '.join(sorted(LATTE_PIPELINE_CLASSES))})"
        )

    for comp, (config_name, needs_weights) in LATTE_COMPONENTS.items():
        entry = index.get(comp)
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and all(entry)):
            raise ValueError(
                f"model_index.json {index_path} has no usable entry for component {comp!r} "
                f"(found {entry!r}; expected [library, class], e.g. as LattePipeline.save_pretrained writes)"
            )
        sub = root / comp
        if not sub.is_dir():
            raise FileNotFoundError(f"component folder {comp}/ is missing: {sub}")
        if config_name is not None:
            cfg_path = sub / config_name
            if not cfg_path.is_file():
                raise FileNotFoundError(f"{comp} config is missing: {cfg_path}")
            cfg = _read_json(cfg_path, f"{comp} config")
            if not isinstance(cfg, dict):
                raise ValueError(f"{comp} config {cfg_path} must hold a JSON object")
            if comp == "transformer" and cfg.get("_class_name") != LATTE_TRANSFORMER_CLASS:
                raise ValueError(
                    f"transformer config {cfg_path} has _class_name {cfg.get('_class_name')!r}, "
                    f"expected {LATTE_TRANSFORMER_CLASS!r}"
                )
        if needs_weights and not any(p.is_file() for pat in WEIGHT_PATTERNS for p in sub.glob(pat)):
            raise FileNotFoundError(
                f"{comp} weights are missing: no {' or '.join(WEIGHT_PATTERNS)} file in {sub}"
            )
        if comp == "tokenizer" and not any((sub / f).is_file() for f in TOKENIZER_FILES):
            raise FileNotFoundError(
                f"tokenizer vocabulary is missing: neither {' nor '.join(TOKENIZER_FILES)} in {sub}"
            )
    return index


__all__ = [
    "LATTE_1_TRANSFORMER_CONFIG",
    "TINY_LATTE_DIR",
    "TINY_MODELS",
    "resolve_latte",
    "validate_latte_dir",
]
