"""`VideoService`: the server's video jobs, between the HTTP routes and the engine.

The service holds only API state: each job's stored record (SQLite, `server/api/store.py`)
and, while it runs, its MP4 writer. Everything about a request's progress is the engine's
(`engine.engine.VideoEngine`): `create` submits a `GenerationSpec` and gets a
`RequestHandle`; a coroutine per job (`_follow`, on the service's own event loop thread)
reads the handle's typed outputs as they come and turns them into the record's status,
files (a fragmented MP4 written while frames are decoded, a PNG thumbnail) and SSE events.
Blocking work (SQLite, PNG, feeding ffmpeg) runs on a small thread pool, awaited by that
job's coroutine only, so one slow job never holds up another's events.

Job status (the API's) and progress:

    queued       waiting in the engine (or re-queued after a worker crash), progress 0
    in_progress  admitted: progress = 90 * steps done / steps while denoising, then
                 90..99 as frames are decoded and written
    completed    the MP4 is complete on disk (fsynced, with its directory), progress 100
    failed       `error` {code, message} says why

Restart policy (`--data-dir` reused): a job that was in_progress when the server stopped
is failed (code "server_restarted": its partial denoising lived in worker memory); a
queued job is queued again, in its original order; completed videos stay downloadable
(until `--retention` or the `--max-storage-bytes` quota expires their files).

Storage faults fail a job, never hang it: a failed write of its MP4 or thumbnail fails it
with `storage_full` (no space) or `storage_error`; new creates are refused (507) while the
data dir's file system has less than `--min-free-bytes` free, and /health says `degraded`.
A record's state changes in memory first (what clients read); its SQLite write is retried,
and one that still fails is kept and written again later, so a job never stays
`in_progress` because its end could not be written.

SIGTERM (`drain`): creates get 503; queued jobs leave the engine (their records stay queued
for the next start); running jobs get `--drain-seconds` to finish; the rest fail with
`server_shutdown`; open event streams end with the error envelope.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import math
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import REQUIRED
from engine.engine import RequestHandle, VideoEngine
from engine.outputs import Admitted, Cancelled, Failed, Finished, FramesChunk, Queued, Requeued, StepProgress
from engine.request import GenerationSpec, RequestError
from engine.scheduler import QueueFullError, RequestState
from pipelines.media import VideoInputError, is_mp4, read_mp4
from server.api.config import SERVE_ENGINE_DEFAULTS, ServeConfig
from server.api.errors import APIError
from server.api.metrics import Counter, Gauge, Histogram, Registry
from server.api.protocol import (
    Video,
    VideoCreateRequest,
    VideoDeleted,
    VideoError,
    VideoExtendRequest,
    VideoList,
    parse_size,
)
from server.api.store import JobStore, VideoRecord
from server.api.streaming import EventBroker, shutdown_envelope
from server.api.uploads import decode_image, image_bytes
from server.media import FragmentedMP4Writer, storage_error_code, write_png
from server.notify import Notifier

log = logging.getLogger("longserve.server")

DENOISE_SHARE = 90   # progress points for denoising steps; decoded frames take 9 more; 100 = downloadable
MAX_SEED = 2**63 - 1
#: waits between the tries of a SQLite write before it is kept for the housekeeping task to write again
WRITE_RETRY_S = (0.05, 0.25)
#: seconds a client is told to wait (Retry-After) when there is no room, and while the server shuts down
STORAGE_RETRY_AFTER_S = 30
SHUTDOWN_RETRY_AFTER_S = 10

@dataclass(frozen=True)
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
    default_steps: int


@dataclass(eq=False)
class Job:
    """A job the server follows: its stored record and, while it runs, its engine handle and MP4 writer."""

    record: VideoRecord
    handle: RequestHandle
    writer: FragmentedMP4Writer | None = None
    changed: Notifier = field(default_factory=Notifier)   # a writer exists, or the job ended
    deleted: bool = False
    ended: bool = False
    failed_early: bool = False         # failed by the service (its files could not be written): stop following
    requeue_on_cancel: bool = False    # released from the engine by a drain: the record stays queued
    fail_on_cancel: tuple[str, str] | None = None   # (code, message) when it ends: cut short by a drain


class VideoService:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.engine: VideoEngine | None = None
        self.store: JobStore | None = None
        self.broker = EventBroker()
        self.limits: Limits | None = None
        self._jobs: dict[str, Job] = {}
        self._lock = threading.RLock()
        self._io = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="longserve-io")
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="longserve-jobs", daemon=True)
        self.started_at = int(time.time())
        self.draining = False                          # SIGTERM: no new jobs
        self.drained = False                           # ... and the drain is over: every stream ends
        self._unsaved: dict[str, dict] = {}            # video id -> record fields SQLite has not taken yet
        self._storage_error: str | None = None         # the last failed write, until a write succeeds again
        self._free_bytes: int | None = None            # the data dir's free space, as last measured
        self._build_metrics()

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> "VideoService":
        """Start the workers (loads the model), open the store, recover old jobs, follow them."""
        cfg = self.config
        self.store = JobStore(cfg.data_dir)
        self.engine = VideoEngine.start(cfg.engine)
        self.engine.add_batch_listener(self._on_batch)
        info = self.engine.info
        d, m, rule = info.defaults, info.size_multiple, info.frame_multiple
        max_size = cfg.max_size if cfg.max_size is not None else 2 * max(d.width, d.height)
        fps = cfg.fps if cfg.fps is not None else d.fps
        if cfg.max_frames is not None:
            max_frames = cfg.max_frames
        elif info.capabilities.long_video:
            if not cfg.max_seconds > 0:
                raise ValueError(f"max_seconds must be positive, got {cfg.max_seconds!r}")
            max_frames = max(d.num_frames, round(cfg.max_seconds * fps) + rule)
        else:
            max_frames = 4 * d.num_frames
        max_frames = (max_frames - 1) // rule * rule + 1
        if max_size < m or max_frames < 1:
            raise ValueError(f"max_size must be >= {m} and max_frames >= 1")
        fit = lambda v: max(m, min(v, max_size) // m * m)  # noqa: E731
        self.limits = Limits(size_multiple=m, default_width=fit(d.width), default_height=fit(d.height),
                             max_size=max_size, frame_multiple=rule, default_frames=min(d.num_frames, max_frames),
                             max_frames=max_frames, max_steps=cfg.max_steps, fps=fps,
                             guidance_scale=(cfg.default_guidance_scale if cfg.default_guidance_scale is not None
                                             else d.guidance_scale),
                             # a causal model's step count is its step list's: the model's own default
                             default_steps=d.num_inference_steps if info.capabilities.live else cfg.default_steps)
        from server.api.live import LiveSessions

        self.live = LiveSessions(self, cfg.max_live_seconds, cfg.live_buffer_chunks)
        self.model_name = cfg.served_model_name or Path(str(cfg.model).rstrip("/")).name or str(cfg.model)
        self.model_names = {self.model_name, str(cfg.model)}
        self._checkpoint = checkpoint_fingerprint(self.engine.model_dir, cfg.engine.dtype, self.engine.config.loras)
        self._loop_thread.start()
        self._recover()
        self._measure_free()
        asyncio.run_coroutine_threadsafe(self._housekeeping(), self._loop)
        return self

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()           # every handle's iteration ends; the followers finish
        if self._loop_thread.is_alive():
            pending = asyncio.run_coroutine_threadsafe(self._cancel_followers(), self._loop)
            try:
                pending.result(timeout=30)
            except Exception:
                log.exception("stopping the job followers failed")
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=10)
        with self._lock:
            writers = [j.writer for j in self._jobs.values() if j.writer is not None]
        for w in writers:
            w.abort()
        self._io.shutdown(wait=True, cancel_futures=True)
        if self.store is not None:
            self.store.close()

    async def _cancel_followers(self) -> None:
        tasks = [t for t in asyncio.all_tasks(self._loop) if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _recover(self) -> None:
        """Jobs left by a previous run on this data dir: fail the interrupted, queue the queued again."""
        for rec in self.store.by_status("in_progress"):
            self.store.remove_files(rec.id)
            self._finish_record(rec, status="failed", error={
                "code": "server_restarted",
                "message": "the server stopped while this video was being generated (its partial state lived in "
                           "worker memory); create it again"})
        for path in self.store.video_dir.glob("*.part"):
            path.unlink(missing_ok=True)
        for video_id in self.store.unmeasured():          # kept from before sizes were recorded (the quota's)
            self.store.update(video_id, bytes=self.store.files_bytes(video_id))
        for rec in self.store.by_status("queued"):
            if {"image", "video"} & set(rec.params.get("options") or {}):
                self._finish_record(rec, status="failed", error={
                    "code": "server_restarted",
                    "message": "the server stopped before this job ran, and its input (an image, or the video it "
                               "extends) was held in memory only; create it again"})
                continue
            try:
                handle = self.engine.submit(GenerationSpec.from_params(rec.id, rec.prompt, rec.params))
            except (QueueFullError, ValueError) as e:
                self._finish_record(rec, status="failed", error={"code": "server_restarted", "message": str(e)})
                continue
            self._follow_job(Job(record=rec, handle=handle))

    # -- requests -> specs ----------------------------------------------------------------------

    def resolve(self, req: VideoCreateRequest) -> tuple[GenerationSpec, int]:
        """The server's own limits on a create request (APIError naming the field) -> (spec, fps).
        The model's rules are checked once, by the engine, when the spec is submitted."""
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
        options = req.options()
        images = self._references(req.input_reference, options)
        negative = req.negative_prompt if req.negative_prompt is not None else ""
        if len(negative) > cfg.max_prompt_chars:
            raise APIError(400, f"negative_prompt is longer than {cfg.max_prompt_chars} characters",
                           param="negative_prompt", code="invalid_value")
        fps = lim.fps if req.fps is None else req.fps
        _check_range("fps", fps, 1, cfg.max_fps)
        width, height = self._size(req.size)
        if "video" in images:          # extend the uploaded video: seconds are the seconds added
            num_frames = self._extension_frames(req.seconds, req.num_frames, fps, options, len(images["video"]),
                                                "input_reference")
        else:
            num_frames = self._frames(req.seconds, req.num_frames, fps)
        steps = lim.default_steps if req.num_inference_steps is None else req.num_inference_steps
        _check_range("num_inference_steps", steps, 1, lim.max_steps)
        for name in ("sigmas", "timesteps"):         # a fixed schedule sets the step count: the same limit
            if isinstance(options.get(name), list) and not 1 <= len(options[name]) <= lim.max_steps:
                raise APIError(400, f"{name} sets the steps: at most {lim.max_steps} values; got "
                                    f"{len(options[name])}", param=name, code="invalid_value")
        guidance = lim.guidance_scale if req.guidance_scale is None else req.guidance_scale
        seed = random.randrange(MAX_SEED) if req.seed is None else req.seed
        options.update(images)
        if "fps" in self.engine.info.options:       # a model conditioned on fps gets the video's
            options.setdefault("fps", fps)
        spec = GenerationSpec(request_id=f"video_{uuid.uuid4().hex}", prompt=[prompt], negative_prompt=negative,
                              num_frames=num_frames, height=height, width=width, num_inference_steps=steps,
                              guidance_scale=float(guidance), seed=seed, output="uint8", options=options,
                              lora=req.lora)
        return spec, fps

    def _references(self, input_reference, options: dict) -> dict:
        """An image-to-video model's images, or the video a model extends, decoded: `input_reference` is the first
        frame's image (`server/api/uploads.py`) or, on a model that extends, an MP4 to continue (told apart by
        their bytes: `pipelines/media.py`); the `last_image` file field (an extension) is the last frame's image.
        Refused, naming the field, where the model takes no such input, and when missing where it needs one."""
        last = options.pop("last_image", None)
        for name in ("image", "video"):
            if name in options:
                raise APIError(400, f"{name}: send the {name} as the file field input_reference", param=name,
                               code="invalid_value")
        caps = self.engine.info.capabilities
        takes_image, takes_video = caps.takes_image, caps.extends
        if not takes_image and not takes_video:
            for name, value in (("input_reference", input_reference), ("last_image", last)):
                if value is not None:
                    raise APIError(400, f"{name} is not supported: this model generates video from text only",
                                   param=name, code="unsupported_parameter")
            return {}
        limit = self.config.max_image_pixels
        data = None if input_reference is None else image_bytes(input_reference, "input_reference")
        if data is not None and is_mp4(data[:12]):
            if not takes_video:
                raise APIError(400, "input_reference is a video (MP4), but this model does not extend videos: send "
                                    "an image (PNG, JPEG or WebP)", param="input_reference", code="unsupported_video")
            refs = {"video": self._read_video(data, "input_reference")}
        elif data is not None:
            if not takes_image:
                raise APIError(400, "input_reference must be an MP4 video: this model extends videos and takes no "
                                    "image", param="input_reference", code="unsupported_image")
            refs = {"image": decode_image(data, "input_reference", limit)}
        elif caps.video == REQUIRED:
            raise APIError(400, "input_reference is required: this model extends a video (send an MP4 file as the "
                                "multipart field input_reference, or use POST /v1/videos/{id}/extend)",
                           param="input_reference", code="missing_parameter")
        elif caps.image == REQUIRED:
            raise APIError(400, "input_reference is required: this model makes a video from an image (send a PNG, "
                                "JPEG or WebP file as the multipart field input_reference)",
                           param="input_reference", code="missing_parameter")
        else:                           # a model that takes an image or none (Wan 2.2 TI2V, diffusion forcing)
            refs = {}
        if last is not None:
            refs["last_image"] = decode_image(image_bytes(last, "last_image"), "last_image", limit)
        return refs

    def _read_video(self, source, field: str):
        """An MP4 (bytes or a stored file) -> frames, bounded before decoding: at most --max-frames frames (the
        longest video this server makes), --max-image-pixels pixels each, and as many pixels in all as the
        longest video at the largest size holds."""
        lim = self.limits
        try:
            return read_mp4(source, field, max_frames=lim.max_frames, max_pixels=self.config.max_image_pixels,
                            max_total_pixels=lim.max_frames * lim.max_size * lim.max_size)
        except VideoInputError as e:
            raise APIError(400, str(e), param=field, code=e.code) from None

    def _extension_frames(self, seconds: str | None, num_frames: int | None, fps: int, options: dict,
                          video_frames: int, field: str) -> int:
        """The model's num_frames for extending a video of `video_frames` frames by `seconds`: the frames it
        makes re-make the video's last overlap_history frames, then continue it (`engine/families/skyreels_df.py`),
        so num_frames = overlap_history + the new frames, a multiple of the frame rule. `num_frames` (the
        extension field) is the model's own, as in Python. The extended video must fit --max-frames."""
        lim = self.limits
        d = self.engine.info.defaults.options
        overlap = options.get("overlap_history", d.get("overlap_history")) or 0
        rule = lim.frame_multiple
        if num_frames is not None:
            _check_range("num_frames", num_frames, 1, lim.max_frames)
            added = num_frames - overlap
        elif seconds is not None:
            value = self._seconds(seconds)
            added = max(rule, round(value * fps / rule) * rule)
        else:
            added = max(rule, lim.default_frames - overlap)
        if video_frames + added > lim.max_frames:
            raise APIError(400, f"the extended video would be {video_frames} + {added} = {video_frames + added} "
                                f"frames; the limit is {lim.max_frames} ({lim.max_frames / fps:g} s at {fps} fps)",
                           param="seconds" if seconds is not None else field, code="invalid_value")
        return overlap + added if num_frames is None else num_frames

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
            if not lim.size_multiple <= v <= lim.max_size:
                raise APIError(400, f"size: {name} must be in [{lim.size_multiple}, {lim.max_size}]; got {size!r}",
                               param="size", code="invalid_value")
        return width, height

    @staticmethod
    def _seconds(seconds: str) -> float:
        try:
            value = float(seconds.strip())
        except ValueError:
            raise APIError(400, f"seconds must be a number of seconds, e.g. \"4\"; got {seconds!r}",
                           param="seconds", code="invalid_value") from None
        if not math.isfinite(value) or value <= 0:
            raise APIError(400, f"seconds must be positive; got {seconds!r}", param="seconds", code="invalid_value")
        return value

    def _frames(self, seconds: str | None, num_frames: int | None, fps: int) -> int:
        lim = self.limits
        from_seconds = None
        if seconds is not None:
            value = self._seconds(seconds)
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

    # -- the API's operations -----------------------------------------------------------------------

    def create(self, req: VideoCreateRequest) -> Video:
        self.check_admission()
        spec, fps = self.resolve(req)
        return self.submit(spec, fps, seeded=req.seed is not None)

    def extend(self, video_id: str, req: VideoExtendRequest) -> Video:
        """`POST /v1/videos/{id}/extend`: a new video whose content is the completed video `video_id` continued."""
        self.check_admission()
        spec, fps, source = self.resolve_extension(video_id, req)
        return self.submit(spec, fps, extended_from=source, seeded=req.seed is not None)

    def resolve_extension(self, video_id: str, req: VideoExtendRequest) -> tuple[GenerationSpec, int, str]:
        """An extend request -> (spec, fps, the source's id). The source's size, fps, steps, guidance, negative
        prompt, LoRA adapters and model options carry over unless the request sets them; its stored MP4 is the video
        extended.
        400 on a model that cannot extend, 404 for an unknown (or expired) video, 409 for one not completed."""
        cfg, lim = self.config, self.limits
        if not self.engine.info.capabilities.extends:
            raise APIError(400, f"this model ({self.model_name}, a {self.engine.info.family} model) cannot extend "
                                f"videos: extension needs a diffusion-forcing (SkyReels-V2 DF) checkpoint",
                           param="model", code="unsupported_operation")
        source = self.record(video_id)                                          # 404
        if source.status != "completed":
            raise _not_ready(source)                                            # 409
        path = self.content_path(video_id, "video")                            # 404 when expired or missing
        if not req.prompt.strip():
            raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        if len(req.prompt) > cfg.max_prompt_chars:
            raise APIError(400, f"prompt is {len(req.prompt)} characters long; the limit is {cfg.max_prompt_chars}",
                           param="prompt", code="invalid_value")
        if req.model is not None and req.model not in self.model_names:
            raise APIError(404, f"model {req.model!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        p = source.params
        options = {k: v for k, v in (p.get("options") or {}).items() if k not in ("image", "last_image", "video")}
        options.update(req.options())
        for name in ("image", "video", "last_image", "input_reference"):
            if name in options:
                raise APIError(400, f"{name}: an extension continues the video {video_id}; it takes no other input",
                               param=name, code="invalid_value")
        fps = p["fps"]
        video = self._read_video(path, "video_id")
        num_frames = self._extension_frames(req.seconds, None, fps, options, len(video), "video_id")
        steps = p["num_inference_steps"] if req.num_inference_steps is None else req.num_inference_steps
        _check_range("num_inference_steps", steps, 1, lim.max_steps)
        guidance = p["guidance_scale"] if req.guidance_scale is None else req.guidance_scale
        seed = random.randrange(MAX_SEED) if req.seed is None else req.seed
        negative = p["negative_prompt"] if req.negative_prompt is None else req.negative_prompt
        if len(negative) > cfg.max_prompt_chars:
            raise APIError(400, f"negative_prompt is longer than {cfg.max_prompt_chars} characters",
                           param="negative_prompt", code="invalid_value")
        spec = GenerationSpec(request_id=f"video_{uuid.uuid4().hex}", prompt=[req.prompt], negative_prompt=negative,
                              num_frames=num_frames, height=p["height"], width=p["width"], num_inference_steps=steps,
                              guidance_scale=float(guidance), seed=seed, output="uint8",
                              options={**options, "video": video},
                              lora=p.get("lora") or [] if req.lora is None else req.lora)
        return spec, fps, video_id

    def submit(self, spec: GenerationSpec, fps: int, extended_from: str | None = None, seeded: bool = False) -> Video:
        """Hand a resolved request to the engine and store its record (`create`, `extend`); with an explicit seed
        (`seeded`), a repeat of a completed request reuses its content (`--reuse-completed`)."""
        self.check_admission()
        key = None
        if seeded and self.config.reuse_completed == "seeded":
            key = request_key(self._checkpoint, spec, fps)     # an input video counts by its pixels' digest
            reused = self._reuse(key, spec, extended_from)
            if reused is not None:
                return reused
        try:
            handle = self.engine.submit(spec)
        except RequestError as e:
            param = {"height": "size", "width": "size", "image": "input_reference",
                     "video": "video_id" if extended_from else "input_reference"}.get(e.field, e.field)
            raise APIError(400, str(e), param=param, code="invalid_value") from None
        except QueueFullError:
            raise APIError(429, f"the queue is full ({self.config.engine.max_queue} videos waiting); retry later",
                           code="queue_full", headers={"Retry-After": "5"}) from None
        spec = handle.spec                                 # as the family completed it (its defaults filled in)
        # an extension's content is the video it continues and the new frames: what seconds and num_frames say
        frames = self.engine.family.content_frames(self.engine.info.description, spec)
        params = {**stored_params(spec), "fps": fps}
        if frames != spec.num_frames:
            params["content_frames"] = frames
        rec = VideoRecord(id=spec.request_id, created_at=int(time.time()), status="queued", model=self.model_name,
                          prompt=spec.prompt[0], seconds=_format_seconds(frames, fps),
                          size=f"{spec.width}x{spec.height}", params=params, request_key=key,
                          extended_from=extended_from)
        try:
            _retried(lambda: self.store.insert(rec))
        except Exception as e:
            handle.cancel()
            code = storage_error_code(e)
            if code is None:
                raise
            self._storage_failed(f"storing a new job failed: {e}")
            raise _storage_api_error(code, f"the job could not be stored ({e}); nothing was queued") from None
        self.m_created.inc()
        self._follow_job(Job(record=rec, handle=handle))
        return self._video(rec)

    def _reuse(self, key: str, spec: GenerationSpec, extended_from: str | None = None) -> Video | None:
        """A repeat of a completed request (same checkpoint, prompt, parameters, input and explicit seed): a new
        video, completed at once, whose files are the stored video's (hard links). None when there is no such
        video or its files are gone (then the request is generated as usual)."""
        source = self.store.completed_with_key(key)
        if source is None:
            return None
        now = int(time.time())
        rec = VideoRecord(id=spec.request_id, created_at=now, status="completed", model=self.model_name,
                          prompt=source.prompt, seconds=source.seconds, size=source.size, params=dict(source.params),
                          progress=100, completed_at=now, request_key=key, extended_from=extended_from)
        try:
            self.store.link_files(source.id, rec.id)
        except FileNotFoundError:           # expired or deleted since the lookup
            return None
        try:
            _retried(lambda: self.store.insert(rec))
            fields = dict(expires_at=self._expiry(now), bytes=source.bytes)
            _retried(lambda: self.store.update(rec.id, **fields))
        except Exception as e:
            self.store.remove_files(rec.id)
            code = storage_error_code(e)
            if code is None:
                raise
            self._storage_failed(f"storing a reused video failed: {e}")
            raise _storage_api_error(code, f"the video could not be stored ({e})") from None
        rec.expires_at, rec.bytes = fields["expires_at"], fields["bytes"]
        self.m_created.inc()
        self.m_reused.inc()
        self.m_finished.inc(outcome="completed")
        log.info("%s: an identical request to %s; its content reused, nothing generated", rec.id, source.id)
        if self.config.max_storage_bytes is not None:     # the quota counts its bytes as a video's of its own
            try:
                self.enforce_quota()
            except Exception:
                log.exception("enforcing the storage quota failed")
        return self._video(rec)

    def check_admission(self) -> None:
        """503 while shutting down; 507 while the data dir's file system has less than --min-free-bytes free."""
        if self.draining:
            raise APIError(503, "the server is shutting down and takes no new videos; retry on another server or "
                                "after its restart", code="server_shutdown",
                           headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)})
        floor = self.config.min_free_bytes
        if floor and self._measure_free() < floor:
            raise _storage_api_error("storage_full", f"the server's disk is nearly full ({self._free_bytes} bytes "
                                                     f"free, below {floor}); no new videos until space is freed")

    def _measure_free(self) -> int:
        try:
            self._free_bytes = self.store.free_bytes()
        except OSError as e:
            log.warning("measuring the free space of %s failed: %s", self.store.data_dir, e)
            self._free_bytes = 0
        return self._free_bytes

    def _storage_failed(self, message: str) -> None:
        if self._storage_error is None:
            log.error("storage: %s", message)
        self._storage_error = message
        self._measure_free()

    def storage_problem(self) -> str | None:
        """Why the server's storage is degraded (health's reason), None while it is fine."""
        floor, free = self.config.min_free_bytes, self._free_bytes
        problems = []
        if floor and free is not None and free < floor:
            problems.append(f"{free} bytes free in {self.store.data_dir}, below --min-free-bytes ({floor}): new "
                            f"videos are refused")
        if self._storage_error is not None:
            problems.append(f"a write failed: {self._storage_error}")
        if self._unsaved:
            problems.append(f"{len(self._unsaved)} job record(s) wait to be written to the database")
        return "; ".join(problems) or None

    def _follow_job(self, job: Job) -> None:
        with self._lock:
            self._jobs[job.record.id] = job
        asyncio.run_coroutine_threadsafe(self._follow(job), self._loop)

    def _job(self, video_id: str) -> Job | None:
        """The job the server still follows for `video_id` (None once it is deleted)."""
        with self._lock:
            job = self._jobs.get(video_id)
        return None if job is None or job.deleted else job

    def record(self, video_id: str) -> VideoRecord:
        job = self._job(video_id)
        if job is not None:
            return job.record
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
            records = [self._jobs[r.id].record if r.id in self._jobs else r for r in records]
        data = [self._video(r) for r in records]
        return VideoList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                         has_more=has_more)

    def delete(self, video_id: str) -> VideoDeleted:
        """Delete a video; a queued or running one is cancelled (at the next step boundary) first."""
        with self._lock:
            job = self._job(video_id)
            if job is None and (not _plausible_id(video_id) or self.store.get(video_id) is None):
                raise APIError(404, f"no video found with video_id {video_id!r}", param="video_id",
                               code="video_not_found")
            if job is not None:
                job.deleted = True
        try:
            _retried(lambda: self.store.delete(video_id))
        except Exception as e:
            if job is not None:
                job.deleted = False
            code = storage_error_code(e)
            if code is None:
                raise
            raise _storage_api_error(code, f"video {video_id!r} could not be deleted ({e}); retry later") from None
        with self._lock:
            self._unsaved.pop(video_id, None)
            if job is not None and job.ended:     # finished, kept only while its record waited for SQLite
                self._jobs.pop(video_id, None)
                job = None
        if job is not None:
            job.handle.cancel()         # its follower drops what was written once the engine let it go
            job.changed.notify()
            self.m_finished.inc(outcome="cancelled")
        else:
            self.store.remove_files(video_id)
        self.broker.publish(video_id, "video.deleted", {"id": video_id, "object": "video.deleted", "deleted": True})
        return VideoDeleted(id=video_id)

    def content_path(self, video_id: str, variant: str) -> Path:
        """The stored MP4 or PNG of a completed video."""
        rec = self.record(video_id)
        if rec.status != "completed":
            raise _not_ready(rec)
        if rec.expired:
            raise APIError(404, f"the content of video {video_id!r} expired at {rec.expires_at} and was deleted "
                                f"(the video object stays readable)", param="video_id", code="video_expired")
        path = self.store.video_path(video_id) if variant == "video" else self.store.thumbnail_path(video_id)
        if not path.exists():
            raise APIError(404, f"the {variant} of {video_id!r} is missing from the data directory",
                           param="variant", code="content_missing")
        return path

    async def live_writer(self, video_id: str, disconnected) -> FragmentedMP4Writer | None:
        """The MP4 writer of a job that is still running, once it exists (woken when it does); None when the
        job ended first or `await disconnected()` turns true."""
        while True:
            job = self._job(video_id)
            if job is None or job.ended or job.requeue_on_cancel or (self.drained and job.writer is None):
                return None
            version = job.changed.version
            if job.writer is not None:
                return job.writer
            if await disconnected():
                return None
            await job.changed.wait_after(version, timeout=1.0)

    def event_snapshot(self, video_id: str) -> tuple[str, dict]:
        """The event that tells a new SSE subscriber where the video stands now."""
        rec = self.record(video_id)
        job = self._job(video_id)
        if rec.status == "completed":
            return "video.completed", self._video(rec).model_dump()
        if rec.status == "failed":
            return "video.failed", self._video(rec).model_dump()
        status = job.handle.status() if job is not None else None
        if rec.status == "queued":
            return "video.queued", self._event(rec, queue_position=status.queue_position if status else None)
        if status is None:
            return "video.in_progress", self._event(rec)
        if status.frames_done and status.step >= status.num_steps:
            return "video.decoding", self._event(rec, frames_done=status.frames_done, num_frames=status.num_frames)
        return "video.in_progress", self._event(rec, step=status.step, num_steps=status.num_steps)

    # -- following a job (the service's event loop) --------------------------------------------------------

    async def _run_io(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def _follow(self, job: Job) -> None:
        """Turn the job's engine outputs into its record, files and events, in order, until it ends."""
        try:
            async for out in job.handle:
                await self._apply(job, out)
                if job.failed_early:
                    break          # leaving the iteration cancels the request in the engine
        except asyncio.CancelledError:
            raise
        except Exception as e:     # a bug in one job's handling must not touch any other job
            log.exception("following %s failed", job.record.id)
            job.handle.cancel()
            await self._fail(job, "internal_error", f"the server failed while handling this video: {e}")
        finally:
            job.ended = True
            with self._lock:           # a record SQLite has not taken yet is still served from memory
                if self._jobs.get(job.record.id) is job and job.record.id not in self._unsaved:
                    del self._jobs[job.record.id]
            if job.deleted:        # deleted while it finished: whatever was written goes too
                try:
                    await self._run_io(self.store.remove_files, job.record.id)
                except Exception:  # noqa: BLE001 - the loop may be closing; nothing else to do
                    log.exception("removing the files of deleted %s failed", job.record.id)
            job.changed.notify()

    async def _apply(self, job: Job, out) -> None:
        rec = job.record
        if job.deleted:
            if isinstance(out, (Finished, Failed, Cancelled)):
                await self._drop_output(job)
            return
        if isinstance(out, Queued):
            if self.broker.has_subscribers(rec.id):
                self.broker.publish(rec.id, "video.queued", self._event(rec, queue_position=out.position))
        elif isinstance(out, Admitted):
            await self._update(job, status="in_progress", progress=0)
            self.broker.publish(rec.id, "video.in_progress", self._event(rec, step=0, num_steps=out.num_steps))
        elif isinstance(out, StepProgress):
            self._set(rec, progress=self._progress(job))
            self.broker.publish(rec.id, "video.progress", self._event(
                rec, step=out.step, num_steps=out.num_steps, batch_size=out.batch_size,
                step_ms=round(1000 * out.step_s, 2)))
            if out.denoised:
                self.broker.publish(rec.id, "video.decoding", self._event(rec, frames_done=0,
                                                                          num_frames=job.handle.status().num_frames))
        elif isinstance(out, FramesChunk):
            frames = out.frames[0]                                   # (n, H, W, 3) uint8, first prompt
            try:
                await self._run_io(self._write_frames, job, out)
                await job.writer.write_async(frames)              # this job's own hand-off: never a shared wait
            except OSError as e:                                     # the thumbnail, or the writer's part file
                await self._fail_early(job, storage_error_code(e), f"writing the video failed: {e}")
                return
            if job.writer.failed:
                await self._fail_early(job, job.writer.error_code, job.writer.error)
                return
            self._set(rec, progress=self._progress(job))
            self.broker.publish(rec.id, "video.decoding", self._event(rec, frames_done=out.stop,
                                                                      num_frames=out.num_frames))
        elif isinstance(out, Finished):
            await self._complete(job, out.timings)
        elif isinstance(out, Failed) and job.requeue_on_cancel and job.fail_on_cancel is None:
            await self._drop_output(job)         # released by a drain (the engine closed first): stays queued
        elif isinstance(out, Failed):
            await self._fail(job, *(job.fail_on_cancel or (out.error.code, out.error.message)))
        elif isinstance(out, Cancelled):
            await self._drop_output(job)
            if job.fail_on_cancel is not None:
                await self._fail(job, *job.fail_on_cancel)
            elif job.requeue_on_cancel and rec.status != "queued":
                await self._update(job, status="queued", progress=0)
        elif isinstance(out, Requeued):
            await self._drop_output(job)
            await self._update(job, status="queued", progress=0)
            self.m_requeued.inc()

    def _write_frames(self, job: Job, out: FramesChunk) -> None:
        """The io thread: the first chunk makes the thumbnail and the writer (the frames are then handed to the
        writer by the job's follower, `FragmentedMP4Writer.write_async`)."""
        rec, p = job.record, job.record.params
        if job.writer is None:
            write_png(self.store.thumbnail_path(rec.id), out.frames[0][0])
            job.writer = FragmentedMP4Writer(self.store.partial_path(rec.id), self.store.video_path(rec.id),
                                             p["width"], p["height"], p["fps"],
                                             keyframe_interval=self.config.engine.decode_chunk_frames)
            job.changed.notify()

    async def _complete(self, job: Job, timings: dict | None = None) -> None:
        if job.writer is None:
            await self._fail(job, "encoding_failed", "no frames were decoded")
            return
        loop = asyncio.get_running_loop()
        written: asyncio.Future = loop.create_future()
        job.writer.finish(lambda ok, err: loop.call_soon_threadsafe(
            lambda: written.done() or written.set_result((ok, err))))
        ok, error = await written
        if job.deleted:
            await self._drop_output(job)
            return
        if not ok:
            code = job.writer.error_code or "encoding_failed"
            if code.startswith("storage"):
                self._storage_failed(error)
            await self._fail(job, code, f"writing the MP4 failed: {error}")
            return
        now = int(time.time())
        size = await self._run_io(self.store.files_bytes, job.record.id)
        extra = {}
        if timings and "blocks" in timings:      # transformer block evaluations (step caching skips some)
            extra["params"] = {**job.record.params, "transformer_blocks": {
                "evaluated": timings["blocks"], "skipped": timings.get("blocks_skipped", 0)}}
        await self._update(job, status="completed", progress=100, completed_at=now, expires_at=self._expiry(now),
                           bytes=size, **extra)
        if job.deleted:            # deleted while its record was written: it was cancelled, not completed
            await self._drop_output(job)
            return
        self.m_finished.inc(outcome="completed")
        self.broker.publish(job.record.id, "video.completed", self._video(job.record).model_dump())
        if self.config.max_storage_bytes is not None:
            try:
                await self._run_io(self.enforce_quota)
            except Exception:
                log.exception("enforcing the storage quota failed")

    async def _fail(self, job: Job, code: str, message: str) -> None:
        """Failed in memory first (what clients read, and the event), then the files go and SQLite is told."""
        fields = {"status": "failed", "error": {"code": code, "message": message},
                  "expires_at": self._expiry(int(time.time()))}
        self._set(job.record, **fields)
        self.m_finished.inc(outcome="failed")
        self.broker.publish(job.record.id, "video.failed", self._video(job.record).model_dump())
        try:
            await self._drop_output(job)
        except Exception:          # noqa: BLE001 - the record must still be written
            log.exception("removing the files of failed %s failed", job.record.id)
        if not job.deleted:
            await self._save(job.record.id, fields)

    async def _fail_early(self, job: Job, code: str, message: str) -> None:
        """Fail a job the engine still runs (its files cannot be written): the follower stops, which cancels it."""
        if code.startswith("storage"):
            self._storage_failed(message)
        job.failed_early = True
        job.handle.cancel()
        await self._fail(job, code, message)

    async def _drop_output(self, job: Job) -> None:
        writer, job.writer = job.writer, None
        if writer is not None:
            await self._run_io(writer.abort)
        await self._run_io(self.store.remove_files, job.record.id)
        job.changed.notify()

    async def _update(self, job: Job, **fields) -> None:
        """The record in memory first (what clients read), then in SQLite (unless the job was deleted)."""
        self._set(job.record, **fields)
        if not job.deleted:
            await self._save(job.record.id, fields)

    async def _save(self, video_id: str, fields: dict) -> None:
        """Write fields of a record to SQLite, tried again after a failure (a full disk, a locked database); what
        still fails is kept, with the job served from memory, for `_housekeeping` to write. Never raises."""
        with self._lock:
            pending = {**self._unsaved.pop(video_id, {}), **fields}   # in order: later fields win
        for wait in (*WRITE_RETRY_S, None):
            try:
                await self._run_io(lambda: self.store.update(video_id, **pending))
                if not self._unsaved:
                    self._storage_error = None     # writes go through again
                return
            except Exception as e:  # noqa: BLE001 - sqlite3 and OS errors alike
                if wait is None:
                    with self._lock:
                        self._unsaved[video_id] = {**pending, **self._unsaved.get(video_id, {})}
                    self._storage_failed(f"writing the record of {video_id} failed: {e}")
                    return
                await asyncio.sleep(wait)

    def _flush_unsaved(self) -> None:
        """The io thread: write the records SQLite could not take before; a job fully written is let go."""
        with self._lock:
            pending = dict(self._unsaved)
        for video_id, fields in pending.items():
            try:
                self.store.update(video_id, **dict(fields))
            except Exception as e:  # noqa: BLE001
                self._storage_failed(f"writing the record of {video_id} failed: {e}")
                return
            with self._lock:
                if self._unsaved.get(video_id) == fields:
                    del self._unsaved[video_id]
                job = self._jobs.get(video_id)
                if job is not None and job.ended and video_id not in self._unsaved:
                    del self._jobs[video_id]
        if not self._unsaved:
            log.info("storage: the pending job records are written")
            self._storage_error = None

    def _finish_record(self, rec: VideoRecord, **fields) -> None:
        self.store.update(rec.id, **fields, expires_at=self._expiry(int(time.time())))

    def _progress(self, job: Job) -> int:
        """90 points over every denoising step (all segments' for long video), 9 over the frames decoded so far
        (a long video's first segments are decoded while later ones denoise), 100 once the file is complete."""
        s = job.handle.status()
        if s.state is RequestState.WAITING:
            return 0
        steps = s.step / max(1, s.num_steps)
        frames = s.frames_done / max(1, s.num_frames)
        return min(99, int(DENOISE_SHARE * steps + (99 - DENOISE_SHARE) * frames))

    def _set(self, rec: VideoRecord, **fields) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(rec, k, v)

    # -- retention, quota, housekeeping ------------------------------------------------------------------

    def _expiry(self, finished_at: int) -> int | None:
        r = self.config.retention_s
        return None if r is None else finished_at + math.ceil(r)

    def expire(self, now: int | None = None) -> list[str]:
        """Delete the files of the finished videos whose expires_at has passed and mark their records expired
        (GET still answers; content says video_expired); returns their ids."""
        now = int(time.time()) if now is None else now
        gone = []
        for video_id in self.store.expired(now):
            with self._lock:
                if video_id in self._jobs:
                    continue               # still being finished: its next sweep
            self._expire_files(video_id)
            gone.append(video_id)
        return gone

    def enforce_quota(self) -> list[str]:
        """Over --max-storage-bytes: expire completed videos, oldest completed first, until the rest fit. The
        newest completed video is kept (its client has not had a chance to fetch it) and running jobs are
        never touched. Returns the ids evicted."""
        limit = self.config.max_storage_bytes
        if limit is None:
            return []
        stored = self.store.stored()
        total = sum(size for _, size, _ in stored)
        evicted = []
        for video_id, size, expires_at in stored[:-1]:
            if total <= limit:
                break
            with self._lock:
                if video_id in self._jobs:
                    continue
            now = int(time.time())
            self._expire_files(video_id, expires_at=now if expires_at is None else min(expires_at, now))
            total -= size
            evicted.append(video_id)
        if evicted:
            log.info("storage quota (%d bytes): expired %d oldest video(s)", limit, len(evicted))
        return evicted

    def _expire_files(self, video_id: str, **fields) -> None:
        self.store.remove_files(video_id)
        self.store.update(video_id, expired=True, **fields)
        self.m_expired.inc()
        log.info("expired %s", video_id)

    def stored_bytes(self) -> int:
        return sum(size for _, size, _ in self.store.stored()) if self.store is not None else 0

    async def _housekeeping(self) -> None:
        """Every second: write the records SQLite could not take; every few seconds: measure the free space;
        at every half retention (at most a minute): expire old videos and apply the quota."""
        retention = self.config.retention_s
        sweep_s = 60.0 if retention is None else max(1.0, min(60.0, retention / 2))
        last_sweep = last_free = float("-inf")
        while True:
            now = time.monotonic()
            try:
                if self._unsaved:
                    await self._run_io(self._flush_unsaved)
                if now - last_free >= 2.0:
                    last_free = now
                    await self._run_io(self._measure_free)
                if now - last_sweep >= sweep_s:
                    last_sweep = now
                    await self._run_io(self.expire)
                    await self._run_io(self.enforce_quota)
            except Exception as e:  # noqa: BLE001 - the next round tries again
                log.exception("housekeeping failed")
                if storage_error_code(e) is not None:
                    self._storage_failed(str(e))
            await asyncio.sleep(1.0)

    # -- shutdown ----------------------------------------------------------------------------------------

    def drain(self, timeout_s: float, cut_short: threading.Event | None = None) -> None:
        """SIGTERM: admit nothing new (creates get 503); queued jobs leave the engine (their records stay queued:
        the next start on this data dir runs them); running jobs get `timeout_s` to finish (less if `cut_short`
        is set); what still runs then fails with `server_shutdown`; open event streams end with the error
        envelope. Blocks (call it from a thread of its own); the caller then stops the HTTP server."""
        self.draining = True
        stop = cut_short or threading.Event()
        deadline = time.monotonic() + timeout_s
        log.warning("draining: %d job(s) followed; running ones get %g s to finish", len(self._jobs), timeout_s)
        while True:
            running = []
            for job in self._followed():
                if job.requeue_on_cancel or job.fail_on_cancel:
                    continue
                if job.handle.status().state is RequestState.WAITING:
                    job.requeue_on_cancel = True
                    job.handle.cancel()
                else:
                    running.append(job)
            if not running or time.monotonic() >= deadline or stop.wait(0.1):
                break
        message = (f"the server shut down before this video was finished (running videos had {timeout_s:g} s to "
                   f"finish); create it again")
        for job in running:
            job.fail_on_cancel = ("server_shutdown", message)
            job.handle.cancel()
        live = getattr(self, "live", None)
        for handle in list(live.active.values()) if live is not None else ():
            handle.cancel()                     # a live session ends at its next step
        until = time.monotonic() + 3.0          # the followers write what the cancellations mean
        while any(not j.ended for j in self._followed()) and time.monotonic() < until:
            time.sleep(0.05)
        self.drained = True
        self.broker.close_all("error", shutdown_envelope())
        for job in self._followed():
            job.changed.notify()
        log.warning("drained: %d video(s) failed with server_shutdown", len(running))

    def stream_ends_now(self, video_id: str) -> bool:
        """While shutting down: no more events will come for `video_id` (it is not running here any more)."""
        if not self.draining:
            return False
        job = self._job(video_id)
        return self.drained or job is None or job.ended or job.requeue_on_cancel

    def _followed(self) -> list[Job]:
        with self._lock:
            return [j for j in self._jobs.values() if not j.ended]

    # -- views ----------------------------------------------------------------------------------------

    def _video(self, rec: VideoRecord) -> Video:
        p = rec.params
        return Video(id=rec.id, model=rec.model, status=rec.status, progress=rec.progress, created_at=rec.created_at,
                     completed_at=rec.completed_at, expires_at=rec.expires_at,
                     error=VideoError(**rec.error) if rec.error else None,
                     prompt=rec.prompt, seconds=rec.seconds, size=rec.size, extended_from=rec.extended_from,
                     num_frames=p.get("content_frames", p["num_frames"]), fps=p["fps"],
                     num_inference_steps=p["num_inference_steps"], guidance_scale=p["guidance_scale"],
                     seed=p["seed"], negative_prompt=p["negative_prompt"], options=p.get("options") or {},
                     lora=p.get("lora") or [], transformer_blocks=p.get("transformer_blocks"))

    @staticmethod
    def _event(rec: VideoRecord, **extra) -> dict:
        return {"id": rec.id, "status": rec.status, "progress": rec.progress, **extra}

    # -- health and metrics ---------------------------------------------------------------------------

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body): 200 "ok" only while every worker is up with the model loaded; 503 "starting",
        "restarting" (after a failure) or "unavailable" (the workers fail to load, or the engine stopped).
        Reads attributes only: never waits for a running job."""
        if self.engine is None:
            return 503, {"status": "starting", "model": self.config.model, "workers": self.config.engine.workers,
                         "workers_ready": False, "worker_state": "starting", "worker_restarts": 0,
                         "setup_failures": 0, "queued": 0, "running": 0, "last_error": None}
        s = self.engine.stats()
        if not s.loop_alive or s.pool_state in ("unavailable", "closed") or s.setup_failures >= 3:
            status = "unavailable"
        elif s.pool_state == "ready":
            status = "ok"
        else:
            status = s.pool_state if s.pool_state in ("starting", "restarting") else "unavailable"
        error = s.last_error
        reason = None
        if status == "ok" and self.draining:
            status, reason = "draining", "the server is shutting down: no new videos"
        elif status == "ok" and (problem := self.storage_problem()) is not None:
            status, reason = "degraded", problem
        body = {"status": status, "model": getattr(self, "model_name", self.config.model), "workers": s.workers,
                "workers_ready": s.workers_ready, "worker_state": s.pool_state, "worker_restarts": s.restarts,
                "setup_failures": s.setup_failures, "queued": s.waiting, "running": s.running,
                "last_error": None if error is None else {"kind": error.kind, "rank": error.rank,
                                                          "message": str(error).splitlines()[0][:500]},
                "reason": reason, "disk_free_bytes": self._free_bytes}
        return (200 if status == "ok" else 503), body

    def _on_batch(self, step) -> None:
        self.m_batch.observe(step.batch_size)
        self.m_step_latency.observe(step.step_s)

    def _build_metrics(self) -> None:
        r = self.registry = Registry()
        stats = lambda: self.engine.stats() if self.engine else None  # noqa: E731  (set in start)
        r.add(Gauge("longserve_queue_depth", "Video requests waiting to be admitted.",
                    lambda: stats().waiting if self.engine else 0))
        r.add(Gauge("longserve_running_requests", "Admitted video requests (denoising or decoding).",
                    lambda: stats().running if self.engine else 0))
        r.add(Gauge("longserve_live_sessions", "Open live sessions (WebSocket /v1/videos/live).",
                    lambda: len(self.live.active) if getattr(self, "live", None) else 0))
        r.add(Gauge("longserve_kv_cache_bytes", "KV cache held per worker by causal-model requests (counted against "
                    "--live-kv-budget; freed when a request ends).", self._kv_bytes))
        r.add(Gauge("longserve_batch_size", "Requests in the most recent denoising step.",
                    lambda: stats().last_batch_size if self.engine else 0))
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
        self.m_reused = r.add(Counter("longserve_jobs_reused_total",
                                      "Video jobs completed at once with a stored video's content (an identical "
                                      "request with an explicit seed; --reuse-completed)."))
        self.m_expired = r.add(Counter("longserve_jobs_expired_total",
                                       "Finished videos whose files were deleted (retention ran out, or the storage "
                                       "quota evicted them); their records stay, marked expired."))
        r.add(Gauge("longserve_stored_video_bytes", "Bytes of the completed videos kept (--max-storage-bytes "
                    "counts these).", self.stored_bytes))
        r.add(Gauge("longserve_disk_free_bytes", "Free bytes on the data dir's file system, as last measured.",
                    lambda: self._free_bytes or 0))
        r.add(Gauge("longserve_worker_restarts", "Worker pool restarts since the server started.",
                    lambda: stats().restarts if self.engine else 0))
        r.add(Gauge("longserve_workers_ready", "1 while the worker pool is up.",
                    lambda: 1 if self.engine and stats().workers_ready else 0))

    def _kv_bytes(self) -> int:
        return self.engine.kv_bytes_held() if self.engine is not None else 0

    def _jobs_by_status(self) -> dict:
        counts = {s: 0 for s in ("queued", "in_progress", "completed", "failed")}
        if self.store is not None:
            counts.update(self.store.counts_by_status())
        return counts

    def metrics_text(self) -> str:
        return self.registry.render()


def _retried(write):
    """`write()`, tried again after a short wait when it fails (SQLite busy or out of space for a moment)."""
    for wait in (*WRITE_RETRY_S, None):
        try:
            return write()
        except Exception:  # noqa: BLE001 - the last failure is raised
            if wait is None:
                raise
            time.sleep(wait)


def _storage_api_error(code: str, message: str) -> APIError:
    """507 (no room) or 503 (another storage fault), both with Retry-After: the client may try again later."""
    status = 507 if code == "storage_full" else 503
    return APIError(status, message, code=code, headers={"Retry-After": str(STORAGE_RETRY_AFTER_S)})


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise APIError(400, f"{name} must be in [{low}, {high}]; got {value}", param=name, code="invalid_value")


def stored_params(spec: GenerationSpec) -> dict:
    """The spec's parameters as the record keeps them (JSON): an image is kept as its size, a video as its frame
    count and size, not their pixels. A queued job with either is therefore not run again after a restart (its
    input lived in memory only)."""
    params = spec.params()
    options = params["options"]
    for name in ("image", "last_image"):
        if name in options:
            height, width = options.pop(name).shape[:2]
            options[name] = f"{width}x{height}"
    if "video" in options:
        frames, height, width = options.pop("video").shape[:3]
        options["video"] = f"{frames} frames {width}x{height}"
    return params


def checkpoint_fingerprint(model_dir, dtype: str, loras=()) -> str:
    """What identifies the served weights for `request_key`: every file's path, size and modification time under
    the checkpoint (a retrained or replaced checkpoint of the same name is another model), and the dtype; and the
    LoRA adapters loaded at start (`engine.lora.LoraAdapter`s): a request names one, so its file and start scale
    are part of what the name means."""
    root = Path(model_dir)
    files = sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                   for p in root.rglob("*") if p.is_file())
    adapters = [(a.name, a.scale, [(path, Path(path).stat().st_size, Path(path).stat().st_mtime_ns)
                                   for path in (a.path, a.path_2) if path is not None]) for a in loras]
    return hashlib.sha256(json.dumps([str(root.resolve()), dtype, files, *([adapters] if adapters else [])]
                                     ).encode()).hexdigest()


def request_key(checkpoint: str, spec: GenerationSpec, fps: int) -> str:
    """Two create requests with equal keys make the same video: the checkpoint, the prompt, every generation
    parameter with the seed, the fps, and the input images by their pixels' digest."""
    params = spec.params()
    options = params["options"]
    for name, value in list(options.items()):
        if hasattr(value, "shape") and hasattr(value, "tobytes"):       # an image (numpy array)
            options[name] = f"{value.dtype}:{tuple(value.shape)}:{hashlib.sha256(value.tobytes()).hexdigest()}"
    payload = {"checkpoint": checkpoint, "prompt": spec.prompt, "params": params, "fps": fps}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


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


__all__ = ["SERVE_ENGINE_DEFAULTS", "ServeConfig", "VideoService", "Limits", "Job"]
