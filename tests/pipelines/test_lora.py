"""LoRA adapters per request (engine/lora.py) and the few-step recipe (a fixed sigmas list, no CFG).

1 worker equals diffusers' WanPipeline with the same adapters loaded by `load_lora_weights` and set by
`set_adapters(names, scales)`; requests with different adapters (or none, or one adapter at two scales, or no CFG)
share a batch and each equals its run alone; 2 workers (Ulysses on 45 tokens and 3 heads, neither even; and
CFG-parallel, where each half of the workers holds half of every request's rows) equal 1 worker; a two-expert
Wan 2.2 checkpoint takes one file per expert, as diffusers' `load_into_transformer_2` does."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from longserve.engine.outputs import FramesChunk, StepProgress
from longserve.engine.request import RequestError
from longserve.pipelines import VideoPipeline
from longserve.weights import resolve_lora, resolve_model

ATOL = 1e-4
PROMPT, NEGATIVE = "a red ball bouncing", "blurry, low quality"
pytestmark = pytest.mark.usefixtures("one_thread")      # diffusers' reference runs: tiny ops, shared cores

#: both shipped formats: diffusers' (alpha 4, rank 2) at scale 1 by default, musubi's at 0.5 by default
LORAS = ("style=tiny-wan-lora", "musubi=tiny-wan-lora-musubi:0.5")
# one latent frame of 3 x 5 patches: 15 tokens, and tiny-wan's 3 heads: neither divides by 2
SIZE = dict(num_frames=1, height=48, width=80)
#: (lora, guidance) of four requests that share a batch: two adapters, one at two scales, and one with neither
#: and no CFG (one row where the others have two)
MIXED = [([{"name": "style", "scale": 0.7}], 5.0), ([{"name": "musubi", "scale": 1.3}], 5.0), ([], 1.0),
         ([{"name": "style", "scale": 1.5}, {"name": "musubi"}], 5.0)]          # musubi at its start scale, 0.5


@pytest.fixture(scope="module")
def pipe1(pipeline_cache):
    """One worker with both adapters, one step per job (a newcomer joins the running batch at once); shared."""
    return pipeline_cache.get("tiny-wan", workers=1, loras=LORAS, max_steps_per_job=1)


@pytest.fixture(scope="module")
def runs(pipe1):
    """Each MIXED request run alone on one worker (VideoOutput)."""
    return [alone(pipe1, lora, g) for lora, g in MIXED]


@pytest.fixture(scope="module")
def singles(runs):
    return [out.frames for out in runs]


@functools.lru_cache(maxsize=1)
def diffusers_pipe():
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(resolve_model("tiny-wan")))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(resolve_lora("tiny-wan-lora")), adapter_name="style")
    pipe.load_lora_weights(str(resolve_lora("tiny-wan-lora-musubi")), adapter_name="musubi")
    return pipe


def diffusers_frames(names, scales, seed, sigmas=None, **kw):
    pipe = diffusers_pipe()
    pipe.set_adapters(names, scales)
    scheduler = pipe.scheduler
    if sigmas is not None:              # WanPipeline sets `num_inference_steps`: hand the scheduler the list
        pipe.scheduler = type(scheduler).from_config(scheduler.config)
        pipe.scheduler.set_timesteps = functools.partial(pipe.scheduler.set_timesteps,
                                                         sigmas=np.asarray(sigmas, dtype=np.float64))
    try:
        return pipe(prompt=PROMPT, negative_prompt=NEGATIVE, generator=torch.Generator("cpu").manual_seed(seed),
                    output_type="np", **kw).frames
    finally:
        pipe.scheduler = scheduler


def alone(pipe, lora, guidance, seed=3):
    return pipe(PROMPT, negative_prompt=NEGATIVE, num_inference_steps=2, guidance_scale=guidance, seed=seed,
                lora=lora, **SIZE)


def test_a_lora_at_scale_s_equals_diffusers_set_adapters(runs, singles):
    kw = dict(num_inference_steps=2, guidance_scale=5.0, **SIZE)
    assert np.abs(singles[0] - diffusers_frames("style", 0.7, seed=3, **kw)).max() <= ATOL
    # two adapters on one request (diffusers' format and musubi's), one at the start scale the flag gave it
    assert runs[3].lora == [{"name": "style", "scale": 1.5}, {"name": "musubi", "scale": 0.5}]
    assert np.abs(singles[3] - diffusers_frames(["style", "musubi"], [1.5, 0.5], seed=3, **kw)).max() <= ATOL
    assert np.abs(singles[0] - singles[3]).max() > 0.05, "the adapters should change the video"


def together(pipe, seed=3):
    """The MIXED requests submitted at once; their frames, and the largest batch any of them was stepped in."""
    specs = [pipe.make_spec(PROMPT, NEGATIVE, num_inference_steps=2, guidance_scale=g, seed=seed, lora=lora, **SIZE)
             for lora, g in MIXED]
    outs = [list(h) for h in [pipe.engine.submit(s) for s in specs]]
    batch = max(o.batch_size for out in outs for o in out if isinstance(o, StepProgress))
    return [np.concatenate([o.frames for o in out if isinstance(o, FramesChunk)], axis=1) for out in outs], batch


def test_requests_with_different_adapters_share_a_batch_and_each_equals_its_run_alone(pipe1, singles):
    frames, batch = together(pipe1)
    assert batch == len(MIXED), "the four requests should have shared a step"
    for (lora, _), got, want in zip(MIXED, frames, singles):
        assert np.abs(got - want).max() <= ATOL, lora
    assert min(np.abs(a - b).max() for i, a in enumerate(singles) for b in singles[i + 1:]) > 0.05


def test_two_workers_equal_one_with_adapters_per_row_under_ulysses_and_cfg_parallel(singles):
    with VideoPipeline.from_pretrained("tiny-wan", workers=2, device="cpu", loras=LORAS,
                                       max_steps_per_job=1) as pipe:
        for cfg in (False, True):
            pipe.engine.set_plan("ulysses", None, cfg_parallel=cfg)
            frames, batch = together(pipe)
            assert batch == len(MIXED)
            for (lora, _), got, want in zip(MIXED, frames, singles):
                assert np.abs(got - want).max() <= ATOL, (cfg, lora)


def _count_forwards(ctx, on: bool):
    """On the worker: record the batch size of every transformer forward (on), or stop and return them."""
    model = ctx.state["family"].pipe.transformer
    if on:
        sizes = ctx.state["forward_sizes"] = []
        ctx.state["forward_hook"] = model.register_forward_pre_hook(lambda m, args: sizes.append(args[0].shape[0]))
        return None
    ctx.state.pop("forward_hook").remove()
    return ctx.state.pop("forward_sizes")


def test_four_fixed_sigmas_without_cfg_run_four_forwards_of_one_row_and_equal_diffusers(pipe1):
    """The few-step recipe: a LoRA, a fixed list (4 sigmas, shifted by the scheduler's flow_shift as diffusers
    does), guidance 1: exactly 4 transformer forwards, each of batch 1."""
    sigmas = [1.0, 0.75, 0.5, 0.25]
    kw = dict(guidance_scale=1.0, **SIZE)
    pipe1.pool.run(_count_forwards, True)
    try:     # no num_inference_steps: the model's default is 20, the list decides
        got = pipe1(PROMPT, negative_prompt=NEGATIVE, seed=2, sigmas=sigmas, lora={"style": 1.0}, **kw).frames
    finally:
        sizes = pipe1.pool.run(_count_forwards, False)[0]
    assert sizes == [1, 1, 1, 1]
    want = diffusers_frames("style", 1.0, seed=2, sigmas=sigmas, num_inference_steps=4, **kw)
    assert np.abs(got - want).max() <= ATOL


def test_a_two_expert_checkpoint_takes_one_file_per_expert_as_diffusers_load_into_transformer_2(pipeline):
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8))
    kw = dict(num_frames=1, height=32, width=48, num_inference_steps=2, guidance_scale=4.0)
    pipe = pipeline("tiny-wan22-i2v-a14b", workers=1, loras=("fast=tiny-wan-lora-musubi,tiny-wan-lora:0.8",))
    got = pipe(PROMPT, negative_prompt=NEGATIVE, image=image, seed=5, lora=["fast"], **kw)
    assert got.lora == [{"name": "fast", "scale": 0.8}]
    ref = WanImageToVideoPipeline.from_pretrained(str(resolve_model("tiny-wan22-i2v-a14b")))
    ref.set_progress_bar_config(disable=True)
    ref.load_lora_weights(str(resolve_lora("tiny-wan-lora-musubi")), adapter_name="fast")
    ref.load_lora_weights(str(resolve_lora("tiny-wan-lora")), adapter_name="fast", load_into_transformer_2=True)
    ref.set_adapters("fast", 0.8)
    want = ref(prompt=PROMPT, negative_prompt=NEGATIVE, image=image, generator=torch.Generator("cpu").manual_seed(5),
               output_type="np", **kw).frames
    assert ref.scheduler.timesteps[0] >= 900 > ref.scheduler.timesteps[1], "both experts should have run"
    assert np.abs(got.frames - want).max() <= ATOL


@pytest.mark.parametrize("lora, message", [
    ([{"name": "nope"}], "unknown LoRA adapter 'nope'"),
    ([{"name": "style", "scale": 50}], "scale must be a number"),
    ([{"name": "style", "scale": "high"}], "scale must be a number"),
    ([{"name": "style", "weight": 1}], "each lora entry"),
    ([{"name": "style"}, {"name": "style"}], "given twice"),
    (3, "lora must be a list"),
])
def test_a_bad_lora_is_a_request_error_naming_lora(pipe1, lora, message):
    with pytest.raises(RequestError, match=message) as e:
        pipe1(PROMPT, num_inference_steps=1, lora=lora, **SIZE)
    assert e.value.field == "lora"


@pytest.mark.parametrize("options, field", [
    (dict(timesteps=[999.0, 500.0]), "timesteps"),          # Wan's UniPC takes sigmas, not timesteps
    (dict(sigmas=[0.5, 0.9]), "sigmas"),                    # not decreasing
    (dict(sigmas=[1.0, 0.0]), "sigmas"),                    # out of (0, 1]
    (dict(sigmas="1.0, 0.5"), "sigmas"),
])
def test_a_bad_schedule_is_a_request_error_naming_it(pipe1, options, field):
    with pytest.raises(RequestError) as e:
        pipe1(PROMPT, guidance_scale=1.0, **options, **SIZE)
    assert e.value.field == field


def test_a_checkpoint_s_generation_defaults_carry_the_recipe_for_its_default_step_count():
    """`"num_inference_steps": 4, "sigmas": [...]` in generation_defaults.json: a request for 4 steps that gives no
    list gets it; another step count gets the scheduler's own spacing; a list of its own wins."""
    import dataclasses

    from longserve.engine.families.wan import WanFamily
    from longserve.engine.request import GenerationSpec

    desc = WanFamily.describe(resolve_model("tiny-wan"))
    recipe = [1.0, 0.75, 0.5, 0.25]
    desc = dataclasses.replace(desc, defaults=dataclasses.replace(desc.defaults, num_inference_steps=4,
                                                                  guidance_scale=1.0, options={"sigmas": recipe}))

    def checked(steps, **options):
        spec = GenerationSpec("r", [PROMPT], "", 1, 48, 80, steps, 1.0, 0, options=options)
        return WanFamily.check_request(desc, spec)

    assert checked(4).options == {"sigmas": recipe}
    assert checked(8).options == {} and checked(8).num_inference_steps == 8
    own = checked(4, sigmas=[1.0, 0.5])
    assert own.options == {"sigmas": [1.0, 0.5]} and own.num_inference_steps == 2


def test_adapters_that_cannot_load_fail_at_start_naming_the_flag(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(ValueError, match="--lora x=/no/such.safetensors: no LoRA file"):
        VideoPipeline.from_pretrained("tiny-wan", device="cpu", loras={"x": "/no/such.safetensors"})
    with pytest.raises(ValueError, match="--lora x=.*HIGH,LOW"):
        VideoPipeline.from_pretrained("tiny-wan", device="cpu", loras=("x=tiny-wan-lora,tiny-wan-lora",))
    with pytest.raises(ValueError, match="takes no LoRA adapters"):
        VideoPipeline.from_pretrained("tiny-latte", device="cpu", loras={"x": "tiny-wan-lora"})
    # a file that names a block tiny-wan (2 blocks) does not have: found on the worker that loads it
    wrong = tmp_path / "wrong.safetensors"
    save_file({"transformer.blocks.7.attn1.to_q.lora_A.weight": torch.zeros(2, 36),
               "transformer.blocks.7.attn1.to_q.lora_B.weight": torch.zeros(36, 2)}, str(wrong))
    with pytest.raises(Exception, match=f"--lora bad={wrong}: .*does not fit"):
        VideoPipeline.from_pretrained("tiny-wan", device="cpu", loras={"bad": str(wrong)})


def test_rows_that_step_caching_skips_leave_the_others_with_their_own_adapters(pipe1):
    """Step caching (engine/cache.py) runs the blocks after the first for the recomputing rows only: the per-row
    adapters must follow that subset. Two of the four MIXED requests cache with a threshold that skips every step
    after the first; all four share the batch and each equals its run alone."""
    skip_all = {"kind": "first_block", "threshold": 100.0}
    caches = [skip_all, None, skip_all, None]
    kw = dict(num_inference_steps=2, seed=3, **SIZE)
    alone_runs = [pipe1(PROMPT, negative_prompt=NEGATIVE, guidance_scale=g, lora=lora, cache=c, **kw)
                  for (lora, g), c in zip(MIXED, caches)]
    specs = [pipe1.make_spec(PROMPT, NEGATIVE, guidance_scale=g, lora=lora, cache=c, **kw)
             for (lora, g), c in zip(MIXED, caches)]
    outs = [list(h) for h in [pipe1.engine.submit(s) for s in specs]]
    assert max(o.batch_size for out in outs for o in out if isinstance(o, StepProgress)) == len(MIXED)
    for c, run, out in zip(caches, alone_runs, outs):
        assert (run.timings["blocks_skipped"] > 0) == (c is not None)
        got = np.concatenate([o.frames for o in out if isinstance(o, FramesChunk)], axis=1)
        assert np.abs(got - run.frames).max() <= ATOL
