"""The fork server forked from the process that starts workers (engine/zygote.py), instead of a new interpreter
importing torch, diffusers and transformers again."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from multiprocessing import forkserver
from pathlib import Path


def test_this_suites_fork_server_is_a_fork_of_this_pytest_process():
    """tests/conftest.py starts it at the first test: its command line is this process's, not multiprocessing's
    `python -c 'from multiprocessing.forkserver import main; ...'`."""
    from longserve.engine.zygote import is_forked

    server = forkserver._forkserver
    assert is_forked() and server._forkserver_pid is not None
    with open(f"/proc/{server._forkserver_pid}/cmdline", "rb") as f:
        theirs = f.read()
    with open("/proc/self/cmdline", "rb") as f:
        assert theirs == f.read() and b"forkserver" not in theirs


def test_a_fork_is_refused_while_another_thread_runs_unless_the_caller_vouches_for_it():
    from longserve.engine.zygote import refusal

    others = threading.active_count() - 1               # pytest-xdist's channel reader, under xdist
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert refusal() == f"{others + 1} other Python thread(s) run"
        assert refusal(threads_ok=True) in (None, "CUDA is initialised in this process")
    finally:
        stop.set()
        thread.join()


#: a new process that used OpenMP with two threads, opened a file, made it `sys.stdout` and set a SIGTERM handler and a
#: root log handler before its first pool; its worker (two threads: 1 worker of a 2-thread budget) sees none of it
SCRIPT = r"""
import gc, logging, os, signal, sys
import torch
torch.set_num_threads(2)
x = torch.randn(256, 256)
want = float((x @ x).relu().sum())                # GNU OpenMP's team of 2 exists from here
sys.stdout.write("PENDING\n")                     # not flushed: block-buffered into a pipe
marker = open(sys.argv[1], "w")
signal.signal(signal.SIGTERM, lambda *a: None)
logging.getLogger().addHandler(logging.StreamHandler(marker))
logging.getLogger("lib").addHandler(logging.StreamHandler(marker))      # a library's, made on pytest's capture
sys.stdout = marker                                # as pytest's capture replaces it
from multiprocessing import forkserver
from longserve.engine.pool import WorkerPool
from zygote_probe import probe

with WorkerPool(1, device="cpu") as pool:
    [(threads, got, *clean)] = pool.run(probe, x, marker.name, timeout_s=60)
    pool.restart()                                  # workers forked again: the pending text must not come back
    pool.run(probe, x, marker.name, timeout_s=60)
    server = forkserver._forkserver._forkserver_pid
    with open(f"/proc/{server}/cmdline", "rb") as f, open("/proc/self/cmdline", "rb") as g:
        forked = f.read() == g.read()                 # not multiprocessing's own `python -c ...` launch
print("RESULT", forked, threads, got == want, *clean, gc.get_freeze_count(), file=sys.__stdout__, flush=True)
"""


def test_a_forked_fork_server_s_workers_run_openmp_and_inherit_no_file_handler_or_logger(tmp_path):
    """Without releasing OpenMP's threads before the fork the worker's first two-thread matmul waits forever (the
    timeout below); without the copy's clean-up it would hold the caller's file, run its SIGTERM handler, find the
    fork server's lock held (a pool of its own hung) and lose a library's log lines; without the flush each worker
    wrote the caller's pending line again. The worker's imports are frozen out of its collector; the caller's heap
    is left unfrozen (the last figure)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "support"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "marker.log")], capture_output=True,
                         text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "RESULT True 2 True False True True True True True True 0" in run.stdout, run.stdout + run.stderr[-3000:]
    assert run.stdout.count("PENDING") == 1, run.stdout     # not again by each worker as it exits
