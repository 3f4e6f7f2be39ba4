"""`EngineCore`: carries out the scheduler's decisions on the worker pool, applies the failure policy,
and emits every request's typed outputs.

One call of `step()` is one step boundary: `Scheduler.schedule()` decides (release,
admit, decode, step), the core runs the worker jobs of `engine.worker` for it, hands the
results back to the scheduler and puts `engine.outputs` on each request's stream. It is
driven by `VideoEngine`'s loop thread; tests drive it by hand for exact interleavings.

Failures (the pool raises `WorkerError`; `Pool.restarts` tells whether it restarted):

- setup (the workers could not load the model): nobody's fault; the requests involved go
  back to the queue, and the start is retried with exponential backoff meanwhile;
- input (the request's fault, refused on every worker before any collective): the
  requests involved fail, the pool stays up;
- out_of_memory: the requests involved fail, or with `oom_retry` and more than one of them
  in a denoising batch, each goes back to the front of the queue to run alone;
- worker_died, timeout, internal: the requests involved fail.
When the pool was restarted, every other admitted request lost its worker state and is
queued again, in front (`Requeued`); the rest of the iteration's decision is dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from longserve.engine import worker as jobs
from longserve.engine.config import EngineConfig
from longserve.engine.errors import public_message
from longserve.engine.live_frames import frames_out
from longserve.engine.outputs import (
    CANCELLED,
    Admitted,
    Failed,
    Finished,
    FramesChunk,
    Queued,
    RequestFailure,
    Requeued,
    StepProgress,
    ended_early,
)
from longserve.engine.pool import WorkerError
from longserve.engine.request import GenerationSpec
from longserve.engine.results import AdmitFailure
from longserve.engine.scheduler import RequestState, ScheduledRequest, Scheduler

log = logging.getLogger("longserve.engine")


class Pool(Protocol):
    """What the engine needs of a worker pool: `engine.pool.WorkerPool` (local processes, restartable) and
    `engine.pool.TorchrunPool` (a group torchrun started) both are one."""

    workers: int
    restarts: int
    last_error: WorkerError | None
    setup_args: tuple

    @property
    def ready(self) -> bool: ...

    @property
    def state(self) -> str: ...

    def start(self) -> "Pool": ...

    def run(self, fn: Callable, *args, on_event=None, timeout_s: float | None = None) -> list: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class BatchStep:
    """One denoising step of a batch (for metrics): the engine's listeners hear it."""

    batch_size: int
    step_s: float
    request_ids: tuple[str, ...]


#: the `code` of a failed request, by failure kind
ERROR_CODES = {"input": "invalid_request", "out_of_memory": "out_of_memory", "worker_died": "worker_crashed",
               "timeout": "timeout", "internal": "internal_error", "setup": "model_unavailable"}


class EngineCore:
    """The scheduler's decisions, carried out on `pool` (whose workers ran `engine.worker.setup_worker`)."""

    def __init__(self, pool: Pool, config: EngineConfig, on_batch: Callable[[BatchStep], None] | None = None):
        self.pool = pool
        self.config = config
        self.scheduler = Scheduler(config)
        self.on_batch = on_batch
        self.setup_failures = 0          # consecutive times the workers failed to (re)load the model
        self._retry_at = 0.0
        self._positions_lock = threading.Lock()   # queue positions are told from the caller's and our thread
        # counters (the server's /metrics, stats())
        self.steps_run = 0
        self.requests_stepped = 0        # sum of batch sizes over steps
        self.last_batch_size = 0
        self.crashes = 0
        self.compiled_graphs = 0         # rank 0's graphs compiled so far, as of its last step job

    # -- requests ----------------------------------------------------------------------------------

    def add_request(self, spec: GenerationSpec, kv_bytes: int = 0) -> ScheduledRequest:
        """Queue a checked request (QueueFullError, KVBudgetError, ValueError for a duplicate id)."""
        req = self.scheduler.submit(spec, kv_bytes)
        self._tell_positions()
        return req

    def abort_request(self, request_id: str, reason: str | RequestFailure = CANCELLED) -> bool:
        """End a request for `reason` (`Scheduler.abort`): a waiting one now, a running one at the next step
        boundary. False if unknown or finished."""
        req, dequeued = self.scheduler.abort(request_id, reason)
        if req is None:
            return False
        if dequeued:                                           # it was waiting: ended now, told here
            req.stream.put(final_output(req))
            self._tell_positions()
        return True

    def update_request(self, request_id: str, payload: dict) -> bool:
        """A running request changes course at the next step boundary (checked payload). False if unknown."""
        return self.scheduler.update(request_id, payload)

    def close(self) -> None:
        """The engine closes: every unfinished request ends now, with a final output (as its abort asked, else
        Failed: engine_closed)."""
        for r in self.scheduler.close():
            r.stream.put(final_output(r))

    # -- one step boundary ---------------------------------------------------------------------------

    def step(self) -> bool:
        """Carry out one step boundary's decision. Returns whether anything was done."""
        if not self._ensure_pool():
            return False        # requests wait in line (none is failed) while the workers are down
        plan = self.scheduler.schedule()
        if plan.empty:
            return False
        restarts = self.pool.restarts
        if plan.release:
            self._release([r.id for r in plan.release])
            for r in plan.release:
                r.stream.put(final_output(r))
            if self._pool_lost(restarts):
                return True      # the release met a dead worker: every admitted request was queued again
        if plan.admit:
            self._tell_positions()
        for req in plan.admit:
            if not self._admit(req) and self._pool_lost(restarts):
                return True
        for req, payloads in plan.update:
            for payload in payloads:
                if req.state is not RequestState.RUNNING or req.aborted:
                    break
                res = self._call(jobs.update, req.id, payload, involved=[req])
                if res is None:
                    if self._pool_lost(restarts):
                        return True
                    break
                self.scheduler.stepped(req, res["progress"])
        if plan.decode is not None and not plan.decode.aborted and self.config.live_loop != "serial":
            # the decode and the steps in one job, the decode on the workers' lane beside them (engine/live_loop.py)
            batch = [r for r in plan.step.batch if r.state is RequestState.RUNNING] if plan.step is not None else []
            self._tick(plan.decode, plan.decode_frames, batch, plan.step.num_steps if batch else 0)
            return True
        if plan.decode is not None and not plan.decode.aborted:
            if not self._decode(plan.decode, plan.decode_frames) and self._pool_lost(restarts):
                return True
        if plan.step is not None:
            batch = [r for r in plan.step.batch if r.state is RequestState.RUNNING]   # a failed decode left it
            if batch:
                self._denoise(batch, plan.step.num_steps)
        return True

    def _pool_lost(self, restarts: int) -> bool:
        """Did the workers lose their state since `restarts` was read (the rest of the decision is void)?"""
        return self.pool.restarts != restarts or not self.pool.ready

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
            self._retry_at = time.monotonic() + min(self.config.setup_retry_max_s, 2.0 ** self.setup_failures)
            log.warning("the workers failed to start (%d in a row): %s", self.setup_failures,
                        str(e).splitlines()[0] if str(e) else e)
            return False
        self.setup_failures = 0
        return True

    @property
    def retry_in_s(self) -> float:
        return max(0.0, self._retry_at - time.monotonic())

    def _admit(self, req: ScheduledRequest) -> bool:
        info = self._call(jobs.admit, req.spec, involved=[req])
        if info is None:
            return False
        if isinstance(info, AdmitFailure):      # the request's inputs could not be encoded: it fails alone
            self._failed(jobs.admit, WorkerError(f"the model could not take this request's inputs: {info.message}",
                                                 kind="input", rank=0, field=info.field), [req], restarted=False)
            return True
        self.scheduler.admitted(req, info)
        req.stream.put(Admitted(req.id, req.num_steps, req.num_frames, req.admissions))
        return True

    def _decode(self, req: ScheduledRequest, max_frames: int) -> bool:
        chunk = self._call(jobs.decode_next, req.id, max_frames, involved=[req])
        if chunk is None:
            return False
        self._decoded(req, chunk)
        return True

    def _decoded(self, req: ScheduledRequest, chunk) -> None:
        if req.aborted:
            return        # aborted meanwhile: released (its final output) at the next boundary
        done = self.scheduler.decoded(req, chunk)
        # a live chunk's frames come as uint8 in a worker's shared-memory slot: read (and made "np") here, at the edge
        t0 = time.perf_counter()
        frames = frames_out(chunk.frames, req.spec.output)
        req.edge_s += time.perf_counter() - t0
        if "transfer_s" in req.timings or req.edge_s:    # the workers' hand-over (pipelined) and this read
            req.timings["transfer_s"] = req.timings.get("transfer_s", 0.0) + req.edge_s
        req.stream.put(FramesChunk(req.id, frames, chunk.start, chunk.stop, chunk.num_frames, chunk.vae_s,
                                   chunk.audio, chunk.live))
        if done:
            self._release([req.id])
            req.stream.put(Finished(req.id, dict(req.timings)))

    def _tick(self, req: ScheduledRequest, max_frames: int, batch: list[ScheduledRequest], num_steps: int) -> None:
        """`req`'s next chunk decoded on the lane while `batch` runs `num_steps` steps: one job (`jobs.live_tick`);
        the chunk is handed out first, as a serial decode before the steps would be."""
        t0 = time.perf_counter()
        involved = [req] + [r for r in batch if r is not req]
        ticks = self._call(jobs.live_tick, [r.id for r in batch], num_steps, req.id, max_frames, involved=involved,
                           every_rank=True)
        if ticks is None:
            return
        head = ticks[0]
        lane = next((t for t in ticks if t is not None and t.lane), None)
        if lane is None:
            raise RuntimeError("no worker reported the decode lane's frames (the pipelined live loop needs the "
                               "local worker pool: a torchrun group hands back rank 0's results only)")
        meta = head.decoded
        self._decoded(req, dataclasses.replace(meta, frames=lane.frames, vae_s=lane.vae_s,
                                               timings={**meta.timings, "vae_s": lane.vae_total_s}))
        if head.step is not None:
            self._stepped(batch, head.step, t0)

    def _denoise(self, batch: list[ScheduledRequest], num_steps: int) -> None:
        t0 = time.perf_counter()
        out = self._call(jobs.step, [r.id for r in batch], num_steps, involved=batch)
        if out is None:
            return
        self._stepped(batch, out, t0)

    def _stepped(self, batch: list[ScheduledRequest], out, t0: float) -> None:
        step_s = (time.perf_counter() - t0) / len(out.progress)
        self.compiled_graphs = out.compiled_graphs
        for progress in out.progress:
            self.steps_run += 1
            self.requests_stepped += len(batch)
            self.last_batch_size = len(batch)
            if self.on_batch is not None:
                self.on_batch(BatchStep(len(batch), step_s, tuple(r.id for r in batch)))
            for r in batch:
                self.scheduler.stepped(r, progress[r.id])
                r.stream.put(StepProgress(r.id, r.steps_done, r.num_steps, len(batch), step_s))

    # -- worker calls and their failures ---------------------------------------------------------------

    def _call(self, fn, *args, involved: list[ScheduledRequest], every_rank: bool = False):
        """pool.run(fn, *args), rank 0's result (`every_rank`: every rank's, rank 0 first); on a failure apply the
        failure policy (module docstring) to `involved` and the other admitted requests, and return None."""
        restarts = self.pool.restarts
        try:
            out = self.pool.run(fn, *args, timeout_s=self.config.job_timeout_s)
            return out if every_rank else out[0]
        except WorkerError as e:
            self._failed(fn, e, involved, restarted=self._pool_lost(restarts))
        except Exception as e:  # not the pool's typed failure (the OS, a result that cannot be read): nothing is
            # known of the workers' state, so they start afresh, and the call is an internal failure
            log.exception("%s failed outside the pool's failure model", fn.__name__)
            restart = getattr(self.pool, "restart", None)
            if restart is not None:
                try:
                    restart()
                except Exception:  # noqa: BLE001 - the next boundary's _ensure_pool tries again
                    log.exception("restarting the workers failed")
            self._failed(fn, WorkerError(f"{type(e).__name__}: {e}", kind="internal"), involved, restarted=True)
        return None

    def _failed(self, fn, e: WorkerError, involved: list[ScheduledRequest], restarted: bool) -> None:
        detail = str(e).strip()
        # the log keeps the whole failure, traceback included, once; the requests' messages carry its first line
        log.warning("%s failed for %s (%s): %s", fn.__name__, [r.id for r in involved], e.kind, detail)
        oom_retry = (e.kind == "out_of_memory" and self.config.oom_retry and fn is jobs.step
                     and len(involved) > 1)
        retry = e.kind == "setup" or oom_retry
        error = None if retry else failure_for(e, fn.__name__, detail)
        moved = [r for r in involved
                 if (self.scheduler.requeue(r, solo=oom_retry) if retry else self.scheduler.fail(r, error))]
        lost = self.scheduler.requeue_admitted() if restarted else []
        if restarted:
            self.crashes += 1
        elif not retry:
            self._release([r.id for r in moved])
        for r in moved:
            if retry:
                lost.insert(0, r)
            else:
                r.stream.put(Failed(r.id, error))
        self._tell_requeued(lost)

    def _tell_requeued(self, lost: list[ScheduledRequest]) -> None:
        for r in lost:
            if r.state.finished:                  # aborted before the restart: it just ends
                r.stream.put(final_output(r))
            else:
                r.stream.put(Requeued(r.id, "the worker pool restarted; the request is admitted again"))
        if lost:
            self._tell_positions()

    def _tell_positions(self) -> None:
        with self._positions_lock:       # computed and told together: a request hears its positions in order
            for r, position in self.scheduler.moved_in_line():
                r.stream.put(Queued(r.id, position))

    def _release(self, ids: list[str]) -> None:
        if not ids or not self.pool.ready:
            return  # a restarted pool holds no state to release
        try:
            self.pool.run(jobs.release, ids, timeout_s=self.config.job_timeout_s)
        except WorkerError as e:
            # a crash here hits no request's batch, but every admitted request lost its state
            log.warning("release failed: %s", str(e).splitlines()[0] if str(e) else e)
            self.crashes += 1
            self._tell_requeued(self.scheduler.requeue_admitted())


def final_output(r: ScheduledRequest):
    """The final output of a request the scheduler finished early: as its abort asked, or Failed."""
    if r.aborted:
        return ended_early(r.id, r.abort_reason)
    return Failed(r.id, r.error)


def failure_for(e: WorkerError, job: str, detail: str) -> RequestFailure:
    """Why a request in job `job` failed with `e`, in words a client can act on: no traceback and no server path
    (`public_message`: the first line of `detail`, file paths cut to their last name); the log has the rest."""
    where = f"worker {e.rank}" if e.rank is not None else "the worker pool"
    detail = detail if e.kind == "input" else public_message(detail)       # an input error is our own words
    messages = {
        "input": detail,
        "out_of_memory": f"{where} ran out of memory in {job} while this video was in the batch; the worker pool "
                         f"was restarted and other jobs were not affected. Cause: {detail}",
        "worker_died": f"a worker process failed while this video was in the running batch ({job}); the job was "
                       f"stopped and the worker pool restarted; other jobs were not affected. Cause: {detail}",
        "timeout": f"{job} took longer than the job timeout; the worker pool was restarted. {detail}",
        "internal": f"generation failed on {where} in {job} (an internal error, not the request's fault); the "
                    f"worker pool was restarted. Cause: {detail}",
        "setup": f"the model could not be loaded: {detail}",
    }
    return RequestFailure(code=ERROR_CODES[e.kind], message=messages[e.kind], kind=e.kind, rank=e.rank,
                          field=e.field)
