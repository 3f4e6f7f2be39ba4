"""`VideoService`: the server's video jobs, between the HTTP routes and the step scheduler.

It owns the worker pool (through `pipelines.VideoPipeline.from_pretrained`, which starts
and validates it), the `engine.scheduler.StepScheduler` that drives it, the job store
(SQLite + files) and the event fan-out. Handlers call `create`, `get`, `list`, `delete`,
...; the scheduler's thread calls `_on_event`, which turns scheduler events into job
status, files (a fragmented MP4 written while frames are decoded, a PNG thumbnail) and
SSE events.

Job status (the API's) and progress:

    queued       waiting in the scheduler (or re-queued after a worker crash), progress 0
    in_progress  admitted: progress = 90 * steps done / steps while denoising, then
                 90..99 as frames are decoded and written
    completed    the MP4 is complete on disk, progress 100
    failed       `error` {code, message} says why

Restart policy (`--data-dir` reused): a job that was in_progress when the server stopped
is failed (code "server_restarted": its partial denoising lived in worker memory); a
queued job is queued again, in its original order; completed videos stay downloadable.
"""

from __future__ import annotations

import logging
import math
import queue
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from engine.engine import VideoEngine
from engine.families.base import MAX_STEPS
from engine.request import GenerationSpec, RequestError
from engine.scheduler import QueueFullError
from server.api.errors import APIError
from server.media import FragmentedMP4Writer, write_png
from server.api.metrics import Counter, Gauge, Histogram, Registry
from server.api.protocol import Video, VideoCreateRequest, VideoDeleted, VideoError, VideoList, parse_size
from server.api.store import JobStore, VideoRecord
from server.api.streaming import EventBroker

log = logging.getLogger("longserve.server")

DENOISE_SHARE = 90   # progress points for denoising steps; decoded frames take 9 more; 100 = downloadable
MAX_SEED = 2**63 - 1


@dataclass
class ServeConfig:
    """Everything `longserve serve` configures about video serving (limits default from the model)."""

    model: str = "tiny-latte"
    served_model_name: str | None = None   # default: the model directory's name
    workers: int = 1
    parallel: str = "auto"
    ulysses_degree: int | None = None
    device: str | None = None
    dtype: str = "float32"
    cfg_parallel: bool = False
    attention: str = "auto"
    vae_tiling: bool = False              # decode in diffusers' spatial tiles (vae.enable_tiling())
    data_dir: str = "longserve-data"
    max_queue: int = 256
    max_batch: int = 8
    max_running: int | None = None        # admitted requests at once; default max_batch
    max_frames: int | None = None         # default: 4 x the model's default frame count, or max_seconds of long video
    max_seconds: float = 60.0             # longest video of a long-video model (diffusion forcing), at its fps
    max_size: int | None = None           # largest width/height in pixels; default: 2 x the model's default size
    max_steps: int = 200
    default_steps: int = 20
    default_guidance_scale: float | None = None   # default: the model's
    fps: int | None = None                # default: the model's
    max_fps: int = 60
    decode_chunk_frames: int = 8
    job_timeout_s: float | None = 600.0
    oom_retry: bool = False               # a batch that runs out of memory: retry its requests one at a time
    max_prompt_chars: int = 4000


@dataclass
class Limits:
    size_multiple: int
    default_width: int
    default_height: int
    max_size: int
    frame_multiple: int      # frame counts are frame_multiple*k + 1 (1: any)
    default_frames: int
    max_frames: int
    max_steps: int
    fps: int
    guidance_scale: float


@dataclass(eq=False)
class LiveJob:
    """A job that is not finished yet: its record plus what only exists while it runs."""

    record: VideoRecord
    num_steps: int = 0
    step: int = 0
    num_frames: int = 0
    frames_done: int = 0
    queue_position: int | None = None
    writer: FragmentedMP4Writer | None = None
    writer_ready: threading.Event = field(default_factory=threading.Event)  # writer made, or job ended


class VideoService:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.engine: VideoEngine | None = None
        self.scheduler = None
        self.store: JobStore | None = None
        self.broker = EventBroker()
        self.limits: Limits | None = None
        self._live: dict[str, LiveJob] = {}
        self._cancelling: dict[str, LiveJob] = {}
        self._lock = threading.RLock()
        self._output = OutputThread()
        self.started_at = int(time.time())
        self._build_metrics()

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> "VideoService":
        """Start the workers (loads the model), open the store, recover old jobs, start scheduling."""
        cfg = self.config
        for name in ("max_queue", "max_batch", "max_steps", "default_steps", "decode_chunk_frames"):
            value = getattr(cfg, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "max_queue" else 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if cfg.fps is not None and (isinstance(cfg.fps, bool) or not isinstance(cfg.fps, int) or cfg.fps < 1):
            raise ValueError(f"fps must be a positive integer, got {cfg.fps!r}")
        if cfg.default_steps > cfg.max_steps:
            raise ValueError(f"default_steps ({cfg.default_steps}) exceeds max_steps ({cfg.max_steps})")
        if cfg.max_steps > MAX_STEPS:
            raise ValueError(f"max_steps must be <= {MAX_STEPS} (the engine's limit), got {cfg.max_steps}")
        self.store = JobStore(cfg.data_dir)
        self.engine = VideoEngine.start(
            cfg.model, workers=cfg.workers, parallel=cfg.parallel, ulysses_degree=cfg.ulysses_degree,
            device=cfg.device, dtype=cfg.dtype, cfg_parallel=cfg.cfg_parallel, attention=cfg.attention,
            vae_tiling=cfg.vae_tiling, max_batch=cfg.max_batch, max_running=cfg.max_running, max_waiting=cfg.max_queue,
            decode_chunk_frames=cfg.decode_chunk_frames, job_timeout_s=cfg.job_timeout_s, oom_retry=cfg.oom_retry)
        self.scheduler = self.engine.scheduler
        info = self.engine.info
        d, m, rule = info["defaults"], info["size_multiple"], info["frame_multiple"]
        max_size = cfg.max_size if cfg.max_size is not None else 2 * max(d["width"], d["height"])
        fps = cfg.fps if cfg.fps is not None else d["fps"]
        if cfg.max_frames is not None:
            max_frames = cfg.max_frames
        elif info.get("long_video"):
            if not cfg.max_seconds > 0:
                raise ValueError(f"max_seconds must be positive, got {cfg.max_seconds!r}")
            max_frames = max(d["num_frames"], round(cfg.max_seconds * fps) + rule)
        else:
            max_frames = 4 * d["num_frames"]
        max_frames = (max_frames - 1) // rule * rule + 1
        if max_size < m or max_frames < 1:
            raise ValueError(f"max_size must be >= {m} and max_frames >= 1")
        fit = lambda v: max(m, min(v, max_size) // m * m)  # noqa: E731
        self.limits = Limits(size_multiple=m, default_width=fit(d["width"]), default_height=fit(d["height"]),
                             max_size=max_size, frame_multiple=rule, default_frames=min(d["num_frames"], max_frames),
                             max_frames=max_frames, max_steps=cfg.max_steps,
                             fps=fps,
                             guidance_scale=(cfg.default_guidance_scale if cfg.default_guidance_scale is not None
                                             else d["guidance_scale"]))
        self.model_name = cfg.served_model_name or Path(str(cfg.model).rstrip("/")).name or str(cfg.model)
        self.model_names = {self.model_name, str(cfg.model)}
        self.engine.add_listener(self._on_event)
        self._recover()
        self.engine.start_loop()
        return self

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
        self._output.close()
        with self._lock:
            writers = [j.writer for j in self._live.values() if j.writer is not None]
        for w in writers:
            w.abort()
        if self.engine is not None:
            self.engine.close()
        if self.store is not None:
            self.store.close()

    def _recover(self) -> None:
        """Jobs left by a previous run on this data dir: fail the interrupted, queue the queued again."""
        for rec in self.store.by_status("in_progress"):
            self.store.remove_files(rec.id)
            self.store.update(rec.id, status="failed", error={
                "code": "server_restarted",
                "message": "the server stopped while this video was being generated (its partial state lived in "
                           "worker memory); create it again"})
        for path in self.store.video_dir.glob("*.part"):
            path.unlink(missing_ok=True)
        for rec in self.store.by_status("queued"):
            spec = self._spec(rec)
            with self._lock:
                self._live[rec.id] = LiveJob(record=rec)
            try:
                self.scheduler.submit(spec)
            except (QueueFullError, ValueError) as e:
                with self._lock:
                    self._live.pop(rec.id, None)
                self.store.update(rec.id, status="failed", error={"code": "server_restarted", "message": str(e)})

    # -- requests -> specs ----------------------------------------------------------------------

    def resolve(self, req: VideoCreateRequest) -> tuple[GenerationSpec, dict]:
        """Validate a create request against the model and the server's limits (APIError naming the field)."""
        cfg, lim = self.config, self.limits
        prompt = req.prompt
        if not prompt.strip():
            raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        if len(prompt) > cfg.max_prompt_chars:
            raise APIError(400, f"prompt is {len(prompt)} characters long; the limit is {cfg.max_prompt_chars}",
                           param="prompt", code="invalid_value")
        if req.model is not None and req.model not in self.model_names:
            raise APIError(404, f"model {req.model!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        if req.input_reference is not None:
            raise APIError(400, "input_reference is not supported: this model generates video from text only",
                           param="input_reference", code="unsupported_parameter")
        negative = req.negative_prompt if req.negative_prompt is not None else ""
        if len(negative) > cfg.max_prompt_chars:
            raise APIError(400, f"negative_prompt is longer than {cfg.max_prompt_chars} characters",
                           param="negative_prompt", code="invalid_value")
        fps = lim.fps if req.fps is None else req.fps
        _check_range("fps", fps, 1, cfg.max_fps)
        width, height = self._size(req.size)
        num_frames = self._frames(req.seconds, req.num_frames, fps)
        steps = cfg.default_steps if req.num_inference_steps is None else req.num_inference_steps
        _check_range("num_inference_steps", steps, 1, lim.max_steps)
        guidance = lim.guidance_scale if req.guidance_scale is None else req.guidance_scale
        if not math.isfinite(guidance) or not 0 <= guidance <= 100:
            raise APIError(400, f"guidance_scale must be a number in [0, 100]; got {guidance!r}",
                           param="guidance_scale", code="invalid_value")
        seed = random.randrange(MAX_SEED) if req.seed is None else req.seed
        _check_range("seed", seed, 0, MAX_SEED)
        params = {"num_frames": num_frames, "fps": fps, "width": width, "height": height,
                  "num_inference_steps": steps, "guidance_scale": float(guidance), "seed": seed,
                  "negative_prompt": negative, "options": self._options(req, fps)}
        video_id = f"video_{uuid.uuid4().hex}"
        spec = self._spec_from(video_id, prompt, params)
        try:  # the model family's own checks, last: nothing it would refuse may reach the workers
            self.engine.check(spec)
        except RequestError as e:
            param = "size" if e.field in ("height", "width") else e.field
            raise APIError(400, str(e), param=param, code="invalid_value") from None
        params["options"] = dict(spec.options)          # as the family completed them (its defaults filled in)
        fields = {"id": video_id, "prompt": prompt, "seconds": _format_seconds(num_frames, fps),
                  "size": f"{width}x{height}", "params": params}
        return spec, fields

    def _options(self, req: VideoCreateRequest, fps: int) -> dict:
        """The model's own options from the request; a model conditioned on fps gets the video's."""
        options = req.options()
        if "fps" in self.engine.info.get("options", ()):
            options.setdefault("fps", fps)
        return options

    def _size(self, size: str | None) -> tuple[int, int]:
        lim = self.limits
        if size is None:
            return lim.default_width, lim.default_height
        try:
            width, height = parse_size(size)
        except ValueError:
            raise APIError(400, f"size must look like WIDTHxHEIGHT, e.g. \"{lim.default_width}x{lim.default_height}\"; "
                                f"got {size!r}", param="size", code="invalid_value") from None
        for name, v in (("width", width), ("height", height)):
            if not lim.size_multiple <= v <= lim.max_size or v % lim.size_multiple:
                raise APIError(400, f"size: {name} must be a multiple of {lim.size_multiple} in "
                                    f"[{lim.size_multiple}, {lim.max_size}]; got {size!r}",
                               param="size", code="invalid_value")
        return width, height

    def _frames(self, seconds: str | None, num_frames: int | None, fps: int) -> int:
        lim = self.limits
        from_seconds = None
        if seconds is not None:
            try:
                value = float(seconds.strip())
            except ValueError:
                raise APIError(400, f"seconds must be a number of seconds, e.g. \"4\"; got {seconds!r}",
                               param="seconds", code="invalid_value") from None
            if not math.isfinite(value) or value <= 0:
                raise APIError(400, f"seconds must be positive; got {seconds!r}", param="seconds", code="invalid_value")
            # the nearest frame count the model can make (frame_multiple*k + 1 for a causal video VAE)
            rule = lim.frame_multiple
            from_seconds = max(1, round((value * fps - 1) / rule) * rule + 1 if rule > 1 else round(value * fps))
            if from_seconds > lim.max_frames:
                raise APIError(400, f"seconds={seconds} at fps={fps} is {from_seconds} frames; the limit is "
                                    f"{lim.max_frames} frames ({lim.max_frames / fps:g} s at {fps} fps)",
                               param="seconds", code="invalid_value")
        if num_frames is not None:
            _check_range("num_frames", num_frames, 1, lim.max_frames)
            if from_seconds is not None and from_seconds != num_frames:
                raise APIError(400, f"seconds={seconds} at fps={fps} is {from_seconds} frames, but num_frames="
                                    f"{num_frames}; give one of them, or consistent values",
                               param="seconds", code="invalid_value")
            return num_frames
        return lim.default_frames if from_seconds is None else from_seconds

    def _spec_from(self, video_id: str, prompt: str, p: dict) -> GenerationSpec:
        return GenerationSpec(request_id=video_id, prompt=[prompt], negative_prompt=p["negative_prompt"],
                              num_frames=p["num_frames"], height=p["height"], width=p["width"],
                              num_inference_steps=p["num_inference_steps"], guidance_scale=p["guidance_scale"],
                              seed=p["seed"], output="uint8", options=dict(p.get("options") or {}))

    def _spec(self, rec: VideoRecord) -> GenerationSpec:
        return self._spec_from(rec.id, rec.prompt, rec.params)

    # -- the API's operations -----------------------------------------------------------------------

    def create(self, req: VideoCreateRequest) -> Video:
        spec, fields = self.resolve(req)
        rec = VideoRecord(created_at=int(time.time()), status="queued", model=self.model_name, **fields)
        with self._lock:
            self.store.insert(rec)
            self._live[rec.id] = LiveJob(record=rec)
            try:
                self.scheduler.submit(spec)
            except QueueFullError:
                self._live.pop(rec.id, None)
                self.store.delete(rec.id)
                raise self._queue_full() from None
            self.m_created.inc()
            return self._video(rec)

    def _queue_full(self) -> APIError:
        return APIError(429, f"the queue is full ({self.config.max_queue} videos waiting); retry later",
                        code="queue_full", headers={"Retry-After": "5"})

    def record(self, video_id: str) -> VideoRecord:
        with self._lock:
            live = self._live.get(video_id)
            if live is not None:
                return live.record
        rec = self.store.get(video_id) if _plausible_id(video_id) else None
        if rec is None:
            raise APIError(404, f"no video found with video_id {video_id!r}", param="video_id",
                           code="video_not_found")
        return rec

    def get(self, video_id: str) -> Video:
        return self._video(self.record(video_id))

    def list(self, after: str | None, limit: int, order: str) -> VideoList:
        after_seq = None
        if after is not None:
            rec = self.store.get(after) if _plausible_id(after) else None
            if rec is None:
                raise APIError(404, f"after: no video with id {after!r}", param="after", code="video_not_found")
            after_seq = rec.seq
        records, has_more = self.store.page(after_seq, limit, order)
        with self._lock:
            records = [self._live[r.id].record if r.id in self._live else r for r in records]
        data = [self._video(r) for r in records]
        return VideoList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                         has_more=has_more)

    def delete(self, video_id: str) -> VideoDeleted:
        """Delete a video; a queued or running one is cancelled (at the next step boundary) first."""
        with self._lock:
            live = self._live.pop(video_id, None)
            if live is None and (not _plausible_id(video_id) or self.store.get(video_id) is None):
                raise APIError(404, f"no video found with video_id {video_id!r}", param="video_id",
                               code="video_not_found")
            self.store.delete(video_id)
            if live is not None:
                self._cancelling[video_id] = live
        if live is not None:
            live.writer_ready.set()
            if not self.scheduler.cancel(video_id):
                # the scheduler was already done with it (its video is being written): stop that, in turn
                with self._lock:
                    self._cancelling.pop(video_id, None)
                self._output.put(self._drop_output, live)
            self.m_finished.inc(outcome="cancelled")
        self._output.put(self.store.remove_files, video_id)
        self._output.put(self.broker.publish, video_id, "video.deleted",
                         {"id": video_id, "object": "video.deleted", "deleted": True})
        return VideoDeleted(id=video_id)

    def content_path(self, video_id: str, variant: str) -> Path:
        """The stored MP4 or PNG of a completed video."""
        rec = self.record(video_id)
        if rec.status != "completed":
            raise _not_ready(rec)
        path = self.store.video_path(video_id) if variant == "video" else self.store.thumbnail_path(video_id)
        if not path.exists():
            raise APIError(404, f"the {variant} of {video_id!r} is missing from the data directory",
                           param="variant", code="content_missing")
        return path

    def live_job(self, video_id: str) -> LiveJob | None:
        with self._lock:
            return self._live.get(video_id)

    def event_snapshot(self, video_id: str) -> tuple[str, dict]:
        """The event that tells a new SSE subscriber where the video stands now."""
        rec = self.record(video_id)
        with self._lock:
            live = self._live.get(video_id)
            return self._status_event(rec, live)

    def _status_event(self, rec: VideoRecord, live: LiveJob | None) -> tuple[str, dict]:
        if rec.status == "completed":
            return "video.completed", self._video(rec).model_dump()
        if rec.status == "failed":
            return "video.failed", self._video(rec).model_dump()
        if rec.status == "queued":
            pos = self.scheduler.queue_position(rec.id)
            return "video.queued", self._event(rec, queue_position=pos)
        extra = {}
        if live is not None:
            if live.frames_done and live.step >= live.num_steps:
                return "video.decoding", self._event(rec, frames_done=live.frames_done,
                                                     num_frames=rec.params["num_frames"])
            extra = {"step": live.step, "num_steps": live.num_steps}
        return "video.in_progress", self._event(rec, **extra)

    # -- scheduler events (the scheduler's thread) ---------------------------------------------------

    def _on_event(self, kind: str, req, data: dict) -> None:
        """The scheduler thread's only call into the service: counters, then the rest is queued for the
        output thread (SQLite, PNG, MP4 encoding, SSE fan-out), so the thread that drives the workers never
        waits for I/O."""
        if kind == "batch":
            self.m_batch.observe(data["batch_size"])
            self.m_step_latency.observe(data["step_s"])
            return
        self._output.put(self._handle_event, kind, req, data)

    def _handle_event(self, kind: str, req, data: dict) -> None:
        """A scheduler event's side effects (the output thread)."""
        if kind == "pool":
            return
        if kind == "queue":
            self._publish_positions(data["waiting"])
            return
        if kind in ("cancelled", "failed", "completed"):
            with self._lock:
                gone = self._cancelling.pop(req.id, None)
            if gone is not None:  # deleted by a client: drop whatever was written
                if gone.writer is not None:
                    gone.writer.abort()
                self.store.remove_files(req.id)
                return
        if kind == "cancelled":
            return
        with self._lock:
            live = self._live.get(req.id)
        if live is None:
            return  # deleted meanwhile
        rec = live.record
        if kind == "admitted":
            live.num_steps, live.step, live.frames_done, live.queue_position = data["num_steps"], 0, 0, None
            live.num_frames = data["num_frames"]
            self._set(rec, status="in_progress", progress=0)
            self.store.update(rec.id, status="in_progress", progress=0)
            self.broker.publish(rec.id, "video.in_progress", self._event(rec, step=0, num_steps=live.num_steps))
        elif kind == "step":
            live.step = data["step"]
            self._set(rec, progress=self._progress(live))
            self.broker.publish(rec.id, "video.progress", self._event(
                rec, step=data["step"], num_steps=data["num_steps"], batch_size=data["batch_size"],
                step_ms=round(1000 * data["step_s"], 2)))
        elif kind == "decoding":
            self.broker.publish(rec.id, "video.decoding", self._event(rec, frames_done=0,
                                                                      num_frames=data["num_frames"]))
        elif kind == "frames":
            self._write_frames(live, data)
        elif kind == "completed":
            if live.writer is None:
                self._fail(live, "encoding_failed", "no frames were decoded")
            else:
                live.writer.finish(lambda ok, err, vid=rec.id: self._written(vid, ok, err))
        elif kind == "failed":
            self._fail(live, data["code"], data["message"])
        elif kind == "requeued":
            self._drop_output(live)
            live.num_steps = live.step = live.frames_done = 0
            self._set(rec, status="queued", progress=0)
            self.store.update(rec.id, status="queued", progress=0)
            self.m_requeued.inc()

    def _write_frames(self, live: LiveJob, data: dict) -> None:
        rec, p = live.record, live.record.params
        frames = data["frames"][0]                                   # (n, H, W, 3) uint8, first prompt
        if live.writer is None:
            write_png(self.store.thumbnail_path(rec.id), frames[0])
            live.writer = FragmentedMP4Writer(self.store.partial_path(rec.id), self.store.video_path(rec.id),
                                              p["width"], p["height"], p["fps"],
                                              keyframe_interval=self.config.decode_chunk_frames)
            live.writer_ready.set()
        live.writer.write(frames)
        live.frames_done = data["stop"]
        total = live.num_frames = data["num_frames"]
        self._set(rec, progress=self._progress(live))
        self.broker.publish(rec.id, "video.decoding", self._event(rec, frames_done=data["stop"], num_frames=total))

    @staticmethod
    def _progress(live: LiveJob) -> int:
        """90 points over every denoising step (all segments' for long video), 9 over the frames decoded so far
        (a long video's first segments are decoded while later ones denoise), 100 once the file is complete."""
        steps = live.step / max(1, live.num_steps)
        frames = live.frames_done / max(1, live.num_frames)
        return min(99, int(DENOISE_SHARE * steps + (99 - DENOISE_SHARE) * frames))

    def _written(self, video_id: str, ok: bool, error: str | None) -> None:
        """The MP4 writer finished (its own thread)."""
        with self._lock:
            live = self._live.get(video_id)
        if live is None:  # deleted while the last bytes were written
            self.store.remove_files(video_id)
            return
        if not ok:
            self._fail(live, "encoding_failed", f"writing the MP4 failed: {error}")
            return
        rec = live.record
        now = int(time.time())
        self.store.update(video_id, status="completed", progress=100, completed_at=now)
        with self._lock:
            self._set(rec, status="completed", progress=100, completed_at=now)
            self._live.pop(video_id, None)
        self.m_finished.inc(outcome="completed")
        self.broker.publish(video_id, "video.completed", self._video(rec).model_dump())

    def _fail(self, live: LiveJob, code: str, message: str) -> None:
        rec = live.record
        self._drop_output(live)
        error = {"code": code, "message": message}
        self.store.update(rec.id, status="failed", error=error)
        with self._lock:
            self._set(rec, status="failed", error=error)
            self._live.pop(rec.id, None)
        live.writer_ready.set()
        self.m_finished.inc(outcome="failed")
        self.broker.publish(rec.id, "video.failed", self._video(rec).model_dump())

    def _drop_output(self, live: LiveJob) -> None:
        if live.writer is not None:
            live.writer.abort()
            live.writer = None
            live.writer_ready.clear()
        self.store.remove_files(live.record.id)

    def _publish_positions(self, waiting: list[str]) -> None:
        with self._lock:
            jobs = [(i, self._live.get(vid)) for i, vid in enumerate(waiting)]
        for i, live in jobs:
            if live is None or live.queue_position == i:
                continue
            live.queue_position = i
            if self.broker.has_subscribers(live.record.id):
                self.broker.publish(live.record.id, "video.queued", self._event(live.record, queue_position=i))

    def _set(self, rec: VideoRecord, **fields) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(rec, k, v)

    # -- views ----------------------------------------------------------------------------------------

    def _video(self, rec: VideoRecord) -> Video:
        p = rec.params
        return Video(id=rec.id, model=rec.model, status=rec.status, progress=rec.progress, created_at=rec.created_at,
                     completed_at=rec.completed_at, error=VideoError(**rec.error) if rec.error else None,
                     prompt=rec.prompt, seconds=rec.seconds, size=rec.size, num_frames=p["num_frames"], fps=p["fps"],
                     num_inference_steps=p["num_inference_steps"], guidance_scale=p["guidance_scale"],
                     seed=p["seed"], negative_prompt=p["negative_prompt"], options=p.get("options") or {})

    @staticmethod
    def _event(rec: VideoRecord, **extra) -> dict:
        return {"id": rec.id, "status": rec.status, "progress": rec.progress, **extra}

    # -- health and metrics ---------------------------------------------------------------------------

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body): 200 "ok" only while every worker is up with the model loaded; 503 "starting",
        "restarting" (after a failure) or "unavailable" (the workers fail to load, or the scheduler stopped).
        Reads attributes only: never waits for a running job."""
        engine, sched = self.engine, self.scheduler
        pool = engine.pool if engine else None
        state = pool.state if pool is not None else "starting"
        if sched is None or not sched.alive or state in ("unavailable", "closed") or sched.setup_failures >= 3:
            status = "unavailable"
        elif state == "ready":
            status = "ok"
        else:
            status = state if state in ("starting", "restarting") else "unavailable"
        error = (pool.last_error if pool is not None else None) or None
        body = {"status": status, "model": getattr(self, "model_name", self.config.model),
                "workers": pool.workers if pool is not None else self.config.workers,
                "workers_ready": bool(pool is not None and pool.ready), "worker_state": state,
                "worker_restarts": pool.restarts if pool is not None else 0,
                "setup_failures": sched.setup_failures if sched is not None else 0,
                "queued": sched.num_waiting if sched is not None else 0,
                "running": sched.num_admitted if sched is not None else 0,
                "last_error": None if error is None else {"kind": error.kind, "rank": error.rank,
                                                          "message": str(error).splitlines()[0][:500]}}
        return (200 if status == "ok" else 503), body

    def _build_metrics(self) -> None:
        r = self.registry = Registry()
        sched = lambda: self.scheduler  # noqa: E731  (set in start)
        r.add(Gauge("longserve_queue_depth", "Video requests waiting to be admitted.",
                    lambda: sched().num_waiting if sched() else 0))
        r.add(Gauge("longserve_running_requests", "Admitted video requests (denoising or decoding).",
                    lambda: sched().num_admitted if sched() else 0))
        r.add(Gauge("longserve_batch_size", "Requests in the most recent denoising step.",
                    lambda: sched().last_batch_size if sched() else 0))
        self.m_batch = r.add(Histogram("longserve_step_batch_size", "Requests per denoising step.",
                                       (1, 2, 4, 8, 16, 32, 64, 128)))
        self.m_step_latency = r.add(Histogram("longserve_step_latency_seconds", "Wall time of one denoising step.",
                                              (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)))
        r.add(Gauge("longserve_jobs", "Video jobs in the store, by status.", self._jobs_by_status, labels=("status",)))
        self.m_created = r.add(Counter("longserve_jobs_created_total", "Video jobs accepted."))
        self.m_finished = r.add(Counter("longserve_jobs_finished_total", "Video jobs finished, by outcome.",
                                        labels=("outcome",)))
        self.m_requeued = r.add(Counter("longserve_jobs_requeued_total",
                                        "Admitted jobs queued again after a worker pool restart."))
        r.add(Gauge("longserve_worker_restarts", "Worker pool restarts since the server started.",
                    lambda: self.engine.pool.restarts if self.engine else 0))
        r.add(Gauge("longserve_workers_ready", "1 while the worker pool is up.",
                    lambda: 1 if self.engine and self.engine.pool.ready else 0))

    def _jobs_by_status(self) -> dict:
        counts = {s: 0 for s in ("queued", "in_progress", "completed", "failed")}
        if self.store is not None:
            counts.update(self.store.counts_by_status())
        return counts

    def metrics_text(self) -> str:
        return self.registry.render()


class OutputThread:
    """Runs the service's side effects in order, on one thread of their own."""

    def __init__(self):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="longserve-output", daemon=True)
        self._thread.start()

    def put(self, fn, *args) -> None:
        self._tasks.put((fn, args))

    def _run(self) -> None:
        while True:
            fn, args = self._tasks.get()
            if fn is None:
                return
            try:
                fn(*args)
            except Exception:  # one job's failed write must not stop everyone else's
                log.exception("output task %s failed", getattr(fn, "__name__", fn))

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every task queued so far is done."""
        done = threading.Event()
        self.put(done.set)
        done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.put(None)
        self._thread.join(timeout)


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise APIError(400, f"{name} must be in [{low}, {high}]; got {value}", param=name, code="invalid_value")


def _format_seconds(num_frames: int, fps: int) -> str:
    return f"{num_frames / fps:g}"


def _plausible_id(video_id: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9_\-]{1,100}", video_id))


def _not_ready(rec: VideoRecord) -> APIError:
    if rec.status == "failed":
        msg = rec.error["message"] if rec.error else "unknown error"
        return APIError(409, f"video {rec.id!r} failed and has no content: {msg}", param="video_id",
                        code="video_failed")
    return APIError(409, f"video {rec.id!r} is {rec.status} ({rec.progress}%); its content is not ready yet "
                         f"(or ask for ?stream=true)", param="video_id", code="video_not_ready")
