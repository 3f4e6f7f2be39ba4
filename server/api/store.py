"""The job store: one SQLite table of video jobs, and their files under the data directory.

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
import logging
import os
import shutil
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from longserve.engine.request import text_problem
from longserve.server.api.json_input import safe_text

SCHEMA = """
CREATE TABLE IF NOT EXISTS videos (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    id           TEXT NOT NULL UNIQUE,
    created_at   INTEGER NOT NULL,
    completed_at INTEGER,
    status       TEXT NOT NULL,
    progress     INTEGER NOT NULL DEFAULT 0,
    model        TEXT NOT NULL,
    prompt       TEXT NOT NULL,
    seconds      TEXT NOT NULL,
    size         TEXT NOT NULL,
    params       TEXT NOT NULL,
    error        TEXT,
    expires_at   INTEGER,
    expired      INTEGER NOT NULL DEFAULT 0,
    bytes        INTEGER,
    request_key  TEXT,
    extended_from TEXT,
    owner        TEXT
);
CREATE INDEX IF NOT EXISTS videos_status ON videos(status);
"""

COLUMNS = ("seq", "id", "created_at", "completed_at", "status", "progress", "model", "prompt", "seconds", "size",
            "params", "error", "expires_at", "expired", "bytes", "request_key",
            "extended_from", "owner")
#: columns added after the first release, with their declarations (a data dir written before gets them)
_ADDED = {"expires_at": "INTEGER", "expired": "INTEGER NOT NULL DEFAULT 0", "bytes": "INTEGER",
          "request_key": "TEXT", "extended_from": "TEXT", "owner": "TEXT"}


def disk_free_bytes(path: str | Path) -> int:
    """Bytes free for this user on the file system holding `path` (what admission and /health compare with
    --min-free-bytes)."""
    return shutil.disk_usage(path).free


@dataclass
class VideoRecord:
    """One job as stored. `params`: the generation parameters (`GenerationSpec.params()`) and the fps."""

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


class StoredFiles:
    """A store's files: the videos under `video_dir` (<data-dir>/videos, or a shared directory every replica mounts:
    `--media-store file://...`), and the temp area of uploads (always this replica's own, under the data dir).
    Shared by the SQLite store (below) and the PostgreSQL one (`server/api/pg_store.py`)."""

    def __init__(self, data_dir: str | Path, video_dir: str | Path | None = None, objects=None):
        self.data_dir = Path(data_dir)
        # an object store (`--media-store s3://`, server/api/object_media.py): the files here are this replica's
        # working area and cache; the objects are what every replica reads
        self.objects = objects
        self.shared = video_dir is not None or objects is not None    # every replica reads this media store
        self._uploaders: dict[tuple[str, int], object] = {}
        self.video_dir = Path(video_dir) if video_dir is not None else self.data_dir / "videos"
        self.media_root = Path(video_dir) if video_dir is not None else self.data_dir   # what free_bytes measures
        # every prompt is in the database: only this user may read the directory (mkdir's mode applies to the
        # directories it creates; one that exists keeps its mode, the operator's choice)
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.video_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.tmp_dir = self.data_dir / "tmp"           # uploads on their way through a decoder (`sweep_tmp`)
        self.tmp_dir.mkdir(mode=0o700, exist_ok=True)

    def free_bytes(self) -> int:
        return disk_free_bytes(self.media_root)

    def sweep_tmp(self) -> int:
        """Remove what a previous run left in the temp area (a process killed while it decoded an upload: each is
        removed when its decode ends otherwise), and on an object store this replica's working area and cache;
        at start, before any request. Returns how many were removed."""
        removed = 0
        local = [self.video_dir] if self.objects is not None else []
        for path in [p for d in (self.tmp_dir, *local) for p in d.iterdir()]:
            if path.is_file() or path.is_symlink():
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    # A claim of a replicated job (its `fence`, server/api/pg_store.py) writes files of its own, `<id>.f<fence>.*`,
    # renamed to `<id>.*` when the claim completes the job (`PostgresJobStore.publish`): a replica that lost its
    # lease never overwrites the job's files, and what it drops is its own.

    def video_path(self, video_id: str, fence: int | None = None) -> Path:
        return self.video_dir / f"{video_id}{_tag(fence)}.mp4"

    def partial_path(self, video_id: str, fence: int | None = None) -> Path:
        return self.video_dir / f"{video_id}{_tag(fence)}.mp4.part"

    def thumbnail_path(self, video_id: str, fence: int | None = None) -> Path:
        return self.video_dir / f"{video_id}{_tag(fence)}.png"

    # A job's uploaded inputs (`server/api/job_inputs.py`): in the media store, so that any replica can claim it.

    def inputs_dir(self, video_id: str) -> Path:
        return self.video_dir.parent / "inputs" / video_id

    def put_inputs(self, video_id: str, files: dict[str, bytes]) -> None:
        if self.objects is not None:
            for name, data in files.items():
                self.objects.put_bytes(f"inputs/{video_id}/{name}", data)
            return
        folder = self.inputs_dir(video_id)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        for name, data in files.items():
            tmp = folder / f".{name}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, folder / name)

    def get_inputs(self, video_id: str, names) -> dict[str, bytes] | None:
        """These files of a job's inputs; None when one is missing."""
        files = {}
        for name in names:
            if self.objects is not None:
                data = self.objects.get_bytes(f"inputs/{video_id}/{name}")
            else:
                try:
                    data = (self.inputs_dir(video_id) / name).read_bytes()
                except FileNotFoundError:
                    data = None
            if data is None:
                return None
            files[name] = data
        return files

    def remove_inputs(self, video_id: str) -> None:
        if self.objects is not None:
            self.objects.delete_prefix(f"inputs/{video_id}/")
        else:
            shutil.rmtree(self.inputs_dir(video_id), ignore_errors=True)

    def remove_files(self, video_id: str, fence: int | None = None) -> None:
        """A claim's files (`fence`), or all of a video's (None: its inputs too); on an object store its objects
        too."""
        if fence is None and self.shared:
            self.remove_inputs(video_id)
        if self.objects is not None:
            self._stop_uploads(video_id, fence)
            self.objects.delete_prefix(f"videos/{video_id}.{'' if fence is None else f'f{int(fence)}.'}")
        for path in (self.video_path(video_id, fence), self.partial_path(video_id, fence),
                     self.thumbnail_path(video_id, fence)):
            path.unlink(missing_ok=True)

    def writing(self, video_id: str, fence: int | None, writer) -> None:
        """A claim's MP4 writer started: on an object store, its pieces are put as they are appended (what another
        replica's `?stream=true` reads)."""
        if self.objects is not None and fence is not None:
            from longserve.server.api.object_media import PartUploader

            self._uploaders[(video_id, int(fence))] = PartUploader(self.objects, video_id, int(fence), writer)

    def _stop_uploads(self, video_id: str, fence: int | None) -> None:
        for key in [k for k in list(self._uploaders) if k[0] == video_id and fence in (None, k[1])]:
            uploader = self._uploaders.pop(key, None)
            if uploader is not None:
                uploader.stop()

    def publish_files(self, video_id: str, fence: int) -> None:
        """(under the job's row lock, its fence checked) A claim's files become the video's: renamed on a file
        system (atomic: a reader sees the old name or the complete file); on an object store put whole, the
        thumbnail first (an object is complete or absent), and kept here as this replica's cache."""
        if self.objects is not None:
            self._stop_uploads(video_id, fence)
            for path, ext in ((self.thumbnail_path, "png"), (self.video_path, "mp4")):
                self.objects.put_file(path(video_id, fence), f"videos/{video_id}.{ext}")
        for path in (self.thumbnail_path, self.video_path):
            os.replace(path(video_id, fence), path(video_id))

    def published(self, video_id: str, fence: int) -> None:
        """After a publication: the pieces another replica streamed from go (the whole object has their bytes), and
        the job's inputs (it will not run again)."""
        try:
            if self.shared:
                self.remove_inputs(video_id)
            if self.objects is not None:
                self.objects.delete_prefix(f"videos/{video_id}.f{int(fence)}.")
        except Exception as e:  # noqa: BLE001 - left over; the video's DELETE or expiry removes them
            logging.getLogger("longserve.server").warning("%s: removing its pieces or inputs failed: %s", video_id, e)

    def content_file(self, video_id: str, variant: str = "video") -> Path | None:
        """The local file of a video's MP4 (`variant` video) or PNG, None when it is missing. On an object store a
        video this replica did not make is fetched once into its cache (`trim_cache` lets it go)."""
        path = self.video_path(video_id) if variant == "video" else self.thumbnail_path(video_id)
        if path.exists():
            return path
        if self.objects is not None and self.objects.get_file(f"videos/{video_id}.{path.suffix[1:]}", path):
            return path
        return None

    def trim_cache(self, max_age_s: float = 3600.0) -> int:
        """On an object store: the cached copies of videos not written for `max_age_s` go (the objects stay).
        Returns how many."""
        if self.objects is None:
            return 0
        removed, now = 0, time.time()
        for path in self.video_dir.iterdir():
            if ".f" in path.name or path.suffix not in (".mp4", ".png"):
                continue                                   # a claim's files, while it writes them
            try:
                if now - path.stat().st_mtime > max_age_s:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed

    def link_files(self, source_id: str, video_id: str) -> None:
        """`video_id`'s MP4 and thumbnail, the same bytes as `source_id`'s: hard links where the file system has
        them (no second copy on disk), else copies (server-side on an object store). FileNotFoundError when the
        source's files are gone."""
        if self.objects is not None:
            for ext in ("png", "mp4"):
                try:
                    self.objects.copy(f"videos/{source_id}.{ext}", f"videos/{video_id}.{ext}")
                except FileNotFoundError:
                    self.remove_files(video_id)
                    raise
            return
        for path in (self.video_path, self.thumbnail_path):
            src, dst = path(source_id), path(video_id)
            try:
                os.link(src, dst)
            except FileNotFoundError:
                self.remove_files(video_id)
                raise
            except OSError:
                shutil.copyfile(src, dst)

    def files_bytes(self, video_id: str, fence: int | None = None) -> int:
        total = 0
        for path in (self.video_path(video_id, fence), self.thumbnail_path(video_id, fence)):
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                pass
        return total


def _tag(fence: int | None) -> str:
    return "" if fence is None else f".f{int(fence)}"


def check_storable(rec: VideoRecord) -> None:
    """The doors refuse text that does not encode; a record that holds some is never stored (either store)."""
    for name, text in (("prompt", rec.prompt or ""), ("params", json.dumps(rec.params, ensure_ascii=False))):
        problem = text_problem(text)
        if problem is not None:
            raise ValueError(f"video {rec.id}: its {name} {problem}")


class JobStore(StoredFiles):
    """The SQLite store. Thread-safe (one connection behind a lock: statements are tiny)."""

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
        self._db.executescript(SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(videos)")}
        for name, declaration in _ADDED.items():  # a data dir written before the column existed
            if name not in columns:
                self._db.execute(f"ALTER TABLE videos ADD COLUMN {name} {declaration}")
        self._db.execute("CREATE INDEX IF NOT EXISTS videos_request_key ON videos(request_key)")
        self._db.execute("CREATE INDEX IF NOT EXISTS videos_owner ON videos(owner, seq)")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- rows -----------------------------------------------------------------------------------

    def insert(self, rec: VideoRecord, cost: float = 1.0) -> int:
        """Store a new record (`cost`: its work, what replicas claim by; one server has no use for it)."""
        check_storable(rec)
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO videos (id, created_at, completed_at, status, progress, model, prompt, seconds, size,"
                " params, error, request_key, extended_from, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (rec.id, rec.created_at, rec.completed_at, rec.status, rec.progress, rec.model, rec.prompt,
                 rec.seconds, rec.size, json.dumps(rec.params), dump_json(rec.error), rec.request_key,
                 rec.extended_from, rec.owner))
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
        with self._lock:
            self._db.execute(f"UPDATE videos SET {sets} WHERE id = ?", (*fields.values(), video_id))

    def delete(self, video_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM videos WHERE id = ?", (video_id,)).rowcount > 0

    def completed_with_key(self, request_key: str, owner: str | None) -> VideoRecord | None:
        """The newest completed video whose files are kept, made by a request with this key, of this owner (None:
        the rows without one): reuse never crosses owners."""
        with self._lock:
            row = self._db.execute(f"SELECT {', '.join(COLUMNS)} FROM videos WHERE request_key = ? AND owner IS ? "
                                   f"AND status = 'completed' AND expired = 0 ORDER BY seq DESC LIMIT 1",
                                   (request_key, owner)).fetchone()
        return record_from_row(row) if row else None

    def get(self, video_id: str) -> VideoRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {', '.join(COLUMNS)} FROM videos WHERE id = ?", (video_id,)).fetchone()
        return record_from_row(row) if row else None

    def page(self, after_seq: int | None, limit: int, order: str,
             owner: str | None = None) -> tuple[list[VideoRecord], bool]:
        """Up to `limit` records after `after_seq` in creation order (`asc` or `desc`), and whether more follow;
        only `owner`'s when given (None: every record)."""
        where, direction, args = page_clause(after_seq, order, owner, "?")
        with self._lock:
            rows = self._db.execute(f"SELECT {', '.join(COLUMNS)} FROM videos {where} ORDER BY seq {direction} "
                                    f"LIMIT ?", (*args, limit + 1)).fetchall()
        return [record_from_row(r) for r in rows[:limit]], len(rows) > limit

    def counts_by_status(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM videos GROUP BY status").fetchall()
        return dict(rows)

    def expired(self, now: int) -> list[str]:
        """Ids of the finished jobs whose `expires_at` has passed and that are not yet marked expired."""
        with self._lock:
            rows = self._db.execute("SELECT id FROM videos WHERE expires_at IS NOT NULL AND expires_at <= ? "
                                    "AND expired = 0 ORDER BY seq", (now,)).fetchall()
        return [r[0] for r in rows]

    def stored(self) -> list[tuple[str, int, int | None]]:
        """(id, bytes, expires_at) of every completed video whose files are kept, oldest completed first."""
        with self._lock:
            rows = self._db.execute("SELECT id, COALESCE(bytes, 0), expires_at FROM videos WHERE status = "
                                    "'completed' AND expired = 0 ORDER BY completed_at, seq").fetchall()
        return [tuple(r) for r in rows]

    def unmeasured(self) -> list[str]:
        """Completed videos kept from before `bytes` was recorded."""
        with self._lock:
            rows = self._db.execute("SELECT id FROM videos WHERE status = 'completed' AND expired = 0 AND "
                                    "bytes IS NULL").fetchall()
        return [r[0] for r in rows]

    def by_status(self, status: str) -> list[VideoRecord]:
        with self._lock:
            rows = self._db.execute(f"SELECT {', '.join(COLUMNS)} FROM videos WHERE status = ? ORDER BY seq",
                                    (status,)).fetchall()
        return [record_from_row(r) for r in rows]


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
