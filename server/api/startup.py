"""`StartupProgress`: what a starting server is doing, told as it goes (a log line per stage) and read by
`/health/ready` and `/health/live` (their bodies' `startup`).

`longserve serve` listens before it loads: `/health/live` answers from the first moment, `/health/ready` says 503
`starting` with the stage until the model is loaded and warmed. The stages, in order:

    store      open the job store (PostgreSQL: bounded retries while it does not answer, `--store-wait`)
    workers    start the worker pool: each worker loads the checkpoint (the long part of a large model's start)
    warm_up    one video at the warm-up shape (`--warm-up-shape`, default the model's), its steps and frames told
    recover    the queued jobs of the last run, queued again

A stage's detail (the warm-up's step, its frames) changes while it runs; only the stage's start and end are logged.
"""

from __future__ import annotations

import logging
import threading
import time

from longserve.server.api.config import parse_shape

log = logging.getLogger("longserve.server")


class StartupProgress:
    def __init__(self):
        self._lock = threading.Lock()
        self.started_at = time.monotonic()
        self.stages: list[dict] = []        # {"stage", "what", "status": running|done|failed, "detail", "s"}
        self.ready = False
        self.error: str | None = None

    def begin(self, stage: str, detail: str = "") -> None:
        with self._lock:
            self.stages.append({"stage": stage, "what": detail, "status": "running", "detail": "", "s": None,
                                "_t0": time.monotonic()})
        log.info("starting: %s%s", stage, f": {detail}" if detail else "")

    def note(self, detail: str) -> None:
        """The running stage's detail changed (a warm-up step, frames decoded): read by the health bodies."""
        with self._lock:
            if self.stages and self.stages[-1]["status"] == "running":
                self.stages[-1]["detail"] = detail

    def done(self, detail: str | None = None) -> None:
        """The running stage ended; `detail`: what came of it (its last progress note otherwise)."""
        with self._lock:
            stage = self.stages[-1]
            stage["status"], stage["s"] = "done", round(time.monotonic() - stage["_t0"], 3)
            if detail is not None:
                stage["detail"] = detail
        log.info("started: %s in %.1f s%s", stage["stage"], stage["s"], f" ({detail})" if detail else "")

    def failed(self, error: str) -> None:
        with self._lock:
            self.error = error
            if self.stages and self.stages[-1]["status"] == "running":
                stage = self.stages[-1]
                stage["status"], stage["s"] = "failed", round(time.monotonic() - stage["_t0"], 3)

    def finish(self) -> None:
        with self._lock:
            self.ready = True
        log.info("started in %.1f s: ready", time.monotonic() - self.started_at)

    def view(self) -> dict:
        """{"stage", "detail", "elapsed_s", "stages": [{"stage", "what", "status", "detail", "s"}, ...], "error"}:
        the running stage and its latest progress (or what it does), and every stage so far."""
        with self._lock:
            stages = [{k: v for k, v in s.items() if not k.startswith("_")} for s in self.stages]
            current = next((s for s in reversed(stages) if s["status"] != "done"), None)
            return {"stage": "ready" if self.ready else (current or {"stage": "starting"})["stage"],
                    "detail": (current["detail"] or current["what"]) if current else "", "error": self.error,
                    "elapsed_s": round(time.monotonic() - self.started_at, 3), "stages": stages}


def warm_up_listener(progress: StartupProgress):
    """An `engine.warm_up(on_output=...)` listener telling the warm-up's steps and frames to `progress`."""
    from longserve.engine.outputs import FramesChunk, StepProgress

    def heard(out) -> None:
        if isinstance(out, StepProgress):
            progress.note(f"step {out.step}/{out.num_steps}")
        elif isinstance(out, FramesChunk):
            progress.note(f"decoded frames {out.stop}/{out.num_frames}")

    return heard


def describe_store(config) -> str:
    """Where jobs live, for the start's lines: the SQLite file under --data-dir, or the shared PostgreSQL (its
    password hidden), and where the videos go."""
    from longserve.server.api.config import safe_url

    where = f"PostgreSQL {safe_url(config.store)} (shared by the replicas)" if config.store else \
        f"SQLite under {config.data_dir}"
    return where + (f", videos in {config.media_store}" if config.media_store else "")


def check_warm_up_shape(config) -> None:
    """Before the load: a `--warm-up-shape` the model refuses is a ValueError naming the flag, said in a second."""
    from longserve.engine.engine import check_before_load, resolve_checkpoint
    from longserve.engine.families import detect_family
    from longserve.engine.request import RequestError, default_request

    model_dir = resolve_checkpoint(config.model)
    request = default_request(detect_family(model_dir).describe(model_dir), "warm-up-check")
    request.width, request.height, request.num_frames = parse_shape(config.warm_up_shape)
    try:
        check_before_load(config.engine, request)
    except RequestError as e:
        raise ValueError(f"--warm-up-shape {config.warm_up_shape}: {e}") from None


def warm_up(engine, config, progress: StartupProgress) -> float:
    """The warm-up video at `--warm-up-shape` (the model's default shape without it), its steps and frames told to
    `progress`; its wall time (s)."""
    shape = parse_shape(config.warm_up_shape) or (None, None, None)
    d = engine.defaults
    width, height, frames = (shape[0] or d.width, shape[1] or d.height, shape[2] or d.num_frames)
    progress.begin("warm_up", f"one video at {width}x{height}, {frames} frames")
    seconds = engine.warm_up(*shape, on_output=warm_up_listener(progress))
    progress.done(f"{seconds:.1f} s")
    return seconds
