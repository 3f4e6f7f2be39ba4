"""`python -m tools.weights.train_tiny_i2v` (issue 36, Build 5): a short run writes a `WanImageToVideoPipeline`
directory with its record, and two runs with the same seed give byte-identical weights; the starting transformer
is tiny-skyreels-df's (the same prediction whatever the new condition inputs hold), and the training's compressed
cross-attention equals diffusers' on the 512 text rows."""

import json

import torch

from longserve.weights import TINY_MODELS
from tools.weights.prompts import PROMPTS
from tools.weights.train_tiny_i2v import (
    GENERATION_DEFAULTS,
    INIT_FROM,
    TEXT_FROM,
    flow_prediction,
    install_cross_attention,
    new_transformer,
    train,
)
from tools.weights.train_tiny_live import compress_text, encode_prompts, load_text
from tools.weights.writing import file_digests


def test_short_training_runs_are_seeded_and_write_a_pipeline_with_its_record(tmp_path):
    records = [train(tmp_path / name, steps=2, clips_per_prompt=1, threads=1, prompts=PROMPTS[:2],
                     log=lambda *_: None) for name in ("a", "b")]
    a, b = file_digests(tmp_path / "a"), file_digests(tmp_path / "b")
    assert a == b and "transformer/diffusion_pytorch_model.safetensors" in a
    assert records[0]["files"] == a and records[0]["seed"] == 0 and records[0]["windows"] == 2
    for part, source in (("text_encoder/", "tiny-wan"), ("vae/", "tiny-live"), ("image_encoder/", "tiny-wan-i2v")):
        shipped = file_digests(TINY_MODELS[source])
        copied = [rel for rel in a if rel.startswith(part)]
        assert copied and all(a[rel] == shipped[rel] for rel in copied), part
    index = json.loads((tmp_path / "a" / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline" and index["image_encoder"] == ["transformers",
                                                                                             "CLIPVisionModel"]
    assert json.loads((tmp_path / "a" / "generation_defaults.json").read_text()) == GENERATION_DEFAULTS


@torch.no_grad()
def test_the_start_is_tiny_skyreels_df_and_the_compressed_text_is_exact():
    from diffusers import SkyReelsV2Transformer3DModel

    g = torch.Generator().manual_seed(0)
    model = new_transformer(2).eval()
    source = SkyReelsV2Transformer3DModel.from_pretrained(INIT_FROM / "transformer").eval()
    x, condition = torch.randn(2, 4, 3, 8, 8, generator=g), torch.randn(2, 5, 3, 8, 8, generator=g)
    text, image = torch.randn(2, 512, 32, generator=g), torch.randn(2, 17, 32, generator=g)
    t = torch.tensor([300.0, 800.0])
    want = source(x, timestep=t, encoder_hidden_states=text, fps=[1], return_dict=False)[0]
    got = model(torch.cat([x, condition], 1), timestep=t, encoder_hidden_states=text,
                encoder_hidden_states_image=image, return_dict=False)[0]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()

    for block in model.blocks:                                      # a trained model's image values are not zero
        block.attn2.add_v_proj.weight.normal_(generator=g)
    embeds = encode_prompts(*load_text(TEXT_FROM), ["a red ball moving right", ""])
    full = torch.stack(list(embeds.values()))                       # (2, 512, 32): the pipeline's rows
    want = model(torch.cat([x, condition], 1), timestep=t, encoder_hidden_states=full,
                 encoder_hidden_states_image=image, return_dict=False)[0]
    compressed, bias = compress_text(embeds)
    layout = install_cross_attention(model)
    got = flow_prediction(model, layout, x, condition, t / 1000, torch.tensor([0, 1]), compressed, bias, image)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
