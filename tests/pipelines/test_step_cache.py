"""Step caching keyed per request (engine/cache.py, diffusers' FirstBlockCache): one worker equals diffusers'
own hook on the same checkpoint; a request's frames do not depend on who shares its batches; 2 and 3 workers
equal 1 (the decision is all-reduced); caching off leaves the forward bit for bit as it was; a bad `cache` is
refused naming its field."""

import numpy as np
import pytest
import torch

from longserve.engine import worker as jobs
from longserve.engine.cache import WanStepCache, parse_cache
from longserve.engine.config import EngineConfig, WorkerConfig
from longserve.engine.core import EngineCore
from longserve.engine.engine import resolve_checkpoint
from longserve.engine.outputs import FramesChunk, StepProgress
from longserve.engine.parallel import ParallelPlan
from longserve.engine.pool import WorkerPool
from longserve.engine.request import GenerationSpec, RequestError
from longserve.pipelines import VideoPipeline
from longserve.weights import resolve_model

PROMPT, NEGATIVE = "a red ball bouncing", "blurry, low quality"
# the random tiny-wan's head residual changes by 0.67-1.3 of itself from step to step: this threshold skips some
WAN_CACHE = {"kind": "first_block", "threshold": 0.8}
#: MagCache with a made-up calibration (one ratio per step, resampled to each request's steps) that skips some
MAG = {"kind": "mag", "mag_ratios": [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02, 0.9], "threshold": 0.3}
WAN = dict(num_frames=5, height=32, width=48, num_inference_steps=8, guidance_scale=5.0, seed=0)


def test_a_bad_cache_is_refused_naming_its_field():
    assert parse_cache("first_block") == {"kind": "first_block", "threshold": 0.05}     # diffusers' default
    assert parse_cache('{"kind": "first_block", "threshold": 0.2}')["threshold"] == 0.2
    assert parse_cache("none") is None and parse_cache(None) is None
    for value, field in [("fastest", "cache"), ({"kind": "tea"}, "cache.kind"), ([0.1], "cache"),
                         ({"kind": "first_block", "threshold": -1}, "cache.threshold"),
                         ({"kind": "first_block", "threshold": "high"}, "cache.threshold"),
                         ({"kind": "first_block", "treshold": 0.1}, "cache.treshold"), ("{not json", "cache"),
                         ({"kind": "mag", "max_skip_steps": 1.5}, "cache.max_skip_steps"),
                         ({"kind": "mag", "retention_ratio": 2}, "cache.retention_ratio"),
                         ({"kind": "mag", "mag_ratios": [1.0, -1.0]}, "cache.mag_ratios"),
                         ({"kind": "mag", "mag_ratios": "1,2"}, "cache.mag_ratios"),
                         ({"kind": "mag", "calibrate": "yes"}, "cache.calibrate")]:
        with pytest.raises(RequestError) as e:
            parse_cache(value)
        assert e.value.field == field and field in str(e.value), value
    with pytest.raises(ValueError, match="cache"):
        EngineConfig(cache="fastest")
    assert parse_cache("mag") == {"kind": "mag", "threshold": 0.06, "max_skip_steps": 3, "retention_ratio": 0.2}


def test_a_cache_the_model_cannot_take_is_refused_naming_the_field():
    from longserve.engine.families.latte import LatteFamily
    from longserve.engine.families.wan import WanFamily

    latte = LatteFamily.describe(resolve_model("tiny-latte"))
    wan = WanFamily.describe(resolve_model("tiny-wan"))
    with pytest.raises(RequestError) as e:
        LatteFamily.check_request(latte, _spec("x", PROMPT, 0, "mag", steps=4))
    assert e.value.field == "cache.kind"
    with pytest.raises(RequestError) as e:              # tiny-wan ships no mag_ratios.json
        WanFamily.check_request(wan, _spec("x", PROMPT, 0, "mag", steps=4))
    assert e.value.field == "cache.mag_ratios" and "calibrate" in str(e.value)


def test_the_hooks_leave_diffusers_forward_bit_for_bit_while_no_request_caches():
    from diffusers import WanTransformer3DModel

    from longserve.engine.cache import StepCache

    path = resolve_model("tiny-wan") / "transformer"
    plain, hooked = (WanTransformer3DModel.from_pretrained(path) for _ in range(2))
    WanStepCache(hooked, StepCache(blocks=len(hooked.blocks)))
    x = torch.randn(2, 8, 3, 6, 8, generator=torch.Generator().manual_seed(0))
    t, text = torch.tensor([900.0, 300.0]), torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(plain(x, t, text, return_dict=False)[0], hooked(x, t, text, return_dict=False)[0])


@pytest.fixture
def wan1(pipeline):
    return pipeline("tiny-wan", workers=1)


def test_one_worker_equals_diffusers_first_block_cache_on_wan(wan1):
    from diffusers import WanPipeline
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    pipe = WanPipeline.from_pretrained(str(resolve_model("tiny-wan")))
    pipe.set_progress_bar_config(disable=True)
    apply_first_block_cache(pipe.transformer, FirstBlockCacheConfig(threshold=WAN_CACHE["threshold"]))
    kw = dict(WAN)
    want = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, generator=torch.Generator("cpu").manual_seed(kw.pop("seed")),
                output_type="np", **kw).frames
    cached = wan1(PROMPT, negative_prompt=NEGATIVE, cache=WAN_CACHE, **WAN)
    blocks = 8 * 2 * 2                   # steps x (cond, uncond) x tiny-wan's 2 blocks
    assert cached.timings["blocks"] + cached.timings["blocks_skipped"] == blocks
    assert cached.timings["blocks_skipped"] >= 4, "the threshold should let some steps skip (0.39 off exact)"
    assert np.abs(cached.frames - want).max() <= 1e-4


def _diffusers_mag(config):
    """diffusers' WanPipeline with `apply_mag_cache(config)` -> (frames, the calibrations it prints)."""
    import contextlib
    import io
    import json

    from diffusers import WanPipeline
    from diffusers.hooks import apply_mag_cache

    pipe = WanPipeline.from_pretrained(str(resolve_model("tiny-wan")))
    pipe.set_progress_bar_config(disable=True)
    apply_mag_cache(pipe.transformer, config)
    kw = dict(WAN)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        frames = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, output_type="np",
                      generator=torch.Generator("cpu").manual_seed(kw.pop("seed")), **kw).frames
    lists = [json.loads(line) for line in printed.getvalue().splitlines() if line.startswith("[") and "," in line]
    return frames, lists


def test_mag_cache_calibrates_and_skips_as_diffusers_mag_cache_on_wan(wan1):
    """MagCache: the calibration run measures diffusers' ratios (its conditional context's, printed first), and
    with them each threshold skips the steps diffusers' hook skips, to the same frames."""
    from diffusers.hooks import MagCacheConfig

    _, printed = _diffusers_mag(MagCacheConfig(calibrate=True, num_inference_steps=WAN["num_inference_steps"]))
    calibrated = wan1(PROMPT, negative_prompt=NEGATIVE, cache={"kind": "mag", "calibrate": True}, **WAN)
    assert calibrated.timings["blocks_skipped"] == 0
    assert np.allclose(calibrated.timings["mag_ratios"][0], printed[0], rtol=1e-5)
    ratios = printed[0]
    for threshold, least in ((0.06, 0), (0.3, 8)):
        want, _ = _diffusers_mag(MagCacheConfig(mag_ratios=ratios, threshold=threshold,
                                                num_inference_steps=WAN["num_inference_steps"]))
        got = wan1(PROMPT, negative_prompt=NEGATIVE, cache={"kind": "mag", "mag_ratios": ratios,
                                                            "threshold": threshold}, **WAN)
        assert got.timings["blocks_skipped"] >= least
        assert np.abs(got.frames - want).max() <= 1e-4, threshold


def _spec(rid, prompt, seed, cache, steps=10):
    return GenerationSpec(request_id=rid, prompt=[prompt], negative_prompt=NEGATIVE, num_frames=5, height=32,
                          width=48, num_inference_steps=steps, guidance_scale=5.0, seed=seed, output="np",
                          options={} if cache is None else {"cache": parse_cache(cache)})


def _run(core, schedule):
    """schedule: [(boundary, spec)]: add each spec before that many core steps have run; run to the end."""
    reqs, n = [], 0
    while True:
        reqs += [core.add_request(s) for b, s in schedule if b == n]
        if not core.step() and n >= max(b for b, _ in schedule):
            break
        n += 1
    got = {}
    for r in reqs:
        while (out := r.stream.get(timeout=0)) is not None:
            got.setdefault(r.id, []).append(out)
    return got


def test_a_request_joining_another_five_steps_late_gets_the_frames_it_gets_alone():
    """Two caching requests (and one that does not cache) at different steps in one batch: each keeps its own
    residuals and decisions, so each gets the frames it gets alone."""
    config = WorkerConfig(EngineConfig(model="tiny-wan", workers=1, device="cpu"),
                          str(resolve_checkpoint("tiny-wan")), ParallelPlan("ulysses"))
    specs = [_spec("a", PROMPT, 1, WAN_CACHE, steps=9), _spec("b", "a blue cube sliding", 2, WAN_CACHE, steps=8),
             _spec("c", "waves", 3, None, steps=4), _spec("d", "a green ball", 4, MAG, steps=7)]
    with WorkerPool(1, setup=jobs.setup_worker, setup_args=(config,), device="cpu") as pool:
        core = EngineCore(pool, EngineConfig(max_batch=4, max_steps_per_job=1))
        alone = {s.request_id: _run(core, [(0, s)])[s.request_id] for s in specs}
        together = _run(core, [(0, specs[0]), (5, specs[1]), (5, specs[2]), (5, specs[3])])
    first_shared = min(o.step for o in together["b"] if isinstance(o, StepProgress))
    a_steps = [o for o in together["a"] if isinstance(o, StepProgress)]
    assert [o.batch_size for o in a_steps if o.step == 6] == [4], "b, c and d join a after its 5th step"
    assert first_shared == 1
    for rid, outs in together.items():
        got = np.concatenate([o.frames for o in outs if isinstance(o, FramesChunk)], axis=1)
        want = np.concatenate([o.frames for o in alone[rid] if isinstance(o, FramesChunk)], axis=1)
        assert got.shape == want.shape and want.std() > 0.01
        assert np.abs(got - want).max() <= 1e-5, rid
    skipped = {rid: outs[-1].timings["blocks_skipped"] for rid, outs in together.items()}
    assert skipped["a"] > 0 and skipped["b"] > 0 and skipped["c"] == 0 and skipped["d"] > 0
    assert skipped == {rid: outs[-1].timings["blocks_skipped"] for rid, outs in alone.items()}


# 17 frames -> 5 latent frames; 80x112 -> a 5x7 patch grid: 175 tokens, divisible by neither 2 nor 3
ODD = dict(num_frames=17, height=80, width=112, num_inference_steps=6, guidance_scale=5.0, seed=3)


def test_two_and_three_workers_equal_one_with_caching_on_wan(wan1):
    want = wan1(PROMPT, negative_prompt=NEGATIVE, cache=WAN_CACHE, **ODD)
    assert want.timings["blocks_skipped"] > 0
    calibrated = wan1(PROMPT, negative_prompt=NEGATIVE, cache={"kind": "mag", "calibrate": True}, **ODD)
    mag = wan1(PROMPT, negative_prompt=NEGATIVE, cache=MAG, **ODD)
    for workers, plans in ((2, [("ulysses", False), ("ring", True)]), (3, [("ring", False)])):
        with VideoPipeline.from_pretrained("tiny-wan", workers=workers, device="cpu") as pipe:
            for plan, cfg_parallel in plans:
                pipe.engine.set_plan(plan, cfg_parallel=cfg_parallel)
                got = pipe(PROMPT, negative_prompt=NEGATIVE, cache=WAN_CACHE, **ODD)
                assert got.timings["blocks_skipped"] == want.timings["blocks_skipped"], (workers, plan)
                assert np.abs(got.frames - want.frames).max() <= 1e-4, (workers, plan, cfg_parallel)
            if workers == 2:        # MagCache: the calibration's sums over every rank's real tokens, and the skips
                pipe.engine.set_plan("ulysses", cfg_parallel=False)
                got = pipe(PROMPT, negative_prompt=NEGATIVE, cache={"kind": "mag", "calibrate": True}, **ODD)
                assert np.allclose(got.timings["mag_ratios"], calibrated.timings["mag_ratios"], rtol=1e-5)
                got = pipe(PROMPT, negative_prompt=NEGATIVE, cache=MAG, **ODD)
                assert got.timings["blocks_skipped"] == mag.timings["blocks_skipped"] > 0
                assert np.abs(got.frames - mag.frames).max() <= 1e-4


def test_latte_caches_per_request_and_three_workers_equal_one():
    """Latte's own forward (DSP, and the embedded Ulysses path): 7 frames and a 4x4 patch grid on 3 workers."""
    kw = dict(num_frames=7, num_inference_steps=8, seed=0)
    cache = {"kind": "first_block", "threshold": 0.2}
    prompts = ["a red ball bouncing", "a blue square moving left"]
    with VideoPipeline.from_pretrained("tiny-latte", workers=1, device="cpu") as pipe:
        exact = pipe(prompts, **kw)
        want = pipe(prompts, cache=cache, **kw)
    assert want.timings["blocks_skipped"] > 0 and np.abs(want.frames - exact.frames).max() > 1e-2
    assert want.timings["blocks"] + want.timings["blocks_skipped"] == 8 * 2 * 2 * 6
    with VideoPipeline.from_pretrained("tiny-latte", workers=3, device="cpu") as pipe:
        for plan in ("dsp", "ulysses"):
            pipe.set_parallel(plan)
            got = pipe(prompts, cache=cache, **kw)
            assert got.timings["blocks_skipped"] == want.timings["blocks_skipped"], plan
            assert np.abs(got.frames - want.frames).max() <= 1e-4, plan


def test_each_wan22_expert_keeps_its_own_state_as_diffusers_hook_on_each_transformer(pipeline):
    """Wan 2.2 A14B (two experts): the low-noise expert's first step compares with nothing of the high-noise
    expert's, as diffusers' hook applied to `transformer` and `transformer_2` has it."""
    import PIL.Image
    from diffusers import WanImageToVideoPipeline
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    image = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8))
    kw = dict(num_frames=5, height=32, width=48, num_inference_steps=8, guidance_scale=5.0, guidance_scale_2=2.0,
              seed=1)
    ref = WanImageToVideoPipeline.from_pretrained(str(resolve_model("tiny-wan22-i2v-a14b")))
    ref.set_progress_bar_config(disable=True)
    for model in (ref.transformer, ref.transformer_2):
        apply_first_block_cache(model, FirstBlockCacheConfig(threshold=WAN_CACHE["threshold"]))
    seed = kw.pop("seed")
    want = ref(prompt=PROMPT, negative_prompt=NEGATIVE, image=image, output_type="np",
               generator=torch.Generator("cpu").manual_seed(seed), **kw).frames
    got = pipeline("tiny-wan22-i2v-a14b", workers=1)(PROMPT, negative_prompt=NEGATIVE, image=image, seed=seed,
                                                      cache=WAN_CACHE, **kw)
    assert got.timings["blocks_skipped"] > 0
    assert np.abs(got.frames - want).max() <= 1e-4


def test_an_engine_default_cache_no_request_could_take_is_refused_at_start():
    with pytest.raises(ValueError, match="cache.mag_ratios"):
        VideoPipeline.from_pretrained("tiny-wan", device="cpu", cache="mag")
    with pytest.raises(ValueError, match="cache.kind"):
        VideoPipeline.from_pretrained("tiny-latte", device="cpu", cache='{"kind": "mag", "calibrate": true}')
