"""The OpenAI-compatible video server, end to end on one in-process server (uvicorn on a real port,
tiny-latte on 2 workers: tests/support/api_server.py, shared with test_api_requests.py): the official openai
client, batching under concurrency, progress over GET and SSE, a streamed MP4, cancellation, a killed worker,
/v1/score, repeat requests, a job's log lines and metrics."""

import io
import math
import os
import signal
import threading
import time
import warnings

import httpx
import imageio.v3 as iio
import pytest
from api_server import TERMINAL, VALID, collect_events, create, metric, wait, wait_idle

from longserve.server.api.app import create_app, serve_in_thread
from longserve.server.api.metrics import parse_text
from longserve.server.api.service import ServeConfig, VideoService
from tools.bench import serve as bench_serve

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the openai client marks the Sora API deprecated


# -- the official client -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wan_server(tmp_path_factory):
    """tiny-wan (a full-attention Wan 2.1-format model) on 2 workers: the same API, another model family."""
    data_dir = tmp_path_factory.mktemp("serve-wan")
    config = ServeConfig.from_options(warm_up=False,  # the warm-up video: tests/server/test_drain.py
                                      model="tiny-wan", workers=2, device="cpu", data_dir=str(data_dir), max_batch=4,
                                      default_steps=3, decode_chunk_frames=8)
    service = VideoService(config).start()
    app = create_app(service, None, poll_after_ms=50)
    try:
        with serve_in_thread(app) as url:
            yield {"url": url, "service": service, "data_dir": data_dir}
    finally:
        service.close()


# (fixture, model id, frames of 2 s, frames of 1 s at fps 4): tiny-latte makes any count at 8 fps; tiny-wan's
# causal VAE makes 4k+1 frames at 16 fps, so 2 s is 33 frames (the nearest to 32) and 1 s at 4 fps is 5
MODELS = [("server", "tiny-latte", 16, 4), ("wan_server", "tiny-wan", 33, 5)]


@pytest.mark.parametrize("fixture, model, two_seconds, one_second_at_4", MODELS)
def test_openai_client_creates_polls_downloads_lists_and_deletes(request, fixture, model, two_seconds,
                                                                 one_second_at_4):
    from openai import NotFoundError, OpenAI

    server = request.getfixturevalue(fixture)
    client = OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)
    video = client.videos.create_and_poll(prompt="a red ball bouncing", size="64x64", seconds="2",
                                          poll_interval_ms=50)
    assert video.status == "completed", video.error
    assert (video.object, video.progress, video.size) == ("video", 100, "64x64")
    assert video.model == model and video.completed_at >= video.created_at

    mp4 = client.videos.download_content(video.id).read()
    frames = iio.imread(io.BytesIO(mp4), extension=".mp4")
    assert frames.shape == (two_seconds, 64, 64, 3)
    assert frames.std() > 3, "a flat video means the frames were not written"
    png = client.videos.download_content(video.id, variant="thumbnail").read()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert iio.imread(io.BytesIO(png), extension=".png").shape[:2] == (64, 64)

    # multipart extensions through extra_body (the client sends form fields as strings)
    other = client.videos.create(prompt="a blue cube", size="32x32", seconds="1",
                                 extra_body={"num_inference_steps": 2, "fps": 4, "seed": 11, "cache": "first_block"})
    assert other.model_extra["num_inference_steps"] == 2 and other.model_extra["num_frames"] == one_second_at_4

    listed = [v.id for v in client.videos.list(limit=1, order="desc")]   # auto-pagination, one per page
    assert video.id in listed and other.id in listed
    assert listed.index(other.id) < listed.index(video.id), "newest first"

    deleted = client.videos.delete(video.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (video.id, "video.deleted", True)
    with pytest.raises(NotFoundError):
        client.videos.retrieve(video.id)
    assert not list(server["data_dir"].glob(f"videos/{video.id}*")), "its files are removed"
    done = client.videos.poll(other.id, poll_interval_ms=50)
    assert done.status == "completed" and done.model_extra["options"]["cache"]["kind"] == "first_block"
    blocks = done.model_extra["transformer_blocks"]       # 2 steps x (cond, uncond) x the model's blocks
    per_forward = {"tiny-latte": 6, "tiny-wan": 2}[model]         # tiny-latte: 3 spatial + 3 temporal
    assert blocks["evaluated"] + blocks["skipped"] == 4 * per_forward
    assert blocks["evaluated"] >= 2 * per_forward + 2, "the first step runs every block; the second, the heads"


def test_a_model_option_is_served_by_the_family_that_knows_it_and_refused_by_the_others(server, wan_server):
    bad = httpx.post(server["url"] + "/v1/videos", json={"prompt": "x", "guidance_scale_2": 3.0}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guidance_scale_2"
    bad = httpx.post(wan_server["url"] + "/v1/videos", json={"prompt": "x", "num_frames": 8}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "num_frames"
    assert "4k+1" in bad.json()["error"]["message"]


# -- batching under load -------------------------------------------------------------------------------------


def test_concurrent_videos_all_complete_in_shared_batches(server, http):
    body = {"size": "64x64", "num_frames": 16, "num_inference_steps": 6}
    rows = bench_serve.measure(server["url"], [1, 6], 6, body)
    one, six = rows
    for row in rows:
        assert row["completed"] == 6 and row["failed"] == 0, row
        assert len(row["ids"]) == 6, "every request got its own video, none lost"
    assert one["mean_batch"] == pytest.approx(1.0)
    # shared steps, counted, not timed: 6 videos of 6 steps took fewer than a third of 36 denoising steps
    # (the speed-up this buys is a benchmark figure: `longserve bench serve`, docs/benchmarks.md)
    assert six["mean_batch"] > 3, six
    m = parse_text(http.get("/metrics").text)
    assert m['longserve_step_batch_size_bucket{le="1"}'] < m["longserve_step_batch_size_count"], \
        "/metrics shows denoising steps with more than one request"
    for vid in six["ids"][:3]:
        frames = iio.imread(io.BytesIO(http.get(f"/v1/videos/{vid}/content").content), extension=".mp4")
        assert frames.shape == (16, 64, 64, 3)


# -- progress and streaming ------------------------------------------------------------------------------------


def test_progress_rises_step_by_step_over_get_and_over_sse(server, http):
    steps = 60
    v = create(http, size="64x64", num_frames=16, num_inference_steps=steps)
    events: list = []
    sse = threading.Thread(target=collect_events, args=(server["url"], v["id"], events))
    sse.start()
    seen = []
    while True:
        cur = http.get(f"/v1/videos/{v['id']}").json()
        seen.append(cur["progress"])
        if cur["status"] in ("completed", "failed"):
            break
        time.sleep(0.002)
    sse.join(60)
    assert cur["status"] == "completed" and seen[-1] == 100
    assert seen == sorted(seen), "progress never goes back"
    assert len({p for p in seen if 0 < p < 100}) >= 5, f"GET saw too few intermediate values: {sorted(set(seen))}"

    kinds = [e for e, _ in events]
    assert kinds[-1] == "video.completed" and events[-1][1]["progress"] == 100
    step_events = [d for e, d in events if e == "video.progress"]
    first = step_events[0]["step"]
    assert [d["step"] for d in step_events] == list(range(first, steps + 1)), "one event per denoising step"
    assert first <= 10, "the stream was opened right after create: it should see (almost) every step"
    assert all(d["num_steps"] == steps for d in step_events)
    progress = [d["progress"] for _, d in events]
    assert progress == sorted(progress) and step_events[-1]["progress"] == 90
    decoding = [d for e, d in events if e == "video.decoding"]
    assert decoding[-1]["frames_done"] == 16 and kinds.index("video.decoding") > kinds.index("video.progress")


def test_content_stream_sends_the_mp4_while_frames_are_still_being_decoded(server, http, monkeypatch):
    service = server["service"]
    gate, first_chunk = threading.Event(), threading.Event()
    write_frames = service.outputs.write_frames

    def gated(job, out):  # hold the video's writing at its second chunk until the client has bytes
        if job.record.prompt == "stream me" and out.start > 0 and not gate.is_set():
            first_chunk.set()      # the first chunk's frames were handed to the writer before this call
            gate.wait(30)
        write_frames(job, out)

    monkeypatch.setattr(service.outputs, "write_frames", gated)
    v = create(http, prompt="stream me", size="64x64", num_frames=16, num_inference_steps=3)
    received = bytearray()
    try:
        with http.stream("GET", f"/v1/videos/{v['id']}/content", params={"stream": "true"}) as r:
            assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
            chunks = r.iter_bytes()
            received += next(chunks)
            # bytes came while the writer is (or is about to be) held at the second chunk: the video cannot
            # finish until the gate opens below (the first fragment may reach us before chunk 2 is decoded)
            assert first_chunk.wait(30)
            during = http.get(f"/v1/videos/{v['id']}").json()
            assert during["status"] == "in_progress" and during["progress"] < 100
            assert not (server["data_dir"] / "videos" / f"{v['id']}.mp4").exists(), "not finished yet"
            gate.set()
            for chunk in chunks:
                received += chunk
    finally:
        gate.set()
    assert bytes(received[4:8]) == b"ftyp"
    assert b"moof" in received, "a fragmented MP4"
    wait(http, v["id"])
    stored = http.get(f"/v1/videos/{v['id']}/content").content
    assert bytes(received) == stored, "the streamed bytes are the stored video"
    frames = iio.imread(io.BytesIO(bytes(received)), extension=".mp4")
    assert frames.shape == (16, 64, 64, 3)


# -- cancellation ----------------------------------------------------------------------------------------------


def test_deleting_a_running_video_frees_its_slot_at_the_next_step_and_its_batchmate_completes(server, http):
    a = create(http, size="64x64", num_frames=16, num_inference_steps=150, seed=1)
    b = create(http, size="64x64", num_frames=16, num_inference_steps=150, seed=2)
    a_events, b_events = [], []
    threads = [threading.Thread(target=collect_events, args=(server["url"], vid, out))
               for vid, out in ((a["id"], a_events), (b["id"], b_events))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not any(e == "video.progress" and d["batch_size"] == 2 and d["step"] >= 3 for e, d in list(b_events)):
        assert time.monotonic() < deadline, "a and b never shared a step"
        time.sleep(0.005)
    step_at_delete = max(d["step"] for e, d in list(b_events) if e == "video.progress")
    tracked = server["service"].engine.core.scheduler.get(a["id"])          # the engine's own view of a
    r = http.delete(f"/v1/videos/{a['id']}")
    steps_when_deleted = tracked.steps_done
    assert r.status_code == 200 and r.json() == {"id": a["id"], "object": "video.deleted", "deleted": True}
    assert http.get(f"/v1/videos/{a['id']}").status_code == 404
    deadline = time.monotonic() + 10
    while metric(http, "longserve_running_requests") != 1:
        assert time.monotonic() < deadline, "the cancelled video still holds its slot"
        time.sleep(0.01)
    assert http.get(f"/v1/videos/{b['id']}").json()["status"] == "in_progress"
    for t in threads:
        t.join(120)
    assert a_events[-1][0] == "video.deleted"
    assert b_events[-1][0] == "video.completed"
    sizes = [(d["step"], d["batch_size"]) for e, d in b_events if e == "video.progress"]
    after = [s for step, s in sizes if step > step_at_delete]
    assert after == sorted(after, reverse=True) and after[-1] == 1, "b runs alone once a is gone"
    # counted by the scheduler, not timed: a ran at most the rest of the job that was in flight
    assert tracked.state.value == "finished_cancelled"
    assert tracked.steps_done - steps_when_deleted <= server["service"].engine.config.max_steps_per_job
    assert not list(server["data_dir"].glob(f"videos/{a['id']}*"))


def test_a_stalled_video_writer_stalls_neither_the_denoising_nor_the_progress_of_other_videos(server, http):
    """Writing a video's frames (MP4 encoding, thumbnail) happens off the engine's thread, and each job's outputs
    are followed on their own: while one video's writer is stuck, another keeps denoising and its progress
    keeps rising over the API."""
    service = server["service"]
    write_frames = service.outputs.write_frames
    stuck, release = threading.Event(), threading.Event()

    def stuck_writer(job, out):
        if job.record.prompt == "stuck":
            stuck.set()
            release.wait(60)                               # stuck until the checks below are done
        write_frames(job, out)

    service.outputs.write_frames = stuck_writer
    try:
        long = create(http, size="64x64", num_frames=16, num_inference_steps=1000, seed=5)
        create(http, prompt="stuck", size="32x32", num_frames=4, num_inference_steps=2, seed=6)
        assert stuck.wait(60), "the short video's frames never reached the writer"
        tracked = service.engine.core.scheduler.get(long["id"])
        before, progress_before = tracked.steps_done, http.get(f"/v1/videos/{long['id']}").json()["progress"]
        # counted, not timed: while the writer stays stuck, the long video takes steps and its progress rises
        deadline = time.monotonic() + 30
        while (tracked.steps_done - before < 3
               or http.get(f"/v1/videos/{long['id']}").json()["progress"] <= progress_before):
            assert time.monotonic() < deadline, (f"the long video took {tracked.steps_done - before} steps and its "
                                                 f"progress stayed at {progress_before} while the writer was stuck")
            time.sleep(0.01)
        assert not release.is_set() and stuck.is_set()
    finally:
        release.set()
        service.outputs.write_frames = write_frames
    assert http.delete(f"/v1/videos/{long['id']}").status_code == 200


def test_listing_pages_with_after_limit_and_order(server, http):
    ids = [create(http, **VALID)["id"] for _ in range(3)]
    desc = http.get("/v1/videos", params={"limit": 2}).json()
    assert desc["object"] == "list" and [v["id"] for v in desc["data"]] == ids[::-1][:2] and desc["has_more"]
    assert desc["first_id"] == ids[2] and desc["last_id"] == ids[1]
    nxt = http.get("/v1/videos", params={"limit": 1, "after": desc["last_id"]}).json()
    assert [v["id"] for v in nxt["data"]] == [ids[0]]
    asc = http.get("/v1/videos", params={"order": "asc", "after": ids[0], "limit": 100}).json()
    assert [v["id"] for v in asc["data"]] == ids[1:] and not asc["has_more"]
    for vid in ids:
        wait(http, vid)


# -- a worker dies -----------------------------------------------------------------------------------------------


def test_a_worker_killed_mid_batch_fails_that_batch_within_30s_and_health_tells_the_truth(server, http):
    service = server["service"]
    restarts = metric(http, "longserve_worker_restarts")
    # two shapes take turns: the kill lands in one shape's batch; the other shape's video is not in it
    jobs = {size: create(http, size=size, num_frames=16, num_inference_steps=1000, seed=1)["id"]
            for size in ("64x64", "32x32")}
    deadline = time.monotonic() + 60
    while not all(http.get(f"/v1/videos/{j}").json()["progress"] >= 1 for j in jobs.values()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert http.get("/health").status_code == 200
    victim = service.engine.pool.pids[1]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    queued_meanwhile = create(http, **VALID)["id"]
    healths = []
    while True:
        r = http.get("/health")
        healths.append((r.status_code, r.json()["status"]))
        if r.status_code == 200 and any(code == 503 for code, _ in healths):
            break
        assert time.monotonic() - killed_at < 60, healths[-5:]
        time.sleep(0.01)
    assert (503, "restarting") in healths, "while the workers restart, /health says so"
    # the pool is ready again a moment before the scheduler records the failed batch: poll within the 30 s
    while True:
        statuses = {size: http.get(f"/v1/videos/{j}").json() for size, j in jobs.items()}
        failed = [v for v in statuses.values() if v["status"] == "failed"]
        if failed or time.monotonic() - killed_at >= 30:
            break
        time.sleep(0.02)
    assert len(failed) == 1, statuses
    assert failed[0]["error"]["code"] == "worker_crashed"
    assert "SIGKILL" in failed[0]["error"]["message"] and "worker 1" in failed[0]["error"]["message"]
    assert time.monotonic() - killed_at < 30
    survivor = next(v for v in statuses.values() if v["status"] != "failed")
    assert survivor["status"] in ("queued", "in_progress"), "the other shape's video was re-admitted, not lost"
    assert wait(http, queued_meanwhile, timeout=120)["status"] == "completed"
    assert victim not in service.engine.pool.pids
    assert metric(http, "longserve_worker_restarts") == restarts + 1
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["workers_ready"] and health["last_error"]["kind"] == "worker_died"
    assert http.delete(f"/v1/videos/{survivor['id']}").status_code == 200


# -- the rest of the surface ----------------------------------------------------------------------------------------


def test_health_models_and_prometheus_metrics(server, http):
    h = http.get("/health")
    assert h.status_code == 200 and h.json()["workers"] == 2
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert {m["id"] for m in models["data"]} == {"tiny-latte", "tiny-lm"}
    r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    m = parse_text(r.text)
    for name in ("longserve_queue_depth", "longserve_running_requests", "longserve_batch_size",
                 "longserve_step_latency_seconds_count", "longserve_step_batch_size_count",
                 'longserve_jobs{status="queued"}', 'longserve_jobs{status="in_progress"}',
                 'longserve_jobs{status="completed"}', 'longserve_jobs{status="failed"}'):
        assert name in m, name
    assert "# TYPE longserve_step_latency_seconds histogram" in r.text


def test_score_returns_consistent_likelihood_numbers(server, http):
    text = "The quick brown fox jumps over the lazy dog. " * 4
    r = http.post("/v1/score", json={"model": "tiny-lm", "text": text})
    assert r.status_code == 200, r.text
    s = r.json()
    assert s["object"] == "score" and s["model"] == "tiny-lm"
    assert s["num_bytes"] == len(text.encode()) and s["num_tokens"] > 10
    assert s["mean_nll"] == pytest.approx(s["total_nll"] / s["num_tokens"])
    assert s["perplexity"] == pytest.approx(math.exp(s["mean_nll"]))
    assert s["bits_per_byte"] == pytest.approx(s["total_nll"] / (math.log(2) * s["num_bytes"]))
    again = http.post("/v1/score", json={"text": text}).json()
    assert again["total_nll"] == pytest.approx(s["total_nll"], rel=1e-9)
    shorter = http.post("/v1/score", json={"text": text[:40]}).json()
    assert shorter["num_tokens"] < s["num_tokens"] and shorter["total_nll"] != s["total_nll"]


def test_a_video_deleted_while_its_completion_is_recorded_leaves_no_file_and_no_completed_event(server, http):
    service = server["service"]
    update = service.outputs.update
    deleted = []

    async def delete_then_update(job, **fields):
        if fields.get("status") == "completed" and job.record.prompt == "deleted as it completes":
            ready.wait(30)                 # the event stream is open: it must hear the deletion, not a 404
            deleted.append(service.delete(job.record.id))
        await update(job, **fields)

    events, ready = [], threading.Event()
    completed_before = metric(http, 'longserve_jobs_finished_total{outcome="completed"}')
    service.outputs.update = delete_then_update
    try:
        v = create(http, prompt="deleted as it completes", **{k: v for k, v in VALID.items() if k != "prompt"})
        sse = threading.Thread(target=collect_events, args=(server["url"], v["id"], events, ready))
        sse.start()
        deadline = time.monotonic() + 60
        while not deleted:
            assert time.monotonic() < deadline, "the video never reached its completion"
            time.sleep(0.01)
        sse.join(30)
    finally:
        service.outputs.update = update
    assert http.get(f"/v1/videos/{v['id']}").status_code == 404
    deadline = time.monotonic() + 10
    while list(server["data_dir"].glob(f"videos/{v['id']}*")):
        assert time.monotonic() < deadline, "the deleted video's files stayed"
        time.sleep(0.01)
    assert [e for e, _ in events if e in TERMINAL] == ["video.deleted"]
    assert metric(http, 'longserve_jobs_finished_total{outcome="completed"}') == completed_before


# -- repeat requests --------------------------------------------------------------------------------------------


def test_an_identical_seeded_request_gets_a_new_video_with_the_stored_content_and_nothing_is_generated(server, http):
    body = dict(prompt="the same again", size="64x64", num_frames=8, num_inference_steps=2, seed=1234)
    first = wait(http, create(http, **body)["id"])
    assert first["status"] == "completed"
    engine = server["service"].engine
    steps, reused = engine.stats().steps_run, metric(http, "longserve_jobs_reused_total")
    again = create(http, **body)
    assert again["status"] == "completed" and again["progress"] == 100 and again["id"] != first["id"]
    assert engine.stats().steps_run == steps, "nothing was generated"
    assert metric(http, "longserve_jobs_reused_total") == reused + 1
    content = http.get(f"/v1/videos/{first['id']}/content").content
    assert http.get(f"/v1/videos/{again['id']}/content").content == content
    # the copy is a video of its own: deleting the first leaves it whole
    assert http.delete(f"/v1/videos/{first['id']}").json()["deleted"] is True
    assert http.get(f"/v1/videos/{again['id']}/content").content == content
    # not identical, or no explicit seed: generated
    for changed in (dict(body, num_inference_steps=3), dict(body, prompt="the same again!"),
                    {k: v for k, v in body.items() if k != "seed"}):
        assert create(http, **changed)["status"] == "queued", changed
    # a repeat of the repeat still finds the content (the newest completed video with the request's key)
    assert create(http, **body)["status"] == "completed"


def test_a_plain_get_of_the_live_endpoint_says_upgrade_required(http):
    """Issue 36: `GET /v1/videos/live` without a WebSocket upgrade answered 404; it is 426 naming the protocol."""
    r = http.get("/v1/videos/live")
    assert r.status_code == 426, r.text
    assert r.headers["upgrade"] == "websocket" and r.json()["error"]["code"] == "upgrade_required"
    assert "WebSocket" in r.json()["error"]["message"]


def test_a_job_s_life_is_one_log_line_per_transition_and_the_latency_histograms_move(server, http, caplog):
    """Issue 46: /metrics is prometheus_client's, with queue wait, time to first frame, end to end and per-stage
    histograms and the cluster's work; the log has one structured line per transition (JSON with --log-format
    json); a remix on a text-only model is refused naming `model`."""
    import json
    import logging

    from longserve.server.api.logs import JsonFormatter

    names = ["longserve_queue_wait_seconds_count", "longserve_time_to_first_frame_seconds_count",
             "longserve_e2e_latency_seconds_count"] + [
        f'longserve_stage_seconds_count{{model="tiny-latte",stage="{s}"}}' for s in ("encode", "denoise", "decode",
                                                                                     "mux")]
    label = '{model="tiny-latte"}'
    wait_idle(server)                           # the videos of the tests before it move the same histograms
    before = parse_text(http.get("/metrics").text)
    caplog.set_level(logging.INFO, logger="longserve.jobs")
    v = wait(http, create(http, num_frames=4, num_inference_steps=4, size="32x32")["id"])
    assert v["status"] == "completed", v
    text = http.get("/metrics").text
    after = parse_text(text)
    for name in names:
        key = name if "{" in name else name.replace("_count", "_count" + label)
        assert after[key] == before.get(key, 0) + 1, key
    assert "# TYPE longserve_e2e_latency_seconds histogram" in text and "_seconds_created" not in text
    assert 'longserve_cluster_work{status="queued"}' in after
    assert 'longserve_cluster_jobs{status="in_progress"}' in after
    records = [r for r in caplog.records if r.name == "longserve.jobs" and getattr(r, "job", None) == v["id"]]
    events = [r.event for r in records]
    assert events[0] == "created" and events[1] == "started" and events[-1] == "finished", events
    assert "progress" in events and set(events) <= {"created", "started", "progress", "finished"}, events
    done = records[-1]
    assert done.e2e_s >= done.queue_wait_s >= 0 and done.denoise_s > 0 and done.mux_s >= 0 and done.encode_s >= 0
    line = json.loads(JsonFormatter().format(done))
    assert (line["event"], line["job"], line["owner"], line["replica"]) == ("finished", v["id"], None, None)
    assert line["message"].startswith(f"job {v['id']} finished owner=- replica=- ") and "e2e_s" in line
    r = http.post(f"/v1/videos/{v['id']}/remix", json={"prompt": "a blue ball"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


