"""A video's sound (LTX-2 makes it with the picture): float32 samples (channels, n) in [-1, 1] at a rate, muxed into
an MP4 beside its picture as an AAC track (every browser plays it). One function for every door: `VideoOutput.save`
(Python), `longserve generate` and the server's writer (`server.media.FragmentedMP4Writer.add_audio`)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from longserve.engine.outputs import Sound

AAC_BITRATE = "128k"


def as_sound(samples, rate) -> Sound:
    """Checked (channels, n) float32 samples (a batch's first row if given (B, channels, n))."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim == 3:
        samples = samples[0]
    if samples.ndim == 1:
        samples = samples[None]
    if samples.ndim != 2 or not 1 <= samples.shape[0] <= 8 or samples.shape[1] < 1:
        raise ValueError(f"sound must be (channels, samples) with 1 to 8 channels; got {samples.shape}")
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or not 1000 <= rate <= 384000:
        raise ValueError(f"the sound's rate must be an integer number of Hz in [1000, 384000]; got {rate!r}")
    return Sound(np.clip(np.nan_to_num(samples), -1.0, 1.0), int(rate))


def mux_audio(video_path: str | os.PathLike, out_path: str | os.PathLike, sound: Sound,
              timeout_s: float = 300.0) -> None:
    """Write `out_path`: the picture of the MP4 at `video_path` (copied, not re-encoded) with `sound` as an AAC track,
    the index at the front (`+faststart`: a player starts before the whole file is read). `out_path` may be
    `video_path` (it is replaced once the new file is complete)."""
    import imageio_ffmpeg

    out_path = Path(out_path)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.stem}.", suffix=".mp4", dir=out_path.parent)
    os.close(fd)
    try:
        raw = np.ascontiguousarray(sound.samples.T).astype("<f4").tobytes()      # interleaved f32le
        cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-nostdin", "-y",
               "-i", str(video_path), "-f", "f32le", "-ar", str(sound.rate), "-ac", str(sound.samples.shape[0]),
               "-i", "pipe:0", "-map", "0:v:0", "-map", "1:a:0", "-c:v", "copy", "-c:a", "aac", "-b:a", AAC_BITRATE,
               "-movflags", "+faststart", "-f", "mp4", tmp]
        done = subprocess.run(cmd, input=raw, capture_output=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"muxing the sound failed: {done.stderr.decode(errors='replace').strip()[-300:]}")
        os.replace(tmp, out_path)
    finally:
        Path(tmp).unlink(missing_ok=True)
