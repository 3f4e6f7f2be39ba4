"""Diffusion forcing from an image and from a video (tiny-skyreels-df): 1 worker equals diffusers'
`SkyReelsV2DiffusionForcingImageToVideoPipeline` and `...VideoToVideoPipeline` over several segments; an
extension's content is the input's frames then the new ones (diffusers' output without the frames that re-make
the input's end); 2 and 3 workers (Ulysses, Ring) equal 1; the input's frames stream out first; what a request
or a checkpoint cannot take is refused naming the field."""

import dataclasses

import numpy as np
import PIL.Image
import pytest
import torch

from longserve.engine.families.skyreels_df import SkyReelsDiffusionForcingFamily as DF
from longserve.engine.request import GenerationSpec, RequestError
from longserve.weights import resolve_model

ATOL = 1e-4
PROMPT, NEGATIVE = "a red ball moving right", "blurry"
# as tests/pipelines/test_long_video.py: 80x112 (a 5x7 patch grid, divisible by none of 2, 3), the checkpoint's own
# guidance 2.0, a VAE that does not compress time (one latent frame is one frame). overlap_history 5 = 4k+1: the
# Wan encoder takes 1 + 4k frames, so the whole overlap is encoded (3 would encode only its first frame).
SIZE = dict(height=80, width=112, num_inference_steps=2, guidance_scale=2.0, base_num_frames=7, overlap_history=5,
            ar_step=0, causal_block_size=1)
I2V = dict(num_frames=11, **SIZE)        # 3 segments of 7 latent frames: 7 from the image's, then 2 + 2 new
V2V = dict(num_frames=9, **SIZE)         # 2 segments of 7: 5 re-make the input's end, 2 + 2 new
INPUT_FRAMES = 6

pytestmark = pytest.mark.usefixtures("one_thread")


def ball(frames: int, height: int, width: int, start: int = 20) -> np.ndarray:
    """A red ball moving right on grey (what the checkpoint was trained on): (T, H, W, 3) uint8."""
    y, x = np.mgrid[0:height, 0:width]
    video = np.full((frames, height, width, 3), 128, np.uint8)
    for t in range(frames):
        video[t][(y - height // 2) ** 2 + (x - start - 4 * t) ** 2 < 12 ** 2] = (200, 40, 40)
    return video


IMAGE = ball(1, 60, 84)[0]                         # resized to 80x112 as diffusers resizes it
VIDEO = ball(INPUT_FRAMES, 80, 112)


def diffusers_frames(case: dict) -> dict:
    """diffusers rounds num_frames to 4k+1 even for a VAE that does not compress time: one frame fewer."""
    return dict(case, num_frames=case["num_frames"] - 1)


@pytest.fixture(scope="module")
def references(pipeline_cache):
    """1 worker's videos; the extension is streamed (what `__call__` returns is the chunks concatenated) from a
    list of frames, with the step each chunk came out at."""
    pipe = pipeline_cache.get("tiny-skyreels-df", workers=1)
    steps, chunks, at_step = [], [], []
    for chunk in pipe.stream(PROMPT, negative_prompt=NEGATIVE, seed=0, video=list(VIDEO),
                             callback=lambda s, n: steps.append((s, n)), **V2V):
        chunks.append(chunk)
        at_step.append(len(steps))
    return {"image": pipe(PROMPT, negative_prompt=NEGATIVE, seed=0, image=IMAGE, **I2V).frames,
            "video": np.concatenate(chunks)[None], "stream": (steps, chunks, at_step)}


def test_one_worker_matches_diffusers_image_to_video_over_three_segments(references):
    from diffusers import SkyReelsV2DiffusionForcingImageToVideoPipeline

    pipe = SkyReelsV2DiffusionForcingImageToVideoPipeline.from_pretrained(str(resolve_model("tiny-skyreels-df")))
    pipe.set_progress_bar_config(disable=True)
    want = pipe(image=PIL.Image.fromarray(IMAGE), prompt=PROMPT, negative_prompt=NEGATIVE, output_type="np",
                generator=torch.Generator("cpu").manual_seed(0), **diffusers_frames(I2V)).frames
    got = references["image"]
    assert got.shape == want.shape == (1, 11, 80, 112, 3)
    assert want.std() > 0.03, "the reference video should not be flat"
    assert float(abs(got - want).max()) <= ATOL


def test_an_extension_is_the_input_then_diffusers_new_frames_without_the_remade_overlap(references):
    from diffusers import SkyReelsV2DiffusionForcingVideoToVideoPipeline

    pipe = SkyReelsV2DiffusionForcingVideoToVideoPipeline.from_pretrained(str(resolve_model("tiny-skyreels-df")))
    pipe.set_progress_bar_config(disable=True)
    want = pipe(video=[PIL.Image.fromarray(f) for f in VIDEO], prompt=PROMPT, negative_prompt=NEGATIVE,
                output_type="np", generator=torch.Generator("cpu").manual_seed(0), **diffusers_frames(V2V)).frames
    overlap = V2V["overlap_history"]
    # diffusers: the input (6), then every frame it decodes (9), the first 5 of which re-make the input's last 5
    assert want.shape == (1, INPUT_FRAMES + V2V["num_frames"], 80, 112, 3)
    got = references["video"]
    assert got.shape == (1, INPUT_FRAMES + V2V["num_frames"] - overlap, 80, 112, 3)
    assert np.abs(got[0, :INPUT_FRAMES] * 255 - VIDEO).max() < 1e-3, "the content starts with the input's frames"
    expected = np.concatenate([want[:, :INPUT_FRAMES], want[:, INPUT_FRAMES + overlap:]], axis=1)
    assert float(abs(got - expected).max()) <= ATOL
    remade = want[0, INPUT_FRAMES:INPUT_FRAMES + overlap]
    assert np.abs(remade - VIDEO[-overlap:] / 255).mean() < 0.1, "what is dropped re-makes the input's end"
    assert want[0, INPUT_FRAMES + overlap:].std() > 0.03, "the new frames should not be flat"


@pytest.mark.parametrize("workers, parallel", [(2, "ulysses"), (3, "ring")])
def test_n_workers_match_one_worker_from_an_image_and_from_a_video(pipeline, references, workers, parallel):
    pipe = pipeline("tiny-skyreels-df", workers=workers, parallel=parallel)
    for name, case in (("image", I2V), ("video", V2V)):
        got = pipe(PROMPT, negative_prompt=NEGATIVE, seed=0, **{name: IMAGE if name == "image" else VIDEO}, **case)
        err = float(abs(got.frames - references[name]).max())
        assert err <= ATOL, f"{name}: {parallel} on {workers} workers differs by {err:.2e}"


def test_an_extension_streams_the_input_first_then_each_segments_new_frames(references):
    steps, chunks, at_step = references["stream"]
    total = steps[-1][1]
    assert total == 2 * V2V["num_inference_steps"], "two segments, every step of each counted"
    assert [len(c) for c in chunks] == [INPUT_FRAMES, 2, 2], "the input, then each segment's new frames"
    assert at_step[0] <= 1 and at_step[1] < total == at_step[2], \
        "the input comes out at once, the first segment's frames before the second segment is done"


def _check(model: str, num_frames: int = 9, **options) -> GenerationSpec:
    """A request checked on the coordinator, as `engine.submit` checks it (no workers)."""
    desc = DF.describe(resolve_model(model))
    windows = {k: SIZE[k] for k in ("base_num_frames", "overlap_history", "ar_step", "causal_block_size")}
    spec = GenerationSpec(request_id="r", prompt=[PROMPT], negative_prompt="", num_frames=num_frames, height=80,
                          width=112, num_inference_steps=2, guidance_scale=2.0, seed=0, options={**windows, **options})
    return DF.check_request(desc, spec)


@pytest.mark.parametrize("model, kwargs, field", [
    ("tiny-skyreels-df", dict(video=VIDEO[:4]), "video"),                        # fewer frames than overlap_history
    ("tiny-skyreels-df", dict(video=VIDEO, num_frames=5), "num_frames"),          # nothing new after the overlap
    ("tiny-skyreels-df", dict(video=VIDEO, image=IMAGE), "video"),                # both
    ("tiny-skyreels-df", dict(video=VIDEO, overlap_history=None), "overlap_history"),
    ("tiny-skyreels-df", dict(video=VIDEO[0]), "video"),                          # one frame is not a video
    ("tiny-skyreels-df", dict(video="in.mp4"), "video"),                          # the engine reads no files
    ("tiny-skyreels-df", dict(image=IMAGE, last_image=IMAGE), "last_image"),
    ("tiny-skyreels-df-i2v", dict(), "image"),                                    # an I2V checkpoint needs one
    ("tiny-skyreels-df-i2v", dict(video=VIDEO), "video"),
    ("tiny-skyreels-df-v2v", dict(), "video"),                                    # a V2V checkpoint extends only
    ("tiny-skyreels-df-v2v", dict(image=IMAGE, video=None), "image"),
])
def test_what_a_request_or_its_checkpoint_cannot_take_is_refused_naming_the_field(model, kwargs, field):
    with pytest.raises(RequestError) as e:
        _check(model, **kwargs)
    assert e.value.field == field, str(e.value)


def test_each_checkpoint_class_takes_what_its_diffusers_pipeline_takes():
    caps = {m: DF.describe(resolve_model(m)).capabilities for m in ("tiny-skyreels-df", "tiny-skyreels-df-i2v",
                                                                     "tiny-skyreels-df-v2v")}
    assert {m: (c.image, c.video) for m, c in caps.items()} == {"tiny-skyreels-df": ("optional", "optional"),
                                                                "tiny-skyreels-df-i2v": ("required", "refused"),
                                                                "tiny-skyreels-df-v2v": ("refused", "required")}
    spec = _check("tiny-skyreels-df-v2v", video=[PIL.Image.fromarray(f) for f in VIDEO])
    assert spec.options["video"].shape == VIDEO.shape and (spec.options["video"] == VIDEO).all()
    assert DF.content_frames(DF.describe(resolve_model("tiny-skyreels-df-v2v")), spec) == INPUT_FRAMES + 9 - 5
    assert DF.content_frames(None, dataclasses.replace(spec, output="latent")) == 9, "latents are diffusers' own"


def test_a_video_path_is_read_by_the_pipeline(tmp_path):
    from longserve.pipelines.media import read_mp4
    from longserve.pipelines.video import VideoPipeline, save_video

    path = tmp_path / "in.mp4"
    save_video(VIDEO / 255.0, path, fps=8)
    frames = VideoPipeline.read_inputs({"video": str(path)})["video"]
    assert frames.shape == VIDEO.shape and frames.dtype == np.uint8
    assert np.abs(frames.astype(int) - VIDEO).mean() < 8, "the frames, within MP4 error"
    assert (read_mp4(path.read_bytes()) == frames).all(), "bytes and a path read the same"
