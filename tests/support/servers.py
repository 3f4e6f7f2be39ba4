"""In-process servers for the tests: a `VideoService` behind uvicorn on a free port."""

from __future__ import annotations

import contextlib


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
