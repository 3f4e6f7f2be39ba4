"""StepScheduler policy, on a scripted pool: batching across timesteps, joins and leaves at step
boundaries, max_batch, round-robin over shapes, cancellation, crash recovery, lifecycle.

The fake pool keeps per-request state the way the workers do (admit creates it, step needs
it, a crash wipes it), so a scheduler that steps a request whose worker state is gone fails
here just as it would on the real pool.
"""

import threading
import time

import numpy as np
import pytest

from engine.pool import WorkerError
from engine.scheduler import QueueFullError, RequestState, StepScheduler
from engine.request import GenerationSpec


class ScriptedPool:
    """Stands in for WorkerPool: records every job, keeps worker-side request state."""

    def __init__(self):
        self.restarts = 0
        self.ready = True
        self.calls: list[tuple[str, tuple]] = []
        self.held: dict[str, dict] = {}
        self.crash_when = None      # fn(name, args) -> True: a worker dies during this call
        self.oom_when = None        # fn(name, args) -> True: a worker runs out of memory (the pool restarts)
        self.start_failures = 0     # the next start() calls that fail to load the model
        self.raise_when = None      # fn(name, args) -> failure dict: every worker raises it (pool stays up)

    @property
    def state(self):
        return "ready" if self.ready else "restarting"

    def start(self):
        if self.start_failures:
            self.start_failures -= 1
            raise WorkerError("worker 0 failed to start: OSError: weights missing", kind="setup", rank=0)
        self.ready = True
        return self

    def run(self, fn, *args, timeout_s=None):
        name = fn.__name__
        assert self.ready, f"{name} sent to a pool that is not up"
        if self.oom_when and self.oom_when(name, args):
            self.oom_when = None
            self.restarts += 1
            self.held.clear()
            raise WorkerError("worker 1 failed (out_of_memory): OutOfMemoryError", kind="out_of_memory", rank=1)
        if self.crash_when and self.crash_when(name, args):
            self.crash_when = None
            self.restarts += 1
            self.held.clear()
            raise WorkerError(f"worker 1 (pid 4242) died during {name} (killed by SIGKILL); the pool was restarted",
                              kind="worker_died", rank=1)
        if self.raise_when and (failure := self.raise_when(name, args)):
            raise WorkerError(failure["message"], kind=failure["kind"], rank=0, field=failure.get("field"))
        self.calls.append((name, args))
        if name == "admit":
            spec = args[0]
            self.held[spec.request_id] = {"spec": spec, "step": 0, "decoded": 0}
            return [{"request_id": spec.request_id, "num_steps": spec.num_inference_steps,
                     "num_frames": spec.num_frames, "encode_s": 0.0, **self.progress(spec.request_id)}, None]
        if name == "step":
            ids, max_steps = args
            progress = []
            for _ in range(max_steps):
                for rid in ids:
                    st = self.held[rid]  # KeyError = stepping a request the workers do not hold
                    assert st["step"] < st["spec"].num_inference_steps, f"{rid} stepped past its last step"
                    st["step"] += 1
                progress.append({rid: self.progress(rid) for rid in ids})
                if any(self.held[rid]["step"] == self.held[rid]["spec"].num_inference_steps for rid in ids):
                    break
            return [{"progress": progress, "compute_s": 0.0}, None]
        if name == "decode_next":
            rid, max_frames = args
            st = self.held[rid]
            spec = st["spec"]
            assert st["step"] == spec.num_inference_steps, "decoding before denoising finished"
            start, stop = st["decoded"], min(spec.num_frames, st["decoded"] + max_frames)
            st["decoded"] = stop
            frames = np.full((1, stop - start, spec.height, spec.width, 3), start, dtype=np.uint8)
            return [{"frames": frames, "start": start, "stop": stop, "num_frames": spec.num_frames, "vae_s": 0.0,
                     "done": stop == spec.num_frames, "timings": {}, **self.progress(rid)}, None]
        if name == "release":
            for rid in args[0]:
                self.held.pop(rid, None)
            return [None, None]
        raise AssertionError(f"unexpected job {name}")

    def progress(self, rid) -> dict:
        st = self.held[rid]
        spec = st["spec"]
        denoised = st["step"] == spec.num_inference_steps
        return {"steps_done": st["step"], "batch_key": (spec.batch_size, spec.num_frames, spec.height, spec.width),
                "decodable": denoised and st["decoded"] < spec.num_frames}

    def batches(self) -> list[list[str]]:
        return [list(args[0]) for name, args in self.calls if name == "step"]


def spec(rid, steps=3, frames=4, size=32, guidance=4.5):
    return GenerationSpec(request_id=rid, prompt=[f"prompt {rid}"], negative_prompt="", num_frames=frames,
                          height=size, width=size, num_inference_steps=steps, guidance_scale=guidance, seed=0)


class Recorder:
    def __init__(self):
        self.events = []

    def __call__(self, kind, req, data):
        self.events.append((kind, req.id if req is not None else None, data))

    def kinds(self, rid):
        return [k for k, r, _ in self.events if r == rid]

    def of(self, kind):
        return [(r, d) for k, r, d in self.events if k == kind]


def make(pool=None, **kw):
    pool = pool or ScriptedPool()
    rec = Recorder()
    kw.setdefault("max_steps_per_job", 1)    # the policy tests count one job per step
    return StepScheduler(pool, on_event=rec, **kw), pool, rec


def drain(sched, limit=500):
    for _ in range(limit):
        if not sched.run_iteration():
            return
    raise AssertionError("the scheduler did not go idle")


def test_same_shape_requests_share_a_batch_at_different_timesteps_and_guidance():
    sched, pool, rec = make(max_batch=4)
    sched.submit(spec("a", steps=5, guidance=1.0))
    sched.run_iteration()
    sched.run_iteration()                       # a is at step 2
    sched.submit(spec("b", steps=3, guidance=9.0))
    sched.run_iteration()                       # b joins at this boundary
    assert pool.batches()[:3] == [["a"], ["a"], ["a", "b"]]
    assert pool.held["a"]["step"] == 3 and pool.held["b"]["step"] == 1
    drain(sched)
    assert rec.kinds("a")[-1] == rec.kinds("b")[-1] == "completed"


def test_a_finished_request_leaves_the_batch_and_the_others_go_on():
    sched, pool, rec = make(max_batch=4)
    sched.submit(spec("short", steps=2))
    sched.submit(spec("long", steps=5))
    drain(sched)
    assert pool.batches() == [["short", "long"], ["short", "long"], ["long"], ["long"], ["long"]]
    assert [r for r, _ in rec.of("completed")] == ["short", "long"]


def test_max_batch_caps_each_step_and_the_oldest_go_first():
    sched, pool, _ = make(max_batch=2, max_running=3)
    for rid in "abc":
        sched.submit(spec(rid, steps=2))
    drain(sched)
    batches = pool.batches()
    assert max(len(b) for b in batches) == 2
    assert batches[0] == ["a", "b"]
    assert sum(b.count("c") for b in batches) == 2


def test_shape_groups_take_turns_so_a_lone_shape_is_not_starved():
    sched, pool, rec = make(max_batch=2, max_running=8)
    for i in range(4):
        sched.submit(spec(f"small{i}", steps=4, size=32))
    sched.submit(spec("big", steps=4, size=64))
    for _ in range(8):
        sched.run_iteration()
        sched.submit(spec(f"late{len(pool.calls)}", steps=4, size=32))  # the small shape keeps arriving
    shapes = ["big" if b == ["big"] else "small" for b in pool.batches()[:8]]
    assert shapes == ["small", "big"] * 4, pool.batches()
    drain(sched)
    assert rec.kinds("big")[-1] == "completed"


def test_new_requests_join_only_up_to_max_running_and_then_at_each_boundary():
    sched, pool, rec = make(max_batch=2, max_running=2)
    for rid in "abc":
        sched.submit(spec(rid, steps=2, frames=4))
    sched.run_iteration()
    assert [n for n, _ in pool.calls].count("admit") == 2
    assert sched.queue_position("c") == 0 and sched.get("c").state is RequestState.WAITING
    drain(sched)
    assert rec.kinds("c")[-1] == "completed"


def test_cancelling_a_running_request_frees_its_slot_at_the_next_step_and_its_batchmate_completes():
    sched, pool, rec = make(max_batch=2, max_running=2)
    for rid in "abc":
        sched.submit(spec(rid, steps=4))
    sched.run_iteration()
    assert pool.batches() == [["a", "b"]]
    assert sched.cancel("a")
    sched.run_iteration()                       # next boundary: a released, c admitted, b+c step
    assert ("release", (["a"],)) in pool.calls
    assert pool.batches()[-1] == ["b", "c"]
    assert "a" not in pool.held
    drain(sched)
    assert rec.kinds("a")[-1] == "cancelled" and "step" not in rec.kinds("a")[2:]
    assert rec.kinds("b")[-1] == rec.kinds("c")[-1] == "completed"
    assert not sched.cancel("a"), "a finished request cannot be cancelled twice"


def test_cancelling_a_waiting_request_removes_it_from_the_queue_at_once():
    sched, pool, rec = make(max_batch=1, max_running=1)
    sched.submit(spec("a"))
    sched.submit(spec("b"))
    sched.submit(spec("c"))
    sched.run_iteration()
    assert sched.waiting_ids() == ["b", "c"]
    assert sched.cancel("b")
    assert sched.waiting_ids() == ["c"] and rec.kinds("b")[-1] == "cancelled"
    drain(sched)
    assert all(args[0].request_id != "b" for name, args in pool.calls if name == "admit")


def test_a_crash_fails_only_the_running_batch_and_re_admits_the_other_admitted_requests():
    sched, pool, rec = make(max_batch=2, max_running=3)
    sched.submit(spec("x1", steps=4, size=32))
    sched.submit(spec("x2", steps=4, size=32))
    sched.submit(spec("y", steps=4, size=64))    # admitted, other shape: not in the crashing batch
    sched.submit(spec("queued", steps=2, size=32))
    sched.run_iteration()                        # admits x1, x2, y; steps the x batch
    sched.run_iteration()                        # steps y
    pool.crash_when = lambda name, args: name == "step" and "x1" in args[0]
    sched.run_iteration()
    failed = dict(rec.of("failed"))
    assert set(failed) == {"x1", "x2"}
    assert failed["x1"]["code"] == "worker_crashed" and "SIGKILL" in failed["x1"]["message"]
    assert [r for r, _ in rec.of("requeued")] == ["y"]
    assert sched.waiting_ids() == ["y", "queued"], "the re-admitted request goes before the queued ones"
    drain(sched)
    assert rec.kinds("y")[-1] == "completed" and rec.kinds("queued")[-1] == "completed"
    assert [args[0].request_id for name, args in pool.calls if name == "admit"].count("y") == 2
    assert sched.crashes == 1


def test_a_crash_while_decoding_fails_that_request_only():
    sched, pool, rec = make(max_batch=2, decode_chunk_frames=2)
    sched.submit(spec("a", steps=1, frames=6))
    sched.submit(spec("b", steps=5, frames=6))
    pool.crash_when = lambda name, args: name == "decode_next" and args[0] == "a"
    drain(sched)
    assert rec.kinds("a")[-1] == "failed" and rec.kinds("b")[-1] == "completed"
    assert "requeued" in rec.kinds("b")


def test_an_error_raised_on_every_worker_fails_that_request_and_keeps_the_pool():
    sched, pool, rec = make(max_batch=4)
    pool.raise_when = lambda name, args: (name == "admit" and args[0].request_id == "bad"
                                          and {"message": "negative_prompt must be a string", "kind": "input",
                                               "field": "negative_prompt"})
    sched.submit(spec("good"))
    sched.submit(spec("bad"))
    drain(sched)
    assert dict(rec.of("failed"))["bad"]["code"] == "invalid_request"
    assert rec.kinds("good")[-1] == "completed"
    assert pool.restarts == 0 and "requeued" not in rec.kinds("good")


def test_lifecycle_goes_waiting_running_decoding_finished_with_every_step_and_chunk_reported():
    sched, pool, rec = make(max_batch=1, decode_chunk_frames=3)
    req = sched.submit(spec("a", steps=3, frames=7))
    assert req.state is RequestState.WAITING
    sched.run_iteration()
    assert req.state is RequestState.RUNNING
    sched.run_iteration()
    sched.run_iteration()
    assert req.state is RequestState.DECODING
    drain(sched)
    assert req.state is RequestState.FINISHED_COMPLETED
    assert rec.kinds("a") == ["admitted", "step", "step", "step", "decoding", "frames", "frames", "frames",
                              "completed"]
    steps = [d["step"] for r, d in rec.of("step")]
    assert steps == [1, 2, 3]
    chunks = [(d["start"], d["stop"]) for r, d in rec.of("frames")]
    assert chunks == [(0, 3), (3, 6), (6, 7)]
    assert "a" not in pool.held, "a finished request's worker state is released"


def test_decoding_one_request_is_interleaved_with_the_denoising_steps_of_others():
    sched, pool, _ = make(max_batch=2, decode_chunk_frames=1)
    sched.submit(spec("done_soon", steps=1, frames=3))
    sched.submit(spec("long", steps=6, frames=3))
    drain(sched)
    names = [n for n, args in pool.calls if n in ("step", "decode_next")]
    first_decode = names.index("decode_next")
    assert names[first_decode:first_decode + 4] == ["decode_next", "step", "decode_next", "step"]


def test_the_queue_refuses_beyond_max_waiting_and_a_duplicate_id():
    sched, _, _ = make(max_batch=1, max_waiting=2)
    sched.submit(spec("a"))
    sched.submit(spec("b"))
    with pytest.raises(QueueFullError):
        sched.submit(spec("c"))
    with pytest.raises(ValueError, match="already"):
        sched.submit(spec("a"))


@pytest.mark.parametrize("kw", [dict(max_batch=0), dict(max_batch=True), dict(decode_chunk_frames=0),
                                dict(max_running=-1), dict(max_waiting=-2)])
def test_bad_scheduler_options_are_refused(kw):
    with pytest.raises(ValueError):
        StepScheduler(ScriptedPool(), **kw)


def test_the_background_thread_runs_submissions_to_completion_and_stops():
    pool = ScriptedPool()
    done = threading.Event()
    finished = []

    def on_event(kind, req, data):
        if kind == "completed":
            finished.append(req.id)
            if len(finished) == 5:
                done.set()

    sched = StepScheduler(pool, max_batch=3, on_event=on_event).start()
    try:
        for i in range(5):
            sched.submit(spec(f"r{i}", steps=3))
            time.sleep(0.001)
        assert done.wait(10), f"only {finished} finished"
    finally:
        sched.stop()
    assert not sched.alive
    assert sorted(finished) == [f"r{i}" for i in range(5)]


def test_out_of_memory_fails_only_the_batch_that_hit_it_and_requeues_the_others():
    sched, pool, rec = make(max_batch=2, max_running=3)
    sched.submit(spec("x1", steps=3, size=32))
    sched.submit(spec("x2", steps=3, size=32))
    sched.submit(spec("y", steps=3, size=64))
    pool.oom_when = lambda name, args: name == "step" and "x1" in args[0]
    drain(sched)
    failed = dict(rec.of("failed"))
    assert set(failed) == {"x1", "x2"} and failed["x1"]["code"] == "out_of_memory" and failed["x1"]["rank"] == 1
    assert rec.kinds("y")[-1] == "completed" and "requeued" in rec.kinds("y"), "its state died with the pool"


def test_with_oom_retry_the_requests_of_an_out_of_memory_batch_run_again_one_at_a_time():
    sched, pool, rec = make(max_batch=4, oom_retry=True)
    for rid in ("a", "b", "c"):
        sched.submit(spec(rid, steps=2))
    pool.oom_when = lambda name, args: name == "step" and len(args[0]) == 3
    drain(sched)
    assert [r for r, _ in rec.of("completed")] == ["a", "b", "c"] and not rec.of("failed")
    after = pool.batches()          # the 3-request batch that ran out of memory raised before it was recorded
    assert after and all(len(b) == 1 for b in after), after


def test_a_model_that_fails_to_load_keeps_requests_queued_and_retries_with_backoff():
    sched, pool, rec = make(max_batch=2, setup_retry_max_s=0.0)
    sched.submit(spec("a", steps=2))
    sched.submit(spec("b", steps=2))
    pool.ready, pool.start_failures = False, 3
    for _ in range(3):
        sched.run_iteration()
    assert sched.setup_failures == 3 and sched.waiting_ids() == ["a", "b"], "nobody's request fails for it"
    assert not rec.of("failed") and [d["failures"] for _, d in rec.of("pool")] == [1, 2, 3]
    drain(sched)
    assert sched.setup_failures == 0
    assert [r for r, _ in rec.of("completed")] == ["a", "b"]


def test_a_quiet_batch_runs_several_steps_per_job_and_a_newcomer_joins_at_the_next_boundary():
    sched, pool, rec = make(max_batch=4, max_steps_per_job=4)
    sched.submit(spec("a", steps=10))
    sched.run_iteration()                        # admitted; nothing else waits: 4 steps in one job
    assert pool.batches() == [["a"]] and pool.held["a"]["step"] == 4
    assert [d["step"] for _, d in rec.of("step")] == [1, 2, 3, 4], "progress is still reported per step"
    sched.submit(spec("b", steps=3))             # arrives during (after) that job: joins at the next boundary
    sched.run_iteration()                        # admits b; a and b run min(4, 6, 3) = 3 steps together
    assert pool.batches()[-1] == ["a", "b"] and (pool.held["a"]["step"], pool.held["b"]["step"]) == (7, 3)
    sched.submit(spec("c", steps=9))
    sched.run_iteration()                        # admits c, decodes b (done), then a and c run 3 steps
    assert pool.batches()[-1] == ["a", "c"] and (pool.held["a"]["step"], pool.held["c"]["step"]) == (10, 3)
    assert sched.cancel("c")
    sched.run_iteration()                        # cancelled at the next boundary
    assert "c" not in pool.held
    drain(sched)
    assert [d["step"] for r, d in rec.of("step") if r == "a"] == list(range(1, 11))
    assert rec.kinds("a")[-1] == rec.kinds("b")[-1] == "completed" and rec.kinds("c")[-1] == "cancelled"
