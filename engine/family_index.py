"""The one table of model families: each family's name, the module that declares it and the checkpoints it serves,
read without importing torch or any family (vLLM's model registry reads the same way). `engine.families` finds a
family here and nowhere else; adding a family is its package (or module) under `engine/families/` and one line here.

Measured on the 2-core dev machine (Intel Xeon, 2026-11-26): a coordinator detecting tiny-latte's family spent
3.0 CPU-s with this table against 3.5 when every family was imported to ask it. (A fork server preloading one
model's family rather than the common ones was tried too: 4.0 CPU-s either way, torch, diffusers and
transformers being all of it, so it was not kept.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple


class Entry(NamedTuple):
    """One family's line: `module` (under `longserve.engine.families`) defines `FAMILY`; `pipelines`: the
    `model_index.json` `_class_name`s it serves; `claim`: what else makes it serve a directory (`VideoFamily.claims`),
    checked before it is imported and asked: a file of its own in the directory ("file", name) or a key of its own
    in the directory's `model_index.json` ("index", key)."""

    module: str
    pipelines: tuple[str, ...] = ()
    claim: tuple[str, str] | None = None


#: Every family by its name, one line each (tests/engine/test_families.py checks each against the family it
#: imports and every shipped checkpoint).
FAMILIES = {
    "latte": Entry("latte", ("LattePipeline",)),
    "wan": Entry("wan", ("WanPipeline", "SkyReelsV2Pipeline")),
    "wan-i2v": Entry("wan_i2v", ("WanImageToVideoPipeline", "SkyReelsV2ImageToVideoPipeline")),
    "wan-ti2v": Entry("wan_ti2v", claim=("index", "expand_timesteps")),
    "skyreels-df": Entry("skyreels_df", ("SkyReelsV2DiffusionForcingPipeline",
                                         "SkyReelsV2DiffusionForcingImageToVideoPipeline",
                                         "SkyReelsV2DiffusionForcingVideoToVideoPipeline")),
    "causal-wan": Entry("causal_wan", claim=("file", "causal_config.json")),
    "helios": Entry("helios", ("HeliosPipeline",)),
    "helios-pyramid": Entry("helios_pyramid", ("HeliosPyramidPipeline",)),
    "ltx2": Entry("ltx2.family", ("LTX2Pipeline", "LTX2ImageToVideoPipeline")),
    "hunyuan15": Entry("hunyuan15.family", ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline")),
    "sana_video": Entry("sana_video", ("SanaVideoPipeline", "SanaImageToVideoPipeline")),
    "framepack": Entry("framepack", ("HunyuanVideoFramepackPipeline",)),
}

#: `_class_name` -> the family serving it (so that a process imports its model's family alone: importing every
#: family costs a `longserve serve` or `generate` start about half a CPU-second more than Latte's alone)
PIPELINE_FAMILIES = {pipeline: name for name, entry in FAMILIES.items() for pipeline in entry.pipelines}
#: the families that claim a directory by more than its `_class_name`, with what must hold before they are asked
CLAIMS = {name: entry.claim for name, entry in FAMILIES.items() if entry.claim is not None}


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
