"""`StepScheduler`: step-level batching of video requests on one worker pool (coordinator side).

A diffusion request is a loop of denoising steps, so, as vLLM does per decoding
iteration, the scheduler decides at every *step boundary* which requests run the next
step together. It drives the worker jobs of `engine.worker` (`admit`, `step`,
`decode_next`, `release`) and never touches the model, HTTP or files: what happens to a
request is reported through one callback, `on_event(kind, request, data)`. It is the
request lifecycle of `engine.engine.VideoEngine`, which the Python pipeline drives in its
own thread and the HTTP server on a background thread.

Lifecycle (`RequestState`), one way only except for the crash recovery noted below::

    WAITING --admit--> RUNNING --last step--> DECODING --last frame--> FINISHED_COMPLETED
       |                  |                      |
       +------------------+----------------------+--> FINISHED_CANCELLED | FINISHED_FAILED

- WAITING: submitted, no worker state; a FIFO queue.
- RUNNING: admitted (prompt encoded on the workers, latents and a diffusers scheduler of
  its own prepared there); it takes part in denoising batches. Frames that are already
  final (a long video's finished segments) are decoded meanwhile.
- DECODING: denoised; its remaining frames are VAE-decoded a chunk at a time.
- FINISHED_*: its worker state is released.

One iteration (`run_iteration`), i.e. one step boundary:

1. Release the running requests whose cancellation was asked for (FINISHED_CANCELLED):
   a cancelled request leaves at the next boundary and its slot is free at once.
2. Admit waiting requests, oldest first, while fewer than `max_running` are admitted
   (RUNNING + DECODING): a new request joins at the next step boundary.
3. Decode one chunk of at most `decode_chunk_frames` frames of the oldest request that
   has final frames not yet decoded, so a long VAE decode is spread over several
   boundaries and never stalls the others' steps for long; a request whose last chunk is
   out is released (FINISHED_COMPLETED).
4. Pick the batch and run ONE denoising step for it -- or, while nothing else could happen
   at the boundaries in between (nobody waits, nothing is cancelled or has frames to
   decode, no other batch takes turns), up to `max_steps_per_job` steps in one worker job,
   which saves the pool's per-job overhead; the job stops early when a request finishes
   or its batch key changes. So a request that arrives or is cancelled during such a job
   waits at most `max_steps_per_job - 1` extra steps. Requests with the same batch key
   (the family's: latent shape, and anything else one forward needs in common, such as
   Wan 2.2's expert) share a batch, whatever their timesteps and guidance scales (each
   keeps its own scheduler state on the workers); key groups take turns round-robin, and
   a group sends its oldest requests first, up to `max_batch`. So no shape starves, and
   within a shape admission order is kept.

Failures (the pool raises `WorkerError`):

- a worker died (the pool restarted itself, all worker state is gone): the requests of
  the call that was running (the batch, or the one being admitted or decoded) fail with
  the pool's message; every other admitted request goes back to the *front* of the queue
  (state WAITING, progress reset) to be admitted again on the fresh workers; queued
  requests then run as usual. Nothing else is lost.
- a job raised on every worker alike (the pool stays up): only the requests of that call
  fail, and their worker state is released.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from engine import worker as runtime
from engine.request import GenerationSpec
from engine.pool import WorkerError

log = logging.getLogger("longserve.scheduler")

EventCallback = Callable[[str, "ScheduledRequest | None", dict], None]


class RequestState(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DECODING = "decoding"
    FINISHED_COMPLETED = "finished_completed"
    FINISHED_FAILED = "finished_failed"
    FINISHED_CANCELLED = "finished_cancelled"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


class QueueFullError(RuntimeError):
    """`submit` refused: the waiting queue already holds `max_waiting` requests."""


@dataclass(eq=False)
class ScheduledRequest:
    """One request as the scheduler tracks it (the worker-side state lives in the model family)."""

    spec: GenerationSpec
    seq: int                                   # arrival order: the "oldest first" key
    state: RequestState = RequestState.WAITING
    num_steps: int = 0                         # known once admitted
    steps_done: int = 0
    num_frames: int = 0                        # output frames, known once admitted
    frames_done: int = 0                       # output frames decoded and handed out
    batch_key: tuple | None = None             # the family's: equal keys can share a step
    decodable: bool = False                    # final frames wait to be decoded
    cancel_requested: bool = False
    solo: bool = False                         # runs in a batch of its own (after an out-of-memory batch)
    error: dict | None = None                  # {"code", "message", ...} when FINISHED_FAILED
    admissions: int = 0                        # > 1 after a crash sent it back to the queue
    timings: dict = field(default_factory=dict)
    submitted_at: float = field(default_factory=time.time)
    finished_at: float | None = None

    @property
    def id(self) -> str:
        return self.spec.request_id

    def _progress(self, p: dict) -> None:
        self.steps_done, self.batch_key, self.decodable = p["steps_done"], tuple(p["batch_key"]), p["decodable"]


class StepScheduler:
    """Decides, at every denoising step boundary, which admitted requests run together.

    pool: an `engine.pool.WorkerPool` whose workers ran `engine.worker.setup_worker`.
    max_batch: most requests in one denoising step.
    max_running: most admitted requests (worker memory holds their latents); default max_batch.
    max_waiting: most queued requests (`submit` raises QueueFullError beyond); None = unbounded.
    decode_chunk_frames: frames per `decode_frames` call.
    job_timeout_s: a worker job running longer fails (and the pool restarts).

    Drive it with `start()` (a background thread) or call `run_iteration()` yourself.
    """

    def __init__(self, pool, *, max_batch: int = 8, max_running: int | None = None,
                 max_waiting: int | None = None, decode_chunk_frames: int = 8,
                 on_event: EventCallback | None = None, job_timeout_s: float | None = None,
                 oom_retry: bool = False, setup_retry_max_s: float = 60.0, max_steps_per_job: int = 4):
        for name, value in (("max_batch", max_batch), ("decode_chunk_frames", decode_chunk_frames)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        max_running = max_batch if max_running is None else max_running
        if isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1:
            raise ValueError(f"max_running must be a positive integer, got {max_running!r}")
        if max_waiting is not None and (isinstance(max_waiting, bool) or not isinstance(max_waiting, int)
                                        or max_waiting < 0):
            raise ValueError(f"max_waiting must be a non-negative integer or None, got {max_waiting!r}")
        self.pool = pool
        self.max_batch = max_batch
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.decode_chunk_frames = decode_chunk_frames
        self.job_timeout_s = job_timeout_s
        if isinstance(max_steps_per_job, bool) or not isinstance(max_steps_per_job, int) or max_steps_per_job < 1:
            raise ValueError(f"max_steps_per_job must be a positive integer, got {max_steps_per_job!r}")
        self.max_steps_per_job = max_steps_per_job
        self.oom_retry = oom_retry
        self.setup_retry_max_s = setup_retry_max_s
        self.setup_failures = 0          # consecutive times the workers failed to (re)load the model
        self._retry_at = 0.0
        self._on_event = on_event
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._seq = itertools.count()
        self._requests: dict[str, ScheduledRequest] = {}      # every unfinished request
        self._waiting: collections.deque[ScheduledRequest] = collections.deque()
        self._admitted: list[ScheduledRequest] = []           # RUNNING + DECODING, in admission order
        self._key_turns: collections.deque[tuple] = collections.deque()  # round-robin order of batch keys
        self._thread: threading.Thread | None = None
        self._stopping = False
        # counters (read by the server's /metrics)
        self.steps_run = 0
        self.requests_stepped = 0       # sum of batch sizes over steps
        self.last_batch_size = 0
        self.crashes = 0

    # -- the public face -------------------------------------------------------------------

    def submit(self, spec: GenerationSpec) -> ScheduledRequest:
        """Queue a validated request; it is admitted at a coming step boundary."""
        with self._lock:
            if spec.request_id in self._requests:
                raise ValueError(f"request_id {spec.request_id!r} is already scheduled")
            if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
                raise QueueFullError(f"the queue is full ({self.max_waiting} requests waiting)")
            req = ScheduledRequest(spec=spec, seq=next(self._seq))
            self._requests[req.id] = req
            self._waiting.append(req)
            self._wake.notify_all()
        self._emit("queue", None, {"waiting": self.waiting_ids()})
        return req

    def cancel(self, request_id: str) -> bool:
        """Cancel a request: a waiting one leaves the queue now, a running one at the next step boundary.

        Returns False when the request is unknown or already finished.
        """
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.state.finished:
                return False
            req.cancel_requested = True
            dequeued = req.state is RequestState.WAITING
            if dequeued:
                self._waiting.remove(req)
                self._finish_locked(req, RequestState.FINISHED_CANCELLED)
            self._wake.notify_all()
        if dequeued:
            self._emit("cancelled", req, {})
            self._emit("queue", None, {"waiting": self.waiting_ids()})
        return True

    def get(self, request_id: str) -> ScheduledRequest | None:
        with self._lock:
            return self._requests.get(request_id)

    def waiting_ids(self) -> list[str]:
        """Queued request ids, next to be admitted first."""
        with self._lock:
            return [r.id for r in self._waiting]

    def queue_position(self, request_id: str) -> int | None:
        """0 for the next request to be admitted; None when not waiting."""
        with self._lock:
            for i, r in enumerate(self._waiting):
                if r.id == request_id:
                    return i
        return None

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_admitted(self) -> int:
        return len(self._admitted)

    def has_work(self) -> bool:
        with self._lock:
            return self._has_work_locked()

    # -- background thread -----------------------------------------------------------------

    def start(self) -> "StepScheduler":
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="longserve-step-scheduler", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._has_work_locked() and self.pool.ready:
                    self._wake.wait(timeout=1.0)
                if self._stopping:
                    return
            try:
                if not self.run_iteration() and not self.pool.ready:
                    with self._lock:  # the workers are down: wait for the next attempt (or a cancellation)
                        self._wake.wait(timeout=max(0.05, min(1.0, self._retry_at - time.monotonic())))
            except Exception:  # the loop must outlive any bug in one iteration
                log.exception("scheduler iteration failed")
                time.sleep(0.1)

    def _has_work_locked(self) -> bool:
        return bool(self._waiting) or bool(self._admitted)

    # -- one step boundary -----------------------------------------------------------------

    def run_iteration(self) -> bool:
        """Run one step boundary (see the module docstring). Returns whether anything was done."""
        worked = self._release_cancelled()
        if not self._ensure_pool():
            return worked        # requests wait in line (none is failed) while the workers are down
        worked |= self._admit_waiting()
        worked |= self._decode_one_chunk()
        worked |= self._denoise_one_step()
        return worked

    def _ensure_pool(self) -> bool:
        """The workers are up, or (re)start them now; a failed start is retried with exponential backoff."""
        if self.pool.ready:
            return True
        if time.monotonic() < self._retry_at:
            return False
        try:
            self.pool.start()
        except WorkerError as e:
            self.setup_failures += 1
            self._retry_at = time.monotonic() + min(self.setup_retry_max_s, 2.0 ** self.setup_failures)
            log.warning("the workers failed to start (%d in a row): %s", self.setup_failures,
                        str(e).splitlines()[0] if str(e) else e)
            self._emit("pool", None, {"state": self.pool.state, "error": str(e), "failures": self.setup_failures})
            return False
        self.setup_failures = 0
        self._emit("pool", None, {"state": self.pool.state})
        return True

    def _release_cancelled(self) -> bool:
        with self._lock:
            gone = [r for r in self._admitted if r.cancel_requested]
            for r in gone:
                self._admitted.remove(r)
                self._finish_locked(r, RequestState.FINISHED_CANCELLED)
        if not gone:
            return False
        self._release_quietly([r.id for r in gone])
        for r in gone:
            self._emit("cancelled", r, {})
        return True

    def _admit_waiting(self) -> bool:
        admitted_any = False
        while True:
            with self._lock:
                if not self._waiting or len(self._admitted) >= self.max_running:
                    break
                req = self._waiting.popleft()
                req.state = RequestState.RUNNING
                req.steps_done = req.frames_done = 0
                req.decodable = False
                req.admissions += 1
                self._admitted.append(req)
            admitted_any = True
            self._emit("queue", None, {"waiting": self.waiting_ids()})
            try:
                info = self._call(runtime.admit, req.spec, involved=[req])
            except _CallFailed:
                continue
            req.num_steps, req.num_frames = int(info["num_steps"]), int(info["num_frames"])
            req._progress(info)
            self._emit("admitted", req, {"num_steps": req.num_steps, "num_frames": req.num_frames,
                                         "admissions": req.admissions})
        return admitted_any

    def _decode_one_chunk(self) -> bool:
        with self._lock:
            ready = [r for r in self._admitted if r.decodable and not r.cancel_requested]
            req = min(ready, key=lambda r: r.seq) if ready else None
        if req is None:
            return False
        try:
            out = self._call(runtime.decode_next, req.id, self.decode_chunk_frames, involved=[req])
        except _CallFailed:
            return True
        if req.cancel_requested:
            return True  # cancelled meanwhile: released (FINISHED_CANCELLED) at the next boundary
        req._progress(out)
        req.frames_done = out["stop"]
        req.timings = out["timings"]
        self._emit("frames", req, {"start": out["start"], "stop": out["stop"], "num_frames": out["num_frames"],
                                   "frames": out["frames"], "vae_s": out["vae_s"]})
        if out["done"]:
            with self._lock:
                if req in self._admitted:
                    self._admitted.remove(req)
                self._finish_locked(req, RequestState.FINISHED_COMPLETED)
            self._release_quietly([req.id])
            self._emit("completed", req, {"timings": dict(req.timings)})
        return True

    def _select_batch_locked(self) -> list[ScheduledRequest]:
        groups: dict[tuple, list[ScheduledRequest]] = {}
        for r in sorted(self._admitted, key=lambda r: r.seq):
            if r.state is RequestState.RUNNING and not r.cancel_requested and r.steps_done < r.num_steps:
                groups.setdefault(("solo", r.id) if r.solo else r.batch_key, []).append(r)
        if not groups:
            return []
        # round-robin over batch keys: new keys join at the back of the rotation
        self._key_turns = collections.deque(s for s in self._key_turns if s in groups)
        self._key_turns.extend(s for s in groups if s not in self._key_turns)
        key = self._key_turns[0]
        self._key_turns.rotate(-1)
        return groups[key][:self.max_batch]

    def _steps_for(self, batch: list[ScheduledRequest]) -> int:
        """Steps the next job may run: several only while nothing else could happen at the boundaries in
        between (nobody waits, nothing to cancel or decode, no other batch's turn)."""
        with self._lock:
            quiet = (not self._waiting and not any(r.cancel_requested or r.decodable for r in self._admitted)
                     and all(r in batch for r in self._admitted if r.state is RequestState.RUNNING))
        if not quiet:
            return 1
        return max(1, min(self.max_steps_per_job, *(r.num_steps - r.steps_done for r in batch)))

    def _denoise_one_step(self) -> bool:
        with self._lock:
            batch = self._select_batch_locked()
        if not batch:
            return False
        steps = self._steps_for(batch)
        t0 = time.perf_counter()
        try:
            out = self._call(runtime.step, [r.id for r in batch], steps, involved=batch)
        except _CallFailed:
            return True
        step_s = (time.perf_counter() - t0) / len(out["progress"])
        for progress in out["progress"]:
            self.steps_run += 1
            self.requests_stepped += len(batch)
            self.last_batch_size = len(batch)
            self._emit("batch", None, {"batch_size": len(batch), "step_s": step_s, "batch_key": batch[0].batch_key,
                                       "request_ids": [r.id for r in batch]})
            for r in batch:
                r._progress(progress[r.id])
                self._emit("step", r, {"step": r.steps_done, "num_steps": r.num_steps, "batch_size": len(batch),
                                       "step_s": step_s})
                if r.steps_done >= r.num_steps:
                    with self._lock:
                        r.state = RequestState.DECODING
                    self._emit("decoding", r, {"num_frames": r.num_frames, "frames_done": r.frames_done})
        return True

    # -- worker calls and their failures ---------------------------------------------------

    def _call(self, fn, *args, involved: list[ScheduledRequest]):
        """pool.run(fn, *args), rank 0's result; on WorkerError deal with `involved` and recover, then raise
        _CallFailed. What happens depends on the failure's kind:

        - setup (the workers could not load the model): nobody's fault; `involved` go back to the queue;
        - input (the request's fault, refused on every worker before any collective): `involved` fail;
        - out_of_memory: `involved` fail, or with `oom_retry` and more than one of them in a denoising
          batch, each goes back to the front of the queue to run alone;
        - worker_died, timeout, internal: `involved` fail.
        When the pool was restarted, every other admitted request lost its worker state and is queued
        again, in front.
        """
        restarts = self.pool.restarts
        try:
            return self.pool.run(fn, *args, timeout_s=self.job_timeout_s)[0]
        except WorkerError as e:
            restarted = self.pool.restarts != restarts or not self.pool.ready
            detail = str(e).strip()
            log.warning("%s failed for %s (%s): %s", fn.__name__, [r.id for r in involved], e.kind,
                        detail.splitlines()[0] if detail else "")
            retry = e.kind == "setup" or (e.kind == "out_of_memory" and self.oom_retry
                                          and fn is runtime.step and len(involved) > 1)
            error = None if retry else _error_for(e, fn, detail)
            with self._lock:
                for r in involved:
                    if r in self._admitted:
                        self._admitted.remove(r)
                    if retry:
                        r.solo = r.solo or e.kind == "out_of_memory"
                        self._requeue_locked(r)
                    else:
                        self._finish_locked(r, RequestState.FINISHED_FAILED, error)
                lost = self._requeue_admitted_locked() if restarted else []
            if restarted:
                self.crashes += 1
            elif not retry:
                self._release_quietly([r.id for r in involved])
            for r in involved:
                if retry:
                    lost.insert(0, r)
                else:
                    self._emit("failed", r, dict(r.error))
            self._emit_requeued(lost)
            raise _CallFailed from e

    def _requeue_locked(self, r: ScheduledRequest) -> None:
        r.state = RequestState.WAITING
        r.steps_done = r.frames_done = 0
        r.decodable = False
        self._waiting.appendleft(r)

    def _requeue_admitted_locked(self) -> list[ScheduledRequest]:
        """After a pool restart every admitted request lost its worker state: queue it again, in front
        (a cancelled one just finishes). Returns those requests; `_emit_requeued` reports them."""
        back = sorted(self._admitted, key=lambda r: r.seq)
        self._admitted.clear()
        for r in reversed(back):
            if r.cancel_requested:
                self._finish_locked(r, RequestState.FINISHED_CANCELLED)
                continue
            self._requeue_locked(r)
        return back

    def _emit_requeued(self, lost: list[ScheduledRequest]) -> None:
        for r in lost:
            if r.state is RequestState.FINISHED_CANCELLED:
                self._emit("cancelled", r, {})
            else:
                self._emit("requeued", r, {"reason": "the worker pool restarted; the request is admitted again"})
        if lost:
            self._emit("queue", None, {"waiting": self.waiting_ids()})

    def _release_quietly(self, ids: list[str]) -> None:
        if not ids or not self.pool.ready:
            return  # a restarted pool holds no state to release
        try:
            self.pool.run(runtime.release, ids, timeout_s=self.job_timeout_s)
        except WorkerError as e:
            # a crash here hits no request's batch, but every admitted request lost its state
            log.warning("release failed: %s", str(e).splitlines()[0] if str(e) else e)
            with self._lock:
                lost = self._requeue_admitted_locked()
            self.crashes += 1
            self._emit_requeued(lost)

    def _finish_locked(self, req: ScheduledRequest, state: RequestState, error: dict | None = None) -> None:
        req.state = state
        req.error = error
        req.finished_at = time.time()
        self._requests.pop(req.id, None)

    def _emit(self, kind: str, req: ScheduledRequest | None, data: dict) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(kind, req, data)
        except Exception:  # a listener bug must not stop the scheduling of everyone else
            log.exception("scheduler event listener failed on %r", kind)


#: the `code` of a failed request, by failure kind
ERROR_CODES = {"input": "invalid_request", "out_of_memory": "out_of_memory", "worker_died": "worker_crashed",
               "timeout": "timeout", "internal": "internal_error"}


def _error_for(e: WorkerError, fn, detail: str) -> dict:
    """{"code", "message", "kind", "rank", "field"} for a request failed by `e` in job `fn`."""
    where = f"worker {e.rank}" if e.rank is not None else "the worker pool"
    messages = {
        "input": detail,
        "out_of_memory": f"{where} ran out of memory in {fn.__name__} while this video was in the batch; the "
                         f"worker pool was restarted and other jobs were not affected. Cause: {detail}",
        "worker_died": f"a worker process failed while this video was in the running batch ({fn.__name__}); the job "
                       f"was stopped and the worker pool restarted; other jobs were not affected. Cause: {detail}",
        "timeout": f"{fn.__name__} took longer than the job timeout; the worker pool was restarted. {detail}",
        "internal": f"generation failed on {where} in {fn.__name__} (an internal error, not the request's fault); "
                    f"the worker pool was restarted. Cause: {detail}",
    }
    return {"code": ERROR_CODES[e.kind], "message": messages[e.kind], "kind": e.kind, "rank": e.rank,
            "field": e.field}


class _CallFailed(Exception):
    """Internal: a worker call failed and its requests were already dealt with."""
