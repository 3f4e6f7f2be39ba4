"""Reading a video to extend: an MP4 file (or its bytes) -> frames (T, H, W, 3) uint8, bounded before decoding.

Every front door that takes a video goes through `read_mp4`: `VideoPipeline` (`video="in.mp4"`), `longserve
generate --video`, the server's `input_reference` upload and its `/extend` of a stored video. The order of the
checks is the point, as for uploaded images (`server/api/uploads.py`):

1. the bytes' own signature: an ISO base media file (`ftyp` box first: MP4, MOV); nothing else is handed to
   ffmpeg, which is then told the demuxer (`-f mov`) instead of guessing one from the content;
2. the header (`ffmpeg -i`, which reads the container's boxes and no frame) gives the frame size and an
   estimate of the frame count (duration x fps), checked against the caller's limits BEFORE any frame is
   decoded, so a small file that declares a huge video costs nothing;
3. the frames are decoded (the first video stream, as RGB, at most `max_frames + 1` of them: a header that
   lies is caught here), with `-xerror`: a truncated or damaged file fails instead of yielding what was
   readable.

Frames keep their coded orientation (`-noautorotate`) so that their size is the header's.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from longserve.engine.request import RequestError

#: how long ffmpeg may take over a header or a decode before the file is refused
FFMPEG_TIMEOUT_S = 120


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
    """The first video stream of an MP4, from its header only: {"width", "height", "fps", "frames"} (frames: an
    estimate from duration x fps, None when either is missing)."""
    try:
        run = subprocess.run([_ffmpeg(), "-hide_banner", "-nostdin", "-f", "mov", "-i", path], capture_output=True,
                             timeout=FFMPEG_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise VideoInputError(field, f"{field}: reading the MP4's header took too long", "invalid_video") from None
    text = run.stderr.decode("utf-8", "replace")
    stream = re.search(r"Stream #\d+:\d+.*?: Video: (.*)", text)
    if stream is None:
        raise VideoInputError(field, f"{field} could not be read as an MP4 video (no video stream; truncated or "
                                     f"damaged?): {_last_lines(run.stderr)}", "invalid_video")
    size = re.search(r", (\d+)x(\d+)\b", stream.group(1))
    if size is None:
        raise VideoInputError(field, f"{field}: the MP4's video stream has no frame size", "invalid_video")
    rate = re.search(r"([\d.]+) (?:fps|tbr)\b", stream.group(1))
    duration = re.search(r"Duration: (\d+):(\d+):(\d+(?:\.\d+)?)", text)
    fps = float(rate.group(1)) if rate else 0.0
    seconds = (int(duration.group(1)) * 3600 + int(duration.group(2)) * 60 + float(duration.group(3))
               if duration else 0.0)
    return {"width": int(size.group(1)), "height": int(size.group(2)), "fps": fps,
            "frames": math.ceil(fps * seconds - 1e-6) if fps > 0 and seconds > 0 else None}


def read_mp4(source: str | os.PathLike | bytes, field: str = "video", max_frames: int | None = None,
             max_pixels: int | None = None, max_total_pixels: int | None = None) -> np.ndarray:
    """An MP4 file (a path, or its bytes) -> its frames (T, H, W, 3) uint8 RGB. `VideoInputError` naming `field`
    (code "unsupported_video", "invalid_video" or "video_too_large") for anything else; see the module doc for
    the order of the checks. Bytes go through a temporary file (ffmpeg seeks in an MP4), removed before the
    return, whatever happens."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise VideoInputError(field, f"{field} is an empty file", "invalid_video")
        if not is_mp4(data[:12]):
            raise VideoInputError(field, f"{field} must be an MP4 video; this file is not one (nor a PNG, JPEG or "
                                         f"WebP image where one is taken)", "unsupported_video")
        fd, tmp = tempfile.mkstemp(prefix="longserve-video-", suffix=".mp4")
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
        raise VideoInputError(field, f"{field} has about {meta['frames']} frames of {width}x{height}; the limit is "
                                     f"{limit} (checked before decoding)", "video_too_large")
    cmd = [_ffmpeg(), "-v", "error", "-xerror", "-nostdin", "-noautorotate", "-f", "mov", "-i", str(path),
           "-map", "0:v:0", *(["-frames:v", str(limit + 1)] if limit is not None else []),
           "-f", "rawvideo", "-pix_fmt", "rgb24", "-"]
    try:
        run = subprocess.run(cmd, capture_output=True, timeout=FFMPEG_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise VideoInputError(field, f"{field}: decoding took too long", "invalid_video") from None
    frame_bytes = width * height * 3
    count, rest = divmod(len(run.stdout), frame_bytes)
    if run.returncode != 0 or rest or count == 0:
        raise VideoInputError(field, f"{field} could not be decoded (a truncated or damaged MP4): "
                                     f"{_last_lines(run.stderr) or 'no frames'}", "invalid_video")
    if limit is not None and count > limit:
        raise VideoInputError(field, f"{field} has more than {limit} frames of {width}x{height}; the limit is "
                                     f"{limit}", "video_too_large")
    return np.frombuffer(run.stdout, dtype=np.uint8).reshape(count, height, width, 3)      # (T, H, W, 3)
