"""`ServerMetrics`: `/metrics` through `prometheus_client`, every metric of the server defined here (one place, as
vLLM's `vllm/v1/metrics` does); the parts only observe.

- **Latency histograms**, labelled by model, observed on the coordinator from each job's typed outputs (the workers'
  stage times come back in them): `longserve_queue_wait_seconds` (created -> admitted: its denoising starts),
  `longserve_time_to_first_frame_seconds` (created -> its first frames decoded), `longserve_e2e_latency_seconds`
  (created -> the MP4 complete), `longserve_stage_seconds{stage=encode|denoise|decode|mux}` (a completed video's
  prompt encode, transformer steps, VAE decode, and the MP4 encode after its last frames).
- **The cluster's work**, read from the store at every scrape: `longserve_cluster_jobs{status=queued|in_progress}`
  and `longserve_cluster_work{status=...}` (in default requests, admission's unit), every replica's on PostgreSQL:
  the metric to scale on (docs/serving.md, "Metrics").
- The engine's and this replica's gauges (queue depth, running requests, live sessions, KV cache, workers), step
  histograms, and the job counters.

Each service has its own registry (several servers in one process, as the tests run them, keep their numbers
apart). Only this process observes: the workers report through the engine's outputs, not to Prometheus. Should a
deployment run the app in several processes with `PROMETHEUS_MULTIPROC_DIR` set, the counters and histograms are
written to that directory by prometheus_client and `render` adds them up (`MultiProcessCollector`).
"""

from __future__ import annotations

import os
import re
from typing import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

prometheus_client.disable_created_metrics()      # no `_created` series beside every counter and histogram

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
#: seconds: a tiny model's request on a CPU takes a second, a long video on GPUs tens of minutes
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
STAGES = ("encode", "denoise", "decode", "mux")


class CallbackGauges:
    """Gauges read from callbacks at scrape time (a prometheus_client collector): one number, or {labels: value}."""

    def __init__(self):
        self._gauges: list[tuple[str, str, Callable, tuple[str, ...]]] = []

    def add(self, name: str, help_text: str, read: Callable[[], float | dict], labels: tuple[str, ...] = ()) -> None:
        self._gauges.append((name, help_text, read, labels))

    def describe(self):
        return [GaugeMetricFamily(n, h, labels=list(lb) or None) for n, h, _, lb in self._gauges]

    def collect(self):
        for name, help_text, read, labels in self._gauges:
            family = GaugeMetricFamily(name, help_text, labels=list(labels) or None)
            value = read()
            if isinstance(value, dict):
                for key, v in sorted(value.items()):
                    family.add_metric(list(key) if isinstance(key, tuple) else [str(key)], float(v))
            else:
                family.add_metric([], float(value))
            yield family


class ServerMetrics:
    """The job registry and the server's health (`ServerHealth`: /health/ready's answer) from the start; the
    engine, the storage side and the replica set by the server's start as each exists (None until then: their
    gauges read 0)."""

    def __init__(self, jobs, health):
        self.jobs, self.health = jobs, health
        self.engine = self.storage = self.replica = None
        self._last: dict = {}                 # the store's gauges as last read
        r = self.registry = CollectorRegistry()
        g = self.gauges = CallbackGauges()
        r.register(g)
        g.add("longserve_queue_depth", "Video requests waiting to be admitted.", lambda: self._stat("waiting"))
        g.add("longserve_running_requests", "Admitted video requests (denoising or decoding).",
              lambda: self._stat("running"))
        g.add("longserve_live_sessions", "Open live sessions (WebSocket /v1/videos/live).",
              lambda: self.jobs.count("live"))
        g.add("longserve_kv_cache_bytes", "KV cache held per worker by causal-model requests (counted against "
              "--live-kv-budget; freed when a request ends).",
              lambda: self.engine.kv_bytes_held() if self.engine is not None else 0)
        g.add("longserve_batch_size", "Requests in the most recent denoising step.",
              lambda: self._stat("last_batch_size"))
        g.add("longserve_jobs", "Video jobs in the store, by status.", self._jobs_by_status, ("status",))
        g.add("longserve_cluster_jobs", "Jobs not finished in the whole cluster (every replica's, from the shared "
              "store; this server's with SQLite), by status.",
              lambda: self._from_store("cluster", self._cluster, ({}, {}))[0], ("status",))
        g.add("longserve_cluster_work", "Work of the jobs not finished in the whole cluster, in default requests (the "
              "admission's unit; a replica takes --max-batch of it), by status: the metric to scale replicas on.",
              lambda: self._from_store("cluster", self._cluster, ({}, {}))[1], ("status",))
        g.add("longserve_stored_video_bytes", "Bytes of the completed videos kept (--max-storage-bytes counts these).",
              lambda: self._from_store("stored", lambda: self.storage.stored_bytes(), 0))
        g.add("longserve_disk_free_bytes", "Free bytes on the data dir's file system, as last measured.",
              lambda: (self.storage.free_bytes or 0) if self.storage is not None else 0)
        g.add("longserve_worker_restarts", "Worker pool restarts since the server started.",
              lambda: self._stat("restarts"))
        g.add("longserve_workers_ready", "1 while the worker pool is up.",
              lambda: 1 if self._stat("workers_ready") else 0)
        g.add("longserve_ready", "1 while /health/ready answers 200 (loaded, warm, workers up, store fine).",
              lambda: 1 if self.health.started and self.health.health()[0] == 200 else 0)
        g.add("longserve_replica_claimed_jobs", "Jobs this replica claimed from the shared store, by replica "
              "(--store postgresql://; none with the SQLite store).", lambda: self._replica("claimed"), ("replica",))
        g.add("longserve_replica_work", "Work of this replica's active jobs in default requests, by replica.",
              lambda: self._replica("work"), ("replica",))
        g.add("longserve_loras", "LoRA adapters this server has loaded (at start and over POST /v1/loras).",
              lambda: len(self.engine.config.loras) if self.engine is not None else 0)
        self.batch = Histogram("longserve_step_batch_size", "Requests per denoising step.",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.step_latency = Histogram("longserve_step_latency_seconds", "Wall time of one denoising step.",
                                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                      registry=r)
        self.queue_wait = Histogram("longserve_queue_wait_seconds", "A video's wait from its creation to its "
                                    "admission (its denoising starts), by model.", ["model"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.first_frame = Histogram("longserve_time_to_first_frame_seconds", "From a video's creation to its first "
                                     "decoded frames (streamed from then on), by model.", ["model"],
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("longserve_e2e_latency_seconds", "From a video's creation to its complete MP4, by model.",
                             ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.stage = Histogram("longserve_stage_seconds", "A completed video's time in each stage: encode (the "
                               "prompt), denoise (the transformer's steps), decode (the VAE), mux (the MP4 encode "
                               "after the last frames), by model and stage.", ["model", "stage"],
                               buckets=LATENCY_BUCKETS, registry=r)
        self.created = Counter("longserve_jobs_created", "Video jobs accepted.", registry=r)
        self.finished = Counter("longserve_jobs_finished", "Video jobs finished, by outcome.", ["outcome"], registry=r)
        self.requeued = Counter("longserve_jobs_requeued", "Admitted jobs queued again after a worker pool restart.",
                                registry=r)
        self.reused = Counter("longserve_jobs_reused", "Video jobs completed at once with a stored video's content "
                              "(an identical request with an explicit seed; --reuse-completed).", registry=r)
        self.expired = Counter("longserve_jobs_expired", "Finished videos whose files were deleted (retention ran "
                               "out, or the storage quota evicted them); their records stay, marked expired.",
                               registry=r)
        self.webhooks = Counter("longserve_webhook_deliveries", "Webhook deliveries, by outcome (delivered: a 2xx "
                                "within the attempts; failed: none).", ["outcome"], registry=r)

    # -- reads ----------------------------------------------------------------------------------------------

    def _stat(self, name: str):
        engine = self.engine
        return getattr(engine.stats(), name) if engine is not None else 0

    def _replica(self, name: str) -> dict:
        replica = self.replica
        return {} if replica is None else {replica.id: replica.describe()[name]}

    def _jobs_by_status(self) -> dict:
        counts = {s: 0 for s in ("queued", "in_progress", "completed", "failed")}
        counts.update(self._from_store("by_status", lambda: self.storage.store.counts_by_status(), {}))
        return counts

    def _from_store(self, name: str, read, default):
        """A gauge read from the job store; while it does not answer, the value last read (/metrics still answers;
        /health says why the store is degraded)."""
        storage = self.storage
        if storage is None:
            return default
        if getattr(storage.store, "unavailable", None) is not None:     # known down: no wait for the pool
            return self._last.get(name, default)
        try:
            self._last[name] = read()
        except Exception:  # noqa: BLE001 - StoreUnavailable, or the database's own error during an outage
            pass
        return self._last.get(name, default)

    def _cluster(self) -> tuple[dict, dict]:
        """({status: jobs}, {status: work}) of the queued and running jobs: the shared store's (every replica's),
        else this server's registry."""
        jobs = {"queued": 0, "in_progress": 0}
        work = {"queued": 0.0, "in_progress": 0.0}
        store = self.storage.store
        if getattr(store, "pool", None) is not None:
            with store._connection() as conn:    # the store's own: an outage is its StoreUnavailable
                for status, n, cost in conn.execute("SELECT status, COUNT(*), COALESCE(SUM(cost), 0) FROM videos "
                                                    "WHERE status IN ('queued', 'in_progress') GROUP BY status"):
                    jobs[status], work[status] = n, float(cost)
            return jobs, work
        for job in self.jobs.jobs("video"):
            status = "queued" if job.record is None or job.record.status == "queued" else "in_progress"
            jobs[status] += 1
            work[status] += job.cost
        return jobs, work

    # -- the engine's listener --------------------------------------------------------------------------------

    def on_batch(self, step) -> None:
        """The engine's batch listener (its thread): one denoising step of a batch."""
        self.batch.observe(step.batch_size)
        self.step_latency.observe(step.step_s)

    def render(self) -> bytes:
        """The exposition text: this registry, or with PROMETHEUS_MULTIPROC_DIR every process's files with the
        gauges read here."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged)
            merged.register(self.gauges)
            return generate_latest(merged)
        return generate_latest(self.registry)


_LE = re.compile(r'le="([^"]+)"')


def parse_text(text: str) -> dict[str, float]:
    """Exposition text -> {"name{labels}": value} (for tests and `bench serve`); a bucket's bound is written as a
    number reads (`le="1"`, not prometheus_client's `le="1.0"`)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        key = _LE.sub(lambda m: f'le="{m.group(1) if m.group(1) == "+Inf" else format(float(m.group(1)), "g")}"',
                      key)
        out[key] = float(value.replace("+Inf", "inf"))
    return out
