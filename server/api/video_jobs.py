"""`VideoOutputs`: what a video job's engine outputs become: its record, its files and its SSE events.

Job status (the API's) and progress:

    queued       waiting in the engine (or re-queued after a worker crash), progress 0
    in_progress  admitted: progress = 90 * steps done / steps while denoising, then
                 90..99 as frames are decoded and written
    completed    the MP4 is complete on disk (fsynced, with its directory), progress 100
    failed       `error` {code, message} says why

A record changes in memory first (what clients read), then in SQLite through the store side (`server/api/
storage.py`, which retries and keeps what still fails). The first decoded frames make the thumbnail and
the fragmented-MP4 writer (on the runner's thread pool); every chunk is handed to the writer by the job's
own coroutine, so one slow writer holds up no other job. A failed write ends the job with `storage_full`
or `storage_error` (the runner aborts the request with it).

How a job ends (`server/api/runner.py` calls one of these for its final output): `finished` completes the
MP4 and the record; `failed` records the error; `cancelled` says why the server ended it: `deleted` drops
what was written, `released` (a drain) puts the record back to queued for the next start.
"""

from __future__ import annotations

import asyncio
import logging
import time

from longserve.engine.outputs import ABORTED, Admitted, FramesChunk, Queued, RequestFailure, Requeued, StepProgress
from longserve.engine.scheduler import RequestState
from longserve.server.api.jobs import DELETED, RELEASED, Job, JobRegistry
from longserve.server.api.protocol import Video, VideoError
from longserve.server.api.store import VideoRecord
from longserve.server.api.streaming import EventBroker
from longserve.server.media import FragmentedMP4Writer, storage_error_code, write_png

log = logging.getLogger("longserve.server")

DENOISE_SHARE = 90   # progress points for denoising steps; decoded frames take 9 more; 100 = downloadable


class VideoOutputs:
    """The sink of every video job (`runner.JobSink`). `lifecycle`: what its transitions mean besides its record
    (log lines, metrics, webhooks: `server/api/lifecycle.py`)."""

    def __init__(self, jobs: JobRegistry, storage, broker: EventBroker, runner, lifecycle, keyframe_interval: int):
        self.jobs, self.storage, self.broker, self.runner = jobs, storage, broker, runner
        self.lifecycle = lifecycle
        self.keyframe_interval = keyframe_interval

    # -- the outputs on the way ---------------------------------------------------------------------------

    async def take(self, job: Job, out) -> RequestFailure | None:
        rec = job.record
        if isinstance(out, Queued):
            if self.broker.has_subscribers(rec.id):
                self.broker.publish(rec.id, "video.queued", event(rec, job, queue_position=out.position))
        elif isinstance(out, Admitted):
            self.lifecycle.started(job, out.num_steps, out.admissions)
            await self.update(job, status="in_progress", progress=0)
            self.broker.publish(rec.id, "video.in_progress", event(rec, job, step=0, num_steps=out.num_steps))
        elif isinstance(out, StepProgress):
            self.set(rec, progress=progress(job))
            self.lifecycle.step(job, out.step, out.num_steps, out.batch_size)
            if job.fence is not None and time.monotonic() - job.saved_at >= 1.0:   # other replicas read it
                job.saved_at = time.monotonic()
                await self.update(job, progress=rec.progress)
            self.broker.publish(rec.id, "video.progress", event(
                rec, job, step=out.step, num_steps=out.num_steps, batch_size=out.batch_size,
                step_ms=round(1000 * out.step_s, 2)))
            if out.denoised:
                self.broker.publish(rec.id, "video.decoding", event(rec, job, frames_done=0,
                                                                    num_frames=job.handle.status().num_frames))
        elif isinstance(out, FramesChunk):
            self.lifecycle.frames(job)
            try:
                await self.runner.run_io(self.write_frames, job, out)
                t0 = time.perf_counter()
                await job.writer.write_async(out.frames[0])     # (n, H, W, 3) uint8: this job's own hand-off
                job.times["mux_s"] = job.times.get("mux_s", 0.0) + time.perf_counter() - t0
                if out.audio is not None:                         # a sound that came after the first frames: muxed
                    job.writer.add_audio(out.audio.samples[0], out.audio.rate)   # in when the picture is done
            except OSError as e:                                  # the thumbnail, or the writer's part file
                return self._write_failed(storage_error_code(e), f"writing the video failed: {e}")
            if job.writer.failed:
                return self._write_failed(job.writer.error_code, job.writer.error)
            self.set(rec, progress=progress(job))
            self.broker.publish(rec.id, "video.decoding", event(rec, job, frames_done=out.stop,
                                                                  num_frames=out.num_frames))
        elif isinstance(out, Requeued):
            await self.drop_output(job)
            await self.update(job, status="queued", progress=0)
            job.times.pop("mux_s", None)
            self.lifecycle.requeued(job)
        return None

    def _write_failed(self, code: str, message: str) -> RequestFailure:
        if code.startswith("storage"):
            self.storage.failed(message)
        return RequestFailure(code, message, kind=ABORTED)

    def write_frames(self, job: Job, out: FramesChunk) -> None:
        """The io thread: the first chunk makes the thumbnail and the writer (the frames are then handed to the
        writer by the job's coroutine, `FragmentedMP4Writer.write_async`)."""
        rec, p, store = job.record, job.record.params, self.storage.store
        if job.writer is None:           # a replica's claim writes files of its own (`StoredFiles`)
            write_png(store.thumbnail_path(rec.id, job.fence), out.frames[0][0])
            sound = None
            if out.audio is not None:   # a model's sound, with the first frames: in every fragment
                from longserve.pipelines.sound import as_sound

                sound = as_sound(out.audio.samples[0], out.audio.rate)
            job.writer = FragmentedMP4Writer(store.partial_path(rec.id, job.fence),
                                             store.video_path(rec.id, job.fence), p["width"], p["height"], p["fps"],
                                             keyframe_interval=self.keyframe_interval, sound=sound)
            store.writing(rec.id, job.fence, job.writer)    # an object store's pieces, streamed elsewhere
            job.changed.notify()

    # -- how it ends ------------------------------------------------------------------------------------------

    async def finished(self, job: Job, timings: dict) -> None:
        if job.writer is None:
            await self.failed(job, RequestFailure("encoding_failed", "no frames were decoded", kind=ABORTED))
            return
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        written: asyncio.Future = loop.create_future()
        job.writer.finish(lambda ok, err: loop.call_soon_threadsafe(
            lambda: written.done() or written.set_result((ok, err))))
        ok, error = await written
        job.times["mux_s"] = job.times.get("mux_s", 0.0) + time.perf_counter() - t0     # the encode's tail
        if not self.jobs.holds(job):
            await self.drop_output(job)             # deleted while its file was finished
            return
        if not ok:
            code = job.writer.error_code or "encoding_failed"
            if code.startswith("storage"):
                self.storage.failed(error)
            await self.failed(job, RequestFailure(code, f"writing the MP4 failed: {error}", kind=ABORTED))
            return
        now = int(time.time())
        store = self.storage.store
        size = await self.runner.run_io(store.files_bytes, *fenced(job))
        extra = {}
        if timings and "blocks" in timings:         # transformer block evaluations (step caching skips some)
            extra["params"] = {**job.record.params, "transformer_blocks": {
                "evaluated": timings["blocks"], "skipped": timings.get("blocks_skipped", 0)}}
        fields = dict(status="completed", progress=100, completed_at=now, expires_at=self.storage.expiry(now),
                      bytes=size, **extra)
        if job.fence is None:
            await self.update(job, **fields)
        elif await self.runner.run_io(lambda: store.publish(job.record.id, job.fence, **fields)):
            self.set(job.record, **fields)          # published: its files renamed, the record completed at once
        else:                                       # its lease was lost: another replica runs it
            log.warning("%s: its lease (fence %s) was lost before it completed; dropped", job.id, job.fence)
            self.jobs.remove(job)
        if not self.jobs.holds(job):                # deleted while its record was written: cancelled, not completed
            await self.drop_output(job)
            return
        self.broker.publish(job.record.id, "video.completed", video_view(job.record).model_dump())
        self.lifecycle.finished(job, timings or {})
        if self.storage.quotas.on:
            try:
                await self.runner.run_io(self.storage.quota, job.owner)
            except Exception:
                log.exception("enforcing the storage quota failed")

    async def failed(self, job: Job, error: RequestFailure) -> None:
        """Failed in memory first (what clients read, and the event), then the files go and SQLite is told."""
        fields = {"status": "failed", "error": {"code": error.code, "message": error.message},
                  "expires_at": self.storage.expiry(int(time.time()))}
        self.set(job.record, **fields)
        self.lifecycle.failed(job, error.code, error.message)
        self.broker.publish(job.record.id, "video.failed", video_view(job.record).model_dump())
        try:
            await self.drop_output(job)
            if self.storage.store.shared:          # it never runs again: its uploads go from the media store
                await self.runner.run_io(self.storage.store.remove_inputs, job.record.id)
        except Exception:          # noqa: BLE001 - the record must still be written
            log.exception("removing the files of failed %s failed", job.record.id)
        if self.jobs.holds(job):
            await self.storage.save(job.record, fields, job.fence)

    async def cancelled(self, job: Job, reason: str) -> None:
        await self.drop_output(job)
        if reason == DELETED or not self.jobs.holds(job):
            return
        if reason == RELEASED and job.fence is not None:   # a drain let it go: another replica claims it
            self.set(job.record, status="queued", progress=0)
            await self.runner.run_io(lambda: self.storage.store.release(job.id, job.fence, status="queued",
                                                                        progress=0))
            return
        if reason == RELEASED:                      # a drain let it go: it runs at the next start
            if job.record.status != "queued":
                await self.update(job, status="queued", progress=0)
            return
        await self.failed(job, RequestFailure("cancelled", f"the video was cancelled ({reason})", kind=ABORTED))

    # -- the record and the files -------------------------------------------------------------------------

    async def drop_output(self, job: Job) -> None:
        writer, job.writer = job.writer, None
        if writer is not None:
            await self.runner.run_io(writer.abort)
        await self.runner.run_io(self.storage.store.remove_files, *fenced(job))
        job.changed.notify()

    async def update(self, job: Job, **fields) -> None:
        """The record in memory first (what clients read), then in SQLite (unless the job was deleted)."""
        self.set(job.record, **fields)
        if self.jobs.holds(job) and not await self.storage.save(job.record, fields, job.fence):
            self.lost(job)

    def lost(self, job: Job) -> None:
        """A replica's claim of `job` is gone (its record deleted on any replica, or its lease lapsed and another
        replica claimed it): the job ends here at its next step, and drops what it wrote (its own files)."""
        if self.jobs.remove(job) and job.handle is not None:
            job.handle.abort(DELETED)

    def set(self, rec: VideoRecord, **fields) -> None:
        with self.jobs.lock:
            for k, v in fields.items():
                setattr(rec, k, v)


def fenced(job: Job) -> tuple:
    """(id,) or (id, fence): the arguments naming a job's own files (`StoredFiles`)."""
    return (job.record.id,) if job.fence is None else (job.record.id, job.fence)


def progress(job: Job) -> int:
    """90 points over every denoising step (all segments' for long video), 9 over the frames decoded so far
    (a long video's first segments are decoded while later ones denoise), 100 once the file is complete."""
    s = job.handle.status()
    if s.state is RequestState.WAITING:
        return 0
    steps = s.step / max(1, s.num_steps)
    frames = s.frames_done / max(1, s.num_frames)
    return min(99, int(DENOISE_SHARE * steps + (99 - DENOISE_SHARE) * frames))


def progress_state(rec: VideoRecord, job: Job | None = None) -> dict:
    """Where a video stands, in one shape for every reader (the Video object's `state`, every SSE event's; the page
    draws its progress bar and its history row from it): `stage` (queued, denoising, decoding, completed, failed),
    `percent` (the Video's `progress`), `step`/`num_steps`, `frames_done`/`num_frames`, `queue_position`,
    `elapsed_s` since it was created, and `eta_s`: its time running so far scaled by the progress still to make
    (None until it has run a step)."""
    now = time.time()
    state = {"stage": rec.status, "percent": rec.progress, "step": None, "num_steps": None, "frames_done": None,
             "num_frames": None, "queue_position": None, "elapsed_s": None, "eta_s": None}
    if rec.status in ("completed", "failed"):
        state["elapsed_s"] = round(max(0, (rec.completed_at or now) - rec.created_at), 3)
        state["eta_s"] = 0 if rec.status == "completed" else None
        return state
    created = job.times.get("created", rec.created_at) if job is not None else rec.created_at
    state["elapsed_s"] = round(max(0.0, now - created), 3)
    status = job.handle.status() if job is not None and job.handle is not None else None
    if status is None:
        return state
    if status.state is RequestState.WAITING:
        state.update(stage="queued", queue_position=status.queue_position)
        return state
    state.update(stage="denoising" if status.step < status.num_steps else "decoding", step=status.step,
                 num_steps=status.num_steps, frames_done=status.frames_done, num_frames=status.num_frames)
    admitted = job.times.get("admitted")
    if admitted is not None and rec.progress > 0:
        running = now - admitted
        state["eta_s"] = round(running * (100 - rec.progress) / rec.progress, 3)
    return state


def video_view(rec: VideoRecord, job: Job | None = None) -> Video:
    """The API's Video object of a record (`job`: the active job it belongs to, for its progress state)."""
    p = rec.params
    return Video(id=rec.id, model=rec.model, status=rec.status, progress=rec.progress, created_at=rec.created_at,
                 completed_at=rec.completed_at, expires_at=rec.expires_at,
                 error=VideoError(**rec.error) if rec.error else None,
                 prompt=rec.prompt, seconds=rec.seconds, size=rec.size, extended_from=rec.extended_from,
                 remixed_from_video_id=p.get("remixed_from"),
                 num_frames=p.get("content_frames", p["num_frames"]), fps=p["fps"],
                 num_inference_steps=p["num_inference_steps"], guidance_scale=p["guidance_scale"],
                 seed=p["seed"], negative_prompt=p["negative_prompt"], options=p.get("options") or {},
                 lora=p.get("lora") or [], transformer_blocks=p.get("transformer_blocks"),
                 state=progress_state(rec, job))


def event(rec: VideoRecord, job: Job | None = None, **extra) -> dict:
    """An SSE event's data: where the video stands (its `state`, as its Video object has it), and the event's own
    fields."""
    return {"id": rec.id, "status": rec.status, "progress": rec.progress, **extra, "state": progress_state(rec, job)}
