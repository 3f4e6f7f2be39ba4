"""`longserve serve` as a process: API key, queue limit and queue positions, then a hard kill and a
restart on the same --data-dir (completed videos stay downloadable, the interrupted job is failed
with a clear error, queued jobs run). One job is killed between its complete MP4 and the record that
says so (a fault injected by tests/support/faults/sitecustomize.py): it is not completed after the restart.
The data dir the server creates is private (0700, the database 0600)."""

import os
import signal
import stat
import subprocess
import threading
import time

import httpx
import pytest
from servers import ROOT, SERVE_KEY, faults_env, serve_command, sse_events, wait_until_healthy

from longserve.server.api.app import free_port

KEY = SERVE_KEY
AUTH = {"Authorization": f"Bearer {KEY}"}


PAUSED = "pause before commit"       # the prompt of the video that stops between its file and its record


class Server:
    def __init__(self, data_dir, env=None):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        # one worker: what is tested is the queue and the store across a restart, not the sharding
        self.proc = subprocess.Popen(serve_command(port, data_dir, workers=1), cwd=ROOT, env=env or dict(os.environ))
        wait_until_healthy(self.proc, self.url)
        self.http = httpx.Client(base_url=self.url, headers=AUTH, timeout=60)

    def create(self, **body):
        body.setdefault("prompt", "a red ball bouncing")
        body.setdefault("size", "32x32")
        body.setdefault("num_frames", 4)
        return self.http.post("/v1/videos", json=body)

    def wait(self, vid, until=("completed", "failed"), timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = self.http.get(f"/v1/videos/{vid}").json()
            if v["status"] in until:
                return v
            time.sleep(0.05)
        raise AssertionError(f"{vid} is still {v['status']}")

    def stop(self, sig=signal.SIGTERM):
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def sse(url, vid, out, ready):
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c, c.stream("GET", f"/v1/videos/{vid}/events") as r:
        ready.set()
        try:
            for event, data in sse_events(r):
                out.append((event, data))
                if event in ("video.completed", "video.failed", "video.deleted"):
                    return
        except httpx.HTTPError:
            return  # the server was killed under us


@pytest.fixture
def servers():
    started = []
    yield started
    for s in started:
        s.stop(signal.SIGKILL)


def test_a_restart_keeps_completed_videos_fails_the_interrupted_one_and_runs_the_queued(tmp_path, servers):
    data = tmp_path / "data"
    # each step waits 0.1 s first: the 1000-step video below holds its slot without keeping a core busy
    first = Server(data, env=faults_env(LONGSERVE_TEST_PAUSE_BEFORE_COMMIT=PAUSED, LONGSERVE_TEST_STEP_SLEEP_S="0.1"))
    servers.append(first)
    assert stat.S_IMODE(data.stat().st_mode) == 0o700 and stat.S_IMODE((data / "longserve.db").stat().st_mode) == 0o600

    # --api-key: /v1 needs the bearer token; the probes do not
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(first.url + "/v1/videos", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(first.url + "/v1/videos", json={"prompt": "x"}).status_code == 401
    assert httpx.get(first.url + "/health").status_code == 200

    done = first.create(num_inference_steps=3).json()
    assert first.wait(done["id"])["status"] == "completed"
    mp4 = first.http.get(f"/v1/videos/{done['id']}/content").content
    assert mp4[4:8] == b"ftyp"

    paused = first.create(prompt=PAUSED, num_inference_steps=3).json()    # its MP4 is complete, its record not
    deadline = time.monotonic() + 60
    while not (data / "videos" / f"{paused['id']}.mp4").exists():
        assert time.monotonic() < deadline, "the paused video's MP4 never appeared"
        time.sleep(0.05)
    assert first.http.get(f"/v1/videos/{paused['id']}").json()["status"] == "in_progress"

    running = first.create(num_inference_steps=1000).json()   # max-batch 1: it holds the only slot
    deadline = time.monotonic() + 60
    while first.http.get(f"/v1/videos/{running['id']}").json()["progress"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    dropped = first.create().json()
    waiting = first.create(num_inference_steps=3).json()
    assert first.http.get(f"/v1/videos/{waiting['id']}").json()["status"] == "queued"

    full = first.create()                                     # max-queue 2
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"

    events, ready = [], threading.Event()
    watcher = threading.Thread(target=sse, args=(first.url, waiting["id"], events, ready), daemon=True)
    watcher.start()
    assert ready.wait(10)
    deadline = time.monotonic() + 10
    while not events:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    name, said = events[0]
    assert (name, said["state"]["stage"], said["state"]["queue_position"]) == ("video.queued", "queued", 1)
    said.pop("state")                                   # (the one progress state: tests/server/test_ui_video.py)
    assert said == {"id": waiting["id"], "status": "queued", "progress": 0, "queue_position": 1}
    assert first.http.delete(f"/v1/videos/{dropped['id']}").json()["deleted"] is True
    deadline = time.monotonic() + 10
    while len(events) < 2:
        assert time.monotonic() < deadline, events
        time.sleep(0.01)
    assert events[1][0] == "video.queued" and events[1][1]["queue_position"] == 0, "the queue moved up"
    later = first.create(num_inference_steps=3).json()

    first.stop(signal.SIGKILL)                                 # no chance to clean up
    watcher.join(10)

    second = Server(data)
    servers.append(second)
    kept = second.http.get(f"/v1/videos/{done['id']}")
    assert kept.json()["status"] == "completed"
    assert second.http.get(f"/v1/videos/{done['id']}/content").content == mp4
    assert second.http.get(f"/v1/videos/{done['id']}/content", params={"variant": "thumbnail"}).status_code == 200

    interrupted = second.http.get(f"/v1/videos/{running['id']}").json()
    assert interrupted["status"] == "failed"
    assert interrupted["error"]["code"] == "server_restarted" and "create it again" in interrupted["error"]["message"]
    assert second.http.get(f"/v1/videos/{running['id']}/content").status_code == 409
    unfinished = second.http.get(f"/v1/videos/{paused['id']}").json()
    assert unfinished["status"] == "failed" and unfinished["error"]["code"] == "server_restarted", unfinished
    assert not list((data / "videos").glob(f"{paused['id']}*")), "no stored file without a completed record"

    for job in (waiting, later):                             # queued before the kill: run now
        assert second.wait(job["id"])["status"] == "completed"
    assert second.http.get(f"/v1/videos/{dropped['id']}").status_code == 404
    listed = [v["id"] for v in second.http.get("/v1/videos", params={"order": "asc"}).json()["data"]]
    assert listed == [done["id"], paused["id"], running["id"], waiting["id"], later["id"]]
    assert second.stop() == 0, "SIGTERM shuts the server down cleanly"


def test_the_cli_lists_serve_and_bench_serve_options(capsys):
    from longserve.server.cli import main

    for args in (["serve", "--help"], ["bench", "serve", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 0
        out = capsys.readouterr().out
        serve_flags = ("--data-dir", "--api-key", "--max-queue", "--max-batch", "--parallel", "--max-frames",
                       "--max-size", "--max-steps", "--retention")
        for flag in serve_flags if args[0] == "serve" else ("--concurrency", "--json"):
            assert flag in out, flag
