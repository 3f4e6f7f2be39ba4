"""The shipped tiny-helios checkpoint: rebuilt byte for byte by its script, small, a `HeliosPipeline` directory
naming the published components, with Helios' own structure (multi-term memory patches, guidance
cross-attention, history key amplification) at toy sizes."""

from __future__ import annotations

import json

import pytest

from longserve.weights import read_model_index, resolve_model
from tests.support.checkpoints import assert_rebuilt, digests
from tools.weights import build_tiny_helios

pytestmark = pytest.mark.usefixtures("one_thread")




@pytest.mark.parametrize("kind", sorted(build_tiny_helios.WRITERS))
def test_the_build_equals_the_committed_checkpoint_byte_for_byte(tmp_path, kind):
    """Byte for byte on the CPU kernels the checkpoint was built with, within float rounding on others
    (tests/support/checkpoints.py says why)."""
    name = build_tiny_helios.WRITERS[kind][0]
    built = build_tiny_helios.build(kind, tmp_path / name)
    assert len(digests(built)) == 12
    assert_rebuilt(built, resolve_model(name))


def test_the_checkpoint_is_small_and_has_the_published_structure():
    root = resolve_model("tiny-helios")
    assert sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) < 2 * 2**20
    index = read_model_index("tiny-helios")
    assert {k: v for k, v in index.items() if k != "_diffusers_version"} == build_tiny_helios.HELIOS_MODEL_INDEX
    transformer = json.loads((root / "transformer" / "config.json").read_text())
    assert transformer["num_attention_heads"] == 3, "an odd head count"
    assert transformer["has_multi_term_memory_patch"] and transformer["guidance_cross_attn"]
    assert transformer["zero_history_timestep"] and transformer["is_amplify_history"]
    scheduler = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
    assert (scheduler["_class_name"], scheduler["stages"], scheduler["scheduler_type"]) == ("HeliosScheduler", 1,
                                                                                            "unipc")
