"""`ServerHealth`: `GET /health/live`, `GET /health/ready` (and `/health`, the same) of a video server, read from its
parts' public state.

Health reads attributes only (the engine's stats, the store side's free space and faults, the drain, the start's
progress), never waiting for a running job. `/metrics` is `server/api/metrics.py`'s.
"""

from __future__ import annotations


class ServerHealth:
    """From the start: the `ServeConfig`, the start's progress (`StartupProgress`) and the drain (`Shutdown`); once
    the server is serving (`serving`): its engine, storage side, model name, warm-up time and replica (or None)."""

    def __init__(self, config, startup, shutdown):
        self.config, self.startup, self.shutdown = config, startup, shutdown
        self.engine = self.storage = self.model_name = self.warm_up_s = self.replica = None
        self.started = False

    def serving(self, engine, storage, model_name: str, warm_up_s: float | None, replica=None) -> None:
        """The server is started: the model is loaded and warm, old jobs recovered."""
        self.engine, self.storage, self.model_name = engine, storage, model_name
        self.warm_up_s, self.replica = warm_up_s, replica
        self.started = True

    def live(self) -> dict:
        """`/health/live`: the process answers (from the moment it listens, while it loads, while it drains); what
        it is doing, so a probe's log says it."""
        view = self.startup.view()
        return {"status": "alive", "stage": view["stage"], "detail": view["detail"],
                "uptime_s": view["elapsed_s"], "draining": self.shutdown.draining}

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body): 200 "ok" only while every worker is up with the model loaded and warm (the
        `/health/ready` and `/health` answer); 503 "starting" (with the start's stage in `startup`),
        "restarting" (after a failure), "unavailable" (the workers fail to load, or the engine stopped),
        "draining" or "degraded" (storage)."""
        config = self.config
        startup = self.startup.view()
        if not self.started:               # loading (the server listens first): the stage says where it is
            failed = startup["error"] is not None
            return 503, {"status": "unavailable" if failed else "starting", "model": config.model,
                         "workers": config.engine.workers, "workers_ready": False, "worker_state": "starting",
                         "worker_restarts": 0, "setup_failures": 0, "queued": 0, "running": 0, "last_error": None,
                         "reason": startup["error"], "startup": startup}
        s = self.engine.stats()
        if not s.loop_alive or s.pool_state in ("unavailable", "closed") or s.setup_failures >= 3:
            status = "unavailable"
        elif s.pool_state == "ready":
            status = "ok"
        else:
            status = s.pool_state if s.pool_state in ("starting", "restarting") else "unavailable"
        error = s.last_error
        reason = None
        if status == "ok" and self.shutdown.draining:
            status, reason = "draining", "the server is shutting down: no new videos"
        elif status == "ok" and (problem := self.storage.problem()) is not None:
            status, reason = "degraded", problem
        body = {"status": status, "model": self.model_name or config.model, "workers": s.workers,
                "workers_ready": s.workers_ready, "worker_state": s.pool_state, "worker_restarts": s.restarts,
                "setup_failures": s.setup_failures, "queued": s.waiting, "running": s.running,
                "last_error": None if error is None else {"kind": error.kind, "rank": error.rank,
                                                          "message": str(error).splitlines()[0][:500]},
                "reason": reason, "disk_free_bytes": self.storage.free_bytes, "warm_up_s": self.warm_up_s,
                "startup": startup}
        if self.replica is not None:                  # a replica's capacity, for a router to choose by
            body["replica"] = self.replica.describe()
        return (200 if status == "ok" else 503), body
