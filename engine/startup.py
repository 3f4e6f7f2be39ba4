"""How worker processes start; light on purpose (no torch): the CLI starts the fork server before its own imports.

CPU workers are forked from a fork server that imported torch, diffusers, transformers and
the families once (`engine/preload.py`); CUDA workers are spawned (the fork server must never
have touched the driver). `prestart` launches the fork server at once: its imports then run
beside the coordinator's, instead of after them when the first pool starts.
"""

from __future__ import annotations

import multiprocessing
import os

PRELOAD = ["longserve.engine.preload"]


def start_method(device: str) -> str:
    return "spawn" if device.startswith("cuda") else "forkserver"


def context(device: str):
    """The multiprocessing context a pool on `device` starts its workers with."""
    method = start_method(device)
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)    # read when the fork server starts (once per process)
    return ctx


def _cuda_likely() -> bool:
    """Without importing torch: is there an NVIDIA device to default to?"""
    return os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES", "0") not in ("", "-1")


def prestart(device: str | None = None, launcher: str = "auto") -> bool:
    """Launch the fork server now if this process's pools will fork from it (returns at once; the server's
    imports run in the background). Returns whether one was launched."""
    if launcher == "torchrun" or (launcher == "auto" and "RANK" in os.environ and "MASTER_ADDR" in os.environ):
        return False                           # a torchrun group: no local workers
    if start_method(device or ("cuda" if _cuda_likely() else "cpu")) != "forkserver":
        return False
    context("cpu")
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return True
