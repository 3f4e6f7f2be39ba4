"""A live chunk's frames on their way out of a worker: uint8 on the device, then through shared memory.

A decoded chunk is (B, 3, n, H, W) in [-1, 1] on the worker's device. Pickled as float32 through the pool's result
queue, a LongLive-sized chunk (12 frames of 832x480) is 57.5 MB and the coordinator waits for it; as uint8 it is a
quarter of that, converted where the frames are (`to_uint8`: one fused clamp/scale/round on the device, then one
copy to the host), and it crosses to the coordinator through a shared-memory slot, not the queue: the queue carries
a `SharedFrames` handle of a few hundred bytes.

The uint8 frames are exactly what the "uint8" output always was (diffusers' `postprocess_video` to [0, 1], then
`round(x * 255)`: the same float32 operations, in the same order, on the device). Output "np" (float32 in [0, 1])
is made at the edge, on the coordinator, as uint8 / 255: that is the one change this path makes to a live
request's "np" frames, at most half a level (0.5 / 255) from the float32 decode (tests/engine/test_live_loop.py).

Slots: each worker keeps a small ring of shared-memory segments (`FrameSlots`), sized to the chunk and reused: the
coordinator copies a chunk out of its slot (`SharedFrames.read`) when the job that made it returns, before it sends
the worker another job, so a ring of two slots is never written while it is read. The worker owns (and unlinks, at
exit or when a slot grows) its segments; the coordinator only attaches, and keeps its attachments open for reuse.
"""

from __future__ import annotations

import atexit
import threading
from dataclasses import dataclass
from multiprocessing import shared_memory, util

import numpy as np
import torch

SLOTS = 2                  # chunks a worker may have handed out and not yet seen read (see the module docstring)


def to_uint8(video: torch.Tensor, unit: bool = False) -> torch.Tensor:
    """Decoded (B, 3, n, H, W) in [-1, 1] -> uint8 (B, n, H, W, 3) on the same device: diffusers' denormalise
    (x * 0.5 + 0.5, clamped to [0, 1]) and the uint8 output's round(x * 255), in float32 as they are on the host.
    `unit`: the frames are in [0, 1] already (a small decoder's): clamped, not denormalised."""
    x = (video.float().clamp(0, 1) if unit else (video.float() * 0.5 + 0.5).clamp(0, 1))    # (B, 3, n, H, W)
    return (x * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1)  # (B, n, H, W, 3)


@dataclass(frozen=True)
class SharedFrames:
    """A chunk of uint8 frames in a worker's shared-memory slot: what crosses the result queue instead of them."""

    name: str                    # the segment
    shape: tuple                 # (B, n, H, W, 3)

    def read(self, output: str) -> np.ndarray:
        """The frames as `output` asks: "uint8" as they are, "np" as float32 in [0, 1] (uint8 / 255). A copy: the
        slot is the worker's again once its next job is sent."""
        view = np.ndarray(self.shape, np.uint8, buffer=_attach(self.name).buf)
        if output == "uint8":
            return view.copy()
        return view.astype(np.float32) / 255.0


def frames_out(frames, output: str):
    """What a caller gets of a decoded chunk's `frames` (a `SharedFrames` read at the edge; anything else as is)."""
    return frames.read(output) if isinstance(frames, SharedFrames) else frames


class FrameSlots:
    """One worker's ring of shared-memory slots (created on first use, grown when a chunk does not fit)."""

    def __init__(self, slots: int = SLOTS):
        self._segments: list[shared_memory.SharedMemory | None] = [None] * slots
        self._next = 0
        self._lock = threading.Lock()
        # a pool's worker ends through multiprocessing, which runs its finalizers and not atexit's handlers
        util.Finalize(self, FrameSlots.close, args=(self,), exitpriority=10)
        atexit.register(self.close)

    def put(self, frames: torch.Tensor) -> SharedFrames:
        """uint8 frames (any device) into the next slot -> their handle."""
        frames = frames.contiguous()
        with self._lock:
            i, self._next = self._next, (self._next + 1) % len(self._segments)
            seg = self._segments[i]
            if seg is None or seg.size < frames.numel():
                if seg is not None:
                    _unpin(seg)
                    seg.close()
                    seg.unlink()
                seg = self._segments[i] = shared_memory.SharedMemory(create=True, size=max(1, frames.numel()))
        target = torch.from_numpy(np.ndarray(tuple(frames.shape), np.uint8, buffer=seg.buf))
        if frames.is_cuda:
            _pin(seg)
        target.copy_(frames)          # the device -> host copy lands in the slot itself
        del target
        return SharedFrames(seg.name, tuple(frames.shape))

    def close(self) -> None:
        with self._lock:
            for seg in self._segments:
                if seg is not None:
                    try:
                        _unpin(seg)
                        seg.close()
                        seg.unlink()
                    except (FileNotFoundError, BufferError):
                        pass
            self._segments = [None] * len(self._segments)


_pinned: set[str] = set()


def _pin(seg: shared_memory.SharedMemory) -> None:
    """Page-lock a slot for CUDA (once): the device -> host copy then goes by DMA, as into a pinned buffer. Where
    the driver refuses, the copy still works, through a staging buffer (not measured here: no GPU on this machine)."""
    if seg.name in _pinned:
        return
    ptr = torch.frombuffer(seg.buf, dtype=torch.uint8).data_ptr()
    try:
        err = torch.cuda.cudart().cudaHostRegister(ptr, seg.size, 0)
        if int(getattr(err, "value", err)) == 0:           # cudaSuccess (a pybind enum or an int)
            _pinned.add(seg.name)
    except Exception:  # noqa: BLE001 - pinning is an optimisation
        pass


def _unpin(seg: shared_memory.SharedMemory) -> None:
    if seg.name in _pinned:
        _pinned.discard(seg.name)
        try:
            torch.cuda.cudart().cudaHostUnregister(torch.frombuffer(seg.buf, dtype=torch.uint8).data_ptr())
        except Exception:  # noqa: BLE001
            pass


_attached: dict[str, shared_memory.SharedMemory] = {}
_attach_lock = threading.Lock()


def _attach(name: str) -> shared_memory.SharedMemory:
    """The coordinator's attachment to a worker's slot, kept open (slots are reused; a grown slot has a new name)."""
    with _attach_lock:
        seg = _attached.get(name)
        if seg is None:
            # the workers share the coordinator's resource tracker (spawned children do): attaching registers
            # nothing new there, and the worker's unlink is what unregisters the segment
            seg = _attached[name] = shared_memory.SharedMemory(name=name)
            if len(_attached) > 64:                     # slots of workers gone (restarts, closed pools)
                old = next(iter(_attached))
                _attached.pop(old).close()
        return seg

