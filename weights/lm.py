"""Where causal language models come from: resolve a name or a local directory.

`resolve_causal_lm("tiny-lm")` is the tiny Llama that ships with the repo (built by
`python -m tools.weights.build_tiny_lm`); any other string is a local transformers
checkpoint directory (config.json, *.safetensors or pytorch_model*.bin, and a
tokenizer). Nothing here downloads anything.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_LM = "tiny-lm"
TINY_LM_DIR = Path(__file__).resolve().parent / "tiny-lm"

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def resolve_causal_lm(name_or_path: str | Path, require_tokenizer: bool = True) -> Path:
    """The local directory of causal LM `name_or_path`, checked for what loading needs.

    Raises FileNotFoundError naming the missing piece (directory, config.json, weights,
    tokenizer) and ValueError when config.json is not a causal-LM config.
    """
    if not isinstance(name_or_path, (str, Path)) or not str(name_or_path).strip():
        raise ValueError(f"model must be 'tiny-lm' or a local directory, got {name_or_path!r}")
    path = TINY_LM_DIR if str(name_or_path) == TINY_LM else Path(name_or_path).expanduser()
    if not path.is_dir():
        hint = " (run `python -m tools.weights.build_tiny_lm` to rebuild it)" if path == TINY_LM_DIR else ""
        raise FileNotFoundError(
            f"model {str(name_or_path)!r}: directory {str(path)!r} does not exist{hint}; "
            f"give 'tiny-lm' or a local transformers checkpoint directory (no hub downloads)"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model {str(name_or_path)!r}: {str(config_file)!r} is missing")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"model {str(name_or_path)!r}: {str(config_file)!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"model {str(name_or_path)!r}: {str(config_file)!r} has no 'model_type'")
    if not any(any(path.glob(p)) for p in _WEIGHT_PATTERNS):
        raise FileNotFoundError(
            f"model {str(name_or_path)!r}: no weights in {str(path)!r} (expected *.safetensors or pytorch_model*.bin)"
        )
    if require_tokenizer and not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"model {str(name_or_path)!r}: no tokenizer in {str(path)!r} "
            f"(expected one of {', '.join(_TOKENIZER_FILES)})"
        )
    return path
