"""Expert-aware offload: one of a two-expert model's denoisers on the device, the other in host memory.

Wan 2.2 A14B runs its high-noise expert (`transformer`) for the steps with t >= boundary and its
low-noise expert (`transformer_2`) for the rest; a step uses one of them. With `offload="expert"`
each worker keeps only the expert of the current batch on its device and the other in pinned host
memory, so the two 14B experts cost the device memory of one. The swap is a copy of the incoming
expert's tensors from their pinned host copies (issued on the compute stream, so the forward that
follows waits for it and nothing else does) and a drop of the outgoing expert's device tensors (its
host copies are kept for the way back: an eviction copies nothing).

What keeps swaps rare is the scheduler, not this module: with offload on, it keeps stepping the
batches of the resident expert while any is runnable (`engine/scheduler.py`, "expert phases"), so
staggered requests finish their high-noise steps together, one swap moves everyone to the low-noise
expert, and a request waiting for the other expert is served at the latest after
`offload_max_wait` batches that passed it over.

On a CPU worker there is no device to save: the "device" is a stand-in. The evicted expert's
parameters are really taken out of the module (each replaced by an empty tensor) and put back on a
swap, so a step that used the wrong expert would fail at once, and the frames show the swap restores
every tensor exactly; the residency and swap count are the same decisions a GPU worker makes.
"""

from __future__ import annotations

import time

import torch

OFFLOAD = ("none", "expert")


class ExpertResidency:
    """Which of `modules` (the experts) is on `device`; `use(i)` makes expert i resident, swapping if needed."""

    def __init__(self, modules: list[torch.nn.Module], device: torch.device, resident: int = 0):
        self.modules = modules
        self.device = torch.device(device)
        self.stand_in = self.device.type == "cpu"
        self.swaps = 0
        self.swap_s = 0.0
        pin = self.device.type == "cuda"
        # every parameter and buffer of every expert, once, in host memory (pinned for asynchronous copies)
        self._host = [{name: (t.detach().to("cpu").pin_memory() if pin else t.detach().clone())
                       for name, t in _tensors(m)} for m in modules]
        self.resident: int | None = None
        for i in range(len(modules)):
            self._evict(i)
        self._load(resident)

    def where(self) -> list[str]:
        """Each expert's place: "device" or "host"."""
        return ["device" if i == self.resident else "host" for i in range(len(self.modules))]

    def use(self, i: int) -> bool:
        """Make expert `i` resident; True when that took a swap."""
        if i == self.resident:
            return False
        t0 = time.perf_counter()
        self._evict(self.resident)
        self._load(i)
        self.swaps += 1
        self.swap_s += time.perf_counter() - t0
        return True

    def _evict(self, i: int | None) -> None:
        if i is None:
            return
        for name, t in _tensors(self.modules[i]):
            # CUDA: point at the pinned host copy (the device tensor is freed); CPU stand-in: take it out
            t.data = self._host[i][name] if not self.stand_in else torch.empty(0, dtype=t.dtype)
        if self.resident == i:
            self.resident = None

    def _load(self, i: int) -> None:
        for name, t in _tensors(self.modules[i]):
            host = self._host[i][name]
            t.data = host if self.stand_in else host.to(self.device, non_blocking=True)
        self.resident = i


def _tensors(module: torch.nn.Module):
    yield from module.named_parameters(recurse=True)
    yield from module.named_buffers(recurse=True)
