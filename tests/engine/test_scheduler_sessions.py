"""The scheduler on a scripted pool (tests/support/scheduler_harness.py), continued: a two-expert model's offload
(requests grouped by expert, so swaps are rare) and live sessions (no running slot, held prompt switches, the live
KV budget), and what a failed request's message may carry."""

import os

import pytest
from scheduler_harness import Harness, ScriptedPool, spec

from longserve.engine import worker as jobs
from longserve.engine.config import EngineConfig
from longserve.engine.outputs import Finished
from longserve.engine.results import Progress
from longserve.engine.scheduler import RequestState, Scheduler


class TwoExpertPool(ScriptedPool):
    """A two-expert model (Wan 2.2): a request's first half of steps uses expert 0, the rest expert 1 (in its batch
    key and `Progress.model`); the pool counts swaps the way the workers' ExpertResidency makes them."""

    def __init__(self):
        super().__init__()
        self.resident, self.swaps = 0, 0

    def expert(self, rid):
        st = self.held[rid]
        return 0 if st["step"] < st["spec"].num_inference_steps // 2 else 1

    def run(self, fn, *args, timeout_s=None, on_event=None):
        if fn is jobs.step:
            experts = {self.expert(rid) for rid in args[0]}
            assert len(experts) == 1, "a batch mixes experts"
            if experts != {self.resident}:
                self.resident, self.swaps = experts.pop(), self.swaps + 1
        return super().run(fn, *args, timeout_s=timeout_s, on_event=on_event)

    def progress(self, rid):
        p = super().progress(rid)
        e = self.expert(rid)
        return Progress(p.steps_done, (*p.batch_key, e), p.decodable, model=e)


def run_staggered(offload, n=8, every=2, steps=10, **config):
    """n requests, one every `every` step boundaries, through a two-expert model; the pool's swaps."""
    h = Harness(pool=TwoExpertPool(), max_batch=8, offload=offload, **config)
    for i in range(n):
        h.submit(spec(f"r{i}", steps=steps))
        for _ in range(every):
            h.step()
    h.run()
    assert len(h.of(Finished)) == n
    return h


def test_expert_offload_groups_staggered_requests_by_expert_so_swaps_are_rare():
    grouped = run_staggered("expert")
    plain = run_staggered("none")
    print(f"\nswaps for 8 staggered requests: {grouped.pool.swaps} grouped by expert, {plain.pool.swaps} round-robin")
    assert grouped.pool.swaps <= 2 < plain.pool.swaps
    # the same steps ran: every request stepped its 10 steps, in batches of one expert each
    assert sorted(sum(grouped.pool.batches(), [])) == sorted(sum(plain.pool.batches(), []))


PATIENCE = 3


def test_expert_offload_serves_a_request_waiting_for_the_other_expert_within_its_patience():
    # a request every boundary keeps expert 0 busy for ever: the first request, at expert 1 since its 5th step,
    # must still be served after at most `offload_max_wait` batches that passed it over
    h = Harness(pool=TwoExpertPool(), max_batch=2, max_running=8, offload="expert", offload_max_wait=PATIENCE)
    longest = 0
    for i in range(30):
        h.submit(spec(f"r{i}", steps=10))
        h.step()
        for r in h.core.scheduler._admitted:
            if r.state is RequestState.RUNNING and r.batch_key is not None:
                longest = max(longest, r.passed_over)
    h.run()
    assert len(h.of(Finished)) == 30
    print(f"\nlongest wait {longest} (patience {PATIENCE})")
    assert longest <= PATIENCE, longest
    with pytest.raises(ValueError, match="offload"):
        EngineConfig(offload="disk")


# -- live sessions (issue 32) ------------------------------------------------------------------------------


def live(rid, steps=400):
    s = spec(rid, steps=steps)
    s.live = True
    return s


def test_live_sessions_take_no_running_slot_and_a_video_of_their_shape_steps_at_the_next_boundary():
    h = Harness(max_batch=2, max_running=2)
    for rid in ("s1", "s2", "s3"):             # more sessions than slots and than a batch holds
        h.submit(live(rid))
    h.step()
    assert h.pool.admitted() == ["s1", "s2", "s3"]
    h.step()
    h.submit(spec("video", steps=2))
    h.step()                                   # admitted at once: the sessions hold no slot
    h.step()                                   # and stepped at the next boundary, ahead of the sessions
    assert h.pool.admitted()[-1] == "video" and "video" in h.pool.batches()[-1]
    h.step()
    assert "video" in h.pool.batches()[-1], "a video goes first in its shape's batch until it is done"
    # the sessions take turns for the room left: none is left out two boundaries in a row
    batches = h.pool.batches()[-3:]
    assert all(any(s in b for b in batches) for s in ("s1", "s2", "s3")), batches


def test_a_burst_of_prompt_switches_is_held_as_one_and_sent_once_a_chunk_starts():
    from longserve.engine.results import Admission
    from longserve.engine.scheduler import PromptSwitch

    sched = Scheduler(EngineConfig())
    req = sched.submit(live("s"))
    assert sched.schedule().admit == [req]
    mid_chunk = Progress(1, ("k",), False, switch_ready=False)
    sched.admitted(req, Admission(400, 4, 0.0, mid_chunk))
    results = [sched.switch("s", {"prompt": f"p{i}"}) for i in range(5000)]
    assert results[0] == PromptSwitch(1, None) and results[-1] == PromptSwitch(5000, 4999)
    assert [r.replaced for r in results[1:]] == [r.prompt_index - 1 for r in results[1:]]
    out = sched.schedule()
    assert out.update == [] and out.step.num_steps == 1, "held mid-chunk; one step at a time until it is sent"
    sched.stepped(req, Progress(2, ("k",), False, switch_ready=True))     # the next chunk starts
    assert sched.schedule().update == [(req, [{"prompt": "p4999", "prompt_index": 5000}])]
    assert sched.schedule().update == [], "nothing more to send: 5,000 switches made one worker job"
    assert sched.switch("nope", {"prompt": "x"}) is None


def test_the_live_kv_budget_defaults_to_a_quarter_of_a_workers_memory():
    from longserve.engine.memory import system_memory_bytes

    ram = system_memory_bytes()
    assert 0 < ram <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert Scheduler(EngineConfig(device="cpu", workers=2)).kv_budget == int(ram * 0.25 / 2)   # shared RAM
    assert Scheduler(EngineConfig(device="cpu", live_kv_budget=3)).kv_budget == 3 << 20       # as given


def test_a_failed_requests_message_carries_no_traceback_and_no_server_path():
    """Issue 32: a failed video's `error.message` is what a client reads; the worker's traceback stays in the log."""
    from longserve.engine.core import failure_for
    from longserve.engine.pool import _job_error, describe_failure

    def broken_forward():
        open("/srv/longserve/weights/missing-shard.safetensors").read()

    try:
        broken_forward()
    except OSError as e:
        failure = describe_failure(e, collectives_entered=True)
    error = _job_error(jobs.step, 1, failure, restarted=True)
    assert "Traceback" in str(error) and __file__ in str(error)         # what the log gets
    for kind in ("internal", "worker_died", "out_of_memory", "timeout", "setup"):
        error.kind = kind
        message = failure_for(error, "step", str(error)).message
        assert "Traceback" not in message and "\n" not in message, message
        assert __file__ not in message and "/srv/longserve" not in message, message
        assert "FileNotFoundError" in message and "missing-shard.safetensors" in message, message
