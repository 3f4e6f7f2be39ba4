"""`JobRunner`: follows a job's engine handle and hands its outputs to the job's sink, for videos and live sessions.

A coroutine per job reads the handle's typed outputs as they come (`async for out in handle`): each
non-final one goes to the job's sink (`take`: a video's record, MP4 and SSE events, `server/api/
video_jobs.py`; a live session's fragments, `server/api/live.py`). The final output is handled here,
the one place for both kinds: `Finished` -> `sink.finished`, `Failed` -> `sink.failed`, `Cancelled(reason)`
-> `sink.cancelled`, and the job leaves the registry (its admission work is freed).

When a sink cannot go on (a video's files cannot be written) it returns the failure; the runner ends the
request with it (`abort(id, failure)`), skips the outputs still in flight and ends the job with the final
output that follows, which is that failure (or, if the request had already finished, the runner fails it
all the same). A job deleted meanwhile (no longer in the registry) only gets `cancelled(job, DELETED)`,
whatever its final output: what it wrote is dropped.

Every job starts one way, `launch(job, accepted)`: its request queued on the engine, rolled back out of the registry
when the engine refuses it, then followed. Videos are followed on the runner's own event loop thread, so a client's
connection never
holds one up; a live session's coroutine runs in its WebSocket's loop (`follow`). Blocking work (SQLite,
PNG, feeding ffmpeg) runs on the runner's small thread pool (`run_io`), awaited by that job alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Protocol

from longserve.engine.outputs import ABORTED, FINAL, Cancelled, Failed, Finished, RequestFailure, RequestOutput
from longserve.server.api.jobs import DELETED, Job, JobRegistry

log = logging.getLogger("longserve.server")


class JobSink(Protocol):
    """What a job's outputs become."""

    async def take(self, job: Job, out: RequestOutput) -> RequestFailure | None:
        """A non-final output; a failure returned ends the job with it."""

    async def finished(self, job: Job, timings: dict) -> None: ...

    async def failed(self, job: Job, error: RequestFailure) -> None: ...

    async def cancelled(self, job: Job, reason: str) -> None: ...


class JobRunner:
    """`jobs`: the registry a job leaves when it ends; `engine`: what `launch` queues on (set once it is loaded)."""

    def __init__(self, jobs: JobRegistry, io_threads: int = 8):
        self.jobs = jobs
        self.engine = None
        self.io = concurrent.futures.ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="longserve-io")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="longserve-jobs", daemon=True)

    def start_loop(self) -> None:
        self._thread.start()

    def spawn(self, coroutine) -> concurrent.futures.Future:
        """Run a coroutine on the runner's loop (a video's follower, the store's housekeeping)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def launch(self, job: Job, accepted, then=None, follow: bool = True) -> None:
        """Start a job already in the registry (admitted, or added: a restart's queued job, a replica's claim):
        queue its accepted request on the engine (`job.handle`), run `then()` (a create storing and announcing its
        record), and follow it on the runner's loop (`follow=False`: a live session's socket follows it in its own
        loop). When the engine refuses the request or `then` fails, the request ends, the job leaves the registry
        and the error propagates: its caller says what it means (a 429, an unclaim, a failed record)."""
        try:
            job.handle = self.engine.submit(accepted)
        except BaseException:
            self.jobs.remove(job)
            raise
        if then is not None:
            try:
                then()
            except BaseException:
                job.handle.abort(DELETED)     # nothing was stored: nothing to follow
                self.jobs.remove(job)
                raise
        if follow:
            self.start(job)

    def start(self, job: Job) -> None:
        """Follow a launched video's handle on the runner's loop."""
        self.spawn(self.follow(job))

    async def run_io(self, fn, *args):
        """`fn(*args)` on the runner's thread pool, awaited by the calling job alone."""
        return await asyncio.get_running_loop().run_in_executor(self.io, fn, *args)

    async def follow(self, job: Job) -> None:
        """Hand the job's outputs to its sink, in order, until its final one (the module docstring)."""
        failure = None
        try:
            async for out in job.handle:
                if isinstance(out, FINAL):
                    await self._end(job, out, failure)
                    return
                if failure is not None or not self.jobs.holds(job):
                    continue                  # ending early, or deleted: only the final output matters now
                try:
                    failure = await job.sink.take(job, out)
                except asyncio.CancelledError:
                    raise
                except Exception as e:        # a bug in one job's handling must not touch any other job
                    log.exception("following %s failed", job.id)
                    failure = RequestFailure("internal_error", f"the server failed while handling this "
                                                               f"{job.kind}: {e}", kind=ABORTED)
                if failure is not None:
                    job.handle.abort(failure)
        finally:
            if not self.jobs.remove(job) and job.writer is not None:
                try:                          # deleted while it ended: whatever was written goes too
                    await job.sink.cancelled(job, DELETED)
                except Exception:             # noqa: BLE001 - the loop may be closing; nothing else to do
                    log.exception("dropping the output of deleted %s failed", job.id)

    async def _end(self, job: Job, final: RequestOutput, failure: RequestFailure | None) -> None:
        sink = job.sink
        try:
            if not self.jobs.holds(job):
                await sink.cancelled(job, DELETED)
            elif isinstance(final, Failed):
                await sink.failed(job, final.error)
            elif failure is not None:         # it finished (or was cancelled) before the abort took
                await sink.failed(job, failure)
            elif isinstance(final, Finished):
                await sink.finished(job, final.timings)
            elif isinstance(final, Cancelled):
                await sink.cancelled(job, final.reason)
        except asyncio.CancelledError:
            raise
        except Exception:                     # noqa: BLE001 - the job still leaves the registry
            log.exception("ending %s failed", job.id)

    def close(self) -> None:
        """Stop the followers still running (the engine closed first: their requests ended), then the threads."""
        if self._thread.is_alive():
            pending = self.spawn(self._cancel_followers())
            try:
                pending.result(timeout=30)
            except Exception:
                log.exception("stopping the job followers failed")
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        self.io.shutdown(wait=True, cancel_futures=True)

    async def _cancel_followers(self) -> None:
        tasks = [t for t in asyncio.all_tasks(self.loop) if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
