"""Frames read back from a completed video's MP4: the last one (a remix's first frame, on an image-to-video model) and
a spread of them (the `spritesheet` variant of `GET /v1/videos/{id}/content`, as the openai client asks for it).

Decoded with PyAV, keeping only the frames asked for (a long video is never held whole). The spritesheet is a PNG
grid: up to `SPRITES` frames spread evenly from the first to the last, `COLUMNS` a row, each scaled so that its
longer side is at most `TILE` pixels; made on demand and kept for the few videos asked last.
"""

from __future__ import annotations

import io
import math
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

SPRITES, COLUMNS, TILE = 25, 5, 160
_CACHE: OrderedDict = OrderedDict()          # (path, size, mtime) -> PNG bytes
_CACHE_SIZE = 16
_LOCK = threading.Lock()


def frames_at(path: str | Path, pick) -> list[np.ndarray]:
    """(H, W, 3) uint8 frames of the MP4 at the indexes `pick(count)` returns (count: the frames in the file)."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        count = stream.frames or sum(1 for _ in container.decode(video=0))
        if not stream.frames:
            container.seek(0)
        wanted = sorted(set(pick(count)))
        out, index = {}, 0
        for frame in container.decode(video=0):
            if index in wanted:
                out[index] = frame.to_ndarray(format="rgb24")
                if len(out) == len(wanted):
                    break
            index += 1
    return [out[i] for i in wanted if i in out]


def last_frame(path: str | Path) -> np.ndarray:
    """The video's last frame, (H, W, 3) uint8."""
    frames = frames_at(path, lambda n: [max(0, n - 1)])
    if not frames:
        raise ValueError(f"{Path(path).name} has no frame")
    return frames[-1]


def spread(count: int, most: int = SPRITES) -> list[int]:
    """Up to `most` frame indexes from the first to the last, evenly spaced."""
    if count <= most:
        return list(range(count))
    return [round(i * (count - 1) / (most - 1)) for i in range(most)]


def spritesheet(path: str | Path) -> bytes:
    """The PNG grid of the video's frames (the module docstring); cached by the file's path, size and time."""
    from PIL import Image

    stat = Path(path).stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    frames = frames_at(path, spread)
    height, width = frames[0].shape[:2]
    scale = min(1.0, TILE / max(height, width))
    tw, th = max(1, round(width * scale)), max(1, round(height * scale))
    columns = min(COLUMNS, len(frames))
    sheet = Image.new("RGB", (columns * tw, math.ceil(len(frames) / columns) * th))
    for i, frame in enumerate(frames):
        tile = Image.fromarray(frame).resize((tw, th), Image.Resampling.BILINEAR)
        sheet.paste(tile, ((i % columns) * tw, (i // columns) * th))
    buffer = io.BytesIO()
    sheet.save(buffer, format="PNG")
    data = buffer.getvalue()
    with _LOCK:
        _CACHE[key] = data
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return data
