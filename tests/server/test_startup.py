"""The server listens before it loads: `/health/live` answers from the first moment, `/health/ready` says
`starting` with the start's stages (store, workers, warm_up, recover) until the model is loaded and warm, the API
answers 503 `model_loading` meanwhile, and the warm-up runs at `--warm-up-shape`."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest

from longserve.server.api.app import create_app, serve_in_thread
from longserve.server.api.config import parse_shape
from longserve.server.api.service import ServeConfig, VideoService
from longserve.server.api.startup import StartupProgress, warm_up_listener

pytestmark = pytest.mark.usefixtures("one_thread")


def test_live_answers_while_the_model_loads_and_ready_tells_each_stage_until_it_is_warm(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="longserve.server")
    service = VideoService(ServeConfig.from_options(model="tiny-latte", workers=1, device="cpu", score_model="none",
                                                    data_dir=str(tmp_path), warm_up=True, warm_up_shape="32x32x3"))
    try:
        with serve_in_thread(create_app(service)) as url:
            live = httpx.get(url + "/health/live", timeout=10)
            ready = httpx.get(url + "/health/ready", timeout=10)
            assert live.status_code == 200 and live.json()["status"] == "alive"
            assert ready.status_code == 503 and ready.json()["status"] == "starting"
            early = httpx.post(url + "/v1/videos", json={"prompt": "a"}, timeout=10)
            assert early.status_code == 503 and early.json()["error"]["code"] == "model_loading", early.text
            assert early.headers["retry-after"]
            starting = threading.Thread(target=service.start)
            starting.start()
            stages, deadline = [], time.monotonic() + 120
            while True:
                live = httpx.get(url + "/health/live", timeout=10)        # answers throughout
                assert live.status_code == 200, live.text
                ready = httpx.get(url + "/health/ready", timeout=10)
                stage = ready.json()["startup"]["stage"]
                if not stages or stages[-1] != stage:
                    stages.append(stage)
                if ready.status_code == 200:
                    break
                assert time.monotonic() < deadline, ready.text
                time.sleep(0.25)
            starting.join()
            body = ready.json()
            assert body["status"] == "ok" and stages[-1] == "ready", stages      # (a quick start skips the rest)
            done = body["startup"]["stages"]
            assert [s["stage"] for s in done] == ["store", "workers", "warm_up", "recover"]
            assert all(s["status"] == "done" and s["s"] >= 0 for s in done)
            assert done[2]["what"] == "one video at 32x32, 3 frames" and body["warm_up_s"] > 0
            assert httpx.get(url + "/v1/models", timeout=10).status_code == 200
    finally:
        service.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "longserve.server"]
    assert any(m.startswith("starting: warm_up: one video at 32x32, 3 frames") for m in lines), lines
    assert sum(m.startswith("started: ") for m in lines) == 4, lines


def test_a_warm_up_shape_the_model_refuses_stops_the_start_before_the_load(tmp_path):
    with pytest.raises(ValueError, match="--warm-up-shape"):
        ServeConfig.from_options(model="tiny-latte", warm_up_shape="64by64")
    service = VideoService(ServeConfig.from_options(model="tiny-wan", device="cpu", data_dir=str(tmp_path),
                                                    warm_up=True, warm_up_shape="64x64x4"))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"--warm-up-shape 64x64x4: .*num_frames"):
        service.start()
    assert time.monotonic() - t0 < 20 and service.engine is None, "refused before any worker loads"
    assert service.startup.view()["error"].startswith("--warm-up-shape")
    service.close()
    assert parse_shape("default") is None and parse_shape("832x480x81") == (832, 480, 81)
    assert parse_shape("64X48") == (64, 48, None)


def test_the_warm_up_s_steps_and_frames_are_the_running_stage_s_detail():
    from longserve.engine.outputs import FramesChunk, StepProgress

    progress = StartupProgress()
    progress.begin("warm_up", "one video at 64x64, 9 frames")
    heard = warm_up_listener(progress)
    heard(StepProgress("w", 1, 2, 1, 0.1))
    assert progress.view()["detail"] == "step 1/2"
    heard(FramesChunk("w", None, 0, 5, 9, 0.1))
    assert progress.view()["detail"] == "decoded frames 5/9" and progress.view()["stage"] == "warm_up"
    progress.done("1.0 s")
    progress.finish()
    assert progress.view()["stage"] == "ready" and progress.view()["stages"][0]["detail"] == "1.0 s"


def test_the_start_line_says_where_jobs_live_without_the_database_password(tmp_path):
    from longserve.server.api.startup import describe_store

    replica = ServeConfig.from_options(data_dir=str(tmp_path), store="postgresql://ls:hunter2@db:5432/ls",
                                       media_store="s3://bucket/videos")
    line = describe_store(replica)
    assert "PostgreSQL postgresql://ls:***@db:5432/ls (shared by the replicas)" in line and "hunter2" not in line
    assert line.endswith("videos in s3://bucket/videos")
    assert describe_store(ServeConfig.from_options(data_dir=str(tmp_path))) == f"SQLite under {tmp_path}"


def test_log_format_json_writes_one_object_a_line_with_the_transition_s_fields_and_no_key():
    """`--log-format json` (logs.configure_logging, in a process of its own: it replaces the root logger's handlers):
    every line is a JSON object; a job transition's fields are its fields; uvicorn's access line keeps the edge's
    redaction of a key put in a URL."""
    import json
    import subprocess
    import sys

    code = ("import logging\n"
            "from longserve.server.api.logs import configure_logging, job_event\n"
            "configure_logging('info', 'json')\n"
            "logging.getLogger('uvicorn.access').info('%s - \"%s %s HTTP/%s\" %d', '127.0.0.1:5', 'GET', "
            "'/v1/videos?api_key=sk-secret', '1.1', 200)\n"
            "job_event('finished', 'video_1', 'key-0123', 'a', e2e_s=1.23456, mux_s=0.1)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stderr.strip().splitlines()]
    access, job = lines
    assert access["logger"] == "uvicorn.access" and "api_key=[redacted]" in access["message"]
    assert "sk-secret" not in run.stderr
    assert (job["event"], job["job"], job["owner"], job["replica"], job["e2e_s"]) == (
        "finished", "video_1", "key-0123", "a", 1.2346)
    assert job["message"] == "job video_1 finished owner=key-0123 replica=a e2e_s=1.2346 mux_s=0.1"
