"""The shipped tiny-ltx2 checkpoint: rebuilt byte for byte by its script, small, an `LTX2Pipeline` directory naming
the published components (sound included: the audio VAE and the vocoder), with odd head counts."""

from __future__ import annotations

import json
import os

import pytest

from longserve.weights import read_model_index, resolve_model
from tests.support.checkpoints import assert_rebuilt, digests
from tools.weights import build_tiny_ltx2

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_build_equals_the_committed_checkpoint_byte_for_byte(tmp_path):
    """Byte for byte on the CPU kernels the checkpoint was built with, within float rounding on others
    (tests/support/checkpoints.py says why)."""
    built = build_tiny_ltx2.build(tmp_path / "tiny-ltx2")
    assert len(digests(built)) == 18
    assert_rebuilt(built, resolve_model("tiny-ltx2"))


def test_the_image_to_video_directory_is_rebuilt_as_links_to_the_text_to_video_components(tmp_path):
    (tmp_path / "tiny-ltx2").symlink_to(resolve_model("tiny-ltx2"), target_is_directory=True)
    built = build_tiny_ltx2.build(tmp_path / "tiny-ltx2-i2v", kind="i2v")
    shipped = resolve_model("tiny-ltx2-i2v")
    assert {p.name: os.readlink(p) if p.is_symlink() else p.read_text() for p in sorted(built.iterdir())} == \
           {p.name: os.readlink(p) if p.is_symlink() else p.read_text() for p in sorted(shipped.iterdir())}
    assert read_model_index("tiny-ltx2-i2v")["_class_name"] == "LTX2ImageToVideoPipeline"


def test_the_upsampler_directory_is_rebuilt_byte_for_byte_beside_links(tmp_path):
    (tmp_path / "tiny-ltx2").symlink_to(resolve_model("tiny-ltx2"), target_is_directory=True)
    built = build_tiny_ltx2.build(tmp_path / "tiny-ltx2-upsample", kind="upsample")
    shipped = resolve_model("tiny-ltx2-upsample")
    assert sorted(p.name for p in built.iterdir()) == sorted(p.name for p in shipped.iterdir())
    assert all(os.readlink(built / n) == os.readlink(shipped / n) for n in build_tiny_ltx2.I2V_LINKED)
    assert_rebuilt(built / "latent_upsampler", shipped / "latent_upsampler")


def test_the_checkpoint_is_small_and_has_the_published_structure():
    root = resolve_model("tiny-ltx2")
    assert sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) < 3 * 2**20
    index = read_model_index("tiny-ltx2")
    assert {k: v for k, v in index.items() if not k.startswith("_")} == build_tiny_ltx2.MODEL_INDEX
    transformer = json.loads((root / "transformer" / "config.json").read_text())
    assert transformer["num_attention_heads"] == transformer["audio_num_attention_heads"] == 3, "odd head counts"
    assert transformer["audio_in_channels"] == (build_tiny_ltx2.AUDIO_LATENT_CHANNELS * build_tiny_ltx2.MEL_BINS // 4)
