"""Peak activation memory: the most tensor memory alive at once above what was there before.

    with PeakMemory(device) as mem:
        run_the_forward()
    mem.peak_bytes   # peak bytes of tensor storage allocated inside the block

- CUDA: `torch.cuda.max_memory_allocated()` minus the memory allocated on entry (the
  loaded model and anything else already alive), after `reset_peak_memory_stats()`.
- CPU: the CPU allocator keeps no such statistics, so `LiveTensorTracker` counts it:
  a `TorchDispatchMode` sees every aten op that runs inside the block; each output
  whose storage is new (not the storage of one of the op's inputs: views and in-place
  ops allocate nothing) adds its storage's `nbytes()` once, and a `weakref.finalize`
  on that storage subtracts it when the storage is freed. Peak = the maximum of that
  running sum. Storage that existed before the block (the weights) is never counted;
  storage that a block allocates and keeps (its results) still counts at the peak.
  Not seen: scratch buffers that a fused C++ kernel allocates and frees internally
  (for example SDPA's per-thread blocks), and storages that change size in place
  are re-measured only when an op returns them. Counting runs in Python on every op,
  so timings taken inside the block are slightly slower. Buffers handed to a
  collective are freed when the backend's thread lets go of them, so under CPU
  contention the peak can come out a few MiB higher (the memory really is held).
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorTracker(TorchDispatchMode):
    """Bytes of tensor storage allocated inside the mode that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}  # storage key -> bytes counted for it
        self._lock = threading.Lock()  # a backend thread (gloo, NCCL) may drop the last reference

    def _free(self, key: int) -> None:
        with self._lock:
            self.live_bytes -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs:
            return out
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.layout == torch.strided
        }
        for t in outputs:
            if t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            nbytes = storage.nbytes()
            with self._lock:
                if key in self._sizes:  # seen before: only a size change (resize_) matters
                    self.live_bytes += nbytes - self._sizes[key]
                    self._sizes[key] = nbytes
                elif key in inputs or nbytes == 0:
                    continue  # a view of, or an in-place write into, existing storage
                else:
                    self._sizes[key] = nbytes
                    self.live_bytes += nbytes
                    weakref.finalize(storage, self._free, key)
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out


class PeakMemory:
    """Context manager: `peak_bytes` = peak tensor memory allocated inside the block."""

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = True):
        self.device = torch.device(device)
        self.enabled = enabled
        self.peak_bytes = 0
        self.method = "off"
        self._tracker: LiveTensorTracker | None = None
        self._base = 0

    def __enter__(self) -> "PeakMemory":
        if not self.enabled:
            return self
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.method = "torch.cuda.max_memory_allocated - allocated at entry"
        else:
            self._tracker = LiveTensorTracker()
            self._tracker.__enter__()
            self.method = "live tensor storage (TorchDispatchMode tracker)"
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._tracker.__exit__(*exc)
            self.peak_bytes = self._tracker.peak_bytes


#: the share of a worker's memory live sessions' KV caches may take by default (the weights, activations and the
#: VAE's caches need the rest)
DEFAULT_KV_SHARE = 0.25


def default_live_kv_budget(device: str | None, workers: int) -> int:
    """`--live-kv-budget` when none is given, in bytes per worker: a quarter of the memory one worker has. On CUDA
    each worker has a GPU of its own: a quarter of the smallest visible one's; on CPU the workers share the
    machine's RAM: a quarter of it, split between them."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and torch.cuda.is_available():
        return int(min(gpu_memory_bytes()) * DEFAULT_KV_SHARE)
    return int(system_memory_bytes() * DEFAULT_KV_SHARE / max(1, workers))


def gpu_memory_bytes() -> list[int]:
    """Each visible GPU's memory, read without starting CUDA in this process where possible (the coordinator's own
    CUDA context would take memory on the workers' GPU 0): NVML (nvidia-ml-py), then `nvidia-smi`, and torch only
    when neither is there."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            return [int(pynvml.nvmlDeviceGetMemoryInfo(h).total) for h in handles]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - not installed, or no driver: the next way
        pass
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        sizes = [int(line) * 2**20 for line in out.split() if line.strip().isdigit()]      # MiB
        if sizes:
            return sizes
    except (OSError, subprocess.SubprocessError):
        pass
    return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]


def system_memory_bytes() -> int:
    """The machine's RAM (or the cgroup's limit when it is lower: a container's share)."""
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total
