"""server.live_media.ChunkMuxer: one self-contained run of fMP4 boxes per chunk, concatenating to one playable MP4."""

from __future__ import annotations

import struct

import imageio_ffmpeg
import numpy as np
import pytest

from longserve.server.live_media import ChunkMuxer

W, H, FPS = 64, 64, 16
# distinct solid colours, one per chunk, and chunk lengths as a live session makes them (9 first, then ~12)
CHUNKS = [((220, 40, 40), 9), ((40, 200, 60), 12), ((50, 60, 210), 10), ((230, 220, 50), 12), ((128, 128, 128), 11)]


def boxes(data: bytes) -> list[tuple[bytes, bytes]]:
    """Top-level MP4 boxes as (type, payload); asserts they tile `data` exactly (4-byte size + 4-byte type,
    64-bit largesize when size is 1)."""
    out, i = [], 0
    while i < len(data):
        assert len(data) - i >= 8, f"{len(data) - i} stray bytes at {i}"
        size, kind = struct.unpack(">I4s", data[i:i + 8])
        head = 8
        if size == 1:
            size, head = struct.unpack(">Q", data[i + 8:i + 16])[0], 16
        assert head <= size <= len(data) - i, f"box {kind!r} at {i}: size {size} does not fit"
        out.append((kind, data[i + head:i + size]))
        i += size
    return out


def sample_count(moof: bytes) -> int:
    """moof payload -> the sample count of its (single) traf's trun."""
    (traf,) = [payload for kind, payload in boxes(moof) if kind == b"traf"]
    (trun,) = [payload for kind, payload in boxes(traf) if kind == b"trun"]
    return struct.unpack(">I", trun[4:8])[0]


def test_each_push_is_its_chunk_and_all_concatenate_to_one_video(tmp_path):
    messages = []
    with ChunkMuxer(W, H, FPS) as muxer:
        for colour, n in CHUNKS:
            frames = np.empty((n, H, W, 3), np.uint8)
            frames[:] = colour
            messages.append(muxer.push(frames))
        tail = muxer.close()
    assert tail == b""
    for k, (message, (_, n)) in enumerate(zip(messages, CHUNKS)):
        kinds = [kind for kind, _ in boxes(message)]
        # the first message: the init segment, then the fragment; later ones: just the fragment
        assert kinds == ([b"ftyp", b"moov"] if k == 0 else []) + [b"moof", b"mdat"], (k, kinds)
        # exactly this chunk's frames: none held back for the next message
        assert sample_count(dict(boxes(message))[b"moof"]) == n
    assert muxer.frames_written == sum(n for _, n in CHUNKS)
    assert muxer.bytes_written == sum(len(m) for m in messages)

    path = tmp_path / "live.mp4"
    path.write_bytes(b"".join(messages))
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    assert meta["size"] == (W, H) and meta["fps"] == FPS
    decoded = np.stack([np.frombuffer(f, np.uint8).reshape(H, W, 3) for f in reader])
    assert len(decoded) == sum(n for _, n in CHUNKS)
    start = 0
    for k, (colour, n) in enumerate(CHUNKS):
        error = np.abs(decoded[start:start + n].astype(np.float64).mean(axis=(1, 2)) - colour).max()
        assert error < 20, f"chunk {k}: decoded colours are {error:.1f}/255 off {colour}"
        start += n


def test_frames_of_the_wrong_kind_are_refused():
    with ChunkMuxer(W, H, FPS) as muxer:
        with pytest.raises(ValueError, match=r"uint8 \(n, 64, 64, 3\); got float32"):
            muxer.push(np.zeros((2, H, W, 3), np.float32))
        with pytest.raises(ValueError, match=r"got uint8 \(2, 32, 64, 3\)"):
            muxer.push(np.zeros((2, 32, W, 3), np.uint8))
        with pytest.raises(ValueError, match=r"got uint8 \(64, 64, 3\)"):
            muxer.push(np.zeros((H, W, 3), np.uint8))
        with pytest.raises(ValueError, match="got list"):
            muxer.push([np.zeros((H, W, 3), np.uint8)])
        assert muxer.push(np.zeros((0, H, W, 3), np.uint8)) == b""
        # refused frames leave the muxer usable
        assert boxes(muxer.push(np.zeros((3, H, W, 3), np.uint8)))[0][0] == b"ftyp"
    with pytest.raises(ValueError, match="even"):
        ChunkMuxer(63, 64, FPS)


def test_close_twice_and_push_after_close():
    muxer = ChunkMuxer(W, H, FPS)
    assert muxer.close() == b""          # nothing pushed: nothing to say
    assert muxer.close() == b""
    with pytest.raises(RuntimeError, match="closed"):
        muxer.push(np.zeros((1, H, W, 3), np.uint8))


def test_a_killed_encoder_fails_the_push_clearly():
    muxer = ChunkMuxer(W, H, FPS)
    assert muxer.push(np.zeros((9, H, W, 3), np.uint8))
    muxer._proc.kill()
    muxer._proc.wait()
    with pytest.raises(RuntimeError, match="live video encoder failed"):
        muxer.push(np.zeros((12, H, W, 3), np.uint8))
    with pytest.raises(RuntimeError, match="live video encoder failed"):  # and every push after it
        muxer.push(np.zeros((12, H, W, 3), np.uint8))
    assert muxer.close() == b""
    assert muxer.close() == b""


def test_an_ffmpeg_older_than_5_1_gets_vsync_not_fps_mode(tmp_path):
    """`-fps_mode` came with ffmpeg 5.1; an older binary named by IMAGEIO_FFMPEG_EXE (a GPU image's ffmpeg 4.2 was
    one) refuses it and the live encoder died at its first push. The option follows the binary's version."""
    from longserve.server.media import ffmpeg_version, passthrough_timestamps

    old = tmp_path / "ffmpeg"
    old.write_text("#!/bin/sh\necho 'ffmpeg version 4.2.2-static https://johnvansickle.com/ffmpeg/'\n")
    old.chmod(0o755)
    assert ffmpeg_version(str(old)) == (4, 2)
    assert passthrough_timestamps(str(old)) == ["-vsync", "passthrough"]
    shipped = imageio_ffmpeg.get_ffmpeg_exe()
    assert ffmpeg_version(shipped) >= (5, 1)
    assert passthrough_timestamps(shipped) == ["-fps_mode", "passthrough"]
