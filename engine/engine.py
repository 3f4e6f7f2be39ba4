"""`VideoEngine`: a checkpoint on a pool of workers, and the lifecycle of its requests.

One object sits under every front door, as vLLM's engine sits under both its offline
`LLM` and its API server:

    engine = VideoEngine.start("tiny-wan", workers=2)           # pool + model family + plan
    engine.check(spec)                                          # RequestError naming a field
    for kind, data in engine.run(spec): ...                     # drive it here (the pipeline)
    engine.add_listener(fn); engine.start_loop(); engine.submit(spec)   # or on a thread (the server)

What it owns:
- the worker pool (`engine.pool`), whose workers load the checkpoint's family
  (`engine.families`, detected from `model_index.json`) with a parallel plan;
- the `StepScheduler` (`engine.scheduler`): the request lifecycle, step-level batching,
  cancellation at step boundaries, crash recovery;
- the family's request validation, run here on the coordinator before any worker sees
  a request.
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import Callable, Iterator

from engine import worker
from engine.families import detect_family
from engine.parallel import ParallelPlan
from engine.pool import launched_by_torchrun, make_pool
from engine.request import GenerationSpec
from engine.scheduler import RequestState, ScheduledRequest, StepScheduler

Listener = Callable[[str, "ScheduledRequest | None", dict], None]


def resolve_checkpoint(model: str | os.PathLike) -> Path:
    """A shipped model name or a local diffusers directory -> its validated absolute path."""
    from weights import resolve_model

    return Path(resolve_model(model))


class VideoEngine:
    """A model family on a worker pool plus its step scheduler. Build it with `VideoEngine.start`."""

    def __init__(self, pool, family, info: dict, model_dir: Path, **scheduler_options):
        self.pool = pool
        self.family = family
        self.info = info
        self.model_dir = model_dir
        self._listeners: list[Listener] = []
        self._request_listeners: dict[str, Listener] = {}
        self._lock = threading.Lock()
        # max_batch, max_running, max_waiting, decode_chunk_frames, job_timeout_s, oom_retry, ...
        self.scheduler = StepScheduler(pool, on_event=self._dispatch, **scheduler_options)

    @classmethod
    def start(cls, model: str | os.PathLike = "tiny-latte", workers: int = 1, parallel: str = "auto",
              ulysses_degree: int | None = None, device: str | None = None, dtype: str = "float32",
              cfg_parallel: bool = False, attention: str = "auto", launcher: str = "auto",
              vae_tiling: bool = False, **scheduler_options) -> "VideoEngine":
        """Resolve `model`, pick its family and plan, start `workers` processes that load it.

        Under `torchrun` (launcher "auto" or "torchrun") the engine joins the torchrun group
        instead: rank 0 returns the engine, the other ranks serve it and exit.
        `vae_tiling`: decode in the VAE's spatial tiles, as after diffusers' `pipe.vae.enable_tiling()`
        (its default tile sizes); off by default, as in diffusers' pipelines.
        """
        from engine.dist import parse_dtype

        if device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' (default: cuda when available); got {device!r}")
        if attention not in ("auto", "sdpa", "xformers"):
            raise ValueError(f"attention must be auto, sdpa or xformers; got {attention!r}")
        if not isinstance(vae_tiling, bool):
            raise ValueError(f"vae_tiling must be true or false, got {vae_tiling!r}")
        parse_dtype(dtype)
        model_dir = resolve_checkpoint(model)
        family = detect_family(model_dir)
        desc = family.describe(model_dir)
        if launcher == "torchrun" or (launcher == "auto" and launched_by_torchrun()):
            workers = int(os.environ.get("WORLD_SIZE", workers))
        plan = family.resolve_plan(desc, parallel, workers, ulysses_degree, cfg_parallel)
        dtype_name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
        pool = make_pool(workers, setup=worker.setup_worker,
                         setup_args=(str(model_dir), plan, dtype_name, attention, vae_tiling),
                         device=device, launcher=launcher)
        try:
            info = {**desc, **pool.run(worker.model_info)[0]}
        except BaseException:
            pool.close()
            raise
        return cls(pool, family, info, model_dir, **scheduler_options)

    # -- plan -----------------------------------------------------------------------------------

    @property
    def plan(self) -> ParallelPlan:
        return self.info["plan"]

    def set_plan(self, parallel: str, ulysses_degree: int | None = None, cfg_parallel: bool | None = None) -> None:
        """Switch the parallel plan for later steps, without reloading the model."""
        cfg = self.plan.cfg_parallel if cfg_parallel is None else cfg_parallel
        plan = self.family.resolve_plan(self.info, parallel, self.info["workers"], ulysses_degree, cfg)
        self.pool.run(worker.set_plan, plan)
        # a restarted pool (after a worker crash) must come back with the same plan
        model_dir, _, *rest = self.pool.setup_args
        self.pool.setup_args = (model_dir, plan, *rest)
        self.info["plan"] = plan

    # -- requests -------------------------------------------------------------------------------

    def check(self, spec: GenerationSpec) -> GenerationSpec:
        """The family's validation (RequestError naming the field); nothing it refuses reaches a worker."""
        return self.family.check_request(self.info, spec)

    def submit(self, spec: GenerationSpec, listener: Listener | None = None) -> ScheduledRequest:
        """Validate and queue a request; `listener(kind, request, data)` hears its events."""
        spec = self.check(spec)
        if listener is not None:
            with self._lock:
                self._request_listeners[spec.request_id] = listener
        try:
            return self.scheduler.submit(spec)
        except BaseException:
            with self._lock:
                self._request_listeners.pop(spec.request_id, None)
            raise

    def cancel(self, request_id: str) -> bool:
        return self.scheduler.cancel(request_id)

    def run(self, spec: GenerationSpec) -> Iterator[tuple[str, dict]]:
        """Submit `spec` and yield its events (kind, data) until it finishes.

        Without a background loop this drives the scheduler in the caller's thread (the
        Python pipeline); with one (the server) it waits for the loop's events. Closing the
        generator early cancels the request.
        """
        events: queue.SimpleQueue = queue.SimpleQueue()
        req = self.submit(spec, lambda kind, r, data: events.put((kind, data)))
        try:
            while True:
                if self.scheduler.alive or not events.empty():
                    kind, data = events.get()
                else:
                    if not self.scheduler.run_iteration() and events.empty():
                        raise RuntimeError(f"request {spec.request_id} stalled in state {req.state.value}")
                    continue
                yield kind, data
                if kind in ("completed", "failed", "cancelled"):
                    return
        finally:
            if not req.state.finished:
                self.cancel(spec.request_id)
                while not req.state.finished and not self.scheduler.alive:
                    self.scheduler.run_iteration()
            with self._lock:
                self._request_listeners.pop(spec.request_id, None)

    # -- the server's face --------------------------------------------------------------------------

    def add_listener(self, listener: Listener) -> None:
        """`listener(kind, request, data)` hears every request's events (on the scheduler's thread)."""
        self._listeners.append(listener)

    def start_loop(self) -> "VideoEngine":
        """Run the scheduler on a background thread (the server)."""
        self.scheduler.start()
        return self

    def _dispatch(self, kind: str, req: ScheduledRequest | None, data: dict) -> None:
        for listener in self._listeners:
            listener(kind, req, data)
        if req is not None:
            with self._lock:
                mine = self._request_listeners.get(req.id)
            if mine is not None:
                mine(kind, req, data)

    # -- lifecycle ----------------------------------------------------------------------------------

    def close(self) -> None:
        self.scheduler.stop()
        self.pool.close()

    def __enter__(self) -> "VideoEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["VideoEngine", "RequestState", "resolve_checkpoint"]
