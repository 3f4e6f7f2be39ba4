"""The shipped tiny-framepack checkpoint: rebuilt byte for byte by its script, small, a `HunyuanVideoFramepackPipeline`
directory naming the published components, with an odd head count and FramePack's history embedders."""

from __future__ import annotations

import json

import pytest

from longserve.weights import read_model_index, resolve_model
from tests.support.checkpoints import assert_rebuilt
from tools.weights import build_tiny_framepack

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_build_equals_the_committed_checkpoint_byte_for_byte(tmp_path):
    assert_rebuilt(build_tiny_framepack.build(tmp_path / "tiny-framepack"), resolve_model("tiny-framepack"))


def test_the_checkpoint_is_small_and_has_the_published_structure():
    root = resolve_model("tiny-framepack")
    assert sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) < 2 * 2**20
    index = {k: v for k, v in read_model_index("tiny-framepack").items() if k != "_diffusers_version"}
    assert index == build_tiny_framepack.MODEL_INDEX
    transformer = json.loads((root / "transformer" / "config.json").read_text())
    assert transformer["num_attention_heads"] == 3, "an odd head count"
    assert transformer["has_clean_x_embedder"] and transformer["has_image_proj"] and transformer["guidance_embeds"]
