"""Samplers that add noise at every step (DDPM, Euler ancestral) draw it from the request's generator, as
diffusers' pipelines do: 1 worker gives diffusers' frames, N workers give 1 worker's (every rank draws the
same noise, so the ranks stay in lockstep)."""

import json
import shutil

import numpy as np
import pytest
import torch

from longserve.pipelines import VideoPipeline
from longserve.weights import resolve_model

PROMPT = "a red ball bouncing"
KW = dict(num_frames=16, height=32, width=48, num_inference_steps=3, guidance_scale=4.5)  # LattePipeline: 16 frames


def with_scheduler(tmp_path, name: str):
    """tiny-latte with its DDIM scheduler swapped for `name` (same betas, epsilon prediction)."""
    path = tmp_path / f"tiny-latte-{name}"
    shutil.copytree(resolve_model("tiny-latte"), path)
    cfg_path = path / "scheduler" / "scheduler_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["_class_name"] = name
    cfg_path.write_text(json.dumps(cfg))
    index = json.loads((path / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", name]
    (path / "model_index.json").write_text(json.dumps(index))
    return path


@pytest.mark.parametrize("sampler", ["DDPMScheduler", "EulerAncestralDiscreteScheduler"])
def test_noisy_samplers_match_diffusers_at_one_worker_and_one_worker_at_two(tmp_path, sampler):
    from diffusers import LattePipeline

    path = with_scheduler(tmp_path, sampler)
    ref = LattePipeline.from_pretrained(str(path))
    ref.set_progress_bar_config(disable=True)
    assert type(ref.scheduler).__name__ == sampler
    want = ref(prompt=PROMPT, video_length=KW["num_frames"], height=KW["height"], width=KW["width"],
               num_inference_steps=KW["num_inference_steps"], guidance_scale=KW["guidance_scale"],
               generator=torch.Generator("cpu").manual_seed(7), output_type="np", clean_caption=False).frames
    with VideoPipeline.from_pretrained(str(path), workers=1, device="cpu") as pipe:
        one = pipe(PROMPT, seed=7, **KW).frames
        other_seed = pipe(PROMPT, seed=8, **KW).frames
    assert np.abs(one - want).max() <= 1e-4
    assert np.abs(other_seed - one).max() > 1e-2, "the per-step noise depends on the seed"
    with VideoPipeline.from_pretrained(str(path), workers=2, device="cpu") as pipe:
        assert np.abs(pipe(PROMPT, seed=7, **KW).frames - one).max() <= 1e-4
