"""`Settings`: the service's settings that clients change while it runs and every replica must share: the webhook
endpoints of each key (`POST /v1/webhook_endpoints`) and the LoRA adapters loaded while serving (`POST /v1/loras`).

Rows of (kind, id, owner, data JSON). With the SQLite store (one server) they live in `<data-dir>/settings.db`
(mode 0600: webhook signing secrets are in it); with a PostgreSQL store, in its `longserve_settings` table
(migration 4 of `server/api/pg_store.py`), read by every replica. `version()` moves on every write, so a replica
polls one number to see that something changed (`server/api/lora_sync.py`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from pathlib import Path

SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS longserve_settings (
    kind TEXT NOT NULL, id TEXT NOT NULL, owner TEXT, data TEXT NOT NULL, created_at INTEGER NOT NULL,
    seq INTEGER NOT NULL, PRIMARY KEY (kind, id));
CREATE TABLE IF NOT EXISTS longserve_settings_version (one INTEGER PRIMARY KEY CHECK (one = 1), seq INTEGER NOT NULL);
INSERT OR IGNORE INTO longserve_settings_version VALUES (1, 0);
"""


def open_settings(store) -> "Settings":
    """The settings beside a job store: its PostgreSQL pool when it has one, else a SQLite file in its data dir."""
    pool = getattr(store, "pool", None)
    return PostgresSettings(pool) if pool is not None else SqliteSettings(Path(store.data_dir) / "settings.db")


class Settings:
    """put / get / list / delete rows of a kind; `owner` scopes a row to an API key's id (None: the server's)."""

    def put(self, kind: str, id: str, data: dict, owner: str | None = None) -> None:
        raise NotImplementedError

    def get(self, kind: str, id: str) -> tuple[str | None, dict, int] | None:
        """(owner, data, created_at), or None."""
        raise NotImplementedError

    def list(self, kind: str, owner: str | None | object = ...) -> list[tuple[str, str | None, dict, int]]:
        """[(id, owner, data, created_at)] oldest first; of one owner when `owner` is given (None included)."""
        raise NotImplementedError

    def delete(self, kind: str, id: str) -> bool:
        raise NotImplementedError

    def version(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        pass


class SqliteSettings(Settings):
    def __init__(self, path: Path):
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        os.chmod(path, 0o600)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.executescript(SQLITE_SCHEMA)

    def _bump(self) -> int:
        self._db.execute("UPDATE longserve_settings_version SET seq = seq + 1")
        return self._db.execute("SELECT seq FROM longserve_settings_version").fetchone()[0]

    def put(self, kind, id, data, owner=None):
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                seq = self._bump()
                self._db.execute("INSERT INTO longserve_settings VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (kind, id) DO "
                                 "UPDATE SET owner = excluded.owner, data = excluded.data, seq = excluded.seq",
                                 (kind, id, owner, json.dumps(data), int(time.time()), seq))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def get(self, kind, id):
        with self._lock:
            row = self._db.execute("SELECT owner, data, created_at FROM longserve_settings WHERE kind = ? AND id = ?",
                                   (kind, id)).fetchone()
        return None if row is None else (row[0], json.loads(row[1]), row[2])

    def list(self, kind, owner=...):
        sql, args = "SELECT id, owner, data, created_at FROM longserve_settings WHERE kind = ?", [kind]
        if owner is not ...:
            sql, args = sql + " AND owner IS ?", [kind, owner]
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY created_at, id", args).fetchall()
        return [(i, o, json.loads(d), c) for i, o, d, c in rows]

    def delete(self, kind, id):
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                n = self._db.execute("DELETE FROM longserve_settings WHERE kind = ? AND id = ?", (kind, id)).rowcount
                if n:
                    self._bump()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return n > 0

    def version(self):
        with self._lock:
            return self._db.execute("SELECT seq FROM longserve_settings_version").fetchone()[0]

    def close(self):
        with self._lock:
            self._db.close()


class PostgresSettings(Settings):
    """On the replicas' shared database (the job store's pool); `seq` from one sequence: its largest value is the
    version (a delete leaves a tombstone-free gap, so deletes bump `longserve_settings_version` too)."""

    def __init__(self, pool):
        self.pool = pool

    @contextlib.contextmanager
    def _connection(self):
        """A pooled connection; a database that does not answer is the store's StoreUnavailable (503)."""
        from longserve.server.api.pg_store import UNREACHABLE
        from longserve.server.api.store import StoreUnavailable

        try:
            with self.pool.connection() as conn:
                yield conn
        except UNREACHABLE as e:
            raise StoreUnavailable(f"the job store does not answer: {e}") from None

    def put(self, kind, id, data, owner=None):
        with self._connection() as conn, conn.transaction():
            seq = conn.execute("UPDATE longserve_settings_version SET seq = seq + 1 RETURNING seq").fetchone()[0]
            conn.execute("INSERT INTO longserve_settings (kind, id, owner, data, created_at, seq) VALUES (%s, %s, %s, "
                         "%s, %s, %s) ON CONFLICT (kind, id) DO UPDATE SET owner = EXCLUDED.owner, data = "
                         "EXCLUDED.data, seq = EXCLUDED.seq",
                         (kind, id, owner, json.dumps(data), int(time.time()), seq))

    def get(self, kind, id):
        with self._connection() as conn:
            row = conn.execute("SELECT owner, data, created_at FROM longserve_settings WHERE kind = %s AND id = %s",
                               (kind, id)).fetchone()
        return None if row is None else (row[0], json.loads(row[1]), row[2])

    def list(self, kind, owner=...):
        sql, args = "SELECT id, owner, data, created_at FROM longserve_settings WHERE kind = %s", [kind]
        if owner is not ...:
            sql, args = sql + " AND owner IS NOT DISTINCT FROM %s", [kind, owner]
        with self._connection() as conn:
            rows = conn.execute(sql + " ORDER BY created_at, id", args).fetchall()
        return [(i, o, json.loads(d), c) for i, o, d, c in rows]

    def delete(self, kind, id):
        with self._connection() as conn, conn.transaction():
            n = conn.execute("DELETE FROM longserve_settings WHERE kind = %s AND id = %s", (kind, id)).rowcount
            if n:
                conn.execute("UPDATE longserve_settings_version SET seq = seq + 1")
        return n > 0

    def version(self):
        with self._connection() as conn:
            return conn.execute("SELECT seq FROM longserve_settings_version").fetchone()[0]
