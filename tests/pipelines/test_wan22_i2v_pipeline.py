"""Wan 2.2 and SkyReels-V2 image-to-video through VideoPipeline, each against its diffusers pipeline at 1 worker
and N workers against 1:

- Wan 2.2 TI2V-5B (tiny-wan22-ti2v, `expand_timesteps`): without an image it equals `WanPipeline`, with one
  `WanImageToVideoPipeline` (loaded from the same checkpoint); on 2 workers, under Ulysses, Ring and CFG-parallel,
  a request with an image and one without share every step and each equals its 1-worker result, on 27 tokens
  (3 latent frames of 3x3 patches: the first frame's tokens, timestep 0, split across the ranks) and 3 heads;
- Wan 2.2 I2V A14B (tiny-wan22-i2v-a14b): two experts switched inside two steps (t = 999 then 750 against the
  boundary 900), guidance_scale_2 on the second; with a first and a last image too; 3 workers on 20 tokens;
- SkyReels-V2 I2V (tiny-skyreels-i2v, CLIP image encoder): `SkyReelsV2ImageToVideoPipeline`; 2 workers.
"""

import functools

import numpy as np
import PIL.Image
import pytest
import torch

from longserve.engine.outputs import FramesChunk, StepProgress
from longserve.engine.request import RequestError
from longserve.pipelines import VideoPipeline
from longserve.weights import resolve_model

ATOL = 1e-4
PROMPT, NEGATIVE = "a red ball bouncing", "blurry, low quality"


def picture(width: int, height: int, seed: int) -> PIL.Image.Image:
    """A smooth colour field with a bright square (sizes that match no video's: diffusers stretches it)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    pixels = np.stack([x, y, 0.5 + 0.5 * np.sin(9 * x * y + rng.uniform(0, 6))], axis=-1)
    top, left = rng.integers(0, height // 2), rng.integers(0, width // 2)
    pixels[top:top + height // 3, left:left + width // 3] = rng.uniform(0.6, 1.0, 3)
    return PIL.Image.fromarray((pixels * 255).round().astype(np.uint8))


IMAGE, LAST = picture(70, 52, 0), picture(40, 61, 1)
# TI2V: 9 frames -> 3 latent frames of 6x6 -> 3x3 patches: 27 tokens, odd (14 + 13 on 2 ranks)
TI2V = dict(num_frames=9, height=96, width=96, num_inference_steps=2)


@functools.cache
def diffusers_pipeline(cls_name: str, model: str):
    import diffusers

    pipe = getattr(diffusers, cls_name).from_pretrained(str(resolve_model(model)))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_frames(cls_name: str, model: str, seed: int, **kw):
    return diffusers_pipeline(cls_name, model)(prompt=PROMPT, negative_prompt=NEGATIVE, output_type="np",
                                               generator=torch.Generator("cpu").manual_seed(seed), **kw).frames


def run(pipe, **kw):
    return pipe(PROMPT, negative_prompt=NEGATIVE, **kw).frames


# -- Wan 2.2 TI2V-5B ------------------------------------------------------------------------------------


def test_ti2v_one_worker_matches_wanpipeline_without_an_image_and_the_i2v_pipeline_with_one(pipeline):
    pipe = pipeline("tiny-wan22-ti2v", workers=1)
    assert pipe.info.family == "wan-ti2v" and pipe.defaults.fps == 24
    kw = dict(TI2V, guidance_scale=5.0, seed=0)
    want_t2v = diffusers_frames("WanPipeline", "tiny-wan22-ti2v", **kw)
    want_i2v = diffusers_frames("WanImageToVideoPipeline", "tiny-wan22-ti2v", image=IMAGE, **kw)
    assert want_t2v.shape == want_i2v.shape == (1, 9, 96, 96, 3) and want_t2v.std() > 0.01
    assert np.abs(run(pipe, **kw) - want_t2v).max() <= ATOL
    assert np.abs(run(pipe, image=IMAGE, **kw) - want_i2v).max() <= ATOL
    assert np.abs(want_i2v - want_t2v).max() > 1e-2, "the image conditions the video"
    with pytest.raises(RequestError, match="last_image") as e:        # diffusers would ignore it
        run(pipe, image=IMAGE, last_image=LAST, **kw)
    assert e.value.field == "last_image"


def test_ti2v_two_workers_batch_requests_with_and_without_an_image_and_each_equals_one_worker(pipeline):
    requests = [dict(prompt=PROMPT, negative_prompt=NEGATIVE, seed=4, guidance_scale=5.0, image=IMAGE, **TI2V),
                dict(prompt="waves", negative_prompt="", seed=5, guidance_scale=3.0, **TI2V)]
    alone = [pipeline("tiny-wan22-ti2v", workers=1)(**r).frames for r in requests]
    with VideoPipeline.from_pretrained("tiny-wan22-ti2v", workers=2, device="cpu", max_steps_per_job=1) as pipe:
        for parallel, cfg in (("ulysses", False), ("ring", False), ("ulysses", True)):
            pipe.engine.set_plan(parallel, None, cfg_parallel=cfg)
            outs = [list(h) for h in [pipe.engine.submit(pipe.make_spec(**r)) for r in requests]]
            assert max(o.batch_size for o in outs[0] if isinstance(o, StepProgress)) == 2, "the two shared a step"
            for out, want in zip(outs, alone):
                got = np.concatenate([o.frames for o in out if isinstance(o, FramesChunk)], axis=1)
                err = np.abs(got - want).max()
                assert err <= ATOL, f"{parallel} (cfg_parallel={cfg}): {err:.2e}"


# -- Wan 2.2 I2V A14B ------------------------------------------------------------------------------------


def test_a14b_i2v_switches_experts_within_two_steps_and_matches_diffusers(pipeline):
    from diffusers import UniPCMultistepScheduler

    root = resolve_model("tiny-wan22-i2v-a14b")
    scheduler = UniPCMultistepScheduler.from_pretrained(str(root), subfolder="scheduler")
    scheduler.set_timesteps(2)
    assert scheduler.timesteps[0] >= 0.9 * 1000 > scheduler.timesteps[1], "high-noise expert, then low-noise"
    pipe = pipeline("tiny-wan22-i2v-a14b", workers=1)
    assert pipe.info.capabilities.two_experts and not pipe.info.facts.image_encoder
    kw = dict(num_frames=9, height=48, width=64, num_inference_steps=2, guidance_scale=5.0, guidance_scale_2=2.0,
              seed=1)
    for images in (dict(image=IMAGE, last_image=LAST), dict(image=IMAGE)):
        want = diffusers_frames("WanImageToVideoPipeline", "tiny-wan22-i2v-a14b", **images, **kw)
        assert want.std() > 0.01
        assert np.abs(run(pipe, **images, **kw) - want).max() <= ATOL, images.keys()
    # guidance_scale_2 reaches the low-noise expert's step
    assert np.abs(run(pipe, image=IMAGE, **dict(kw, guidance_scale_2=5.0)) - want).max() > 1e-3


def test_a14b_i2v_three_workers_match_one_worker(pipeline):
    # 5 frames -> 2 latent frames of 2x5 patches: 20 tokens (7 + 7 + 6 on 3 ranks), 3 heads
    kw = dict(num_frames=5, height=32, width=80, num_inference_steps=2, guidance_scale=5.0, guidance_scale_2=2.0,
              seed=2, image=IMAGE)
    want = run(pipeline("tiny-wan22-i2v-a14b", workers=1), **kw)
    with VideoPipeline.from_pretrained("tiny-wan22-i2v-a14b", workers=3, device="cpu") as pipe:
        for parallel in ("ulysses", "ring"):
            pipe.engine.set_plan(parallel, None, cfg_parallel=False)
            err = np.abs(run(pipe, **kw) - want).max()
            assert err <= ATOL, f"{parallel}: {err:.2e}"


# -- SkyReels-V2 I2V --------------------------------------------------------------------------------------


def test_skyreels_i2v_matches_diffusers_and_two_workers_match_one(pipeline):
    one = pipeline("tiny-skyreels-i2v", workers=1)
    assert one.info.family == "wan-i2v" and one.info.facts.image_encoder and one.defaults.fps == 24
    kw = dict(num_frames=9, height=48, width=64, num_inference_steps=2, guidance_scale=5.0, seed=3)
    want = diffusers_frames("SkyReelsV2ImageToVideoPipeline", "tiny-skyreels-i2v", image=IMAGE, **kw)
    assert want.std() > 0.01
    assert np.abs(run(one, image=IMAGE, **kw) - want).max() <= ATOL
    # 13 frames -> 4 latent frames of 3x5 patches (odd: neither 2 nor the 3 heads divide the grid)
    odd = dict(kw, num_frames=13, height=48, width=80)
    want = run(one, image=IMAGE, **odd)
    with VideoPipeline.from_pretrained("tiny-skyreels-i2v", workers=2, device="cpu") as pipe:
        for parallel, cfg in (("ring", False), ("ulysses", True)):
            pipe.engine.set_plan(parallel, None, cfg_parallel=cfg)
            err = np.abs(run(pipe, image=IMAGE, **odd) - want).max()
            assert err <= ATOL, f"{parallel} (cfg_parallel={cfg}): {err:.2e}"
