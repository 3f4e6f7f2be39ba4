"""Cost-aware admission: the video queue is bounded by work, not only by count.

A request's cost is frames x height x width x steps relative to the model's default request
(its default frames, size and `--default-steps`), so the default request costs 1 and the most
expensive one the limits allow costs (max_frames / default_frames) x (max_size^2 / default
area) x (max_steps / default_steps). A create that would push the work of every queued and
running video past `--max-queued-work` gets 429 with Retry-After, as would one that pushes
its API key's past `--max-work-per-key`. A request is always admitted when nothing else is
queued or running (of its key, for the per-key limit): a request within the limits can
always run eventually.

The counting lives beside the video service, not in it: a reservation is taken before the
service's `create`, named by the video it made, and ends when that video is no longer
queued or in progress (read from the service at the next admission). Live sessions are
not counted here: `--live-kv-budget` bounds them.
"""

from __future__ import annotations

import threading

from server.api.errors import APIError

ACTIVE = ("queued", "in_progress")


def request_cost(limits, num_frames: int, width: int, height: int, steps: int) -> float:
    """Work of one request in default requests (the default request of `limits` costs 1)."""
    default = limits.default_frames * limits.default_width * limits.default_height * limits.default_steps
    return num_frames * width * height * steps / default


def most_expensive_cost(limits) -> float:
    return request_cost(limits, limits.max_frames, limits.max_size, limits.max_size, limits.max_steps)


class WorkAdmission:
    def __init__(self, videos, max_work: float | None, max_work_per_key: float | None, retry_after_s: int = 5):
        self.videos = videos
        self.max_work = max_work
        self.max_work_per_key = max_work_per_key
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._work: dict[str, tuple[float, str | None]] = {}   # video id (or a pending token) -> (cost, key)
        self._pending = 0
        for rec in videos.store.by_status("queued") if videos.store is not None else ():
            p = rec.params                                       # re-queued by a restart: counted, never refused
            self._work[rec.id] = (request_cost(videos.limits, p["num_frames"], p["width"], p["height"],
                                               p["num_inference_steps"]), None)

    @property
    def enabled(self) -> bool:
        return self.max_work is not None or self.max_work_per_key is not None

    def cost(self, req) -> float:
        """The cost of a create request, with the service's own resolution of its defaults (400s naming the
        field come from there)."""
        spec, _ = self.videos.resolve(req)
        return request_cost(self.videos.limits, spec.num_frames, spec.width, spec.height, spec.num_inference_steps)

    def work(self, key: str | None = None) -> float:
        """Queued plus running work (of `key`, when given)."""
        with self._lock:
            self._forget_ended()
            return sum(c for c, k in self._work.values() if key is None or k == key)

    def create(self, req, key: str | None = None):
        """`videos.create(req)` if its cost fits (429 otherwise); blocking, run it in a thread."""
        if not self.enabled:
            return self.videos.create(req)
        self.videos.check_admission()
        spec, fps = self.videos.resolve(req)
        return self._admit(spec, key, lambda: self.videos.submit(spec, fps, seeded=req.seed is not None))

    def extend(self, video_id: str, req, key: str | None = None):
        """`videos.extend(video_id, req)` if its cost fits, as `create`."""
        if not self.enabled:
            return self.videos.extend(video_id, req)
        self.videos.check_admission()
        spec, fps, source = self.videos.resolve_extension(video_id, req)
        return self._admit(spec, key, lambda: self.videos.submit(spec, fps, extended_from=source,
                                                                 seeded=req.seed is not None))

    def _admit(self, spec, key: str | None, submit):
        """Reserve the cost of a resolved request (resolved once: an upload is decoded once), then `submit()`."""
        cost = request_cost(self.videos.limits, spec.num_frames, spec.width, spec.height, spec.num_inference_steps)
        with self._lock:
            self._forget_ended()
            self._check(cost, key)
            self._pending += 1
            token = f"pending-{self._pending}"
            self._work[token] = (cost, key)
        try:
            video = submit()
        finally:
            with self._lock:
                del self._work[token]
        with self._lock:
            if video.status in ACTIVE:
                self._work[video.id] = (cost, key)
        return video

    def _check(self, cost: float, key: str | None) -> None:
        total = sum(c for c, _ in self._work.values())
        if self.max_work is not None and total > 0 and total + cost > self.max_work:
            raise APIError(429, f"the server's queue is full of work: this request costs {cost:.3g} default "
                                f"requests and {total:.3g} are queued or running, the limit is {self.max_work:g} "
                                f"(--max-queued-work); retry later, or ask for fewer frames, pixels or steps",
                           code="queue_full", headers={"Retry-After": str(self.retry_after_s)})
        if self.max_work_per_key is not None and key is not None:
            mine = sum(c for c, k in self._work.values() if k == key)
            if mine > 0 and mine + cost > self.max_work_per_key:
                raise APIError(429, f"this API key has {mine:.3g} default requests of work queued or running and "
                                    f"this request costs {cost:.3g}; the limit per key is {self.max_work_per_key:g} "
                                    f"(--max-work-per-key); retry when one of its videos has finished",
                               code="key_work_limit", headers={"Retry-After": str(self.retry_after_s)})

    def _forget_ended(self) -> None:
        """Drop the reservations of videos that are no longer queued or in progress (finished or deleted)."""
        for video_id in [v for v in self._work if not v.startswith("pending-")]:
            try:
                status = self.videos.record(video_id).status
            except APIError:                    # deleted
                status = "deleted"
            if status not in ACTIVE:
                del self._work[video_id]
