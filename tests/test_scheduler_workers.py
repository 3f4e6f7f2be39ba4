"""StepScheduler on the real worker pool: batching requests at different timesteps, guidance
scales and prompt lengths gives the frames each request gets alone; chunked decoding gives
the frames of a whole-video decode."""

import numpy as np
import pytest

from engine import worker as runtime
from engine.request import GenerationSpec
from engine.scheduler import StepScheduler
from pipelines import VideoPipeline


@pytest.fixture(scope="module")
def pipe():
    with VideoPipeline.from_pretrained("tiny-latte", workers=2, device="cpu") as p:
        yield p


def quantize(frames):
    return (np.clip(frames, 0, 1) * 255).round().astype(np.int16)


def spec(rid, prompt, steps, guidance, seed, frames=9, size=32, output="uint8"):
    return GenerationSpec(request_id=rid, prompt=[prompt], negative_prompt="", num_frames=frames, height=size,
                          width=size, num_inference_steps=steps, guidance_scale=guidance, seed=seed, output=output)


def test_batched_requests_at_different_timesteps_give_the_frames_each_gets_alone(pipe):
    reqs = [spec("a", "a red ball bouncing", steps=5, guidance=4.5, seed=1),
            spec("b", "a much longer prompt about a blue cube sliding over a wooden table", steps=3,
                 guidance=1.0, seed=2),   # no CFG: half the rows of the others
            spec("c", "waves", steps=4, guidance=7.0, seed=3)]
    frames: dict[str, list] = {}
    batches = []

    def on_event(kind, req, data):
        if kind == "frames":
            frames.setdefault(req.id, []).append(data["frames"])
        if kind == "batch":
            batches.append(data["batch_size"])

    sched = StepScheduler(pipe.pool, max_batch=3, decode_chunk_frames=4, on_event=on_event, max_steps_per_job=1)
    sched.submit(reqs[0])
    sched.run_iteration()
    sched.run_iteration()          # a is 2 steps ahead when b and c join
    sched.submit(reqs[1])
    sched.submit(reqs[2])
    while sched.run_iteration():
        pass
    assert max(batches) == 3, "the three requests should have shared denoising steps"
    for s in reqs:
        got = np.concatenate(frames[s.request_id], axis=1)[0].astype(np.int16)          # (T, H, W, 3)
        alone = pipe(s.prompt[0], num_frames=s.num_frames, height=s.height, width=s.width,
                     num_inference_steps=s.num_inference_steps, guidance_scale=s.guidance_scale, seed=s.seed)
        want = quantize(alone.frames[0])
        assert got.shape == want.shape == (9, 32, 32, 3)
        assert want.std() > 5, "the reference video should not be flat"
        assert np.abs(got - want).max() <= 1, s.request_id


def test_chunked_decode_matches_the_whole_video_decode(pipe):
    whole = spec("whole", "a red ball bouncing", steps=2, guidance=4.5, seed=7, frames=11, output="np")
    chunked = spec("chunked", "a red ball bouncing", steps=2, guidance=4.5, seed=7, frames=11)
    pool = pipe.pool
    for s in (whole, chunked):
        pool.run(runtime.admit, s)
    try:
        for _ in range(2):
            pool.run(runtime.step, [whole.request_id, chunked.request_id])
        video = pool.run(runtime.decode_next, whole.request_id, 1000)[0]
        parts = []
        while True:
            out = pool.run(runtime.decode_next, chunked.request_id, 3)[0]
            parts.append(out["frames"])
            if out["done"]:
                break
    finally:
        pool.run(runtime.release, [whole.request_id, chunked.request_id])
    early = spec("early", "a red ball bouncing", steps=2, guidance=4.5, seed=7)
    pool.run(runtime.admit, early)
    with pytest.raises(Exception, match="no final frames"):
        pool.run(runtime.decode_next, early.request_id, 3)          # not denoised yet
    assert video["done"] and [p.shape[1] for p in parts] == [3, 3, 3, 2]
    got = np.concatenate(parts, axis=1).astype(np.int16)
    assert got.shape == (1, 11, 32, 32, 3)
    assert np.abs(got - quantize(video["frames"])).max() <= 1


def test_a_killed_worker_fails_the_running_batch_and_the_other_admitted_request_is_readmitted(pipe):
    import os
    import signal

    events = []
    frames = {}

    def on_event(kind, req, data):
        if req is not None:
            events.append((kind, req.id))
        if kind == "frames":
            frames.setdefault(req.id, []).append(data["frames"])
        if kind == "failed":
            events.append(("error", data["message"]))

    sched = StepScheduler(pipe.pool, max_batch=2, max_running=2, on_event=on_event, max_steps_per_job=1)
    x = spec("x", "a red ball", steps=6, guidance=4.5, seed=1, size=32)
    y = spec("y", "a blue cube", steps=3, guidance=4.5, seed=2, size=48)   # another shape: its own batch
    sched.submit(x)
    sched.submit(y)
    sched.run_iteration()          # admits both, steps x
    sched.run_iteration()          # steps y (round-robin)
    os.kill(pipe.pool.pids[1], signal.SIGKILL)
    sched.run_iteration()          # x's turn: its step meets the dead worker
    assert ("failed", "x") in events and ("requeued", "y") in events
    message = next(m for k, m in events if k == "error")
    assert "SIGKILL" in message
    while sched.run_iteration():
        pass
    assert events[-1] == ("completed", "y") and [k for k, r in events if r == "y"].count("admitted") == 2
    alone = pipe(y.prompt[0], num_frames=9, height=48, width=48, num_inference_steps=3, guidance_scale=4.5, seed=2)
    got = np.concatenate(frames["y"], axis=1)[0].astype(np.int16)
    assert np.abs(got - quantize(alone.frames[0])).max() <= 1, "re-admitted from scratch, same video"
