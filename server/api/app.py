"""The FastAPI application: routes, error envelope, auth, and an in-process runner.

    service = VideoService(ServeConfig.from_options(model="tiny-latte", workers=2)).start()
    app = create_app(service, api_key=None)     # Host and Origin checks from service.config
    uvicorn.run(app, host="127.0.0.1", port=8000)      # or: with serve_in_thread(app) as url: ...

The app does not own the services' lifecycle: whoever started them closes them
(`longserve serve` does, after uvicorn returns).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Sequence

from fastapi import FastAPI

from longserve.server.api.docs import docs_router
from longserve.server.api.edge import (
    EdgeGuard,
    default_allowed_hosts,
    exposure_warnings,
    log_config,
    parse_list,
    uvicorn_options,
)
from longserve.server.api.errors import install_error_handlers
from longserve.server.api.fairness import Fairness
from longserve.server.api.loras import v1 as loras_v1
from longserve.server.api.openai_routes import v1 as openai_v1
from longserve.server.api.routes import router, v1
from longserve.server.api.ui import router as ui_router
from longserve.server.api.ui import v1 as ui_v1

DEFAULT_MAX_BODY_BYTES = 4 << 20


def create_app(videos, score=None, *, api_key: str | Sequence[str] | None = None,
               admin_api_key: str | Sequence[str] | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, poll_after_ms: int = 250) -> FastAPI:
    """videos: a started `server.api.service.VideoService` (its `ServeConfig` gives the edge's settings: allowed
    hosts and origins, the bound address); score: a
    `server.api.score_service.ScoreService` or None; api_key: one key or several (one per client: each a tenant,
    `server/api/tenants.py`); admin_api_key: keys that see every tenant's videos (they are valid keys too)."""
    config = videos.config
    # /docs and /openapi.json are routes of ours (server/api/docs.py): behind the key like the API, no CDN script
    app = FastAPI(title="longserve", description="OpenAI-compatible video generation (and text scoring) server",
                  version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.videos = videos
    app.state.fairness = Fairness(config.max_streams_per_key, config.rate_per_key, config.rate_burst)
    app.state.score = score
    keys, admins = ((k,) if isinstance(k, str) else tuple(k or ()) for k in (api_key, admin_api_key))
    app.state.admin_keys = tuple(k for k in admins if k)
    app.state.api_keys = tuple(dict.fromkeys(k for k in keys + admins if k))
    app.state.max_body_bytes = max_body_bytes
    app.state.poll_after_ms = poll_after_ms
    app.state.edge_warnings = exposure_warnings(config.host, bool(app.state.api_keys))
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(v1)
    app.include_router(openai_v1)                  # extensions, remix, webhook endpoints
    app.include_router(loras_v1)                   # LoRA adapters loaded while serving
    app.include_router(ui_router)                  # the page at /ui (/ redirects there)
    app.include_router(ui_v1)
    app.include_router(docs_router(config.docs))
    allowed_hosts = parse_list(config.allowed_hosts) or default_allowed_hosts(config.host)
    app.add_middleware(EdgeGuard, allowed_hosts=allowed_hosts, allowed_origins=parse_list(config.allowed_origins),
                       keyed=lambda: bool(app.state.api_keys))
    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int | None = None, timeout_s: float = 30.0,
                    log_level: str = "warning"):
    """Run uvicorn in a background thread of this process (its logs as `longserve serve` configures them:
    `edge.log_config`); yields the base URL ("http://host:port")."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                           timeout_graceful_shutdown=5, log_config=log_config(log_level),
                                           **uvicorn_options(app.state.videos.config)))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start on {host}:{port}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
