"""Where the videos' files live: `--media-store`.

    none                      <data-dir>/videos (one server)
    file:///mnt/longserve     a directory every replica mounts (NFS, a shared volume): <path>/videos/<id>.mp4
    s3://bucket/prefix        S3-compatible object storage (`server/api/object_media.py`; needs --store postgresql://)

A video is published atomically on every store: it is written to `<id>.mp4.part` and renamed to `<id>.mp4` once
complete and fsynced (`server/media.py`, `FragmentedMP4Writer`), so a completed record always points at a complete
file, and a reader on another replica follows the `.part` file while it grows (`?stream=true`). On S3 the replica
writes in its own data dir, puts the pieces as they are appended (streamed elsewhere), and puts the whole object
when it publishes (an object is complete or absent).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

SCHEMES = ("file", "s3")


def check_media_store(url: str | None) -> None:
    """ValueError naming `media_store` for a URL no store here takes."""
    if url is None:
        return
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"media_store must be a URL (file:///path or s3://bucket/prefix), got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"media_store: the scheme {parts.scheme!r} of {url!r} is not supported; use "
                         f"file:///absolute/path (a directory every replica mounts) or s3://bucket/prefix")
    if parts.scheme == "s3":
        from longserve.server.api.object_media import parse_s3_url

        parse_s3_url(url)
        return
    if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
        raise ValueError(f"media_store must be file:///absolute/path, got {url!r}")


def is_object_store(url: str | None) -> bool:
    return url is not None and urlsplit(url).scheme == "s3"


def media_dir(url: str | None) -> Path | None:
    """The directory of the videos' files for `--media-store` (None: the data dir's own, also an object store's
    working area)."""
    if url is None or is_object_store(url):
        return None
    check_media_store(url)
    return Path(unquote(urlsplit(url).path)) / "videos"


def open_objects(url: str | None):
    """The `ObjectMedia` of an s3:// media store (checked: its bucket answers), else None."""
    if not is_object_store(url):
        return None
    from longserve.server.api.object_media import ObjectMedia

    return ObjectMedia(url)
