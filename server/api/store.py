"""The job store: one table of video jobs, and their files under the data directory.

`VIDEO_TABLE` defines the table once (each column's name, kind and constraints) for both stores: SQLite (here, one
server) and PostgreSQL (`pg_store.py`, the replicas' shared store, whose versioned migrations must build the same
columns: `tests/server/test_store_contract.py` compares them). `JobStore` is the protocol the service uses;
`VideoRows` writes its queries once over a driver's placeholder, and each store adds its connection and its writes.

    <data-dir>/                        mode 0700 when the server creates it (prompts are private)
    <data-dir>/longserve.db            jobs (WAL mode; survives restarts; mode 0600)
    <data-dir>/videos/<id>.mp4         the finished video (fragmented MP4, H.264)
    <data-dir>/videos/<id>.mp4.part    the video while it is being written (streamed from)
    <data-dir>/videos/<id>.png         the thumbnail (first frame)

Status transitions are written through at once (queued, in_progress, completed, failed,
deleted); the per-step progress of a running job is the engine's (`server/api/service.py`
reads it from the request's handle), since a job that was running when the server stopped
is failed on the next start anyway. `expires_at` is set when a job finishes: when its files
expire (`--retention`), or sooner when the storage quota (`--max-storage-bytes`) evicts it,
the files are deleted and the row is kept, marked `expired` (its GET still answers; its
content is gone). `bytes` is the size of a completed video's files (the quota's measure).

`owner` is the id of the API key that created the job (`server.api.edge.client_id`: a digest, never the key);
NULL for a job made with no key, and for every row written before the column existed (a data dir from an older
release: such rows are seen only by an admin key or a server without keys, `server/api/tenants.py`). It is a
plain column so that any store of these rows (the replicas' PostgreSQL) carries it as it is.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from longserve.server.api.errors import StoreUnavailable  # noqa: F401 - the stores raise it (one name for both)
from longserve.server.api.json_input import door_text_problem, safe_text
from longserve.server.api.stored_files import StoredFiles

#: the videos table, for both stores: (column, kind, constraints). Kinds: "seq" the row's order (the key), "text",
#: "int" a small integer, "big" a count of seconds or bytes (64-bit in PostgreSQL)
VIDEO_TABLE = (
    ("seq", "seq", ""), ("id", "text", "NOT NULL UNIQUE"), ("created_at", "big", "NOT NULL"),
    ("completed_at", "big", ""), ("status", "text", "NOT NULL"), ("progress", "int", "NOT NULL DEFAULT 0"),
    ("model", "text", "NOT NULL"), ("prompt", "text", "NOT NULL"), ("seconds", "text", "NOT NULL"),
    ("size", "text", "NOT NULL"), ("params", "text", "NOT NULL"), ("error", "text", ""), ("expires_at", "big", ""),
    ("expired", "int", "NOT NULL DEFAULT 0"), ("bytes", "big", ""), ("request_key", "text", ""),
    ("extended_from", "text", ""), ("owner", "text", ""), ("content", "text", ""),
    ("input_bytes", "big", "NOT NULL DEFAULT 0"),
)
COLUMNS = tuple(name for name, _, _ in VIDEO_TABLE)
#: each kind's type in each store
COLUMN_TYPES = {"sqlite": {"seq": "INTEGER", "text": "TEXT", "int": "INTEGER", "big": "INTEGER"},
                "postgresql": {"seq": "BIGINT", "text": "TEXT", "int": "INTEGER", "big": "BIGINT"}}
#: indexes both stores keep (PostgreSQL's replicas add their own: `pg_store.MIGRATIONS`)
VIDEO_INDEXES = {"videos_status": "status", "videos_request_key": "request_key", "videos_owner": "owner, seq"}


def column_declaration(name: str, kind: str, constraints: str, dialect: str) -> str:
    if kind == "seq":
        return f"{name} INTEGER PRIMARY KEY AUTOINCREMENT" if dialect == "sqlite" else f"{name} BIGSERIAL PRIMARY KEY"
    return f"{name} {COLUMN_TYPES[dialect][kind]} {constraints}".rstrip()


def create_sqlite_table(db: sqlite3.Connection) -> None:
    """The SQLite store's table and indexes, from `VIDEO_TABLE`; a data dir written before a column existed gets
    it (every column added after the first release has a default or takes NULL)."""
    columns = ", ".join(column_declaration(*c, "sqlite") for c in VIDEO_TABLE)
    db.execute(f"CREATE TABLE IF NOT EXISTS videos ({columns})")
    present = {row[1] for row in db.execute("PRAGMA table_info(videos)")}
    for name, kind, constraints in VIDEO_TABLE:
        if name not in present:
            db.execute(f"ALTER TABLE videos ADD COLUMN {column_declaration(name, kind, constraints, 'sqlite')}")
    for name, columns in VIDEO_INDEXES.items():
        db.execute(f"CREATE INDEX IF NOT EXISTS {name} ON videos({columns})")


#: `stored` and `active_inputs` of every owner (the default of their `owner`)
ANY_OWNER = "*"


@dataclass
class VideoRecord:
    """One job as stored. `params`: the generation parameters (`GenerationSpec.to_params()`, its fps among them)."""

    id: str
    created_at: int
    status: str
    model: str
    prompt: str
    seconds: str
    size: str
    params: dict
    progress: int = 0
    completed_at: int | None = None
    error: dict | None = None
    seq: int | None = None
    expires_at: int | None = None
    expired: bool = False          # its files were deleted (retention or quota); the record stays
    bytes: int | None = None       # a completed video's MP4 + thumbnail, in bytes
    request_key: str | None = None  # what an identical request has in common with it (service.request_key)
    extended_from: str | None = None   # the video an extension continues (its content starts with that video's)
    owner: str | None = None       # the creating API key's id (None: no key, or a row from before owners)
    content: str | None = None     # a reuse's files are hard links to this video's: one copy on disk (the quota's)
    input_bytes: int = 0           # its uploads kept in a shared media store while it is active (the quota's)


class Kept(NamedTuple):
    """A completed video whose files are kept, as the quota sees it: `content` names its files' copy on disk (the
    video itself, or the one a reuse's hard links share)."""

    id: str
    owner: str | None
    content: str
    bytes: int
    expires_at: int | None


def check_storable(rec: VideoRecord) -> None:
    """The doors refuse text that does not encode or holds a NUL; a record that holds some is never stored (either
    store: both refuse the same)."""
    for name, text in (("prompt", rec.prompt or ""), ("params", json.dumps(rec.params, ensure_ascii=False)),
                       ("seconds", rec.seconds or ""), ("size", rec.size or ""), ("model", rec.model or "")):
        problem = door_text_problem(text)
        if problem is not None:
            raise ValueError(f"video {rec.id}: its {name} {problem}")


class JobStore(Protocol):
    """What the service asks of a job store (`SqliteJobStore`; `pg_store.PostgresJobStore`, which the replicas
    share, adds claims and leases): the rows, plus the files (`StoredFiles`). Both pass one contract
    (`tests/server/test_store_contract.py`)."""

    def insert(self, rec: VideoRecord, cost: float = 1.0) -> int: ...

    def update(self, video_id: str, **fields) -> None: ...

    def delete(self, video_id: str) -> bool: ...

    def get(self, video_id: str) -> VideoRecord | None: ...

    def completed_with_key(self, request_key: str, owner: str | None) -> VideoRecord | None: ...

    def page(self, after_seq: int | None, limit: int, order: str,
             owner: str | None = None) -> tuple[list[VideoRecord], bool]: ...

    def counts_by_status(self) -> dict[str, int]: ...

    def expired(self, now: int) -> list[str]: ...

    def stored(self, owner=ANY_OWNER) -> list[Kept]: ...

    def active_inputs(self, owner=ANY_OWNER) -> int: ...

    def unmeasured(self) -> list[str]: ...

    def by_status(self, status: str) -> list[VideoRecord]: ...

    def close(self) -> None: ...


class VideoRows:
    """The queries of `JobStore` both stores share, written once: a store gives its driver's placeholder (`MARK`),
    its null-safe equality (`SAME`) and `_all` / `_one` / `_run` (a statement's rows, first row, rows touched)."""

    MARK = "?"
    SAME = "IS"

    def _all(self, sql: str, args=()) -> list[tuple]:
        raise NotImplementedError

    def _one(self, sql: str, args=()) -> tuple | None:
        raise NotImplementedError

    def _run(self, sql: str, args=()) -> int:
        raise NotImplementedError

    def delete(self, video_id: str) -> bool:
        return self._run(f"DELETE FROM videos WHERE id = {self.MARK}", (video_id,)) > 0

    def completed_with_key(self, request_key: str, owner: str | None) -> VideoRecord | None:
        """The newest completed video whose files are kept, made by a request with this key, of this owner (None:
        the rows without one): reuse never crosses owners."""
        m = self.MARK
        row = self._one(f"{SELECT} WHERE request_key = {m} AND owner {self.SAME} {m} AND status = 'completed' AND "
                        f"expired = 0 ORDER BY seq DESC LIMIT 1", (request_key, owner))
        return record_from_row(row) if row else None

    def get(self, video_id: str) -> VideoRecord | None:
        row = self._one(f"{SELECT} WHERE id = {self.MARK}", (video_id,))
        return record_from_row(row) if row else None

    def page(self, after_seq: int | None, limit: int, order: str,
             owner: str | None = None) -> tuple[list[VideoRecord], bool]:
        """Up to `limit` records after `after_seq` in creation order (`asc` or `desc`), and whether more follow;
        only `owner`'s when given (None: every record)."""
        where, direction, args = page_clause(after_seq, order, owner, self.MARK)
        rows = self._all(f"{SELECT} {where} ORDER BY seq {direction} LIMIT {self.MARK}", (*args, limit + 1))
        return [record_from_row(r) for r in rows[:limit]], len(rows) > limit

    def counts_by_status(self) -> dict[str, int]:
        return dict(self._all("SELECT status, COUNT(*) FROM videos GROUP BY status"))

    def expired(self, now: int) -> list[str]:
        """Ids of the finished jobs whose `expires_at` has passed and that are not yet marked expired."""
        return [r[0] for r in self._all(f"SELECT id FROM videos WHERE expires_at IS NOT NULL AND expires_at <= "
                                        f"{self.MARK} AND expired = 0 ORDER BY seq", (now,))]

    def stored(self, owner=ANY_OWNER) -> list[Kept]:
        """Every completed video whose files are kept (`owner`'s only, when given: None is the rows without one),
        oldest completed first."""
        where, args = owner_clause(owner, self.MARK)
        return [Kept(*r) for r in self._all(KEPT_SQL.format(where=where), args)]

    def active_inputs(self, owner=ANY_OWNER) -> int:
        """Bytes of the uploads the active jobs keep in the media store (`owner`'s only, when given)."""
        where, args = owner_clause(owner, self.MARK)
        return int(self._one(INPUTS_SQL.format(where=where), args)[0])

    def unmeasured(self) -> list[str]:
        """Completed videos kept from before `bytes` was recorded."""
        return [r[0] for r in self._all("SELECT id FROM videos WHERE status = 'completed' AND expired = 0 AND "
                                        "bytes IS NULL")]

    def by_status(self, status: str) -> list[VideoRecord]:
        return [record_from_row(r) for r in self._all(f"{SELECT} WHERE status = {self.MARK} ORDER BY seq",
                                                      (status,))]


class SqliteJobStore(VideoRows, StoredFiles):
    """The SQLite store (one server). Thread-safe (one connection behind a lock: statements are tiny)."""

    def __init__(self, data_dir: str | Path, video_dir: str | Path | None = None):
        super().__init__(data_dir, video_dir)
        self.db_path = self.data_dir / "longserve.db"
        # created 0600 before SQLite opens it: its -wal and -shm files take the database's mode
        os.close(os.open(self.db_path, os.O_RDWR | os.O_CREAT, 0o600))
        os.chmod(self.db_path, 0o600)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        create_sqlite_table(self._db)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _all(self, sql: str, args=()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _one(self, sql: str, args=()) -> tuple | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _run(self, sql: str, args=()) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    # -- writes -----------------------------------------------------------------------------------

    def insert(self, rec: VideoRecord, cost: float = 1.0) -> int:
        """Store a new record (`cost`: its work, what replicas claim by; one server has no use for it)."""
        check_storable(rec)
        with self._lock:
            cur = self._db.execute(
                f"INSERT INTO videos ({', '.join(INSERTED)}) VALUES ({', '.join('?' * len(INSERTED))})",
                inserted_values(rec))
            rec.seq = cur.lastrowid
            return rec.seq

    def update(self, video_id: str, **fields) -> None:
        if "error" in fields:
            fields["error"] = dump_json(fields["error"])
        if "params" in fields:
            fields["params"] = dump_json(fields["params"])
        if "expired" in fields:
            fields["expired"] = int(fields["expired"])
        sets = ", ".join(f"{k} = ?" for k in fields)
        self._run(f"UPDATE videos SET {sets} WHERE id = ?", (*fields.values(), video_id))


#: the columns a new record is stored with, and their values (both stores)
INSERTED = ("id", "created_at", "completed_at", "status", "progress", "model", "prompt", "seconds", "size", "params",
            "error", "request_key", "extended_from", "owner", "content", "input_bytes")
KEPT_SQL = ("SELECT id, owner, COALESCE(content, id), COALESCE(bytes, 0), expires_at FROM videos WHERE status = "
            "'completed' AND expired = 0{where} ORDER BY completed_at, seq")
INPUTS_SQL = "SELECT COALESCE(SUM(input_bytes), 0) FROM videos WHERE status IN ('queued', 'in_progress'){where}"
SELECT = f"SELECT {', '.join(COLUMNS)} FROM videos"


def inserted_values(rec: VideoRecord) -> tuple:
    return (rec.id, rec.created_at, rec.completed_at, rec.status, rec.progress, rec.model, rec.prompt, rec.seconds,
            rec.size, json.dumps(rec.params), dump_json(rec.error), rec.request_key, rec.extended_from, rec.owner,
            rec.content, int(rec.input_bytes))


def owner_clause(owner, mark: str) -> tuple[str, tuple]:
    """" AND owner ..." for one owner (None: the rows without one), "" for ANY_OWNER; and its arguments."""
    if owner == ANY_OWNER:
        return "", ()
    if owner is None:
        return " AND owner IS NULL", ()
    return f" AND owner = {mark}", (owner,)


def page_clause(after_seq: int | None, order: str, owner: str | None, mark: str) -> tuple[str, str, list]:
    """A page's WHERE clause (empty without conditions), its ORDER BY direction and the clause's arguments, for both
    stores (`mark`: the driver's placeholder, "?" for SQLite, "%s" for psycopg)."""
    op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
    conditions, args = [], []
    if after_seq is not None:
        conditions.append(f"seq {op} {mark}")
        args.append(after_seq)
    if owner is not None:
        conditions.append(f"owner = {mark}")
        args.append(owner)
    return (f"WHERE {' AND '.join(conditions)}" if conditions else ""), direction, args


def dump_json(value) -> str | None:
    return None if value is None else json.dumps(value)


def _loads(text: str):
    """A stored JSON column. A row written by an older release may hold a lone surrogate (`"\\ud800"`, which
    `json.loads` turns into one): it comes back as its escape, so an answer holding it can be encoded."""
    def clean(value):
        if isinstance(value, str):
            return safe_text(value)
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, dict):
            return {clean(k): clean(v) for k, v in value.items()}
        return value

    return clean(json.loads(text))


def record_from_row(row) -> VideoRecord:
    d = dict(zip(COLUMNS, row))
    d["params"] = _loads(d["params"])
    d["error"] = _loads(d["error"]) if d["error"] else None
    d["expired"] = bool(d["expired"])
    return VideoRecord(**d)
