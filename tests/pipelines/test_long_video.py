"""Long video by diffusion forcing (tiny-skyreels-df): 1 worker equals diffusers'
`SkyReelsV2DiffusionForcingPipeline` over several segments, synchronous and asynchronous; 2 and 3
workers equal 1; `stream()` hands out each segment's frames while later segments denoise."""

import dataclasses

import numpy as np
import pytest
import torch

from longserve.engine.request import RequestError
from longserve.pipelines import VideoPipeline
from longserve.weights import resolve_model

ATOL = 1e-4


def assert_equal_over_segments(got, want) -> None:
    """got, want: frames (B, T, H, W, 3) or latents (B, C, T, h, w), every segment's."""
    err = float(abs(got - want).max())
    assert err <= ATOL, f"differs by {err:.2e}"


PROMPT, NEGATIVE = "a red ball bouncing", "blurry"
# 80x112 pixels -> a 5x7 patch grid (35 patches per latent frame: divisible by none of 2, 3, 4). Guidance 2.0 is the
# trained checkpoint's own: a later segment is conditioned on the earlier ones, so the rounding differences of an
# equal computation done differently (CFG rows batched, attention split over workers) are carried along the video,
# and guidance multiplies them at every step. At guidance 6, measured: the first segment within 5.7e-5, the whole
# video within 2.2e-3; at 2.0 the whole video within 3.4e-5 (a wrong prefix or schedule differs by tenths).
SIZE = dict(height=80, width=112, num_inference_steps=2, guidance_scale=2.0)
# tiny-skyreels-df's VAE does not compress time: one latent frame is one frame
# 10 frames in 4 segments of <= 5, each after the first conditioned on 3 frames
SYNC = dict(num_frames=10, base_num_frames=5, overlap_history=3, ar_step=0, causal_block_size=1, **SIZE)
# 19 frames in 3 segments of 9 = 3 causal blocks of 3 (the prefix of 4 cut to 3); later blocks lag 2 steps
ASYNC = dict(num_frames=19, base_num_frames=9, overlap_history=4, ar_step=2, causal_block_size=3, **SIZE)


def diffusers_frames(case: dict) -> dict:
    """diffusers rounds num_frames to 4k+1 with k the VAE's temporal factor; with a factor of 1 that adds one
    frame to any count (num_frames % 1 is never 1), so it is asked for one frame fewer to make the same video."""
    return dict(case, num_frames=case["num_frames"] - 1)


@pytest.fixture(scope="module")
def pipe1():
    with VideoPipeline.from_pretrained("tiny-skyreels-df", workers=1, device="cpu") as p:
        yield p


@pytest.fixture(scope="module")
def diffusers_pipe():
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    pipe = SkyReelsV2DiffusionForcingPipeline.from_pretrained(str(resolve_model("tiny-skyreels-df")))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def async_reference(pipe1):
    return pipe1(PROMPT, negative_prompt=NEGATIVE, seed=0, **ASYNC).frames


@pytest.mark.parametrize("case", [SYNC, ASYNC], ids=["synchronous", "asynchronous"])
def test_one_worker_matches_diffusers_diffusion_forcing_over_several_segments(pipe1, diffusers_pipe, case,
                                                                              async_reference):
    want = diffusers_pipe(prompt=PROMPT, negative_prompt=NEGATIVE, generator=torch.Generator("cpu").manual_seed(0),
                          output_type="np", **diffusers_frames(case)).frames
    got = async_reference if case is ASYNC else pipe1(PROMPT, negative_prompt=NEGATIVE, seed=0, **case).frames
    assert got.shape == want.shape == (1, case["num_frames"], 80, 112, 3)
    # a grey frame with nothing on it: std < 0.01; the trained model's ball on it at these sizes: 0.04-0.06
    assert want.std() > 0.03, "the reference video should not be flat"
    assert_equal_over_segments(got, want)


@pytest.mark.parametrize("workers, parallel", [(2, "ulysses"), (3, "ring")])
def test_n_workers_match_one_worker_with_ulysses_and_ring(async_reference, workers, parallel):
    """2 workers on Ulysses split the 3 heads unevenly; 3 on Ring split the tokens unevenly."""
    with VideoPipeline.from_pretrained("tiny-skyreels-df", workers=workers, parallel=parallel, device="cpu") as pipe:
        got = pipe(PROMPT, negative_prompt=NEGATIVE, seed=0, **ASYNC).frames
    err = np.abs(got - async_reference).max()
    assert err <= ATOL, f"{parallel} on {workers} workers differs by {err:.2e}"


def test_stream_hands_out_segments_while_later_segments_denoise_and_concatenates_to_the_call(pipe1):
    steps_seen, chunk_at_step = [], []
    chunks = []
    for chunk in pipe1.stream(PROMPT, negative_prompt=NEGATIVE, seed=0, callback=lambda s, n: steps_seen.append((s, n)),
                              **SYNC):
        chunks.append(chunk)
        chunk_at_step.append(len(steps_seen))
    total = steps_seen[-1][1]
    assert steps_seen == [(i, total) for i in range(1, total + 1)], "the callback counts every step of every segment"
    per_segment = SYNC["num_inference_steps"]          # synchronous: every segment takes the same steps
    assert total == 4 * per_segment
    last_segment_start = total - per_segment
    assert len(chunks) == 4, "one chunk per segment"
    assert chunk_at_step[0] <= per_segment < last_segment_start, \
        "the first segment's frames come out before the last segment's first step"
    assert [c.shape[0] for c in chunks] == [5, 2, 2, 1]
    assert all(c.dtype == np.float32 and c.shape[1:] == (80, 112, 3) for c in chunks)
    whole = pipe1(PROMPT, negative_prompt=NEGATIVE, seed=0, **SYNC).frames[0]
    assert np.abs(np.concatenate(chunks) - whole).max() == 0


def test_addnoise_condition_draws_the_same_noise_on_every_worker(pipe1):
    kw = dict(SYNC, addnoise_condition=20)
    one = pipe1(PROMPT, seed=5, **kw).frames
    plain = pipe1(PROMPT, seed=5, **SYNC).frames
    assert np.abs(one - plain).max() > 1e-3, "the conditioning noise changes the later segments"
    with VideoPipeline.from_pretrained("tiny-skyreels-df", workers=2, device="cpu") as pipe:
        assert_equal_over_segments(pipe(PROMPT, seed=5, **kw).frames, one)


def test_latent_output_is_every_final_latent_frame(pipe1, diffusers_pipe):
    want = diffusers_pipe(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(1), output_type="latent",
                          **diffusers_frames(SYNC)).frames
    got = pipe1(PROMPT, seed=1, output_type="latent", **SYNC).frames
    assert got.shape == want.shape == (1, 4, 10, 10, 14)
    assert_equal_over_segments(got, want)


@pytest.mark.parametrize("kwargs, field", [
    (dict(overlap_history=5), "overlap_history"),           # not shorter than base_num_frames
    (dict(ar_step=-1), "ar_step"),
    (dict(base_num_frames=0), "base_num_frames"),
    (dict(causal_block_size=2), "causal_block_size"),       # segments of 5 and 4 latent frames
    (dict(addnoise_condition=-5), "addnoise_condition"),
    (dict(num_frames=0), "num_frames"),
])
def test_bad_diffusion_forcing_arguments_raise_naming_the_field(pipe1, kwargs, field):
    with pytest.raises(RequestError, match=field) as e:
        pipe1(PROMPT, seed=0, **{**SYNC, **kwargs})
    assert e.value.field == field


def test_a_long_video_without_overlap_history_is_refused_as_diffusers_refuses_it(pipe1):
    # diffusers' default overlap_history is None; tiny-skyreels-df's generation_defaults.json sets 9
    desc = pipe1.info.description
    desc = dataclasses.replace(desc, defaults=dataclasses.replace(
        desc.defaults, options={**desc.defaults.options, "overlap_history": None}))
    spec = pipe1.make_spec(PROMPT, seed=0, **SYNC)
    spec.options.pop("overlap_history", None)
    with pytest.raises(RequestError, match="overlap_history") as e:
        pipe1.engine.family.check_request(desc, spec)
    assert e.value.field == "overlap_history"
