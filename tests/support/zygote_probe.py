"""What a worker forked from a zygote fork server sees (tests/engine/test_zygote.py runs it in a worker)."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys

import torch


def probe(ctx, x, marker: str):
    """The worker's threads, a two-thread matmul's sum, then whether: `marker` is open here, SIGTERM has its default
    action, the root logger has no handler, `sys.stdout` is descriptor 1, the imported objects are frozen out of the
    collector (engine/preload.py), the fork server's lock is free (a worker's own pools), and the "lib" logger's
    handler, made on the caller's file, writes to stderr."""
    from multiprocessing import forkserver

    opened = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            opened.add(os.path.realpath(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return (torch.get_num_threads(), float((x @ x).relu().sum()), os.path.realpath(marker) in opened,
            signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, logging.getLogger().handlers == [],
            sys.stdout.fileno() == 1, gc.get_freeze_count() > 100_000, not forkserver._forkserver._lock.locked(),
            logging.getLogger("lib").handlers[0].stream.fileno() == 2)
