"""How worker processes start; light on purpose (no torch until a fork server is started): the CLI starts it first.

CPU workers are forked from a fork server that imported torch, diffusers, transformers and
the families once (`engine/preload.py`); CUDA workers are spawned (the fork server must never
have touched the driver). The fork server is itself a fork of this process where that is safe
(`engine/zygote.py`), else multiprocessing's own launch; `prestart` starts it at once, before the
command's own work.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from contextlib import contextmanager

PRELOAD = ["longserve.engine.preload"]
#: every worker's `__main__` (engine/worker_main.py): never the caller's script
WORKER_MAIN = "longserve.engine.worker_main"
_MAIN_LOCK = threading.Lock()


def start_method(device: str) -> str:
    return "spawn" if device.startswith("cuda") else "forkserver"


@contextmanager
def _worker_main_module():
    """While a worker process is being started: `sys.modules["__main__"]` is `WORKER_MAIN`, so the start data
    multiprocessing sends the new process names that module as the one to run as `__main__`, not the caller's
    script (which, with no main guard, would start the pool again in each worker; from `python -` it is not
    even a file)."""
    import importlib

    entry = importlib.import_module(WORKER_MAIN)
    with _MAIN_LOCK:
        caller = sys.modules["__main__"]
        sys.modules["__main__"] = entry
        try:
            yield
        finally:
            sys.modules["__main__"] = caller


def context(device: str):
    """The multiprocessing context a pool on `device` starts its workers with; its `Process` runs the worker
    under `WORKER_MAIN` (engine/worker_main.py) as its main module."""
    method = start_method(device)
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)    # read when the fork server starts (once per process)
    return _WorkerContext(ctx)


class _SpawnWorker(multiprocessing.context.SpawnProcess):
    @staticmethod
    def _Popen(process_obj):
        with _worker_main_module():
            return multiprocessing.context.SpawnProcess._Popen(process_obj)


class _ForkServerWorker(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        from longserve.engine import zygote

        zygote.start(PRELOAD)                  # forked from here when it is safe (engine/zygote.py); else stock
        with _worker_main_module():
            return multiprocessing.context.ForkServerProcess._Popen(process_obj)


class _WorkerContext:
    """A multiprocessing context whose processes start from the worker entry point (everything else: `ctx`'s).
    Its Process classes are module-level: the spawned child unpickles the process object."""

    def __init__(self, ctx):
        self._ctx = ctx
        self.Process = _SpawnWorker if ctx.get_start_method() == "spawn" else _ForkServerWorker

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def _cuda_likely() -> bool:
    """Without importing torch: is there an NVIDIA device to default to?"""
    return os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES", "0") not in ("", "-1")


def prestart(device: str | None = None, launcher: str = "auto", threads_ok: bool = False) -> bool:
    """Start the fork server now if this process's pools will fork from it: forked from this process after the
    preload's imports (engine/zygote.py: while no other Python thread runs, or `threads_ok`, where the caller vouches
    for its threads, as the suite does for pytest-xdist's), else launched (its imports then run beside the caller's).
    Returns whether one runs."""
    if launcher == "torchrun" or (launcher == "auto" and "RANK" in os.environ and "MASTER_ADDR" in os.environ):
        return False                           # a torchrun group: no local workers
    if start_method(device or ("cuda" if _cuda_likely() else "cpu")) != "forkserver":
        return False
    context("cpu")
    from longserve.engine import zygote

    if not zygote.start(PRELOAD, threads_ok=threads_ok):
        from multiprocessing import forkserver

        forkserver.ensure_running()
    return True


def freeze_heap() -> None:
    """Once a long-lived process has imported and loaded what it keeps: collect, then move every object left out of
    the collector's reach (`gc.freeze`). A full collection over torch's, diffusers' and transformers' objects costs
    about 0.25 s on a 2-core AMD EPYC, on whichever thread allocated last (a server's event loop included); frozen,
    later passes scan only what the process makes after this. A fork server freezes without collecting: its own
    after the preload's imports (`engine/preload.py`), or a forked one first thing in the copy (`engine/zygote.py`)."""
    import gc

    gc.collect()
    gc.freeze()
