"""A server's video files: where each job's MP4, its part file and its thumbnail live (`<data-dir>/videos`, or the
shared media store's directory), uploaded inputs for other replicas, and an object store's publication when the media
store is one (`server/api/object_media.py`). The job stores (`server/api/store.py`'s SQLite, `pg_store.py`) keep
their rows and inherit these files.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path


def disk_free_bytes(path: str | Path) -> int:
    """Bytes free for this user on the file system holding `path` (what admission and /health compare with
    --min-free-bytes)."""
    return shutil.disk_usage(path).free


def fence_tag(fence: int | None) -> str:
    return "" if fence is None else f".f{int(fence)}"


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
        return self.video_dir / f"{video_id}{fence_tag(fence)}.mp4"

    def partial_path(self, video_id: str, fence: int | None = None) -> Path:
        return self.video_dir / f"{video_id}{fence_tag(fence)}.mp4.part"

    def thumbnail_path(self, video_id: str, fence: int | None = None) -> Path:
        return self.video_dir / f"{video_id}{fence_tag(fence)}.png"

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

    def link_files(self, source_id: str, video_id: str) -> bool:
        """`video_id`'s MP4 and thumbnail, the same bytes as `source_id`'s: hard links where the file system has
        them (no second copy on disk: True), else copies (server-side on an object store: False).
        FileNotFoundError when the source's files are gone."""
        if self.objects is not None:
            for ext in ("png", "mp4"):
                try:
                    self.objects.copy(f"videos/{source_id}.{ext}", f"videos/{video_id}.{ext}")
                except FileNotFoundError:
                    self.remove_files(video_id)
                    raise
            return False
        linked = True
        for path in (self.video_path, self.thumbnail_path):
            src, dst = path(source_id), path(video_id)
            try:
                os.link(src, dst)
            except FileNotFoundError:
                self.remove_files(video_id)
                raise
            except OSError:
                shutil.copyfile(src, dst)
                linked = False
        return linked

    def files_bytes(self, video_id: str, fence: int | None = None) -> int:
        total = 0
        for path in (self.video_path(video_id, fence), self.thumbnail_path(video_id, fence)):
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                pass
        return total
