"""tools/convert_krea_realtime.py: a synthetic generator in Krea Realtime 14B's published layout (one flat safetensors,
`model.` + the original Wan names) converts into a causal checkpoint the causal-wan family loads and streams, and the
family's weights written back in the published layout are the file's, tensor for tensor; the 14B shape read off a
header alone is Wan 2.1 14B's, and the live KV budget a request takes scales with it."""

from __future__ import annotations

import json

import pytest
import torch

from tools import convert_krea_realtime as krea

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("krea")
    krea.write_synthetic(root / "src", layers=2, small=True)
    krea.write_synthetic_components(root / "base", small=True)
    return root, krea.convert(root / "src", root / "out", root / "base")


def test_a_synthetic_published_checkpoint_converts_into_the_familys_and_back(converted):
    from safetensors.torch import load_file

    from longserve.engine.families import detect_family

    root, out = converted
    family = detect_family(out)
    assert family.name == "causal-wan"
    desc = family.describe(out)
    assert desc.heads == 2 and desc.facts.layers == 2 and desc.capabilities.live_window == 6
    assert (out / krea.PUBLISHED_WEIGHTS).is_symlink(), "the published file is kept as it is"
    back = load_file(str(krea.to_published(out, root / "back.safetensors")))
    original = load_file(str(root / "src" / krea.PUBLISHED_WEIGHTS))
    assert sorted(back) == sorted(original) and any(k.startswith("model.blocks.1.self_attn.") for k in back)
    assert all(torch.equal(back[k], original[k]) for k in original)


def test_the_converted_checkpoint_streams_live_chunks(converted):
    from longserve.pipelines import VideoPipeline

    _, out = converted
    with VideoPipeline.from_pretrained(str(out), workers=1, device="cpu") as pipe:
        chunks = list(pipe.stream("a cat", num_frames=17, width=32, height=32))
    assert sum(len(c) for c in chunks) == 17 and len(chunks) >= 2


def _config_only(path, transformer):
    """A causal checkpoint's JSON alone (what `describe` and the KV budget read)."""
    from tools.weights.wan import WAN_2_1_VAE

    for sub, config in (("transformer", transformer), ("vae", WAN_2_1_VAE)):
        (path / sub).mkdir(parents=True)
        (path / sub / "config.json").write_text(json.dumps(config))
    (path / "causal_config.json").write_text(json.dumps({"weights": "x.safetensors", **krea.KREA_CAUSAL}))
    return path


def test_the_14b_shape_read_off_a_header_is_wan_2_1_14b_and_its_kv_budget_scales_with_it(tmp_path):
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    from longserve.engine.config import EngineConfig
    from longserve.engine.families.causal_wan import CausalWanFamily
    from longserve.engine.request import GenerationSpec
    from longserve.weights.causal_wan import to_upstream
    from tools.weights.wan import WAN_2_1_T2V_1_3B_TRANSFORMER, WAN_2_1_T2V_14B_TRANSFORMER

    with init_empty_weights():
        meta = WanTransformer3DModel(**WAN_2_1_T2V_14B_TRANSFORMER).state_dict()
    config = krea.transformer_config({k: tuple(v.shape) for k, v in to_upstream(meta).items()})
    assert {k: config[k] for k in WAN_2_1_T2V_14B_TRANSFORMER} == WAN_2_1_T2V_14B_TRANSFORMER
    spec = GenerationSpec(request_id="k", prompt=["a"], negative_prompt="", num_frames=33, height=480, width=832,
                          num_inference_steps=4, guidance_scale=1.0, seed=0)
    engine = EngineConfig.from_options(model="x", workers=2, device="cpu")
    kv = {name: CausalWanFamily.kv_bytes(CausalWanFamily.describe(_config_only(tmp_path / name, t)), spec, engine)
          for name, t in (("14b", config), ("1.3b", WAN_2_1_T2V_1_3B_TRANSFORMER))}
    # K and V of every layer, for the window's tokens and the prompt's: layers x width
    assert kv["14b"] / kv["1.3b"] == pytest.approx((40 * 5120) / (30 * 1536), rel=1e-6)
