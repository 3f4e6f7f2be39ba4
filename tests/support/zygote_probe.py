"""What a worker forked from a zygote fork server sees (tests/engine/test_zygote.py runs it in a worker)."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys

import torch


def probe(ctx, x, marker: str):
    """The worker's threads, a two-thread matmul's sum, whether `marker` is open here, whether SIGTERM has its
    default action, whether the root logger has no handler, whether `sys.stdout` is descriptor 1 and whether the
    imported objects are frozen out of the collector (engine/preload.py)."""
    opened = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            opened.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return (torch.get_num_threads(), float((x @ x).relu().sum()), marker in opened,
            signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, logging.getLogger().handlers == [],
            sys.stdout.fileno() == 1, gc.get_freeze_count() > 100_000)
