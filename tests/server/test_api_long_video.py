"""Long video over HTTP (tiny-skyreels-df on 2 workers): a streamed MP4 that starts after the first segment
while later segments still denoise, progress over every segment's steps, cancellation mid-video, the
DF arguments as request extensions (refused naming the field), and the --max-seconds limit."""

import threading
import time

import httpx
import imageio.v3 as iio
import pytest

from longserve.server.api.app import create_app, serve_in_thread
from longserve.server.api.service import ServeConfig, VideoService

STEPS = 30                      # per segment: long enough that segments take visibly long
# 37 frames at 64x64 = 10 latent frames in 4 segments (the checkpoint's base 17 / overlap 9 frames); no guidance
# (the checkpoint's 2.0 doubles each step's rows, and these tests are about segments, not guidance)
LONG = {"prompt": "a red ball bouncing", "size": "64x64", "num_frames": 37, "num_inference_steps": STEPS, "seed": 1,
        "guidance_scale": 1.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("serve-long")
    config = ServeConfig.from_options(warm_up=False,  # the warm-up video: tests/server/test_drain.py
                                      model="tiny-skyreels-df", workers=2, device="cpu", data_dir=str(data_dir),
                                      max_batch=4, default_steps=4, decode_chunk_frames=8, max_seconds=10,
                                      rate_per_key=None)       # (the tests poll every 10 ms)
    service = VideoService(config).start()
    app = create_app(service, None, poll_after_ms=50)
    try:
        with serve_in_thread(app) as url:
            yield {"url": url, "service": service}
    finally:
        service.close()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server["url"], timeout=120) as c:
        yield c


def test_streamed_download_starts_after_the_first_segment_while_later_segments_denoise(server, http):
    v = http.post("/v1/videos", json=LONG).json()
    assert v["status"] == "queued" and v["options"]["overlap_history"] == 9
    streamed, first_bytes_progress = bytearray(), []

    def read_stream():
        with httpx.Client(base_url=server["url"], timeout=120) as c:
            with c.stream("GET", f"/v1/videos/{v['id']}/content", params={"stream": "true"}) as r:
                assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
                for chunk in r.iter_bytes():
                    if not streamed:
                        first_bytes_progress.append(c.get(f"/v1/videos/{v['id']}").json()["progress"])
                    streamed.extend(chunk)

    reader = threading.Thread(target=read_stream)
    reader.start()
    seen = []
    while True:
        cur = http.get(f"/v1/videos/{v['id']}").json()
        seen.append(cur["progress"])
        if cur["status"] in ("completed", "failed"):
            break
        time.sleep(0.01)
    reader.join(60)
    assert cur["status"] == "completed", cur
    assert seen == sorted(seen), "progress never goes back"
    # 4 segments of STEPS steps: the last one starts after 3/4 of the steps, at progress 90 * 3/4 = 67
    last_segment_start = 90 * 3 // 4
    assert first_bytes_progress and first_bytes_progress[0] < last_segment_start, first_bytes_progress
    assert len({p for p in seen if 0 < p < last_segment_start}) >= 5, "progress rises over the early segments"
    stored = http.get(f"/v1/videos/{v['id']}/content").content
    assert bytes(streamed) == stored, "the stored file is the streamed bytes"
    assert iio.imread(stored, extension=".mp4").shape == (37, 64, 64, 3)


def test_delete_cancels_a_long_video_in_a_later_segment(server, http):
    service = server["service"]
    v = http.post("/v1/videos", json=dict(LONG, seed=2)).json()
    deadline = time.monotonic() + 120
    while True:                                   # wait until the second segment is denoising
        job = service.jobs.get(v["id"])
        if job is not None and job.handle.status().step > STEPS + 2:
            break
        assert time.monotonic() < deadline, "the job never reached its second segment"
        time.sleep(0.01)
    tracked = service.engine.core.scheduler.get(v["id"])
    assert http.delete(f"/v1/videos/{v['id']}").json()["deleted"] is True
    steps_when_deleted = tracked.steps_done
    assert http.get(f"/v1/videos/{v['id']}").status_code == 404
    deadline = time.monotonic() + 30
    while service.engine.stats().running:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert tracked.state.value == "finished_cancelled"
    assert tracked.steps_done - steps_when_deleted <= service.engine.config.max_steps_per_job, \
        "cancelled at the next step boundary after the job in flight"


@pytest.mark.parametrize("extra, param", [
    ({"overlap_history": 17}, "overlap_history"),              # not shorter than base_num_frames (17)
    ({"ar_step": -1}, "ar_step"),
    ({"base_num_frames": 0}, "base_num_frames"),
    ({"causal_block_size": 2}, "causal_block_size"),           # the segments hold 5 and 4 latent frames
    ({"addnoise_condition": -1}, "addnoise_condition"),
    ({"seconds": "11"}, "seconds"),                            # past --max-seconds 10
    ({"frames_per_blok": 2}, "frames_per_blok"),               # a typo is refused, named
])
def test_bad_diffusion_forcing_arguments_are_4xx_naming_the_field(http, extra, param):
    body = {k: v for k, v in LONG.items() if k != "num_frames"} if "seconds" in extra else dict(LONG)
    r = http.post("/v1/videos", json={**body, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_seconds_up_to_the_limit_become_a_frame_count_the_model_makes(http):
    v = http.post("/v1/videos", json={"prompt": "waves", "size": "64x64", "seconds": "10",
                                      "num_inference_steps": 1}).json()
    assert v["num_frames"] == 80 and v["fps"] == 8, "10 s at the checkpoint's 8 fps (its VAE takes any frame count)"
    assert http.delete(f"/v1/videos/{v['id']}").status_code == 200


def test_a_prompt_timeline_streams_segment_by_segment_and_a_bad_one_is_400_naming_the_entry(server, http):
    """The timeline of tests/pipelines/test_prompt_timeline.py (whose content test draws each prompt's colour) as a
    create's JSON extension: its first bytes stream before the last segment denoises, and the stored options keep
    the timeline; an entry without seconds before the last is refused naming it."""
    timeline = [{"prompt": "a red ball bouncing", "seconds": 3}, {"prompt": "a blue ball bouncing"}]
    v = http.post("/v1/videos", json=dict(LONG, prompts=timeline)).json()
    assert v["options"]["prompts"] == [dict(timeline[0], seconds=3.0), dict(timeline[1], seconds=None)], v
    first_bytes_progress, size = [], 0
    with http.stream("GET", f"/v1/videos/{v['id']}/content", params={"stream": "true"}) as r:
        for chunk in r.iter_bytes():
            if not size:
                first_bytes_progress.append(http.get(f"/v1/videos/{v['id']}").json()["progress"])
            size += len(chunk)
    deadline = time.monotonic() + 30  # the stream ends with the file's last byte; the record is written after it
    while (done := http.get(f"/v1/videos/{v['id']}").json())["status"] == "in_progress" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done["status"] == "completed" and first_bytes_progress[0] < 90 * 3 // 4, (done, first_bytes_progress)
    assert iio.imread(http.get(f"/v1/videos/{v['id']}/content").content, extension=".mp4").shape == (37, 64, 64, 3)
    r = http.post("/v1/videos", json=dict(LONG, prompts=[{"prompt": "a"}, {"prompt": "b"}]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompts[0].seconds", r.text
