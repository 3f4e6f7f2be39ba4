"""Servers for the tests: an in-process `VideoService` behind uvicorn on a free port, and the command line of a
`longserve serve` process."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVE_KEY = "sk-test-longserve"


def serve_command(port, data_dir, workers: int = 2, max_batch: int = 1):
    """`longserve serve` on tiny-latte with small limits and the key SERVE_KEY (append more flags to the list)."""
    script = Path(sys.executable).parent / "longserve"
    head = [str(script)] if script.exists() else [sys.executable, "-m", "server.cli"]
    return head + ["serve", "--model", "tiny-latte", "--workers", str(workers), "--device", "cpu", "--host",
                   "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir), "--max-batch", str(max_batch),
                   "--max-queue", "2", "--default-steps", "3", "--max-steps", "1000", "--api-key", SERVE_KEY,
                   "--score-model", "none", "--log-level", "warning"]


@contextlib.contextmanager
def serving(data_dir, score=None, poll_after_ms: int = 50, **options):
    """An in-process server: `VideoService(ServeConfig.from_options(**options))` behind uvicorn on a free port.
    Yields {"url", "service", "data_dir", "app"}; everything is closed on exit."""
    from server.api.app import create_app, serve_in_thread
    from server.api.service import ServeConfig, VideoService

    options.setdefault("device", "cpu")
    service = VideoService(ServeConfig.from_options(data_dir=str(data_dir), **options)).start()
    app = create_app(service, score, poll_after_ms=poll_after_ms)
    try:
        with serve_in_thread(app) as url:
            yield {"url": url, "service": service, "data_dir": data_dir, "app": app}
    finally:
        if score is not None:
            score.close()
        service.close()
