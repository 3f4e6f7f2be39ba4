"""A persistent pool of worker processes that form one torch.distributed group.

The coordinator (the process that owns the pool) sends every worker the same job, a
module-level function plus picklable arguments; each worker calls
``fn(ctx, *args)`` in lockstep with its peers, where ``ctx`` is its `WorkerContext`
(its `ParallelGroup`, a dict of state that lives as long as the worker, and `emit` to
send progress events back). Workers load models once, in ``setup(ctx, *setup_args)``,
and stay up between jobs.

Failure model (it must hold under NCCL, where collectives are queued asynchronously and a
rank that fails can leave its peers waiting in a collective that will never complete):

- Failures are typed (`WorkerError.kind`), with the rank where they happened:
  "input" (a `RequestError`: the request's fault), "out_of_memory", "internal" (any other
  exception, a library's `ValueError` deep inside a forward included), "worker_died",
  "timeout", and "setup" (the workers could not load the model).
- The pool stays up only when *every* rank failed with an input error *before entering any
  collective* in that job (`engine.comm.ISSUED`): then nothing is pending anywhere. After
  any other failure the pool is restarted (every worker killed, a fresh group on a new
  port, ``setup`` run again), so no later job can meet a collective left pending by the
  failed one.
- `state` ("starting", "ready", "restarting", "unavailable", "closed") is readable at any
  time without waiting for a running job: health checks read it.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from longserve.engine import comm, startup
from longserve.engine.dist import ParallelGroup, default_device, destroy, find_free_port, init_local_group

FAILURE_KINDS = ("input", "out_of_memory", "internal", "worker_died", "timeout", "setup")


class WorkerError(RuntimeError):
    """A job failed on the worker pool.

    kind: one of FAILURE_KINDS; rank: the worker it happened on (None: the pool as a whole);
    field: for an input error, the request field at fault.
    """

    def __init__(self, message: str, kind: str = "internal", rank: int | None = None, field: str | None = None):
        super().__init__(message)
        self.kind, self.rank, self.field = kind, rank, field

    def __reduce__(self):  # keep the type's fields when the error crosses a process boundary
        return (type(self), (str(self), self.kind, self.rank, self.field))


def classify(e: BaseException) -> str:
    """The failure kind of an exception raised by a job."""
    from longserve.engine.request import RequestError

    if isinstance(e, RequestError):
        return "input"
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(e).lower():
        return "out_of_memory"
    return "internal"


def describe_failure(e: BaseException, collectives_entered: bool) -> dict:
    """What a worker reports about a failed job (plain data: it crosses the result queue)."""
    kind = classify(e)
    return {"kind": kind, "message": f"{type(e).__name__}: {e}", "field": getattr(e, "field", None),
            "traceback": "" if kind == "input" else "".join(traceback.format_exception(e)).strip(),
            "collectives": collectives_entered}


@dataclass
class WorkerContext:
    """What a job function sees on a worker."""

    pg: ParallelGroup
    state: dict = field(default_factory=dict)
    _events: Any = None
    job_id: int = -1

    def emit(self, event: Any) -> None:
        """Send a progress event to the coordinator (cheap; call it from rank 0 only)."""
        self._events.put((self.pg.rank, "event", self.job_id, event))


def _pid_running(pid: int | None) -> bool:
    """Is process `pid` running (not gone, not a zombie waiting to be reaped)?"""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # alive, another user's (never ours, but not gone)
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return True                 # no /proc: os.kill's answer


def _alive(p) -> bool:
    """Is worker process `p` running? Its own process is asked, not only its multiprocessing sentinel: a worker
    forked by the fork server reports through the server, and reads as dead if the server itself died."""
    return p.is_alive() or _pid_running(p.pid)


_coordinator_alive = _pid_running


def _watch_parent(parent_pid: int) -> None:
    # A worker whose coordinator is gone (killed, crashed) exits instead of lingering. (With the
    # forkserver start method the worker's parent process is the fork server, not the coordinator.)
    while True:
        time.sleep(0.5)
        if not _coordinator_alive(parent_pid):
            os._exit(0)


def _worker_main(rank, world_size, port, device, threads, setup, setup_args, tasks, results, parent_pid):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator decides when we stop
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    try:
        pg = init_local_group(rank, world_size, port, device)
        ctx = WorkerContext(pg=pg, _events=results)
        if setup is not None:
            setup(ctx, *setup_args)
        results.put((rank, "ready", None, None))
    except BaseException as e:
        results.put((rank, "error", None, describe_failure(e, True)))
        return
    while True:
        msg = tasks.get()
        if msg is None:
            break
        job_id, fn, args = msg
        ctx.job_id = job_id
        issued = comm.ISSUED[0]
        try:
            out = fn(ctx, *args)
            results.put((rank, "result", job_id, out))
        except BaseException as e:  # report, keep serving; the coordinator decides on restart
            results.put((rank, "error", job_id, describe_failure(e, comm.ISSUED[0] != issued)))
    destroy()


_LIVE_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


@atexit.register
def _close_live_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.close()


class WorkerPool:
    """N persistent workers in one process group. Use as a context manager, or call `close()`."""

    def __init__(
        self,
        workers: int,
        setup: Callable | None = None,
        setup_args: tuple = (),
        device: str | None = None,
        start_timeout_s: float = 300.0,
        error_grace_s: float = 5.0,
    ):
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        self.workers = workers
        self.device = device or default_device()
        if self.device.startswith("cuda"):
            available = torch.cuda.device_count()
            if workers > available:
                raise ValueError(f"workers={workers} but only {available} CUDA device(s) are visible")
        self.setup = setup
        self.setup_args = setup_args
        self.start_timeout_s = start_timeout_s
        self.error_grace_s = error_grace_s
        self.restarts = 0
        self.last_error: WorkerError | None = None
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._procs: list = []
        self._ready = False
        self._ever_ready = False
        self._state = "starting"
        _LIVE_POOLS.add(self)

    # -- lifecycle ---------------------------------------------------------------

    def _spawn(self) -> None:
        ctx = startup.context(self.device)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.workers)]
        port = find_free_port()
        # CPU workers share the coordinator's intra-op thread budget (torch's, which follows OMP_NUM_THREADS)
        threads = max(1, torch.get_num_threads() // self.workers) if self.device == "cpu" else 0
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(r, self.workers, port, self.device, threads, self.setup, self.setup_args,
                      self._tasks[r], self._results, os.getpid()),
                name=f"longserve-worker-{r}",
                daemon=True,
            )
            for r in range(self.workers)
        ]
        for p in self._procs:
            p.start()
        self._ready = False

    def _wait_ready(self) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + self.start_timeout_s
        while len(ready) < self.workers:
            try:
                rank, kind, _, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                self._raise_if_dead("while starting", restart=False)
                if time.monotonic() > deadline:
                    self._kill()
                    self._fail_start(WorkerError(f"workers did not start within {self.start_timeout_s:.0f} s",
                                                 kind="setup"))
                continue
            if kind == "ready":
                ready.add(rank)
            elif kind == "error":
                self._kill()
                self._fail_start(WorkerError(f"worker {rank} failed to start: {payload['message']}\n"
                                             f"{payload['traceback']}", kind="setup", rank=rank))
        self._ready = True
        self._state = "ready"

    def _fail_start(self, error: WorkerError):
        self._state = "unavailable"
        self.last_error = error
        raise error

    def start(self) -> "WorkerPool":
        with self._lock:
            if not self._procs:
                self._spawn()
                self._state = "restarting" if self._ever_ready else "starting"
            if not self._ready:
                self._wait_ready()
                self._ever_ready = True
        return self

    def _kill(self) -> None:
        for p in self._procs:
            if p.pid is not None:
                try:
                    os.kill(p.pid, signal.SIGKILL)     # by pid: the sentinel may say dead when it is not
                except ProcessLookupError:
                    pass
        for p in self._procs:
            p.join(timeout=10)
        self._procs = []
        self._ready = False

    def restart(self) -> None:
        """Kill every worker and start a fresh group (setup runs again on the next job)."""
        with self._lock:
            self._kill()
            self.restarts += 1
            self._spawn()
            self._state = "restarting"

    def close(self) -> None:
        with self._lock:
            if not self._procs:
                return
            for q in self._tasks:
                try:
                    q.put(None)
                except (ValueError, OSError):
                    pass
            for p in self._procs:
                p.join(timeout=10)
            self._kill()
            self._state = "closed"
        _LIVE_POOLS.discard(self)

    def __enter__(self) -> "WorkerPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def ready(self) -> bool:
        """True while the workers are up and set up (False after a crash until the restart is done)."""
        return self._ready

    @property
    def state(self) -> str:
        """"starting" | "ready" | "restarting" | "unavailable" (setup failed) | "closed"; never blocks.

        A worker that died before a job noticed makes a "ready" pool "restarting" at once: it will be."""
        state = self._state
        if state == "ready" and not all(_alive(p) for p in list(self._procs)):
            return "restarting"
        return state

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # -- jobs --------------------------------------------------------------------

    def _raise_if_dead(self, when: str, restart: bool = True) -> None:
        for rank, p in enumerate(self._procs):
            if not _alive(p):
                code = p.exitcode
                killed = code is not None and code < 0
                how = f"killed by {signal.Signals(-code).name}" if killed else f"exit code {code}"
                if restart:
                    self.restart()
                    raise self._failed(WorkerError(f"worker {rank} (pid {p.pid}) died {when} ({how}); the pool was "
                                                   f"restarted", kind="worker_died", rank=rank))
                self._kill()
                self._fail_start(WorkerError(f"worker {rank} (pid {p.pid}) died {when} ({how})", kind="setup",
                                             rank=rank))

    def _failed(self, error: WorkerError) -> WorkerError:
        self.last_error = error
        return error

    def run(
        self,
        fn: Callable,
        *args,
        on_event: Callable[[Any], None] | None = None,
        timeout_s: float | None = None,
    ) -> list:
        """Run ``fn(ctx, *args)`` on every worker; return the per-rank results, rank 0 first."""
        with self._lock:
            self.start()
            job_id = next(self._ids)
            for q in self._tasks:
                q.put((job_id, fn, args))
            results: dict[int, Any] = {}
            errors: dict[int, dict] = {}
            first_error_at = None
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while len(results) + len(errors) < self.workers:
                try:
                    rank, kind, jid, payload = self._results.get(timeout=0.1)
                except queue.Empty:
                    self._raise_if_dead(f"during {fn.__name__}")
                    if first_error_at is not None and time.monotonic() - first_error_at > self.error_grace_s:
                        # some ranks failed, the others are still inside the job (a collective waiting for them)
                        rank, failure = min(errors.items())
                        self.restart()
                        raise self._failed(_job_error(fn, rank, failure, restarted=True)) from None
                    if deadline is not None and time.monotonic() > deadline:
                        self.restart()
                        raise self._failed(WorkerError(f"{fn.__name__} timed out after {timeout_s:.0f} s; the pool "
                                                       f"was restarted", kind="timeout")) from None
                    continue
                if jid != job_id:
                    continue  # a late message from an earlier, abandoned job
                if kind == "event":
                    if on_event is not None:
                        on_event(payload)
                elif kind == "result":
                    results[rank] = payload
                elif kind == "error":
                    errors[rank] = payload
                    first_error_at = first_error_at or time.monotonic()
            if errors:
                rank, failure = min(errors.items())
                kinds = {f["kind"] for f in errors.values()}
                # in step without a restart only if every rank refused the input before any collective
                in_step = len(errors) == self.workers and kinds == {"input"} and \
                    not any(f["collectives"] for f in errors.values())
                if not in_step:
                    self.restart()
                if "out_of_memory" in kinds:
                    rank, failure = min((r, f) for r, f in errors.items() if f["kind"] == "out_of_memory")
                raise self._failed(_job_error(fn, rank, failure, restarted=not in_step))
            return [results[r] for r in range(self.workers)]


def _job_error(fn: Callable, rank: int, failure: dict, restarted: bool) -> WorkerError:
    """The WorkerError for a job that failed on `rank` with `failure` (a `describe_failure` dict)."""
    return job_error(rank, failure, f"in {fn.__name__}" + ("; the pool was restarted" if restarted else ""))


def job_error(rank: int, failure: dict, note: str) -> WorkerError:
    if failure["kind"] == "input":
        return WorkerError(failure["message"].split(": ", 1)[-1], kind="input", rank=rank, field=failure["field"])
    return WorkerError(f"worker {rank} failed ({failure['kind']}) {note}: {failure['message']}\n"
                       f"{failure['traceback']}", kind=failure["kind"], rank=rank)


class TorchrunPool:
    """The `WorkerPool` interface over a group that `torchrun` started (one process per GPU, any number of nodes).

    Rank 0 is both the coordinator and a worker: `run` broadcasts the job on a gloo
    control group, then runs it locally in lockstep with the others. Every other rank
    enters `serve_forever` from the constructor and exits the process when rank 0 closes
    the pool, so the same program (`longserve generate ...`, `longserve serve ...`) runs
    unchanged under `torchrun --nproc-per-node N -m server.cli ...`.

    Failures: a group torchrun started cannot restart itself, so any failure breaks the
    pool (`state` "unavailable"; the deployment restarts it: torchrun --max-restarts, or a
    liveness probe on /health). A non-zero rank whose job raises writes its typed failure
    to the rendezvous store and exits at once, so its peers' pending collectives fail
    instead of waiting forever (gloo: at once; NCCL: at the group's timeout, which
    `init_from_torchrun` sets); rank 0 then raises a `WorkerError` naming that rank. After
    every job all ranks report to rank 0 on the control group, so a rank that fails after
    its last collective is found in the same job.
    """

    def __init__(self, setup: Callable | None = None, setup_args: tuple = (), device: str | None = None):
        import sys

        import torch.distributed as dist

        from longserve.engine.dist import init_from_torchrun

        pg = init_from_torchrun(device)
        self.workers = pg.world_size
        self.restarts = 0
        self.setup_args = setup_args
        self.last_error: WorkerError | None = None
        self._ids = itertools.count()
        self._control = dist.new_group(backend="gloo")  # job descriptions and job outcomes travel on CPU
        self._store = dist.distributed_c10d._get_default_store()
        self._events: "queue.SimpleQueue" = queue.SimpleQueue()
        self.ctx = WorkerContext(pg=pg, _events=self._events)
        if setup is not None:
            setup(self.ctx, *setup_args)
        self._open = True
        if pg.rank != 0:
            self.serve_forever()
            destroy()
            sys.exit(0)

    def _broadcast(self, obj):
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def _report_outcome(self, ok: bool) -> list | None:
        """Every rank tells rank 0 that its part of the job ended (rank 0 gets the list)."""
        import torch.distributed as dist

        out = [None] * self.workers if self.ctx.pg.rank == 0 else None
        dist.gather_object(ok, out, dst=0, group=self._control)
        return out

    def serve_forever(self) -> None:
        import json

        while True:
            msg = self._broadcast(None)
            if msg is None:
                return
            fn, args, job_id = msg
            issued = comm.ISSUED[0]
            try:
                fn(self.ctx, *args)
            except BaseException as e:
                failure = describe_failure(e, comm.ISSUED[0] != issued)
                failure.update(rank=self.ctx.pg.rank, time=time.time())
                self._store.set(f"longserve/failure/{job_id}/{self.ctx.pg.rank}", json.dumps(failure))
                # torchrun's agent stops the whole group about monitor-interval (0.1 s) after we exit, possibly
                # before rank 0 reports: say it here too, so torchrun's log names the failure
                print(f"longserve: rank {self.ctx.pg.rank} failed in {getattr(fn, '__name__', fn)} "
                      f"({failure['kind']}): {failure['traceback'] or failure['message']}", file=sys.stderr, flush=True)
                os._exit(1)  # peers waiting for us in a collective must fail, not hang
            self._report_outcome(True)

    def _peer_failure(self, job_id: int, wait_s: float) -> WorkerError | None:
        """The earliest failure a peer recorded for `job_id` (waiting up to `wait_s` for one to appear)."""
        import json

        keys = [f"longserve/failure/{job_id}/{r}" for r in range(1, self.workers)]
        deadline = time.monotonic() + wait_s
        while True:
            found = [json.loads(self._store.get(k)) for k in keys if self._store.check([k])]
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not found:
            return None
        first = min(found, key=lambda f: f["time"])
        return job_error(first["rank"], first, "and the torchrun group is broken (restart it)")

    def _break(self, error: WorkerError) -> WorkerError:
        self._open = False
        self.last_error = error
        return error

    def run(self, fn: Callable, *args, on_event=None, timeout_s=None) -> list:
        if not self._open:
            raise WorkerError(f"the torchrun group is broken ({self.last_error}); restart the deployment",
                              kind="setup")
        job_id = next(self._ids)
        issued = comm.ISSUED[0]
        try:
            self._broadcast((fn, args, job_id))
            try:
                out = fn(self.ctx, *args)
            except BaseException as e:
                peer = self._peer_failure(job_id, wait_s=2.0)    # our error may only be the echo of a peer's
                if peer is not None:
                    raise self._break(peer) from e
                failure = describe_failure(e, comm.ISSUED[0] != issued)
                raise self._break(job_error(0, failure, f"in {fn.__name__}; the torchrun group is broken and "
                                                        f"must be restarted")) from e
            self._report_outcome(True)
        except WorkerError:
            raise
        except Exception as e:  # a collective or the outcome report failed: a peer left
            peer = self._peer_failure(job_id, wait_s=10.0)
            raise self._break(peer or WorkerError(f"the torchrun group failed during {fn.__name__}: {e}",
                                                  kind="worker_died")) from e
        while not self._events.empty():
            _, _, _, event = self._events.get()
            if on_event is not None:
                on_event(event)
        return [out] + [None] * (self.workers - 1)  # only rank 0's result comes back

    def start(self) -> "TorchrunPool":
        if not self._open:
            raise WorkerError(f"the torchrun group is broken ({self.last_error}); restart the deployment",
                              kind="setup")
        return self

    @property
    def ready(self) -> bool:
        return self._open

    @property
    def state(self) -> str:
        return "ready" if self._open else "unavailable"

    @property
    def pids(self) -> list[int]:
        return [os.getpid()]

    def close(self) -> None:
        if self._open:
            self._open = False
            self._broadcast(None)
            destroy()

    def __enter__(self) -> "TorchrunPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ)


def make_pool(workers: int, setup: Callable | None = None, setup_args: tuple = (), device: str | None = None,
              launcher: str = "auto", start_timeout_s: float = 300.0):
    """A `WorkerPool` of `workers` local processes, or the `torchrun` group this process belongs to.

    launcher: "local" | "torchrun" | "auto" (torchrun when this process was started by it).
    Under torchrun the group size comes from torchrun and `workers` is ignored.
    """
    if launcher not in ("auto", "local", "torchrun"):
        raise ValueError(f"launcher must be auto, local or torchrun; got {launcher!r}")
    if launcher == "torchrun" or (launcher == "auto" and launched_by_torchrun()):
        return TorchrunPool(setup, setup_args, device)
    return WorkerPool(workers, setup=setup, setup_args=setup_args, device=device, start_timeout_s=start_timeout_s)
