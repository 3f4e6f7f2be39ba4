"""The shipped image-to-video checkpoints (tiny-wan-i2v, tiny-wan-flf2v, tiny-wan22-ti2v, tiny-wan22-i2v-a14b,
tiny-skyreels-i2v): rebuilt byte for byte by their script, small, in the published layout, and what they condition
on (one image, or a first and a last; Wan 2.2 TI2V's first latent frame; A14B's two experts)."""

from __future__ import annotations

import json

import pytest

from longserve.weights import TINY_MODELS, read_model_index, resolve_model
from tests.support.checkpoints import assert_rebuilt, digests, without_stamps
from tools.weights import build_tiny_wan_i2v
from tools.weights import wan as published

pytestmark = pytest.mark.usefixtures("one_thread")




# per checkpoint: the Wan 2.1 ones 15 (CLIP encoder and processor), TI2V 12 (none), A14B 14 (a second expert)
FILES = {"i2v": 15, "flf2v": 15, "wan22-ti2v": 12, "wan22-i2v-a14b": 14, "skyreels-i2v": 15}


@pytest.mark.parametrize("kind", build_tiny_wan_i2v.KINDS)
def test_the_build_equals_the_committed_checkpoint_byte_for_byte(tmp_path, kind):
    """Byte for byte on the CPU kernels the checkpoint was built with, within float rounding on others
    (tests/support/checkpoints.py says why)."""
    built = build_tiny_wan_i2v.build(kind, tmp_path / kind)
    assert len(digests(built)) == FILES[kind]
    assert_rebuilt(built, build_tiny_wan_i2v.DEFAULT_OUT[kind])


def test_the_checkpoints_are_small_in_the_published_layout_and_say_what_they_condition_on():
    for name, pos in (("tiny-wan-i2v", None), ("tiny-wan-flf2v", 34)):
        root = resolve_model(name)
        files = [p for p in root.rglob("*") if p.is_file()]
        assert sum(p.stat().st_size for p in files) < 2 * 2**20
        assert without_stamps(root / "model_index.json") == published.WAN_2_1_I2V_MODEL_INDEX
        transformer = json.loads((root / "transformer" / "config.json").read_text())
        assert (transformer["in_channels"], transformer["image_dim"], transformer["pos_embed_seq_len"]) == (20, 32, pos)
        assert transformer["num_attention_heads"] == 3, "an odd head count, as tiny-wan's"
    assert "tiny-wan-i2v" in TINY_MODELS and read_model_index("tiny-wan-flf2v")["_class_name"] == \
        "WanImageToVideoPipeline"


def test_the_wan22_and_skyreels_checkpoints_have_the_published_structure():
    for name in ("tiny-wan22-ti2v", "tiny-wan22-i2v-a14b", "tiny-skyreels-i2v"):
        assert sum(p.stat().st_size for p in resolve_model(name).rglob("*") if p.is_file()) < 2 * 2**20, name
    ti2v = resolve_model("tiny-wan22-ti2v")
    assert without_stamps(ti2v / "model_index.json") == published.WAN_2_2_TI2V_5B_MODEL_INDEX
    vae = json.loads((ti2v / "vae" / "config.json").read_text())
    real = published.WAN_2_2_VAE
    for key in ("is_residual", "patch_size", "in_channels", "out_channels", "scale_factor_spatial",
                "scale_factor_temporal", "dim_mult", "temperal_downsample"):
        assert vae[key] == real[key], key
    assert vae["decoder_base_dim"] > vae["base_dim"] and vae["latents_mean"] == real["latents_mean"][:vae["z_dim"]]
    transformer = json.loads((ti2v / "transformer" / "config.json").read_text())
    assert transformer["in_channels"] == transformer["out_channels"] == vae["z_dim"]
    assert json.loads((ti2v / "scheduler" / "scheduler_config.json").read_text())["flow_shift"] == 5.0

    a14b = resolve_model("tiny-wan22-i2v-a14b")
    assert without_stamps(a14b / "model_index.json") == published.WAN_2_2_I2V_A14B_MODEL_INDEX
    experts = [json.loads((a14b / e / "config.json").read_text()) for e in ("transformer", "transformer_2")]
    assert experts[0] == experts[1] and (experts[0]["in_channels"], experts[0]["image_dim"]) == (20, None)
    assert (a14b / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() != \
        (a14b / "transformer_2" / "diffusion_pytorch_model.safetensors").read_bytes()

    sky = resolve_model("tiny-skyreels-i2v")
    index = without_stamps(sky / "model_index.json")
    assert index == {**published.SKYREELS_V2_I2V_MODEL_INDEX, "image_processor": ["transformers", "CLIPImageProcessor"]}
    transformer = json.loads((sky / "transformer" / "config.json").read_text())
    assert transformer["_class_name"] == "SkyReelsV2Transformer3DModel" and transformer["in_channels"] == 20
