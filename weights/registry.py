"""Locate and validate diffusers pipeline checkpoints of any family, generically.

``resolve_model("tiny-wan")`` returns a checkpoint shipped in this package (see
:data:`TINY_MODELS`); any other string or path is a local directory in diffusers layout::

    model_index.json              {"_class_name": "WanPipeline",
                                   "transformer": ["diffusers", "WanTransformer3DModel"], ...}
    <component>/config.json       for every model component listed in model_index.json
    <component>/*.safetensors     ... with its weights (or *.bin, or a sharded *.index.json and its shards)
    scheduler/scheduler_config.json
    tokenizer/tokenizer.json      (or spiece.model, tokenizer.model, vocab.json, vocab.txt)

What has to be there is read from ``model_index.json`` itself, so Latte, Wan 2.1/2.2 and
SkyReels-V2 directories (and any other diffusers pipeline) are checked by the same code: each
entry ``"name": [library, class]`` with both set is a component that must be present; entries
``[null, null]`` (e.g. Wan 2.2's ``transformer_2`` in a single-expert checkpoint) and plain
values (``"boundary_ratio": 0.875``) are not components.

Nothing here downloads anything or imports torch/diffusers: validation only reads the file
system, so it is cheap enough to run before spawning workers.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent

#: Short model names -> shipped checkpoint directories.
TINY_MODELS: dict[str, Path] = {
    "tiny-latte": _HERE / "tiny-latte",
    "tiny-wan": _HERE / "tiny-wan",
    "tiny-skyreels-df": _HERE / "tiny-skyreels-df",
    "tiny-live": _HERE / "tiny-live",
    "tiny-wan-i2v": _HERE / "tiny-wan-i2v",
    "tiny-i2v": _HERE / "tiny-i2v",
    "tiny-wan-flf2v": _HERE / "tiny-wan-flf2v",
    "tiny-wan22-ti2v": _HERE / "tiny-wan22-ti2v",
    "tiny-wan22-i2v-a14b": _HERE / "tiny-wan22-i2v-a14b",
    "tiny-skyreels-i2v": _HERE / "tiny-skyreels-i2v",
    "tiny-skyreels-df-i2v": _HERE / "tiny-skyreels-df-i2v",
    "tiny-skyreels-df-v2v": _HERE / "tiny-skyreels-df-v2v",
    "tiny-helios": _HERE / "tiny-helios",
    "tiny-helios-distilled": _HERE / "tiny-helios-distilled",
    "tiny-hunyuan15": _HERE / "tiny-hunyuan15",
    "tiny-hunyuan15-i2v": _HERE / "tiny-hunyuan15-i2v",
    "tiny-ltx2": _HERE / "tiny-ltx2",
    "tiny-ltx2-i2v": _HERE / "tiny-ltx2-i2v",
    "tiny-ltx2-upsample": _HERE / "tiny-ltx2-upsample",
    "tiny-sana-video": _HERE / "tiny-sana-video",
    "tiny-sana-video-i2v": _HERE / "tiny-sana-video-i2v",
    "tiny-framepack": _HERE / "tiny-framepack",
}

#: The shipped checkpoints trained to draw their prompts (procedural clips: weights/README.md); every other one keeps
#: random weights (it checks structure: diffusers parity, parallel plans, the API), so its videos are coloured noise.
TRAINED_MODELS: tuple[str, ...] = ("tiny-latte", "tiny-skyreels-df", "tiny-live", "tiny-i2v")


def tiny_label(name: str) -> str:
    """A shipped model's name as listings write it: the random ones marked."""
    return name if name in TRAINED_MODELS else f"{name} (random weights)"


#: Shipped LoRA adapters for tiny-wan (tools/weights/build_tiny_lora.py): a short name -> its file, usable wherever a
#: LoRA path is (``--lora style=tiny-wan-lora``). One in diffusers' format, one in kohya / musubi tuner's.
TINY_LORAS: dict[str, Path] = {
    "tiny-wan-lora": _HERE / "tiny-wan-lora" / "pytorch_lora_weights.safetensors",
    "tiny-wan-lora-musubi": _HERE / "tiny-wan-lora-musubi" / "tiny_wan_lora_musubi.safetensors",
}

#: How to rebuild each shipped checkpoint, from a clone of the repository (named in the error when one is missing).
REBUILD_COMMANDS: dict[str, str] = {
    "tiny-latte": "python -m tools.weights.train_tiny_latte",
    "tiny-wan": "python -m tools.weights.build_tiny_wan --kind wan",
    "tiny-skyreels-df": "python -m tools.weights.train_tiny_skyreels_df",
    "tiny-live": "python -m tools.weights.train_tiny_live",
    "tiny-wan-i2v": "python -m tools.weights.build_tiny_wan_i2v --kind i2v",
    "tiny-i2v": "python -m tools.weights.train_tiny_i2v",
    "tiny-wan-flf2v": "python -m tools.weights.build_tiny_wan_i2v --kind flf2v",
    "tiny-wan22-ti2v": "python -m tools.weights.build_tiny_wan_i2v --kind wan22-ti2v",
    "tiny-wan22-i2v-a14b": "python -m tools.weights.build_tiny_wan_i2v --kind wan22-i2v-a14b",
    "tiny-skyreels-i2v": "python -m tools.weights.build_tiny_wan_i2v --kind skyreels-i2v",
    "tiny-skyreels-df-i2v": "python -m tools.weights.build_tiny_skyreels_df_variants --kind i2v",
    "tiny-skyreels-df-v2v": "python -m tools.weights.build_tiny_skyreels_df_variants --kind v2v",
    "tiny-helios": "python -m tools.weights.build_tiny_helios --kind helios",
    "tiny-helios-distilled": "python -m tools.weights.build_tiny_helios --kind distilled",
    "tiny-hunyuan15": "python -m tools.weights.build_tiny_hunyuan15 --kind t2v",
    "tiny-hunyuan15-i2v": "python -m tools.weights.build_tiny_hunyuan15 --kind i2v",
    "tiny-ltx2": "python -m tools.weights.build_tiny_ltx2",
    "tiny-ltx2-i2v": "python -m tools.weights.build_tiny_ltx2 --kind i2v",
    "tiny-ltx2-upsample": "python -m tools.weights.build_tiny_ltx2 --kind upsample",
    "tiny-sana-video": "python -m tools.weights.build_tiny_sana_video --kind t2v",
    "tiny-sana-video-i2v": "python -m tools.weights.build_tiny_sana_video --kind i2v",
    "tiny-framepack": "python -m tools.weights.build_tiny_framepack",
}

#: Optional longserve file in a checkpoint's root: default call arguments (sizes, steps,
#: guidance, fps, diffusion-forcing windows). diffusers ignores it.
GENERATION_DEFAULTS_FILE = "generation_defaults.json"

WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
SHARD_INDEX_PATTERN = "*.index.json"
#: A tokenizer folder needs a vocabulary: tokenizer_config.json alone cannot be loaded offline.
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "spiece.model", "tokenizer.model", "vocab.json", "vocab.txt")
#: Tokenizers whose vocabulary is the bytes themselves: no vocabulary file (HunyuanVideo-1.5's ByT5)
BYTE_TOKENIZERS = ("ByT5Tokenizer",)

# "owner/name" with Hub-legal characters: what a Hugging Face model id looks like.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


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


def locate(name_or_path: str | os.PathLike) -> Path:
    """The absolute directory ``name_or_path`` names, without validating what is inside it.

    A ``str`` that is a key of :data:`TINY_MODELS` is a shipped checkpoint; anything else is a
    local path. Raises ``FileNotFoundError`` (naming the known short names, or saying how to
    download a Hub id such as ``"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"``) and ``ValueError``.
    """
    if isinstance(name_or_path, str) and name_or_path in TINY_MODELS:
        root = TINY_MODELS[name_or_path]
        if not root.is_dir():
            raise FileNotFoundError(
                f"shipped checkpoint {name_or_path!r} is missing: no directory {root} "
                f"(rebuild it with `{REBUILD_COMMANDS[name_or_path]}`)"
            )
        return root.resolve()
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"expected a model name or a path, got {type(name_or_path).__name__}")
    raw = os.fspath(name_or_path)
    if not raw:
        raise ValueError(f"empty model name or path (known names: {_known_names()})")
    root = Path(raw).expanduser()
    if not root.exists():
        if isinstance(name_or_path, str) and _HUB_ID.match(raw):
            raise FileNotFoundError(
                f"checkpoint {raw!r} not found: there is no such directory, and if it is a Hugging "
                f"Face Hub id, nothing is downloaded here. Fetch it first on a machine with network "
                f"access, e.g. `huggingface-cli download {raw} --local-dir /models/{raw.split('/')[1]}`, "
                f"and pass that directory (known short names: {_known_names()})"
            )
        raise FileNotFoundError(
            f"checkpoint directory not found: {raw!r} is neither a known model name "
            f"(known names: {_known_names()}) nor an existing directory; nothing is "
            f"downloaded, so pass a local diffusers-format pipeline directory"
        )
    if not root.is_dir():
        raise ValueError(f"checkpoint path {root} is not a directory")
    return root.resolve()


def read_model_index(name_or_path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``model_index.json`` of a checkpoint (short name or directory)."""
    root = locate(name_or_path)
    index_path = root / "model_index.json"
    if not index_path.is_file():
        raise FileNotFoundError(
            f"{root} is not a diffusers pipeline: model_index.json is missing ({index_path})"
        )
    index = _read_json(index_path, "model_index.json")
    if not isinstance(index, dict):
        raise ValueError(f"model_index.json {index_path} must hold a JSON object")
    return index


def pipeline_class(name_or_path: str | os.PathLike) -> str:
    """The diffusers pipeline class a checkpoint names (``model_index.json`` ``_class_name``)."""
    root = locate(name_or_path)
    cls = read_model_index(root).get("_class_name")
    if not isinstance(cls, str) or not cls:
        raise ValueError(f"model_index.json in {root} has no _class_name (found {cls!r})")
    return cls


def components(index: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """The components ``model_index.json`` lists: name -> (library, class), in file order.

    Entries ``[null, null]`` (an optional component left out) and non-list values (pipeline
    settings such as ``boundary_ratio``) are not components.
    """
    found = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, (list, tuple)) or len(entry) != 2:
            continue
        library, cls = entry
        if library is None and cls is None:
            continue
        if not (isinstance(library, str) and library and isinstance(cls, str) and cls):
            raise ValueError(
                f"model_index.json entry for component {name!r} must be [library, class] or "
                f"[null, null], found {entry!r}"
            )
        found[name] = (library, cls)
    return found


def component_kind(cls: str) -> str:
    """``"tokenizer"``, ``"scheduler"``, ``"processor"``, ``"guider"`` or ``"model"`` (has config.json and
    weights)."""
    if "Tokenizer" in cls:
        return "tokenizer"
    if cls.endswith("Scheduler"):
        return "scheduler"
    # Image processors / feature extractors (e.g. CLIPImageProcessor of the image-to-video
    # pipelines) carry a preprocessor_config.json and no weights.
    if cls.endswith(("Processor", "FeatureExtractor")):
        return "processor"
    # diffusers' guiders (HunyuanVideo-1.5's ClassifierFreeGuidance): a guider_config.json, no weights
    if cls.endswith("Guidance"):
        return "guider"
    return "model"


def _check_weights(comp: str, sub: Path) -> None:
    shard_indexes = sorted(sub.glob(SHARD_INDEX_PATTERN))
    for index_path in shard_indexes:
        shard_index = _read_json(index_path, f"{comp} shard index")
        weight_map = shard_index.get("weight_map") if isinstance(shard_index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{comp} shard index {index_path} has no weight_map")
        for shard in sorted(set(weight_map.values())):
            if not (sub / shard).is_file():
                raise FileNotFoundError(
                    f"{comp} weights are missing: shard {shard} listed in {index_path} is not in {sub}"
                )
    if not shard_indexes and not any(p.is_file() for pat in WEIGHT_PATTERNS for p in sub.glob(pat)):
        raise FileNotFoundError(
            f"{comp} weights are missing: no {' or '.join(WEIGHT_PATTERNS)} file "
            f"(nor a sharded {SHARD_INDEX_PATTERN}) in {sub}"
        )


def _check_component(root: Path, comp: str, library: str, cls: str) -> None:
    sub = root / comp
    if not sub.is_dir():
        raise FileNotFoundError(f"component folder {comp}/ is missing: {sub} (model_index.json lists {cls})")
    kind = component_kind(cls)
    if kind == "tokenizer":
        if cls in BYTE_TOKENIZERS:
            return
        if not any((sub / f).is_file() for f in TOKENIZER_VOCAB_FILES):
            raise FileNotFoundError(
                f"{comp} vocabulary is missing: none of {', '.join(TOKENIZER_VOCAB_FILES)} in {sub}"
            )
        return
    config_name = {"scheduler": "scheduler_config.json", "guider": "guider_config.json",
                   "processor": "preprocessor_config.json"}.get(kind, "config.json")
    cfg_path = sub / config_name
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{comp} config is missing: {cfg_path}")
    cfg = _read_json(cfg_path, f"{comp} config")
    if not isinstance(cfg, dict):
        raise ValueError(f"{comp} config {cfg_path} must hold a JSON object")
    if kind != "model":
        return
    # diffusers model configs name their class; a mismatch means the folder holds another
    # model than model_index.json says (transformers configs carry "architectures" instead).
    if library == "diffusers" and "_class_name" in cfg and cfg["_class_name"] != cls:
        raise ValueError(
            f"{comp} config {cfg_path} has _class_name {cfg['_class_name']!r}, but model_index.json "
            f"names {cls!r}"
        )
    _check_weights(comp, sub)


def validate_model_dir(root: str | os.PathLike, index: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check that every component ``model_index.json`` lists is present; return the index.

    Raises ``FileNotFoundError`` for a missing folder, config, vocabulary or weight file and
    ``ValueError`` for something present but wrong; the message names the component and path.
    """
    root = Path(root)
    if index is None:
        index = read_model_index(root)
    listed = components(index)
    if not listed:
        raise ValueError(f"model_index.json in {root} lists no components")
    for comp, (library, cls) in listed.items():
        _check_component(root, comp, library, cls)
    return index


def resolve_model(name_or_path: str | os.PathLike, *, pipeline_classes: Iterable[str] | None = None) -> Path:
    """Return the absolute directory of a diffusers pipeline checkpoint, validated.

    ``name_or_path`` is a short name from :data:`TINY_MODELS` (``"tiny-latte"``, ``"tiny-wan"``,
    ``"tiny-skyreels-df"``) or a local directory. Hub ids such as
    ``"Wan-AI/Wan2.1-T2V-1.3B-Diffusers"`` are not downloaded: the error says how to fetch them.
    With ``pipeline_classes``, the checkpoint's ``_class_name`` must be one of them.
    """
    root = locate(name_or_path)
    index = read_model_index(root)
    if pipeline_classes is not None:
        allowed = sorted(pipeline_classes)
        cls = index.get("_class_name")
        if cls not in allowed:
            raise ValueError(
                f"{root / 'model_index.json'} names pipeline class {cls!r}, expected _class_name "
                f"{' or '.join(allowed)}"
            )
    validate_model_dir(root, index)
    return root


def resolve_lora(name_or_path: str | os.PathLike) -> Path:
    """The safetensors file of a LoRA adapter: a name from :data:`TINY_LORAS`, a ``.safetensors`` file, or a
    directory holding one (diffusers' ``save_lora_weights`` writes ``pytorch_lora_weights.safetensors``).

    Raises ``FileNotFoundError`` when there is no such file and ``ValueError`` when a directory holds several
    candidates or the file is not safetensors (pickled ``.bin`` adapters are not loaded: they can run code).
    Nothing is downloaded.
    """
    if isinstance(name_or_path, str) and name_or_path in TINY_LORAS:
        path = TINY_LORAS[name_or_path]
        if not path.is_file():
            raise FileNotFoundError(f"shipped LoRA {name_or_path!r} is missing: no file {path} (rebuild it with "
                                    f"`python -m tools.weights.build_tiny_lora`)")
        return path.resolve()
    path = Path(os.fspath(name_or_path)).expanduser()
    if path.is_dir():
        found = sorted(path.glob("*.safetensors"))
        named = [p for p in found if p.name == "pytorch_lora_weights.safetensors"]
        if len(named) == 1 or len(found) == 1:
            return (named or found)[0].resolve()
        raise (FileNotFoundError if not found else ValueError)(
            f"{path} holds {len(found)} .safetensors files; name the adapter's file (or keep one per directory)")
    if not path.is_file():
        raise FileNotFoundError(f"no LoRA file {str(path)!r}: neither a shipped name ({', '.join(sorted(TINY_LORAS))}) "
                                f"nor an existing file or directory; nothing is downloaded")
    if path.suffix != ".safetensors":
        raise ValueError(f"{path} is not a .safetensors file (LoRA adapters are loaded from safetensors only)")
    return path.resolve()


def generation_defaults(name_or_path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's ``generation_defaults.json`` (``{}`` when it has none).

    Real checkpoints do not ship one; callers then fall back to the pipeline's own defaults.
    """
    path = locate(name_or_path) / GENERATION_DEFAULTS_FILE
    if not path.is_file():
        return {}
    defaults = _read_json(path, GENERATION_DEFAULTS_FILE)
    if not isinstance(defaults, dict):
        raise ValueError(f"{GENERATION_DEFAULTS_FILE} {path} must hold a JSON object")
    return defaults


__all__ = [
    "GENERATION_DEFAULTS_FILE",
    "REBUILD_COMMANDS",
    "TINY_LORAS",
    "TINY_MODELS",
    "TRAINED_MODELS",
    "tiny_label",
    "component_kind",
    "components",
    "generation_defaults",
    "locate",
    "pipeline_class",
    "read_model_index",
    "resolve_lora",
    "resolve_model",
    "validate_model_dir",
]
