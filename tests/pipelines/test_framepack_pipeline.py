"""FramePack (tiny-framepack, a `HunyuanVideoFramepackPipeline` checkpoint): 1 worker equals diffusers' pipeline
under both samplings (vanilla streamed section by section, inverted anti-drifting with a last frame), 2 and 3 workers
equal 1 on a packed sequence no worker count divides, per-worker memory is flat in the length, and what the family
refuses is refused naming the field."""

import numpy as np
import pytest
import torch

from longserve.engine import worker
from longserve.engine.outputs import FramesChunk, StepProgress
from longserve.engine.request import RequestError
from longserve.pipelines import VideoPipeline
from longserve.weights import resolve_model

ATOL = 1e-4            # against diffusers
ATOL_WORKERS = 1e-5    # N workers against 1, fp32
PROMPT = "a red ball bouncing"
# 32x32 pixels, windows of 2 latent frames (5 frames): 9 frames are 2 sections, 17 frames made
CASE = dict(height=32, width=32, num_frames=9, latent_window_size=2, num_inference_steps=2, guidance_scale=10.0)
# 48x80 -> 6x10 latents: a section packs 3x15 latent tokens, 2x15 clean ones, 6 at 2x and 8 at 4x: 89 tokens, which
# no worker count divides; 3 heads
ODD = dict(height=48, width=80, num_frames=17, latent_window_size=3, num_inference_steps=2, guidance_scale=10.0,
           output_type="latent")


def image(seed=0, size=(70, 50)):
    import PIL.Image

    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def assert_close(got, want, atol):
    err = float(np.abs(np.asarray(got) - np.asarray(want)).max())
    assert err <= atol, f"differs by {err:.2e}"


@pytest.fixture(scope="module")
def pipe1():
    with VideoPipeline.from_pretrained("tiny-framepack", workers=1, device="cpu") as p:
        yield p


@pytest.fixture(scope="module")
def diffusers_pipe():
    from diffusers import HunyuanVideoFramepackPipeline

    pipe = HunyuanVideoFramepackPipeline.from_pretrained(str(resolve_model("tiny-framepack")))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_video(pipe, sampling, **extra):
    kw = {k: v for k, v in CASE.items()}
    return pipe(image=image(), prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(0), output_type="np",
                sampling_type=sampling, **kw, **extra).frames


def test_vanilla_sampling_streams_each_section_as_it_is_final_and_equals_diffusers(pipe1, diffusers_pipe):
    """A section's frames (less the tail the next section's decode blends into) arrive while the next section
    denoises; their concatenation is diffusers' video."""
    want = diffusers_video(diffusers_pipe, "vanilla")
    events = []
    for out in pipe1.engine.submit(pipe1.make_spec(PROMPT, image=image(), seed=0, sampling_type="vanilla", **CASE)):
        if isinstance(out, StepProgress):
            events.append(("step", out.step))
        elif isinstance(out, FramesChunk):
            events.append(("frames", out.frames))
    chunks = [f[0] for kind, f in events if kind == "frames"]
    assert [len(c) for c in chunks] == [4, 13], "the first section's final frames, then the rest"
    first = next(i for i, e in enumerate(events) if e[0] == "frames")
    assert any(e[0] == "step" for e in events[first:]), "the first frames came before the second section was done"
    got = np.concatenate(chunks)[None]
    assert got.shape == want.shape == (1, 17, 32, 32, 3) and want.std() > 0.05
    assert_close(got, want, ATOL)


def test_inverted_sampling_with_a_last_frame_equals_diffusers(pipe1, diffusers_pipe):
    want = diffusers_video(diffusers_pipe, "inverted_anti_drifting", last_image=image(1))
    got = pipe1(PROMPT, image=image(), last_image=image(1), seed=0, **CASE).frames
    assert got.shape == want.shape == (1, 17, 32, 32, 3)
    assert_close(got, want, ATOL)
    assert np.abs(got - pipe1(PROMPT, image=image(), seed=0, **CASE).frames).max() > 0.01, "the last frame counts"


@pytest.mark.parametrize("workers", [2, 3])
def test_n_workers_match_one_worker_on_a_packed_sequence_no_worker_count_divides(pipe1, workers):
    want = {s: pipe1(PROMPT, image=image(), seed=0, sampling_type=s, **ODD).frames
            for s in ("vanilla", "inverted_anti_drifting")}
    with VideoPipeline.from_pretrained("tiny-framepack", workers=workers, device="cpu") as pipe:
        assert pipe.parallel == "ulysses"
        for sampling, plan in (("vanilla", "ulysses"), ("inverted_anti_drifting", "ring")):
            pipe.set_parallel(plan)
            got = pipe(PROMPT, image=image(), seed=0, sampling_type=sampling, **ODD).frames
            assert got.shape == want[sampling].shape == (1, 4, 7, 6, 10)
            assert_close(got, want[sampling], ATOL_WORKERS)


def test_per_worker_memory_is_flat_in_the_length():
    """Peak tensor memory per worker (engine/memory.py) at 4x the sections is at most 1.1x: a worker keeps the 19
    history frames, the section before and (rank 0) the blended tail's pixels, never the video."""
    kw = dict(CASE, num_inference_steps=1, sampling_type="vanilla")
    peaks = {}
    with VideoPipeline.from_pretrained("tiny-framepack", workers=2, device="cpu") as p:
        for sections in (2, 8):
            p.pool.run(worker.memory_start)
            frames = p(PROMPT, image=image(), seed=0, **dict(kw, num_frames=5 * sections)).frames
            peaks[sections] = p.pool.run(worker.memory_stop)
            assert frames.shape[1] == 1 + 8 * sections
    assert all(0 < b <= 1.1 * a for a, b in zip(peaks[2], peaks[8])), peaks


@pytest.mark.parametrize("options, field", [
    (dict(image=None), "image"),
    (dict(sampling_type="vanilla", last_image=image(1)), "last_image"),
    (dict(sampling_type="forward"), "sampling_type"),
    (dict(latent_window_size=0), "latent_window_size"),
    (dict(height=40), "height"),
])
def test_bad_framepack_options_are_refused_naming_the_field(pipe1, options, field):
    with pytest.raises(RequestError) as e:
        pipe1(PROMPT, seed=0, **{**CASE, "image": image(), **options})
    assert e.value.field == field


def test_cfg_parallel_is_refused_for_a_guidance_distilled_model():
    from longserve.engine.families.framepack import FramepackFamily

    desc = FramepackFamily.describe(resolve_model("tiny-framepack"))
    assert FramepackFamily.resolve_plan(desc, "auto", 3).name == "ulysses"
    with pytest.raises(ValueError, match="cfg_parallel"):
        FramepackFamily.resolve_plan(desc, "auto", 2, cfg_parallel=True)


def test_two_requests_batched_each_equal_their_run_alone(pipe1):
    """Two prompts' sections in one forward (the model's masked path for a batch over 1, where a lone row takes the
    unmasked one) give each request its video alone."""
    kw = dict(ODD, sampling_type="vanilla", image=image())
    cases = ((PROMPT, 3), ("a blue square moving left, slowly", 4))
    alone = [pipe1(p, seed=s, **kw).frames for p, s in cases]
    outs = [list(h) for h in [pipe1.engine.submit(pipe1.make_spec(p, seed=s, **kw)) for p, s in cases]]
    assert max(o.batch_size for out in outs for o in out if isinstance(o, StepProgress)) == 2
    for out, ref in zip(outs, alone):
        assert_close([o.frames for o in out if isinstance(o, FramesChunk)][0], ref, ATOL_WORKERS)
    assert np.abs(np.asarray(alone[0]) - np.asarray(alone[1])).max() > 0.01


def test_a_list_of_prompts_makes_a_video_each_from_the_one_image(pipe1):
    got = pipe1([PROMPT, "a blue square"], image=image(), seed=0, **ODD).frames
    assert got.shape == (2, 4, 7, 6, 10) and np.abs(np.asarray(got[0]) - np.asarray(got[1])).max() > 0.01
