"""WebRTC for live sessions, beside the WebSocket's fMP4 fragments: a session's frames as a video track (aiortc).

Signalling runs over the live WebSocket (server/api/live.py): the start message carries the browser's offer,

    client -> server   {"type": "start", "prompt": ..., "webrtc": {"type": "offer", "sdp": "..."}}
    server -> client   {"type": "webrtc.answer", "answer": {"type": "answer", "sdp": "..."}}   after session.created

and the socket keeps its JSON events (chunk, prompt.applied, done, ...) and control (prompt, stop); only the
binary fragments are replaced by the track. No STUN or TURN server is used (same machine or LAN: host candidates).

An offer is bounded before anything reads it and answered only after the session was admitted
(`server/api/live.py`), so it cannot make the server send packets anywhere, nor stall it:

- `check_offer` (a few bounded string scans, before admission): at most `MAX_SDP_CHARS`, `MAX_MEDIA_SECTIONS`
  m-sections and `MAX_CANDIDATES` candidates; past them 400 naming webrtc, with no SDP parsed.
- `screen_offer` (on a worker thread, after admission): the SDP read line by line (a clear 400 for one that is not
  a session description), and every candidate that is not an IP literal at an allowed address removed: the
  client's own address (the socket's peer) or a network of `--webrtc-networks`. A `.local` name is never resolved
  (no mDNS query leaves the server); a browser that hides its addresses that way is still reached, by the checks
  it sends to the server's candidate.
- The answer gathers host candidates only on allowed local addresses (`host_candidates`): the one the client
  reached the server on, and the server's own addresses inside `--webrtc-networks`; no other interface is listed.

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
import contextvars
import ipaddress
import logging
import time
from fractions import Fraction

import numpy as np

log = logging.getLogger("longserve.live")

CLOCK = 90_000
MAX_SDP_CHARS = 64 * 1024
#: a live session is one video track: a browser's offer has one m-section (a few more leave room for a client that
#: also offers audio or a data channel, which the answer rejects)
MAX_MEDIA_SECTIONS = 4
#: candidates in one offer: a browser's host candidates on its interfaces (two or four, each per protocol)
MAX_CANDIDATES = 16
#: the local addresses an answer gathers its host candidates on (`host_candidates`), for the peer being answered
_LOCAL_ADDRESSES: contextvars.ContextVar = contextvars.ContextVar("longserve_webrtc_addresses", default=None)


def available() -> bool:
    try:
        import aiortc  # noqa: F401
    except ImportError:
        return False
    return True


def check_offer(offer) -> dict:
    """The start message's `webrtc` field -> {"type": "offer", "sdp"}; ValueError naming the problem otherwise.
    Bounded scans only (no parsing): it runs before admission, on the event loop."""
    if not isinstance(offer, dict) or offer.get("type") != "offer" or not isinstance(offer.get("sdp"), str):
        raise ValueError("webrtc must be the browser's offer: {\"type\": \"offer\", \"sdp\": \"...\"}")
    sdp = offer["sdp"]
    if len(sdp) > MAX_SDP_CHARS:
        raise ValueError(f"webrtc.sdp is {len(sdp)} characters; the limit is {MAX_SDP_CHARS}")
    if sdp.split("\n", 1)[0].strip() != "v=0" or "\nm=video " not in sdp:
        raise ValueError("webrtc.sdp is not a session description with a video section: it starts with the line "
                         "v=0 and has an m=video line")
    sections = sdp.count("\nm=") + sdp.startswith("m=")
    if sections > MAX_MEDIA_SECTIONS:
        raise ValueError(f"webrtc.sdp has {sections} media sections; a live session takes at most "
                         f"{MAX_MEDIA_SECTIONS}")
    candidates = sdp.count("a=candidate:")
    if candidates > MAX_CANDIDATES:
        raise ValueError(f"webrtc.sdp lists {candidates} candidates; the limit is {MAX_CANDIDATES}")
    return {"type": "offer", "sdp": sdp}


def start_offer(offer) -> dict | None:
    """The live start message's `webrtc` field, checked (`check_offer`); None for the fMP4 fragments. APIError 400
    naming webrtc otherwise."""
    from longserve.server.api.errors import APIError

    if offer is None:
        return None
    if not available():
        raise APIError(400, "webrtc is not available on this server (it needs aiortc: pip install aiortc); "
                            "leave it out to receive fMP4 fragments", param="webrtc", code="unsupported_parameter")
    try:
        return check_offer(offer)
    except ValueError as e:
        raise APIError(400, str(e), param="webrtc", code="invalid_value") from None


async def answer_offer(offer: dict, spec, frames_per_chunk: int, ws, networks=()) -> "WebRTCPeer":
    """An admitted session's peer connection, its answer made (APIError 400 naming webrtc when it cannot be): the
    offer screened on a worker thread (`screen_offer`: only candidates at the socket's peer address or in
    `networks` stay), the answer's candidates on the address the client reached and the server's own in those
    networks (`host_candidates`)."""
    from starlette.concurrency import run_in_threadpool

    from longserve.server.api.errors import APIError

    client = ws.client.host if ws.client else None
    local = (ws.scope.get("server") or (None,))[0]
    try:
        sdp, removed = await run_in_threadpool(screen_offer, offer["sdp"], client, networks)
    except ValueError as e:
        raise APIError(400, str(e), param="webrtc", code="invalid_value") from None
    if removed:
        log.info("%s: %d WebRTC candidate(s) outside the client's address and --webrtc-networks ignored",
                 spec.request_id, removed)
    peer = WebRTCPeer(spec.fps, max(spec.fps, frames_per_chunk))
    try:
        await peer.answer({"type": "offer", "sdp": sdp}, host_candidates(local, networks))
    except Exception as e:                          # an offer aiortc cannot answer (no video, no codec)
        await peer.close()
        raise APIError(400, f"webrtc: the offer cannot be answered: {e}", param="webrtc", code="invalid_value") \
            from None
    return peer


def parse_networks(text: str | None) -> tuple:
    """`--webrtc-networks` ("10.0.0.0/8,fd00::/8") -> ip_network objects; ValueError naming the bad one."""
    networks = []
    for item in (text or "").split(","):
        if item.strip():
            try:
                networks.append(ipaddress.ip_network(item.strip(), strict=False))
            except ValueError:
                raise ValueError(f"webrtc_networks: {item.strip()!r} is not a network (e.g. 10.0.0.0/8)") from None
    return tuple(networks)


def candidate_allowed(host: str, client: str | None, networks=()) -> bool:
    """May the server send to a remote candidate at `host`: an IP literal (never a name: no DNS or mDNS lookup) that
    is the client's own address, or inside one of the operator's `networks`."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if client is not None:
        try:
            if address == ipaddress.ip_address(client):
                return True
        except ValueError:
            pass
    return any(address in net for net in networks)


def screen_offer(sdp: str, client: str | None, networks=()) -> tuple[str, int]:
    """(blocking: run it on a worker thread) An offer's SDP with only the candidates `candidate_allowed` keeps, and
    how many were removed; ValueError with a clear message for text that is not a session description with a
    video section."""
    lines = sdp.replace("\r\n", "\n").split("\n")
    while lines and not lines[-1]:
        lines.pop()
    if not lines or lines[0].strip() != "v=0":
        raise ValueError("webrtc.sdp is not a session description: it must start with the line v=0")
    kept, removed, video = [], 0, False
    for number, line in enumerate(lines, 1):
        if len(line) < 2 or line[1] != "=" or not line[0].isalpha():
            raise ValueError(f"webrtc.sdp line {number} is not a type=value line of a session description")
        if line.startswith("m=video "):
            video = True
        if line.startswith("a=candidate:"):
            fields = line.split()
            if len(fields) < 8 or fields[6] != "typ":
                raise ValueError(f"webrtc.sdp line {number} is not a candidate (foundation component protocol "
                                 f"priority address port typ type)")
            if not candidate_allowed(fields[4], client, networks):
                removed += 1
                continue
        kept.append(line)
    if not video:
        raise ValueError("webrtc.sdp has no video section (m=video): a live session is a video track")
    from aiortc.sdp import SessionDescription

    text = "\r\n".join(kept) + "\r\n"
    try:
        SessionDescription.parse(text)            # what aiortc will read, read once here off the event loop
    except Exception as e:  # noqa: BLE001 - aiortc's parser raises whatever its code meets
        raise ValueError(f"webrtc.sdp is not an offer this server can read ({type(e).__name__})") from None
    return text, removed


def host_candidates(local: str | None, networks=()) -> list[str]:
    """The local addresses an answer may list: the one the client reached the server on (`local`, the socket's),
    and the server's interface addresses inside `networks`."""
    addresses = []
    if local is not None:
        try:
            addresses.append(str(ipaddress.ip_address(local)))
        except ValueError:
            pass
    if networks:
        _limit_gathering()
        for address in _all_host_addresses(use_ipv4=True, use_ipv6=True):
            if any(ipaddress.ip_address(address) in net for net in networks) and address not in addresses:
                addresses.append(address)
    return addresses


def _gathered_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    """aioice's host addresses, limited to those `WebRTCPeer.answer` allows for the peer being answered."""
    allowed = _LOCAL_ADDRESSES.get()
    if allowed is None:
        return _all_host_addresses(use_ipv4, use_ipv6)
    return [a for a in allowed if (":" in a and use_ipv6) or (":" not in a and use_ipv4)]


_all_host_addresses = None


def _limit_gathering() -> None:
    """aioice gathers on every interface it finds (`aioice.ice.get_host_addresses`): make it ask
    `_gathered_addresses`, which answers as before unless an answer being made set its addresses."""
    global _all_host_addresses
    import aioice.ice

    if _all_host_addresses is None:
        _all_host_addresses = aioice.ice.get_host_addresses
        aioice.ice.get_host_addresses = _gathered_addresses


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

        _limit_gathering()
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.track = make_track(fps, max_frames)
        self.pc.addTrack(self.track)
        self.local: dict | None = None          # the answer, once made

    async def answer(self, offer: dict, addresses: list[str]) -> dict:
        """The answer to a screened offer (`screen_offer`), its host candidates on `addresses` only."""
        from aiortc import RTCSessionDescription

        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=offer["sdp"], type="offer"))
        token = _LOCAL_ADDRESSES.set(list(addresses))
        try:
            await self.pc.setLocalDescription(await self.pc.createAnswer())     # gathers the host candidates
        finally:
            _LOCAL_ADDRESSES.reset(token)
        self.local = {"type": "answer", "sdp": self.pc.localDescription.sdp}
        return self.local

    async def close(self) -> None:
        self.track.end()
        await self.pc.close()
