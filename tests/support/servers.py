"""Servers for the tests: an in-process `VideoService` behind uvicorn on a free port, and the command line of a
`longserve serve` process."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVE_KEY = "sk-test-longserve"


FAULTS = ROOT / "tests" / "support" / "faults"      # its sitecustomize.py injects faults into a serve process


def faults_env(**variables) -> dict:
    """The environment of a `longserve serve` process that loads tests/support/faults/sitecustomize.py with these
    LONGSERVE_TEST_* variables."""
    path = os.pathsep.join([str(FAULTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **variables}


def serve_command(port, data_dir, workers: int = 2, max_batch: int = 1):
    """`longserve serve` on tiny-latte with small limits and the key SERVE_KEY (append more flags to the list)."""
    script = Path(sys.executable).parent / "longserve"
    head = [str(script)] if script.exists() else [sys.executable, "-m", "longserve.server.cli"]
    return head + ["serve", "--model", "tiny-latte", "--workers", str(workers), "--device", "cpu", "--host",
                   "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir), "--max-batch", str(max_batch),
                   "--max-queue", "2", "--default-steps", "3", "--max-steps", "1000", "--api-key", SERVE_KEY,
                   "--score-model", "none", "--log-level", "warning", "--no-warm-up"]


@contextlib.contextmanager
def serving(data_dir, score=None, poll_after_ms: int = 50, api_key=None, log_level: str = "warning", **options):
    """An in-process server: `VideoService(ServeConfig.from_options(**options))` behind uvicorn on a free port
    (with `api_key`: /v1 needs it). Yields {"url", "service", "data_dir", "app"}; everything is closed on exit."""
    from longserve.server.api.app import create_app, serve_in_thread
    from longserve.server.api.service import ServeConfig, VideoService

    options.setdefault("device", "cpu")
    # the warm-up video (ready means warm) costs every server start a video; the suite's servers skip it, and
    # tests/server/test_drain.py's warm-up test runs it
    options.setdefault("warm_up", False)
    # tests poll as fast as they like: the per-key request rate is tested where it is the subject
    options.setdefault("rate_per_key", None)
    service = VideoService(ServeConfig.from_options(data_dir=str(data_dir), **options)).start()
    app = create_app(service, score, api_key=api_key, poll_after_ms=poll_after_ms)
    try:
        with serve_in_thread(app, log_level=log_level) as url:
            yield {"url": url, "service": service, "data_dir": data_dir, "app": app}
    finally:
        if score is not None:
            score.close()
        service.close()


def wait_until_healthy(proc, url: str, timeout_s: float = 180) -> None:
    """Poll a `longserve serve` process's /health until it answers 200; fail if the process exits first."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


def sse_events(response):
    """(event, data) of a Server-Sent Events response (httpx streaming), one pair per `data:` line."""
    event = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            yield event, json.loads(line[6:])
