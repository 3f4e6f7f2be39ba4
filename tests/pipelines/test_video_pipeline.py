"""VideoPipeline: equal to diffusers' LattePipeline at 1 worker, equal to 1 worker at N, robust to a killed worker."""

import os
import signal
import time

import imageio.v3 as iio
import numpy as np
import pytest
import torch

from longserve.engine.pool import WorkerError
from longserve.pipelines import VideoPipeline
from longserve.weights import resolve_latte

PROMPT = "a red ball bouncing"
STEPS = 3
ATOL = 1e-4


@pytest.fixture
def pipe1(pipeline):
    return pipeline("tiny-latte", workers=1)


@pytest.fixture(scope="module", params=[2, 3])
def pipe_n(request):
    with VideoPipeline.from_pretrained("tiny-latte", workers=request.param, device="cpu") as p:
        yield p


def test_one_worker_matches_diffusers_latte_pipeline(pipe1):
    from diffusers import LattePipeline

    ref = LattePipeline.from_pretrained(str(resolve_latte("tiny-latte")))
    ref.set_progress_bar_config(disable=True)
    want = ref(prompt=PROMPT, video_length=16, height=64, width=64, num_inference_steps=STEPS,
               guidance_scale=4.5, generator=torch.Generator("cpu").manual_seed(0), output_type="np",
               clean_caption=False).frames
    got = pipe1(PROMPT, num_frames=16, height=64, width=64, num_inference_steps=STEPS, guidance_scale=4.5, seed=0)
    assert got.frames.shape == want.shape == (1, 16, 64, 64, 3)
    assert got.frames.dtype == np.float32
    assert want.std() > 0.05, "the reference video should not be flat"
    assert np.abs(got.frames - want).max() <= ATOL


def test_vae_decodes_untiled_as_diffusers_and_in_diffusers_tiles_with_vae_tiling(pipe1):
    """128x128 frames are larger than the tiny VAE's 64 px tile: tiled and untiled pixels differ, and each
    setting equals diffusers' LattePipeline with the same setting (tiled: after `pipe.vae.enable_tiling()`),
    the tiled one on 2 workers that split the frames."""
    from diffusers import LattePipeline

    ref = LattePipeline.from_pretrained(str(resolve_latte("tiny-latte")))
    ref.set_progress_bar_config(disable=True)
    kw = dict(height=128, width=128, num_inference_steps=2, guidance_scale=4.5)

    def diffusers_frames():
        return ref(prompt=PROMPT, video_length=16, generator=torch.Generator("cpu").manual_seed(1), output_type="np",
                   clean_caption=False, **kw).frames

    plain = diffusers_frames()
    ref.vae.enable_tiling()
    tiled = diffusers_frames()
    assert np.abs(plain - tiled).max() > 0.05, "tiling should change these pixels, or the test cannot tell"
    got = pipe1(PROMPT, num_frames=16, seed=1, **kw).frames
    assert np.abs(got - plain).max() <= ATOL
    with VideoPipeline.from_pretrained("tiny-latte", workers=2, device="cpu", vae_tiling=True) as pipe:
        assert pipe.info.vae_tiling is True
        got = pipe(PROMPT, num_frames=16, seed=1, **kw).frames
    assert np.abs(got - tiled).max() <= ATOL


#: (plan, frames) by worker count: each plan on 2 and on 3 workers, each once on 13 frames (divisible by neither)
CASES = {2: [("dsp", 13), ("ulysses", 24)], 3: [("dsp", 24), ("ulysses", 13)]}


@pytest.mark.parametrize("case", [0, 1])
def test_n_workers_match_one_worker_on_uneven_frames_and_patch_grid(pipe1, pipe_n, case):
    # 80x112 pixels -> a 5x7 patch grid: 35 patches divide by neither 2 nor 3
    parallel, num_frames = CASES[pipe_n.pool.workers][case]
    kw = dict(num_frames=num_frames, height=80, width=112, num_inference_steps=STEPS, guidance_scale=4.5, seed=3)
    pipe_n.set_parallel(parallel)
    want = pipe1(PROMPT, **kw).frames
    got = pipe_n(PROMPT, **kw).frames
    assert got.shape == (1, num_frames, 80, 112, 3)
    assert np.abs(got - want).max() <= ATOL


def test_prompt_list_negative_prompt_and_latent_output(pipe1):
    out = pipe1([PROMPT, "a blue cube"], negative_prompt=["blurry", "dark"], num_frames=5, height=32, width=48,
                num_inference_steps=2, guidance_scale=3.0, seed=1, output_type="latent")
    assert tuple(out.frames.shape) == (2, 4, 5, 4, 6)
    single = pipe1("a blue cube", num_frames=5, height=32, width=48, num_inference_steps=2, seed=1)
    steps_seen = []
    pipe1("a blue cube", num_frames=5, height=32, width=48, num_inference_steps=4, seed=1,
          callback=lambda step, total: steps_seen.append((step, total)))
    assert steps_seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert single.frames.shape == (1, 5, 32, 48, 3)


def test_save_writes_an_mp4_with_the_requested_frames_and_size(pipe1, tmp_path):
    out = pipe1(PROMPT, num_frames=9, height=48, width=64, num_inference_steps=2, seed=0)
    path = out.save(tmp_path / "ball.mp4", fps=8)
    frames = iio.imread(path)
    assert frames.shape == (9, 48, 64, 3)


@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt=""), "prompt"),
    (dict(prompt=3), "prompt"),
    (dict(num_frames=0), "num_frames"),
    (dict(num_frames=2.5), "num_frames"),
    (dict(height=50), "height"),
    (dict(width=-16), "width"),
    (dict(num_inference_steps=0), "num_inference_steps"),
    (dict(guidance_scale="high"), "guidance_scale"),
    (dict(seed=-1), "seed"),
    (dict(output_type="pil"), "output_type"),
    (dict(negative_prompt=["a", "b"]), "negative_prompt"),
])
def test_invalid_arguments_raise_value_error_naming_the_argument(pipe1, kwargs, field):
    args = dict(prompt=PROMPT, num_frames=4, height=32, width=32, num_inference_steps=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        pipe1(**args)


def test_from_pretrained_rejects_bad_options():
    with pytest.raises(ValueError, match="colour"):
        VideoPipeline.from_pretrained("tiny-latte", colour="red")
    with pytest.raises(ValueError, match="parallel"):
        VideoPipeline.from_pretrained("tiny-latte", parallel="zigzag")
    with pytest.raises(ValueError, match="workers"):
        VideoPipeline.from_pretrained("tiny-latte", workers=0)
    with pytest.raises(ValueError, match="vae_tiling"):
        VideoPipeline.from_pretrained("tiny-latte", vae_tiling="yes")
    with pytest.raises((ValueError, FileNotFoundError), match="no-such-model"):
        VideoPipeline.from_pretrained("/tmp/no-such-model")
    with pytest.raises(ValueError, match="default_steps"):
        VideoPipeline.from_pretrained("tiny-latte", default_steps=0)
    # a request default the model refuses for every request stops the start, before any worker loads
    with pytest.raises(ValueError, match="request defaults.*exactly 4 steps"):
        VideoPipeline.from_pretrained("tiny-live", default_steps=20)


def test_killed_worker_fails_the_call_quickly_and_the_next_call_succeeds(pipe_n):
    pipe_n.set_parallel("dsp")
    victim = pipe_n.pool.pids[-1]

    def kill_at_step_2(step, total):
        if step == 2:
            os.kill(victim, signal.SIGKILL)

    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="SIGKILL"):
        pipe_n(PROMPT, num_frames=8, height=32, width=32, num_inference_steps=50, seed=0, callback=kill_at_step_2)
    assert time.monotonic() - t0 < 30
    out = pipe_n(PROMPT, num_frames=8, height=32, width=32, num_inference_steps=2, seed=0)
    assert out.frames.shape == (1, 8, 32, 32, 3)
    assert victim not in pipe_n.pool.pids


def test_torchrun_launched_group_matches_one_worker(pipe1, tmp_path):
    import subprocess
    import sys

    from longserve.engine.dist import find_free_port

    path = str(tmp_path / "frames.npy")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(find_free_port()),
           os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "torchrun_generate.py"), path, "ulysses"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(np.load(path + ".workers.npy")) == 2
    want = pipe1(PROMPT, num_frames=13, height=80, width=112, num_inference_steps=3, guidance_scale=4.5, seed=3)
    assert np.abs(np.load(path) - want.frames).max() <= ATOL


def _cfg_groups_in_use(ctx):
    return ctx.state["family"].cfg_groups is not None


def test_cfg_parallel_on_two_groups_matches_one_worker_and_switches_off(pipe1):
    kw = dict(num_frames=7, height=48, width=80, num_inference_steps=STEPS, guidance_scale=4.5, seed=5)
    want = pipe1(PROMPT, **kw).frames
    with VideoPipeline.from_pretrained("tiny-latte", workers=2, cfg_parallel=True, device="cpu") as pipe:
        assert pipe.pool.run(_cfg_groups_in_use) == [True, True]
        assert np.abs(pipe(PROMPT, **kw).frames - want).max() <= ATOL
        pipe.engine.set_plan("dsp", cfg_parallel=False)
        assert pipe.pool.run(_cfg_groups_in_use) == [False, False], "the plan says no CFG-parallel: none runs"
        assert not pipe.info.plan.cfg_parallel
        assert np.abs(pipe(PROMPT, **kw).frames - want).max() <= ATOL


def test_latte1_shaped_checkpoint_runs_sharded_and_matches_diffusers(tmp_path):
    """Latte-1's exact transformer config (16 heads x 72, caption 4096), one block pair, random weights."""
    from diffusers import LattePipeline
    from latte_models import build_latte1_shaped_checkpoint

    ckpt = build_latte1_shaped_checkpoint(tmp_path / "latte-1-shaped")
    ref = LattePipeline.from_pretrained(ckpt)
    ref.set_progress_bar_config(disable=True)
    kw = dict(height=48, width=80, num_inference_steps=2, guidance_scale=4.5)
    want = ref(prompt=PROMPT, video_length=16, generator=torch.Generator("cpu").manual_seed(0),
               output_type="latent", clean_caption=False, **kw).frames
    del ref
    with VideoPipeline.from_pretrained(str(ckpt), workers=2, parallel="dsp", device="cpu") as pipe:
        got = pipe(PROMPT, num_frames=16, seed=0, output_type="latent", **kw).frames
    assert got.shape == want.shape == (1, 4, 16, 6, 10)
    assert (got - want).abs().max().item() <= ATOL


def _all_reduce_after_failing_on_rank_1(ctx, how):
    """Rank 1 fails while its peers wait for it in an all-reduce on the video workers' own group."""
    from longserve.engine import comm

    if ctx.pg.rank == 1:
        if how == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory")
        if how == "exit":
            os._exit(3)
        raise RuntimeError("a bug on one rank")
    return comm.all_reduce(torch.ones(1), ctx.pg)


@pytest.fixture(scope="module")
def failing_pipe():
    """One 2-worker pipeline that the three failures below break in turn (each restarts it)."""
    with VideoPipeline.from_pretrained("tiny-latte", workers=2, device="cpu") as pipe:
        pipe.pool.error_grace_s = 1.0
        yield pipe


@pytest.mark.parametrize("how, kind", [("raise", "internal"), ("oom", "out_of_memory"), ("exit", "worker_died")])
def test_a_failure_on_one_video_worker_restarts_the_pool_and_the_next_video_is_exact(pipe1, failing_pipe, how, kind):
    kw = dict(num_frames=7, height=32, width=48, num_inference_steps=2, guidance_scale=4.5, seed=9)
    want = pipe1(PROMPT, **kw).frames
    restarts = failing_pipe.pool.restarts
    with pytest.raises(WorkerError) as e:
        failing_pipe.pool.run(_all_reduce_after_failing_on_rank_1, how)
    assert (e.value.kind, e.value.rank) == (kind, 1)
    assert failing_pipe.pool.restarts == restarts + 1, "a collective may be pending: the pool must not be reused as is"
    assert np.abs(failing_pipe(PROMPT, **kw).frames - want).max() <= ATOL


def test_a_request_made_again_after_a_worker_restart_is_not_handed_out_twice():
    """The engine sends a request back to the queue when the workers restart under it (Requeued) and makes it
    again from its first frame: `stream` hands out only the frames it has not yet, `__call__` keeps the remake."""
    from types import SimpleNamespace

    from longserve.engine.config import GenerationDefaults
    from longserve.engine.outputs import Finished, FramesChunk, Requeued

    def chunk(start, stop, value):
        return FramesChunk("r", np.full((1, stop - start, 2, 2, 3), value, np.float32), start, stop, 9, 0.0)

    outputs = [chunk(0, 5, 0.1), Requeued("r", "restart"), chunk(0, 5, 0.2), chunk(5, 9, 0.3),
               Finished("r", {"encode_s": 0.0, "transformer_s": 0.0, "vae_s": 0.0})]
    from longserve.engine.engine import Accepted

    engine = SimpleNamespace(submit=lambda accepted: iter(outputs), accept=lambda request: Accepted(request, 9),
                             defaults=GenerationDefaults(num_frames=9, height=2, width=2, num_inference_steps=2,
                                                         guidance_scale=1.0, fps=8))
    pipe = VideoPipeline(engine)
    streamed = list(pipe.stream(PROMPT, seed=0))
    assert [c.shape[0] for c in streamed] == [5, 4]
    assert [float(c[0, 0, 0, 0]) for c in streamed] == [pytest.approx(0.1), pytest.approx(0.3)]
    whole = pipe(PROMPT, seed=0).frames
    assert whole.shape[1] == 9 and float(whole[0, 0, 0, 0, 0]) == pytest.approx(0.2), "the remake, not both"


class _ChecksNothing:
    """A family whose own checks pass everything: what `complete_request` itself does is under test."""

    @staticmethod
    def check_request(desc, spec):
        return spec


def test_one_completion_fills_the_defaults_and_counts_seconds_under_the_frame_rule():
    from longserve.engine.config import Capabilities, EngineConfig, GenerationDefaults, ModelDescription
    from longserve.engine.request import RequestError, RequestInput, complete_request, frame_count

    # the frame rule: the nearest rule*k+1 (halves up), rounded down for a session's length, at least `at_least`
    assert [frame_count(f, 4) for f in (32, 31, 30, 1, 0.2)] == [33, 33, 29, 1, 1]
    assert frame_count(32, 4, down=True) == 29 and frame_count(16, 1) == 16
    assert frame_count(9 + 8, 4, at_least=13) == 17 and frame_count(9 + 1, 4, at_least=13) == 13
    defaults = GenerationDefaults(num_frames=9, height=64, width=64, num_inference_steps=20, guidance_scale=5.0,
                                  fps=16, options={"overlap_history": 9})
    desc = ModelDescription(family="test", pipeline="Test", heads=2, size_multiple=16, frame_multiple=4,
                            defaults=defaults, options=("fps", "overlap_history", "video", "live"),
                            capabilities=Capabilities(video="optional", live=True))
    operator = EngineConfig(default_steps=3)

    def complete(**given):
        return complete_request(RequestInput(prompt="a red ball", **given), _ChecksNothing, desc, operator)

    spec = complete(seconds=2, seed=0)
    assert (spec.num_frames, spec.height, spec.width, spec.fps) == (33, 64, 64, 16)
    assert (spec.num_inference_steps, spec.guidance_scale, spec.negative_prompt) == (3, 5.0, ""), \
        "the operator's steps, the model's guidance"
    assert spec.options == {"fps": 16} and spec.prompt == ["a red ball"], "a model conditioned on fps gets it"
    assert complete(num_frames=13).num_frames == 13 and complete().num_frames == 9
    video = np.zeros((10, 64, 64, 3), np.uint8)
    assert complete(seconds=1, fps=8, options={"video": video}).num_frames == 9 + 8, "an extension: seconds added"
    assert complete(seconds=2, live=True).num_frames == 29, "a session never runs past its length"
    assert complete().seed != complete().seed, "no seed: a random one"
    for given, field in ((dict(seconds=-1), "seconds"), (dict(seconds=2, num_frames=5), "seconds"),
                         (dict(fps=0), "fps"), (dict(prompt=3), "prompt")):
        with pytest.raises(RequestError) as e:
            complete_request(RequestInput(**{"prompt": "a", **given}), _ChecksNothing, desc, operator)
        assert e.value.field == field, given
