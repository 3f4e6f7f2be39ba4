"""`VideoStorage`: the store side of the video service: records that survive a failed write, retention, the quota
and the data dir's free space, over the SQLite job store and its files (`server/api/store.py`).

Storage faults fail a job, never hang it, and never lose a record: a record's change is applied in memory
first (what clients read), then written to SQLite with retries; one that still fails is kept here, served
from memory (`record`, `page`), and written again by the housekeeping task. New videos are refused (507)
while the data dir's file system has less than `--min-free-bytes` free, and /health says `degraded`
(`problem`) until writes go through again.

Retention (`--retention`): a finished video's files expire at `expires_at`; the sweep deletes them and marks
the record `expired` (it stays readable). The quotas (`--max-storage-bytes` per owner, `--max-total-storage-bytes`:
`server/api/quota.py`) evict completed videos' files the same way, an owner's own first.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from typing import Callable

from longserve.server.api.config import safe_url
from longserve.server.api.errors import APIError
from longserve.server.api.media_store import media_dir, open_objects
from longserve.server.api.quota import StorageQuota
from longserve.server.api.store import ANY_OWNER, SqliteJobStore, StoreUnavailable, VideoRecord
from longserve.server.media import storage_error_code

log = logging.getLogger("longserve.server")

#: waits between the tries of a SQLite write before it is kept for the housekeeping task to write again
WRITE_RETRY_S = (0.05, 0.25)
#: seconds a client is told to wait (Retry-After) when there is no room
STORAGE_RETRY_AFTER_S = 30


class VideoStorage:
    """The job store with write retries, retention, the quota and free space. `busy(video_id)`: the job is still
    active (its files are not the sweep's); `on_expired()`: one video's files expired (the metric)."""

    def __init__(self, config, io, busy: Callable[[str], bool], on_expired: Callable[[], None] = lambda: None):
        self.config = config                      # the ServeConfig: data_dir, retention_s, quota, min_free_bytes
        self.store = open_store(config)
        self.io = io
        self.busy, self.on_expired = busy, on_expired
        self._lock = threading.RLock()
        self._pending: dict[str, tuple[VideoRecord, dict]] = {}   # records SQLite has not taken yet, fields to write
        self.replicated = hasattr(self.store, "claim")  # a store replicas share (PostgreSQL): jobs are claimed
        self.error: str | None = None              # the last failed write, until a write succeeds again
        self.free_bytes: int | None = None         # the data dir's free space, as last measured
        self.quotas = StorageQuota(self.store, config.max_storage_bytes, config.max_total_storage_bytes,
                                   busy=busy, expire=self._expire_at)

    def close(self) -> None:
        self.store.close()

    # -- free space and faults -----------------------------------------------------------------------

    def measure_free(self) -> int:
        try:
            self.free_bytes = self.store.free_bytes()
        except OSError as e:
            log.warning("measuring the free space of %s failed: %s", self.store.data_dir, e)
            self.free_bytes = 0
        return self.free_bytes

    def failed(self, message: str) -> None:
        """A write failed (health's reason until writes go through again)."""
        if self.error is None:
            log.error("storage: %s", message)
        self.error = message
        self.measure_free()

    def check_room(self) -> None:
        """507 while the data dir's file system has less than --min-free-bytes free."""
        floor = self.config.min_free_bytes
        if floor and self.measure_free() < floor:
            raise storage_api_error("storage_full", f"the server's disk is nearly full ({self.free_bytes} bytes "
                                                    f"free, below {floor}); no new videos until space is freed")

    def problem(self) -> str | None:
        """Why the server's storage is degraded (health's reason), None while it is fine."""
        floor, free = self.config.min_free_bytes, self.free_bytes
        problems = []
        if floor and free is not None and free < floor:
            problems.append(f"{free} bytes free in {self.store.data_dir}, below --min-free-bytes ({floor}): new "
                            f"videos are refused")
        unreachable = getattr(self.store, "unavailable", None)
        if unreachable is not None:
            problems.append(f"the job store does not answer ({unreachable}): requests that need it get 503 "
                            f"storage_unavailable")
        if self.error is not None:
            problems.append(f"a write failed: {self.error}")
        if self._pending:
            problems.append(f"{len(self._pending)} job record(s) wait to be written to the database")
        return "; ".join(problems) or None

    # -- records ---------------------------------------------------------------------------------------

    def insert(self, rec: VideoRecord, what: str = "the job", cost: float = 1.0) -> None:
        """Store a new record (retried); a storage fault is answered 507 or 503 naming `what`."""
        try:
            retried(lambda: self.store.insert(rec, cost))
        except Exception as e:
            code = storage_error_code(e)
            if code is None:
                raise
            self.failed(f"storing {what} failed: {e}")
            raise storage_api_error(code, f"{what} could not be stored ({e})") from None

    def record(self, video_id: str) -> VideoRecord | None:
        """A record as clients see it: the one waiting in memory for SQLite, else SQLite's."""
        with self._lock:
            pending = self._pending.get(video_id)
        return pending[0] if pending is not None else self.store.get(video_id)

    def page(self, after_seq: int | None, limit: int, order: str,
             owner: str | None = None) -> tuple[list[VideoRecord], bool]:
        records, has_more = self.store.page(after_seq, limit, order, owner)
        with self._lock:
            return [self._pending[r.id][0] if r.id in self._pending else r for r in records], has_more

    async def save(self, rec: VideoRecord, fields: dict, fence: int | None = None) -> bool:
        """Write fields of a record to SQLite, tried again after a failure (a full disk, a locked database); what
        still fails is kept, served from memory, for the housekeeping task to write. Never raises. With `fence` (a
        replica's claim of the job): False when the claim was lost (nothing written: another replica has it)."""
        with self._lock:
            pending = {**self._pending.pop(rec.id, (rec, {}))[1], **fields}     # in order: later fields win
        loop = asyncio.get_running_loop()
        fenced = {} if fence is None else {"fence": fence}
        for wait in (*WRITE_RETRY_S, None):
            try:
                await loop.run_in_executor(self.io, lambda: self.store.update(rec.id, **fenced, **pending))
                if not self._pending:
                    self.error = None              # writes go through again
                return True
            except Exception as e:  # noqa: BLE001 - sqlite3 and OS errors alike
                if type(e).__name__ == "LeaseLost":
                    log.warning("%s", e)
                    return False
                if wait is None:
                    with self._lock:
                        self._pending[rec.id] = (rec, {**pending, **self._pending.get(rec.id, (rec, {}))[1]})
                    self.failed(f"writing the record of {rec.id} failed: {e}")
                    return True
                await asyncio.sleep(wait)

    def flush_pending(self) -> None:
        """(the io thread) Write the records SQLite could not take before."""
        with self._lock:
            pending = dict(self._pending)
        for video_id, (_, fields) in pending.items():
            try:
                self.store.update(video_id, **dict(fields))
            except Exception as e:  # noqa: BLE001
                self.failed(f"writing the record of {video_id} failed: {e}")
                return
            with self._lock:
                if video_id in self._pending and self._pending[video_id][1] == fields:
                    del self._pending[video_id]
        if not self._pending:
            log.info("storage: the pending job records are written")
            self.error = None

    def delete(self, video_id: str) -> None:
        """The record goes (retried; a storage fault is answered 507 or 503), and any write of it still pending."""
        try:
            retried(lambda: self.store.delete(video_id))
        except Exception as e:
            code = storage_error_code(e)
            if code is None:
                raise
            raise storage_api_error(code, f"video {video_id!r} could not be deleted ({e}); retry later") from None
        with self._lock:
            self._pending.pop(video_id, None)

    def recover(self) -> list[VideoRecord]:
        """Jobs left by a previous run on this data dir: the interrupted fail (their partial state lived in
        worker memory), partial files go; returns the queued ones, in their order, to queue again. A replica of a
        shared store leaves the jobs to the leases (a running one is another replica's, or lapses and is queued
        again) and returns none: they are claimed."""
        if self.replicated:
            self.store.sweep_tmp()
            return []
        for rec in self.store.by_status("in_progress"):
            self.store.remove_files(rec.id)
            self.finish_record(rec, status="failed", error={
                "code": "server_restarted",
                "message": "the server stopped while this video was being generated (its partial state lived in "
                           "worker memory); create it again"})
        for path in self.store.video_dir.glob("*.part"):
            path.unlink(missing_ok=True)
        self.store.sweep_tmp()                            # uploads a killed process was decoding
        for video_id in self.store.unmeasured():          # kept from before sizes were recorded (the quota's)
            self.store.update(video_id, bytes=self.store.files_bytes(video_id))
        return self.store.by_status("queued")

    def finish_record(self, rec: VideoRecord, **fields) -> None:
        """A record's end written at once (recovery at start), with its expiry."""
        self.store.update(rec.id, **fields, expires_at=self.expiry(int(time.time())))

    def reuse(self, key: str, rec: VideoRecord) -> VideoRecord | None:
        """`rec` completed at once with the files of the newest completed video made by a request with `key` (hard
        links), of `rec.owner`'s videos only; None when there is none or its files are gone. The record is stored
        (507/503 on a fault)."""
        source = self.store.completed_with_key(key, rec.owner)
        if source is None:
            return None
        try:
            linked = self.store.link_files(source.id, rec.id)
        except FileNotFoundError:           # expired or deleted since the lookup
            return None
        if linked:                          # one copy on disk: the quota counts it once
            rec.content = source.content or source.id
        rec.prompt, rec.seconds, rec.size, rec.params = source.prompt, source.seconds, source.size, dict(source.params)
        rec.status, rec.progress, rec.completed_at = "completed", 100, rec.created_at
        try:
            self.insert(rec, "the reused video")
            fields = dict(expires_at=self.expiry(rec.created_at), bytes=source.bytes)
            retried(lambda: self.store.update(rec.id, **fields))
        except Exception as e:
            self.store.remove_files(rec.id)
            code = storage_error_code(e)
            if code is None or isinstance(e, APIError):
                raise
            self.failed(f"storing a reused video failed: {e}")
            raise storage_api_error(code, f"the video could not be stored ({e})") from None
        rec.expires_at, rec.bytes = fields["expires_at"], fields["bytes"]
        log.info("%s: an identical request to %s; its content reused, nothing generated", rec.id, source.id)
        return source

    # -- retention and quota -----------------------------------------------------------------------------

    def expiry(self, finished_at: int) -> int | None:
        r = self.config.retention_s
        return None if r is None else finished_at + math.ceil(r)

    def expire(self, now: int | None = None) -> list[str]:
        """Delete the files of the finished videos whose expires_at has passed and mark their records expired
        (GET still answers; content says video_expired); returns their ids."""
        now = int(time.time()) if now is None else now
        gone = []
        for video_id in self.store.expired(now):
            if self.busy(video_id):
                continue                   # still being finished: its next sweep
            self._expire_files(video_id)
            gone.append(video_id)
        return gone

    def enforce_quota(self, owner=ANY_OWNER) -> list[str]:
        """The quotas (`server/api/quota.py`): `owner`'s (every owner's by default), then the total cap. Returns
        the ids evicted."""
        return self.quotas.enforce(owner)

    def make_room(self, owner, nbytes: int) -> None:
        """Room in `owner`'s quota for `nbytes` of uploads (its own oldest videos evicted); 507 storage_quota when
        its active jobs' uploads alone are over it."""
        if not self.quotas.make_room(owner, nbytes):
            raise APIError(507, f"this API key's active jobs keep more uploads than its storage quota "
                                f"(--max-storage-bytes {self.config.max_storage_bytes}) allows; retry when one has "
                                f"finished", param="input_reference", code="storage_quota",
                           headers={"Retry-After": str(STORAGE_RETRY_AFTER_S)})

    def _expire_at(self, video_id: str, now: int) -> None:
        self._expire_files(video_id, expires_at=now)

    def _expire_files(self, video_id: str, **fields) -> None:
        self.store.remove_files(video_id)
        self.store.update(video_id, expired=True, **fields)
        self.on_expired()
        log.info("expired %s", video_id)

    def sweep(self) -> None:
        """Retention, then the quota; with a shared store, by one replica at a time (an advisory lock: the quota
        counts every replica's videos, and two sweepers would evict twice)."""
        if not self.replicated:
            self.expire()
            self.enforce_quota()
            return
        with self.store.sweep_lock() as mine:
            if mine:
                self.expire()
                self.enforce_quota()

    def quota(self, owner=ANY_OWNER) -> list[str]:
        """`enforce_quota` (of `owner`), by one replica at a time with a shared store (a replica that finds the
        lock taken leaves it to the one sweeping)."""
        if not self.quotas.on:
            return []
        if not self.replicated:
            return self.enforce_quota(owner)
        with self.store.sweep_lock() as mine:
            return self.enforce_quota(owner) if mine else []

    def stored_bytes(self) -> int:
        return self.quotas.stored_bytes()

    async def housekeeping(self) -> None:
        """Every second: write the records SQLite could not take; every few seconds: measure the free space;
        at every half retention (at most a minute): expire old videos and apply the quota."""
        retention = self.config.retention_s
        sweep_s = 60.0 if retention is None else max(1.0, min(60.0, retention / 2))
        last_sweep = last_free = last_trim = float("-inf")
        loop = asyncio.get_running_loop()
        ping = getattr(self.store, "ping", None)
        while True:
            now = time.monotonic()
            try:
                if ping is not None:       # /health's view of the database; a reachable one lets the pool reconnect
                    await loop.run_in_executor(self.io, ping)
                if self._pending:
                    await loop.run_in_executor(self.io, self.flush_pending)
                if now - last_free >= 2.0:
                    last_free = now
                    await loop.run_in_executor(self.io, self.measure_free)
                    if now - last_trim >= 60.0:             # an object store's cache of videos served here
                        last_trim = now
                        await loop.run_in_executor(self.io, self.store.trim_cache)
                if now - last_sweep >= sweep_s:
                    last_sweep = now
                    await loop.run_in_executor(self.io, self.sweep)
            except StoreUnavailable:       # /health says so (`problem`); the next round tries again
                pass
            except Exception as e:  # noqa: BLE001 - the next round tries again
                log.exception("housekeeping failed")
                if storage_error_code(e) is not None:
                    self.failed(str(e))
            await asyncio.sleep(1.0)


def open_store(config):
    """The job store a `ServeConfig` names: PostgreSQL for `--store postgresql://...` (replicas share it), else the
    SQLite file under `--data-dir`. Videos go to `--media-store` (a shared directory, or object storage) when
    given."""
    video_dir = media_dir(config.media_store)
    url = config.store
    if url and url.split(":", 1)[0] in ("postgresql", "postgres"):
        from longserve.server.api.pg_store import PostgresJobStore

        try:
            return PostgresJobStore(url, config.data_dir, video_dir, objects=open_objects(config.media_store),
                                    timeout_s=config.store_timeout_s, wait_s=getattr(config, "store_wait_s", 0.0))
        except StoreUnavailable as e:        # at start: one line naming the flag (the CLI prints ValueErrors)
            raise ValueError(f"--store {safe_url(url)}: {e}") from None
    return SqliteJobStore(config.data_dir, video_dir)


def retried(write):
    """`write()`, tried again after a short wait when it fails (SQLite busy or out of space for a moment)."""
    for wait in (*WRITE_RETRY_S, None):
        try:
            return write()
        except StoreUnavailable:        # the pool already waited --store-timeout: answer now (503)
            raise
        except Exception:  # noqa: BLE001 - the last failure is raised
            if wait is None:
                raise
            time.sleep(wait)


def storage_api_error(code: str, message: str) -> APIError:
    """507 (no room) or 503 (another storage fault), both with Retry-After: the client may try again later."""
    status = 507 if code == "storage_full" else 503
    return APIError(status, message, code=code, headers={"Retry-After": str(STORAGE_RETRY_AFTER_S)})
