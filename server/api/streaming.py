"""Streaming to clients: Server-Sent Events per video, and tailing a video file while it grows.

The video service's job followers publish; each SSE connection owns an asyncio queue on the
server's event loop, fed with `call_soon_threadsafe`, so no lock is held across an await.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from starlette.responses import StreamingResponse

#: events after which a stream ends; "error" (the OpenAI error envelope) ends every open stream at shutdown
TERMINAL_EVENTS = ("video.completed", "video.failed", "video.deleted", "error")


@dataclass(eq=False)
class Subscription:
    video_id: str
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop


class EventBroker:
    """Fan-out of per-video events to the SSE connections watching that video."""

    def __init__(self):
        self._subs: dict[str, set[Subscription]] = {}
        self._lock = threading.Lock()

    def subscribe(self, video_id: str) -> Subscription:
        sub = Subscription(video_id, asyncio.Queue(), asyncio.get_running_loop())
        with self._lock:
            self._subs.setdefault(video_id, set()).add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get(sub.video_id)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[sub.video_id]

    def close_all(self, event: str, data: dict) -> None:
        """Send every open stream a last (terminal) event: the server is shutting down."""
        with self._lock:
            video_ids = list(self._subs)
        for video_id in video_ids:
            self.publish(video_id, event, data)

    def has_subscribers(self, video_id: str) -> bool:
        return video_id in self._subs

    def publish(self, video_id: str, event: str, data: dict) -> None:
        """Thread-safe; never blocks."""
        with self._lock:
            subs = list(self._subs.get(video_id, ()))
        for sub in subs:
            try:
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, (event, data))
            except RuntimeError:  # that connection's loop is gone
                self.unsubscribe(sub)


class SlotStream(StreamingResponse):
    """A streamed response that holds what it was given (one of its client's stream slots, `fairness.StreamSlot`;
    a watch of another replica's job) until it ends, however it ends (finished, the client gone, the server
    stopping): `releases` are called then."""

    def __init__(self, content, releases, **kwargs):
        super().__init__(content, **kwargs)
        self.releases = list(releases)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for release in self.releases:
                release()


def shutdown_envelope() -> dict:
    return {"error": {"message": "the server is shutting down; this stream ends here (a queued video stays queued "
                                 "and runs when the server starts again on the same data dir)",
                      "type": "server_error", "param": None, "code": "server_shutdown"}}


def sse_message(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def sse_stream(sub: Subscription, first: list[tuple[str, dict]], unsubscribe: Callable[[], None],
                     keepalive_s: float = 15.0) -> AsyncIterator[bytes]:
    """`first` events (the current state), then live ones until a terminal event."""
    try:
        for event, data in first:
            yield sse_message(event, data)
            if event in TERMINAL_EVENTS:
                return
        while True:
            try:
                event, data = await asyncio.wait_for(sub.queue.get(), timeout=keepalive_s)
            except asyncio.TimeoutError:
                yield b": keep-alive\n\n"
                continue
            yield sse_message(event, data)
            if event in TERMINAL_EVENTS:
                return
    finally:
        unsubscribe()


async def tail_file(writer, chunk_size: int = 1 << 16, idle_s: float = 15.0) -> AsyncIterator[bytes]:
    """Yield the bytes of a `FragmentedMP4Writer`'s file as it appends them, until it is done and all is read.

    Woken by the writer's `grown` notifier, never by a timer (`idle_s` only bounds a wait, in case
    a notification is ever lost). The writer renames `part_path` to `final_path` at the end; an open
    handle keeps reading. If the writer fails or is aborted, the stream just ends where the file ended.
    """
    f = None
    for path in (writer.part_path, writer.final_path):
        try:
            f = open(path, "rb")
            break
        except FileNotFoundError:
            continue
    if f is None:
        return
    try:
        while True:
            version = writer.grown.version   # read before the file: bytes appended later wake the wait below
            finished = writer.done.is_set()
            data = f.read(chunk_size)
            if data:
                yield data
                continue
            if finished:
                return
            await writer.grown.wait_after(version, timeout=idle_s)
    finally:
        f.close()
