"""What an MP4's tracks hold, read with PyAV (ffmpeg's libraries: what ffprobe reports)."""

from __future__ import annotations

import io


def tracks(mp4: bytes | str) -> dict:
    """{"video": (frames, width, height) or None, "audio": (codec, channels, rate, seconds) or None}."""
    import av

    with av.open(io.BytesIO(mp4) if isinstance(mp4, (bytes, bytearray)) else mp4, format="mov") as c:
        video = audio = None
        if c.streams.video:
            v = c.streams.video[0]
            video = (sum(1 for _ in c.decode(v)), v.codec_context.width, v.codec_context.height)
    with av.open(io.BytesIO(mp4) if isinstance(mp4, (bytes, bytearray)) else mp4, format="mov") as c:
        if c.streams.audio:
            a = c.streams.audio[0]
            samples = sum(f.samples for f in c.decode(a))
            audio = (a.codec_context.name, a.codec_context.channels, a.codec_context.sample_rate,
                     samples / a.codec_context.sample_rate)
    return {"video": video, "audio": audio}
