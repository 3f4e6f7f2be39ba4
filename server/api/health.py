"""`ServerHealth`: `GET /health` and `GET /metrics` of a video server, read from its parts' public state.

Health reads attributes only (the engine's stats, the store side's free space and faults, the drain),
never waiting for a running job. The metric names are the API's (docs/serving.md lists them); the
counters are bumped by the part that sees the event: `created`, `reused` by the service, `finished`,
`requeued` by the video jobs' outputs, `expired` by the store side.
"""

from __future__ import annotations

from longserve.server.api.errors import StoreUnavailable
from longserve.server.api.jobs import LIVE
from longserve.server.api.metrics import Counter, Gauge, Histogram, Registry


class ServerHealth:
    """`service`: a `VideoService` (its `engine`, `jobs`, `storage`, `shutdown`, `config`, `model_name`)."""

    def __init__(self, service):
        self.service = service
        self._last: dict = {}                 # the store's gauges as last read
        r = self.registry = Registry()
        r.add(Gauge("longserve_queue_depth", "Video requests waiting to be admitted.",
                    lambda: self._stat("waiting")))
        r.add(Gauge("longserve_running_requests", "Admitted video requests (denoising or decoding).",
                    lambda: self._stat("running")))
        r.add(Gauge("longserve_live_sessions", "Open live sessions (WebSocket /v1/videos/live).",
                    lambda: service.jobs.count(LIVE)))
        r.add(Gauge("longserve_kv_cache_bytes", "KV cache held per worker by causal-model requests (counted against "
                    "--live-kv-budget; freed when a request ends).",
                    lambda: service.engine.kv_bytes_held() if service.engine is not None else 0))
        r.add(Gauge("longserve_batch_size", "Requests in the most recent denoising step.",
                    lambda: self._stat("last_batch_size")))
        self.batch = r.add(Histogram("longserve_step_batch_size", "Requests per denoising step.",
                                     (1, 2, 4, 8, 16, 32, 64, 128)))
        self.step_latency = r.add(Histogram("longserve_step_latency_seconds", "Wall time of one denoising step.",
                                            (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)))
        r.add(Gauge("longserve_jobs", "Video jobs in the store, by status.", self._jobs_by_status, labels=("status",)))
        self.created = r.add(Counter("longserve_jobs_created_total", "Video jobs accepted."))
        self.finished = r.add(Counter("longserve_jobs_finished_total", "Video jobs finished, by outcome.",
                                      labels=("outcome",)))
        self.requeued = r.add(Counter("longserve_jobs_requeued_total",
                                      "Admitted jobs queued again after a worker pool restart."))
        self.reused = r.add(Counter("longserve_jobs_reused_total",
                                    "Video jobs completed at once with a stored video's content (an identical "
                                    "request with an explicit seed; --reuse-completed)."))
        self.expired = r.add(Counter("longserve_jobs_expired_total",
                                     "Finished videos whose files were deleted (retention ran out, or the storage "
                                     "quota evicted them); their records stay, marked expired."))
        r.add(Gauge("longserve_stored_video_bytes", "Bytes of the completed videos kept (--max-storage-bytes "
                    "counts these).", lambda: self._from_store("stored", lambda s: s.stored_bytes(), 0)))
        r.add(Gauge("longserve_disk_free_bytes", "Free bytes on the data dir's file system, as last measured.",
                    lambda: (service.storage.free_bytes or 0) if service.storage is not None else 0))
        r.add(Gauge("longserve_worker_restarts", "Worker pool restarts since the server started.",
                    lambda: self._stat("restarts")))
        r.add(Gauge("longserve_workers_ready", "1 while the worker pool is up.",
                    lambda: 1 if self._stat("workers_ready") else 0))
        r.add(Gauge("longserve_replica_claimed_jobs", "Jobs this replica claimed from the shared store, by replica "
                    "(--store postgresql://; none with the SQLite store).",
                    lambda: self._replica("claimed"), labels=("replica",)))
        r.add(Gauge("longserve_replica_work", "Work of this replica's active jobs in default requests, by replica.",
                    lambda: self._replica("work"), labels=("replica",)))

    def _stat(self, name: str):
        engine = self.service.engine
        return getattr(engine.stats(), name) if engine is not None else 0

    def _replica(self, name: str) -> dict:
        replica = getattr(self.service, "replica", None)
        return {} if replica is None else {replica.id: replica.describe()[name]}

    def on_batch(self, step) -> None:
        """The engine's batch listener (its thread): one denoising step of a batch."""
        self.batch.observe(step.batch_size)
        self.step_latency.observe(step.step_s)

    def _jobs_by_status(self) -> dict:
        counts = {s: 0 for s in ("queued", "in_progress", "completed", "failed")}
        counts.update(self._from_store("by_status", lambda s: s.store.counts_by_status(), {}))
        return counts

    def _from_store(self, name: str, read, default):
        """A gauge read from the job store; while it does not answer, the last value read (/metrics still
        answers: /health says why the store is degraded)."""
        storage = self.service.storage
        if storage is None:
            return default
        if getattr(storage.store, "unavailable", None) is not None:     # known down: no wait for the pool
            return self._last.get(name, default)
        try:
            self._last[name] = read(storage)
        except StoreUnavailable:
            pass
        return self._last.get(name, default)

    def metrics_text(self) -> str:
        return self.registry.render()

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body): 200 "ok" only while every worker is up with the model loaded; 503 "starting",
        "restarting" (after a failure), "unavailable" (the workers fail to load, or the engine stopped),
        "draining" or "degraded" (storage)."""
        service = self.service
        config = service.config
        if service.engine is None:
            return 503, {"status": "starting", "model": config.model, "workers": config.engine.workers,
                         "workers_ready": False, "worker_state": "starting", "worker_restarts": 0,
                         "setup_failures": 0, "queued": 0, "running": 0, "last_error": None}
        s = service.engine.stats()
        if not s.loop_alive or s.pool_state in ("unavailable", "closed") or s.setup_failures >= 3:
            status = "unavailable"
        elif s.pool_state == "ready":
            status = "ok"
        else:
            status = s.pool_state if s.pool_state in ("starting", "restarting") else "unavailable"
        error = s.last_error
        reason = None
        if status == "ok" and service.shutdown.draining:
            status, reason = "draining", "the server is shutting down: no new videos"
        elif status == "ok" and (problem := service.storage.problem()) is not None:
            status, reason = "degraded", problem
        body = {"status": status, "model": service.model_name or config.model, "workers": s.workers,
                "workers_ready": s.workers_ready, "worker_state": s.pool_state, "worker_restarts": s.restarts,
                "setup_failures": s.setup_failures, "queued": s.waiting, "running": s.running,
                "last_error": None if error is None else {"kind": error.kind, "rank": error.rank,
                                                          "message": str(error).splitlines()[0][:500]},
                "reason": reason, "disk_free_bytes": service.storage.free_bytes, "warm_up_s": service.warm_up_s}
        if getattr(service, "replica", None) is not None:     # a replica's capacity, for a router to choose by
            body["replica"] = service.replica.describe()
        return (200 if status == "ok" else 503), body
