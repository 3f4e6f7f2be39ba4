"""Where the videos' files live: `--media-store`.

    none                      <data-dir>/videos (one server)
    file:///mnt/longserve     a directory every replica mounts (NFS, a shared volume): <path>/videos/<id>.mp4

A video is published atomically on every store: it is written to `<id>.mp4.part` and renamed to `<id>.mp4` once
complete and fsynced (`server/media.py`, `FragmentedMP4Writer`), so a completed record always points at a complete
file, and a reader on another replica follows the `.part` file while it grows (`?stream=true`).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

SCHEMES = ("file",)


def check_media_store(url: str | None) -> None:
    """ValueError naming `media_store` for a URL no store here takes."""
    if url is None:
        return
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"media_store must be a URL (file:///path), got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"media_store: the scheme {parts.scheme!r} of {url!r} is not supported; use "
                         f"file:///absolute/path (a directory every replica mounts)")
    if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
        raise ValueError(f"media_store must be file:///absolute/path, got {url!r}")


def media_dir(url: str | None) -> Path | None:
    """The directory of the videos' files for `--media-store` (None: the data dir's own)."""
    if url is None:
        return None
    check_media_store(url)
    return Path(unquote(urlsplit(url).path)) / "videos"
