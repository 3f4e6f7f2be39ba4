"""`VideoEngine`: the one door to a checkpoint on a pool of workers.

The Python pipeline and the HTTP server both talk to this object and nothing below it,
as vLLM's `LLM` and API server both sit on its engine:

    engine = VideoEngine.start(EngineConfig(model="tiny-wan", workers=2))
    accepted = engine.accept(RequestInput("a red ball", seconds=2))   # RequestError naming a field
    handle = engine.submit(accepted)                                  # QueueFullError
    for out in handle: ...                # typed outputs (engine.outputs); `async for` in a coroutine
    engine.abort(handle.request_id, "deleted"); engine.stats(); engine.close()

What it owns:
- the worker pool (`engine.pool`), whose workers load the checkpoint's family
  (`engine.families`, detected from `model_index.json`) with a parallel plan;
- the `EngineCore` (`engine/core.py`), which carries out the `Scheduler`'s decision of
  every step boundary on the pool, on a thread of the engine's own;
- the one accept path of a request (`accept`: a door's `RequestInput` -> `Accepted`, a checked
  `GenerationSpec` with the frames it hands out and the door's price of it, engine/request.py's completion run
  once), before anything is queued; `submit(accepted)` queues it as it is;
- why a request ends early (`abort(id, reason)`): its final output says so.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator, Protocol

from longserve.engine import lora, worker
from longserve.engine.config import EngineConfig, ModelInfo, WorkerConfig
from longserve.engine.core import BatchStep, EngineCore
from longserve.engine.families import detect_family
from longserve.engine.lora_runtime import LoraLoads
from longserve.engine.outputs import CANCELLED, FINAL, Finished, RequestFailure, RequestOutput
from longserve.engine.parallel import ParallelPlan
from longserve.engine.pool import WorkerError, launched_by_torchrun, make_pool
from longserve.engine.profile import resolve_profile
from longserve.engine.request import (
    GenerationSpec,
    RequestError,
    RequestInput,
    check_prompts,
    complete_request,
    default_request,
    fill_request,
)
from longserve.engine.scheduler import PromptSwitch, QueueFullError, RequestState, ScheduledRequest

log = logging.getLogger("longserve.engine")


class DoorLimits(Protocol):
    """A front door's own limits on a request (the server's longest video, most steps, ...) and its price."""

    def check(self, spec: GenerationSpec) -> None:
        """The filled-in spec, before the model's checks: a value past the door's limits never reaches those."""

    def cost(self, spec: GenerationSpec) -> float:
        """What the checked request costs the door (the server's admission: its work in default requests)."""


@dataclass(frozen=True)
class Accepted:
    """A request the engine accepted (`VideoEngine.accept`): complete and checked once; `submit` queues it as it
    is. content_frames: the frames it hands out (an extension's: the video's and the new ones); cost: the door's
    price of it (`DoorLimits.cost`; 0 for a door without limits)."""

    spec: GenerationSpec
    content_frames: int
    cost: float = 0.0


def check_speed_levers(config: EngineConfig, family, desc, plan: ParallelPlan, model_dir=None) -> None:
    """Refuse, before any worker loads, a `compile`, `quantize` or `attention_backend` that could not run (ValueError
    naming it)."""
    from longserve.engine.attention import check_backend
    from longserve.engine.dist import default_device
    from longserve.engine.quantize import check_fp8

    check_backend(config, family, plan, config.device or default_device(), model_dir)
    family.check_decoder(config, desc, model_dir)
    if config.live_loop == "stages":
        from longserve.engine.live_stages import check_stages

        check_stages(config, desc)
    if config.sparse_attention != "none" and family.name not in ("wan", "wan-i2v", "wan-ti2v"):
        raise ValueError(f"sparse_attention={config.sparse_attention!r} is built for the Wan family's T2V, I2V and "
                         f"TI2V models; {config.model!r} is a {desc.family} model")

    if config.compile != "none":
        if not family.supports_compile:
            raise ValueError(f"compile={config.compile!r} is not available for {config.model!r} (a {desc.family} "
                             f"model): regional compile is built for Latte and the Wan family (T2V, I2V, TI2V, "
                             f"diffusion forcing, causal live)")
        if config.loras:
            raise ValueError(f"compile={config.compile!r} cannot be used with --lora: the adapters are added per row "
                             f"inside the blocks from state that changes with every batch, which a compiled block "
                             f"would guard on (a recompile per batch) or bake in")
    if config.cuda_graphs:
        device = config.device or default_device()
        if device != "cuda":
            raise ValueError(f"cuda_graphs=True needs CUDA: this engine runs on {device}")
        if not family.supports_cuda_graphs:
            raise ValueError(f"cuda_graphs=True is not available for {config.model!r} (a {desc.family} model): CUDA "
                             f"graphs are built for live (causal) models, whose forwards keep their shapes")
        if config.compile != "blocks":
            raise ValueError("cuda_graphs=True replays the compiled blocks: it needs compile='blocks'")
    if config.quantize != "none":
        if not family.supports_compile:      # the same families: those whose blocks the engine knows
            raise ValueError(f"quantize={config.quantize!r} is not available for {config.model!r} (a {desc.family} "
                             f"model): FP8 weights are built for Latte and the Wan family")
        check_fp8(config.replace(parallel=plan.name), config.device or default_device())


def resolve_checkpoint(model: str | os.PathLike) -> Path:
    """A shipped model name or a local diffusers directory -> its validated absolute path."""
    from longserve.weights import resolve_model

    return Path(resolve_model(model))


@dataclass(frozen=True)
class RequestStatus:
    """Where a request stands now (read from the engine's own state, never waiting)."""

    state: RequestState
    step: int
    num_steps: int
    frames_done: int
    num_frames: int
    queue_position: int | None
    admissions: int


@dataclass(frozen=True)
class EngineStats:
    waiting: int
    running: int
    steps_run: int
    requests_stepped: int
    last_batch_size: int
    crashes: int
    pool_state: str                  # "starting" | "ready" | "restarting" | "unavailable" | "closed"
    workers: int
    workers_ready: bool
    restarts: int
    setup_failures: int
    last_error: WorkerError | None
    loop_alive: bool
    compiled_graphs: int = 0         # `compile` blocks: graphs rank 0 has compiled (warm-up included); bounded


class RequestHandle:
    """One submitted request: its outputs (iterate, sync or async), its status, its cancellation.

    Leaving the iteration before the final output (break, an exception, a closed generator)
    cancels the request."""

    def __init__(self, engine: "VideoEngine", req: ScheduledRequest):
        self._engine, self._req = engine, req

    @property
    def request_id(self) -> str:
        return self._req.id

    @property
    def spec(self) -> GenerationSpec:
        """The request as completed and checked (`VideoEngine.complete`)."""
        return self._req.spec

    @property
    def finished(self) -> bool:
        return self._req.state.finished

    def status(self) -> RequestStatus:
        r = self._req
        return RequestStatus(r.state, r.steps_done, r.num_steps, r.frames_done, r.num_frames, r.queue_position,
                             r.admissions)

    def abort(self, reason: str | RequestFailure = CANCELLED) -> bool:
        """End the request early, for `reason` (`VideoEngine.abort`)."""
        return self._engine.abort(self.request_id, reason)

    def cancel(self) -> bool:
        """`abort("cancelled")`: what leaving the iteration early does."""
        return self.abort(CANCELLED)

    def switch(self, prompt: str) -> PromptSwitch | None:
        """A live session's new prompt, applied at its next chunk (its chunks' `FramesChunk.live.prompt_index` tells):
        its index, and the held switch it replaced (`VideoEngine.switch`); None once the request ended."""
        return self._engine.switch(self.request_id, prompt)

    def stop(self) -> bool:
        """A live session ends after the chunk it is making (its frames so far are delivered, then Finished)."""
        return self._engine.update(self.request_id, stop=True)

    def __iter__(self) -> Iterator[RequestOutput]:
        done = False
        try:
            while True:
                out = self._req.stream.get(timeout=1.0)
                if out is None:
                    self._engine._check_running()
                    continue
                done = isinstance(out, FINAL)
                yield out
                if done:
                    return
        finally:
            if not done:
                self.cancel()

    async def _aiter(self) -> AsyncIterator[RequestOutput]:
        done = False
        try:
            while True:
                out = await self._req.stream.aget()
                done = isinstance(out, FINAL)
                yield out
                if done:
                    return
        finally:
            if not done:
                self.cancel()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter()


def check_before_load(config: EngineConfig, request: RequestInput) -> GenerationSpec:
    """`request` completed and checked against the checkpoint's description, before any worker loads the model
    (RequestError naming the field): what `complete` will say of it after the load, said in a second, not after
    the load (an image given to a text-only checkpoint, a frame count or size the model refuses, ...)."""
    model_dir = resolve_checkpoint(config.model)
    family = detect_family(model_dir)
    return complete_request(request, family, family.describe(model_dir), config)


class VideoEngine:
    """A model family on a worker pool, its scheduler and engine core. Build it with `VideoEngine.start`."""

    def __init__(self, pool, family, info: ModelInfo, model_dir: Path, config: EngineConfig,
                 worker_config: WorkerConfig):
        self.pool = pool
        self.family = family
        self.info = info
        self.model_dir = model_dir
        self.config = config
        self.worker_config = worker_config
        self._batch_listeners: list[Callable[[BatchStep], None]] = []
        self.core = EngineCore(pool, config, on_batch=self._on_batch)
        self.loras = LoraLoads(self)          # adapters loaded and unloaded while serving (engine/lora_runtime.py)
        self._wake = threading.Condition()
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="longserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, config: EngineConfig | None = None, **options) -> "VideoEngine":
        """Resolve the model, pick its family and plan, start the workers that load it, start the loop.

        `options` override fields of `config` (`VideoEngine.start(model="tiny-wan", workers=2)`). Under
        `torchrun` (launcher "auto" or "torchrun") the engine joins the torchrun group instead: rank 0
        returns the engine, the other ranks serve it and exit.
        """
        config = (config or EngineConfig()).replace(**options) if options else (config or EngineConfig())
        model_dir = resolve_checkpoint(config.model)
        family = detect_family(model_dir)
        desc = family.describe(model_dir)
        config = resolve_profile(config, family, desc)          # "fast": the levers that win here (engine/profile.py)
        if config.loras:             # the files are read by the workers; what the coordinator can check, it does here
            config = config.replace(loras=lora.check_adapters(config.loras, family, desc))
        if config.offload == "expert" and not desc.capabilities.two_experts:
            raise ValueError(f"offload='expert' needs a two-expert checkpoint (Wan 2.2 A14B: transformer, "
                             f"transformer_2 and boundary_ratio); {config.model!r} has one denoiser")
        if config.cache is not None and "cache" not in desc.options:
            raise ValueError(f"cache: step caching is not available for {config.model!r} (a {desc.family} model; "
                             f"it is for Latte and the Wan family)")
        if config.cache is not None:        # a default every request would be refused for is refused now

            probe = types.SimpleNamespace(options={"cache": config.cache})
            try:
                family.check_cache(desc, probe)
            except RequestError as e:
                raise ValueError(f"cache: {e}") from None
        if (config.default_steps, config.default_guidance_scale, config.default_fps) != (None, None, None):
            try:                            # operator defaults every request would be refused for are refused now
                complete_request(default_request(desc, "defaults"), family, desc, config)
            except RequestError as e:
                raise ValueError(f"the request defaults (--default-steps, --default-guidance-scale, --default-fps) "
                                 f"do not suit {config.model!r}: {e}") from None
        if config.launcher == "torchrun" or (config.launcher == "auto" and launched_by_torchrun()):
            config = config.replace(workers=int(os.environ.get("WORLD_SIZE", config.workers)))
        plan = family.resolve_plan(desc, config.parallel, config.workers, config.ulysses_degree,
                                   config.cfg_parallel)
        check_speed_levers(config, family, desc, plan, model_dir)
        worker_config = WorkerConfig(config, str(model_dir), plan)
        # compiling at load (the warm-up's steps, inductor's code generation) adds minutes to a large model's start
        pool = make_pool(config.workers, setup=worker.setup_worker, setup_args=(worker_config,),
                         device=config.device, launcher=config.launcher,
                         start_timeout_s=300.0 if config.compile == "none" else 1800.0)
        try:
            info = ModelInfo(desc, **pool.run(worker.model_info)[0])
        except BaseException:
            pool.close()
            raise
        return cls(pool, family, info, model_dir, config, worker_config)

    # -- plan -----------------------------------------------------------------------------------

    @property
    def plan(self) -> ParallelPlan:
        return self.info.plan

    def set_plan(self, parallel: str, ulysses_degree: int | None = None, cfg_parallel: bool | None = None) -> None:
        """Switch the parallel plan for later steps, without reloading the model (while nothing runs)."""
        cfg = self.plan.cfg_parallel if cfg_parallel is None else cfg_parallel
        plan = self.family.resolve_plan(self.info.description, parallel, self.info.workers, ulysses_degree, cfg)
        from longserve.engine.attention import check_plan

        check_plan(self.config.attention_backend, self.family, plan, self.info.workers)
        self.pool.run(worker.set_plan, plan)
        # a restarted pool (after a worker crash) must come back with the same plan
        self.worker_config = WorkerConfig(self.config, self.worker_config.model_dir, plan)
        self.pool.setup_args = (self.worker_config,)
        self.info = dataclasses.replace(self.info, plan=plan)

    # -- requests -------------------------------------------------------------------------------

    @property
    def defaults(self):
        """What a request that leaves a field out gets (`GenerationDefaults`): the model's, with the operator's
        `default_steps`, `default_guidance_scale` and `default_fps` in their place where set."""
        return self.config.request_defaults(self.info.description.defaults)

    def accept(self, request: RequestInput | GenerationSpec, limits: DoorLimits | None = None) -> Accepted:
        """A door's request -> `Accepted`, in one call: complete and check it (engine/request.py: defaults,
        seconds -> frames, prompt checks, the family's checks; RequestError naming the field), count the frames it
        hands out and price it. `limits.check`, a door's own limits, sees the filled-in spec before the model's
        checks, so a value past them never reaches those. A `GenerationSpec` (a stored job read back) is checked
        as it is."""
        desc = self.info.description
        if limits is not None and isinstance(request, RequestInput):
            request = fill_request(request, desc, self.defaults)
            limits.check(request)
        spec = complete_request(request, self.family, desc, self.config)
        content = self.family.content_frames(desc, spec)
        return Accepted(spec, content, limits.cost(spec) if limits is not None else 0.0)

    def complete(self, request: RequestInput | GenerationSpec) -> GenerationSpec:
        """`accept(request).spec`: the checked spec alone (the pipeline's `make_spec`)."""
        return self.accept(request).spec

    def submit(self, request: Accepted | RequestInput | GenerationSpec) -> RequestHandle:
        """Queue an accepted request as it is (QueueFullError when `max_queue` requests wait); anything else is
        accepted first (`accept`). Its outputs come through the returned handle."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        accepted = request if isinstance(request, Accepted) else self.accept(request)
        spec = accepted.spec
        with self.loras.lock:                 # its adapters stay loaded until it is queued (an unload waits)
            loaded = {a.name for a in self.config.loras}
            gone = [e["name"] for e in spec.lora if e["name"] not in loaded]
            if gone:                          # unloaded between its acceptance and now
                raise RequestError("lora", f"lora {gone[0]!r} was unloaded while the request was accepted; "
                                           f"loaded: {', '.join(sorted(loaded)) or 'none'}")
            kv = self.family.kv_bytes(self.info.description, spec, self.config)
            req = self.core.add_request(spec, kv)
        self._notify()
        return RequestHandle(self, req)

    def load_lora(self, adapter) -> "concurrent.futures.Future":
        """Load a LoRA adapter (`engine.lora.LoraAdapter`, or "NAME=PATH[:SCALE]") on every worker while serving,
        between step boundaries (engine/lora_runtime.py); its future resolves once requests may name it. ValueError
        naming it for one the coordinator can refuse at once."""
        if isinstance(adapter, str):
            adapter = lora.parse_adapter(adapter)
        return self.loras.load(adapter)

    def unload_lora(self, name: str) -> "concurrent.futures.Future":
        """Unload an adapter (KeyError for an unknown name; the future fails with `LoraInUse` while a queued or
        running request names it)."""
        return self.loras.unload(name)

    def kv_bytes_held(self) -> int:
        """KV cache bytes per worker that unfinished requests hold (counted against `live_kv_budget`)."""
        return self.core.scheduler.kv_bytes_held()

    def switch(self, request_id: str, prompt: str) -> PromptSwitch | None:
        """A running request's new prompt (a live session's), held by the scheduler until the request's next
        chunk start and replacing any switch held before it (that one never applies: `PromptSwitch.replaced`).
        RequestError naming `prompt` for a bad one; None when the request is unknown or finished."""
        req = self.core.scheduler.get(request_id)
        if req is None:
            return None
        check_prompts(prompt)
        payload = self.family.check_update(self.info.description, req.spec, {"prompt": prompt})
        result = self.core.scheduler.switch(request_id, payload)
        self._notify()
        return result

    def update(self, request_id: str, **payload) -> bool:
        """Change a running request at its next step boundary: a live session's `prompt=` (applied at its next
        chunk) or `stop=True` (it ends after the chunk it is making). The family checks the payload
        (RequestError naming the field). False when the request is unknown or finished."""
        if set(payload) == {"prompt"}:
            return self.switch(request_id, payload["prompt"]) is not None
        req = self.core.scheduler.get(request_id)
        if req is None:
            return False
        if "prompt" in payload:
            check_prompts(payload["prompt"])
        payload = self.family.check_update(self.info.description, req.spec, payload)
        ok = self.core.update_request(request_id, payload)
        self._notify()
        return ok

    def abort(self, request_id: str, reason: str | RequestFailure = CANCELLED) -> bool:
        """End a request early: a waiting one now, a running one at the next step boundary. Its final output says
        why: `Cancelled(reason)` for a word ("cancelled", "deleted", "released", "disconnected", ...),
        `Failed(reason)` for a `RequestFailure` (kind `outputs.ABORTED`). The first reason asked for wins. False if
        it is unknown or already finished."""
        found = self.core.abort_request(request_id, reason)
        if found:
            self._notify()
        return found

    def warm_up(self, width: int | None = None, height: int | None = None, num_frames: int | None = None,
                on_output: Callable[[RequestOutput], None] | None = None) -> float:
        """One throw-away request at the model's default shape (or `width` x `height` x `num_frames`: the shape the
        deployment will serve), run through every stage (encode, a denoising step, the decode), so that what the
        first request would pay once (first calls into each module, allocator growth, the VAE's first decode) is
        paid before a server says it is ready. One step when the model takes one (the shape is what matters), else
        its default steps. `on_output` hears each of its outputs (progress). -> wall time (s). RequestError naming
        the field for a shape the model refuses."""
        request = default_request(self.info.description, f"warm-up-{time.monotonic_ns()}")
        request.width, request.height, request.num_frames = width, height, num_frames
        request.num_inference_steps = 1
        t0 = time.perf_counter()
        try:
            handle = self.submit(request)
        except RequestError:                   # a model that takes no single step: its default steps
            request.num_inference_steps = None
            handle = self.submit(request)
        for out in handle:
            if on_output is not None:
                on_output(out)
        if isinstance(out, FINAL) and not isinstance(out, Finished):
            raise RuntimeError(f"the warm-up video did not finish: {out}")
        return time.perf_counter() - t0

    def stats(self) -> EngineStats:
        core, pool = self.core, self.pool
        return EngineStats(waiting=core.scheduler.num_waiting, running=core.scheduler.num_admitted,
                           steps_run=core.steps_run, requests_stepped=core.requests_stepped,
                           last_batch_size=core.last_batch_size, crashes=core.crashes, pool_state=pool.state,
                           workers=pool.workers, workers_ready=pool.ready, restarts=pool.restarts,
                           setup_failures=core.setup_failures, last_error=pool.last_error,
                           loop_alive=self._thread.is_alive(),
                           compiled_graphs=core.compiled_graphs or self.info.compiled_graphs)

    def add_batch_listener(self, listener: Callable[[BatchStep], None]) -> None:
        """`listener(BatchStep)` hears every denoising step of every batch (on the engine's thread: keep it short)."""
        self._batch_listeners.append(listener)

    def _on_batch(self, step: BatchStep) -> None:
        for listener in self._batch_listeners:
            try:
                listener(step)
            except Exception:  # a listener's bug must not stop the engine
                log.exception("batch listener failed")

    # -- the loop -------------------------------------------------------------------------------------

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def _loop(self) -> None:
        core = self.core
        while True:
            with self._wake:
                while not self._stopping and not core.scheduler.has_work and self.pool.ready \
                        and not self.loras.busy:
                    self._wake.wait(timeout=1.0)
                if self._stopping:
                    return
            try:
                self.loras.tick()             # a pending adapter load or unload: one worker job, between boundaries
                if not core.step():
                    # the workers are down (wait for the next attempt, or a cancellation), or nothing to do yet
                    wait = max(0.05, min(1.0, core.retry_in_s)) if not self.pool.ready else 0.05
                    with self._wake:
                        if not self._stopping:
                            self._wake.wait(timeout=wait)
            except Exception:  # the loop must outlive any bug in one iteration
                log.exception("engine iteration failed")
                time.sleep(0.1)

    def _check_running(self) -> None:
        if self._closed or not self._thread.is_alive():
            raise RuntimeError("the engine stopped before the request finished")

    # -- lifecycle ----------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        self._thread.join(timeout=60)
        self.core.close()            # unfinished requests end now: their readers (sync or async) get Failed
        self.pool.close()

    def __enter__(self) -> "VideoEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["VideoEngine", "RequestHandle", "RequestStatus", "EngineStats", "RequestState", "QueueFullError",
           "resolve_checkpoint"]
