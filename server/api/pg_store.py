"""The PostgreSQL job store (`--store postgresql://...`): the same rows as the SQLite store (`server/api/store.py`),
in one database that several `longserve serve` replicas share, through psycopg 3 and a connection pool.

The schema is versioned: `MIGRATIONS` are applied in order, each once, in one transaction under an advisory lock
(replicas starting together migrate once), and `longserve_schema` records the versions applied. A schema is chosen
the libpq way, in the URL: `postgresql://host/db?options=-csearch_path%3Dlongserve`.

The video files are not in the database: they live in the media store (`StoredFiles`, `server/api/media_store.py`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from longserve.server.api.store import (
    COLUMNS,
    StoredFiles,
    StoreUnavailable,
    VideoRecord,
    check_storable,
    dump_json,
    page_clause,
    record_from_row,
    safe_url,
)

#: advisory lock keys (with the schema's hash as the second key: replicas of one schema agree on them): migrations
MIGRATION_LOCK = 0x6C6F6E67          # "long"

#: (version, statements): applied in order, each version once (`longserve_schema`); never edit a released one
MIGRATIONS: list[tuple[int, tuple[str, ...]]] = [
    (1, ("""CREATE TABLE videos (
            seq           BIGSERIAL PRIMARY KEY,
            id            TEXT NOT NULL UNIQUE,
            created_at    BIGINT NOT NULL,
            completed_at  BIGINT,
            status        TEXT NOT NULL,
            progress      INTEGER NOT NULL DEFAULT 0,
            model         TEXT NOT NULL,
            prompt        TEXT NOT NULL,
            seconds       TEXT NOT NULL,
            size          TEXT NOT NULL,
            params        TEXT NOT NULL,
            error         TEXT,
            expires_at    BIGINT,
            expired       INTEGER NOT NULL DEFAULT 0,
            bytes         BIGINT,
            request_key   TEXT,
            extended_from TEXT,
            owner         TEXT)""",
         "CREATE INDEX videos_status ON videos(status, seq)",
         "CREATE INDEX videos_request_key ON videos(request_key)",
         "CREATE INDEX videos_owner ON videos(owner, seq)")),
    # leases: a queued job is claimed by one replica (lease_owner) until lease_until; each claim is an attempt and
    # takes a new fence, which that replica's writes must carry (`update(..., fence=)`)
    (2, ("ALTER TABLE videos ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0, ADD COLUMN fence BIGINT NOT NULL "
         "DEFAULT 0, ADD COLUMN lease_owner TEXT, ADD COLUMN lease_until TIMESTAMPTZ, ADD COLUMN cost DOUBLE "
         "PRECISION NOT NULL DEFAULT 1",
         "CREATE INDEX videos_claimable ON videos(model, seq) WHERE status = 'queued' AND lease_owner IS NULL",
         "CREATE INDEX videos_leased ON videos(lease_until) WHERE lease_owner IS NOT NULL")),
    # the live replicas: what each serves and its capacity (`heartbeat`; /v1/models, a create's model check)
    (3, ("CREATE TABLE replicas (id TEXT PRIMARY KEY, models TEXT[] NOT NULL, info TEXT NOT NULL DEFAULT '{}', "
         "heartbeat TIMESTAMPTZ NOT NULL)",)),
    # what clients change while the replicas run and all must share: webhook endpoints, LoRA adapters
    # (`server/api/settings_store.py`); the version row moves on every write (a replica polls one number)
    (4, ("CREATE TABLE longserve_settings (kind TEXT NOT NULL, id TEXT NOT NULL, owner TEXT, data TEXT NOT NULL, "
         "created_at BIGINT NOT NULL, seq BIGINT NOT NULL, PRIMARY KEY (kind, id))",
         "CREATE TABLE longserve_settings_version (one INTEGER PRIMARY KEY CHECK (one = 1), seq BIGINT NOT NULL)",
         "INSERT INTO longserve_settings_version VALUES (1, 0)")),
]

#: the retention and quota sweep: one replica of a schema sweeps at a time
SWEEP_LOCK = MIGRATION_LOCK + 1


log = logging.getLogger("longserve.server")

#: a database that answers but refuses us: waiting will not help (a wrong password, user or database name)
REFUSED = re.compile(r"authentication failed|role .* does not exist|database .* does not exist|no pg_hba\.conf entry|"
                     r"password authentication|SSL", re.I)


def wait_for_database(url: str, wait_s: float) -> None:
    """Connect once to `url`, trying again with backoff (0.5 s doubling, at most 8 s apart) while it does not answer,
    for up to `wait_s` seconds; a line is logged per failed try. StoreUnavailable naming --store when it never
    answers, or at once when it refuses (authentication, an unknown database)."""
    deadline = time.monotonic() + wait_s
    delay, tries = 0.5, 0
    while True:
        tries += 1
        remaining = deadline - time.monotonic()
        try:
            psycopg.connect(url, connect_timeout=max(2, min(10, int(remaining) + 1))).close()
            return
        except psycopg.Error as e:
            reason = " ".join(str(e).split())[:300] or type(e).__name__
            if REFUSED.search(reason):
                raise StoreUnavailable(f"the database refused the connection: {reason}") \
                    from None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreUnavailable(f"the database did not answer within --store-wait "
                                       f"{wait_s:g} s ({tries} tries; last: {reason})") from None
            log.warning("the job store %s does not answer (%s); trying again in %.1f s (gives up %.0f s from now)",
                        safe_url(url), reason, min(delay, remaining), remaining)
            time.sleep(min(delay, remaining))
            delay = min(8.0, delay * 2)


class LeaseLost(RuntimeError):
    """A replica's write under a fence that is no longer the job's: another replica claimed it since."""


_SELECT = f"SELECT {', '.join(COLUMNS)} FROM videos"
_WRITABLE = frozenset(COLUMNS) - {"seq", "id"}


def migrate(pool: ConnectionPool) -> list[int]:
    """Apply the migrations this database lacks (one transaction, under the advisory lock); the versions applied."""
    applied = []
    with pool.connection() as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(COALESCE(current_schema(), '')))", (MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS longserve_schema (version INTEGER PRIMARY KEY, "
                     "applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
        done = {row[0] for row in conn.execute("SELECT version FROM longserve_schema")}
        for version, statements in MIGRATIONS:
            if version in done:
                continue
            for statement in statements:
                conn.execute(statement)
            conn.execute("INSERT INTO longserve_schema (version) VALUES (%s)", (version,))
            applied.append(version)
    return applied


#: what a database that does not answer raises: refused or cut connections, a pool with none to give in time
UNREACHABLE = (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout)


class PostgresJobStore(StoredFiles):
    """Thread-safe: each call takes a connection from the pool (autocommit; a claim is its own transaction).

    `timeout_s` (`--store-timeout`) bounds how long a call waits for a connection (the pool's wait, and each new
    connection's connect timeout): a database that refuses or drops connections is `StoreUnavailable` within it,
    never a hang. A connection is checked when it is taken (one empty round trip), so one the database dropped
    is replaced, not failed on; and a failed reconnection gives up after about `timeout_s`, so the next call tries
    again at once: the pool recovers by itself seconds after the database is back. `unavailable` says why the last
    call failed, until one succeeds (`/health`'s reason). At start, `wait_s` (`--store-wait`) is how long a
    database that does not answer yet is tried again (`wait_for_database`)."""

    def __init__(self, url: str, data_dir, video_dir=None, pool_size: int = 8, objects=None,
                 timeout_s: float = 3.0, wait_s: float = 0.0):
        wait_for_database(url, wait_s)         # a database that is not up yet: bounded retries (--store-wait)
        super().__init__(data_dir, video_dir, objects)
        self.url = url
        self.timeout_s = float(timeout_s)
        self.unavailable: str | None = None
        self.failed_at: float | None = None      # time.monotonic() of the first failure of this outage
        try:                       # one connection first: its error says what is wrong (the pool's only "timeout")
            psycopg.connect(url, connect_timeout=max(2, round(self.timeout_s))).close()
        except psycopg.Error as e:
            raise StoreUnavailable(f"cannot connect: {first_line(e)}") from None
        self.pool = ConnectionPool(url, min_size=1, max_size=pool_size, open=False, name="longserve-store",
                                   kwargs={"autocommit": True, "connect_timeout": max(2, round(self.timeout_s))},
                                   timeout=self.timeout_s, reconnect_timeout=max(1.0, self.timeout_s),
                                   check=ConnectionPool.check_connection)
        try:
            self.pool.open(wait=True, timeout=max(5.0, 2 * self.timeout_s))
            self.migrated = migrate(self.pool)
        except BaseException as e:
            self.pool.close()
            if isinstance(e, UNREACHABLE):
                raise StoreUnavailable(f"cannot use the database: {first_line(e)}") from None
            raise

    def close(self) -> None:
        self.pool.close()

    def schema_version(self) -> int:
        return self._one("SELECT COALESCE(MAX(version), 0) FROM longserve_schema")[0]

    def ping(self) -> None:
        """One round trip (the health probe): StoreUnavailable when the database does not answer."""
        self._one("SELECT 1")

    # -- helpers ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _connection(self):
        """A pooled connection; what an unreachable database raises becomes StoreUnavailable (503)."""
        try:
            with self.pool.connection() as conn:
                yield conn
        except UNREACHABLE as e:
            if self.unavailable is None:
                self.failed_at = time.monotonic()
            self.unavailable = first_line(e) or type(e).__name__
            raise StoreUnavailable(f"the job store does not answer: {self.unavailable}") from None
        if self.unavailable is not None:
            self.unavailable = self.failed_at = None

    def _all(self, sql: str, args=()) -> list[tuple]:
        with self._connection() as conn:
            return conn.execute(sql, args).fetchall()

    def _one(self, sql: str, args=()) -> tuple | None:
        with self._connection() as conn:
            return conn.execute(sql, args).fetchone()

    def _run(self, sql: str, args=()) -> int:
        with self._connection() as conn:
            return conn.execute(sql, args).rowcount

    # -- rows (the SQLite store's interface) ----------------------------------------------------------

    def insert(self, rec: VideoRecord, cost: float = 1.0) -> int:
        check_storable(rec)
        row = self._one(
            "INSERT INTO videos (id, created_at, completed_at, status, progress, model, prompt, seconds, size, params,"
            " error, request_key, extended_from, owner, cost) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, "
            "%s, %s, %s) RETURNING seq",
            (rec.id, rec.created_at, rec.completed_at, rec.status, rec.progress, rec.model, rec.prompt, rec.seconds,
             rec.size, json.dumps(rec.params), dump_json(rec.error), rec.request_key, rec.extended_from, rec.owner,
             float(cost)))
        rec.seq = row[0]
        return rec.seq

    def update(self, video_id: str, fence: int | None = None, **fields) -> None:
        """With `fence`: only while that claim still holds the job (LeaseLost otherwise: another replica has it)."""
        if fence is None:
            self._run(*_update_sql(video_id, fields))
            return
        sql, args = _update_sql(video_id, fields, " AND fence = %s", (fence,))
        if fields.get("status") in ("completed", "failed"):       # the claim's last write lets the lease go
            sql = sql.replace("SET ", "SET lease_owner = NULL, lease_until = NULL, ", 1)
        if self._run(sql, args) == 0:
            raise LeaseLost(f"{video_id}: its lease (fence {fence}) was lost; another replica runs it")

    # -- leases (replicas) ---------------------------------------------------------------------------

    def claim(self, replica: str, models, budget: float, lease_s: float, idle: bool,
              look_ahead: int = 16) -> list[tuple[VideoRecord, int, int, float]]:
        """Claim queued jobs of `models`, oldest first, whose work fits `budget` (at least one when `idle`): each
        gets this replica's lease for `lease_s`, an attempt and a new fence. Rows another replica is claiming are
        skipped (FOR UPDATE SKIP LOCKED). Returns (record, fence, attempts, cost) of each."""
        with self._connection() as conn, conn.transaction():
            rows = conn.execute("SELECT id, cost FROM videos WHERE status = 'queued' AND lease_owner IS NULL AND "
                                "model = ANY(%s) ORDER BY seq LIMIT %s FOR UPDATE SKIP LOCKED",
                                (list(models), look_ahead)).fetchall()
            chosen, total = [], 0.0
            for video_id, cost in rows:
                if total + cost > budget and not (idle and not chosen):
                    break
                chosen.append(video_id)
                total += cost
            if not chosen:
                return []
            claimed = conn.execute(
                f"UPDATE videos SET lease_owner = %s, lease_until = now() + make_interval(secs => %s), "
                f"attempts = attempts + 1, fence = fence + 1 WHERE id = ANY(%s) RETURNING "
                f"{', '.join(COLUMNS)}, fence, attempts, cost", (replica, float(lease_s), chosen)).fetchall()
        n = len(COLUMNS)
        out = [(record_from_row(r[:n]), r[n], r[n + 1], r[n + 2]) for r in claimed]
        return sorted(out, key=lambda c: c[0].seq)

    def claim_now(self, video_id: str, replica: str, lease_s: float) -> int:
        """Claim one queued job for this replica at once (a job whose input lives in this process's memory); its
        fence."""
        row = self._one("UPDATE videos SET lease_owner = %s, lease_until = now() + make_interval(secs => %s), "
                        "attempts = attempts + 1, fence = fence + 1 WHERE id = %s AND lease_owner IS NULL "
                        "RETURNING fence", (replica, float(lease_s), video_id))
        if row is None:
            raise LeaseLost(f"{video_id} could not be claimed")
        return row[0]

    def renew(self, replica: str, fences: dict[str, int], lease_s: float) -> set[str]:
        """Extend this replica's leases of these jobs (id -> fence); the ids whose lease still held."""
        if not fences:
            return set()
        rows = self._all("UPDATE videos v SET lease_until = now() + make_interval(secs => %s) FROM "
                         "unnest(%s::text[], %s::bigint[]) AS h(id, fence) WHERE v.id = h.id AND v.fence = h.fence "
                         "AND v.lease_owner = %s RETURNING v.id",
                         (float(lease_s), list(fences), list(fences.values()), replica))
        return {r[0] for r in rows}

    def release(self, video_id: str, fence: int, **fields) -> bool:
        """A claim's last write: the fields, and the lease let go, only while `fence` holds; False otherwise."""
        sql, args = _update_sql(video_id, fields, " AND fence = %s", (fence,))
        sql = sql.replace("UPDATE videos SET ", "UPDATE videos SET lease_owner = NULL, lease_until = NULL, " if fields
                          else "UPDATE videos SET lease_owner = NULL, lease_until = NULL", 1)
        return self._run(sql, args) > 0

    def unclaim(self, video_id: str, fence: int) -> bool:
        """Give a claim back untried (its replica could not queue it): queued for any replica, the attempt undone."""
        return self._run("UPDATE videos SET lease_owner = NULL, lease_until = NULL, attempts = attempts - 1 WHERE id = "
                         "%s AND fence = %s AND status = 'queued'", (video_id, fence)) > 0

    def requeue_lapsed(self, max_attempts: int) -> tuple[list[str], list[str]]:
        """Jobs whose lease lapsed (their replica stopped renewing): queued again while they have attempts left,
        else failed (`replica_lost`). Returns (requeued ids, failed ids)."""
        with self._connection() as conn, conn.transaction():
            lapsed = conn.execute("SELECT id, attempts, fence FROM videos WHERE lease_owner IS NOT NULL AND "
                                  "lease_until < now() AND status IN ('queued', 'in_progress') FOR UPDATE SKIP LOCKED"
                                  ).fetchall()
            again = [i for i, attempts, _ in lapsed if attempts < max_attempts]
            lost = [i for i, attempts, _ in lapsed if attempts >= max_attempts]
            if again:
                conn.execute("UPDATE videos SET status = 'queued', progress = 0, lease_owner = NULL, lease_until = "
                             "NULL WHERE id = ANY(%s)", (again,))
            if lost:
                error = dump_json({"code": "replica_lost", "message": f"the replica running this video stopped "
                                                                  f"{max_attempts} times; it was not retried again"})
                conn.execute("UPDATE videos SET status = 'failed', lease_owner = NULL, lease_until = NULL, error = "
                             "%s, completed_at = EXTRACT(EPOCH FROM now())::bigint WHERE id = ANY(%s)", (error, lost))
        for video_id, _, fence in lapsed:          # what the lost claims wrote: their own files only
            self.remove_files(video_id, fence)
        return again, lost

    def lease_of(self, video_id: str) -> tuple[str | None, int, int] | None:
        """(lease owner, fence, attempts) of a job; None when there is no such job."""
        return self._one("SELECT lease_owner, fence, attempts FROM videos WHERE id = %s", (video_id,))

    def set_cost(self, video_id: str, cost: float) -> None:
        self._run("UPDATE videos SET cost = %s WHERE id = %s", (float(cost), video_id))

    def publish(self, video_id: str, fence: int, **fields) -> bool:
        """Complete a claim's video: while `fence` still holds the row (locked), its files `<id>.f<fence>.*` become
        `<id>.*` (`publish_files`: renamed, atomic on one file system; or put whole as objects) and the fields are
        written, the lease let go. False, with nothing published, when another claim holds the job. (A lapsed lease
        is not requeued while the row is locked: `requeue_lapsed` skips locked rows.)"""
        with self._connection() as conn, conn.transaction():
            row = conn.execute("SELECT fence FROM videos WHERE id = %s FOR UPDATE", (video_id,)).fetchone()
            if row is None or row[0] != fence:
                return False
            self.publish_files(video_id, fence)
            sql, args = _update_sql(video_id, fields, " AND fence = %s", (fence,))
            conn.execute(sql.replace("SET ", "SET lease_owner = NULL, lease_until = NULL, ", 1), args)
        self.published(video_id, fence)
        return True

    def existing(self, ids) -> set[str]:
        """Which of these jobs still have a record (a DELETE on any replica removes it)."""
        ids = list(ids)
        return {r[0] for r in self._all("SELECT id FROM videos WHERE id = ANY(%s)", (ids,))} if ids else set()

    def active_work(self, owner: str | None = None) -> float:
        """Work of the queued and running jobs of every replica (of `owner`, when given)."""
        sql = "SELECT COALESCE(SUM(cost), 0) FROM videos WHERE status IN ('queued', 'in_progress')"
        row = self._one(sql + " AND owner = %s", (owner,)) if owner is not None else self._one(sql)
        return float(row[0])

    def heartbeat(self, replica: str, models, info: dict) -> None:
        self._run("INSERT INTO replicas (id, models, info, heartbeat) VALUES (%s, %s, %s, now()) ON CONFLICT (id) "
                  "DO UPDATE SET models = EXCLUDED.models, info = EXCLUDED.info, heartbeat = now()",
                  (replica, list(models), json.dumps(info)))

    def live_replicas(self, within_s: float) -> list[tuple[str, list[str], dict]]:
        """(id, models, info) of the replicas that beat within `within_s` seconds."""
        rows = self._all("SELECT id, models, info FROM replicas WHERE heartbeat > now() - make_interval(secs => %s) "
                         "ORDER BY id", (float(within_s),))
        return [(i, list(models), json.loads(info)) for i, models, info in rows]

    def leave(self, replica: str) -> None:
        self._run("DELETE FROM replicas WHERE id = %s", (replica,))

    @contextlib.contextmanager
    def sweep_lock(self):
        """A context: True inside it for the one replica that sweeps now (a session advisory lock), else False."""
        with self._connection() as conn:
            held = conn.execute("SELECT pg_try_advisory_lock(%s, hashtext(COALESCE(current_schema(), '')))",
                                (SWEEP_LOCK,)).fetchone()[0]
            try:
                yield held
            finally:
                if held:
                    conn.execute("SELECT pg_advisory_unlock(%s, hashtext(COALESCE(current_schema(), '')))",
                                 (SWEEP_LOCK,))


    def delete(self, video_id: str) -> bool:
        return self._run("DELETE FROM videos WHERE id = %s", (video_id,)) > 0

    def completed_with_key(self, request_key: str, owner: str | None) -> VideoRecord | None:
        row = self._one(f"{_SELECT} WHERE request_key = %s AND owner IS NOT DISTINCT FROM %s AND status = "
                        f"'completed' AND expired = 0 ORDER BY seq DESC LIMIT 1", (request_key, owner))
        return record_from_row(row) if row else None

    def get(self, video_id: str) -> VideoRecord | None:
        row = self._one(f"{_SELECT} WHERE id = %s", (video_id,))
        return record_from_row(row) if row else None

    def page(self, after_seq: int | None, limit: int, order: str,
             owner: str | None = None) -> tuple[list[VideoRecord], bool]:
        where, direction, args = page_clause(after_seq, order, owner, "%s")
        rows = self._all(f"{_SELECT} {where} ORDER BY seq {direction} LIMIT %s", (*args, limit + 1))
        return [record_from_row(r) for r in rows[:limit]], len(rows) > limit

    def counts_by_status(self) -> dict[str, int]:
        return dict(self._all("SELECT status, COUNT(*) FROM videos GROUP BY status"))

    def expired(self, now: int) -> list[str]:
        return [r[0] for r in self._all("SELECT id FROM videos WHERE expires_at IS NOT NULL AND expires_at <= %s "
                                        "AND expired = 0 ORDER BY seq", (now,))]

    def stored(self) -> list[tuple[str, int, int | None]]:
        return [tuple(r) for r in self._all("SELECT id, COALESCE(bytes, 0), expires_at FROM videos WHERE status = "
                                            "'completed' AND expired = 0 ORDER BY completed_at, seq")]

    def unmeasured(self) -> list[str]:
        return [r[0] for r in self._all("SELECT id FROM videos WHERE status = 'completed' AND expired = 0 AND "
                                        "bytes IS NULL")]

    def by_status(self, status: str) -> list[VideoRecord]:
        return [record_from_row(r) for r in self._all(f"{_SELECT} WHERE status = %s ORDER BY seq", (status,))]


def first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _update_sql(video_id: str, fields: dict, where: str = "", args=()) -> tuple[str, tuple]:
    """UPDATE of a record's fields (JSON columns dumped), with more conditions after the id's."""
    unknown = set(fields) - _WRITABLE
    if unknown:
        raise ValueError(f"not a writable column of videos: {sorted(unknown)}")
    values = dict(fields)
    for name in ("error", "params"):
        if name in values:
            values[name] = dump_json(values[name])
    if "expired" in values:
        values["expired"] = int(values["expired"])
    sets = ", ".join(f"{k} = %s" for k in values)
    return f"UPDATE videos SET {sets} WHERE id = %s{where}", (*values.values(), video_id, *args)
