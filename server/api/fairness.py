"""Fair connections: no one client can hold every connection slot or every request the server takes.

A client is an API key (its id, `edge.client_id`), or its address on a server without keys (and for requests that
carry no valid key: a wrong key is counted where it came from).

- Open streams per client: event streams (`/events`), streamed downloads (`/content?stream=true`) and live sockets
  count against `--max-streams-per-key`; one more gets 429 `too_many_streams` with Retry-After, and its connection
  is closed (an idle kept-alive connection would still count against uvicorn's `--limit-concurrency`).
- Requests per client: a token bucket of `--rate-burst` tokens refilled at `--rate-per-key` a second; every /v1
  request (and a live socket's start) takes one; an empty bucket is 429 `rate_limited` with Retry-After, the
  seconds until a token is back.

Probes (/health, /metrics) and the page's static files are not counted.
"""

from __future__ import annotations

import math
import threading
import time

from longserve.server.api.errors import APIError

#: buckets kept before the full (idle) ones are forgotten: a bound on what many addresses can make this hold
MAX_TRACKED = 10_000


class Fairness:
    """`max_streams`: open streams per client (None: no cap); `rate`, `burst`: the token bucket (rate None: no
    limit). Thread-safe (routes run in the threadpool and on the event loop)."""

    def __init__(self, max_streams: int | None, rate: float | None, burst: int | None, clock=time.monotonic):
        self.max_streams, self.rate, self.clock = max_streams, rate, clock
        self.burst = float(burst if burst is not None else max(1.0, 2 * (rate or 1)))
        self._lock = threading.Lock()
        self._streams: dict[str, int] = {}
        self._buckets: dict[str, tuple[float, float]] = {}     # client -> (tokens, when last counted)

    def take(self, client: str) -> None:
        """One request of `client`: a token from its bucket, or 429 rate_limited."""
        if self.rate is None:
            return
        with self._lock:
            now = self.clock()
            tokens, then = self._buckets.get(client, (self.burst, now))
            tokens = min(self.burst, tokens + (now - then) * self.rate)
            if tokens < 1.0:
                self._buckets[client] = (tokens, now)
                wait = math.ceil((1.0 - tokens) / self.rate)
                raise APIError(429, f"too many requests from this API key: at most {self.rate:g} a second (bursts of "
                                    f"{self.burst:g}); retry in {wait} s", code="rate_limited",
                               headers={"Retry-After": str(wait), "Connection": "close"})
            self._buckets[client] = (tokens - 1.0, now)
            if len(self._buckets) > MAX_TRACKED:
                self._forget_idle(now)

    def open_stream(self, client: str, what: str) -> "StreamSlot":
        """A slot for one more open stream of `client` (release it when the stream ends), or 429
        too_many_streams."""
        with self._lock:
            held = self._streams.get(client, 0)
            if self.max_streams is not None and held >= self.max_streams:
                raise APIError(429, f"this API key has {held} streams open (events, streamed downloads, live "
                                    f"sessions); the limit is {self.max_streams} (--max-streams-per-key): close "
                                    f"one before opening {what}", code="too_many_streams",
                               headers={"Retry-After": "5", "Connection": "close"})
            self._streams[client] = held + 1
        return StreamSlot(self, client)

    def open_streams(self, client: str) -> int:
        with self._lock:
            return self._streams.get(client, 0)

    def _close(self, client: str) -> None:
        with self._lock:
            left = self._streams.get(client, 0) - 1
            if left > 0:
                self._streams[client] = left
            else:
                self._streams.pop(client, None)

    def _forget_idle(self, now: float) -> None:
        for client, (tokens, then) in list(self._buckets.items()):
            if tokens + (now - then) * self.rate >= self.burst:
                del self._buckets[client]


class StreamSlot:
    """One open stream's place; `release()` gives it back (once, however often it is called)."""

    def __init__(self, fairness: Fairness, client: str):
        self.fairness, self.client, self.released = fairness, client, False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.fairness._close(self.client)
