"""`Replica`: one `longserve serve` process among several that share a PostgreSQL store (`--store postgresql://`)
and a media store (`--media-store file://` or `s3://`). Its one job is the claim cycle, on the runner's loop every
`TICK_S`:

    create      any replica stores the job queued, with its work (`cost`), after admission over every replica's
                queued and running work (`--max-queued-work` is the service's); no engine is touched
    claim       each replica claims queued jobs of the models it serves, oldest first, while its own active work
                is under its budget (`--max-batch` default requests; one job at least when idle):
                FOR UPDATE SKIP LOCKED, so two replicas never claim one job. A claim is an attempt and a new
                fence; the job then runs here as any job does (the engine's step-level batching)
    renew       every third of `--lease-seconds`; a lease that did not renew (its record deleted, or it lapsed and
                another replica claimed it) ends the job here at its next step
    deleted     every tick: a job here whose record is gone (a DELETE on any replica) ends at its next step
    lapsed      every second: jobs whose lease lapsed (their replica was killed, lost its connection, hung) go
                back to the queue, or fail `replica_lost` after `--max-attempts` claims
    heartbeat   every second: this replica's models and capacity (`replicas`: /v1/models, /health, a create's
                model check)

A job with an uploaded input (an image, a video to extend) has its input put in the shared media store
(`server/api/job_inputs.py`) before it is stored, and is claimed like any job; the claiming replica reads the input
back. Without a shared media store (`--media-store`) such a job is claimed by the replica that took it at once
(`hold`) and fails `replica_lost` if its lease lapses: no other replica has its input.

Writes of a claimed job carry its fence (`PostgresJobStore.update`): a replica that lost its lease cannot write the
record, its files are its own (`<id>.f<fence>.*`), and completion renames them to `<id>.*` in the same transaction
that checks the fence and marks the record completed (`publish`), so a completed record always points at complete
files and at most one claim completes a job.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from longserve.engine.request import GenerationSpec
from longserve.engine.scheduler import QueueFullError
from longserve.server.api.errors import APIError, StoreUnavailable
from longserve.server.api.job_inputs import INPUTS, pack_inputs, read_inputs
from longserve.server.api.jobs import LIVE, VIDEO, Job
from longserve.server.api.remote_jobs import RemoteJobs

log = logging.getLogger("longserve.server")

TICK_S = 0.2
#: options whose value is an upload (`reuse.stored_params` keeps their shape; the media store their files)
IN_MEMORY = INPUTS


def attach_replica(config, model_name: str, storage, admission, requests, jobs, runner, shutdown, outputs,
                   lifecycle, broker, adapter_loading) -> "Replica | None":
    """A started server's replica, claiming (None when its store is not shared): admission then counts every
    replica's work, and the request door sends a model served elsewhere there. The parts are the server's
    (`VideoService`'s composition: config, storage side, admission gate, request door, job registry and runner,
    drain, video outputs, job lifecycle, event broker); `adapter_loading(name)`: is that LoRA adapter being loaded
    here (a claim that names it waits for it)."""
    if not storage.replicated:
        return None
    from longserve.server.api.pg_admission import SharedLedger

    replica = Replica(config, model_name, storage, admission, requests, jobs, runner, shutdown, outputs, lifecycle,
                      broker, adapter_loading)
    admission.shared = replica.ledger = SharedLedger(storage.store, replica.id, replica.lease_s,
                                                     whole=config.max_queued_work is not None)
    requests.elsewhere = replica.check_model
    runner.spawn(replica.run())
    return replica


class Replica:
    """A started server's claim cycle on a shared store (`VideoStorage.replicated`); the parts: `attach_replica`."""

    def __init__(self, config, model_name: str, storage, admission, requests, jobs, runner, shutdown, outputs,
                 lifecycle, broker, adapter_loading):
        self.model_name, self.storage, self.admission, self.requests = model_name, storage, admission, requests
        self.jobs, self.runner, self.shutdown, self.outputs = jobs, runner, shutdown, outputs
        self.lifecycle, self.broker, self.adapter_loading = lifecycle, broker, adapter_loading
        cfg = config
        self.store = storage.store
        self.id = cfg.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self.lease_s = float(cfg.lease_seconds)
        self.max_attempts = cfg.max_attempts
        self.budget = float(cfg.engine.max_batch)       # active work this replica claims up to, in default requests
        # and at most a batch and one more waiting (never past the engine's queue): what is not about to run stays
        # in the shared queue for the other replicas
        self.max_jobs = cfg.engine.max_batch + 1
        if cfg.engine.max_queue is not None:
            self.max_jobs = max(1, min(self.max_jobs, cfg.engine.max_queue))
        self.claimed = 0
        self.claim_latency_s: list[float] = []           # created -> claimed, of the jobs this replica claimed
        self.closed = False
        self.ledger = None                               # its admission's ledger (`attach_replica`)
        # the jobs other replicas run, as clients here follow them
        self.remote = RemoteJobs(self.store, runner, broker, jobs)
        self._store_down = False

    @property
    def models(self) -> list[str]:
        return [self.model_name]

    # -- the doors the service uses --------------------------------------------------------------------

    def enqueue(self, job: Job, spec: GenerationSpec) -> bool:
        """Store a create for whichever replica claims it (True), its uploaded inputs first in the shared media
        store; False for a job with uploaded inputs when there is no shared media store (the service runs it here
        and calls `hold` once it is stored)."""
        uploads = set(IN_MEMORY) & set(spec.options or {})
        if uploads and not self.store.shared:
            return False
        if uploads:
            files = pack_inputs(spec.options)
            job.record.input_bytes = sum(len(data) for data in files.values())
            self.storage.make_room(job.owner, job.record.input_bytes)     # its owner's quota counts them
            try:
                self.store.put_inputs(job.id, files)
            except Exception as e:
                self.storage.failed(f"storing the inputs of {job.id} failed: {e}")
                raise APIError(503, f"the job's input could not be stored ({e}); retry later",
                               code="storage_error", headers={"Retry-After": "30"}) from None
        try:               # 429 past the work of every replica; stored in the same transaction
            self.admission.admit(job, here=False)
        except BaseException:
            if uploads:
                self.store.remove_inputs(job.id)
            raise
        return True

    def check_model(self, model: str) -> None:
        """A model not served here: 400 naming `model`, saying which live replicas serve it, if any (a request is
        created on a replica serving its model: its defaults and checks are that model's)."""
        serving = sorted(r for r, models, _ in self.live() if model in models)
        if not serving:
            raise APIError(400, f"model {model!r} is served by no live replica; served: "
                                f"{', '.join(self.live_models()) or 'none'}", param="model", code="model_not_found")
        raise APIError(400, f"model {model!r} is served by replica(s) {', '.join(serving)}, not this one "
                            f"({self.id}); send the request to one of them", param="model", code="model_elsewhere")

    def live(self) -> list[tuple[str, list[str], dict]]:
        return self.store.live_replicas(max(3.0, self.lease_s))

    def live_models(self) -> list[str]:
        return sorted({m for _, models, _ in self.live() for m in models} | set(self.models))

    def describe(self) -> dict:
        """This replica's capacity (/health; the heartbeat): what a router chooses by."""
        jobs = self.jobs
        return {"id": self.id, "models": self.models, "work": round(jobs.work(), 4), "budget": self.budget,
                "running": jobs.count(VIDEO), "claimed": self.claimed, "live_sessions": jobs.count("live"),
                "draining": self.shutdown.draining, "claim_p50_s": median(self.claim_latency_s[-1000:])}

    # -- the cycle ----------------------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        io = self.runner.io
        last_beat = last_renew = last_lapse = float("-inf")
        while not self.closed:
            now = time.monotonic()
            try:
                if now - last_beat >= 1.0:
                    last_beat = now
                    await loop.run_in_executor(io, lambda: self.store.heartbeat(self.id, self.models,
                                                                                self.describe()))
                if now - last_lapse >= 1.0:
                    last_lapse = now
                    await loop.run_in_executor(io, self.requeue_lapsed)
                if now - last_renew >= self.lease_s / 3:
                    last_renew = now
                    await self.renew(loop, io)
                await self.drop_deleted(loop, io)
                if not self.shutdown.draining:
                    for claim in await loop.run_in_executor(io, self.claim):
                        self.start(*claim)
                self._store_down = False
            except asyncio.CancelledError:
                raise
            except StoreUnavailable as e:      # said once an outage (and by /health); the next tick tries again
                if not self._store_down:
                    log.warning("replica %s: the claim cycle waits for the job store: %s", self.id, e)
                self._store_down = True
            except Exception:  # noqa: BLE001 - the database may be away for a moment: the next tick tries again
                log.exception("replica %s: the claim cycle failed", self.id)
            await asyncio.sleep(TICK_S)

    def claim(self) -> list:
        jobs = self.jobs
        work, count = jobs.work(), jobs.count(VIDEO)
        if count and (work >= self.budget or count >= self.max_jobs):
            return []
        claims = self.store.claim(self.id, self.models, self.budget - work, self.lease_s, idle=count == 0,
                                  look_ahead=self.max_jobs - count)
        return [(*claim, self.inputs_of(claim[0])) for claim in claims]

    def inputs_of(self, rec) -> dict | None:
        """(the io thread) A claimed job's uploaded inputs, read back from the media store: {} for a job without
        any, None when they cannot be had (the job fails)."""
        try:
            return read_inputs(self.store, rec)
        except Exception as e:  # noqa: BLE001 - an unreadable input fails its job, never the claim cycle
            log.warning("replica %s: the inputs of %s could not be read: %s", self.id, rec.id, e)
            return None

    def requeue_lapsed(self) -> None:
        again, lost = self.store.requeue_lapsed(self.max_attempts)
        if again or lost:
            log.warning("replica %s: lapsed leases: %d job(s) queued again, %d failed", self.id, len(again),
                        len(lost))

    def start(self, rec, fence: int, attempts: int, cost: float, inputs: dict | None = None) -> None:
        """Run a claimed job here, as the service runs any job (`inputs`: its uploads, read back; None: they are
        gone)."""
        self.claimed += 1
        self.claim_latency_s.append(max(0.0, time.time() - rec.created_at))
        if inputs is None:
            self._fail(rec, fence, "its input (an image, or the video it extends) was held in the memory of the "
                                   "replica that took the request, which stopped, or could not be read from the "
                                   "media store; create it again")
            return
        job = Job(rec.id, VIDEO, cost, rec.owner, record=rec, sink=self.outputs, fence=fence)
        self.lifecycle.claimed(job, attempts, fence)
        self.jobs.add(job)
        try:
            self.runner.launch(job, self.requests.stored(rec, inputs))
        except QueueFullError:
            self.store.unclaim(rec.id, fence)          # another replica, or this one later
            return
        except ValueError as e:
            self.jobs.remove(job)                   # (refused before it was launched: still registered)
            if getattr(e, "field", None) == "lora" and any(self.adapter_loading(a["name"])
                                                           for a in rec.params.get("lora") or []):
                self.store.unclaim(rec.id, fence)      # an adapter this replica is still loading: another, or later
                return
            self._fail(rec, fence, str(e))

    def _fail(self, rec, fence: int, message: str) -> None:
        self.store.update(rec.id, fence=fence, status="failed", completed_at=int(time.time()),
                          error={"code": "replica_lost", "message": message},
                          expires_at=self.storage.expiry(int(time.time())))
        if self.store.shared:                   # what is left of its uploads: it never runs again
            self.store.remove_inputs(rec.id)

    def _mine(self) -> dict[str, Job]:
        return {j.id: j for j in self.jobs.jobs(VIDEO)     # (a finished one lets its lease go itself)
                if j.fence is not None and j.record.status not in ("completed", "failed")}

    async def renew(self, loop, io) -> None:
        mine = self._mine()
        sessions = [j.id for j in self.jobs.jobs(LIVE)]
        await loop.run_in_executor(io, self.ledger.renew, sessions)      # counted by every replica's admission
        held = await loop.run_in_executor(io, lambda: self.store.renew(self.id, {i: j.fence for i, j in mine.items()},
                                                                       self.lease_s))
        for video_id in set(mine) - held:
            log.warning("replica %s: the lease of %s was lost; it stops here", self.id, video_id)
            self.outputs.lost(mine[video_id])

    async def drop_deleted(self, loop, io) -> None:
        mine = self._mine()
        if not mine:
            return
        present = await loop.run_in_executor(io, lambda: self.store.existing(mine))
        for video_id in set(mine) - present:
            self.outputs.lost(mine[video_id])
            self.lifecycle.cancelled(mine[video_id], "deleted")
            self.broker.publish(video_id, "video.deleted", {"id": video_id, "object": "video.deleted",
                                                                    "deleted": True})

    # -- any replica answers for any job: events and streams of a job that runs on another ------------------

    def watch(self, video_id: str) -> None:
        """An SSE subscriber here for a job that is not: the job's one watcher on this replica publishes its
        changes to every subscriber here, until it ends or they all leave (`remote_jobs.py`)."""
        if self.jobs.get(video_id) is None:
            self.remote.watch(video_id)

    async def remote_writer(self, video_id: str, disconnected):
        """The file (or object pieces) another replica writes for a running job (`?stream=true` here), once it
        exists; None when the job ends first, runs here, or the client leaves (`RemoteJobs.writer`)."""
        return await self.remote.writer(video_id, disconnected)

    def close(self) -> None:
        """Stop claiming and leave the live replicas (the jobs still here lapse and are queued again)."""
        self.closed = True
        try:
            self.store.leave(self.id)
            self.ledger.leave()
        except Exception:  # noqa: BLE001 - the database may be gone; the heartbeat lapses anyway
            log.exception("replica %s: leaving failed", self.id)


def median(values: list[float]) -> float | None:
    return sorted(values)[len(values) // 2] if values else None
