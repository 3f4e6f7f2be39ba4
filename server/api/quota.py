"""`StorageQuota`: what each owner (API key) may keep in the media store, and whose videos go when it is over.

An owner's usage is the bytes of its completed videos whose files are kept, each copy on disk counted once (a
repeat-request reuse is hard links to the first video's files: `VideoRecord.content` names that copy), and the
uploads its active jobs keep in a shared media store (`input_bytes`: an image, a video to extend, stored for any
replica to claim, removed when the job ends).

- `--max-storage-bytes` is per owner: over it, that owner's own videos expire (files deleted, records kept and
  marked expired), the copy used longest ago first (a reuse refreshes its copy), never one whose job is still
  active and never the copy of its newest completed video. Another owner's videos are never touched, so a key
  that repeats a request or generates a lot evicts only its own.
- `--max-total-storage-bytes` caps everyone's together: over it, the owner keeping the most bytes loses its oldest
  copy first, then the next largest, with the same exceptions; the log says whose.
- An upload that would put its owner over the quota makes room among that owner's videos first; 507
  `storage_quota` when its active jobs' uploads alone are over it.

A server without keys has one owner (None), so its quota is the server's, as before owners existed.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Callable

from longserve.server.api.store import ANY_OWNER, Kept

log = logging.getLogger("longserve.server")


class StorageQuota:
    """`store`: the job store (`stored`, `active_inputs`); `busy(video_id)`: its job is still active;
    `expire(video_id, now)`: delete a video's files and mark its record expired."""

    def __init__(self, store, per_owner: int | None, total: int | None, busy: Callable[[str], bool],
                 expire: Callable[[str, int], None]):
        self.store, self.per_owner, self.total = store, per_owner, total
        self.busy, self.expire = busy, expire

    @property
    def on(self) -> bool:
        return self.per_owner is not None or self.total is not None

    def usage(self, owner) -> int:
        """Bytes `owner` keeps: its videos' copies, each counted once, and its active jobs' uploads."""
        return sum(copy_bytes(self.store.stored(owner)).values()) + self.store.active_inputs(owner)

    def stored_bytes(self) -> int:
        """Bytes of every kept video, each copy counted once (the metric)."""
        return sum(copy_bytes(self.store.stored()).values())

    def enforce(self, owner=ANY_OWNER, extra: int = 0) -> list[str]:
        """Expire videos until `owner` (every owner: ANY_OWNER) is within its quota with `extra` more bytes, then
        everyone within the total cap. Returns the ids expired."""
        if not self.on:
            return []
        kept = self.store.stored(owner)
        by_owner: dict = defaultdict(list)
        for k in kept:
            by_owner[k.owner].append(k)
        if owner != ANY_OWNER:
            by_owner.setdefault(owner, [])
        usage = {o: sum(copy_bytes(videos).values()) + self.store.active_inputs(o) + (extra if o == owner else 0)
                 for o, videos in by_owner.items()}
        evicted = []
        if self.per_owner is not None:
            for o, videos in by_owner.items():
                mine = []
                for copy, size in evictable(videos, self.busy):
                    if usage[o] <= self.per_owner:
                        break
                    mine += self._evict(videos, copy)
                    usage[o] -= size
                if mine:
                    log.info("storage quota of %s (%d bytes): expired %d of its own video(s)", o or "the server",
                             self.per_owner, len(mine))
                evicted += mine
        if self.total is not None:
            if owner != ANY_OWNER:          # the cap counts everyone: the others' usage too
                return evicted + self.enforce(ANY_OWNER)
            evicted += self._within_total(by_owner, usage)
        return evicted

    def make_room(self, owner, nbytes: int) -> bool:
        """Room for `nbytes` more of `owner`'s uploads (its own videos evicted for them); False when its active
        uploads alone would be over the quota."""
        if self.per_owner is None:
            return True
        self.enforce(owner, extra=nbytes)
        return self.store.active_inputs(owner) + nbytes <= self.per_owner

    def _within_total(self, by_owner: dict, usage: dict) -> list[str]:
        evicted = []
        queues = {o: list(evictable(v, self.busy)) for o, v in by_owner.items()}
        while sum(usage.values()) > self.total:
            candidates = [o for o in usage if queues.get(o)]
            if not candidates:
                break
            largest = max(candidates, key=lambda o: usage[o])        # the biggest user pays first
            copy, size = queues[largest].pop(0)
            gone = self._evict(by_owner[largest], copy)
            usage[largest] -= size
            evicted += gone
            log.info("total storage cap (%d bytes): expired %s of %s, the owner keeping the most (%d bytes)",
                     self.total, ", ".join(gone), largest or "the server", usage[largest] + size)
        return evicted

    def _evict(self, videos: list[Kept], copy: str) -> list[str]:
        now = int(time.time())
        gone = [k.id for k in videos if k.content == copy]
        for k in videos:
            if k.content == copy:
                self.expire(k.id, now if k.expires_at is None else min(k.expires_at, now))
        return gone


def copy_bytes(videos: list[Kept]) -> dict[str, int]:
    """Each copy on disk (content) -> its bytes: hard links to one copy count once."""
    return {k.content: k.bytes for k in videos}


def evictable(videos: list[Kept], busy) -> list[tuple[str, int]]:
    """(copy, bytes) of one owner's copies that may go, used longest ago first: a copy's use is its newest video's
    completion (the list is oldest completed first); never the newest copy, nor one a busy job's video shares."""
    last_use: dict[str, int] = {}
    for i, k in enumerate(videos):
        last_use[k.content] = i
    if not last_use:
        return []
    newest = max(last_use, key=last_use.get)
    blocked = {k.content for k in videos if busy(k.id)} | {newest}
    sizes = copy_bytes(videos)
    return [(c, sizes[c]) for c in sorted(last_use, key=last_use.get) if c not in blocked]
