"""Live video as fragmented MP4, one self-contained run of boxes per chunk: frames -> ffmpeg (H.264 in FLV) -> fMP4.

A live session produces frames a chunk at a time and sends one binary WebSocket message per
chunk; the messages concatenated are one fragmented MP4 (the first holds the init segment,
`ftyp` + `moov`, then every message is a `moof` + `mdat` holding exactly that chunk's frames).
`ChunkMuxer.push(frames)` returns a chunk's bytes as soon as its last frame is encoded.

Why not ffmpeg's own MP4 muxer (what `server.media.FragmentedMP4Writer` uses for stored
videos): it cuts a fragment only when the *next* packet arrives (`frag_every_frame`,
`frag_keyframe` and `frag_duration` are all checked on arrival; only the library call
`av_write_frame(s, NULL)` flushes, which the ffmpeg command line never makes), so the
last frame of every chunk would come out one chunk late. Measured with the ffmpeg that
imageio-ffmpeg ships: 11 of 12 frames per push, the 12th at the start of the next one.

So the same ffmpeg binary (no new dependency) encodes libx264 with `-tune zerolatency`
(no lookahead, no B-frames: one packet out per frame in, at once) into FLV on its stdout,
a tag per packet, written as it comes (`-flush_packets 1`). FLV is only the transport: its
tags are length-framed (so a frame's end is known without waiting for the next one), its
sequence header carries the `avcC` record and its video tags carry each frame already in
MP4's sample format (length-prefixed NAL units) with a keyframe flag. A reader thread
parses the tags (it must run beside the writes: ffmpeg stops reading frames when its
output is not drained); `push` writes the raw rgb24 frames to ffmpeg's stdin and waits for
exactly that many samples, then writes the boxes itself: `ftyp` + `moov` (an empty sample
table, `mvex`/`trex`) once, and per chunk `moof` (`mfhd`, `traf` with `tfhd`
default-base-is-moof, `tfdt`, and a `trun` with every sample's size and sync flag) + `mdat`.
Every frame lasts 1/fps (timescale 1000 * fps); timestamps in the FLV (milliseconds) are
not used.

Keyframes are the encoder's (x264's interval and scene cuts), not forced at chunk starts:
the command line cannot be told where a chunk starts, and a stream read from its start
needs only the first. `keyframe_interval` sets the interval, so that a client that joins
late (or reconnects) can be sent `init_segment` + the messages from one whose fragment
starts with a keyframe (`last_push_keyframe`).

The encoder runs at lowered priority (like media.py's) so it yields the CPU to the model
workers. One producer; `push` and `close` may run on any thread (a worker's), and `close`
from another thread during a `push` stops the encoder, making that push raise.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import subprocess
import tempfile
import threading
import time
import weakref
from typing import IO

import numpy as np

from longserve.server.media import ffmpeg_exe, lower_priority, passthrough_timestamps

log = logging.getLogger("longserve.live_media")

X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow",
                "placebo")

#: media time units per frame (the track timescale is this times fps)
TICKS_PER_FRAME = 1000

# trun sample flags: a sync sample depends on no other (sample_depends_on = 2); any other
# depends on earlier ones (sample_depends_on = 1) and is a non-sync sample
SYNC_SAMPLE_FLAGS = 0x02000000
NON_SYNC_SAMPLE_FLAGS = 0x01010000

_UNITY_MATRIX = struct.pack(">9I", 0x00010000, 0, 0, 0, 0x00010000, 0, 0, 0, 0x40000000)


class _EncoderEnd:
    """Queued by the reader thread when ffmpeg's output ends (error: why it ended early, if it did)."""

    def __init__(self, error: str | None = None):
        self.error = error


class ChunkMuxer:
    """uint8 frames in, one self-contained run of fMP4 boxes out per push (the first with the init segment).

    push(frames) -> bytes: exactly those frames, as `moof` + `mdat` (preceded by `ftyp` + `moov` the first
    time). close() -> bytes: whatever is left (normally b""); frees the encoder; safe to call twice and
    after errors. A failed or killed encoder makes push raise RuntimeError (and every push after it).
    """

    def __init__(self, width: int, height: int, fps: int, *, crf: int = 20, preset: str = "veryfast",
                 keyframe_interval: int | None = None, timeout: float = 60.0):
        if width <= 0 or height <= 0 or width % 2 or height % 2:
            raise ValueError(f"H.264 needs a positive even width and height; got {width}x{height}")
        if int(fps) != fps or fps <= 0:
            raise ValueError(f"fps must be a positive integer; got {fps!r}")
        # checked here: an encoder that cannot open leaves ffmpeg running, silent, until its input ends
        if preset not in X264_PRESETS:
            raise ValueError(f"preset must be one of {', '.join(X264_PRESETS)}; got {preset!r}")
        if not 0 <= crf <= 51:
            raise ValueError(f"crf must be in 0..51; got {crf}")
        self.width, self.height, self.fps = width, height, int(fps)
        self.timescale = TICKS_PER_FRAME * self.fps
        self.timeout = timeout
        self.init_segment: bytes | None = None  # ftyp + moov, once the encoder has said what it makes
        self.frames_written = 0                 # frames whose boxes push() has returned
        self.bytes_written = 0
        self.last_push_keyframe = False         # whether the last push's fragment starts with a keyframe
        self.error: str | None = None
        self._closed = False
        self._sequence = 0                      # mfhd sequence_number of the last fragment
        self._avcc: bytes | None = None
        self._lock = threading.Lock()           # one push or close at a time
        self._fail_lock = threading.Lock()      # _fail from close() during a push
        self._samples: queue.Queue = queue.Queue()
        self._stderr = tempfile.TemporaryFile()
        exe = ffmpeg_exe()
        cmd = [exe, "-hide_banner", "-loglevel", "error", "-nostdin",
               "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}", "-r", str(self.fps), "-i", "pipe:0",
               "-an", "-c:v", "libx264", "-preset", preset, "-tune", "zerolatency", "-crf", str(crf), "-bf", "0",
               "-pix_fmt", "yuv420p", *passthrough_timestamps(exe)]
        if keyframe_interval is not None:
            cmd += ["-g", str(max(1, keyframe_interval))]
        cmd += ["-flush_packets", "1", "-f", "flv", "pipe:1"]
        # the encoder yields the CPU to the workers (media.py's niceness)
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      bufsize=0, preexec_fn=lower_priority if os.name == "posix" else None)
        self._reader = threading.Thread(target=_read_flv, args=(self._proc.stdout, self._samples),
                                        name="live-mp4-reader", daemon=True)
        self._reader.start()
        # a muxer dropped without close() leaves no ffmpeg behind
        self._finalizer = weakref.finalize(self, _kill, self._proc)

    def __enter__(self) -> ChunkMuxer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def push(self, frames: np.ndarray) -> bytes:
        """frames: uint8 (n, H, W, 3) -> the boxes holding exactly these n frames (b"" when n is 0)."""
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 \
                or frames.shape[1:] != (self.height, self.width, 3):
            got = f"{frames.dtype} {tuple(frames.shape)}" if isinstance(frames, np.ndarray) else type(frames).__name__
            raise ValueError(f"frames must be uint8 (n, {self.height}, {self.width}, 3); got {got}")
        with self._lock:
            if self._closed:
                raise RuntimeError("the muxer is closed")
            if self.error is not None:
                raise RuntimeError(self.error)
            n = len(frames)
            if n == 0:
                return b""
            try:
                _write_all(self._proc.stdin, np.ascontiguousarray(frames))
            except (BrokenPipeError, OSError) as e:
                raise RuntimeError(self._fail(f"ffmpeg stopped accepting frames ({e})")) from None
            deadline = time.monotonic() + self.timeout
            samples = []
            while len(samples) < n:
                try:
                    item = self._samples.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    error = f"ffmpeg made {len(samples)} of {n} frames in {self.timeout:g} s"
                    raise RuntimeError(self._fail(error)) from None
                if isinstance(item, _EncoderEnd):
                    raise RuntimeError(self._fail(item.error or f"ffmpeg ended after {len(samples)} of {n} frames"))
                self._take(item, samples)
            return self._fragment(samples)

    def close(self) -> bytes:
        """No more frames: ends the encoder and returns what it still held (normally b"")."""
        if not self._lock.acquire(blocking=False):
            # a push is waiting on the encoder (from another thread): stop it, which ends that push
            self._fail("the muxer was closed during a push")
            self._lock.acquire()
        try:
            if self._closed:
                return b""
            self._closed = True
            samples: list[tuple[bytes, bool]] = []
            failed_before = self.error is not None
            if not failed_before:
                try:
                    self._drain(samples)
                except RuntimeError:
                    pass                        # recorded in self.error
            self._release()
            if self.error is not None:
                if not failed_before:           # (a push already raised the earlier ones)
                    log.warning("%s", self.error)
                return b""
            return self._fragment(samples) if samples else b""
        finally:
            self._lock.release()

    # -- internals ---------------------------------------------------------------------------------------------

    def _drain(self, samples: list[tuple[bytes, bool]]) -> None:
        """End ffmpeg's input and collect what it still writes, until it exits."""
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                item = self._samples.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(self._fail(f"ffmpeg did not finish in {self.timeout:g} s")) from None
            if isinstance(item, _EncoderEnd):
                if item.error is not None:
                    raise RuntimeError(self._fail(item.error))
                break
            self._take(item, samples)
        code = self._wait()
        if code != 0:
            raise RuntimeError(self._fail("ffmpeg failed finishing the stream"))

    def _take(self, item: tuple[str, bytes, bool], samples: list[tuple[bytes, bool]]) -> None:
        kind, data, key = item
        if kind == "config":
            if self._avcc is not None and data != self._avcc:
                raise RuntimeError(self._fail("the encoder changed its H.264 parameters mid-stream"))
            self._avcc = data
        else:
            samples.append((data, key))

    def _fragment(self, samples: list[tuple[bytes, bool]]) -> bytes:
        head = b""
        if self.init_segment is None:
            if self._avcc is None:
                raise RuntimeError(self._fail("ffmpeg sent frames before the H.264 parameters"))
            self.init_segment = head = self._init_boxes()
        self._sequence += 1
        out = head + self._fragment_boxes(samples, self.frames_written * TICKS_PER_FRAME, self._sequence)
        self.frames_written += len(samples)
        self.bytes_written += len(out)
        self.last_push_keyframe = samples[0][1]
        return out

    def _init_boxes(self) -> bytes:
        ftyp = _box(b"ftyp", b"isom", struct.pack(">I", 0x200), b"isom", b"iso6", b"avc1", b"mp41")
        mvhd = _full_box(b"mvhd", 0, 0, struct.pack(">IIII", 0, 0, self.timescale, 0),
                         struct.pack(">IH10x", 0x00010000, 0x0100), _UNITY_MATRIX, bytes(24), struct.pack(">I", 2))
        tkhd = _full_box(b"tkhd", 0, 3, struct.pack(">IIIII", 0, 0, 1, 0, 0), bytes(8),
                         struct.pack(">hhhH", 0, 0, 0, 0), _UNITY_MATRIX,
                         struct.pack(">II", self.width << 16, self.height << 16))
        mdhd = _full_box(b"mdhd", 0, 0, struct.pack(">IIII", 0, 0, self.timescale, 0),
                         struct.pack(">HH", _language("und"), 0))
        hdlr = _full_box(b"hdlr", 0, 0, struct.pack(">I4s12x", 0, b"vide"), b"VideoHandler\0")
        vmhd = _full_box(b"vmhd", 0, 1, bytes(8))
        dinf = _box(b"dinf", _full_box(b"dref", 0, 0, struct.pack(">I", 1), _full_box(b"url ", 0, 1)))
        avc1 = _box(b"avc1", bytes(6), struct.pack(">H", 1), bytes(16),
                    struct.pack(">HHIIIH", self.width, self.height, 0x00480000, 0x00480000, 0, 1),
                    bytes(32), struct.pack(">Hh", 0x0018, -1), _box(b"avcC", self._avcc))
        stbl = _box(b"stbl", _full_box(b"stsd", 0, 0, struct.pack(">I", 1), avc1),
                    _full_box(b"stts", 0, 0, struct.pack(">I", 0)), _full_box(b"stsc", 0, 0, struct.pack(">I", 0)),
                    _full_box(b"stsz", 0, 0, struct.pack(">II", 0, 0)), _full_box(b"stco", 0, 0, struct.pack(">I", 0)))
        trak = _box(b"trak", tkhd, _box(b"mdia", mdhd, hdlr, _box(b"minf", vmhd, dinf, stbl)))
        trex = _full_box(b"trex", 0, 0, struct.pack(">IIIII", 1, 1, TICKS_PER_FRAME, 0, NON_SYNC_SAMPLE_FLAGS))
        return ftyp + _box(b"moov", mvhd, trak, _box(b"mvex", trex))

    @staticmethod
    def _fragment_boxes(samples: list[tuple[bytes, bool]], decode_time: int, sequence: int) -> bytes:
        mfhd = _full_box(b"mfhd", 0, 0, struct.pack(">I", sequence))
        # default-base-is-moof | default-sample-duration-present
        tfhd = _full_box(b"tfhd", 0, 0x020008, struct.pack(">II", 1, TICKS_PER_FRAME))
        tfdt = _full_box(b"tfdt", 1, 0, struct.pack(">Q", decode_time))
        entries = b"".join(struct.pack(">II", len(data), SYNC_SAMPLE_FLAGS if key else NON_SYNC_SAMPLE_FLAGS)
                           for data, key in samples)
        # data-offset-present | sample-size-present | sample-flags-present
        trun_size = 8 + 4 + 8 + len(entries)
        moof_size = 8 + len(mfhd) + 8 + len(tfhd) + len(tfdt) + trun_size
        trun = _full_box(b"trun", 0, 0x000601, struct.pack(">Ii", len(samples), moof_size + 8), entries)
        moof = _box(b"moof", mfhd, _box(b"traf", tfhd, tfdt, trun))
        assert len(moof) == moof_size
        payload = b"".join(data for data, _ in samples)
        return moof + struct.pack(">I4s", 8 + len(payload), b"mdat") + payload

    def _fail(self, error: str) -> str:
        """Record the first error, stop ffmpeg, and return the error with ffmpeg's last words."""
        with self._fail_lock:
            if self.error is not None:
                return self.error
            _kill(self._proc)
            code = self._wait()
            detail = ""
            try:
                self._stderr.seek(0)
                # ffmpeg's first words name the cause
                detail = self._stderr.read(2000).decode(errors="replace").strip()[:500]
            except (OSError, ValueError):
                pass
            detail = f": {detail}" if detail else ""
            self.error = f"live video encoder failed: {error} (ffmpeg exit code {code}{detail})"
            return self.error

    def _wait(self) -> int | None:
        try:
            return self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _kill(self._proc)
            return self._proc.wait()

    def _release(self) -> None:
        _kill(self._proc)
        self._wait()
        self._reader.join(timeout=10)
        for f in (self._proc.stdin, self._proc.stdout, self._stderr):
            try:
                f.close()
            except OSError:
                pass
        self._finalizer.detach()


def _read_flv(stream: IO[bytes], out: queue.Queue) -> None:
    """ffmpeg's FLV -> ("config", avcC, False) and ("frame", sample, keyframe) items on `out`, then _EncoderEnd."""
    error = None
    try:
        header = _read_exact(stream, 9)
        if header is None:
            return
        if header[:3] != b"FLV":
            raise ValueError(f"not an FLV stream: {header[:3]!r}")
        if _read_exact(stream, struct.unpack(">I", header[5:9])[0] - 9 + 4) is None:  # rest of header, tag size 0
            return
        while True:
            tag = _read_exact(stream, 11)
            if tag is None:
                return
            size = int.from_bytes(tag[1:4], "big")
            body = _read_exact(stream, size + 4)                     # the tag, then its PreviousTagSize
            if body is None:
                raise ValueError("FLV stream ended inside a tag")
            if tag[0] & 0x1F != 9 or size < 5:                       # not video (script data), or no payload
                continue
            if body[0] & 0x80:
                raise ValueError("ffmpeg wrote an enhanced-FLV video tag; only H.264 (codec id 7) is read here")
            frame_type, codec = body[0] >> 4, body[0] & 0x0F
            if frame_type == 5:                                      # video info / command frame
                continue
            if codec != 7:
                raise ValueError(f"FLV video codec id {codec}, expected 7 (H.264)")
            packet_type, cts = body[1], int.from_bytes(body[2:5], "big", signed=True)
            if packet_type == 0:
                out.put(("config", bytes(body[5:size]), False))
            elif packet_type == 1:
                if cts != 0:
                    raise ValueError(f"a frame with composition offset {cts} ms (B-frames are off)")
                out.put(("frame", bytes(body[5:size]), frame_type == 1))
            # packet_type 2: end of sequence
    except (OSError, ValueError) as e:
        error = f"reading ffmpeg's output: {e}"
    finally:
        out.put(_EncoderEnd(error))


def _read_exact(stream: IO[bytes], n: int) -> bytearray | None:
    """n bytes, or None at end of stream before the first; ValueError when it ends part-way."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = stream.readinto(view[got:])
        if not k:
            if got == 0:
                return None
            raise ValueError(f"stream ended after {got} of {n} bytes")
        got += k
    return buf


def _write_all(stream: IO[bytes], frames: np.ndarray) -> None:
    view = memoryview(frames).cast("B")
    while len(view):
        view = view[stream.write(view):]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            proc.kill()
        except OSError:
            pass


def _box(kind: bytes, *payload: bytes) -> bytes:
    body = b"".join(payload)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def _full_box(kind: bytes, version: int, flags: int, *payload: bytes) -> bytes:
    return _box(kind, struct.pack(">I", (version << 24) | flags), *payload)


def _language(code: str) -> int:
    """ISO 639-2/T code -> mdhd's packed form (three 5-bit letters)."""
    return sum((ord(c) - 0x60) << shift for c, shift in zip(code, (10, 5, 0)))
