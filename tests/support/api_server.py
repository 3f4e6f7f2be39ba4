"""The API tests' in-process server (uvicorn on a real port, tiny-latte on 2 workers, tiny-lm scoring) and the small
HTTP helpers those tests share (tests/server/test_api.py, test_api_requests.py; the fixture: tests/server/conftest.py,
one server a test process, which both files use)."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
from servers import sse_events

from longserve.server.api.app import create_app, serve_in_thread
from longserve.server.api.metrics import parse_text
from longserve.server.api.score_service import ScoreService
from longserve.server.api.service import ServeConfig, VideoService

TERMINAL = ("video.completed", "video.failed", "video.deleted")
#: a small valid create body (what a malformed request is one change from)
VALID = {"prompt": "a red ball", "size": "32x32", "num_frames": 4, "num_inference_steps": 2}


@contextlib.contextmanager
def api_server(data_dir):
    """{"url", "service", "data_dir"} of a started server; closed when the block ends."""
    # max_steps 250 x default_steps: the cost of a long-running video is not these tests' subject
    config = ServeConfig.from_options(warm_up=False,  # the warm-up video: tests/server/test_drain.py
                                      model="tiny-latte", workers=2, device="cpu", data_dir=str(data_dir),
                                      max_batch=16, max_queue=64, default_steps=4, max_steps=1000,
                                      decode_chunk_frames=4, max_queued_work=None,
                                      rate_per_key=None)        # the fuzzer is fast; the rate: test_fairness.py
    service = VideoService(config).start()
    app = create_app(service, ScoreService("tiny-lm", workers=1, device="cpu"), poll_after_ms=50)
    try:
        with serve_in_thread(app) as url:
            yield {"url": url, "service": service, "data_dir": data_dir}
    finally:
        app.state.score.close()
        service.close()


def create(http, **body):
    body.setdefault("prompt", "a red ball bouncing")
    r = http.post("/v1/videos", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def wait(http, vid, timeout=120, until=("completed", "failed")):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = http.get(f"/v1/videos/{vid}").json()
        if v["status"] in until:
            return v
        time.sleep(0.02)
    raise AssertionError(f"{vid} still {v['status']} after {timeout} s")


def collect_events(url, vid, out: list, ready: threading.Event | None = None, timeout=120):
    """Read a video's SSE stream into `out` as (event, data) until a terminal event."""
    with httpx.Client(base_url=url, timeout=timeout) as c:
        with c.stream("GET", f"/v1/videos/{vid}/events") as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            if ready is not None:
                ready.set()
            for event, data in sse_events(r):
                out.append((event, data))
                if event in TERMINAL:
                    return


def multipart(fields: dict, files: dict | None = None) -> dict:
    """Request kwargs for a multipart/form-data body of text fields (and files), as the openai client sends."""
    boundary = "longserve-test-boundary"
    parts = []
    for k, v in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode())
    for k, (filename, data) in (files or {}).items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"; filename="{filename}"\r\n'
                     f"Content-Type: application/octet-stream\r\n\r\n".encode() + data + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return {"content": body, "headers": {"content-type": f"multipart/form-data; boundary={boundary}"}}


def metric(http, name):
    return parse_text(http.get("/metrics").text).get(name, 0.0)


def wait_idle(server, timeout=120) -> None:
    """Until no job of earlier tests is queued or running (a test that counts what one video moves)."""
    deadline = time.monotonic() + timeout
    while server["service"].jobs.jobs() or server["service"].engine.stats().running:
        assert time.monotonic() < deadline, "the server stayed busy"
        time.sleep(0.05)
