"""The shipped tiny LoRA adapters (tiny-wan-lora in diffusers' format, tiny-wan-lora-musubi in kohya / musubi
tuner's): rebuilt byte for byte by their script, small, and read by diffusers' own loader into the same kind of
state dict, whatever the format."""

from __future__ import annotations

import pytest

from longserve.weights import TINY_LORAS, resolve_lora
from tests.support.checkpoints import assert_same_file
from tools.weights import build_tiny_lora

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_build_equals_the_committed_adapters_byte_for_byte(tmp_path):
    """Byte for byte on the CPU kernels the adapters were built with, within float rounding on others
    (tests/support/checkpoints.py says why)."""
    built = {"tiny-wan-lora": build_tiny_lora.build("diffusers", tmp_path / "d") / "pytorch_lora_weights.safetensors",
             "tiny-wan-lora-musubi": build_tiny_lora.build("musubi", tmp_path / "m.safetensors")}
    for name, path in built.items():
        assert_same_file(path, resolve_lora(name))
        assert path.stat().st_size < 64 << 10 and TINY_LORAS[name].is_file()


def test_both_formats_load_through_diffusers_into_transformer_lora_keys():
    from diffusers import WanPipeline

    diffusers_format = WanPipeline.lora_state_dict(str(resolve_lora("tiny-wan-lora")))
    musubi = WanPipeline.lora_state_dict(str(resolve_lora("tiny-wan-lora-musubi")))
    assert "transformer.proj_out.lora_A.weight" in diffusers_format
    assert all(k.startswith("transformer.blocks.") for k in musubi) and len(musubi) == 2 * 10 * 2
    assert musubi["transformer.blocks.1.ffn.net.0.proj.lora_B.weight"].shape == (64, 4)
