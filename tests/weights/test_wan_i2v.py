"""The shipped image-to-video checkpoints (tiny-wan-i2v, tiny-wan-flf2v): rebuilt byte for byte by their script,
small, in the published layout, and what they condition on (one image, or a first and a last)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from weights import TINY_MODELS, build_tiny_wan_i2v, read_model_index, resolve_model
from weights import wan as published

VERSION_STAMPS = ("_diffusers_version", "transformers_version")

pytestmark = pytest.mark.usefixtures("one_thread")


def _digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _without_stamps(path: Path) -> dict:
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in VERSION_STAMPS}


@pytest.mark.parametrize("kind", build_tiny_wan_i2v.KINDS)
def test_the_build_equals_the_committed_checkpoint_byte_for_byte(tmp_path, kind):
    built = build_tiny_wan_i2v.build(kind, tmp_path / kind)
    shipped = build_tiny_wan_i2v.DEFAULT_OUT[kind]
    got, committed = _digests(built), _digests(shipped)
    assert sorted(got) == sorted(committed) and len(got) == 15
    for rel in got:
        if rel.endswith(".json"):  # library version stamps may differ; the content may not
            assert _without_stamps(built / rel) == _without_stamps(shipped / rel), rel
        else:
            assert got[rel] == committed[rel], f"{rel} differs from the committed file; rebuild and commit"


def test_the_checkpoints_are_small_in_the_published_layout_and_say_what_they_condition_on():
    for name, pos in (("tiny-wan-i2v", None), ("tiny-wan-flf2v", 34)):
        root = resolve_model(name)
        files = [p for p in root.rglob("*") if p.is_file()]
        assert sum(p.stat().st_size for p in files) < 2 * 2**20
        assert _without_stamps(root / "model_index.json") == published.WAN_2_1_I2V_MODEL_INDEX
        transformer = json.loads((root / "transformer" / "config.json").read_text())
        assert (transformer["in_channels"], transformer["image_dim"], transformer["pos_embed_seq_len"]) == (20, 32, pos)
        assert transformer["num_attention_heads"] == 3, "an odd head count, as tiny-wan's"
    assert "tiny-wan-i2v" in TINY_MODELS and read_model_index("tiny-wan-flf2v")["_class_name"] == \
        "WanImageToVideoPipeline"
