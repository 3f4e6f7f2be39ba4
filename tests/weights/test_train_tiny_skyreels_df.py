"""`python -m tools.weights.train_tiny_skyreels_df` (issues 23, 45): a short run (both stages) writes a
`SkyReelsV2DiffusionForcingPipeline` directory with its record, and two runs with the same seed give
byte-identical weights; the diffusion-forcing noise patterns give the sampler's situations (a clean prefix, one
shared level, per-frame levels)."""

import json

import torch

from longserve.weights import TINY_MODELS
from tools.weights.prompts import PROMPTS
from tools.weights.train_tiny_skyreels_df import GENERATION_DEFAULTS, OVERLAP, WINDOW, noise_levels, train
from tools.weights.writing import file_digests


def test_short_training_runs_are_seeded_and_write_a_pipeline_with_its_record(tmp_path):
    short = dict(steps=2, stage1_steps=2, clips_per_prompt=1, threads=1, clip_frames=WINDOW, prompts=PROMPTS[:2],
                 log=lambda *_: None)
    records = [train(tmp_path / name, **short) for name in ("a", "b")]
    a, b = file_digests(tmp_path / "a"), file_digests(tmp_path / "b")
    assert a == b and "transformer/diffusion_pytorch_model.safetensors" in a
    assert records[0]["files"] == a and records[0]["seed"] == 0 and records[0]["threads"] == 1
    assert records[0]["stage1"]["from"] == "scratch" and records[0]["stage1"]["steps"] == 2
    # stage 2 alone from a given stage 1 (issue 45's run: from issue 23's weights), its digest recorded
    again = train(tmp_path / "c", init_from=tmp_path / "a", **short)
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert again["stage1"]["transformer_sha256"] == a[weights] and again["stage1"]["is_issue_23_run"] is False
    assert file_digests(tmp_path / "c")[weights] != a[weights]
    shipped = file_digests(TINY_MODELS["tiny-skyreels-df"])
    for rel in a:
        if rel.startswith(("text_encoder/", "tokenizer/", "vae/")):       # copied as they are
            assert a[rel] == shipped[rel], rel
    index = json.loads((tmp_path / "a" / "model_index.json").read_text())
    assert index["_class_name"] == "SkyReelsV2DiffusionForcingPipeline"
    assert json.loads((tmp_path / "a" / "generation_defaults.json").read_text()) == GENERATION_DEFAULTS


def test_noise_levels_give_clean_prefixes_shared_levels_and_per_frame_levels():
    sigma, target = noise_levels(400, WINDOW, torch.Generator().manual_seed(0))
    prefix = (~target).sum(dim=1)                                                  # (B,) given frames
    assert ((prefix == OVERLAP).float().mean() > 0.2) and (prefix == 0).float().mean() > 0.3
    assert (sigma[~target] <= 0.06).all() and (sigma[~target] == 0).float().mean() > 0.6
    made = [sigma[b, target[b]] for b in range(400)]
    shared = sum(bool((m == m[0]).all()) for m in made)
    assert 0.5 < shared / 400 < 0.9                                                # the rest: per-frame levels
