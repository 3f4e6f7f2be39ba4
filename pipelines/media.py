"""Reading a video to extend: an MP4 file (or its bytes) -> frames (T, H, W, 3) uint8, bounded before decoding.

Every front door that takes a video goes through `read_mp4`: `VideoPipeline` (`video="in.mp4"`), `longserve
generate --video`, the server's `input_reference` upload and its `/extend` of a stored video. The order of the
checks is the point, as for uploaded images (`server/api/uploads.py`):

1. the bytes' own signature: an ISO base media file (`ftyp` box first: MP4, MOV); nothing else is handed to
   a demuxer, which is then told the format (`mov`) instead of guessing one from the content;
2. the header gives the first video stream's own parameters, read as data by PyAV (libavformat's demuxer, the
   container's boxes, no frame decoded): the coded width and height and the frame count of the stream's sample
   table. Never text: ffmpeg's human-readable log echoes the file's metadata (a `title` can spell a fake
   "Stream #0:0: Video: h264, 16x16" line), so nothing is parsed out of it. The size and the count are checked
   against the caller's limits BEFORE any frame is decoded, so a small file that declares a huge video costs
   nothing;
3. the frames are decoded by ffmpeg in its own process (a hostile file cannot crash or bloat the caller), under a
   timeout, with `-xerror` (a truncated or damaged file fails instead of yielding what was readable), the
   decoder's own per-frame pixel cap (`-max_pixels`: a frame larger than the limit is an error, whatever the
   header said), every frame scaled to the header's size (so the raw stream stays aligned), and its output read as
   a stream: once it passes the bytes the limits allow (`frames x W x H x 3`), the decoder is killed and the file
   refused. What a lying header can cost is therefore bounded by the limits, not by the file.

Frames keep their coded orientation (`-noautorotate`) so that their size is the header's. Bytes go through a
temporary file (MP4 demuxers seek), in `tmp_dir` when the caller has one (the server's data dir, swept at its
start), removed whatever happens.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from longserve.engine.request import RequestError

#: how long ffmpeg may take over a decode before the file is refused
FFMPEG_TIMEOUT_S = 120
#: pixels a decoder's frame may exceed the header's size by on each side (codecs align to blocks of up to 64)
ALIGN_SLACK = 64
#: the name every temporary copy of an uploaded video starts with (a server sweeps its leftovers at start)
TEMP_PREFIX = "longserve-video-"


@dataclass(frozen=True, eq=False)
class EncodedVideo:
    """An MP4 a front door checked (`read_mp4` decoded it within the door's bounds), kept as its file: what a queued
    extension holds instead of its frames (a few MB, not frames x W x H x 3 bytes). The worker that encodes the
    request's conditions decodes it again, under the same bounds (`decode`); the engine reads it as a video through
    `shape`, `len()` and `decode()` (`engine.images.video_frames`). `digest`: the sha256 of its bytes."""

    data: bytes
    frames: int
    width: int
    height: int
    digest: str
    max_pixels: int | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.frames, self.height, self.width, 3)

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def __len__(self) -> int:
        return self.frames

    def decode(self) -> np.ndarray:
        """(T, H, W, 3) uint8, as the door decoded it (at most its frames, its size)."""
        return read_mp4(self.data, "video", max_frames=self.frames, max_pixels=self.max_pixels)


def encoded_video(source, field: str = "video", tmp_dir=None, **limits) -> EncodedVideo:
    """`read_mp4(source, field, **limits)` as a check (VideoInputError as it raises), then the file kept as an
    `EncodedVideo` (a path's bytes are read): the frames are let go."""
    try:
        data = bytes(source) if isinstance(source, (bytes, bytearray, memoryview)) else Path(source).read_bytes()
    except OSError:             # a stored video deleted or expired meanwhile
        raise VideoInputError(field, f"{field} could not be read (it is no longer stored)", "invalid_video") from None
    frames = read_mp4(data, field, tmp_dir=tmp_dir, **limits)
    count, height, width = frames.shape[:3]
    del frames
    return EncodedVideo(data, count, width, height, hashlib.sha256(data).hexdigest(), limits.get("max_pixels"))


class VideoInputError(RequestError):
    """A video file that cannot be taken; `code` says why (for the server's error envelope)."""

    def __init__(self, field: str, message: str, code: str):
        super().__init__(field, message)
        self.code = code


def is_mp4(head: bytes) -> bool:
    """Does a file start like an ISO base media file (its first box is `ftyp`)?"""
    return len(head) >= 12 and head[4:8] == b"ftyp"


def _ffmpeg() -> str:
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()


def _last_lines(stderr: bytes) -> str:
    """ffmpeg's last two log lines, without its "[demuxer @ 0x...]" prefixes."""
    lines = stderr.decode("utf-8", "replace").splitlines()[-2:]
    return re.sub(r"\[[^\]]*@ 0x[0-9a-f]+\] ", "", " ".join(line.strip() for line in lines))[:300]


def probe(path: str, field: str) -> dict:
    """The first video stream of an MP4, from its header only, read as data (PyAV): {"width", "height", "fps",
    "frames"}. `frames` is the stream's sample count (one sample a frame in an MP4 video track), or, where the track
    has no sample table, an estimate from its duration and frame rate (None when either is missing)."""
    import av

    try:
        with av.open(path, format="mov") as container:
            streams = container.streams.video
            if not streams:
                raise VideoInputError(field, f"{field} has no video stream", "invalid_video")
            stream = streams[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else 0.0
            frames = stream.frames or None
            if frames is None and stream.duration and stream.time_base and fps > 0:
                frames = math.ceil(float(stream.duration * stream.time_base) * fps - 1e-6)
    except VideoInputError:
        raise
    except (av.FFmpegError, ValueError, OSError, OverflowError) as e:
        raise VideoInputError(field, f"{field} could not be read as an MP4 video (truncated or damaged?): "
                                     f"{str(e)[:200]}", "invalid_video") from None
    return {"width": int(width or 0), "height": int(height or 0), "fps": fps, "frames": frames}


def read_mp4(source: str | os.PathLike | bytes, field: str = "video", max_frames: int | None = None,
             max_pixels: int | None = None, max_total_pixels: int | None = None,
             tmp_dir: str | os.PathLike | None = None) -> np.ndarray:
    """An MP4 file (a path, or its bytes) -> its frames (T, H, W, 3) uint8 RGB. `VideoInputError` naming `field`
    (code "unsupported_video", "invalid_video" or "video_too_large") for anything else; see the module doc for
    the order of the checks. Bytes go through a temporary file in `tmp_dir` (default: the system's), removed before
    the return, whatever happens."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise VideoInputError(field, f"{field} is an empty file", "invalid_video")
        if not is_mp4(data[:12]):
            raise VideoInputError(field, f"{field} must be an MP4 video; this file is not one (nor a PNG, JPEG or "
                                         f"WebP image where one is taken)", "unsupported_video")
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".mp4", dir=tmp_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return read_mp4(tmp, field, max_frames, max_pixels, max_total_pixels)
        finally:
            os.unlink(tmp)
    path = Path(source)
    try:
        with open(path, "rb") as f:
            head = f.read(12)
    except OSError as e:
        raise VideoInputError(field, f"{field}: cannot read {path}: {e.strerror or e}", "invalid_video") from None
    if not is_mp4(head):
        raise VideoInputError(field, f"{field}: {path.name} is not an MP4 video", "unsupported_video")
    meta = probe(str(path), field)
    width, height = meta["width"], meta["height"]
    if width * height == 0:
        raise VideoInputError(field, f"{field} has no pixels ({width}x{height})", "invalid_video")
    if max_pixels is not None and width * height > max_pixels:
        raise VideoInputError(field, f"{field} is {width}x{height} = {width * height} pixels a frame; the limit is "
                                     f"{max_pixels} (checked before decoding)", "video_too_large")
    limit = max_frames
    if max_total_pixels is not None:
        limit = min(limit or max_total_pixels, max_total_pixels // (width * height))
    if limit is not None and meta["frames"] is not None and meta["frames"] > limit:
        raise VideoInputError(field, f"{field} has {meta['frames']} frames of {width}x{height}; the limit is "
                                     f"{limit} (checked before decoding)", "video_too_large")
    frame_bytes = width * height * 3
    cap = None if limit is None else (limit + 1) * frame_bytes    # one frame past the limit proves it is over
    cmd = [_ffmpeg(), "-v", "error", "-xerror", "-nostdin", "-noautorotate",
           # the decoder refuses a frame larger than the header said (with room for the codec's block alignment,
           # which its own check counts), so a header that understates the size cannot make it decode huge frames
           "-max_pixels", str((width + ALIGN_SLACK) * (height + ALIGN_SLACK)),
           "-f", "mov", "-i", str(path), "-map", "0:v:0", *(["-frames:v", str(limit + 1)] if limit is not None else []),
           "-s", f"{width}x{height}", "-f", "rawvideo", "-pix_fmt", "rgb24", "-"]
    out, stderr, status = _run_capped(cmd, cap)
    if status == "over":
        raise VideoInputError(field, f"{field} decodes to more than {limit} frames of {width}x{height}; the limit "
                                     f"is {limit} (the decoder was stopped)", "video_too_large")
    if status == "timeout":
        raise VideoInputError(field, f"{field}: decoding took too long", "invalid_video")
    count, rest = divmod(len(out), frame_bytes)
    if status != 0 or rest or count == 0:
        raise VideoInputError(field, f"{field} could not be decoded (a truncated or damaged MP4, or a frame over the "
                                     f"pixel limit): {_last_lines(stderr) or 'no frames'}", "invalid_video")
    if limit is not None and count > limit:
        raise VideoInputError(field, f"{field} has more than {limit} frames of {width}x{height}; the limit is "
                                     f"{limit}", "video_too_large")
    return np.frombuffer(out, dtype=np.uint8).reshape(count, height, width, 3)      # (T, H, W, 3)


def _run_capped(cmd: list[str], cap: int | None, timeout_s: float = FFMPEG_TIMEOUT_S) -> tuple:
    """Run a decoder, reading its stdout as a stream: -> (output, stderr, status), status its exit code, "over" when
    its output passed `cap` bytes (it is killed at once, so at most `cap` plus one pipe read is ever held), or
    "timeout" (killed)."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    errors: list[bytes] = []
    drain = threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True)  # never blocks ffmpeg
    drain.start()
    timed_out = threading.Event()

    def expire() -> None:
        timed_out.set()
        proc.kill()

    timer = threading.Timer(timeout_s, expire)
    timer.start()
    out, status = bytearray(), None
    try:
        while chunk := proc.stdout.read(1 << 20):
            out += chunk
            if cap is not None and len(out) > cap:
                status = "over"
                proc.kill()
                break
        proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        drain.join(timeout=5)
    if status is None:
        status = "timeout" if timed_out.is_set() else proc.returncode
    if status == "over":
        del out[:]                                  # the caller refuses: let the memory go now
    return out, b"".join(errors), status
