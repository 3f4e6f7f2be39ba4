"""The scheduler tests' harness: a scripted pool that keeps per-request state the way the workers do (admit creates
it, step needs it, a crash wipes it), so a core that steps a request whose worker state is gone fails as it would on
the real pool; `spec` makes a small request, `Harness` an engine core on the scripted pool."""

import numpy as np

from longserve.engine import worker as jobs
from longserve.engine.config import EngineConfig
from longserve.engine.core import EngineCore
from longserve.engine.pool import WorkerError
from longserve.engine.request import GenerationSpec
from longserve.engine.results import Progress


class ScriptedPool:
    """Stands in for WorkerPool: records every job, keeps worker-side request state."""

    def __init__(self):
        self.workers = 2
        self.restarts = 0
        self.ready = True
        self.last_error = None
        self.setup_args = ()
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

    def close(self):
        self.ready = False

    def run(self, fn, *args, timeout_s=None, on_event=None):
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
        if fn is jobs.admit:
            spec = args[0]
            self.held[spec.request_id] = {"spec": spec, "step": 0, "decoded": 0}
            return [jobs.Admission(spec.num_inference_steps, spec.num_frames, 0.0, self.progress(spec.request_id)),
                    None]
        if fn is jobs.step:
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
            return [jobs.StepResult(progress, 0.0), None]
        if fn is jobs.decode_next:
            rid, max_frames = args
            st = self.held[rid]
            spec = st["spec"]
            assert st["step"] == spec.num_inference_steps, "decoding before denoising finished"
            start, stop = st["decoded"], min(spec.num_frames, st["decoded"] + max_frames)
            st["decoded"] = stop
            frames = np.full((1, stop - start, spec.height, spec.width, 3), start, dtype=np.uint8)
            return [jobs.DecodedChunk(frames, start, stop, spec.num_frames, 0.0, stop == spec.num_frames,
                                      self.progress(rid)), None]
        if fn is jobs.release:
            for rid in args[0]:
                self.held.pop(rid, None)
            return [None, None]
        raise AssertionError(f"unexpected job {name}")

    def progress(self, rid):
        st = self.held[rid]
        spec = st["spec"]
        denoised = st["step"] == spec.num_inference_steps
        return Progress(st["step"], (spec.batch_size, spec.num_frames, spec.height, spec.width),
                             denoised and st["decoded"] < spec.num_frames)

    def batches(self) -> list[list[str]]:
        return [list(args[0]) for name, args in self.calls if name == "step"]

    def admitted(self) -> list[str]:
        return [args[0].request_id for name, args in self.calls if name == "admit"]


def spec(rid, steps=3, frames=4, size=32, guidance=4.5):
    return GenerationSpec(request_id=rid, prompt=[f"prompt {rid}"], negative_prompt="", num_frames=frames,
                          height=size, width=size, num_inference_steps=steps, guidance_scale=guidance, seed=0)


class Harness:
    """An EngineCore on a ScriptedPool, driven one step boundary at a time; every output is recorded in order."""

    def __init__(self, pool=None, **config):
        config.setdefault("max_steps_per_job", 1)    # the policy tests count one job per step
        self.pool = pool or ScriptedPool()
        self.core = EngineCore(self.pool, EngineConfig(**config))
        self.sched = self.core.scheduler
        self.reqs, self.events = [], []

    def submit(self, s):
        req = self.core.add_request(s)
        self.reqs.append(req)
        self.drain()
        return req

    def cancel(self, rid, reason="cancelled"):
        found = self.core.abort_request(rid, reason)
        self.drain()
        return found

    def step(self):
        worked = self.core.step()
        self.drain()
        return worked

    def run(self, limit=500):
        for _ in range(limit):
            if not self.step():
                return
        raise AssertionError("the engine did not go idle")

    def drain(self):
        for r in self.reqs:
            while (out := r.stream.get(timeout=0)) is not None:
                self.events.append(out)

    def kinds(self, rid):
        return [type(o).__name__ for o in self.events if o.request_id == rid]

    def of(self, kind):
        return [o for o in self.events if isinstance(o, kind)]
