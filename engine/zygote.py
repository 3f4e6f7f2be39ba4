"""The fork server, forked from this process instead of launched as a new interpreter (a zygote).

multiprocessing's fork server is a fresh `python -c` that imports torch, diffusers, transformers and the families
(`engine/preload.py`): about 4.5 CPU-s on a 2-core AMD EPYC, in every process that starts CPU workers (the CLI's
`generate`, `live` and `serve`, a script using `VideoPipeline`, each pytest process). The process starting it has
imported most of that already; forked from it after the preload's imports, the server costs a `fork` (the pages
are shared) and its workers start exactly as before: the same server loop (`multiprocessing.forkserver.main`),
the same preload list, the same protocol to the parent.

A fork is only safe from a known state, so `start` refuses (and the stock fork server is launched as before) when:
- another Python thread runs (it may hold a lock the copy would inherit held), unless the caller vouches for its
  threads (`threads_ok=True`: the suite, at its first test, for pytest-xdist's channel reader);
- CUDA is initialised (the driver does not survive a fork);
- this Python's fork server does not have the shape written for (3.11 and 3.12's `main` and fields).
GNU OpenMP's thread pool does not survive a fork either (a worker's first parallel region waits forever on threads
the copy does not have: reproduced with 2 threads), so its threads are released first (`omp_pause_resource_all`;
the next parallel region here starts them again). In the copy: every descriptor but stdio and the server's own is
retired (as the stock launch passes only those), the standard streams, signal handlers and root logger are a new
interpreter's (a library's log handler made on a retired descriptor, as on pytest's capture file, writes to
stderr again), the standard streams are flushed before the fork (else each worker wrote the caller's pending text
again as it exited), the fork server's lock (held by `start` at the fork) is a new one, and it leaves with
`os._exit`, never unwinding into the caller's frames. The copy freezes its heap (its collections never scan, nor
copy, the shared pages); the caller's is left as it was.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import inspect
import os
import re
import signal
import socket
import sys
import threading

#: `multiprocessing.forkserver.main`'s parameters this module drives (Python 3.11 and 3.12)
_MAIN_PARAMETERS = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
_OMP_PAUSE_HARD = 2
#: set while `start` imports the preload in the caller's process (engine/preload.py then leaves its heap alone)
IMPORTING = False
#: GNU's, Intel's and LLVM's OpenMP runtimes in /proc/self/maps
_OPENMP = re.compile(r"/\S*/lib[gi]?omp[\w.-]*\.so[\w.]*")


def _shape_known() -> bool:
    from multiprocessing import forkserver

    try:
        names = list(inspect.signature(forkserver.main).parameters)
    except (TypeError, ValueError):
        return False
    fields = ("_lock", "_forkserver_pid", "_forkserver_address", "_forkserver_alive_fd", "_preload_modules")
    return names == _MAIN_PARAMETERS and all(hasattr(forkserver._forkserver, f) for f in fields)


def refusal(threads_ok: bool = False) -> str | None:
    """Why this process must not fork its fork server now (None: it may)."""
    if not hasattr(os, "fork") or not _shape_known():
        return f"this Python's fork server ({sys.version.split()[0]}) is not the shape engine/zygote.py drives"
    if not threads_ok and threading.active_count() > 1:
        return f"{threading.active_count() - 1} other Python thread(s) run"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in this process"
    return None


def _pause_openmp() -> None:
    """Release the OpenMP runtime's threads (each runtime this process has loaded) before the fork."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {m.group(0) for m in map(_OPENMP.search, maps) if m}
    except OSError:
        return
    for path in paths:
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        pause(_OMP_PAUSE_HARD)


def is_forked() -> bool:
    """Whether this process's running fork server is one `start` forked (not multiprocessing's own launch)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    return server._forkserver_pid is not None and getattr(server, "_longserve_zygote", None) == server._forkserver_pid


def _flush_std_streams() -> None:
    """Text written but not yet flushed would be written again by the copy's workers as they exit (multiprocessing
    flushes the standard streams then; its own fork start method flushes before forking, too)."""
    for stream in {id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}.values():
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


def _retire_fds(keep: set[int]) -> None:
    """Every descriptor but stdio and `keep` pointed at /dev/null: what it held (a socket, a pipe's write end, a
    listening port) is released here as a close would, while its number stays taken, so that a Python object of the
    caller's that still names it (pytest's capture file, a library's log stream) writes nowhere instead of into a
    socket a worker opens later under the same number."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    null = os.open(os.devnull, os.O_RDWR)
    for fd in fds:
        if fd > 2 and fd != null and fd not in keep:
            try:
                os.fstat(fd)
                os.dup2(null, fd)
            except OSError:
                pass
    os.close(null)


def _as_new_interpreter() -> None:
    """The copy's standard streams, signal handlers, fault handler and root logger as a new interpreter's (the
    caller's may be pytest's capture files, drain a server, or keep log records in memory, as pytest does)."""
    import faulthandler
    import logging

    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__
    faulthandler.disable()                       # its file may be a descriptor retired here
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(file=sys.__stderr__)
    root = logging.getLogger()
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    for logger in list(logging.Logger.manager.loggerDict.values()):
        for handler in getattr(logger, "handlers", []):       # a library's handler made on pytest's capture file
            if type(handler) is logging.StreamHandler and _retired(handler.stream):
                handler.setStream(sys.__stderr__)


def _retired(stream) -> bool:
    """Whether `stream` writes to a descriptor `_retire_fds` pointed at /dev/null."""
    try:
        return stream.fileno() > 2
    except (AttributeError, OSError, ValueError):
        return False


def _serve(listener_fd: int, alive_r: int, preload: list[str]) -> None:
    """The copy: multiprocessing's own fork-server loop, then `os._exit` whatever happens."""
    code = 1
    try:
        gc.freeze()                              # the copy's collections never scan (nor copy) the shared pages
        from multiprocessing import forkserver

        forkserver._forkserver._lock = threading.Lock()     # held by `start` at the fork: a worker's own pools
        _retire_fds({listener_fd, alive_r})
        _as_new_interpreter()
        forkserver.main(listener_fd, alive_r, preload)
        code = 0
    except SystemExit:                           # the loop's way out: every client is gone
        code = 0
    finally:
        os._exit(code)


def start(preload: list[str], threads_ok: bool = False) -> bool:
    """Run this process's fork server as a fork of it, after importing `preload` here. Returns whether a fork
    server runs that this call (or an earlier one) forked; False: nothing was done, and multiprocessing launches
    its own when a worker starts."""
    from multiprocessing import connection, forkserver, resource_tracker, util

    if not hasattr(os, "fork") or not _shape_known():
        return False
    server = forkserver._forkserver
    with server._lock:
        if server._forkserver_pid is not None:
            pid, _ = os.waitpid(server._forkserver_pid, os.WNOHANG)
            if not pid:
                return is_forked()
            os.close(server._forkserver_alive_fd)
            server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
        if refusal(threads_ok) is not None:
            return False
        global IMPORTING
        IMPORTING = True
        try:
            for name in preload:
                importlib.import_module(name)
        finally:
            IMPORTING = False
        if refusal(threads_ok) is not None:     # the imports may have started one
            return False
        resource_tracker.ensure_running()        # its descriptor reaches each worker through the server's protocol
        _pause_openmp()
        _flush_std_streams()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            try:
                pid = os.fork()
                if pid == 0:
                    _serve(listener.fileno(), alive_r, list(preload))
            except BaseException:
                os.close(alive_w)
                raise
            finally:
                os.close(alive_r)
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
        server._longserve_zygote = pid
        return True
