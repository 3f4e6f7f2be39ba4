"""A persistent pool of worker processes that form one torch.distributed group.

The coordinator (the process that owns the pool) sends every worker the same job, a
module-level function plus picklable arguments; each worker calls
``fn(ctx, *args)`` in lockstep with its peers, where ``ctx`` is its `WorkerContext`
(its `ParallelGroup`, a dict of state that lives as long as the worker, and `emit` to
send progress events back). Workers load models once, in ``setup(ctx, *setup_args)``,
and stay up between jobs.

Failure model: a job that raises on *every* worker (for instance a validation error
that all ranks see alike) fails with that error and the pool stays up. A worker that
dies, or that raises while its peers are still inside a collective, fails the job with
a clear `WorkerError`, and the pool is restarted (all workers killed and started anew,
``setup`` run again) so the next job runs on a healthy group.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import signal
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from engine.dist import ParallelGroup, default_device, destroy, find_free_port, init_local_group


class WorkerError(RuntimeError):
    """A job failed on the worker pool: a worker raised, died, or the job timed out."""


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


def _watch_parent(parent_pid: int) -> None:
    # A worker whose coordinator is gone (killed, crashed) exits instead of lingering.
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
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
    except BaseException:
        results.put((rank, "error", None, traceback.format_exc()))
        return
    while True:
        msg = tasks.get()
        if msg is None:
            break
        job_id, fn, args = msg
        ctx.job_id = job_id
        try:
            out = fn(ctx, *args)
            results.put((rank, "result", job_id, out))
        except BaseException as e:  # report, keep serving; the coordinator decides on restart
            results.put((rank, "error", job_id, _describe(e)))
    destroy()


def _describe(e: BaseException) -> str:
    if isinstance(e, (ValueError, WorkerError)):
        return f"{type(e).__name__}: {e}"
    return "".join(traceback.format_exception(e)).strip()


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
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._procs: list = []
        self._ready = False
        _LIVE_POOLS.add(self)

    # -- lifecycle ---------------------------------------------------------------

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.workers)]
        port = find_free_port()
        threads = max(1, (os.cpu_count() or 1) // self.workers) if self.device == "cpu" else 0
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
                self._raise_if_dead("while starting")
                if time.monotonic() > deadline:
                    self._kill()
                    raise WorkerError(f"workers did not start within {self.start_timeout_s:.0f} s")
                continue
            if kind == "ready":
                ready.add(rank)
            elif kind == "error":
                self._kill()
                raise WorkerError(f"worker {rank} failed to start:\n{payload}")
        self._ready = True

    def start(self) -> "WorkerPool":
        with self._lock:
            if not self._procs:
                self._spawn()
            if not self._ready:
                self._wait_ready()
        return self

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
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
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # -- jobs --------------------------------------------------------------------

    def _raise_if_dead(self, when: str) -> None:
        for rank, p in enumerate(self._procs):
            if not p.is_alive():
                code = p.exitcode
                how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
                self.restart()
                raise WorkerError(f"worker {rank} (pid {p.pid}) died {when} ({how}); the pool was restarted")

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
            errors: dict[int, str] = {}
            first_error_at = None
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while len(results) + len(errors) < self.workers:
                try:
                    rank, kind, jid, payload = self._results.get(timeout=0.1)
                except queue.Empty:
                    self._raise_if_dead(f"during {fn.__name__}")
                    if first_error_at is not None and time.monotonic() - first_error_at > self.error_grace_s:
                        self.restart()
                        rank, msg = next(iter(errors.items()))
                        raise WorkerError(f"worker {rank} failed in {fn.__name__}; the pool was restarted:\n{msg}")
                    if deadline is not None and time.monotonic() > deadline:
                        self.restart()
                        raise WorkerError(f"{fn.__name__} timed out after {timeout_s:.0f} s; the pool was restarted")
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
                rank, msg = min(errors.items())
                if len(errors) < self.workers:  # peers may have left a collective half done
                    self.restart()
                raise WorkerError(msg if msg.startswith("ValueError") else f"worker {rank} failed in {fn.__name__}:\n{msg}")
            return [results[r] for r in range(self.workers)]


class TorchrunPool:
    """The `WorkerPool` interface over a group that `torchrun` started (one process per GPU, any number of nodes).

    Rank 0 is both the coordinator and a worker: `run` broadcasts the job on a gloo
    control group, then runs it locally in lockstep with the others. Every other rank
    enters `serve_forever` from the constructor and exits the process when rank 0 closes
    the pool, so the same program (`longserve generate ...`, `longserve serve ...`) runs
    unchanged under `torchrun --nproc-per-node N -m server.cli ...`.
    """

    def __init__(self, setup: Callable | None = None, setup_args: tuple = (), device: str | None = None):
        import sys

        import torch.distributed as dist

        from engine.dist import init_from_torchrun

        pg = init_from_torchrun(device)
        self.workers = pg.world_size
        self.restarts = 0
        self.setup_args = setup_args
        self._control = dist.new_group(backend="gloo")  # job descriptions travel on CPU
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

    def serve_forever(self) -> None:
        while True:
            msg = self._broadcast(None)
            if msg is None:
                return
            fn, args = msg
            fn(self.ctx, *args)

    def run(self, fn: Callable, *args, on_event=None, timeout_s=None) -> list:
        self._broadcast((fn, args))
        out = fn(self.ctx, *args)
        while not self._events.empty():
            _, _, _, event = self._events.get()
            if on_event is not None:
                on_event(event)
        return [out] + [None] * (self.workers - 1)  # only rank 0's result comes back

    def start(self) -> "TorchrunPool":
        return self

    @property
    def ready(self) -> bool:
        return self._open

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
              launcher: str = "auto"):
    """A `WorkerPool` of `workers` local processes, or the `torchrun` group this process belongs to.

    launcher: "local" | "torchrun" | "auto" (torchrun when this process was started by it).
    Under torchrun the group size comes from torchrun and `workers` is ignored.
    """
    if launcher not in ("auto", "local", "torchrun"):
        raise ValueError(f"launcher must be auto, local or torchrun; got {launcher!r}")
    if launcher == "torchrun" or (launcher == "auto" and launched_by_torchrun()):
        return TorchrunPool(setup, setup_args, device)
    return WorkerPool(workers, setup=setup, setup_args=setup_args, device=device)
