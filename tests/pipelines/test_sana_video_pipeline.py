"""SANA-Video (tiny-sana-video, a `SanaVideoPipeline` checkpoint, and tiny-sana-video-i2v, its
`SanaImageToVideoPipeline` sibling): 1 worker equals diffusers' pipelines, 2 and 3 workers equal 1 (the linear
attention's state all-reduced, the temporal conv's neighbour frames exchanged) on frame and head counts no worker
count divides, CFG-parallel too, and what the family refuses is refused naming the field."""

import numpy as np
import pytest
import torch

from longserve.engine.request import RequestError
from longserve.pipelines import VideoPipeline
from longserve.weights import resolve_model

ATOL = 1e-4            # against diffusers
ATOL_WORKERS = 1e-5    # N workers against 1, fp32
PROMPT, NEGATIVE = "a red ball bouncing", "blurry"
# 96x128 pixels -> 12x16 latents -> 6x8 tokens a frame (patch 2x2), 3 latent frames; 3 heads
CASE = dict(height=96, width=128, num_frames=9, num_inference_steps=2, guidance_scale=6.0)
# 96x96, 17 frames -> 5 latent frames of 36 tokens: 5 frames divide by neither 2 nor 3 (the last rank of 3 holds
# one real frame of its two)
ODD = dict(height=96, width=96, num_frames=17, num_inference_steps=2, guidance_scale=6.0, output_type="latent")


def image(seed=0, size=(130, 90)):
    import PIL.Image

    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def assert_close(got, want, atol, scaled=False):
    """Within `atol`; `scaled`: within `atol` of the reference's scale (its largest magnitude, at least 1)."""
    got, want = np.asarray(got), np.asarray(want)
    err = float(np.abs(got - want).max())
    assert err <= atol * (max(1.0, float(np.abs(want).max())) if scaled else 1.0), f"differs by {err:.2e}"


def diffusers_video(name, **kw):
    from diffusers import SanaImageToVideoPipeline, SanaVideoPipeline

    cls = SanaImageToVideoPipeline if name.endswith("i2v") else SanaVideoPipeline
    pipe = cls.from_pretrained(str(resolve_model(name)))
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=CASE["height"], width=CASE["width"],
                frames=CASE["num_frames"], num_inference_steps=CASE["num_inference_steps"],
                guidance_scale=CASE["guidance_scale"], generator=torch.Generator("cpu").manual_seed(0),
                output_type="np", use_resolution_binning=False, **kw).frames


@pytest.fixture(scope="module")
def pipe1():
    with VideoPipeline.from_pretrained("tiny-sana-video", workers=1, device="cpu") as p:
        yield p


@pytest.fixture(scope="module")
def want_latents(pipe1):
    return np.asarray(pipe1(PROMPT, negative_prompt=NEGATIVE, seed=0, **ODD).frames)


def test_one_worker_matches_diffusers_sana_video(pipe1):
    want = diffusers_video("tiny-sana-video")
    got = pipe1(PROMPT, negative_prompt=NEGATIVE, seed=0, **CASE).frames
    assert got.shape == want.shape == (1, 9, 96, 128, 3)
    assert want.std() > 0.05, "the reference video should not be flat"
    assert_close(got, want, ATOL)


@pytest.mark.parametrize("workers", [2, 3])
def test_n_workers_match_one_worker_on_frames_no_worker_count_divides(want_latents, workers):
    """The linear attention's sums all-reduced and the temporal conv's edge frames exchanged: a rank that summed
    its own tokens only, or convolved without its neighbours' frames, would differ by far more than 1e-5."""
    with VideoPipeline.from_pretrained("tiny-sana-video", workers=workers, device="cpu") as pipe:
        assert pipe.parallel == "tokens"
        got = pipe(PROMPT, negative_prompt=NEGATIVE, seed=0, **ODD).frames
        assert got.shape == want_latents.shape == (1, 8, 5, 12, 12)
        assert_close(got, want_latents, ATOL_WORKERS)
        if workers == 2:
            pipe.engine.set_plan("tokens", None, cfg_parallel=True)
            assert_close(pipe(PROMPT, negative_prompt=NEGATIVE, seed=0, **ODD).frames, want_latents, ATOL_WORKERS)


def test_image_to_video_matches_diffusers_at_one_and_two_workers():
    """(A video that ignored the image would differ from diffusers', which reads it: the comparison can fail.)"""
    img = image()
    want = diffusers_video("tiny-sana-video-i2v", image=img)
    assert want.shape == (1, 9, 96, 128, 3) and want.std() > 0.05
    with VideoPipeline.from_pretrained("tiny-sana-video-i2v", workers=1, device="cpu") as p1:
        assert p1.info.description.capabilities.image == "required"
        assert_close(p1(PROMPT, negative_prompt=NEGATIVE, seed=0, image=img, **CASE).frames, want, ATOL)
        with pytest.raises(RequestError) as e:
            p1(PROMPT, seed=0, **CASE)
        assert e.value.field == "image"
    with VideoPipeline.from_pretrained("tiny-sana-video-i2v", workers=2, device="cpu") as p2:
        assert_close(p2(PROMPT, negative_prompt=NEGATIVE, seed=0, image=img, **CASE).frames, want, ATOL)


@pytest.mark.parametrize("options, field", [
    (dict(image=image()), "image"),
    (dict(height=80), "height"),
    (dict(num_frames=8), "num_frames"),
])
def test_bad_sana_video_options_are_refused_naming_the_field(pipe1, options, field):
    with pytest.raises(RequestError) as e:
        pipe1(PROMPT, seed=0, **{**CASE, **options})
    assert e.value.field == field
    if field == "image":
        assert "SanaImageToVideoPipeline" in str(e.value)


def test_auto_is_the_token_plan_and_other_plans_are_refused_naming_the_field():
    from longserve.engine.families.sana_video import SanaVideoFamily

    desc = SanaVideoFamily.describe(resolve_model("tiny-sana-video"))
    assert desc.heads == 3 and desc.size_multiple == 32 and desc.frame_multiple == 4
    for workers in (1, 2, 3, 8):
        assert SanaVideoFamily.resolve_plan(desc, "auto", workers).name == "tokens"
    with pytest.raises(ValueError, match="parallel"):
        SanaVideoFamily.resolve_plan(desc, "ulysses", 2)


def test_two_requests_batched_each_equal_their_run_alone(pipe1):
    from longserve.engine.outputs import FramesChunk, StepProgress

    cases = ((PROMPT, 3), ("a blue square moving left, slowly", 4))
    alone = [pipe1(p, negative_prompt=NEGATIVE, seed=s, **ODD).frames for p, s in cases]
    outs = [list(h) for h in [pipe1.engine.submit(pipe1.make_spec(p, NEGATIVE, seed=s, **ODD)) for p, s in cases]]
    assert max(o.batch_size for out in outs for o in out if isinstance(o, StepProgress)) == 2
    for out, ref in zip(outs, alone):
        # fp32 rounding at the latents' scale (about 10): a batch of 2 blocks the matmuls differently (1.3e-5 on an
        # AVX2-only EPYC, under 1e-5 with AVX-512)
        assert_close([o.frames for o in out if isinstance(o, FramesChunk)][0], ref, ATOL_WORKERS, scaled=True)
    assert np.abs(np.asarray(alone[0]) - np.asarray(alone[1])).max() > 0.01
