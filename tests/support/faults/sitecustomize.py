"""Fault injection for `longserve serve` processes in tests, kept out of the installed package: a test puts this
folder first on the process's PYTHONPATH, so Python runs this file at start-up.

With LONGSERVE_TEST_PAUSE_BEFORE_COMMIT set, a video whose prompt is its value stops between its complete MP4 and
the record that says so: measuring the finished files (`SqliteJobStore.files_bytes`, the last step before the record is
written) blocks until the process is killed, a crash at the worst moment for the store. The variable is taken
out of the environment here, so the server's workers start without the patch.

With LONGSERVE_TEST_HOLD_FILE set to a path, the engine core waits before each denoising step for as long as that
file exists (tests/server/test_drain.py: a running video stays running, and the one behind it queued, until the
test has sent SIGTERM, on a machine of any speed). With LONGSERVE_TEST_STEP_SLEEP_S set, it sleeps that long
before each denoising step: a long video stays running without keeping the CPU busy (the queue, positions and
deletes still move at every step boundary).
"""

import os

_PROMPT = os.environ.pop("LONGSERVE_TEST_PAUSE_BEFORE_COMMIT", None)

if _PROMPT:
    import threading

    from longserve.server.api.store import SqliteJobStore

    _measure = SqliteJobStore.files_bytes

    def _files_bytes(self, video_id, *args):
        record = self.get(video_id)
        if record is not None and record.prompt == _PROMPT:
            threading.Event().wait()            # forever: the test kills the process
        return _measure(self, video_id, *args)

    SqliteJobStore.files_bytes = _files_bytes

_HOLD = os.environ.pop("LONGSERVE_TEST_HOLD_FILE", None)
_SLEEP_S = float(os.environ.pop("LONGSERVE_TEST_STEP_SLEEP_S", "0"))

if _HOLD or _SLEEP_S:
    import time

    from longserve.engine.core import EngineCore

    _denoise = EngineCore._denoise

    def _held_denoise(self, batch, num_steps):
        while _HOLD and os.path.exists(_HOLD):
            time.sleep(0.02)
        time.sleep(_SLEEP_S)
        return _denoise(self, batch, num_steps)

    EngineCore._denoise = _held_denoise
