"""LTX-2 (tiny-ltx2, an `LTX2Pipeline` checkpoint with sound): 1 worker equals diffusers' pipeline, video frames and
audio samples, with every guidance term (CFG, STG, modality isolation, rescale) and with the distilled schedule;
2 and 3 workers equal 1 under Ulysses, Ring and CFG-parallel; two requests batched equal their runs alone; bad
options are refused naming the field."""

import numpy as np
import pytest
import torch

from longserve.engine.outputs import FramesChunk, StepProgress
from longserve.engine.request import RequestError
from longserve.pipelines import VideoPipeline
from longserve.weights import resolve_model
from tests.support.sound import tracks

ATOL = 1e-4          # against diffusers (pixels and samples)
ATOL_WORKERS = 1e-5  # N workers against 1 (latents)
PROMPT, NEGATIVE = "a red ball bouncing", "blurry"
# 96x160 pixels, 17 frames -> 3 x 3 x 5 = 45 video tokens (divisible by neither 2 nor 4), 18 audio tokens at 24 fps;
# 3 video heads (divisible by neither 2 nor 4)
CASE = dict(height=96, width=160, num_frames=17, num_inference_steps=3, guidance_scale=3.0)
# every guidance term on: STG perturbs block 1 (of 2), modality isolation, rescale, an audio scale of its own
GUIDANCE = dict(stg_scale=1.0, audio_stg_scale=0.5, modality_scale=3.0, audio_modality_scale=2.0,
                spatio_temporal_guidance_blocks=[1], guidance_rescale=0.7, audio_guidance_scale=7.0,
                audio_guidance_rescale=0.5)
PLAIN = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0)


@pytest.fixture(scope="module")
def diffusers_pipe():
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(str(resolve_model("tiny-ltx2")))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(pipe, seed=0, **kw):
    return pipe(prompt=PROMPT, negative_prompt=NEGATIVE, frame_rate=24.0, output_type=kw.pop("output_type", "np"),
                generator=torch.Generator("cpu").manual_seed(seed), **kw)


@pytest.fixture(scope="module")
def pipe1():
    """One worker, its attention through diffusers' dispatcher (`_native_math`, a backend other than the default):
    what is compared with diffusers and with N workers (the default backend) below."""
    with VideoPipeline.from_pretrained("tiny-ltx2", workers=1, device="cpu", attention_backend="_native_math") as p:
        assert p.info.attention_backend == "_native_math"
        yield p


def run(pipe, prompt=PROMPT, seed=0, **kw):
    """(frames (B, T, H, W, 3) or latents, the sound (`FramesChunk.audio`)) of one request through the engine."""
    spec = pipe.make_spec(prompt, NEGATIVE, seed=seed, **kw)
    chunks = [o for o in pipe.engine.submit(spec) if isinstance(o, FramesChunk)]
    sounds = [c.audio for c in chunks if c.audio is not None]
    assert len(sounds) <= 1, "a sound is handed out once"
    return np.concatenate([c.frames for c in chunks], axis=1 if spec.output != "latent" else 2), \
        (sounds[0] if sounds else None)


def assert_close(got, want, atol=ATOL):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = float(np.abs(got - want).max())
    assert err <= atol, f"differs by {err:.2e}"


def test_one_worker_matches_diffusers_video_and_audio_with_every_guidance_term(pipe1, diffusers_pipe):
    want = reference(diffusers_pipe, **CASE, **GUIDANCE)
    frames, info = run(pipe1, **CASE, **GUIDANCE)
    assert frames.shape == (1, 17, 96, 160, 3)
    assert want.frames.std() > 0.05 and float(want.audio.std()) > 1e-3, "the reference should not be flat or silent"
    assert_close(frames, want.frames)
    assert info.rate == 24000 and not info.latent
    assert info.samples.shape == tuple(want.audio.shape) and info.samples.shape[1] == 2      # stereo
    assert_close(info.samples, want.audio.numpy())
    # the guidance terms matter: without STG and modality guidance the video differs
    assert np.abs(run(pipe1, **CASE, **PLAIN)[0] - frames).max() > 1e-3


def test_distilled_schedule_without_cfg_matches_diffusers(pipe1, diffusers_pipe):
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES

    want = reference(diffusers_pipe, height=96, width=160, num_frames=17, sigmas=DISTILLED_SIGMA_VALUES,
                     num_inference_steps=len(DISTILLED_SIGMA_VALUES), guidance_scale=1.0, audio_guidance_scale=1.0,
                     guidance_rescale=0.0, audio_guidance_rescale=0.0, **PLAIN)
    spec = pipe1.make_spec(PROMPT, NEGATIVE, seed=0, height=96, width=160, num_frames=17, distilled=True)
    assert (spec.num_inference_steps, spec.guidance_scale, spec.use_cfg) == (8, 1.0, False)
    # no CFG asked: none for the sound either, unless its own scale is given (then refused: the rows are shared)
    assert pipe1.make_spec(PROMPT, seed=0, **dict(CASE, guidance_scale=1.0)).options["audio_guidance_scale"] == 1.0
    frames, info = run(pipe1, height=96, width=160, num_frames=17, distilled=True)
    assert_close(frames, want.frames)
    assert_close(info.samples, want.audio.numpy())


def test_latent_output_is_diffusers_video_and_audio_latents(pipe1, diffusers_pipe):
    want = reference(diffusers_pipe, seed=1, output_type="latent", **CASE, **PLAIN)
    latents, info = run(pipe1, seed=1, output_type="latent", **CASE, **PLAIN)
    assert latents.shape == tuple(want.frames.shape) == (1, 8, 3, 3, 5)
    assert_close(latents, want.frames.numpy())
    assert info.latent
    assert_close(info.samples, want.audio.numpy())


@pytest.mark.parametrize("workers", [2, 3])
def test_n_workers_match_one_worker_under_each_plan(pipe1, workers):
    kw = dict(CASE, **GUIDANCE, output_type="latent")
    want, want_info = run(pipe1, **kw)
    with VideoPipeline.from_pretrained("tiny-ltx2", workers=workers, device="cpu") as pipe:
        plans = [("ulysses", False), ("ring", False), ("ulysses", True)] if workers == 2 else \
            [("ring", False), ("ulysses", False)]
        for parallel, cfg_parallel in plans:
            pipe.engine.set_plan(parallel, None, cfg_parallel=cfg_parallel)
            got, info = run(pipe, **kw)
            assert_close(got, want, ATOL_WORKERS)
            assert_close(info.samples, want_info.samples, ATOL_WORKERS)


def test_two_requests_batched_each_equal_their_run_alone(pipe1):
    kw = dict(CASE, **PLAIN, output_type="latent")
    alone = [run(pipe1, p, s, **kw) for p, s in ((PROMPT, 3), ("a blue square", 4))]
    specs = [pipe1.make_spec(p, NEGATIVE, seed=s, **kw) for p, s in ((PROMPT, 3), ("a blue square", 4))]
    outs = [list(h) for h in [pipe1.engine.submit(s) for s in specs]]
    assert max(o.batch_size for out in outs for o in out if isinstance(o, StepProgress)) == 2
    for (want, want_info), out in zip(alone, outs):
        chunks = [o for o in out if isinstance(o, FramesChunk)]
        assert_close(chunks[-1].frames, want, ATOL_WORKERS)
        assert chunks[-1].audio.latent
        assert_close(chunks[-1].audio.samples, want_info.samples, ATOL_WORKERS)


def test_audio_false_skips_the_sound(pipe1):
    frames, info = run(pipe1, audio=False, **CASE, **PLAIN)
    assert frames.shape == (1, 17, 96, 160, 3) and info is None


@pytest.mark.parametrize("options, field", [
    (dict(spatio_temporal_guidance_blocks="all"), "spatio_temporal_guidance_blocks"),
    (dict(spatio_temporal_guidance_blocks=[], stg_scale=1.0), "spatio_temporal_guidance_blocks"),
    (dict(guidance_scale=1.0, audio_guidance_scale=5.0), "audio_guidance_scale"),
    (dict(guidance_rescale=2.0), "guidance_rescale"),
    (dict(audio="yes"), "audio"),
    (dict(distilled=True, sigmas=[1.0, 0.5]), "sigmas"),
    (dict(sigmas=[0.5, 0.9]), "sigmas"),
    (dict(image="x.png"), "image"),
    (dict(height=100), "height"),
    (dict(num_frames=12), "num_frames"),
])
def test_bad_options_are_refused_naming_the_field(pipe1, options, field):
    with pytest.raises(RequestError) as e:
        pipe1.make_spec(PROMPT, NEGATIVE, seed=0, **{**CASE, **options})
    assert e.value.field == field


def test_python_save_writes_an_mp4_with_an_aac_track_as_long_as_the_sound(pipe1, tmp_path):
    out = pipe1(PROMPT, negative_prompt=NEGATIVE, seed=0, **CASE, **PLAIN)
    assert out.audio.shape[:2] == (1, 2) and out.audio_rate == 24000
    got = tracks(out.save(tmp_path / "ball.mp4", fps=24))
    assert got["video"] == (17, 160, 96)
    codec, channels, rate, seconds = got["audio"]
    assert (codec, channels, rate) == ("aac", 2, 24000)
    assert abs(seconds - out.audio.shape[2] / 24000) < 0.05, seconds
    quiet = pipe1(PROMPT, negative_prompt=NEGATIVE, seed=0, audio=False, **CASE, **PLAIN)
    assert quiet.audio is None and tracks(quiet.save(tmp_path / "quiet.mp4", fps=24))["audio"] is None


def test_the_cli_writes_the_sound(tmp_path, capfd):
    from longserve.server.cli import main

    out = tmp_path / "cli.mp4"
    assert main(["generate", PROMPT, "--model", "tiny-ltx2", "--workers", "1", "--device", "cpu", "--frames", "17",
                 "--size", "160x96", "--steps", "2", "--opt", "stg_scale=0", "--opt", "audio_stg_scale=0",
                 "--opt", "modality_scale=1", "--opt", "audio_modality_scale=1", "-o", str(out)]) == 0
    got = tracks(str(out))
    assert got["video"] == (17, 160, 96) and got["audio"][:3] == ("aac", 2, 24000)


def test_audio_of_a_model_without_sound_is_refused_naming_the_field():
    from longserve.engine.config import EngineConfig
    from longserve.engine.families import detect_family
    from longserve.engine.request import RequestInput, complete_request

    root = resolve_model("tiny-wan")
    family = detect_family(root)
    with pytest.raises(RequestError) as e:
        complete_request(RequestInput(prompt="x", options={"audio": True}), family, family.describe(root),
                         EngineConfig(model="tiny-wan"))
    assert e.value.field == "audio"


@pytest.fixture(scope="module")
def first_frame():
    import PIL.Image

    rng = np.random.default_rng(0)
    return PIL.Image.fromarray((rng.random((96, 160, 3)) * 255).astype(np.uint8))


def test_image_to_video_matches_diffusers_at_one_worker_and_two(first_frame):
    from diffusers import LTX2ImageToVideoPipeline

    ref = LTX2ImageToVideoPipeline.from_pretrained(str(resolve_model("tiny-ltx2-i2v")))
    ref.set_progress_bar_config(disable=True)
    want = reference(ref, image=first_frame, **CASE, **GUIDANCE)
    for workers in (1, 2):
        with VideoPipeline.from_pretrained("tiny-ltx2-i2v", workers=workers, device="cpu") as pipe:
            out = pipe(PROMPT, negative_prompt=NEGATIVE, seed=0, image=first_frame, **CASE, **GUIDANCE)
            assert_close(out.frames, want.frames)
            assert_close(out.audio, want.audio.numpy())
            with pytest.raises(RequestError) as e:                      # an image-to-video checkpoint needs one
                pipe.make_spec(PROMPT, NEGATIVE, seed=0, **CASE)
            assert e.value.field == "image"


def test_the_latent_upsamplers_second_stage_matches_diffusers_two_stage_recipe_on_two_workers():
    """`upsample=True` on a checkpoint that ships `latent_upsampler/`: the first stage at half the size, the
    upsampler, the distilled second stage at the full size, as diffusers' recipe chains LTX2Pipeline ->
    LTX2LatentUpsamplePipeline -> LTX2Pipeline (same seed for both stages)."""
    from diffusers import LTX2Pipeline
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplePipeline, LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES as STAGE_2

    root = resolve_model("tiny-ltx2-upsample")
    ref = LTX2Pipeline.from_pretrained(str(root))
    ref.set_progress_bar_config(disable=True)
    upsampler = LTX2LatentUpsamplePipeline(vae=ref.vae, latent_upsampler=LTX2LatentUpsamplerModel.from_pretrained(
        str(root / "latent_upsampler")))
    kw = dict(num_frames=17, **GUIDANCE)
    video, audio = reference(ref, height=64, width=96, num_inference_steps=3, guidance_scale=3.0,
                             output_type="latent", return_dict=False, **kw)
    video = upsampler(latents=video, height=64, width=96, num_frames=17, output_type="latent", return_dict=False)[0]
    want = reference(ref, height=128, width=192, latents=video, audio_latents=audio, sigmas=STAGE_2,
                     noise_scale=STAGE_2[0], num_inference_steps=len(STAGE_2), guidance_scale=1.0,
                     **dict(kw, audio_guidance_scale=1.0, **PLAIN))
    with VideoPipeline.from_pretrained("tiny-ltx2-upsample", workers=2, device="cpu") as pipe:
        out = pipe(PROMPT, negative_prompt=NEGATIVE, seed=0, height=128, width=192, num_inference_steps=3,
                   guidance_scale=3.0, upsample=True, **kw)
        assert out.frames.shape == (1, 17, 128, 192, 3)
        assert_close(out.frames, want.frames)
        assert_close(out.audio, want.audio.numpy())
        with pytest.raises(RequestError) as e:                    # the first stage is half the size: 64k pixels
            pipe.make_spec(PROMPT, seed=0, height=96, width=192, upsample=True)
        assert e.value.field == "height"


def test_a_long_clip_is_decoded_window_by_window_as_diffusers_decodes_it_whole(pipe1, diffusers_pipe):
    """30 latent frames are longer than a window and its halos on tiny-ltx2 (H = 7: 14 + 2 x 7), so the video comes
    in two windows (14 latent frames, then the 16 left), each decoded with its halo (families/ltx2/vae.py), and equals
    diffusers' one-call decode; the sound comes with the first window (the 17-frame clips above are one window)."""
    kw = dict(height=64, width=64, num_frames=233, num_inference_steps=2, guidance_scale=1.0,
              audio_guidance_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0, **PLAIN)
    want = reference(diffusers_pipe, **kw)
    spec = pipe1.make_spec(PROMPT, NEGATIVE, seed=0, **kw)
    chunks = [o for o in pipe1.engine.submit(spec) if isinstance(o, FramesChunk)]
    assert [c.frames.shape[1] for c in chunks] == [1 + 8 * 13, 8 * 16]
    assert chunks[0].audio is not None and chunks[1].audio is None
    assert_close(np.concatenate([c.frames for c in chunks], axis=1), want.frames)
    assert_close(chunks[0].audio.samples, want.audio.numpy())
