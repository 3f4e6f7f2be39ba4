"""The live loop off the critical path (engine/live_lane.py, live_loop.py, live_frames.py): uint8 frames made on
the device and handed out through shared memory, a decode lane that runs beside the steps, and the overlapped and
pipelined loops making exactly the serial loop's frames, in order, with prompt switches, stop and cancellation."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from causal_models import build_tiny_causal, cancelled_at_first_chunk, stopped_session, switched_session

from longserve.engine import worker as jobs
from longserve.engine.live_frames import FrameSlots, SharedFrames, frames_out, to_uint8
from longserve.engine.live_lane import DecodeLane
from longserve.engine.live_loop import loop_roles
from longserve.engine.outputs import Cancelled, FramesChunk, LiveChunkInfo
from longserve.pipelines import VideoPipeline

H, W = 16, 80
FRAMES = 1 + (4 * 3 - 1) * 4          # 4 chunks of 3 latent frames


def test_uint8_frames_made_on_the_device_are_the_uint8_output_and_np_is_within_half_a_level():
    from diffusers.video_processor import VideoProcessor

    from longserve.engine.decoding import to_pixels

    video = torch.randn(2, 3, 5, 8, 12, generator=torch.Generator().manual_seed(0)) * 0.8   # past [-1, 1] too
    want = to_pixels(video, VideoProcessor(vae_scale_factor=8), "uint8")                     # the host path
    got = to_uint8(video)
    assert got.dtype == torch.uint8 and tuple(got.shape) == want.shape == (2, 5, 8, 12, 3)
    np.testing.assert_array_equal(got.numpy(), want)
    slots = FrameSlots()
    try:
        handle = slots.put(got)
        assert isinstance(handle, SharedFrames)
        np.testing.assert_array_equal(frames_out(handle, "uint8"), want)
        floats = to_pixels(video, VideoProcessor(vae_scale_factor=8), "np")
        np_frames = frames_out(handle, "np")
        assert np_frames.dtype == np.float32
        assert 0 < np.abs(np_frames - floats).max() <= 0.5 / 255 + 1e-7          # the one change, bounded
    finally:
        slots.close()


def test_frame_slots_are_a_ring_that_grows_to_the_chunk():
    slots = FrameSlots(slots=2)
    try:
        a = slots.put(torch.zeros(1, 2, 4, 4, 3, dtype=torch.uint8))
        b = slots.put(torch.ones(1, 2, 4, 4, 3, dtype=torch.uint8))
        c = slots.put(torch.full((1, 2, 4, 4, 3), 2, dtype=torch.uint8))
        assert a.name != b.name and c.name == a.name                         # reused, not one segment a chunk
        assert (frames_out(b, "uint8") == 1).all() and (frames_out(c, "uint8") == 2).all()
        d = slots.put(torch.full((1, 9, 8, 8, 3), 3, dtype=torch.uint8))     # larger: the slot grows
        assert d.name != b.name and (frames_out(d, "uint8") == 3).all()
    finally:
        slots.close()


def test_the_decode_lane_runs_beside_the_caller_in_submission_order():
    lane = DecodeLane(torch.device("cpu"), threads=1)
    started, release, order = threading.Event(), threading.Event(), []

    def first():
        started.set()
        assert release.wait(10), "the caller never ran while the lane was busy"
        order.append(1)
        return threading.current_thread().name

    try:
        f1 = lane.submit(first)
        f2 = lane.submit(lambda: order.append(2))
        assert started.wait(10)
        release.set()                                   # the caller runs while the lane holds `first`
        assert f1.result(10).startswith("decode-lane") and f2.result(10) is None
        assert order == [1, 2]
    finally:
        lane.close()


def test_loop_roles():
    assert loop_roles("serial", 2).lane is None
    one = loop_roles("pipelined", 1)                    # one worker: the overlapped loop
    assert (one.loop, one.lane, one.transfer) == ("overlapped", 0, False)
    two = loop_roles("pipelined", 3)
    assert (two.lane, two.denoisers, two.transfer) == (2, (0, 1), True)


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory):
    return build_tiny_causal(tmp_path_factory.mktemp("causal") / "tiny-causal")


def run_all(p) -> dict:
    """A schedule's video as frames, its chunks' infos, and the jobs the pool ran for it."""
    jobs_run = []
    run = p.pool.run

    def recording(fn, *args, **kw):
        jobs_run.append((fn.__name__, args))
        return run(fn, *args, **kw)

    p.pool.run = recording
    try:
        spec = p.make_spec("", num_frames=FRAMES, height=H, width=W, seed=1,
                           prompt_schedule=[[0, "a red ball bouncing"], [2, "a blue ball bouncing"]])
        chunks = [o for o in p.engine.submit(spec) if isinstance(o, FramesChunk)]
    finally:
        p.pool.run = run
    return {"frames": np.concatenate([c.frames for c in chunks], axis=1), "live": [c.live for c in chunks],
            "jobs": jobs_run}


def test_overlapped_and_pipelined_loops_make_the_serial_loop_s_frames_and_never_wait_on_a_decode(causal_dir):
    runs = {}
    for loop, workers in (("serial", 1), ("overlapped", 1), ("pipelined", 2)):
        with VideoPipeline.from_pretrained(str(causal_dir), workers=workers, live_loop=loop) as p:
            runs[loop] = run_all(p)
    want = runs["serial"]
    assert want["live"] == [LiveChunkInfo(chunk=i, prompt_index=int(i >= 2)) for i in range(4)]
    for loop in ("overlapped", "pipelined"):
        got = runs[loop]
        assert got["live"] == want["live"]                                   # in order, switched at the same chunk
        np.testing.assert_array_equal(got["frames"], want["frames"])         # exact: the same decode, elsewhere
        if loop == "pipelined":                 # latents come out of the decode worker too, as the serial loop's
            with VideoPipeline.from_pretrained(str(causal_dir), workers=2, live_loop=loop) as p:
                latents = p("a red ball bouncing", seed=0, num_frames=FRAMES, height=H, width=W,
                            output_type="latent").frames
            with VideoPipeline.from_pretrained(str(causal_dir), workers=1) as p:
                want_latents = p("a red ball bouncing", seed=0, num_frames=FRAMES, height=H, width=W,
                                 output_type="latent").frames
            assert (latents - want_latents).abs().max() <= 1e-5
            with VideoPipeline.from_pretrained(str(causal_dir), workers=2, live_loop="overlapped") as p:
                ulysses = p("a red ball bouncing", seed=0, num_frames=FRAMES, height=H, width=W,
                            output_type="latent").frames                  # Ulysses on 2, the lane on rank 0
            assert (ulysses - want_latents).abs().max() <= 1e-5
        names = [n for n, _ in got["jobs"]]
        assert "decode_next" not in names
        # every chunk but the last is decoded in the job that makes the next one's steps
        ticks = [args for n, args in got["jobs"] if n == "live_tick"]
        assert len(ticks) == 4 and sum(bool(args[0]) for args in ticks) == 3
    assert "live_tick" not in [n for n, _ in want["jobs"]]


@pytest.mark.parametrize("loop,workers", [("overlapped", 1), ("pipelined", 2)])
def test_a_live_switch_stop_and_cancel_keep_their_timing_outside_the_serial_loop(causal_dir, loop, workers):
    with VideoPipeline.from_pretrained(str(causal_dir), workers=workers, live_loop=loop) as p:
        seen, first_blue, session = switched_session(p, 5, H, W)
        # at the next chunk to start, which is one later than in the serial loop (tests/pipelines/test_live_video.py:
        # 2 or 3): chunk 1's frames come out of the job that made chunk 2 beside its decode, and the job making
        # chunk 3 may have begun before the call
        assert first_blue in (3, 4) and all(p_ == int(i >= first_blue) for i, p_ in seen)
        assert first_blue <= session.last_switch.by_chunk <= 4       # the engine's promise (`prompt.received`) holds
        assert [i for i, _ in seen] == list(range(6))

        chunks, session = stopped_session(p, H, W)
        got = [c.index for c in chunks]
        # after the chunk being made when the stop reached the workers: chunk 2, or 3 when the job making chunk 3 had
        # begun (one later than the serial loop's, as the switch)
        assert 3 <= len(got) <= 4 and got == list(range(len(got)))
        assert session.handle.status().state.value == "finished_completed"
        assert session.timings["vae_s"] > 0 and session.timings["transformer_s"] > 0

        outs, handle = cancelled_at_first_chunk(p, H, W)            # ends at the next step boundary
        assert isinstance(outs[-1], Cancelled) and handle.status().state.value == "finished_cancelled"
        assert sum(isinstance(o, FramesChunk) for o in outs) <= 2
        # the pool is still sound: a next request makes the serial loop's first chunk
        again = list(p.stream("a red ball bouncing", num_frames=9, height=H, width=W, seed=0))
        assert len(again) == 1 and again[0].shape == (9, H, W, 3)


def test_a_tick_without_a_lane_decodes_then_steps(causal_dir):
    """The serial roles in `live_tick` (a family with no lane) run the two jobs' work in turn: its result is the
    decode's chunk and the steps' progress."""
    assert jobs.live_tick.__name__ == "live_tick"
    with VideoPipeline.from_pretrained(str(causal_dir), workers=1) as p:
        spec = p.make_spec("a red ball bouncing", num_frames=FRAMES, height=H, width=W, seed=0)
        p.pool.run(jobs.admit, spec)
        p.pool.run(jobs.step, [spec.request_id], 4)                  # chunk 0 is final
        tick = p.pool.run(jobs.live_tick, [spec.request_id], 4, spec.request_id, 100)[0]
        frames = frames_out(tick.frames, "uint8")           # read before the worker (the slot's owner) exits
        p.pool.run(jobs.release, [spec.request_id])
    assert tick.lane and tick.decoded.live == LiveChunkInfo(chunk=0, prompt_index=0)
    assert frames.shape == (1, 9, H, W, 3) and frames.dtype == np.uint8
    assert tick.step is not None and tick.step.progress
