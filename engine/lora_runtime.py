"""LoRA adapters loaded and unloaded while the engine serves (`VideoEngine.load_lora` / `unload_lora`).

A load is a few worker jobs run by the engine's own loop between two step boundaries, never in the middle of one,
so the requests running meanwhile pause for one job at a time:

    prefetch   each worker reads the file(s) into the page cache on a thread of its own (the job returns at once)
    wait       at each boundary, one cheap job asks the workers whether they are done reading
    attach     each worker loads the adapter (`engine.lora.LoraSet.add`: diffusers' loader, as at start, from
               memory), and hooks its new layers; a worker that fails leaves its model as it was, and the others
               unload it again: the load fails with the reason, the pool stays up

Then the engine's config holds the adapter (requests may name it; a restarted pool loads it at setup, as an
adapter given at start). An unload waits for no request: it is refused while a queued or running request names the
adapter (`LoraInUse`), and is one job (`engine.lora.LoraSet.remove`). Submissions and these checks take one lock,
so a request is never admitted naming an adapter that is going.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time

from longserve.engine import lora, worker
from longserve.engine.config import WorkerConfig

log = logging.getLogger("longserve.engine")


class LoraInUse(ValueError):
    """An unload asked while requests name the adapter."""


class LoraLoads:
    """The engine's pending adapter loads and unloads; `tick()` (the engine's loop thread) moves one on by one job."""

    def __init__(self, engine):
        self.engine = engine
        self.lock = threading.Lock()          # submit's check of `lora` against the config, and an unload's
        self._pending: collections.deque = collections.deque()
        #: {adapter name: the longest worker job of its load or unload (s)}: the most it paused the requests
        self.pauses: dict[str, float] = {}

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    # -- doors (any thread) ---------------------------------------------------------------------------------

    def load(self, adapter: lora.LoraAdapter) -> concurrent.futures.Future:
        """Check `adapter` on the coordinator (the family takes adapters, the file is LoRA safetensors; ValueError
        naming it) and queue its load; the future's result is the adapter, paths resolved."""
        engine = self.engine
        config = engine.config
        for name, value, off in (("compile", config.compile, "none"), ("quantize", config.quantize, "none"),
                                 ("offload", config.offload, "none")):
            if value != off:
                raise ValueError(f"lora: adapters are not loaded while serving with {name}={value!r} (they would "
                                 f"change the compiled, quantized or offloaded blocks); give them at start (--lora)")
        [adapter] = lora.check_adapters((adapter,), engine.family, engine.info.description)
        if any(a.name == adapter.name for a in config.loras) or any(p[1].name == adapter.name for p in self._pending):
            raise ValueError(f"lora: an adapter named {adapter.name!r} is loaded (or loading) already")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._pending.append(["load", adapter, future, "prefetch", time.perf_counter()])
        engine._notify()
        return future

    def unload(self, name: str) -> concurrent.futures.Future:
        if not any(a.name == name for a in self.engine.config.loras):
            raise KeyError(name)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._pending.append(["unload", name, future, "unload", time.perf_counter()])
        self.engine._notify()
        return future

    # -- the engine's loop ---------------------------------------------------------------------------------

    def tick(self) -> None:
        """Move the oldest pending load or unload on by one worker job (between two step boundaries)."""
        if not self._pending or not self.engine.pool.ready:
            return
        item = self._pending[0]
        kind, subject, future, stage, t0 = item
        name = subject if isinstance(subject, str) else subject.name
        job_t0 = time.perf_counter()
        try:
            done = self._unload(subject) if kind == "unload" else self._load_stage(item)
        except Exception as e:  # noqa: BLE001 - the caller hears it; the engine goes on
            self._pending.popleft()
            future.set_exception(e)
            return
        finally:
            self.pauses[name] = max(self.pauses.get(name, 0.0) if stage != "prefetch" and kind == "load" else 0.0,
                                    time.perf_counter() - job_t0)
        if done:
            self._pending.popleft()
            log.info("lora %s: %s in %.2f s (its longest worker job, the most it paused other requests: %.3f s)",
                     name, "unloaded" if kind == "unload" else "loaded", time.perf_counter() - t0, self.pauses[name])
            future.set_result(subject)

    def _load_stage(self, item) -> bool:
        pool, adapter = self.engine.pool, item[1]
        if item[3] == "prefetch":
            pool.run(worker.prefetch_lora, [p for p in (adapter.path, adapter.path_2) if p])
            item[3] = "wait"
            return False
        if item[3] == "wait":
            if all(pool.run(worker.prefetched_lora)):
                item[3] = "attach"
            return False
        errors = pool.run(worker.load_lora, adapter)
        if any(errors):
            pool.run(worker.unload_lora, adapter.name)       # the ranks that took it let it go
            raise ValueError(next(e for e in errors if e))
        self._set_loras(self.engine.config.loras + (adapter,))
        return True

    def _unload(self, name: str) -> bool:
        engine = self.engine
        with self.lock:
            users = [r.id for r in engine.core.scheduler.unfinished() if any(e["name"] == name for e in r.spec.lora)]
            if users:
                raise LoraInUse(f"lora {name!r} is used by {len(users)} queued or running request(s) (e.g. "
                                f"{users[0]}); unload it when they are done")
            self._set_loras(tuple(a for a in engine.config.loras if a.name != name))
        engine.pool.run(worker.unload_lora, name)
        return True

    def _set_loras(self, loras: tuple) -> None:
        """The engine's config with these adapters (what requests are checked against), and the workers' setup: a
        restarted pool loads them as adapters given at start."""
        engine = self.engine
        engine.config = engine.config.replace(loras=loras)
        engine.core.config = engine.config
        engine.worker_config = WorkerConfig(engine.config, engine.worker_config.model_dir, engine.worker_config.plan)
        engine.pool.setup_args = (engine.worker_config,)
