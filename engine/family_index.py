"""Which family module serves a checkpoint, read without importing torch or any family: the lookup that lets a
process import its model's family alone (`engine.families.detect_family`).

Measured on the 2-core dev machine (Intel Xeon, 2026-11-26): a coordinator detecting tiny-latte's family spent
3.0 CPU-s with this table against 3.5 when every family was imported to ask it. (A fork server preloading one
model's family rather than the common ones was tried too: 4.0 CPU-s either way, torch, diffusers and
transformers being all of it, so it was not kept.)
"""

from __future__ import annotations

import json
from pathlib import Path

#: The module of the family that serves each `_class_name`, so that a process imports its model's family alone:
#: importing every family costs a `longserve serve` or `generate` start about half a CPU-second more than Latte's
#: alone (the module docstring). Written from the families' own `pipeline_classes`;
#: tests/engine/test_families.py checks it, and CLAIMS, against `all_families()` and every shipped checkpoint.
PIPELINE_MODULES = {
    "LattePipeline": "latte",
    "WanPipeline": "wan", "SkyReelsV2Pipeline": "wan",
    "WanImageToVideoPipeline": "wan_i2v", "SkyReelsV2ImageToVideoPipeline": "wan_i2v",
    "SkyReelsV2DiffusionForcingPipeline": "skyreels_df",
    "SkyReelsV2DiffusionForcingImageToVideoPipeline": "skyreels_df",
    "SkyReelsV2DiffusionForcingVideoToVideoPipeline": "skyreels_df",
    "HeliosPipeline": "helios", "HeliosPyramidPipeline": "helios_pyramid",
    "LTX2Pipeline": "ltx2", "LTX2ImageToVideoPipeline": "ltx2",
    "HunyuanVideo15Pipeline": "hunyuan15", "HunyuanVideo15ImageToVideoPipeline": "hunyuan15",
    "SanaVideoPipeline": "sana_video", "SanaImageToVideoPipeline": "sana_video",
    "HunyuanVideoFramepackPipeline": "framepack",
}
#: The modules whose family claims a directory by more than its `_class_name` (`VideoFamily.claims`), each with
#: what must hold before it is imported and asked: a file of its own in the directory, or a key of its own in the
#: directory's `model_index.json`.
CLAIMS = {
    "causal_wan": ("file", "causal_config.json"),
    "wan_ti2v": ("index", "expand_timesteps"),
}


def model_index(model_dir: str | Path) -> dict:
    """A checkpoint's `model_index.json` ({} when it has none or it cannot be read)."""
    try:
        index = json.loads((Path(model_dir) / "model_index.json").read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def hinted(model_dir: Path, index: dict, hint: tuple[str, str]) -> bool:
    """Does `model_dir` show what a claiming family's `CLAIMS` entry names?"""
    kind, what = hint
    return (model_dir / what).is_file() if kind == "file" else bool(index.get(what))
