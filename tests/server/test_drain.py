"""SIGTERM drains `longserve serve` (a real process): new creates get 503 in the JSON envelope while the running
video finishes within --drain-seconds (its event stream and its streamed MP4 end cleanly), a queued one stays
queued for the next start (its event stream ends with the error envelope), and the process exits before the
stop timeout the docs give (drain + 10 s). A video that runs past the drain fails with server_shutdown:
tests/server/test_storage.py drains an in-process server for that."""

import signal
import sqlite3
import subprocess
import threading
import time

import httpx
from servers import ROOT, SERVE_KEY, faults_env, serve_command, sse_events, wait_until_healthy

from longserve.server.api.app import free_port

DRAIN_S = 60               # --drain-seconds here: room for a loaded machine (the drain ends when the video does)
STOP_MARGIN_S = 10          # docs/serving.md: the stop timeout is --drain-seconds + 10 s
KEY = {"Authorization": f"Bearer {SERVE_KEY}"}


def read_events(url, vid, out):
    """(event, data) of one video's SSE stream until it ends; "closed" last if the body ended cleanly."""
    try:
        with httpx.Client(base_url=url, headers=KEY, timeout=60) as c, c.stream("GET", f"/v1/videos/{vid}/events") as r:
            out.extend(sse_events(r))
        out.append(("closed", None))
    except httpx.HTTPError as e:
        out.append(("broken", repr(e)))


def read_content(url, vid, out):
    try:
        with httpx.Client(base_url=url, headers=KEY, timeout=60) as c, \
                c.stream("GET", f"/v1/videos/{vid}/content", params={"stream": "true"}) as r:
            out.append((r.status_code, r.headers.get("content-type"), b"".join(r.iter_bytes())))
    except httpx.HTTPError as e:
        out.append(("broken", repr(e), b""))


def test_sigterm_lets_the_running_video_finish_refuses_new_ones_and_exits_before_the_stop_timeout(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # the drain ends as soon as the running video is done, so a long --drain-seconds costs nothing when quiet;
    # the engine holds before each step while `hold` exists, so the first video is running and the second queued
    # when SIGTERM comes, however fast the machine (tests/support/faults/sitecustomize.py)
    hold = tmp_path / "hold"
    hold.touch()
    proc = subprocess.Popen(serve_command(port, tmp_path / "data", workers=1, max_batch=1)
                            + ["--drain-seconds", str(DRAIN_S)], cwd=ROOT,
                            env=faults_env(LONGSERVE_TEST_HOLD_FILE=str(hold)))
    try:
        http = httpx.Client(base_url=url, headers=KEY, timeout=30)
        wait_until_healthy(proc, url)

        def create(steps):
            r = http.post("/v1/videos", json={"prompt": "a red ball bouncing", "size": "32x32", "num_frames": 8,
                                              "num_inference_steps": steps})
            assert r.status_code == 200, r.text
            return r.json()["id"]

        running, queued = create(3), create(3)                  # --max-batch 1: the second one waits
        content, events = [], {running: [], queued: []}
        readers = [threading.Thread(target=read_content, args=(url, running, content), daemon=True)]
        readers += [threading.Thread(target=read_events, args=(url, vid, out), daemon=True)
                    for vid, out in events.items()]
        for t in readers:
            t.start()
        while not all(events.values()):                          # both event streams are open
            time.sleep(0.02)
        assert http.get(f"/v1/videos/{queued}").json()["status"] == "queued"
        assert http.get(f"/v1/videos/{running}").json()["status"] in ("queued", "in_progress")

        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        while (r := http.post("/v1/videos", json={"prompt": "too late"})).status_code == 200:
            assert time.monotonic() - t0 < 2, "creates are still admitted after SIGTERM"
        assert r.status_code == 503 and r.headers["Retry-After"], r.text
        assert r.json()["error"]["code"] == "server_shutdown" and r.json()["error"]["type"] == "server_error"
        health = httpx.get(url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        hold.unlink()                                            # the running video goes on

        proc.wait(DRAIN_S + STOP_MARGIN_S)
        exited_after = time.monotonic() - t0
        for t in readers:
            t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and exited_after < DRAIN_S + STOP_MARGIN_S, exited_after

    assert [e for e, _ in events[running][-2:]] == ["video.completed", "closed"], events[running][-3:]
    [(status, ctype, mp4)] = content
    assert status == 200 and ctype == "video/mp4" and mp4[4:8] == b"ftyp"
    assert mp4 == (tmp_path / "data" / "videos" / f"{running}.mp4").read_bytes(), "the whole MP4 was streamed"
    (last, envelope), (closed, _) = events[queued][-2:]
    assert last == "error" and envelope["error"]["code"] == "server_shutdown" and closed == "closed"

    db = sqlite3.connect(tmp_path / "data" / "longserve.db")
    rows = dict(db.execute("SELECT id, status FROM videos").fetchall())
    db.close()
    assert rows == {running: "completed", queued: "queued"}, "the queued video runs after a restart"


def test_health_says_ok_only_after_the_warm_up_video(tmp_path, monkeypatch):
    """Ready means warm (issue 36: the first video on a fresh server took 25 s, later ones 1.4 s): the service runs
    one video at the model's default shape before it exposes its engine, so /health says "starting" throughout, and
    "ok" (with the warm-up's time) only after it."""
    from longserve.engine.engine import VideoEngine
    from longserve.server.api.config import ServeConfig
    from longserve.server.api.service import VideoService

    service = VideoService(ServeConfig.from_options(model="tiny-latte", workers=1, device="cpu", score_model="none",
                                                    data_dir=str(tmp_path / "data")))
    during, warm_up = [], VideoEngine.warm_up

    def watched(engine, *args, **kwargs):
        during.append(service.monitor.health())
        return warm_up(engine, *args, **kwargs)

    monkeypatch.setattr(VideoEngine, "warm_up", watched)
    service.start()
    try:
        [(status, body)] = during
        assert (status, body["status"]) == (503, "starting")
        status, body = service.monitor.health()
        assert (status, body["status"]) == (200, "ok") and body["warm_up_s"] > 0
    finally:
        service.close()
