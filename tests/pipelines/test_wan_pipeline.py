"""The Wan family through VideoPipeline: 1 worker equals diffusers' own pipelines (Wan 2.1 `WanPipeline`,
Wan 2.2 with two experts, SkyReels-V2 T2V); 2, 3 and 4 workers (Ulysses, Ring, USP, CFG-parallel) equal
1 worker on a latent frame count, a patch grid and a head count that none of them divides."""

import numpy as np
import pytest
import torch
from wan_models import (
    WAN_2_2_T2V_A14B_TRANSFORMER,
    build_skyreels_v2_checkpoint,
    build_wan21_checkpoint,
    build_wan22_checkpoint,
    narrow,
)

from longserve.engine.request import RequestError
from longserve.pipelines import VideoPipeline
from longserve.weights import resolve_model
from tools.weights.wan import SKYREELS_V2_T2V_14B_540P_TRANSFORMER

ATOL = 1e-4
PROMPT, NEGATIVE = "a red ball bouncing", "blurry, low quality"
# 17 frames -> 5 latent frames; 80x112 pixels -> a 5x7 patch grid: neither divides by 2, 3 or 4
ODD = dict(num_frames=17, height=80, width=112, num_inference_steps=3, guidance_scale=5.0, seed=3)


def diffusers_frames(pipeline_cls, path, vae_tiling=False, **kw):
    pipe = pipeline_cls.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    if vae_tiling:
        pipe.vae.enable_tiling()
    seed = kw.pop("seed")
    return pipe(prompt=PROMPT, negative_prompt=NEGATIVE, generator=torch.Generator("cpu").manual_seed(seed),
                output_type="np", **kw).frames


@pytest.fixture(scope="module")
def pipe1():
    with VideoPipeline.from_pretrained("tiny-wan", workers=1, device="cpu") as p:
        yield p


@pytest.fixture(scope="module")
def odd_reference(pipe1):
    return pipe1(PROMPT, negative_prompt=NEGATIVE, **ODD).frames


def test_one_worker_matches_diffusers_wan_pipeline(pipe1):
    from diffusers import WanPipeline

    kw = dict(num_frames=9, height=48, width=80, num_inference_steps=4, guidance_scale=5.0, seed=0)
    want = diffusers_frames(WanPipeline, resolve_model("tiny-wan"), **kw)
    got = pipe1(PROMPT, negative_prompt=NEGATIVE, **kw)
    assert got.frames.shape == want.shape == (1, 9, 48, 80, 3)
    assert want.std() > 0.01, "the reference video should not be flat"
    assert np.abs(got.frames - want).max() <= ATOL
    assert pipe1.info.family == "wan" and pipe1.parallel == "ulysses"


def test_vae_decodes_untiled_as_diffusers_and_in_diffusers_tiles_with_vae_tiling(pipe1):
    """288 px is wider than diffusers' default 256 px VAE tile: tiled and untiled pixels differ. By default
    1 worker equals WanPipeline's (untiled) decode; with vae_tiling, 2 workers (one tile each) equal
    WanPipeline after `pipe.vae.enable_tiling()`."""
    from diffusers import WanPipeline

    kw = dict(num_frames=5, height=32, width=288, num_inference_steps=2, guidance_scale=5.0, seed=2)
    plain = diffusers_frames(WanPipeline, resolve_model("tiny-wan"), **kw)
    tiled = diffusers_frames(WanPipeline, resolve_model("tiny-wan"), vae_tiling=True, **kw)
    assert np.abs(plain - tiled).max() > 0.05, "tiling should change these pixels, or the test cannot tell"
    assert pipe1.info.vae_tiling is False
    assert np.abs(pipe1(PROMPT, negative_prompt=NEGATIVE, **kw).frames - plain).max() <= ATOL
    with VideoPipeline.from_pretrained("tiny-wan", workers=2, device="cpu", vae_tiling=True) as pipe:
        got = pipe(PROMPT, negative_prompt=NEGATIVE, **kw).frames
    assert np.abs(got - tiled).max() <= ATOL


def test_vae_dtype_bfloat16_decodes_as_diffusers_wan_pipeline_with_a_bfloat16_vae():
    """`vae_dtype="bfloat16"` (the default is float32, as diffusers' Wan examples load the VAE) decodes as
    WanPipeline does with its VAE loaded in bfloat16: the same frames, and not the float32 ones."""
    from diffusers import AutoencoderKLWan, WanPipeline

    path = resolve_model("tiny-wan")
    kw = dict(num_frames=5, height=32, width=48, num_inference_steps=2, guidance_scale=5.0, seed=1)
    vae = AutoencoderKLWan.from_pretrained(str(path), subfolder="vae", torch_dtype=torch.bfloat16)
    ref = WanPipeline.from_pretrained(str(path), vae=vae)
    ref.set_progress_bar_config(disable=True)
    want = ref(prompt=PROMPT, negative_prompt=NEGATIVE, generator=torch.Generator("cpu").manual_seed(1),
               output_type="np", **{k: v for k, v in kw.items() if k != "seed"}).frames
    with VideoPipeline.from_pretrained("tiny-wan", workers=1, device="cpu", vae_dtype="bfloat16") as pipe:
        got = pipe(PROMPT, negative_prompt=NEGATIVE, **kw).frames
    fp32 = diffusers_frames(WanPipeline, path, **kw)
    ulp = 2.0 ** -8                                  # one bfloat16 step in [0.5, 1): diffusers' frames are bf16 values
    print("vae_dtype bf16: ours vs diffusers", np.abs(got - want).max(), "float32 vs bf16", np.abs(fp32 - want).max())
    assert np.abs(got - want).max() <= ulp
    assert np.abs(fp32 - want).max() > 2 * ulp, "bf16 should round these pixels, or the test cannot tell"
    with pytest.raises(ValueError, match="vae_dtype"):
        VideoPipeline.from_pretrained("tiny-wan", vae_dtype="int8")


def test_wan21_1_3b_shaped_checkpoint_matches_diffusers(tmp_path):
    from diffusers import WanPipeline

    path = build_wan21_checkpoint(tmp_path / "wan21-1.3b")           # 12 heads x 128, text_dim 4096, z_dim 16
    kw = dict(num_frames=5, height=32, width=48, num_inference_steps=2, guidance_scale=5.0, seed=1)
    want = diffusers_frames(WanPipeline, path, **kw)
    with VideoPipeline.from_pretrained(str(path), workers=2, device="cpu") as pipe:
        assert pipe.parallel == "ulysses"
        got = pipe(PROMPT, negative_prompt=NEGATIVE, **kw).frames
    assert np.abs(got - want).max() <= ATOL


def test_wan22_two_experts_and_guidance_scale_2_match_diffusers(tmp_path):
    from diffusers import WanPipeline

    path = build_wan22_checkpoint(tmp_path / "wan22", config=narrow(WAN_2_2_T2V_A14B_TRANSFORMER, heads=2))
    kw = dict(num_frames=5, height=32, width=48, num_inference_steps=6, guidance_scale=4.0, seed=2)
    want = diffusers_frames(WanPipeline, path, guidance_scale_2=2.0, **kw)
    with VideoPipeline.from_pretrained(str(path), workers=1, device="cpu") as pipe:
        assert pipe.info.capabilities.two_experts and "guidance_scale_2" in pipe.info.options
        got = pipe(PROMPT, negative_prompt=NEGATIVE, guidance_scale_2=2.0, **kw).frames
        other = pipe(PROMPT, negative_prompt=NEGATIVE, guidance_scale_2=6.0, **kw).frames
    assert np.abs(got - want).max() <= ATOL
    assert np.abs(other - got).max() > 1e-3, "guidance_scale_2 steers the low-noise expert's steps"


def test_skyreels_v2_t2v_matches_diffusers(tmp_path):
    from diffusers import SkyReelsV2Pipeline

    path = build_skyreels_v2_checkpoint(tmp_path / "skyreels-t2v", kind="t2v",
                                        config=narrow(SKYREELS_V2_T2V_14B_540P_TRANSFORMER, heads=2))
    kw = dict(num_frames=5, height=32, width=48, num_inference_steps=2, guidance_scale=6.0, seed=4)
    want = diffusers_frames(SkyReelsV2Pipeline, path, **kw)
    with VideoPipeline.from_pretrained(str(path), workers=1, device="cpu") as pipe:
        got = pipe(PROMPT, negative_prompt=NEGATIVE, **kw).frames
    assert np.abs(got - want).max() <= ATOL


@pytest.mark.parametrize("workers, plans", [
    (2, [("ulysses", None, False), ("ring", None, False), ("usp", 2, False), ("ulysses", None, True)]),
    (3, [("ulysses", None, False), ("ring", None, False)]),
    (4, [("ulysses", None, False), ("ring", None, False), ("usp", 2, False), ("usp", 2, True)]),
])
def test_n_workers_match_one_worker_for_every_plan(odd_reference, workers, plans):
    assert odd_reference.shape == (1, 17, 80, 112, 3)
    with VideoPipeline.from_pretrained("tiny-wan", workers=workers, device="cpu") as pipe:
        for parallel, degree, cfg in plans:
            pipe.engine.set_plan(parallel, degree, cfg_parallel=cfg)
            got = pipe(PROMPT, negative_prompt=NEGATIVE, **ODD).frames
            err = np.abs(got - odd_reference).max()
            assert err <= ATOL, f"{parallel} (ulysses_degree={degree}, cfg_parallel={cfg}) on {workers}: {err:.2e}"


def test_a_plan_the_family_does_not_support_names_the_ones_it_does():
    with pytest.raises(ValueError, match="ulysses, ring, usp"):
        VideoPipeline.from_pretrained("tiny-wan", workers=2, parallel="dsp")
    with pytest.raises(ValueError, match="dsp, ulysses, ring, megatron-sp"):
        VideoPipeline.from_pretrained("tiny-latte", workers=2, parallel="usp")


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_frames=8), "num_frames"),                 # not 4k+1
    (dict(height=40), "height"),                        # not a multiple of 16
    (dict(guidance_scale_2=3.0), "guidance_scale_2"),   # Wan 2.1 has one expert
    (dict(ar_step=2), "ar_step"),                       # a diffusion-forcing option
])
def test_bad_wan_arguments_raise_naming_the_field(pipe1, kwargs, field):
    args = dict(num_frames=9, height=32, width=32, num_inference_steps=1)
    args.update(kwargs)
    with pytest.raises(RequestError, match=field) as e:
        pipe1(PROMPT, **args)
    assert e.value.field == field


def _residency(ctx):
    """On a worker: where each expert is, its parameter count in the module now, and the swaps made."""
    family = ctx.state["family"]
    experts = (family.pipe.transformer, family.pipe.transformer_2)
    return family.residency.where(), [sum(p.numel() for p in m.parameters()) for m in experts], family.residency.swaps


def test_expert_offload_keeps_one_expert_resident_gives_the_same_frames_and_swaps_rarely(tmp_path):
    """Wan 2.2's two experts with offload="expert" on 2 workers (Ulysses), 8 requests arriving one step apart:
    each video equals its run without offload, the evicted expert's tensors are really out of the module (the CPU
    stand-in for host memory), and the scheduler's grouping by expert keeps swaps to at most 2 per video."""
    import threading
    import time

    path = build_wan22_checkpoint(tmp_path / "wan22", config=narrow(WAN_2_2_T2V_A14B_TRANSFORMER, heads=2))
    kw = dict(num_frames=5, height=32, width=48, num_inference_steps=4, guidance_scale=4.0)
    with VideoPipeline.from_pretrained(str(path), workers=1, device="cpu") as plain:    # all 8 in one batch
        want = [None] * 8
        together = [threading.Thread(target=lambda i: want.__setitem__(i, plain(PROMPT, seed=i, **kw).frames),
                                     args=(i,)) for i in range(8)]
        for t in together:
            t.start()
        for t in together:
            t.join(120)
    with pytest.raises(ValueError, match="two-expert"):
        VideoPipeline.from_pretrained("tiny-wan", device="cpu", offload="expert")
    with VideoPipeline.from_pretrained(str(path), workers=2, device="cpu", offload="expert") as pipe:
        where, sizes, _ = pipe.pool.run(_residency)[0]
        assert where == ["device", "host"] and sizes[0] > 0 and sizes[1] == 0
        got, threads = [None] * 8, []

        def run(i):
            got[i] = pipe(PROMPT, seed=i, **kw)

        for i in range(8):
            steps = pipe.engine.stats().steps_run
            threads.append(threading.Thread(target=run, args=(i,)))
            threads[-1].start()
            deadline = time.monotonic() + 60
            while pipe.engine.stats().steps_run == steps:      # the next one arrives a denoising step later
                assert time.monotonic() < deadline
                time.sleep(0.002)
        for t in threads:
            t.join(120)
        where, sizes, swaps = pipe.pool.run(_residency)[1]
    swaps_per_video = [out.timings.get("expert_swaps", 0) for out in got]
    print(f"\nexpert swaps: {swaps} in all; per video {swaps_per_video}")
    for out, w in zip(got, want):
        assert np.abs(out.frames - w).max() <= ATOL
    assert max(swaps_per_video) <= 2 and 1 <= swaps <= len(got) // 2 and sum(swaps_per_video) >= swaps
    assert sorted(where) == ["device", "host"] and sorted(sizes)[0] == 0
