"""`JobLifecycle`: what a video job's transitions mean besides its record: one log line each (`server/api/logs.py`),
the metrics they move (`server/api/metrics.py`), and the webhooks of its end (`server/api/webhooks.py`).

    created   accepted (or reused: completed at once)        counter; line
    claimed   a replica took it from the shared store         line (attempt, fence)
    started   admitted: its denoising begins                  queue-wait histogram; line (queue_wait_s)
    progress  a denoising step, sampled                       line at most every 10 s and at each quarter
    frames    its first frames are decoded                    time-to-first-frame histogram
    finished  its MP4 is complete                             end-to-end and stage histograms; line; video.completed
    failed    with its error's code                           counter; line; video.failed
    cancelled deleted, released by a drain, or lost           counter; line

The parts call it where they see the transition (the service, the replica's claim cycle, the job's outputs); times
are kept on the job (`Job.times`), so a job followed by this process alone is measured from its creation here (a
claimed job from its record's creation time).
"""

from __future__ import annotations

import time

from longserve.server.api.logs import ProgressSampler, job_event


class JobLifecycle:
    """`metrics`: the service's `ServerMetrics`; `model`: the served model's name (the histograms' label);
    `replica`: a callable giving this replica's id (None without a shared store); `webhooks`: `Webhooks` or None."""

    def __init__(self, metrics, model: str, replica=lambda: None, webhooks=None):
        self.metrics, self.model, self.replica, self.webhooks = metrics, model, replica, webhooks

    def _line(self, event: str, job, **fields) -> None:
        job_event(event, job.id, job.owner, self.replica(), **fields)

    def created(self, job, spec=None) -> None:
        job.times.setdefault("created", time.time())
        self.metrics.created.inc()
        p = job.record.params if job.record is not None else {}
        self._line("created", job, cost=round(job.cost, 4), size=getattr(job.record, "size", None),
                   frames=p.get("num_frames"), steps=p.get("num_inference_steps"))

    def reused(self, job) -> None:
        self.metrics.created.inc()
        self.metrics.reused.inc()
        self.metrics.finished.labels(outcome="completed").inc()
        self._line("created", job, reused=True)
        self._line("finished", job, reused=True, e2e_s=0.0)
        self._webhook(job, "completed")

    def claimed(self, job, attempt: int, fence: int) -> None:
        job.times["created"] = float(job.record.created_at)
        self._line("claimed", job, attempt=attempt, fence=fence,
                   claim_wait_s=max(0.0, time.time() - job.record.created_at))

    def started(self, job, num_steps: int, admissions: int) -> None:
        now = time.time()
        job.times["admitted"] = now
        wait = now - job.times.get("created", now)
        if admissions == 1:               # a requeued job's second admission is not a queue wait of a new job
            self.metrics.queue_wait.labels(model=self.model).observe(wait)
        job.sampler = ProgressSampler()
        self._line("started", job, queue_wait_s=wait, steps=num_steps, admission=admissions)

    def step(self, job, step: int, num_steps: int, batch_size: int) -> None:
        sampler = getattr(job, "sampler", None)
        if sampler is not None and sampler.due(step, num_steps):
            self._line("progress", job, step=step, steps=num_steps, batch=batch_size,
                       elapsed_s=time.time() - job.times.get("admitted", time.time()))

    def frames(self, job) -> None:
        if "first_frame" not in job.times:
            job.times["first_frame"] = now = time.time()
            self.metrics.first_frame.labels(model=self.model).observe(now - job.times.get("created", now))

    def requeued(self, job) -> None:
        self.metrics.requeued.inc()
        job.times.pop("first_frame", None)
        self._line("requeued", job)

    def finished(self, job, timings: dict) -> None:
        now = time.time()
        e2e = now - job.times.get("created", now)
        self.metrics.finished.labels(outcome="completed").inc()
        self.metrics.e2e.labels(model=self.model).observe(e2e)
        stages = {"encode": timings.get("encode_s"), "denoise": timings.get("transformer_s"),
                  "decode": timings.get("vae_s"), "mux": job.times.get("mux_s")}
        for stage, seconds in stages.items():
            if seconds is not None:
                self.metrics.stage.labels(model=self.model, stage=stage).observe(seconds)
        self._line("finished", job, e2e_s=e2e, first_frame_s=_since(job, "first_frame"),
                   queue_wait_s=_between(job, "created", "admitted"),
                   **{f"{k}_s": v for k, v in stages.items() if v is not None})
        self._webhook(job, "completed")

    def failed(self, job, code: str, message: str) -> None:
        self.metrics.finished.labels(outcome="failed").inc()
        now = time.time()
        self._line("failed", job, code=code, e2e_s=now - job.times.get("created", now), reason=message[:200])
        self._webhook(job, "failed")

    def cancelled(self, job, reason: str) -> None:
        self.metrics.finished.labels(outcome="cancelled").inc()
        self._line("cancelled", job, reason=reason)

    def _webhook(self, job, status: str) -> None:
        if self.webhooks is not None:
            self.webhooks.video_event(job.id, job.owner, status)


def _since(job, mark: str) -> float | None:
    return _between(job, "created", mark)


def _between(job, a: str, b: str) -> float | None:
    if a in job.times and b in job.times:
        return job.times[b] - job.times[a]
    return None
