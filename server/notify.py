"""`Notifier`: wake waiters in any thread or event loop when something happens, with no polling.

The MP4 writer's pump thread notifies after every chunk of bytes it appends (and once it is
done); a job notifies when its writer exists or it ended. Readers in an event loop (a
streaming HTTP response) await `wait_after(version)`; each notification sets their
asyncio.Event through `call_soon_threadsafe`, so an idle reader costs nothing.
"""

from __future__ import annotations

import asyncio
import threading


class Notifier:
    """A counter of notifications; waiters wake when it moves past the version they saw."""

    def __init__(self):
        self.version = 0
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def notify(self) -> None:
        with self._lock:
            self.version += 1
            waiters = list(self._waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:      # that waiter's loop is closed
                pass

    async def wait_after(self, version: int, timeout: float | None = None) -> bool:
        """Wait until a notification after `version` (at most `timeout` seconds); True if one came."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._lock:
            if self.version > version:
                return True
            self._waiters.add((loop, event))
        try:
            await asyncio.wait_for(event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return self.version > version
        finally:
            with self._lock:
                self._waiters.discard((loop, event))
