"""The PostgreSQL job store (`--store postgresql://...`): the same rows as the SQLite store (`server/api/store.py`),
in one database that several `longserve serve` replicas share, through psycopg 3 and a connection pool.

The schema is versioned: `MIGRATIONS` are applied in order, each once, in one transaction under an advisory lock
(replicas starting together migrate once), and `longserve_schema` records the versions applied. A schema is chosen
the libpq way, in the URL: `postgresql://host/db?options=-csearch_path%3Dlongserve`.

The video files are not in the database: they live in the media store (`StoredFiles`, `server/api/media_store.py`).
"""

from __future__ import annotations

import json

from psycopg_pool import ConnectionPool

from longserve.server.api.store import _COLUMNS, StoredFiles, VideoRecord, _dump, _record, check_storable

#: pg_advisory_xact_lock key of schema migrations (any constant: replicas of one database agree on it)
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
]

_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM videos"
_WRITABLE = frozenset(_COLUMNS) - {"seq", "id"}


def migrate(pool: ConnectionPool) -> list[int]:
    """Apply the migrations this database lacks (one transaction, under the advisory lock); the versions applied."""
    applied = []
    with pool.connection() as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
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


class PostgresJobStore(StoredFiles):
    """Thread-safe: each call takes a connection from the pool (autocommit; a claim is its own transaction)."""

    def __init__(self, url: str, data_dir, video_dir=None, pool_size: int = 8):
        super().__init__(data_dir, video_dir)
        self.url = url
        self.pool = ConnectionPool(url, min_size=1, max_size=pool_size, kwargs={"autocommit": True}, open=False,
                                   name="longserve-store")
        self.pool.open(wait=True, timeout=30)
        try:
            self.migrated = migrate(self.pool)
        except BaseException:
            self.pool.close()
            raise

    def close(self) -> None:
        self.pool.close()

    def schema_version(self) -> int:
        return self._one("SELECT COALESCE(MAX(version), 0) FROM longserve_schema")[0]

    # -- helpers ---------------------------------------------------------------------------------

    def _all(self, sql: str, args=()) -> list[tuple]:
        with self.pool.connection() as conn:
            return conn.execute(sql, args).fetchall()

    def _one(self, sql: str, args=()) -> tuple | None:
        with self.pool.connection() as conn:
            return conn.execute(sql, args).fetchone()

    def _run(self, sql: str, args=()) -> int:
        with self.pool.connection() as conn:
            return conn.execute(sql, args).rowcount

    # -- rows (the SQLite store's interface) ----------------------------------------------------------

    def insert(self, rec: VideoRecord) -> int:
        check_storable(rec)
        row = self._one(
            "INSERT INTO videos (id, created_at, completed_at, status, progress, model, prompt, seconds, size, params,"
            " error, request_key, extended_from, owner) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, "
            "%s) RETURNING seq",
            (rec.id, rec.created_at, rec.completed_at, rec.status, rec.progress, rec.model, rec.prompt, rec.seconds,
             rec.size, json.dumps(rec.params), _dump(rec.error), rec.request_key, rec.extended_from, rec.owner))
        rec.seq = row[0]
        return rec.seq

    def update(self, video_id: str, **fields) -> None:
        self._run(*_update_sql(video_id, fields))

    def delete(self, video_id: str) -> bool:
        return self._run("DELETE FROM videos WHERE id = %s", (video_id,)) > 0

    def completed_with_key(self, request_key: str, owner: str | None) -> VideoRecord | None:
        row = self._one(f"{_SELECT} WHERE request_key = %s AND owner IS NOT DISTINCT FROM %s AND status = "
                        f"'completed' AND expired = 0 ORDER BY seq DESC LIMIT 1", (request_key, owner))
        return _record(row) if row else None

    def get(self, video_id: str) -> VideoRecord | None:
        row = self._one(f"{_SELECT} WHERE id = %s", (video_id,))
        return _record(row) if row else None

    def page(self, after_seq: int | None, limit: int, order: str,
             owner: str | None = None) -> tuple[list[VideoRecord], bool]:
        op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        conditions, args = [], []
        if after_seq is not None:
            conditions.append(f"seq {op} %s")
            args.append(after_seq)
        if owner is not None:
            conditions.append("owner = %s")
            args.append(owner)
        where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
        rows = self._all(f"{_SELECT} {where} ORDER BY seq {direction} LIMIT %s", (*args, limit + 1))
        return [_record(r) for r in rows[:limit]], len(rows) > limit

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
        return [_record(r) for r in self._all(f"{_SELECT} WHERE status = %s ORDER BY seq", (status,))]


def _update_sql(video_id: str, fields: dict, where: str = "", args=()) -> tuple[str, tuple]:
    """UPDATE of a record's fields (JSON columns dumped), with more conditions after the id's."""
    unknown = set(fields) - _WRITABLE
    if unknown:
        raise ValueError(f"not a writable column of videos: {sorted(unknown)}")
    values = dict(fields)
    for name in ("error", "params"):
        if name in values:
            values[name] = _dump(values[name])
    if "expired" in values:
        values["expired"] = int(values["expired"])
    sets = ", ".join(f"{k} = %s" for k in values)
    return f"UPDATE videos SET {sets} WHERE id = %s{where}", (*values.values(), video_id, *args)
