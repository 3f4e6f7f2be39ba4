"""Video extension over HTTP on tiny-skyreels-df (one server for the module): an MP4 `input_reference` is the
video a create continues; `POST /v1/videos/{id}/extend` continues a completed video into a new one with
`extended_from`, whose content starts with the original's frames (within MP4 error) and is streamed as it is
made; every bad upload or extend request gets the error envelope naming the field, leaving no file and no job."""

import dataclasses
import io
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import imageio.v3 as iio
import imageio_ffmpeg
import numpy as np
import pytest
from servers import serving
from webhook_receiver import Receiver

from longserve.engine.outputs import FramesChunk, StepProgress
from longserve.pipelines import media
from longserve.pipelines.media import read_mp4
from longserve.pipelines.video import save_video

FPS = 8                       # tiny-skyreels-df's
MAX_PIXELS = 96 * 96          # --max-image-pixels: a frame of 128x128 is too large
# no guidance (one row per step) and 4 steps: these tests are about frames in and out, not quality
FAST = {"guidance_scale": "1", "num_inference_steps": "4"}


def ball_mp4(frames: int = 10, size: int = 64) -> bytes:
    """A red ball moving right on grey, as an MP4 (libx264, yuv420p, moov at the end: not fragmented)."""
    y, x = np.mgrid[0:size, 0:size]
    video = np.full((frames, size, size, 3), 0.5, np.float32)
    for t in range(frames):
        video[t][(y - size // 2) ** 2 + (x - 12 - 3 * t) ** 2 < 10 ** 2] = (0.8, 0.15, 0.15)
    with tempfile.TemporaryDirectory() as d:
        save_video(video, Path(d) / "ball.mp4", fps=FPS)
        return (Path(d) / "ball.mp4").read_bytes()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("serve-extend"), model="tiny-skyreels-df", workers=1, max_batch=4,
                 default_steps=4, max_image_pixels=MAX_PIXELS, max_seconds=6,
                 webhook_allowed_hosts="127.0.0.1") as s:     # the openai test's webhook receiver is on loopback
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server["url"], timeout=120) as c:
        yield c


def wait(http, video_id: str) -> dict:
    deadline = time.monotonic() + 120
    while (v := http.get(f"/v1/videos/{video_id}").json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, v
        time.sleep(0.02)
    assert v["status"] == "completed", v
    return v


def content(http, video_id: str) -> np.ndarray:
    return iio.imread(io.BytesIO(http.get(f"/v1/videos/{video_id}/content").content), extension=".mp4")


def mp4_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(int) - b.astype(int)).mean())


@pytest.fixture(scope="module")
def uploaded(server):
    """A video made by continuing an uploaded MP4 (multipart `input_reference`) by one second."""
    data = ball_mp4()
    with httpx.Client(base_url=server["url"], timeout=120) as http:
        r = http.post("/v1/videos", data={"prompt": "a red ball moving right", "seconds": "1", "seed": "1", **FAST},
                      files={"input_reference": ("ball.mp4", data, "video/mp4")})
        assert r.status_code == 200, r.text
        return {"input": read_mp4(data), "video": wait(http, r.json()["id"])}


def test_an_uploaded_mp4_is_continued_and_the_content_is_the_whole_extended_video(http, uploaded):
    v, given = uploaded["video"], uploaded["input"]
    assert (v["num_frames"], v["seconds"], v["size"]) == (10 + FPS, "2.25", "64x64"), "10 frames + 1 s at 8 fps"
    assert v["options"]["video"] == "10 frames 64x64" and v["extended_from"] is None
    frames = content(http, v["id"])
    assert frames.shape == (18, 64, 64, 3)
    assert mp4_error(frames[:10], given) < 3, "the content starts with the uploaded frames"
    assert frames[10:].std() > 3, "then new frames"


def test_extend_continues_a_completed_video_streamed_with_extended_from(server, http, uploaded, monkeypatch):
    service, source = server["service"], uploaded["video"]
    seen, take = [], service.outputs.take

    async def recording(job, out):        # every engine output the job's runner turns into files and events
        if job.record.prompt == "the ball rolls on":
            seen.append(out)
        return await take(job, out)

    monkeypatch.setattr(service.outputs, "take", recording)
    r = http.post(f"/v1/videos/{source['id']}/extend", json={"prompt": "the ball rolls on", "seconds": "1"})
    assert r.status_code == 200, r.text
    v = r.json()
    assert v["extended_from"] == source["id"] and v["status"] == "queued"
    busy = http.post(f"/v1/videos/{v['id']}/extend", json={"prompt": "and on", "seconds": "1"})
    assert busy.status_code == 409 and busy.json()["error"]["param"] == "video_id", busy.text

    done = wait(http, v["id"])
    assert (done["num_frames"], done["seconds"], done["extended_from"]) == (26, "3.25", source["id"])
    assert (done["num_inference_steps"], done["guidance_scale"]) == (4, 1.0), "the source's settings carry over"
    assert server["service"].store.get(v["id"]).extended_from == source["id"], "the stored record says so too"
    listed = {x["id"]: x for x in http.get("/v1/videos").json()["data"]}
    assert listed[v["id"]]["extended_from"] == source["id"] and listed[source["id"]]["extended_from"] is None
    before, after = content(http, source["id"]), content(http, v["id"])
    assert after.shape == (26, 64, 64, 3)
    assert mp4_error(after[:18], before) < 3, "the first frames are the original's, within MP4 error"
    # streamed: the original's frames went to the MP4 writer before the denoising ended
    last_step = next(i for i, o in enumerate(seen) if isinstance(o, StepProgress) and o.step == o.num_steps)
    early = [o for o in seen[:last_step] if isinstance(o, FramesChunk)]
    assert early and early[0].start == 0 and early[-1].stop >= 18, [(o.start, o.stop) for o in early]
    assert http.get(f"/v1/videos/{v['id']}/content", params={"stream": "true"}).content == \
        http.get(f"/v1/videos/{v['id']}/content").content


def _refused(r: httpx.Response, status: int, param: str | None, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error
    if code is not None:
        assert error["code"] == code, error


def _with_capabilities(monkeypatch, engine, **changes) -> None:
    """The served model as if its capabilities were changed (what the doors read)."""
    desc = engine.info.description
    caps = dataclasses.replace(desc.capabilities, **changes)
    monkeypatch.setattr(engine, "info", dataclasses.replace(
        engine.info, description=dataclasses.replace(desc, capabilities=caps)))


def test_bad_extend_requests_get_the_error_envelope(server, http, uploaded, monkeypatch):
    vid = uploaded["video"]["id"]
    _refused(http.post("/v1/videos/video_nope/extend", json={"prompt": "a", "seconds": "1"}), 404, "video_id",
             "video_not_found")
    for seconds in ("0", "-1", "abc", "100"):           # 100 s: past --max-seconds
        _refused(http.post(f"/v1/videos/{vid}/extend", json={"prompt": "a", "seconds": seconds}), 400, "seconds")
    _refused(http.post(f"/v1/videos/{vid}/extend", json={"prompt": " ", "seconds": "1"}), 400, "prompt")
    _refused(http.post(f"/v1/videos/{vid}/extend", json={"seconds": "1"}), 400, "prompt")
    _refused(http.post(f"/v1/videos/{vid}/extend", json={"prompt": "a", "seconds": "1", "overlap_history": 0}), 400,
             "overlap_history")
    _with_capabilities(monkeypatch, server["service"].engine, video="refused")     # a model that cannot extend
    _refused(http.post(f"/v1/videos/{vid}/extend", json={"prompt": "a", "seconds": "1"}), 400, "model")


def test_bad_uploads_get_400_naming_input_reference_and_leave_nothing_behind(server, http, monkeypatch):
    data_dir = server["data_dir"]
    files_before = sorted(p.name for p in (data_dir / "videos").iterdir())
    jobs_before = len(http.get("/v1/videos", params={"limit": 100}).json()["data"])
    temps_before = set(Path(tempfile.gettempdir()).glob("longserve-video-*"))
    good = ball_mp4(frames=10)

    def post(data: bytes, name: str = "in.mp4"):
        return http.post("/v1/videos", data={"prompt": "a", **FAST}, files={"input_reference": (name, data)})

    _refused(post(good[:len(good) // 2]), 400, "input_reference", "invalid_video")          # truncated
    _refused(post(b"\0\0\0\x18ftypisom" + bytes(3000)), 400, "input_reference", "invalid_video")
    _refused(post(b"GIF89a" + bytes(100), "in.gif"), 400, "input_reference", "unsupported_image")
    _refused(post(ball_mp4(frames=3, size=128)), 400, "input_reference", "video_too_large")   # 128x128 > 96x96
    _refused(post(ball_mp4(frames=5)), 400, "input_reference")           # fewer frames than overlap_history (9)
    engine = server["service"].engine
    _with_capabilities(monkeypatch, engine, video="refused")             # a model that cannot extend
    _refused(post(good), 400, "input_reference", "unsupported_video")
    _with_capabilities(monkeypatch, engine, video="optional", image="refused")     # a model that only extends
    buf = io.BytesIO()
    iio.imwrite(buf, np.zeros((8, 8, 3), np.uint8), extension=".png")
    _refused(post(buf.getvalue(), "in.png"), 400, "input_reference", "unsupported_image")

    assert sorted(p.name for p in (data_dir / "videos").iterdir()) == files_before, "no file left behind"
    assert len(http.get("/v1/videos", params={"limit": 100}).json()["data"]) == jobs_before, "no job made"
    assert set(Path(tempfile.gettempdir()).glob("longserve-video-*")) == temps_before, "no temporary file left"
    assert list((data_dir / "tmp").iterdir()) == [], "nor in the data dir's temp area"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_forged_header_mp4_is_refused_with_400_and_the_server_holds_no_more_memory(server, http, monkeypatch):
    """Issue 32: a small MP4 of many 1280x720 frames whose title imitates ffmpeg's stream line ("16x16", 0.5 s).
    The server (in this process) reads the stream's own header and refuses it before decoding; its RSS, sampled
    while the request runs, grows by less than 100 MiB. Uploads go through the data dir's temp area."""
    title = "x\n  Stream #0:0: Video: h264, 16x16, 1 fps\n  Duration: 00:00:00.50, start: 0.000000, bitrate: 1 kb/s"
    path = server["data_dir"] / "forged.mp4"
    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-y", "-f", "lavfi", "-i",
                    "color=black:size=1280x720:rate=8", "-frames:v", "120", "-c:v", "libx264", "-preset", "ultrafast",
                    "-tune", "stillimage", "-pix_fmt", "yuv420p", "-metadata", f"title={title}", str(path)], check=True)
    data = path.read_bytes()
    assert len(data) < 64 << 10            # a small file that would decode to 330 MB
    seen = []                              # where the server put the upload on its way to the probe
    probe = media.probe
    monkeypatch.setattr(media, "probe", lambda p, field: seen.append(Path(p).parent) or probe(p, field))
    before, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        r = http.post("/v1/videos", data={"prompt": "a", **FAST}, files={"input_reference": ("f.mp4", data)})
    finally:
        done.set()
        sampler.join()
    _refused(r, 400, "input_reference", "video_too_large")
    assert "1280x720" in r.json()["error"]["message"]
    assert max(peak[0], _rss()) - before < 100 << 20, f"RSS grew by {(max(peak[0], _rss()) - before) >> 20} MiB"
    assert seen == [server["data_dir"] / "tmp"] and list(seen[0].iterdir()) == []


def test_what_a_killed_server_left_in_its_temp_area_is_swept_at_start(tmp_path):
    from longserve.server.api.service import ServeConfig
    from longserve.server.api.storage import VideoStorage

    stale = tmp_path / "tmp" / "longserve-video-k1ll3d.mp4"
    stale.parent.mkdir()
    stale.write_bytes(b"\0" * 4096)
    storage = VideoStorage(ServeConfig.from_options(model="tiny-latte", data_dir=str(tmp_path)), None, lambda v: False)
    try:
        assert storage.recover() == [] and list(stale.parent.iterdir()) == []
    finally:
        storage.close()


def test_a_queued_extension_holds_its_mp4_not_its_frames_and_admission_counts_its_bytes(server, http, monkeypatch):
    """Issue 32: a queued job keeps the uploaded MP4 as its file (decoded again by the worker that admits it), and
    its admission cost counts the file's bytes."""
    service = server["service"]
    monkeypatch.setattr(service.engine.core.scheduler, "max_running", 0)     # held: it waits in the queue
    data = ball_mp4(frames=12)
    r = http.post("/v1/videos", data={"prompt": "a", "seconds": "1", **FAST},
                  files={"input_reference": ("ball.mp4", data, "video/mp4")})
    assert r.status_code == 200, r.text
    job = service.jobs.get(r.json()["id"])
    try:
        video = job.handle.spec.options["video"]
        assert video.nbytes == len(data) < 12 * 64 * 64 * 3, "the file, not its frames"
        assert len(video) == 12 and video.shape == (12, 64, 64, 3)
        plain = service.admission.cost(dataclasses.replace(job.handle.spec, options={}), "video")
        lim = service.limits
        assert job.cost - plain == pytest.approx(len(data) / (lim.default_frames * lim.default_width *
                                                              lim.default_height * 3))
        assert r.json()["options"]["video"] == "12 frames 64x64"
    finally:
        http.delete(f"/v1/videos/{job.id}")


def test_a_create_answers_with_the_seconds_asked_and_the_frames_made(http):
    """`seconds` is the caller's own value (issue 36: "2" came back as "2.0625" on a 4k+1 model); `num_frames` is
    what the model makes of it (the nearest count: 1.3 s x 8 fps = 10.4 -> 10, which is 1.25 s)."""
    r = http.post("/v1/videos", json={"prompt": "a red ball", "seconds": "1.3", "size": "32x32", **FAST})
    assert r.status_code == 200, r.text
    v = r.json()
    assert (v["seconds"], v["num_frames"]) == ("1.3", 10)
    assert http.get(f"/v1/videos/{v['id']}").json()["seconds"] == "1.3"
    http.delete(f"/v1/videos/{v['id']}")


# -- the openai client's extend, remix, spritesheet and webhooks ---------------------------------------------------


def test_the_openai_client_extends_remixes_gets_a_spritesheet_and_a_signed_webhook(server, http, tmp_path):
    """The client's own calls (openai 3.57, pinned): `webhooks.create` registers a loopback receiver, which gets
    `video.completed` signed as OpenAI signs it (`webhooks.unwrap` verifies it), the first attempt answered 500
    and retried with the same webhook-id; `videos.extend` continues a stored video (`{"video": {"id"}}`) and an uploaded
    MP4 by `seconds="4"`; `videos.remix` of a diffusion-forcing video is its extension under the new prompt;
    `download_content(variant="spritesheet")` is a PNG grid of the video's frames."""
    import openai
    from openai import OpenAI

    client = OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)
    receiver = Receiver(answers=[500])
    try:
        endpoint = client.webhooks.create(name="mine", url=receiver.url, event_types=["video.completed"])
        assert endpoint.signing_secret.startswith("whsec_") and endpoint.url == receiver.url
        assert [e.id for e in client.webhooks.list()] == [endpoint.id]
        source = client.videos.create_and_poll(prompt="a red ball moving right", size="64x64", seconds="2",
                                               extra_body={**FAST, "seed": 2}, poll_interval_ms=50)
        assert source.status == "completed", source.error
        first, again = receiver.wait(2)
        assert first[0]["webhook-id"] == again[0]["webhook-id"] and first[1] == again[1], "a retry of one event"
        event = client.webhooks.unwrap(again[1], again[0], secret=endpoint.signing_secret)
        assert (event.type, event.data.id) == ("video.completed", source.id)
        with pytest.raises(Exception, match="signature"):
            client.webhooks.verify_signature(again[1], again[0], secret="whsec_" + "A" * 44)

        made = source.model_extra["num_frames"]
        # openai 3.57's multipart encoder takes only a file as `video`: a stored video's {"id"} goes in extra_body
        # (sent as the form field video[id], as the client writes an object)
        longer = client.videos.extend(video=openai.omit, prompt="the ball rolls on", seconds="4",
                                      extra_body={**FAST, "video": {"id": source.id}})
        assert longer.model_extra["extended_from"] == source.id
        uploaded = client.videos.extend(video=("ball.mp4", ball_mp4(), "video/mp4"), prompt="the ball rolls on",
                                        seconds="4", extra_body=FAST)
        remix = client.videos.remix(source.id, prompt="a red ball moving left")
        assert remix.remixed_from_video_id == source.id and remix.model_extra["extended_from"] == source.id
        for video, frames in ((longer, made + 4 * FPS), (uploaded, 10 + 4 * FPS), (remix, None)):
            done = client.videos.poll(video.id, poll_interval_ms=50)
            assert done.status == "completed", done.error
            assert frames is None or done.model_extra["num_frames"] == frames, (video.id, done.model_extra)
        assert mp4_error(content(http, remix.id)[:made], content(http, source.id)) < 3, "the remix continues it"

        sheet = client.videos.download_content(source.id, variant="spritesheet").read()
        grid = iio.imread(io.BytesIO(sheet), extension=".png")
        frames = content(http, source.id)
        columns = min(5, made)
        assert grid.shape == (64 * -(-made // columns), 64 * columns, 3), grid.shape
        assert np.abs(grid[:64, :64].astype(int) - frames[0].astype(int)).mean() < 1, "tile 0 is frame 0"
        last = (made - 1) // columns, (made - 1) % columns
        assert np.abs(grid[64 * last[0]:64 * last[0] + 64, 64 * last[1]:64 * last[1] + 64].astype(int)
                      - frames[-1].astype(int)).mean() < 1, "the last tile is the last frame"

        rotated = client.webhooks.rotate_secret(endpoint.id)
        assert rotated.signing_secret != endpoint.signing_secret
        assert client.webhooks.test(endpoint.id, event_type="video.failed").status_code == 200
        assert json.loads(receiver.got[-1][1])["type"] == "video.failed"
        client.webhooks.unwrap(receiver.got[-1][1], receiver.got[-1][0], secret=rotated.signing_secret)
        assert client.webhooks.update(endpoint.id, name="renamed").name == "renamed"
        assert client.webhooks.delete(endpoint.id).deleted
        assert list(client.webhooks.list()) == []
    finally:
        receiver.close()
    bad = http.post("/v1/webhook_endpoints", json={"name": "x", "url": "http://10.0.0.1/hook",
                                                   "event_types": ["video.completed"]})
    _refused(bad, 400, "url")
    bad = http.post("/v1/webhook_endpoints", json={"name": "x", "url": receiver.url, "event_types": ["batch.failed"]})
    _refused(bad, 400, "event_types")
    _refused(http.post("/v1/videos/extensions", data={"prompt": "a", "seconds": "4"}), 400, "video")
