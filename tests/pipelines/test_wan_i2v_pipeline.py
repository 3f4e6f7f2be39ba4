"""Image-to-video with `WanImageToVideoPipeline` checkpoints through VideoPipeline: 1 worker equals diffusers'
pipeline for the same image, prompt and seed (Wan 2.1 I2V with its CLIP image encoder; FLF2V with `last_image`);
2 and 3 workers equal 1 worker (Ulysses, Ring, CFG-parallel) on a latent frame count, a patch grid and a head
count (3) that neither divides; two I2V requests with different images share denoising steps and each gets
what it gets alone; bad images are refused naming the argument."""

import contextlib

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
# 13 frames -> 4 latent frames; 48x80 pixels -> a 3x5 patch grid: neither divides by 2 or 3 (3 heads neither)
ODD = dict(num_frames=13, height=48, width=80, num_inference_steps=3, guidance_scale=5.0, seed=3)


def picture(width: int, height: int, seed: int) -> PIL.Image.Image:
    """A smooth colour field with a bright square: an image whose resize and crop show in the result."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    phase = rng.uniform(0, 6)
    pixels = np.stack([x, y, 0.5 + 0.5 * np.sin(9 * x * y + phase)], axis=-1)
    top, left = rng.integers(0, height // 2), rng.integers(0, width // 2)
    pixels[top:top + height // 3, left:left + width // 3] = rng.uniform(0.6, 1.0, 3)
    return PIL.Image.fromarray((pixels * 255).round().astype(np.uint8))


# sizes that match neither the video's nor each other's aspect: the pipeline stretches (VAE) and crops (CLIP)
IMAGE, LAST, OTHER = picture(70, 52, 0), picture(40, 61, 1), picture(96, 40, 2)


@pytest.fixture(scope="module")
def i2v1():
    with VideoPipeline.from_pretrained("tiny-wan-i2v", workers=1, device="cpu") as p:
        yield p


@pytest.fixture(scope="module")
def flf1():
    with VideoPipeline.from_pretrained("tiny-wan-flf2v", workers=1, device="cpu") as p:
        yield p


@pytest.fixture(scope="module")
def i2v2():
    """Two workers, one step per worker job (so a second request joins the first's batch at once)."""
    with VideoPipeline.from_pretrained("tiny-wan-i2v", workers=2, device="cpu", max_steps_per_job=1) as p:
        yield p


def diffusers_frames(name: str, **kw):
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(str(resolve_model(name)))
    pipe.set_progress_bar_config(disable=True)
    seed = kw.pop("seed")
    return pipe(prompt=PROMPT, negative_prompt=NEGATIVE, generator=torch.Generator("cpu").manual_seed(seed),
                output_type="np", **kw).frames


def test_one_worker_matches_diffusers_wan_i2v(i2v1):
    kw = dict(num_frames=9, height=48, width=64, num_inference_steps=3, guidance_scale=5.0, seed=0)
    want = diffusers_frames("tiny-wan-i2v", image=IMAGE, **kw)
    got = i2v1(PROMPT, negative_prompt=NEGATIVE, image=IMAGE, **kw)
    assert got.frames.shape == want.shape == (1, 9, 48, 64, 3)
    assert want.std() > 0.01, "the reference video should not be flat"
    assert np.abs(got.frames - want).max() <= ATOL
    assert i2v1.info.family == "wan-i2v" and i2v1.info.facts.image_encoder
    other = i2v1(PROMPT, negative_prompt=NEGATIVE, image=OTHER, **kw).frames
    assert np.abs(other - want).max() > 1e-2, "the image conditions the video"


def test_one_worker_matches_diffusers_flf2v_with_last_image_given_as_arrays(flf1):
    kw = dict(num_frames=9, height=48, width=64, num_inference_steps=3, guidance_scale=5.0, seed=1)
    want = diffusers_frames("tiny-wan-flf2v", image=IMAGE, last_image=LAST, **kw)
    # the same images as an (H, W, 3) uint8 array and a float array in [0, 1]
    got = flf1(PROMPT, negative_prompt=NEGATIVE, image=np.asarray(IMAGE),
               last_image=np.asarray(LAST).astype(np.float32) / 255, **kw)
    assert np.abs(got.frames - want).max() <= ATOL
    other = flf1(PROMPT, negative_prompt=NEGATIVE, image=IMAGE, last_image=OTHER, **kw).frames
    assert np.abs(other - want).max() > 1e-2, "the last image conditions the video"


@pytest.mark.parametrize("model, workers, plans", [
    ("tiny-wan-i2v", 2, [("ulysses", False), ("ring", False), ("ulysses", True)]),
    ("tiny-wan-i2v", 3, [("ulysses", False), ("ring", False)]),
    ("tiny-wan-flf2v", 2, [("ring", False), ("ulysses", True)]),
])
def test_n_workers_match_one_worker(request, model, workers, plans):
    one = request.getfixturevalue("i2v1" if model == "tiny-wan-i2v" else "flf1")
    images = dict(image=IMAGE) if model == "tiny-wan-i2v" else dict(image=IMAGE, last_image=LAST)
    want = one(PROMPT, negative_prompt=NEGATIVE, **images, **ODD).frames
    assert want.shape == (1, 13, 48, 80, 3)
    shared = model == "tiny-wan-i2v" and workers == 2
    with contextlib.nullcontext(request.getfixturevalue("i2v2")) if shared else \
            VideoPipeline.from_pretrained(model, workers=workers, device="cpu") as pipe:
        for parallel, cfg in plans:
            pipe.engine.set_plan(parallel, None, cfg_parallel=cfg)
            got = pipe(PROMPT, negative_prompt=NEGATIVE, **images, **ODD).frames
            err = np.abs(got - want).max()
            assert err <= ATOL, f"{model} {parallel} (cfg_parallel={cfg}) on {workers} workers: {err:.2e}"
        pipe.engine.set_plan("auto", None, cfg_parallel=False)


def test_two_i2v_requests_share_steps_and_each_gets_its_frames_alone(i2v2):
    """Different images, prompts, seeds, step counts and guidance (one without CFG: half the rows) in one batch."""
    size = dict(num_frames=9, height=48, width=64)
    first = i2v2.make_spec(PROMPT, NEGATIVE, num_inference_steps=5, guidance_scale=5.0, seed=4, image=IMAGE, **size)
    second = i2v2.make_spec("waves", "", num_inference_steps=3, guidance_scale=1.0, seed=5, image=OTHER, **size)
    outs = [list(h) for h in [i2v2.engine.submit(s) for s in (first, second)]]
    assert max(o.batch_size for o in outs[0] if isinstance(o, StepProgress)) == 2, "the two shared a step"
    for spec, out in zip((first, second), outs):
        together = np.concatenate([o.frames for o in out if isinstance(o, FramesChunk)], axis=1)
        alone = i2v2(spec.prompt[0], negative_prompt=spec.negative_prompt, num_inference_steps=spec.num_inference_steps,
                     guidance_scale=spec.guidance_scale, seed=spec.seed, image=spec.options["image"], **size).frames
        assert np.abs(together - alone).max() <= ATOL


@pytest.mark.parametrize("model, kwargs, field", [
    ("tiny-wan-i2v", dict(), "image"),                                          # image-to-video needs an image
    ("tiny-wan-i2v", dict(image="cat.png"), "image"),                           # a path is not an image
    ("tiny-wan-i2v", dict(image=np.zeros((0, 4, 3), np.uint8)), "image"),       # empty
    ("tiny-wan-i2v", dict(image=np.full((8, 8, 3), 2.0)), "image"),             # floats beyond [0, 1]
    ("tiny-wan-i2v", dict(image=IMAGE, last_image=LAST), "last_image"),         # one-image checkpoint
    ("tiny-wan-flf2v", dict(image=IMAGE), "last_image"),                        # FLF2V needs both
    ("tiny-wan-flf2v", dict(image=IMAGE, last_image=np.zeros((4, 4, 2))), "last_image"),
])
def test_bad_images_raise_naming_the_argument(request, model, kwargs, field):
    pipe = request.getfixturevalue("i2v1" if model == "tiny-wan-i2v" else "flf1")
    with pytest.raises(RequestError, match=field) as e:
        pipe(PROMPT, num_frames=5, height=32, width=32, num_inference_steps=1, **kwargs)
    assert e.value.field == field


def test_a_text_to_video_model_refuses_an_image_naming_it(pipeline):
    pipe = pipeline("tiny-wan", workers=1)
    for name in ("image", "last_image"):
        with pytest.raises(ValueError, match=f"{name} is not supported") as e:
            pipe(PROMPT, num_frames=5, height=32, width=32, num_inference_steps=1, **{name: IMAGE})
        assert e.value.field == name
