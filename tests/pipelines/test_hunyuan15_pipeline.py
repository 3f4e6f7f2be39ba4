"""HunyuanVideo-1.5 (tiny-hunyuan15, a `HunyuanVideo15Pipeline` checkpoint, and tiny-hunyuan15-i2v, its
`HunyuanVideo15ImageToVideoPipeline` sibling): 1 worker equals diffusers' pipelines, 2 and 3 workers equal 1 under
each of the family's plans (and CFG-parallel) on token counts no worker count divides, two requests batched equal
their runs alone, and what the family refuses is refused naming the field."""

import numpy as np
import pytest
import torch

from longserve.engine.outputs import FramesChunk, StepProgress
from longserve.engine.request import RequestError
from longserve.pipelines import VideoPipeline
from longserve.weights import resolve_model

ATOL = 1e-4            # against diffusers (issue 33)
ATOL_WORKERS = 1e-5    # N workers against 1, fp32
PROMPT, NEGATIVE = 'a red ball with a sign that says "hi"', "blurry"      # a quoted glyph: ByT5 encodes it
# 80x112 pixels -> 5x7 latents (patch 1): 35 tokens a frame, 2 latent frames
CASE = dict(height=80, width=112, num_frames=5, num_inference_steps=2, guidance_scale=6.0)
# 80x80, 17 frames -> 5 latent frames of 25 tokens: 125 tokens, a multiple of none of 2, 3, 4; 3 heads
ODD = dict(height=80, width=80, num_frames=17, num_inference_steps=2, guidance_scale=6.0, output_type="latent")


@pytest.fixture(scope="module")
def pipe1():
    """One worker, its attention through diffusers' dispatcher (`_native_math`, a backend other than the default):
    what is compared with diffusers and with N workers (the default backend) below."""
    with VideoPipeline.from_pretrained("tiny-hunyuan15", workers=1, device="cpu", attention_backend="_native_math") \
            as p:
        assert p.info.attention_backend == "_native_math"
        yield p


@pytest.fixture(scope="module")
def want_latents(pipe1):
    return pipe1(PROMPT, negative_prompt=NEGATIVE, seed=0, **ODD).frames


def image(seed=0, size=(130, 90)):
    import PIL.Image

    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def assert_close(got, want, atol):
    err = float(np.abs(np.asarray(got) - np.asarray(want)).max())
    assert err <= atol, f"differs by {err:.2e}"


def test_one_worker_matches_diffusers_hunyuan_video15(pipe1):
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(str(resolve_model("tiny-hunyuan15")))
    pipe.set_progress_bar_config(disable=True)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=CASE["guidance_scale"])   # diffusers' guidance is a component
    kw = {k: v for k, v in CASE.items() if k != "guidance_scale"}
    want = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, generator=torch.Generator("cpu").manual_seed(0),
                output_type="np", **kw).frames
    got = pipe1(PROMPT, negative_prompt=NEGATIVE, seed=0, **CASE).frames
    assert got.shape == want.shape == (1, 5, 80, 112, 3)
    assert want.std() > 0.05, "the reference video should not be flat"
    assert_close(got, want, ATOL)


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_n_workers_match_one_worker_under_each_plan_and_cfg_parallel(want_latents, workers):
    """Ulysses, Ring on 3 (the condition keys an extra block of the ring, the condition rows split over it) and,
    with CFG-parallel, Ulysses per half; on 4, USP (Ulysses 2 x Ring 2) and Ring per CFG half. Ring on 2 workers
    is checked against diffusers' forward by the transformer bench's test (tests/server/bench/
    test_bench_transformer.py)."""
    plans = {2: [("ulysses", None, False), ("ulysses", None, True)],
             3: [("ulysses", None, False), ("ring", None, False)],
             4: [("usp", 2, False), ("ring", None, True)]}[workers]
    with VideoPipeline.from_pretrained("tiny-hunyuan15", workers=workers, device="cpu") as pipe:
        for parallel, degree, cfg_parallel in plans:
            pipe.engine.set_plan(parallel, degree, cfg_parallel=cfg_parallel)
            got = pipe(PROMPT, negative_prompt=NEGATIVE, seed=0, **ODD).frames
            assert got.shape == want_latents.shape == (1, 4, 5, 5, 5)
            assert_close(got, want_latents, ATOL_WORKERS)


def test_two_requests_batched_each_equal_their_run_alone(pipe1):
    kw = dict(ODD, height=48, width=80)           # 75 tokens
    cases = ((PROMPT, 3), ("a blue square", 4))
    alone = [pipe1(p, negative_prompt=NEGATIVE, seed=s, **kw).frames for p, s in cases]
    outs = [list(h) for h in [pipe1.engine.submit(pipe1.make_spec(p, NEGATIVE, seed=s, **kw)) for p, s in cases]]
    assert max(o.batch_size for out in outs for o in out if isinstance(o, StepProgress)) == 2
    for out, ref in zip(outs, alone):
        latents = [o.frames for o in out if isinstance(o, FramesChunk)]
        assert_close(latents[0], ref, ATOL_WORKERS)
    assert np.abs(alone[0] - alone[1]).max() > 0.01


def test_image_to_video_matches_diffusers_at_one_and_two_workers():
    """diffusers picks the size (the bucket of target_size nearest the image's aspect): the request asks for it.
    (A video that ignored the image would differ from diffusers', which reads it: the comparison can fail.)"""
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15ImageToVideoPipeline

    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(str(resolve_model("tiny-hunyuan15-i2v")))
    pipe.set_progress_bar_config(disable=True)
    pipe.guider = ClassifierFreeGuidance(guidance_scale=CASE["guidance_scale"])
    img = image()
    height, width = pipe.video_processor.calculate_default_height_width(img.height, img.width, pipe.target_size)
    want = pipe(image=img, prompt=PROMPT, negative_prompt=NEGATIVE, num_frames=5, num_inference_steps=2,
                generator=torch.Generator("cpu").manual_seed(0), output_type="np").frames
    assert want.shape == (1, 5, 80, 112, 3) and want.std() > 0.05
    kw = dict(CASE, height=height, width=width, image=img)
    with VideoPipeline.from_pretrained("tiny-hunyuan15-i2v", workers=1, device="cpu") as p1:
        assert p1.info.description.capabilities.image == "required"
        assert_close(p1(PROMPT, negative_prompt=NEGATIVE, seed=0, **kw).frames, want, ATOL)
        with pytest.raises(RequestError) as e:
            p1(PROMPT, seed=0, **CASE)
        assert e.value.field == "image"
    with VideoPipeline.from_pretrained("tiny-hunyuan15-i2v", workers=2, device="cpu") as p2:   # Ulysses over 2
        assert_close(p2(PROMPT, negative_prompt=NEGATIVE, seed=0, **kw).frames, want, ATOL)


@pytest.mark.parametrize("options, field", [
    (dict(image=image()), "image"),
    (dict(height=72), "height"),
    (dict(num_frames=8), "num_frames"),
    (dict(sigmas=[0.9, 0.5]), "sigmas"),
])
def test_bad_hunyuan15_options_are_refused_naming_the_field(pipe1, options, field):
    with pytest.raises(RequestError) as e:
        pipe1(PROMPT, seed=0, **{**CASE, **options})
    assert e.value.field == field
    if field == "image":
        assert "HunyuanVideo15ImageToVideoPipeline" in str(e.value)


def test_auto_is_ulysses_at_any_worker_count_and_unknown_plans_are_refused_naming_the_field():
    from longserve.engine.families.hunyuan15.family import FAMILY as Hunyuan15Family

    desc = Hunyuan15Family.describe(resolve_model("tiny-hunyuan15"))
    assert desc.heads == 3
    for workers in (1, 2, 3, 4, 8):                   # more workers than heads too: the heads are padded
        assert Hunyuan15Family.resolve_plan(desc, "auto", workers).name == "ulysses"
    with pytest.raises(ValueError, match="parallel"):
        VideoPipeline.from_pretrained("tiny-hunyuan15", workers=2, device="cpu", parallel="dsp")
