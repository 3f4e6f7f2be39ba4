"""The shipped tiny-hunyuan15 and tiny-hunyuan15-i2v checkpoints: rebuilt byte for byte by their script, small in
git, `HunyuanVideo15Pipeline` / `HunyuanVideo15ImageToVideoPipeline` directories naming the published components,
with odd head counts."""

from __future__ import annotations

import json
import zlib

import pytest

from longserve.weights import read_model_index, resolve_model
from tests.support.checkpoints import assert_rebuilt
from tools.weights import build_tiny_hunyuan15

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", sorted(build_tiny_hunyuan15.WRITERS))
def test_the_build_equals_the_committed_checkpoint_byte_for_byte(tmp_path, kind):
    """Byte for byte on the CPU kernels the checkpoint was built with, within float rounding on others
    (tests/support/checkpoints.py says why)."""
    name = build_tiny_hunyuan15.WRITERS[kind][0]
    assert_rebuilt(build_tiny_hunyuan15.build(kind, tmp_path / name), resolve_model(name))


def test_the_checkpoints_are_small_in_git_and_have_the_published_structure():
    for name, index in (("tiny-hunyuan15", build_tiny_hunyuan15.MODEL_INDEX),
                        ("tiny-hunyuan15-i2v", build_tiny_hunyuan15.I2V_MODEL_INDEX)):
        root = resolve_model(name)
        # diffusers fixes the ByT5 projection at 2048 wide (17 MB of float32): drawn as signs, git's zlib packs it
        packed = sum(len(zlib.compress(p.read_bytes(), 1)) for p in root.rglob("*") if p.is_file())
        assert packed < 3 * 2**20, packed
        assert {k: v for k, v in read_model_index(name).items() if k != "_diffusers_version"} == index
        transformer = json.loads((root / "transformer" / "config.json").read_text())
        assert transformer["num_attention_heads"] == 3, "an odd head count"
        assert transformer["task_type"] == ("i2v" if name.endswith("i2v") else "t2v")
