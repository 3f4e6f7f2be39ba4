"""What a request hears from the engine: typed outputs, and the stream that carries them.

`VideoEngine.submit(spec)` returns a `RequestHandle`; its outputs arrive in order, one
dataclass each, and end with exactly one of `Finished`, `Failed` or `Cancelled`:

    Queued(position)            waiting; sent again whenever its place in line changes
    Admitted(num_steps, ...)    its prompt is encoded and its latents exist on the workers
    StepProgress(step, ...)     after every denoising step (of every segment, for a long video)
    FramesChunk(frames, ...)    final frames, decoded (a long video's arrive while it still denoises)
    Requeued(reason)            the workers restarted under it: it waits again and starts over
    Finished(timings) | Failed(error) | Cancelled(reason)

A request ends early only by `VideoEngine.abort(id, reason)`, and its final output says why: a
word ends it `Cancelled(reason)` ("cancelled" when a reader let go; a server says "deleted",
"released", "disconnected", ...), a `RequestFailure` ends it `Failed(error)` (a drain's
`server_shutdown`, a writer's `storage_full`).

The Python pipeline reads a handle as a plain iterator; the server as an async iterator
(`async for out in handle`), so a coroutine per job wakes on its own outputs (as vLLM's
`AsyncLLM.generate` reads one queue per request). Nothing polls.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass, field
from typing import Any

#: the reason of a plain cancellation (a reader that let go of its handle), and the kind of an abort's failure
CANCELLED = "cancelled"
ABORTED = "aborted"


@dataclass(frozen=True)
class RequestOutput:
    request_id: str


@dataclass(frozen=True)
class Queued(RequestOutput):
    position: int                     # 0: admitted next


@dataclass(frozen=True)
class Admitted(RequestOutput):
    num_steps: int                    # denoising steps in all (every segment's)
    num_frames: int
    admissions: int                   # > 1 after a worker restart sent it back to the queue


@dataclass(frozen=True)
class StepProgress(RequestOutput):
    step: int
    num_steps: int
    batch_size: int
    step_s: float

    @property
    def denoised(self) -> bool:
        return self.step >= self.num_steps


@dataclass(frozen=True)
class Sound:
    """A video's sound (LTX-2 makes it with the picture): float32 samples (channels, n) in [-1, 1] at `rate` Hz, as
    a file holds it; as a chunk carries it, one row per video of the batch, (B, channels, n). A request for latents
    (output "latent") is handed the audio latents instead, (B, C, L, M), with rate 0: not samples yet."""

    samples: Any
    rate: int

    @property
    def latent(self) -> bool:
        return self.rate == 0

    @property
    def seconds(self) -> float:
        return self.samples.shape[-1] / self.rate


@dataclass(frozen=True)
class LiveChunkInfo:
    """Which chunk of a causal request a piece of frames is, and which of its prompts made it."""

    chunk: int                        # 0, 1, ... in the request (a live session's, or a prompt schedule's)
    prompt_index: int                 # 0 the first prompt, then one per switch in order


@dataclass(frozen=True)
class FramesChunk(RequestOutput):
    frames: Any                       # (B, n, H, W, 3) float32 ("np") or uint8, or latents ("latent")
    start: int
    stop: int
    num_frames: int
    vae_s: float
    audio: Sound | None = None        # a model's sound, with the first frames that follow its making (LTX-2)
    live: LiveChunkInfo | None = None  # a causal model's chunk: its index and prompt


@dataclass(frozen=True)
class Requeued(RequestOutput):
    reason: str


@dataclass(frozen=True)
class RequestFailure:
    """Why a request failed. kind: the worker failure kind (`engine.pool.FAILURE_KINDS`), or ABORTED for a failure
    its caller gave (`VideoEngine.abort`); code: the API's."""

    code: str
    message: str
    kind: str
    rank: int | None = None
    field: str | None = None


@dataclass(frozen=True)
class Finished(RequestOutput):
    timings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Failed(RequestOutput):
    error: RequestFailure


@dataclass(frozen=True)
class Cancelled(RequestOutput):
    reason: str = CANCELLED           # the word its abort gave


def ended_early(request_id: str, reason: "str | RequestFailure") -> RequestOutput:
    """The final output of a request aborted for `reason`: Failed for a failure, else Cancelled."""
    if isinstance(reason, RequestFailure):
        return Failed(request_id, reason)
    return Cancelled(request_id, reason)


FINAL = (Finished, Failed, Cancelled)


class OutputStream:
    """A queue of one request's outputs: one producer (the engine's thread), readers in any thread or event loop.

    Sync readers wait on a condition; async readers register an asyncio.Event that the
    producer sets with `call_soon_threadsafe`, so an awaiting coroutine wakes when (and only
    when) something arrives.
    """

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self.closed = False               # the final output was put

    def put(self, item: RequestOutput) -> None:
        """Queue an output; nothing is queued after the final one (a request ends exactly once)."""
        with self._cond:
            if self.closed:
                return
            self._items.append(item)
            self.closed = isinstance(item, FINAL)
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:          # that reader's loop is gone
                pass

    def get(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output, waiting up to `timeout` seconds (None: no limit); None if none came."""
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)
            return self._items.popleft() if self._items else None

    async def aget(self) -> RequestOutput:
        loop = asyncio.get_running_loop()
        while True:
            event = asyncio.Event()
            with self._cond:
                if self._items:
                    return self._items.popleft()
                self._waiters.add((loop, event))
            try:
                await event.wait()
            finally:
                with self._cond:
                    self._waiters.discard((loop, event))
