"""The PostgreSQL job store (`--store postgresql://...`): the same rows as the SQLite store (`server/api/store.py`),
in one database that several `longserve serve` replicas share, through psycopg 3 and a connection pool.

The schema is versioned: `MIGRATIONS` are applied in order, each once, in one transaction under an advisory lock
(replicas starting together migrate once), and `longserve_schema` records the versions applied. A schema is chosen
the libpq way, in the URL: `postgresql://host/db?options=-csearch_path%3Dlongserve`.

The video files are not in the database: they live in the media store (`StoredFiles`, `server/api/media_store.py`).
What only replicas do with the rows (claims, leases, publication, the live replicas) is `pg_leases.ReplicaRows`; the
admission over every replica's work is `pg_admission.SharedLedger`.
"""

from __future__ import annotations

import contextlib
import time

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from longserve.server.api.pg_leases import LeaseLost, ReplicaRows, update_sql
from longserve.server.api.store import (
    INSERTED,
    StoredFiles,
    StoreUnavailable,
    VideoRecord,
    VideoRows,
    check_storable,
    inserted_values,
)
from longserve.server.api.store_wait import wait_for_database

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
    # storage per owner (a reuse's shared files counted once, uploads counted while their job is active), and the
    # live sessions every replica's admission counts (each renewed by its replica; a lapsed one counts no more)
    (4, ("ALTER TABLE videos ADD COLUMN content TEXT, ADD COLUMN input_bytes BIGINT NOT NULL DEFAULT 0",
         "CREATE INDEX videos_kept ON videos(owner, completed_at) WHERE status = 'completed' AND expired = 0",
         "CREATE TABLE sessions (id TEXT PRIMARY KEY, owner TEXT, cost DOUBLE PRECISION NOT NULL, replica TEXT NOT "
         "NULL, lease_until TIMESTAMPTZ NOT NULL)")),
    # what clients change while the replicas run and all must share: webhook endpoints, LoRA adapters
    # (`server/api/settings_store.py`); the version row moves on every write (a replica polls one number)
    (5, ("CREATE TABLE longserve_settings (kind TEXT NOT NULL, id TEXT NOT NULL, owner TEXT, data TEXT NOT NULL, "
         "created_at BIGINT NOT NULL, seq BIGINT NOT NULL, PRIMARY KEY (kind, id))",
         "CREATE TABLE longserve_settings_version (one INTEGER PRIMARY KEY CHECK (one = 1), seq BIGINT NOT NULL)",
         "INSERT INTO longserve_settings_version VALUES (1, 0)")),
]

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


class PostgresJobStore(ReplicaRows, VideoRows, StoredFiles):
    """The rows' queries are the SQLite store's (`VideoRows`, with psycopg's placeholder). Thread-safe: each call
    takes a connection from the pool (autocommit; a claim is its own transaction).

    `timeout_s` (`--store-timeout`) bounds how long a call waits for a connection (the pool's wait, and each new
    connection's connect timeout): a database that refuses or drops connections is `StoreUnavailable` within it,
    never a hang. A connection is checked when it is taken (one empty round trip), so one the database dropped
    is replaced, not failed on; and a failed reconnection gives up after about `timeout_s`, so the next call tries
    again at once: the pool recovers by itself seconds after the database is back. `unavailable` says why the last
    call failed, until one succeeds (`/health`'s reason). At start, `wait_s` (`--store-wait`) is how long a
    database that does not answer yet is tried again (`wait_for_database`)."""

    MARK = "%s"
    SAME = "IS NOT DISTINCT FROM"

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

    @contextlib.contextmanager
    def transaction(self):
        """A connection in a transaction (committed when the block ends, rolled back when it raises)."""
        with self._connection() as conn, conn.transaction():
            yield conn

    def execute(self, sql: str, args=()) -> int:
        """One statement of the store's own SQL (its modules': `pg_admission.py`); the rows it touched."""
        return self._run(sql, args)

    def _all(self, sql: str, args=()) -> list[tuple]:
        with self._connection() as conn:
            return conn.execute(sql, args).fetchall()

    def _one(self, sql: str, args=()) -> tuple | None:
        with self._connection() as conn:
            return conn.execute(sql, args).fetchone()

    def _run(self, sql: str, args=()) -> int:
        with self._connection() as conn:
            return conn.execute(sql, args).rowcount

    # -- writes (the reads are `VideoRows`') ----------------------------------------------------------

    def insert(self, rec: VideoRecord, cost: float = 1.0, conn=None, lease: tuple[str, float] | None = None) -> int:
        """Store a new record with its work (`cost`); in `conn`'s transaction when given (admission's); with `lease`
        (replica, seconds) claimed at once by that replica (its fence, 1, is the record's `fence`)."""
        check_storable(rec)
        names, values = [*INSERTED, "cost"], [*inserted_values(rec), float(cost)]
        marks = ["%s"] * len(names)
        if lease is not None:
            names += ["lease_owner", "lease_until", "attempts", "fence"]
            values += [lease[0], float(lease[1]), 1, 1]
            marks += ["%s", "now() + make_interval(secs => %s)", "%s", "%s"]
        sql = f"INSERT INTO videos ({', '.join(names)}) VALUES ({', '.join(marks)}) RETURNING seq"
        if conn is not None:
            rec.seq = conn.execute(sql, values).fetchone()[0]
        else:
            rec.seq = self._one(sql, values)[0]
        return rec.seq

    def update(self, video_id: str, fence: int | None = None, **fields) -> None:
        """With `fence`: only while that claim still holds the job (LeaseLost otherwise: another replica has it)."""
        if fence is None:
            self._run(*update_sql(video_id, fields))
            return
        sql, args = update_sql(video_id, fields, " AND fence = %s", (fence,))
        if fields.get("status") in ("completed", "failed"):       # the claim's last write lets the lease go
            sql = sql.replace("SET ", "SET lease_owner = NULL, lease_until = NULL, ", 1)
        if self._run(sql, args) == 0:
            raise LeaseLost(f"{video_id}: its lease (fence {fence}) was lost; another replica runs it")


def first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
