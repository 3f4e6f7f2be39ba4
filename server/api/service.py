"""`VideoService`: the server's videos and live sessions, between the HTTP routes and the engine.

It holds the parts, each with one job, and does the API's video operations with them (create, extend, get, list,
delete, content, events):

    requests.py    VideoRequests   HTTP shapes -> the engine's `Accepted`: the server's syntax and limits only
                                   (the engine accepts a request once: `VideoEngine.accept`)
    admission.py   AdmissionGate   one gate for create, extend and live: draining 503, disk 507, work 429
    jobs.py        JobRegistry     the active jobs, videos and live sessions, with their cost and owner
    runner.py      JobRunner       follows each job's engine handle; its final output, handled in one place
    video_jobs.py  VideoOutputs    what a video's outputs become: its record, MP4, thumbnail, SSE events
    storage.py     VideoStorage    records with write retries, retention, the quota, free space
    health.py      ServerHealth    /health and /metrics
    drain.py       Shutdown        SIGTERM's drain
    live.py        LiveSessions    the live WebSocket door
    replicas.py    Replica         with a shared store (PostgreSQL): claims, leases, the live replicas

Everything about a request's progress is the engine's: its handle's outputs and status. The service keeps API
state only: the stored record and, while a video runs, its MP4 writer.

Restart policy (`--data-dir` reused): a job in_progress when the server stopped is failed ("server_restarted": its
partial denoising lived in worker memory); a queued job is queued again in order (never refused by admission);
completed videos stay until retention or the quota expire them. Replicas: leases decide (`replicas.py`).
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

from longserve.engine.engine import Accepted, VideoEngine
from longserve.engine.request import GenerationSpec
from longserve.engine.scheduler import QueueFullError
from longserve.server.api.admission import AdmissionGate
from longserve.server.api.config import SERVE_ENGINE_DEFAULTS, ServeConfig
from longserve.server.api.drain import Shutdown
from longserve.server.api.errors import APIError
from longserve.server.api.health import ServerHealth
from longserve.server.api.jobs import DELETED, VIDEO, Job, JobRegistry
from longserve.server.api.lifecycle import JobLifecycle
from longserve.server.api.loras import LoraAdmin
from longserve.server.api.metrics import ServerMetrics
from longserve.server.api.protocol import Video, VideoCreateRequest, VideoDeleted, VideoExtendRequest, VideoList
from longserve.server.api.replicas import attach_replica
from longserve.server.api.requests import Limits, VideoRequests
from longserve.server.api.reuse import checkpoint_fingerprint, request_key, stored_params
from longserve.server.api.runner import JobRunner
from longserve.server.api.settings_store import open_settings
from longserve.server.api.startup import StartupProgress, check_warm_up_shape, describe_store, warm_up
from longserve.server.api.storage import VideoStorage
from longserve.server.api.store import VideoRecord
from longserve.server.api.streaming import EventBroker
from longserve.server.api.tenants import NO_KEY, Caller
from longserve.server.api.video_jobs import VideoOutputs, event, video_view
from longserve.server.api.webhooks import Webhooks
from longserve.server.media import FragmentedMP4Writer

log = logging.getLogger("longserve.server")


class VideoService:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.engine: VideoEngine | None = None
        self.storage: VideoStorage | None = None
        self.limits: Limits | None = None
        self.model_name: str | None = None
        self.started_at = int(time.time())
        self.warm_up_s: float | None = None
        self.jobs = JobRegistry()
        self.broker = EventBroker()
        self.runner = JobRunner(self.jobs)
        self.shutdown = Shutdown(self.jobs, self.broker)
        self.startup = StartupProgress()  # what the start is doing (/health/ready's body)
        self.monitor = ServerHealth(config, self.startup, self.shutdown)
        self.metrics = ServerMetrics(self.jobs, self.monitor)
        self.lifecycle = None             # a job's transitions: log lines, metrics, webhooks (lifecycle.py)
        self.replica = None               # with a shared store: this replica's claim cycle (replicas.py)
        self.started = False              # the model is loaded and warmed: the API's routes answer
        self._closing = False

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> "VideoService":
        """Open the store, start the workers (loads the model), warm up, recover old jobs, follow them: each stage
        told to `self.startup` (a log line, and /health/ready's body). May run on a thread of its own while the
        HTTP server already answers (`longserve serve`); `close()` meanwhile stops it after its current stage."""
        try:
            self._start()
        except BaseException as e:
            self.startup.failed(str(e).splitlines()[0] if str(e) else type(e).__name__)
            raise
        self.monitor.serving(self.engine, self.storage, self.model_name, self.warm_up_s, self.replica)
        self.started = True
        self.startup.finish()
        return self

    def _start(self) -> None:
        from longserve.server.api.live import LiveSessions

        cfg, progress = self.config, self.startup
        progress.begin("store", f"jobs in {describe_store(cfg)}")
        self.storage = self.metrics.storage = VideoStorage(cfg, self.runner.io,
                                                           busy=lambda vid: self.jobs.get(vid) is not None,
                                                           on_expired=self.metrics.expired.inc)
        self.settings = open_settings(self.storage.store)
        self.webhooks = Webhooks(cfg, self.settings, self.runner, self.metrics.webhooks)
        progress.done()
        self._check_open()
        if cfg.warm_up and cfg.warm_up_shape:     # a shape the model refuses is said now, not after the load
            check_warm_up_shape(cfg)
        progress.begin("workers", f"loading {cfg.model} on {cfg.engine.workers} worker(s)")
        engine = VideoEngine.start(cfg.engine)
        try:
            progress.done(f"{engine.info.workers} worker(s) ready, {engine.info.device}")
            if cfg.warm_up:              # /health/ready says "starting" until this is done: ready means warm
                self._check_open()
                self.warm_up_s = warm_up(engine, cfg, progress)
            self._check_open()
        except BaseException:
            engine.close()
            raise
        self.engine = self.runner.engine = self.metrics.engine = engine
        self.engine.add_batch_listener(self.metrics.on_batch)
        self.limits = Limits.of(self.engine, cfg)
        self.model_name = cfg.served_model_name or Path(str(cfg.model).rstrip("/")).name or str(cfg.model)
        self.requests = VideoRequests(self.engine, cfg, self.limits, self.model_name, self.storage.store.tmp_dir)
        self.admission = AdmissionGate(self.jobs, self.storage, self.shutdown, self.limits, cfg.max_queued_work,
                                       cfg.max_work_per_key, self.engine.info.capabilities.frames_per_chunk)
        self.lifecycle = JobLifecycle(self.metrics, self.model_name, self.replica_id, self.webhooks)
        self.outputs = VideoOutputs(self.jobs, self.storage, self.broker, self.runner, self.lifecycle,
                                    keyframe_interval=cfg.engine.decode_chunk_frames)
        self.live = LiveSessions(cfg, self.engine, self.requests, self.admission, self.jobs, self.runner,
                                 self.shutdown, self.storage, self.model_name)
        self._checkpoint = checkpoint_fingerprint(self.engine.model_dir, cfg.engine.dtype, self.engine.config.loras)
        self.runner.start_loop()
        progress.begin("recover", "the last run's queued jobs")
        self._recover()
        progress.done()
        self.storage.measure_free()
        self.runner.spawn(self.storage.housekeeping())
        # None unless the store is shared; a claim naming an adapter still loading here waits (`self.loras`, next)
        self.replica = attach_replica(cfg, self.model_name, self.storage, self.admission, self.requests, self.jobs,
                                      self.runner, self.shutdown, self.outputs, self.lifecycle, self.broker,
                                      adapter_loading=lambda name: self.loras.sync.wanted(name))
        self.metrics.replica = self.replica
        # adapters loaded while serving (POST /v1/loras)
        self.loras = LoraAdmin(cfg, self.engine, self.settings, self.runner, self.replica_id())
        self.runner.spawn(self.loras.sync.run())

    def _check_open(self) -> None:
        if self._closing:
            raise RuntimeError("the server stopped while it was starting")

    def close(self) -> None:
        self._closing = True              # a start still running on its thread stops after its stage
        if self.replica is not None:
            self.replica.close()
        if self.engine is not None:
            self.engine.close()           # every handle's iteration ends; the runners finish
        self.runner.close()
        for job in self.jobs.jobs(VIDEO):
            if job.writer is not None:
                job.writer.abort()
        if self.storage is not None:
            self.storage.close()

    def _recover(self) -> None:
        for rec in self.storage.recover():
            if {"image", "video"} & set(rec.params.get("options") or {}):
                self.storage.finish_record(rec, status="failed", error={
                    "code": "server_restarted",
                    "message": "the server stopped before this job ran, and its input (an image, or the video it "
                               "extends) was held in memory only; create it again"})
                continue
            try:
                accepted = self.requests.stored(rec)
                job = Job(rec.id, VIDEO, accepted.cost, rec.owner, record=rec, sink=self.outputs)
                self.jobs.add(job)                        # counted by admission, never refused
                self.runner.launch(job, accepted)
            except (QueueFullError, ValueError) as e:
                self.storage.finish_record(rec, status="failed", error={"code": "server_restarted",
                                                                        "message": str(e)})

    # -- the API's operations -----------------------------------------------------------------------

    def create(self, req: VideoCreateRequest, caller: Caller = NO_KEY) -> Video:
        """`POST /v1/videos` (blocking: run it in a thread). `caller`: who asks (the video is its owner's)."""
        self.admission.check_open()
        accepted = self.requests.create(req)
        return self._submit(accepted, caller.owner, seeded=req.seed is not None, asked_seconds=req.seconds)

    def extend(self, video_id: str, req: VideoExtendRequest, caller: Caller = NO_KEY) -> Video:
        """`POST /v1/videos/{id}/extend`: a new video whose content is the completed video `video_id` continued.
        400 on a model that cannot extend, 404 for an unknown (or expired) video, 409 for one not completed."""
        self.admission.check_open()
        source = self.record(video_id, caller)             # 404 first: another key's video is not found
        self.requests.check_extends()
        if source.status != "completed":
            raise not_ready(source)
        accepted = self.requests.extend(source, self.content_path(video_id, "video", caller), req)
        return self._submit(accepted, caller.owner, seeded=req.seed is not None, extended_from=video_id)

    def remix(self, video_id: str, req: VideoExtendRequest, caller: Caller = NO_KEY) -> Video:
        """`POST /v1/videos/{id}/remix`: a new video from the completed `video_id` under a new prompt (an extension
        on a model that extends, else a video from its last frame; `VideoRequests.remix`), `remixed_from_video_id`
        set. 400 naming `model` where the model can do neither, 404 / 409 as extend."""
        self.admission.check_open()
        source = self.record(video_id, caller)
        caps = self.engine.info.capabilities
        if caps.extends or caps.takes_image:
            if source.status != "completed":
                raise not_ready(source)
            path = self.content_path(video_id, "video", caller)
        else:
            path = None                               # refused by the door, naming model
        accepted, how = self.requests.remix(source, path, req)
        return self._submit(accepted, caller.owner, seeded=req.seed is not None, remixed_from=video_id,
                            extended_from=video_id if how == "extension" else None)

    def _submit(self, accepted: Accepted, owner: str | None, seeded: bool, extended_from: str | None = None,
                asked_seconds: str | None = None, remixed_from: str | None = None):
        """Admit a complete request, queue it and store its record; with an explicit seed (`seeded`), a repeat of a
        completed request of the same owner reuses its content (`--reuse-completed`). The record's `seconds` is
        the caller's own text where a create gave one (`num_frames` has the count made, by the model's frame rule),
        else the content's length."""
        spec, key = accepted.spec, None
        if seeded and self.config.reuse_completed == "seeded":
            key = request_key(self._checkpoint, spec, spec.fps, self.engine.config.loras)   # inputs by digest
            reused = self._reuse(key, spec, owner, extended_from)
            if reused is not None:
                return reused
        # an extension's content is the video it continues and the new frames: what seconds and num_frames say
        frames = accepted.content_frames
        params = stored_params(spec)
        if remixed_from is not None:
            params["remixed_from"] = remixed_from
        if frames != spec.num_frames:
            params["content_frames"] = frames
        seconds = asked_seconds.strip() if asked_seconds is not None and frames == spec.num_frames else None
        rec = VideoRecord(id=spec.request_id, created_at=int(time.time()), status="queued", model=self.model_name,
                          prompt=spec.prompt[0], seconds=seconds or f"{frames / spec.fps:g}",
                          size=f"{spec.width}x{spec.height}",
                          params=params, request_key=key, extended_from=extended_from, owner=owner)
        job = Job(spec.request_id, VIDEO, accepted.cost, owner, record=rec, sink=self.outputs)
        if self.replica is not None and self.replica.enqueue(job, spec):   # stored for a replica to claim
            self.lifecycle.created(job)
            return video_view(rec)
        # 429 past the work limits; with replicas (an upload with no shared media store: its input is in this
        # process's memory) stored at once, claimed by this replica
        self.admission.admit(job)

        def created() -> None:                      # stored (with replicas: already), then announced
            if self.replica is None:
                self.storage.insert(rec, "the job")
            self.lifecycle.created(job)

        try:
            self.runner.launch(job, accepted, then=created)
        except BaseException as e:
            if self.replica is not None and job.handle is None:
                self.storage.delete(rec.id)
            if isinstance(e, QueueFullError):
                raise APIError(429, f"the queue is full ({self.config.engine.max_queue} videos waiting); retry "
                                    f"later", code="queue_full", headers={"Retry-After": "5"}) from None
            raise
        return video_view(rec)

    def _reuse(self, key: str, spec: GenerationSpec, owner: str | None, extended_from: str | None) -> Video | None:
        """A repeat of a completed request (same checkpoint, prompt, parameters, input and explicit seed) by the
        same owner: a new video, completed at once, whose files are the stored video's. None when there is no such
        video or its files are gone (then the request is generated as usual)."""
        now = int(time.time())
        rec = VideoRecord(id=spec.request_id, created_at=now, status="completed", model=self.model_name, prompt="",
                          seconds="", size="", params={}, request_key=key, extended_from=extended_from, owner=owner)
        if self.storage.reuse(key, rec) is None:
            return None
        self.lifecycle.reused(Job(rec.id, VIDEO, 0.0, owner, record=rec))
        try:                                              # its owner's quota: the copy it shares is used anew
            self.storage.quota(owner)
        except Exception:
            log.exception("enforcing the storage quota failed")
        return video_view(rec)

    def record(self, video_id: str, caller: Caller = NO_KEY) -> VideoRecord:
        """The video's record, if `caller` may see it (404 otherwise: another key's video is not found)."""
        job = self.jobs.get(video_id, VIDEO)
        rec = job.record if job is not None else self.storage.record(video_id) if plausible_id(video_id) else None
        if rec is None or not caller.sees(rec.owner):
            raise APIError(404, f"no video found with video_id {video_id!r}", param="video_id",
                           code="video_not_found")
        return rec

    def get(self, video_id: str, caller: Caller = NO_KEY) -> Video:
        return video_view(self.record(video_id, caller), self.jobs.get(video_id, VIDEO))

    def list(self, after: str | None, limit: int, order: str, caller: Caller = NO_KEY) -> VideoList:
        """A page of the videos `caller` sees (its own; every one for an admin key or no key)."""
        after_seq = None
        if after is not None:
            rec = self.storage.store.get(after) if plausible_id(after) else None
            if rec is None or not caller.sees(rec.owner):
                raise APIError(404, f"after: no video with id {after!r}", param="after", code="video_not_found")
            after_seq = rec.seq
        records, has_more = self.storage.page(after_seq, limit, order, caller.scope)
        active = {j.id: j for j in self.jobs.jobs(VIDEO)}
        data = [video_view(active[r.id].record, active[r.id]) if r.id in active else video_view(r) for r in records]
        return VideoList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                         has_more=has_more)

    def delete(self, video_id: str, caller: Caller = NO_KEY) -> VideoDeleted:
        """Delete a video `caller` may see; a queued or running one is ended (`abort(id, "deleted")`, at the next
        step boundary) and its runner drops what was written."""
        self.record(video_id, caller)                               # 404 for an unknown or another key's video
        job = self.jobs.get(video_id, VIDEO)
        taken = job is not None and self.jobs.remove(job)           # the API sees it gone at once
        try:
            self.storage.delete(video_id)
        except BaseException:
            if taken:
                self.jobs.add(job)
            raise
        if taken:
            job.handle.abort(DELETED)
            self.lifecycle.cancelled(job, DELETED)
            if self.storage.store.shared:                           # its uploads, in the shared media store
                self.storage.store.remove_inputs(video_id)
        else:
            self.storage.store.remove_files(video_id)
        self.broker.publish(video_id, "video.deleted", {"id": video_id, "object": "video.deleted", "deleted": True})
        return VideoDeleted(id=video_id)

    def content_path(self, video_id: str, variant: str, caller: Caller = NO_KEY) -> Path:
        """The stored MP4 or PNG of a completed video `caller` may see."""
        rec = self.record(video_id, caller)
        if rec.status != "completed":
            raise not_ready(rec)
        if rec.expired:
            raise APIError(404, f"the content of video {video_id!r} expired at {rec.expires_at} and was deleted "
                                f"(the video object stays readable)", param="video_id", code="video_expired")
        path = self.storage.store.content_file(video_id, variant)
        if path is None:
            raise APIError(404, f"the {variant} of {video_id!r} is missing from the data directory",
                           param="variant", code="content_missing")
        return path

    async def live_writer(self, video_id: str, disconnected) -> FragmentedMP4Writer | None:
        """The MP4 writer of a job that is still running, once it exists (woken when it does); None when the
        job ended first or `await disconnected()` turns true."""
        while True:
            job = self.jobs.get(video_id, VIDEO)
            if job is None or (self.shutdown.drained and job.writer is None):
                return None
            version = job.changed.version
            if job.writer is not None:
                return job.writer
            if await disconnected():
                return None
            await job.changed.wait_after(version, timeout=1.0)

    def event_snapshot(self, video_id: str, caller: Caller = NO_KEY) -> tuple[str, dict]:
        """The event that tells a new SSE subscriber where the video stands now."""
        rec = self.record(video_id, caller)
        job = self.jobs.get(video_id, VIDEO)
        if rec.status in ("completed", "failed"):
            return f"video.{rec.status}", video_view(rec).model_dump()
        status = job.handle.status() if job is not None and job.handle is not None else None
        if rec.status == "queued":
            return "video.queued", event(rec, job, queue_position=status.queue_position if status else None)
        if status is None:
            return "video.in_progress", event(rec, job)
        if status.frames_done and status.step >= status.num_steps:
            return "video.decoding", event(rec, job, frames_done=status.frames_done, num_frames=status.num_frames)
        return "video.in_progress", event(rec, job, step=status.step, num_steps=status.num_steps)

    # -- the parts' doors the routes and the CLI use ---------------------------------------------------

    @property
    def store(self):
        return self.storage.store if self.storage is not None else None

    @property
    def draining(self) -> bool:
        return self.shutdown.draining

    def drain(self, timeout_s: float, cut_short=None) -> None:
        self.shutdown.drain(timeout_s, cut_short)

    def stream_ends_now(self, video_id: str) -> bool:
        return self.shutdown.stream_ends_now(video_id)

    def expire(self, now: int | None = None) -> list[str]:
        return self.storage.expire(now)

    def health(self) -> tuple[int, dict]:
        return self.monitor.health()

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def replica_id(self) -> str | None:
        return self.replica.id if self.replica is not None else None


def plausible_id(video_id: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9_\-]{1,100}", video_id))


def not_ready(rec: VideoRecord) -> APIError:
    if rec.status == "failed":
        msg = rec.error["message"] if rec.error else "unknown error"
        return APIError(409, f"video {rec.id!r} failed and has no content: {msg}", param="video_id",
                        code="video_failed")
    return APIError(409, f"video {rec.id!r} is {rec.status} ({rec.progress}%); its content is not ready yet "
                         f"(or ask for ?stream=true)", param="video_id", code="video_not_ready")


__all__ = ["SERVE_ENGINE_DEFAULTS", "ServeConfig", "VideoService", "Limits", "Job"]
