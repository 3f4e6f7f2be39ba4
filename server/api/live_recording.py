"""`LiveRecording`: a live session kept as a video (opt in per session: `"record": true` in its start message).

The session's fMP4 fragments (the binary messages its client gets; concatenated they are one MP4) are appended to a
file of its own as they are made, before any is dropped for a slow client, so the recording has every chunk; a
WebRTC session, which sends no fragments, gets them from a muxer of the recording's own. Its first frame is the
thumbnail. When the session ends (stopped, its length reached, an error, or its client gone) the files are
published as a video's are (`StoredFiles.publish_files`: renamed into place, or put whole on an object store) and a
record is stored, completed, under the session's id (`live_...`) and its owner: it is listed, downloaded, deleted,
expired and counted by the quota like any video, and the page's history shows it. Its `options` say it was live
and which prompts it went through.
"""

from __future__ import annotations

import logging
import os
import time

from longserve.server.api.store import VideoRecord

log = logging.getLogger("longserve.server")

#: a recording's files carry this fence until they are published (no claim: a session runs where it opened)
FENCE = 0


class LiveRecording:
    """`storage`: the server's `VideoStorage`; `model_name`: the served model's; `spec`: the session's request;
    `owner`: its key's id. Its methods touch files: call them on the runner's io threads."""

    def __init__(self, storage, model_name: str, spec, owner: str | None, own_muxer: bool):
        from longserve.server.live_media import ChunkMuxer

        self.storage, self.model_name, self.spec, self.owner = storage, model_name, spec, owner
        self.store = storage.store
        self.created_at = int(time.time())
        self.muxer = ChunkMuxer(spec.width, spec.height, spec.fps) if own_muxer else None
        self.path = self.store.partial_path(spec.request_id, FENCE)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "wb")          # noqa: SIM115 - closed by finish or abort
        self.frames, self.prompts = 0, [spec.prompt[0]]
        self.closed = False

    def add(self, fragment: bytes | None, pixels, prompt: str | None) -> None:
        """One chunk: its fMP4 fragment (None: made here from `pixels`, (n, H, W, 3) uint8) and the prompt it was
        made under."""
        if self.closed:
            return
        if self.frames == 0:
            from longserve.server.media import write_png

            write_png(self.store.thumbnail_path(self.spec.request_id, FENCE), pixels[0])
        if fragment is None and self.muxer is not None:
            fragment = self.muxer.push(pixels)
        self.file.write(fragment or b"")
        self.frames += len(pixels)
        if prompt is not None and prompt != self.prompts[-1]:
            self.prompts.append(prompt)

    def finish(self) -> str | None:
        """Publish the files and store the record; the video's id, or None when nothing was made (or it failed)."""
        if self.closed:
            return None
        self.closed = True
        try:
            if self.muxer is not None:
                self.muxer.close()
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            if self.frames == 0:
                self.store.remove_files(self.spec.request_id, FENCE)
                return None
            vid = self.spec.request_id
            os.replace(self.path, self.store.video_path(vid, FENCE))
            self.store.publish_files(vid, FENCE)
            self.store.published(vid, FENCE)
            rec = self.record()
            self.storage.insert(rec, "the live recording")
            self.store.update(vid, expires_at=rec.expires_at, bytes=rec.bytes)   # (insert writes neither)
        except Exception:  # noqa: BLE001 - the session ended all the same; its recording is lost, and said so
            log.exception("recording live session %s failed", self.spec.request_id)
            self.store.remove_files(self.spec.request_id, FENCE)
            return None
        if self.storage.quotas.on:          # its owner's quota counts it as any video
            self.storage.quota(self.owner)
        return vid

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.file.close()
            self.store.remove_files(self.spec.request_id, FENCE)

    def record(self) -> VideoRecord:
        spec, now, vid = self.spec, int(time.time()), self.spec.request_id
        params = {**spec.to_params(), "num_frames": self.frames}
        options = {k: v for k, v in params["options"].items() if k in ("live",)}
        params["options"] = {**options, "live": True, "prompts": self.prompts}
        return VideoRecord(id=vid, created_at=self.created_at, status="completed", model=self.model_name,
                           prompt=spec.prompt[0], seconds=f"{self.frames / spec.fps:g}",
                           size=f"{spec.width}x{spec.height}", params=params, progress=100, completed_at=now,
                           expires_at=self.storage.expiry(now), owner=self.owner,
                           bytes=self.store.files_bytes(vid))
