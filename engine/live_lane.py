"""The live loop's decode lane: chunk k's VAE decode runs beside chunk k+1's denoising, off the critical path.

The live loop (`EngineConfig.live_loop`, docs/design.md "The live loop") is one of

    serial       decode chunk k, then denoise chunk k+1 (one after the other, every job on every worker)
    overlapped   one job does both at once: the chunk's decode on this worker's `DecodeLane` (a thread with its
                 own intra-op thread budget on the CPU; its own CUDA stream, ordered after the denoiser's by an
                 event, on a GPU) while the job's steps run on the main thread
    pipelined    (several workers) the transformer on workers 0..N-2 and the decode lane on worker N-1: the chunk's
                 final latents cross once (a point-to-point send), and the two stages run on separate workers
    stages       (several workers) the transformer's blocks in one stage per worker, several chunks in flight
                 (engine/live_stages.py; rank 0's lane decodes; not these numbers unless one chunk at a time)

The first three make the same numbers: the decode reads the chunk's final latents, which nothing writes again, and the
lane decodes chunks in their order (one thread, FIFO), so the streaming VAE's cache sees exactly the serial order.
What changes is when a chunk's frames reach the caller: one job later than serial, while the next chunk is made.
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable

import torch


class DecodeLane:
    """A worker's decode thread: `submit(fn)` runs `fn()` there, in submission order, and returns its future.

    threads: the lane's intra-op threads on the CPU (torch's are per thread for OpenMP: set on the lane's own
    thread, they leave the main thread's budget alone). device: a CUDA device gets the lane its own stream; the
    caller's work on the main stream up to `submit` is waited for by an event, not a host sync."""

    def __init__(self, device: torch.device, threads: int = 1):
        self.device = torch.device(device)
        self.threads = threads
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="decode-lane",
                                                           initializer=self._start)

    def _start(self) -> None:
        import threading

        self.native_id = threading.get_native_id()    # what a bench pins to a core of its own (`bench live --pin`)
        if self.device.type == "cpu" and self.threads:
            torch.set_num_threads(self.threads)

    def thread_id(self) -> int:
        """The lane thread's OS id (the thread is started now if it was not yet)."""
        self._pool.submit(lambda: None).result()
        return self.native_id

    def submit(self, fn: Callable) -> concurrent.futures.Future:
        if self.stream is None:
            return self._pool.submit(self._run, fn, None)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))     # the latents fn reads are written by now
        return self._pool.submit(self._run, fn, ready)

    def _run(self, fn: Callable, ready):
        with torch.no_grad():
            if self.stream is None:
                return fn()
            self.stream.wait_event(ready)
            with torch.cuda.stream(self.stream):
                out = fn()
            self.stream.synchronize()             # the frames are in their host slot when the future resolves
            return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
