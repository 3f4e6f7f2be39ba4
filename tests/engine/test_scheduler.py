"""The scheduler's decisions and the engine core that carries them out, on a scripted pool: batching across
timesteps, joins and leaves at step boundaries, max_batch, round-robin over shapes, cancellation, crash
recovery, the lifecycle and its typed outputs.

The scripted pool keeps per-request state the way the workers do (admit creates it, step needs it, a
crash wipes it), so a core that steps a request whose worker state is gone fails here just as it would on
the real pool.
"""

import threading

import pytest
from scheduler_harness import Harness, ScriptedPool, spec

from longserve.engine.config import EngineConfig
from longserve.engine.core import EngineCore
from longserve.engine.outputs import (
    Admitted,
    Cancelled,
    Failed,
    Finished,
    FramesChunk,
    Queued,
    RequestFailure,
    Requeued,
    StepProgress,
)
from longserve.engine.scheduler import QueueFullError, RequestState, Scheduler


def test_same_shape_requests_share_a_batch_at_different_timesteps_and_guidance():
    h = Harness(max_batch=4)
    h.submit(spec("a", steps=5, guidance=1.0))
    h.step()                                   # admits a
    h.step()
    h.step()                                   # a is at step 2
    h.submit(spec("b", steps=3, guidance=9.0))
    h.step()                                   # admits b while a steps alone
    h.step()                                   # b joins at the first boundary after its admission
    assert h.pool.batches()[:4] == [["a"], ["a"], ["a"], ["a", "b"]]
    assert h.pool.held["a"]["step"] == 4 and h.pool.held["b"]["step"] == 1
    h.run()
    assert h.kinds("a")[-1] == h.kinds("b")[-1] == "Finished"


def test_a_finished_request_leaves_the_batch_and_the_others_go_on():
    h = Harness(max_batch=4)
    h.submit(spec("short", steps=2))
    h.submit(spec("long", steps=5))
    h.run()
    assert h.pool.batches() == [["short", "long"], ["short", "long"], ["long"], ["long"], ["long"]]
    assert [o.request_id for o in h.of(Finished)] == ["short", "long"]


def test_max_batch_caps_each_step_and_the_oldest_go_first():
    h = Harness(max_batch=2, max_running=3)
    for rid in "abc":
        h.submit(spec(rid, steps=2))
    h.run()
    batches = h.pool.batches()
    assert max(len(b) for b in batches) == 2
    assert batches[0] == ["a", "b"]
    assert sum(b.count("c") for b in batches) == 2


def test_shape_groups_take_turns_so_a_lone_shape_is_not_starved():
    h = Harness(max_batch=2, max_running=8)
    for i in range(4):
        h.submit(spec(f"small{i}", steps=4, size=32))
    h.submit(spec("big", steps=4, size=64))
    for _ in range(9):
        h.step()
        h.submit(spec(f"late{len(h.pool.calls)}", steps=4, size=32))  # the small shape keeps arriving
    shapes = ["big" if b == ["big"] else "small" for b in h.pool.batches()[:8]]
    assert shapes == ["small", "big"] * 4, h.pool.batches()
    h.run()
    assert h.kinds("big")[-1] == "Finished"


def test_new_requests_join_only_up_to_max_running_and_then_at_each_boundary():
    h = Harness(max_batch=2, max_running=2)
    for rid in "abc":
        h.submit(spec(rid, steps=2, frames=4))
    h.step()
    assert h.pool.admitted() == ["a", "b"]
    assert h.sched.get("c").state is RequestState.WAITING and h.sched.waiting_ids() == ["c"]
    h.run()
    assert h.kinds("c")[-1] == "Finished"


def test_queue_positions_are_told_to_each_waiting_request_as_they_change():
    h = Harness(max_batch=1, max_running=1)
    for rid in "abc":
        h.submit(spec(rid, steps=2))
    assert [(o.request_id, o.position) for o in h.of(Queued)] == [("a", 0), ("b", 1), ("c", 2)]
    h.step()                                   # a admitted: b and c move up
    assert [(o.request_id, o.position) for o in h.of(Queued)][3:] == [("b", 0), ("c", 1)]
    h.cancel("b")                              # c moves up again
    assert (h.of(Queued)[-1].request_id, h.of(Queued)[-1].position) == ("c", 0)


def test_cancelling_a_running_request_frees_its_slot_at_the_next_step_and_its_batchmate_completes():
    h = Harness(max_batch=2, max_running=2)
    for rid in "abc":
        h.submit(spec(rid, steps=4))
    h.step()
    h.step()
    assert h.pool.batches() == [["a", "b"]]
    assert h.cancel("a")
    h.step()                                   # next boundary: a released, c admitted, b steps
    assert ("release", (["a"],)) in h.pool.calls
    assert "a" not in h.pool.held and h.pool.batches()[-1] == ["b"]
    h.step()
    assert h.pool.batches()[-1] == ["b", "c"]
    h.run()
    assert h.kinds("a")[-1] == "Cancelled" and h.kinds("a").count("StepProgress") == 1
    assert h.kinds("b")[-1] == h.kinds("c")[-1] == "Finished"
    assert not h.cancel("a"), "a finished request cannot be cancelled twice"


def test_cancelling_a_waiting_request_removes_it_from_the_queue_at_once():
    h = Harness(max_batch=1, max_running=1)
    for rid in "abc":
        h.submit(spec(rid))
    h.step()
    assert h.sched.waiting_ids() == ["b", "c"]
    assert h.cancel("b")
    assert h.sched.waiting_ids() == ["c"] and h.kinds("b")[-1] == "Cancelled"
    h.run()
    assert "b" not in h.pool.admitted()


def test_a_crash_fails_only_the_running_batch_and_re_admits_the_other_admitted_requests():
    h = Harness(max_batch=2, max_running=3)
    h.submit(spec("x1", steps=4, size=32))
    h.submit(spec("x2", steps=4, size=32))
    h.submit(spec("y", steps=4, size=64))      # admitted, other shape: not in the crashing batch
    h.submit(spec("queued", steps=2, size=32))
    h.step()                                   # admits x1, x2, y
    h.step()                                   # steps the x batch
    h.step()                                   # steps y
    h.pool.crash_when = lambda name, args: name == "step" and "x1" in args[0]
    h.step()
    failed = {o.request_id: o.error for o in h.of(Failed)}
    assert set(failed) == {"x1", "x2"}
    assert failed["x1"].code == "worker_crashed" and "SIGKILL" in failed["x1"].message
    assert [o.request_id for o in h.of(Requeued)] == ["y"]
    assert h.sched.waiting_ids() == ["y", "queued"], "the re-admitted request goes before the queued ones"
    h.run()
    assert h.kinds("y")[-1] == "Finished" and h.kinds("queued")[-1] == "Finished"
    assert h.pool.admitted().count("y") == 2
    assert h.core.crashes == 1


def test_an_abort_ends_a_request_as_its_reason_says_waiting_running_or_when_the_engine_closes():
    h = Harness(max_batch=1, max_running=1)
    for rid in "abc":
        h.submit(spec(rid, steps=5))
    h.step()
    h.step()                                   # a runs; b and c wait
    assert h.cancel("b", "released")
    assert h.of(Cancelled) == [Cancelled("b", "released")], "a waiting request ends at once"
    shutdown = RequestFailure("server_shutdown", "the server shut down", kind="aborted")
    assert h.cancel("a", shutdown)
    assert h.cancel("a", "deleted"), "still running: asked again, but the first reason stays"
    h.step()                                   # a is released at this boundary; c is admitted
    assert [o for o in h.of(Failed) if o.request_id == "a"] == [Failed("a", shutdown)]
    assert "a" not in h.pool.held and h.pool.admitted() == ["a", "c"]
    assert h.cancel("c", "disconnected")
    h.core.close()                             # before the boundary that would release it
    h.drain()
    assert h.kinds("c")[-1] == "Cancelled" and h.of(Cancelled)[-1].reason == "disconnected"
    assert [h.kinds(rid).count(k) for rid in "abc" for k in ("Cancelled", "Failed", "Finished")] == [
        0, 1, 0, 1, 0, 0, 1, 0, 0], "each request ends exactly once"


def test_a_crash_while_decoding_fails_that_request_only():
    h = Harness(max_batch=2, decode_chunk_frames=2)
    h.submit(spec("a", steps=1, frames=6))
    h.submit(spec("b", steps=5, frames=6))
    h.pool.crash_when = lambda name, args: name == "decode_next" and args[0] == "a"
    h.run()
    assert h.kinds("a")[-1] == "Failed" and h.kinds("b")[-1] == "Finished"
    assert "Requeued" in h.kinds("b")


def test_an_error_raised_on_every_worker_fails_that_request_and_keeps_the_pool():
    h = Harness(max_batch=4)
    h.pool.raise_when = lambda name, args: (name == "admit" and args[0].request_id == "bad"
                                            and {"message": "negative_prompt must be a string", "kind": "input",
                                                 "field": "negative_prompt"})
    h.submit(spec("good"))
    h.submit(spec("bad"))
    h.run()
    bad = h.of(Failed)[0].error
    assert (bad.code, bad.kind, bad.field) == ("invalid_request", "input", "negative_prompt")
    assert h.kinds("good")[-1] == "Finished"
    assert h.pool.restarts == 0 and "Requeued" not in h.kinds("good")


def test_lifecycle_goes_waiting_running_decoding_finished_with_every_step_and_chunk_reported():
    h = Harness(max_batch=1, decode_chunk_frames=3)
    req = h.submit(spec("a", steps=3, frames=7))
    assert req.state is RequestState.WAITING
    h.step()
    assert req.state is RequestState.RUNNING
    for _ in range(3):
        h.step()
    assert req.state is RequestState.DECODING
    h.run()
    assert req.state is RequestState.FINISHED_COMPLETED
    assert h.kinds("a") == ["Queued", "Admitted", "StepProgress", "StepProgress", "StepProgress", "FramesChunk",
                            "FramesChunk", "FramesChunk", "Finished"]
    steps = h.of(StepProgress)
    assert [s.step for s in steps] == [1, 2, 3] and [s.denoised for s in steps] == [False, False, True]
    assert [(c.start, c.stop) for c in h.of(FramesChunk)] == [(0, 3), (3, 6), (6, 7)]
    assert h.of(Admitted)[0].num_steps == 3
    assert "a" not in h.pool.held, "a finished request's worker state is released"


def test_decoding_one_request_is_interleaved_with_the_denoising_steps_of_others():
    h = Harness(max_batch=2, decode_chunk_frames=1)
    h.submit(spec("done_soon", steps=1, frames=3))
    h.submit(spec("long", steps=6, frames=3))
    h.run()
    names = [n for n, args in h.pool.calls if n in ("step", "decode_next")]
    first_decode = names.index("decode_next")
    assert names[first_decode:first_decode + 4] == ["decode_next", "step", "decode_next", "step"]


def test_the_queue_refuses_beyond_max_queue_and_a_duplicate_id():
    h = Harness(max_batch=1, max_queue=2)
    h.submit(spec("a"))
    h.submit(spec("b"))
    with pytest.raises(QueueFullError):
        h.submit(spec("c"))
    with pytest.raises(ValueError, match="already"):
        h.submit(spec("a"))


@pytest.mark.parametrize("kw", [dict(max_batch=0), dict(max_batch=True), dict(decode_chunk_frames=0),
                                dict(max_running=-1), dict(max_queue=-2), dict(max_steps_per_job=0),
                                dict(job_timeout_s=0), dict(workers="2")])
def test_bad_engine_options_are_refused_naming_them(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        Scheduler(EngineConfig(**kw))


def test_out_of_memory_fails_only_the_batch_that_hit_it_and_requeues_the_others():
    h = Harness(max_batch=2, max_running=3)
    h.submit(spec("x1", steps=3, size=32))
    h.submit(spec("x2", steps=3, size=32))
    h.submit(spec("y", steps=3, size=64))
    h.pool.oom_when = lambda name, args: name == "step" and "x1" in args[0]
    h.run()
    failed = {o.request_id: o.error for o in h.of(Failed)}
    assert set(failed) == {"x1", "x2"} and failed["x1"].code == "out_of_memory" and failed["x1"].rank == 1
    assert h.kinds("y")[-1] == "Finished" and "Requeued" in h.kinds("y"), "its state died with the pool"


def test_with_oom_retry_the_requests_of_an_out_of_memory_batch_run_again_one_at_a_time():
    h = Harness(max_batch=4, oom_retry=True)
    for rid in ("a", "b", "c"):
        h.submit(spec(rid, steps=2))
    h.pool.oom_when = lambda name, args: name == "step" and len(args[0]) == 3
    h.run()
    assert [o.request_id for o in h.of(Finished)] == ["a", "b", "c"] and not h.of(Failed)
    after = h.pool.batches()        # the 3-request batch that ran out of memory raised before it was recorded
    assert after and all(len(b) == 1 for b in after), after


def test_a_model_that_fails_to_load_keeps_requests_queued_and_retries_with_backoff():
    h = Harness(max_batch=2, setup_retry_max_s=0.0)
    h.submit(spec("a", steps=2))
    h.submit(spec("b", steps=2))
    h.pool.ready, h.pool.start_failures = False, 3
    failures = []
    for _ in range(3):
        h.step()
        failures.append(h.core.setup_failures)
    assert failures == [1, 2, 3] and h.sched.waiting_ids() == ["a", "b"], "nobody's request fails for it"
    assert not h.of(Failed)
    h.run()
    assert h.core.setup_failures == 0
    assert [o.request_id for o in h.of(Finished)] == ["a", "b"]


def test_a_quiet_batch_runs_several_steps_per_job_and_a_newcomer_joins_at_the_next_boundary():
    h = Harness(max_batch=4, max_steps_per_job=4)
    h.submit(spec("a", steps=10))
    h.step()                                   # admitted
    h.step()                                   # nothing else waits: 4 steps in one job
    assert h.pool.batches() == [["a"]] and h.pool.held["a"]["step"] == 4
    assert [s.step for s in h.of(StepProgress)] == [1, 2, 3, 4], "progress is still reported per step"
    h.submit(spec("b", steps=3))               # arrives during (after) that job
    h.step()                                   # admits b; a steps once (not quiet)
    h.step()                                   # a and b run min(4, 5, 3) = 3 steps together
    assert h.pool.batches()[-1] == ["a", "b"] and (h.pool.held["a"]["step"], h.pool.held["b"]["step"]) == (8, 3)
    h.submit(spec("c", steps=9))
    h.step()                                   # admits c, decodes b (done), a steps once
    assert h.cancel("c")
    h.step()                                   # c is released at this boundary, before it ever stepped
    assert "c" not in h.pool.held
    h.run()
    assert [s.step for s in h.of(StepProgress) if s.request_id == "a"] == list(range(1, 11))
    assert h.kinds("a")[-1] == h.kinds("b")[-1] == "Finished" and h.kinds("c")[-1] == "Cancelled"


def test_a_handle_reads_its_outputs_in_a_thread_and_in_an_event_loop():
    """The engine's own loop drives the core; a sync and an async reader each get their request's outputs."""
    import asyncio

    from longserve.engine.engine import RequestHandle

    class Engine:                           # what a handle needs of the engine: abort, liveness
        def abort(self, rid, reason):
            return core.abort_request(rid, reason)

        def _check_running(self):
            pass

    core = EngineCore(ScriptedPool(), EngineConfig(max_batch=2))
    a = RequestHandle(Engine(), core.add_request(spec("a", steps=3)))
    b = RequestHandle(Engine(), core.add_request(spec("b", steps=2)))
    got = {}

    def read_sync():
        got["a"] = [type(o).__name__ for o in a]

    async def read_async():
        got["b"] = [type(o).__name__ async for o in b]

    thread = threading.Thread(target=read_sync)
    thread.start()
    loop_thread = threading.Thread(target=lambda: asyncio.run(read_async()))
    loop_thread.start()
    while not (a.finished and b.finished):
        core.step()
    thread.join(10)
    loop_thread.join(10)
    assert got["a"][-1] == got["b"][-1] == "Finished"
    assert got["a"].count("StepProgress") == 3 and got["b"].count("StepProgress") == 2
    assert [o for o in (Cancelled, Failed) if o.__name__ in got["a"] + got["b"]] == []


def test_a_crash_during_one_admission_requeues_the_same_boundarys_others_without_telling_them():
    h = Harness(max_batch=4)
    for rid in "abc":
        h.submit(spec(rid, steps=2))
    h.pool.crash_when = lambda name, args: name == "admit" and args[0].request_id == "b"
    h.step()                                   # a admitted, b's admission crashes the pool, c never ran
    assert h.kinds("b")[-1] == "Failed" and "Requeued" in h.kinds("a")
    assert "Requeued" not in h.kinds("c"), "c's admission never ran: nothing of it was lost"
    assert h.sched.waiting_ids() == ["a", "c"]
    h.run()
    assert h.kinds("a")[-1] == h.kinds("c")[-1] == "Finished"
    assert [o.admissions for o in h.of(Admitted) if o.request_id == "c"] == [1]


def test_a_crash_in_the_release_at_a_boundary_voids_the_rest_of_that_boundary():
    h = Harness(max_batch=2, max_running=2)
    for rid in "abc":
        h.submit(spec(rid, steps=3))
    h.step()                                   # a and b admitted
    h.step()                                   # a and b step
    h.cancel("a")
    h.pool.crash_when = lambda name, args: name == "release"
    h.step()                                   # a's release meets a dead worker: b lost its state too
    assert h.kinds("a").count("Cancelled") == 1 and h.kinds("a")[-1] == "Cancelled"
    assert "Requeued" in h.kinds("b")
    assert h.pool.admitted() == ["a", "b"], "nothing of the void decision ran: c was not admitted on it"
    h.run()
    for rid in "bc":
        finals = [k for k in h.kinds(rid) if k in ("Finished", "Failed", "Cancelled")]
        assert finals == ["Finished"], (rid, h.kinds(rid))


def test_an_error_outside_the_pools_failure_model_fails_the_call_restarts_the_workers_and_the_rest_go_on():
    class OddPool(ScriptedPool):
        def restart(self):
            self.restarts += 1
            self.held.clear()

        def run(self, fn, *args, **kw):
            if fn.__name__ == "step" and "x" in args[0]:
                raise OSError("too many open files")
            return super().run(fn, *args, **kw)

    h = Harness(OddPool(), max_batch=1, max_running=2)
    h.submit(spec("x", steps=2, size=32))
    h.submit(spec("y", steps=2, size=64))
    h.run()
    assert h.kinds("x")[-1] == "Failed" and h.of(Failed)[0].error.kind == "internal"
    assert "OSError" in h.of(Failed)[0].error.message
    assert h.kinds("y")[-1] == "Finished" and "Requeued" in h.kinds("y")


def test_closing_ends_every_unfinished_request_with_one_final_output():
    h = Harness(max_batch=1, max_running=1)
    h.submit(spec("running", steps=5))
    h.submit(spec("waiting", steps=5))
    h.step()
    h.step()
    h.core.close()
    h.drain()
    for rid in ("running", "waiting"):
        assert h.kinds(rid)[-1] == "Failed", h.kinds(rid)
    assert {o.error.code for o in h.of(Failed)} == {"engine_closed"}
    h.reqs[0].stream.put(Finished("running"))
    assert h.reqs[0].stream.get(timeout=0) is None, "nothing is told after a request's final output"
