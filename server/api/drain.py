"""`Shutdown`: SIGTERM's drain of a video server (`server/cli/serve.py` runs it on a thread of its own).

Admit nothing new (the admission gate answers 503 `server_shutdown` while `draining`); queued videos are
released back to the store (`abort(id, "released")`: their records stay queued, and the next start on
this data dir runs them); running videos get `--drain-seconds` to finish; what still runs then is ended
with the failure `server_shutdown` (`abort(id, RequestFailure)`: the record fails with it), and so is
every live session; then every open event stream ends with the error envelope. Each job's final output
is handled by its runner, as any other's.
"""

from __future__ import annotations

import logging
import threading
import time

from longserve.engine.outputs import ABORTED, RequestFailure
from longserve.engine.scheduler import RequestState
from longserve.server.api.jobs import LIVE, RELEASED, VIDEO, JobRegistry
from longserve.server.api.streaming import EventBroker, shutdown_envelope

log = logging.getLogger("longserve.server")

#: how long the drain waits, after its deadline, for the runners to handle what the aborts mean
SETTLE_S = 3.0


class Shutdown:
    def __init__(self, jobs: JobRegistry, broker: EventBroker):
        self.jobs, self.broker = jobs, broker
        self.draining = False                          # no new jobs
        self.drained = False                           # ... and the drain is over: every stream ends

    def drain(self, timeout_s: float, cut_short: threading.Event | None = None) -> None:
        """Blocks (call it from a thread of its own); the caller then stops the HTTP server."""
        self.draining = True
        stop = cut_short or threading.Event()
        deadline = time.monotonic() + timeout_s
        log.warning("draining: %d job(s) active; running videos get %g s to finish", len(self.jobs.jobs()),
                    timeout_s)
        while True:
            running = []
            for job in self._submitted(VIDEO):
                if job.handle.status().state is RequestState.WAITING:
                    job.handle.abort(RELEASED)      # a no-op once asked: the first reason is the one it ends with
                else:
                    running.append(job)
            if not running or time.monotonic() >= deadline or stop.wait(0.1):
                break
        failure = RequestFailure("server_shutdown", f"the server shut down before this video was finished (running "
                                                    f"videos had {timeout_s:g} s to finish); create it again",
                                 kind=ABORTED)
        for job in running:
            job.handle.abort(failure)
        for job in self._submitted(LIVE):
            job.handle.abort(RequestFailure("server_shutdown", "the server is shutting down; the session ends",
                                            kind=ABORTED))
        until = time.monotonic() + SETTLE_S             # the runners handle what the aborts mean
        while self.jobs.jobs(VIDEO) and time.monotonic() < until:
            time.sleep(0.05)
        self.drained = True
        self.broker.close_all("error", shutdown_envelope())
        for job in self.jobs.jobs():
            job.changed.notify()
        log.warning("drained: %d video(s) failed with server_shutdown", len(running))

    def _submitted(self, kind: str):
        return [j for j in self.jobs.jobs(kind) if j.handle is not None]

    def stream_ends_now(self, video_id: str) -> bool:
        """While shutting down: no more events will come for `video_id` (it is not running here any more)."""
        if not self.draining:
            return False
        return self.drained or self.jobs.get(video_id, VIDEO) is None
