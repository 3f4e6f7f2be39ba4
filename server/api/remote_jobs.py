"""`RemoteJobs`: the jobs another replica runs, as this replica's clients follow them (`server/api/replicas.py`).

Any replica answers the events (`/events`) and the streamed download (`/content?stream=true`) of any job. For a job
that runs elsewhere this replica has one watcher per job, whatever the number of its clients: one query every
`REMOTE_POLL_S` (the job's status, progress and claim), and on an object store one look for the claim's first
piece, shared by every SSE subscriber (published through the event broker) and every streamed download here
(woken through the watch's notifier). 300 clients of one job cost what one does: a few queries a second.

A download reads the file the other replica writes (`RemoteFile`, through `streaming.tail_file`) or the pieces it
puts in an object store (`ObjectTail`); it ends when the watch says the claim ended.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from longserve.server.api.errors import StoreUnavailable
from longserve.server.api.object_media import ObjectTail, piece_name
from longserve.server.notify import Notifier

log = logging.getLogger("longserve.server")

#: how often a job that runs on another replica is looked at (once for all of this replica's clients)
REMOTE_POLL_S = 0.5
ACTIVE = ("queued", "in_progress")


class JobWatch:
    """What this replica knows of a job another replica runs: `state` (status, progress, lease owner, fence),
    None once the job is gone; `writing`: the claim's file (or first piece) exists. `changed` wakes the downloads
    waiting on it."""

    def __init__(self, video_id: str):
        self.video_id = video_id
        self.state: tuple | None = None
        self.known = False               # polled at least once
        self.writing = False
        self.users = 0                   # streamed downloads following it
        self.changed = Notifier()

    @property
    def active(self) -> bool:
        return self.state is not None and self.state[0] in ACTIVE

    def claim_state(self, fence: int) -> str:
        """'running' while the claim `fence` runs the job, 'completed' once it published it, else 'gone' (as
        `ObjectTail` asks)."""
        if self.state is None or self.state[3] != fence:
            return "gone"
        return "completed" if self.state[0] == "completed" else "running" if self.active else "gone"


class RemoteJobs:
    """A replica's watches of the jobs other replicas run: the shared store, the job runner (its loop and io
    threads), the event broker and this replica's job registry."""

    def __init__(self, store, runner, broker, jobs):
        self.store, self.runner, self.broker, self.jobs = store, runner, broker, jobs
        self._lock = threading.Lock()
        self._watches: dict[str, JobWatch] = {}

    def watch(self, video_id: str, download: bool = False) -> JobWatch:
        """The job's watch, started when it is the first (a download counts as a user until `leave`; SSE
        subscribers are the broker's)."""
        with self._lock:
            watch = self._watches.get(video_id)
            new = watch is None
            if new:
                watch = self._watches[video_id] = JobWatch(video_id)
            if download:
                watch.users += 1
        if new:
            self.runner.spawn(self._poll(watch))
        return watch

    def leave(self, watch: JobWatch) -> None:
        with self._lock:
            watch.users = max(0, watch.users - 1)

    def _wanted(self, watch: JobWatch) -> bool:
        with self._lock:
            wanted = watch.users > 0 or self.broker.has_subscribers(watch.video_id)
            if not wanted or self.jobs.get(watch.video_id) is not None:     # (or it runs here now)
                self._watches.pop(watch.video_id, None)
                return False
            return True

    async def _poll(self, watch: JobWatch) -> None:
        from longserve.server.api.video_jobs import video_view

        loop, io, broker = asyncio.get_running_loop(), self.runner.io, self.broker
        video_id, published = watch.video_id, None
        try:
            while self._wanted(watch):
                try:
                    state = await loop.run_in_executor(io, self.store.job_state, video_id)
                    writing = state is not None and state[2] is not None and state[0] in ACTIVE and \
                        await loop.run_in_executor(io, self._writing, video_id, state[3])
                except StoreUnavailable:          # /health says so; the clients wait for the next look
                    await asyncio.sleep(REMOTE_POLL_S)
                    continue
                if (state, writing) != (watch.state, watch.writing) or not watch.known:
                    watch.state, watch.writing, watch.known = state, writing, True
                    watch.changed.notify()
                if state is None:
                    broker.publish(video_id, "video.deleted", {"id": video_id, "object": "video.deleted",
                                                               "deleted": True})
                elif state[:2] != published and broker.has_subscribers(video_id):
                    published = state[:2]
                    if state[0] in ("completed", "failed"):
                        rec = await loop.run_in_executor(io, self.store.get, video_id)
                        if rec is not None:
                            broker.publish(video_id, f"video.{rec.status}", video_view(rec).model_dump())
                    else:
                        broker.publish(video_id, f"video.{state[0]}", {"id": video_id, "status": state[0],
                                                                       "progress": state[1]})
                if state is None or state[0] not in ACTIVE:
                    return                        # it ended: nothing more to look at
                await asyncio.sleep(REMOTE_POLL_S)
        finally:
            with self._lock:
                if self._watches.get(video_id) is watch:
                    del self._watches[video_id]
            watch.changed.notify()

    def _writing(self, video_id: str, fence: int) -> bool:
        if self.store.objects is None:
            return self.store.partial_path(video_id, fence).exists()
        return self.store.objects.size(piece_name(video_id, fence, 0)) is not None

    async def writer(self, video_id: str, disconnected) -> "RemoteFile | RemoteObject | None":
        """The file (or the pieces) another replica writes for a running job, once it exists; None when the job
        ends first, runs here, or the client leaves. The caller calls `release()` on what it got when its stream
        ends."""
        watch = self.watch(video_id, download=True)
        try:
            while self.jobs.get(video_id) is None and not await disconnected():
                version = watch.changed.version
                if watch.known and not watch.active:
                    break
                if watch.known and watch.writing and watch.state[2] is not None:
                    fence = watch.state[3]
                    if self.store.objects is None:
                        return RemoteFile(self, watch, self.store, video_id, fence)
                    return RemoteObject(self, watch, self.store.objects, video_id, fence)
                await watch.changed.wait_after(version, timeout=4 * REMOTE_POLL_S)
        except BaseException:
            self.leave(watch)
            raise
        self.leave(watch)
        return None


class RemoteFile:
    """What `streaming.tail_file` reads a writer through, for a file another replica writes (`<id>.f<fence>.mp4.part`,
    renamed when done; an open handle reads on): its growth read every REMOTE_POLL_S (a file, no query), its end
    the job's watch."""

    def __init__(self, jobs: RemoteJobs, watch: JobWatch, store, video_id: str, fence: int):
        self.jobs, self.watch, self.fence = jobs, watch, fence
        self.part_path, self.final_path = store.partial_path(video_id, fence), store.video_path(video_id, fence)
        self.grown, self.done = _Poll(), self

    def is_set(self) -> bool:
        """Done: the watch says the claim ended (completed, failed, deleted, or another claim took the job)."""
        return self.watch.claim_state(self.fence) != "running"

    def release(self) -> None:
        self.jobs.leave(self.watch)


class RemoteObject(ObjectTail):
    """An object store's pieces of another replica's claim (`ObjectTail`), its end the job's watch."""

    def __init__(self, jobs: RemoteJobs, watch: JobWatch, objects, video_id: str, fence: int):
        super().__init__(objects, video_id, fence, lambda: watch.claim_state(fence))
        self.jobs, self.watch = jobs, watch

    def release(self) -> None:
        self.jobs.leave(self.watch)


class _Poll:
    """A notifier's face that wakes every REMOTE_POLL_S."""

    version = 0

    async def wait_after(self, version: int, timeout: float | None = None) -> bool:
        await asyncio.sleep(REMOTE_POLL_S)
        return True
