"""The server's one registry of active jobs: every video that is queued or running and every open live session.

A job is registered when admission lets it in (`server/api/admission.py` counts the registry's work:
each job carries its cost and its owner, the API key's id) and leaves it when its runner has handled its
final output (`server/api/runner.py`), or at once when it is deleted. What a job does meanwhile is the
engine's (its `RequestHandle`); the registry holds only what the server needs beside it: a video's record
and MP4 writer, the sink its outputs go to, and a notifier for the readers waiting on it.

Why a job ends is the engine's final output, `Cancelled(reason)` or `Failed(error)` when the server
ended it (`VideoEngine.abort`): the reasons below are the server's words.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from longserve.server.notify import Notifier

VIDEO, LIVE = "video", "live"
#: why the server ends a job early (`Cancelled.reason`): a DELETE; a drain sending a queued video back to the
#: store for the next start; a live client that went away
DELETED, RELEASED, DISCONNECTED = "deleted", "released", "disconnected"


@dataclass(eq=False)
class Job:
    """One active job: a video (`record`, `writer`) or a live session; `sink` turns its outputs into effects."""

    id: str
    kind: str                          # VIDEO | LIVE
    cost: float                        # work in default requests (admission's measure)
    owner: str | None = None           # the API key's id (None: no key, or recovered at start)
    handle: Any = None                 # engine.engine.RequestHandle, once submitted
    sink: Any = None                   # what its outputs become (runner.JobSink)
    record: Any = None                 # a video's store.VideoRecord
    writer: Any = None                 # a video's media.FragmentedMP4Writer, from its first frames on
    changed: Notifier = field(default_factory=Notifier)   # a writer exists, or the job ended
    fence: int | None = None           # a replica's claim of the job (shared store: server/api/replicas.py)
    saved_at: float = 0.0              # when a replica last wrote its progress (time.monotonic)
    times: dict = field(default_factory=dict)   # its transitions' epoch times, mux_s (server/api/lifecycle.py)
    sampler: Any = None                # which of its steps get a progress line (logs.ProgressSampler)


class JobRegistry:
    """Thread-safe: routes (threadpool), the runner (the service's loop) and the live door (uvicorn's loop)."""

    def __init__(self):
        self.lock = threading.RLock()
        self._jobs: dict[str, Job] = {}

    def add(self, job: Job) -> None:
        with self.lock:
            if job.id in self._jobs:
                raise ValueError(f"job {job.id!r} is already registered")
            self._jobs[job.id] = job

    def remove(self, job: Job) -> bool:
        """Let `job` go; False if it was not registered (already removed: deleted, or ended)."""
        with self.lock:
            if self._jobs.get(job.id) is not job:
                return False
            del self._jobs[job.id]
        job.changed.notify()
        return True

    def get(self, job_id: str, kind: str | None = None) -> Job | None:
        with self.lock:
            job = self._jobs.get(job_id)
        return job if job is not None and (kind is None or job.kind == kind) else None

    def holds(self, job: Job) -> bool:
        with self.lock:
            return self._jobs.get(job.id) is job

    def jobs(self, kind: str | None = None) -> list[Job]:
        with self.lock:
            return [j for j in self._jobs.values() if kind is None or j.kind == kind]

    def work(self, owner: str | None = None) -> float:
        """Work of every active job (of `owner`, when given), in default requests."""
        with self.lock:
            return sum(j.cost for j in self._jobs.values() if owner is None or j.owner == owner)

    def count(self, kind: str) -> int:
        return len(self.jobs(kind))
