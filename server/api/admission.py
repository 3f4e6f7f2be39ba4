"""One admission gate for every job the server takes: HTTP create, HTTP extend and a live session.

In order: 503 `server_shutdown` while draining; 507 `storage_full` below `--min-free-bytes` (for videos,
which are written to disk); then work. A job's cost is frames x height x width x steps relative to the
model's default request (its default frames, size and steps; with a model's sound, its sound's tokens by the
seconds it lasts, `request_cost`), so the default request costs 1 and the most
expensive one the limits allow costs (max_frames / default_frames) x (max_size^2 / default area) x
(max_steps / default_steps). A live session counts like any other job: its frames are its longest length
(`--max-live-seconds`) in whole chunks. A job that would push the work of every active job (the registry,
`server/api/jobs.py`) past `--max-queued-work` gets 429 `queue_full` with Retry-After, as would one that
pushes its API key's past `--max-work-per-key` (`key_work_limit`). A job is always admitted when nothing
else is active (of its key, for the per-key limit): a request within the limits can always run eventually.

The check and the registration happen under the registry's lock, so two requests never both take the last
room; the work is freed when the job leaves the registry (it ended, or was deleted). With replicas the same check
counts every replica's videos and live sessions in the shared store, and the check and the insert are one
transaction under an advisory lock (`server/api/pg_admission.py`): one accounting path on every store.
"""

from __future__ import annotations

import math

from longserve.engine.images import input_bytes
from longserve.server.api.errors import APIError
from longserve.server.api.jobs import LIVE, Job, JobRegistry

SHUTDOWN_RETRY_AFTER_S = 10


def request_cost(limits, num_frames: int, width: int, height: int, steps: int, fps: int | None = None) -> float:
    """Work of one request in default requests (the default request of `limits` costs 1): its transformer tokens
    times its steps. A model's video tokens are its frames x pixels (over `pixels_per_token`); a model that makes
    sound (LTX-2) has its sound's tokens too, seconds x `sound_tokens_per_second`, so the same frames at a lower
    `fps` (more seconds of sound) cost more."""
    def tokens(frames: int, w: int, h: int, at_fps: int) -> float:
        return frames * w * h / limits.pixels_per_token + frames / at_fps * limits.sound_tokens_per_second

    default = tokens(limits.default_frames, limits.default_width, limits.default_height, limits.fps)
    return tokens(num_frames, width, height, fps or limits.fps) * steps / (default * limits.default_steps)


def input_cost(limits, nbytes: int) -> float:
    """What a job's inputs (an image's file, a video's frames: `engine.images.input_bytes`) hold in the server's
    memory while it waits, in default requests: bytes over the default request's video, frames x W x H x 3 (so a
    queue of inputs is bounded by --max-queued-work like a queue of work)."""
    return nbytes / (limits.default_frames * limits.default_width * limits.default_height * 3)


def job_cost(limits, spec, frames_per_chunk: int = 0) -> float:
    """A checked request's admission cost: its work (`request_cost`; a live session's in whole chunks of
    `frames_per_chunk` frames, 0 for a video) plus what its inputs hold while it waits (`input_cost`)."""
    frames = spec.num_frames
    if frames_per_chunk:                             # a session runs whole chunks
        frames = math.ceil(frames / frames_per_chunk) * frames_per_chunk
    return request_cost(limits, frames, spec.width, spec.height, spec.num_inference_steps, spec.fps) + \
        input_cost(limits, input_bytes(getattr(spec, "options", None) or {}))


def most_expensive_cost(limits) -> float:
    """The cost of the largest request the limits allow (at 1 fps, for a model whose sound is longer the lower
    the fps)."""
    return request_cost(limits, limits.max_frames, limits.max_size, limits.max_size, limits.max_steps,
                        fps=1 if limits.sound_tokens_per_second else None)


class AdmissionGate:
    """`storage`: the store side (`check_room`); `shutdown`: the drain (`draining`); `frames_per_chunk`: a live
    session's chunk, in frames (0 for a model without live sessions)."""

    def __init__(self, jobs: JobRegistry, storage, shutdown, limits, max_work: float | None,
                 max_work_per_key: float | None, frames_per_chunk: int = 0, retry_after_s: int = 5):
        self.jobs, self.storage, self.shutdown, self.limits = jobs, storage, shutdown, limits
        self.max_work = max_work
        self.max_work_per_key = max_work_per_key
        self.frames_per_chunk = frames_per_chunk
        self.retry_after_s = retry_after_s
        #: with replicas: the shared store's ledger of every replica's work (`pg_admission.SharedLedger`), set by
        #: `server/api/replicas.py`; None: this server's registry is all the work there is
        self.shared = None

    def check_open(self, writes_files: bool = True) -> None:
        """503 while shutting down; 507 while the data dir's disk is below --min-free-bytes (`writes_files`)."""
        if self.shutdown.draining:
            raise APIError(503, "the server is shutting down and takes no new videos; retry on another server or "
                                "after its restart", code="server_shutdown",
                           headers={"Retry-After": str(SHUTDOWN_RETRY_AFTER_S)})
        if writes_files:
            self.storage.check_room()

    def cost(self, spec, kind: str) -> float:
        """`job_cost` of a job of `kind` (what a door's `Accepted.cost` holds: `VideoRequests`)."""
        return job_cost(self.limits, spec, self.frames_per_chunk if kind == LIVE else 0)

    def admit(self, job: Job, here: bool = True) -> None:
        """Let `job` in if its cost fits (429 naming the limit otherwise), and register it when it runs `here`.
        With replicas it is stored in the same step: a video's record (`job.record`: queued for any replica, or
        claimed by this one when `here`), a live session's row."""
        if self.shared is None:
            with self.jobs.lock:
                self._check(job.cost, job.owner, self.jobs.work)
                self.jobs.add(job)
            return
        self.shared.admit(job, lambda work_of: self._check(job.cost, job.owner, work_of), here)
        if here:
            self.jobs.add(job)

    def release(self, job: Job) -> None:
        """A job admitted here ended (a live session: a video's record ends with its status)."""
        if self.shared is not None:
            self.shared.release(job)

    def _check(self, cost: float, key: str | None, work_of) -> None:
        if self.max_work is not None:
            total = work_of(None)
            if total > 0 and total + cost > self.max_work:
                raise APIError(429, f"the server's queue is full of work: this request costs {cost:.3g} default "
                                    f"requests and {total:.3g} are queued or running, the limit is "
                                    f"{self.max_work:g} (--max-queued-work); retry later, or ask for fewer frames, "
                                    f"pixels or steps", code="queue_full",
                               headers={"Retry-After": str(self.retry_after_s)})
        if self.max_work_per_key is not None and key is not None:
            mine = work_of(key)
            if mine > 0 and mine + cost > self.max_work_per_key:
                raise APIError(429, f"this API key has {mine:.3g} default requests of work queued or running and "
                                    f"this request costs {cost:.3g}; the limit per key is {self.max_work_per_key:g} "
                                    f"(--max-work-per-key); retry when one of its videos has finished",
                               code="key_work_limit", headers={"Retry-After": str(self.retry_after_s)})
