"""Writing videos as they are decoded: frames -> ffmpeg -> a fragmented MP4 that grows on disk.

`FragmentedMP4Writer` pipes raw RGB frames into the ffmpeg binary that imageio-ffmpeg
ships, encoding H.264 into a *fragmented* MP4 (`-movflags frag_keyframe+empty_moov`):
the header comes first and every keyframe starts a self-contained fragment, so the file
is playable while it grows. ffmpeg writes to its stdout; a pump thread appends those bytes
to `<id>.mp4.part`, from which `GET /content?stream=true` tails (woken by `grown`, a
`server.notify.Notifier`, after every chunk); when the last frame is in, the part file is
fsynced and becomes `<id>.mp4` (its directory fsynced too), the stored video. One encode
serves both. A video's sound given at the start (`sound`) is a second input and an AAC track in the same fragments,
so the stream carries it too; one given later (`add_audio`) is muxed into the stored file when the picture is done.

Each writer owns its threads: a feeder that takes frames from a small bounded hand-off queue
and writes them into ffmpeg's stdin, and the pump. So the caller never blocks on ffmpeg's pipe:
`write` waits for room in the hand-off for at most `stall_timeout_s` (then the writer fails:
the encoder stalled), `write_async` waits the same way without holding a thread. A failed
write to disk (a full disk: ENOSPC) kills ffmpeg while the pump keeps draining its output,
so nothing waits on a full pipe, and the writer ends with `error_code` "storage_full" (or
"storage_error"; "encoding_failed" for ffmpeg's own failures). `done` is always set and the
`finish` callback always runs, whatever failed.
"""

from __future__ import annotations

import collections
import errno
import functools
import logging
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from longserve.server.notify import Notifier

log = logging.getLogger("longserve.media")

#: errnos that mean "no space left" (a full file system, or the user's disk quota)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
#: chunks of frames waiting for ffmpeg, per writer (each is one decode chunk: a few frames)
HANDOFF_CHUNKS = 2


def ffmpeg_exe() -> str:
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe()


@functools.lru_cache(maxsize=None)
def ffmpeg_version(exe: str) -> tuple[int, int]:
    """(major, minor) of the ffmpeg binary `exe` ((99, 0) when its banner does not say: assume a new one)."""
    import re

    try:
        banner = subprocess.run([exe, "-version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return (99, 0)
    m = re.match(r"ffmpeg version n?(\d+)\.(\d+)", banner)
    return (int(m[1]), int(m[2])) if m else (99, 0)


def passthrough_timestamps(exe: str) -> list[str]:
    """ffmpeg's option that keeps every frame's timestamp as given: `-fps_mode passthrough` from ffmpeg 5.1 (the
    binary imageio-ffmpeg ships), `-vsync passthrough` before it (an older ffmpeg named by IMAGEIO_FFMPEG_EXE)."""
    return ["-fps_mode", "passthrough"] if ffmpeg_version(exe) >= (5, 1) else ["-vsync", "passthrough"]


def storage_error_code(exc: BaseException) -> str | None:
    """"storage_full" for a full disk (ENOSPC, EDQUOT, SQLite's "database or disk is full"), "storage_error" for
    any other failed file or database write, None if `exc` is not a storage error."""
    import sqlite3

    if isinstance(exc, sqlite3.Error):
        full = getattr(exc, "sqlite_errorcode", None) == 13 or "disk is full" in str(exc)   # 13: SQLITE_FULL
        return "storage_full" if full else "storage_error"
    if isinstance(exc, OSError):
        return "storage_full" if exc.errno in NO_SPACE else "storage_error"
    return None


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FragmentedMP4Writer:
    """Encode uint8 frames (n, H, W, 3) as they arrive. Not thread-safe for writers (one producer);
    any number of readers may tail `part_path` and wait on `done`."""

    def __init__(self, part_path: Path, final_path: Path, width: int, height: int, fps: int,
                 keyframe_interval: int = 8, stall_timeout_s: float = 60.0, sound=None):
        self.part_path = Path(part_path)
        self.final_path = Path(final_path)
        self.width, self.height = width, height
        self.stall_timeout_s = stall_timeout_s
        self.done = threading.Event()       # set when the writer is finished, successfully or not
        self.grown = Notifier()             # notified after every chunk appended to part_path, and when done
        self.ok = False                     # True once final_path holds the complete, fsynced video
        self.error: str | None = None
        self.error_code: str | None = None  # storage_full | storage_error | encoding_failed, once failed
        self.bytes_written = 0
        self.frames_written = 0
        self._aborted = False
        self.sound = None                   # pipelines.sound.Sound, muxed in as an AAC track when the picture is done
        #: the sound given at the start (`sound`): an AAC track in the fragments themselves, beside the picture
        self.streams_sound = sound is not None
        self._sound_path: Path | None = None
        self._on_done: Callable[[bool, str | None], None] | None = None
        self._done_lock = threading.Lock()
        # the hand-off: chunks of (bytes, frames) for the feeder, at most HANDOFF_CHUNKS; `_input_closed` once
        # `finish` or `abort` was called (never waits for room)
        self._pending: collections.deque = collections.deque()
        self._input_closed = False
        self._cv = threading.Condition()
        self._taken = Notifier()            # the feeder took a chunk (room in the hand-off), or the writer ended
        self._stderr = tempfile.TemporaryFile()
        self.part_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-nostdin",
               "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}", "-r", str(fps), "-i", "pipe:0",
               *(self._sound_input(sound) if sound is not None else ["-an"]),
               "-c:v", "libx264", "-preset", "veryfast", "-tune", "zerolatency", "-crf", "20",
               "-pix_fmt", "yuv420p", "-g", str(max(1, keyframe_interval)),
               # with sound, the header waits for the first fragment (delay_moov), so that it can hold the AAC
               # track's edit list: the encoder's priming samples are trimmed, and the sound starts with the picture
               "-movflags", "frag_keyframe+empty_moov+default_base_moof" + ("+delay_moov" if sound is not None else ""),
               "-f", "mp4", "pipe:1"]
        self._file = open(self.part_path, "wb")
        # the encoder yields the CPU to the workers: a video written a little later, never slower steps
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      bufsize=0, preexec_fn=lower_priority if os.name == "posix" else None)
        name = self.final_path.stem
        self._feeder = threading.Thread(target=self._feed_input, name=f"mp4-feed-{name}", daemon=True)
        self._pump = threading.Thread(target=self._pump_output, name=f"mp4-writer-{name}", daemon=True)
        self._feeder.start()
        self._pump.start()

    @property
    def failed(self) -> bool:
        return self.error_code is not None

    # -- the producer's side -------------------------------------------------------------------------

    def _check(self, frames: np.ndarray) -> bytes:
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[1:] != (self.height, self.width, 3):
            raise ValueError(f"frames must be uint8 (n, {self.height}, {self.width}, 3); got {frames.dtype} "
                             f"{tuple(frames.shape)}")
        return np.ascontiguousarray(frames).tobytes()

    def write(self, frames: np.ndarray) -> None:
        """frames: uint8 (n, H, W, 3). Waits for room in the hand-off at most `stall_timeout_s`; a writer that
        failed (see `error_code`) takes nothing more."""
        data = self._check(frames)
        with self._cv:
            if not self._cv.wait_for(lambda: self._stopped() or len(self._pending) < HANDOFF_CHUNKS,
                                     timeout=self.stall_timeout_s):
                stalled = True
            else:
                stalled = False
                if not self._stopped():
                    self._pending.append((data, len(frames)))
                    self._cv.notify_all()
        if stalled:
            self._stalled()

    async def write_async(self, frames: np.ndarray) -> None:
        """`write` for a coroutine: waits for room in the hand-off without holding a thread."""
        data = self._check(frames)
        deadline = time.monotonic() + self.stall_timeout_s
        while True:
            version = self._taken.version
            with self._cv:
                if self._stopped():
                    return
                if len(self._pending) < HANDOFF_CHUNKS:
                    self._pending.append((data, len(frames)))
                    self._cv.notify_all()
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                self._stalled()
                return
            await self._taken.wait_after(version, timeout=left)

    def _stopped(self) -> bool:
        return self.done.is_set() or self._aborted or self.failed or self._input_closed

    def _stalled(self) -> None:
        self._fail("encoding_failed", f"the encoder took no frames for {self.stall_timeout_s:g} s")

    def _sound_input(self, sound) -> list[str]:
        """ffmpeg's second input, the whole sound (`pipelines.sound.Sound`) as raw float32 in a file beside the part
        file, and the options that put it in the fragments as an AAC track: ffmpeg reads its inputs in time order,
        so every fragment holds the picture's frames and the sound of the same span."""
        from longserve.pipelines.sound import AAC_BITRATE

        self._sound_path = self.part_path.with_name(f".{self.part_path.name}.f32")
        self._sound_path.write_bytes(np.ascontiguousarray(sound.samples.T).astype("<f4").tobytes())   # interleaved
        return ["-f", "f32le", "-ar", str(sound.rate), "-ac", str(sound.samples.shape[0]), "-i", str(self._sound_path),
                "-map", "0:v:0", "-map", "1:a:0", "-c:a", "aac", "-b:a", AAC_BITRATE,
                "-max_muxing_queue_size", "65536"]   # the sound is all there before the first frame is

    def add_audio(self, samples, rate: int) -> None:
        """The video's sound, (channels, n) float32 at `rate` Hz (before `finish`), when the writer did not start with
        it: once the picture is complete, the final file is the picture with the sound as an AAC track
        (`pipelines.sound.mux_audio`); the part file that readers tail while the video is made holds the picture
        alone (its fragments were written before the sound existed). Nothing for a writer that streams its sound."""
        from longserve.pipelines.sound import as_sound

        if not self.streams_sound:
            self.sound = as_sound(samples, rate)

    def finish(self, on_done: Callable[[bool, str | None], None] | None = None) -> None:
        """No more frames. Returns at once; `on_done(ok, error)` runs once the file is complete (or the writer
        failed): always, exactly once, unless the writer was aborted."""
        with self._done_lock:
            self._on_done = on_done
            finished_already = self.done.is_set()
        if finished_already:
            if on_done is not None and not self._aborted:
                on_done(self.ok, self.error)  # ffmpeg had already stopped (it failed)
            return
        self._close_input()

    def abort(self) -> None:
        """Stop now and remove what was written (a cancelled or failed job)."""
        self._aborted = True
        self._kill()
        self._close_input()
        self.done.wait(10)
        self.part_path.unlink(missing_ok=True)

    def _close_input(self) -> None:
        with self._cv:
            self._input_closed = True
            self._cv.notify_all()

    # -- the writer's own threads --------------------------------------------------------------------

    def _fail(self, code: str, message: str) -> None:
        """Record the first failure and stop ffmpeg (its output is drained by the pump until it exits)."""
        with self._done_lock:
            if self.error_code is None:
                self.error_code, self.error = code, message
        self._kill()
        with self._cv:
            self._cv.notify_all()
        self._taken.notify()

    def _kill(self) -> None:
        try:
            self._proc.kill()
        except OSError:
            pass

    def _feed_input(self) -> None:
        """Frames from the hand-off into ffmpeg's stdin (this job's own thread may block on the pipe); the input
        is closed once `finish` was called and every chunk is in, or at once when the writer failed."""
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._pending or self._input_closed or self.failed or self._aborted)
                    if self.failed or self._aborted or not self._pending:
                        self._pending.clear()
                        break
                    data, n = self._pending.popleft()
                    self._cv.notify_all()
                self._taken.notify()
                try:
                    self._proc.stdin.write(data)
                    self.frames_written += n
                except (BrokenPipeError, OSError) as e:
                    if not (self.failed or self._aborted):
                        self._fail("encoding_failed", f"ffmpeg stopped accepting frames: {e}")
        finally:
            try:
                self._proc.stdin.close()
            except OSError:
                pass

    def _pump_output(self) -> None:
        """ffmpeg's stdout into the part file. After a failed write it keeps draining (ffmpeg, killed, exits),
        so nothing ever blocks on a full pipe; whatever fails, `done` is set and the callback runs."""
        try:
            while True:
                chunk = self._proc.stdout.read(1 << 16)
                if not chunk:
                    break
                if self.failed or self._aborted:
                    continue                     # drain: ffmpeg must never block on a full pipe
                try:
                    self._file.write(chunk)
                    self._file.flush()
                except OSError as e:
                    self._fail(storage_error_code(e), f"writing the video failed: {e}")
                    continue
                self.bytes_written += len(chunk)
                self.grown.notify()
            code = self._proc.wait()
            if not (self.failed or self._aborted) and code != 0:
                self._stderr.seek(0)
                detail = self._stderr.read().decode(errors="replace").strip()[-500:]
                self._fail("encoding_failed", f"ffmpeg exited with code {code}: {detail}")
            if not (self.failed or self._aborted):
                self._commit()
        except BaseException as e:      # noqa: BLE001 - whatever happens, done is set and the callback runs
            self._fail(storage_error_code(e) or "encoding_failed", f"writing the video failed: {e}")
        finally:
            self._close_quietly()
            if self._aborted:
                self.error = self.error or "aborted"
            self.ok = not self.failed and not self._aborted
            with self._done_lock:
                self.done.set()
                on_done = self._on_done
            self._taken.notify()
            self.grown.notify()
            if on_done is not None and not self._aborted:
                try:
                    on_done(self.ok, self.error)
                except Exception:
                    log.exception("video writer completion callback failed")

    def _commit(self) -> None:
        """The complete file made durable (data, then the rename): a record that says completed never points at
        a file that a crash could leave short."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            if self.sound is not None:
                from longserve.pipelines.sound import mux_audio

                try:
                    mux_audio(self.part_path, self.part_path, self.sound)
                except (RuntimeError, subprocess.SubprocessError) as e:
                    self._fail("encoding_failed", str(e))
                    return
            if self.part_path != self.final_path:
                os.replace(self.part_path, self.final_path)
            fsync_dir(self.final_path.parent)
        except OSError as e:
            self._fail(storage_error_code(e), f"writing the video failed: {e}")

    def _close_quietly(self) -> None:
        if self._sound_path is not None:
            self._sound_path.unlink(missing_ok=True)
        for close in (self._file.close, self._stderr.close):
            try:
                close()
            except OSError as e:     # a close that flushes onto a full disk
                if not (self.failed or self._aborted):
                    self._fail(storage_error_code(e), f"writing the video failed: {e}")
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._kill()


ENCODER_NICENESS = 10


def lower_priority() -> None:
    os.nice(ENCODER_NICENESS)


def write_png(path: Path, frame: np.ndarray) -> None:
    """frame: uint8 (H, W, 3) -> a PNG at `path` (written to a temporary name, fsynced, then renamed)."""
    from PIL import Image

    tmp = Path(str(path) + ".tmp")
    try:
        with open(tmp, "wb") as f:
            Image.fromarray(frame).save(f, format="PNG")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


__all__ = ["FragmentedMP4Writer", "write_png", "storage_error_code", "fsync_dir", "ffmpeg_exe", "NO_SPACE"]
