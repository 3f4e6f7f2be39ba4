"""Helios with a pyramid (`HeliosPyramidPipeline`): tiny-helios-distilled (the distilled DMD scheduler) equals
diffusers' pipeline over 3 chunks of 3 stages at 1 worker, with and without the amplified first chunk; a
Helios-Mid-like checkpoint (HeliosScheduler of 3 stages, CFG-Zero* guidance) equals it too; 2 and 3 workers
equal 1; a gamma whose block noise cannot be factored is refused at start."""

import json
import shutil

import numpy as np
import pytest
import torch

from longserve.engine.request import RequestError
from longserve.pipelines import VideoPipeline
from longserve.weights import resolve_model

ATOL = 1e-4
PROMPT, NEGATIVE = "a red ball bouncing", "blurry"
# 64x128 px -> 8x16 latents; the stages see 2x4, 4x8 and 8x16 latents (1x2, 2x4, 4x8 patches); chunks of 3 latent
# frames (9 frames), 3 chunks = 27 frames, cut to 25 as diffusers cuts
CASE = dict(height=64, width=128, num_latent_frames_per_chunk=3)
FRAMES = 27
PYRAMID = dict(guidance_scale=5.0, pyramid_num_inference_steps_list=[2, 1, 2])


def diffusers_frames(model_dir, **kw):
    from diffusers import HeliosPyramidPipeline

    pipe = HeliosPyramidPipeline.from_pretrained(str(model_dir))
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt=PROMPT, negative_prompt=NEGATIVE, num_frames=FRAMES, output_type="np",
                generator=torch.Generator("cpu").manual_seed(0), **CASE, **kw).frames


@pytest.fixture(scope="module")
def mid_checkpoint(tmp_path_factory):
    """tiny-helios-distilled's components as Helios-Mid is laid out: a HeliosScheduler of 3 stages (UniPC), not
    distilled, CFG-Zero* guidance."""
    root = tmp_path_factory.mktemp("helios-mid") / "tiny-helios-mid"
    shutil.copytree(resolve_model("tiny-helios-distilled"), root)
    index = json.loads((root / "model_index.json").read_text())
    index.update(scheduler=["diffusers", "HeliosScheduler"], is_distilled=False, is_cfg_zero_star=True)
    (root / "model_index.json").write_text(json.dumps(index))
    from diffusers import HeliosScheduler

    HeliosScheduler(stages=3, gamma=0.25).save_pretrained(str(root / "scheduler"))
    (root / "generation_defaults.json").write_text(json.dumps(
        {"height": 64, "width": 64, "num_frames": 9, "guidance_scale": 5.0,
         "pyramid_num_inference_steps_list": [2, 1, 2]}))
    return root


@pytest.mark.parametrize("amplify", [False, True], ids=["plain first chunk", "amplified first chunk"])
def test_one_worker_matches_diffusers_distilled_pyramid_over_three_chunks(amplify):
    steps = [2, 2, 2]
    want = diffusers_frames(resolve_model("tiny-helios-distilled"), guidance_scale=1.0,
                            pyramid_num_inference_steps_list=steps, is_amplify_first_chunk=amplify)
    with VideoPipeline.from_pretrained("tiny-helios-distilled", workers=1, device="cpu") as pipe:
        got = pipe(PROMPT, negative_prompt=NEGATIVE, seed=0, num_frames=FRAMES, guidance_scale=1.0,
                   pyramid_num_inference_steps_list=steps, is_amplify_first_chunk=amplify, **CASE)
    assert got.frames.shape == want.shape == (1, 25, 64, 128, 3)
    assert want.std() > 0.05
    assert float(np.abs(got.frames - want).max()) <= ATOL


def test_one_worker_matches_diffusers_cfg_zero_star_pyramid(mid_checkpoint):
    kw = dict(guidance_scale=5.0, pyramid_num_inference_steps_list=[2, 1, 2], zero_steps=1)
    want = diffusers_frames(mid_checkpoint, **kw)
    with VideoPipeline.from_pretrained(str(mid_checkpoint), workers=1, device="cpu") as pipe:
        got = pipe(PROMPT, negative_prompt=NEGATIVE, seed=0, num_frames=FRAMES, **CASE, **kw).frames
    assert float(np.abs(got - want).max()) <= ATOL
    # the zero-initialised first steps of CFG-Zero* matter: without them the video differs
    plain = diffusers_frames(mid_checkpoint, use_zero_init=False, **kw)
    assert float(np.abs(plain - want).max()) > 0.01


@pytest.fixture(scope="module")
def pyramid_one_worker(mid_checkpoint):
    with VideoPipeline.from_pretrained(str(mid_checkpoint), workers=1, device="cpu") as pipe:
        return pipe(PROMPT, negative_prompt=NEGATIVE, seed=0, num_frames=FRAMES, **CASE, **PYRAMID).frames


@pytest.mark.parametrize("workers, parallel", [(2, "ulysses"), (3, "ring")])
def test_n_workers_match_one_worker_on_every_stage(mid_checkpoint, pyramid_one_worker, workers, parallel):
    """2 workers on Ulysses split the 3 heads unevenly; 3 on Ring split every stage's tokens unevenly."""
    with VideoPipeline.from_pretrained(str(mid_checkpoint), workers=workers, parallel=parallel, device="cpu") as pipe:
        got = pipe(PROMPT, negative_prompt=NEGATIVE, seed=0, num_frames=FRAMES, **CASE, **PYRAMID).frames
    assert float(np.abs(got - pyramid_one_worker).max()) <= ATOL, (parallel, workers)


def test_pyramid_options_are_checked_naming_the_field(mid_checkpoint):
    with VideoPipeline.from_pretrained(str(mid_checkpoint), workers=1, device="cpu") as pipe:
        for options, field in ((dict(pyramid_num_inference_steps_list=[2, 2]), "pyramid_num_inference_steps_list"),
                               (dict(is_amplify_first_chunk="yes"), "is_amplify_first_chunk"),
                               (dict(height=48), "height"), (dict(sigmas=[0.5]), "sigmas")):
            with pytest.raises(RequestError) as e:
                pipe(PROMPT, seed=0, num_frames=9, **{**CASE, **options})
            assert e.value.field == field, options


def test_a_gamma_whose_block_noise_cannot_be_factored_is_refused_at_start(tmp_path, mid_checkpoint):
    root = tmp_path / "singular"
    shutil.copytree(mid_checkpoint, root)
    from diffusers import HeliosScheduler

    HeliosScheduler(stages=3).save_pretrained(str(root / "scheduler"))       # gamma 1/3: singular for 2x2 patches
    with pytest.raises(ValueError, match="gamma"):                            # on the coordinator: no worker started
        VideoPipeline.from_pretrained(str(root), workers=1, device="cpu")


@pytest.mark.parametrize("gamma, n, refused", [(1 / 3, 4, True), (1 / 3 - 1e-6, 4, True), (0.34, 4, True),
                                               (0.25, 4, False), (1 / 3, 1, False), (0.1, 9, False),
                                               (0.125, 9, True), (-1.0, 4, True)])
def test_the_block_noise_refusal_is_decided_from_gamma_and_the_patch_not_by_this_cpu(gamma, n, refused):
    """The covariance (1 + gamma) I - gamma J has eigenvalues 1 + gamma and 1 - gamma (n - 1): the refusal is
    those numbers' (within float32's margin), the same on every CPU, whether or not a factorisation would succeed."""
    from longserve.engine.families.helios_pyramid import check_block_noise

    if refused:
        with pytest.raises(ValueError, match="gamma"):
            check_block_noise(gamma, n, "p")
    else:
        check_block_noise(gamma, n, "p")
