"""WebRTC for live sessions, beside the WebSocket's fMP4 fragments: a session's frames as a video track (aiortc).

Signalling runs over the live WebSocket (server/api/live.py): the start message carries the browser's offer,

    client -> server   {"type": "start", "prompt": ..., "webrtc": {"type": "offer", "sdp": "..."}}
    server -> client   {"type": "webrtc.answer", "answer": {"type": "answer", "sdp": "..."}}   after session.created

and the socket keeps its JSON events (chunk, prompt.applied, done, ...) and control (prompt, stop); only the
binary fragments are replaced by the track. No STUN or TURN server is used (same machine or LAN: host candidates).

The track is paced on the wall clock: a frame is sent at most one frame time (1/fps) after the one before, its
timestamp the moment it is sent (90 kHz from the first frame), so a session slower than real time plays as it
comes and one faster is smoothed to its fps; past `max_frames` queued (a second of video) the oldest go, so the
track stays near the live edge and a slow peer never holds the engine back. When a chunk's first frame to be sent
goes (its first made, or the first left of it after drops), the session is told (`on_first`): the socket's
`{"type": "chunk.sent", "index", "pts"}` lets a client tell which chunk a painted frame belongs to (its RTP
timestamp less the first frame's).
"""

from __future__ import annotations

import asyncio
import time
from fractions import Fraction

import numpy as np

CLOCK = 90_000
MAX_SDP_CHARS = 64 * 1024


def available() -> bool:
    try:
        import aiortc  # noqa: F401
    except ImportError:
        return False
    return True


def check_offer(offer) -> dict:
    """The start message's `webrtc` field -> {"type": "offer", "sdp"}; ValueError naming the problem otherwise."""
    if not isinstance(offer, dict) or offer.get("type") != "offer" or not isinstance(offer.get("sdp"), str):
        raise ValueError("webrtc must be the browser's offer: {\"type\": \"offer\", \"sdp\": \"...\"}")
    if len(offer["sdp"]) > MAX_SDP_CHARS:
        raise ValueError(f"webrtc.sdp is {len(offer['sdp'])} characters; the limit is {MAX_SDP_CHARS}")
    return {"type": "offer", "sdp": offer["sdp"]}


def make_track(fps: int, max_frames: int):
    from aiortc import MediaStreamTrack
    from aiortc.mediastreams import MediaStreamError

    class ChunkTrack(MediaStreamTrack):
        kind = "video"

        def __init__(self):
            super().__init__()
            self.queue: asyncio.Queue = asyncio.Queue()
            self.step = CLOCK // fps
            self.t0: float | None = None           # the first frame's send time: timestamp 0
            self.sent_pts = -self.step
            self.sent_index = None                  # the chunk of the last frame sent
            self.dropped = 0
            self.on_first = None                    # (chunk index, timestamp) when a chunk's first frame is sent

        def push(self, pixels: np.ndarray, index: int) -> None:
            """Chunk `index`'s frames (T, H, W, 3) uint8 -> the track (the oldest queued go past `max_frames`)."""
            for frame in pixels:
                while self.queue.qsize() >= max_frames:
                    self.queue.get_nowait()
                    self.dropped += 1
                self.queue.put_nowait((index, np.ascontiguousarray(frame)))

        def end(self) -> None:
            self.queue.put_nowait(None)

        async def recv(self):
            import av

            item = await self.queue.get()
            if item is None or self.readyState != "live":
                self.stop()
                raise MediaStreamError
            index, rgb = item
            if self.t0 is None:
                self.t0 = time.monotonic()
            wait = self.t0 + (self.sent_pts + self.step) / CLOCK - time.monotonic()
            if wait > 0:                             # at most fps frames a second
                await asyncio.sleep(wait)
            pts = max(self.sent_pts + self.step, int((time.monotonic() - self.t0) * CLOCK))
            self.sent_pts = pts
            # a chunk's first frame *sent*: its first made may have been dropped from the queue (an engine faster
            # than the track's fps), and the page still needs to know where the chunk starts on the track
            if index != self.sent_index and self.on_first is not None:
                self.on_first(index, pts)
            self.sent_index = index
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts, frame.time_base = pts, Fraction(1, CLOCK)
            return frame

    return ChunkTrack()


class WebRTCPeer:
    """One session's peer connection: its answer to the browser's offer, and the track its chunks go to."""

    def __init__(self, fps: int, max_frames: int):
        from aiortc import RTCConfiguration, RTCPeerConnection

        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.track = make_track(fps, max_frames)
        self.pc.addTrack(self.track)
        self.local: dict | None = None          # the answer, once made

    async def answer(self, offer: dict) -> dict:
        from aiortc import RTCSessionDescription

        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=offer["sdp"], type="offer"))
        await self.pc.setLocalDescription(await self.pc.createAnswer())     # gathers the host candidates
        self.local = {"type": "answer", "sdp": self.pc.localDescription.sdp}
        return self.local

    async def close(self) -> None:
        self.track.end()
        await self.pc.close()
