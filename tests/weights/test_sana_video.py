"""The shipped tiny-sana-video and tiny-sana-video-i2v checkpoints: rebuilt byte for byte by their script, small,
`SanaVideoPipeline` / `SanaImageToVideoPipeline` directories naming the published components, with an odd head
count."""

from __future__ import annotations

import json

import pytest

from longserve.weights import read_model_index, resolve_model
from tests.support.checkpoints import assert_rebuilt
from tools.weights import build_tiny_sana_video

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", sorted(build_tiny_sana_video.WRITERS))
def test_the_build_equals_the_committed_checkpoint_byte_for_byte(tmp_path, kind):
    name = build_tiny_sana_video.WRITERS[kind][0]
    assert_rebuilt(build_tiny_sana_video.build(kind, tmp_path / name), resolve_model(name))


def test_the_checkpoints_are_small_and_have_the_published_structure():
    for name, index in (("tiny-sana-video", build_tiny_sana_video.MODEL_INDEX),
                        ("tiny-sana-video-i2v", build_tiny_sana_video.I2V_MODEL_INDEX)):
        root = resolve_model(name)
        assert sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) < 2 * 2**20
        assert {k: v for k, v in read_model_index(name).items() if k != "_diffusers_version"} == index
        transformer = json.loads((root / "transformer" / "config.json").read_text())
        assert transformer["num_attention_heads"] == 3, "an odd head count"
        assert transformer["patch_size"] == [1, 2, 2], "the published patch"
