"""Writing videos as they are decoded: frames -> ffmpeg -> a fragmented MP4 that grows on disk.

`FragmentedMP4Writer` pipes raw RGB frames into the ffmpeg binary that imageio-ffmpeg
ships, encoding H.264 into a *fragmented* MP4 (`-movflags frag_keyframe+empty_moov`):
the header comes first and every keyframe starts a self-contained fragment, so the file
is playable while it grows. ffmpeg writes to its stdout; a pump thread appends those bytes
to `<id>.mp4.part`, from which `GET /content?stream=true` tails (woken by `grown`, a
`server.notify.Notifier`, after every chunk); when the last frame is in, the part file
becomes `<id>.mp4`, the stored video. One encode serves both.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from server.notify import Notifier

log = logging.getLogger("longserve.media")


def ffmpeg_exe() -> str:
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()


class FragmentedMP4Writer:
    """Encode uint8 frames (n, H, W, 3) as they arrive. Not thread-safe for writers (one producer);
    any number of readers may tail `part_path` and wait on `done`."""

    def __init__(self, part_path: Path, final_path: Path, width: int, height: int, fps: int,
                 keyframe_interval: int = 8):
        self.part_path = Path(part_path)
        self.final_path = Path(final_path)
        self.width, self.height = width, height
        self.done = threading.Event()       # set when the writer is finished, successfully or not
        self.grown = Notifier()             # notified after every chunk appended to part_path, and when done
        self.ok = False                     # True once final_path holds the complete video
        self.error: str | None = None
        self.bytes_written = 0
        self.frames_written = 0
        self._aborted = False
        self._on_done: Callable[[bool, str | None], None] | None = None
        self._done_lock = threading.Lock()
        self._stderr = tempfile.TemporaryFile()
        cmd = [ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-nostdin",
               "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}", "-r", str(fps), "-i", "pipe:0",
               "-an", "-c:v", "libx264", "-preset", "veryfast", "-tune", "zerolatency", "-crf", "20",
               "-pix_fmt", "yuv420p", "-g", str(max(1, keyframe_interval)),
               "-movflags", "frag_keyframe+empty_moov+default_base_moof", "-f", "mp4", "pipe:1"]
        self.part_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.part_path, "wb")
        # the encoder yields the CPU to the workers: a video written a little later, never slower steps
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      bufsize=0, preexec_fn=_lower_priority if os.name == "posix" else None)
        self._pump = threading.Thread(target=self._pump_output, name=f"mp4-writer-{self.final_path.stem}",
                                      daemon=True)
        self._pump.start()

    def write(self, frames: np.ndarray) -> None:
        """frames: uint8 (n, H, W, 3)."""
        if self.done.is_set() or self._aborted:
            return
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[1:] != (self.height, self.width, 3):
            raise ValueError(f"frames must be uint8 (n, {self.height}, {self.width}, 3); got {frames.dtype} "
                             f"{tuple(frames.shape)}")
        try:
            self._proc.stdin.write(np.ascontiguousarray(frames).tobytes())
            self.frames_written += len(frames)
        except (BrokenPipeError, OSError) as e:
            self.error = f"ffmpeg stopped accepting frames: {e}"

    def finish(self, on_done: Callable[[bool, str | None], None] | None = None) -> None:
        """No more frames. Returns at once; `on_done(ok, error)` runs once the file is complete."""
        with self._done_lock:
            self._on_done = on_done
            finished_already = self.done.is_set()
        if finished_already and on_done is not None and not self._aborted:
            on_done(self.ok, self.error)  # ffmpeg had already stopped (it failed)
            return
        try:
            self._proc.stdin.close()
        except OSError:
            pass

    def abort(self) -> None:
        """Stop now and remove what was written (a cancelled or failed job)."""
        self._aborted = True
        try:
            self._proc.kill()
        except OSError:
            pass
        self.done.wait(10)
        self.part_path.unlink(missing_ok=True)

    def _pump_output(self) -> None:
        try:
            while True:
                chunk = self._proc.stdout.read(1 << 16)
                if not chunk:
                    break
                self._file.write(chunk)
                self._file.flush()
                self.bytes_written += len(chunk)
                self.grown.notify()
        except OSError as e:
            self.error = self.error or f"writing the video failed: {e}"
        finally:
            code = self._proc.wait()
            self._file.close()
            if self._aborted:
                self.error = self.error or "aborted"
            elif code != 0:
                self._stderr.seek(0)
                detail = self._stderr.read().decode(errors="replace").strip()[-500:]
                self.error = self.error or f"ffmpeg exited with code {code}: {detail}"
            elif self.error is None:
                os.replace(self.part_path, self.final_path)
                self.ok = True
            self._stderr.close()
            with self._done_lock:
                self.done.set()
                on_done = self._on_done
            self.grown.notify()
            if on_done is not None and not self._aborted:
                try:
                    on_done(self.ok, self.error)
                except Exception:
                    log.exception("video writer completion callback failed")


ENCODER_NICENESS = 10


def _lower_priority() -> None:
    os.nice(ENCODER_NICENESS)


def write_png(path: Path, frame: np.ndarray) -> None:
    """frame: uint8 (H, W, 3) -> a PNG at `path` (written to a temporary name, then renamed)."""
    from PIL import Image

    tmp = Path(str(path) + ".tmp")
    Image.fromarray(frame).save(tmp, format="PNG")
    os.replace(tmp, path)
