"""Image-to-video at the front doors, on tiny-wan-i2v: the official openai client's
`videos.create(input_reference=open("cat.png", "rb"))` against an in-process server; every malformed upload
answered in the error envelope naming `input_reference`, leaving no file and no job behind; `longserve
generate --image`."""

import dataclasses
import io
import os
import struct
import time
import warnings
import zlib

import httpx
import imageio.v3 as iio
import numpy as np
import PIL.Image
import pytest
from servers import serving

from longserve.server.cli import main

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the openai client marks the Sora API deprecated

MAX_PIXELS = 256 * 256
MAX_BODY = 64 << 10


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // width, y * 255 // height, np.full_like(x, rng.integers(0, 255))], -1)
    buf = io.BytesIO()
    PIL.Image.fromarray(pixels.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def with_png_size(png: bytes, width: int, height: int) -> bytes:
    """The same PNG whose header claims another size (its CRC recomputed): a decompression bomb's header."""
    ihdr = png[12:29]                                   # b"IHDR" + 13 bytes of data
    data = struct.pack(">II", width, height) + ihdr[12:]
    chunk = b"IHDR" + data
    return png[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + png[33:]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("serve-i2v"), model="tiny-wan-i2v", workers=1, max_batch=4,
                 default_steps=2, max_image_pixels=MAX_PIXELS) as s:
        s["app"].state.max_body_bytes = MAX_BODY         # what `longserve serve --max-body-bytes` gives create_app
        yield s


def test_openai_client_makes_a_video_from_an_uploaded_image(server, tmp_path):
    from openai import OpenAI

    cat = tmp_path / "cat.png"
    cat.write_bytes(png_bytes(70, 52))
    client = OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)
    with open(cat, "rb") as f:
        video = client.videos.create(prompt="the cat walks away", input_reference=f, size="64x48", seconds="1",
                                     extra_body={"fps": 4, "seed": 3})
    done = client.videos.poll(video.id, poll_interval_ms=50)
    assert done.status == "completed", done.error
    assert done.model_extra["num_frames"] == 5 and done.size == "64x48"
    assert done.model_extra["options"]["image"] == "70x52", "the record keeps the image's size, not its pixels"
    frames = iio.imread(io.BytesIO(client.videos.download_content(video.id).read()), extension=".mp4")
    assert frames.shape == (5, 48, 64, 3) and frames.std() > 3


def test_a_base64_data_url_in_json_is_an_input_reference_too(server):
    import base64

    url = "data:image/png;base64," + base64.b64encode(png_bytes(32, 32)).decode()
    r = httpx.post(server["url"] + "/v1/videos", json={"prompt": "a", "size": "32x32", "num_frames": 1,
                                                       "num_inference_steps": 1, "input_reference": {"image_url": url}},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["options"]["image"] == "32x32"
    vid, deadline = r.json()["id"], time.monotonic() + 60
    while (status := httpx.get(server["url"] + f"/v1/videos/{vid}").json()["status"]) not in ("completed", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert status == "completed"


def _gif() -> bytes:
    buf = io.BytesIO()
    PIL.Image.new("RGB", (8, 8), (255, 0, 0)).save(buf, format="GIF")
    return buf.getvalue()


PNG = png_bytes(48, 40)
MALFORMED = [
    ("empty", b"", 400, "invalid_image"),
    ("not an image", b"hello, this is text", 400, "unsupported_image"),
    ("truncated png", PNG[: len(PNG) // 2], 400, "invalid_image"),
    ("gif", _gif(), 400, "unsupported_image"),
    ("bomb past the server's limit", with_png_size(PNG, 4096, 4096), 400, "image_too_large"),
    ("bomb past pillow's own limit", with_png_size(PNG, 100_000, 100_000), 400, "image_too_large"),
    ("over the body limit", b"\x89PNG\r\n\x1a\n" + bytes(MAX_BODY), 413, "file_too_large"),
]


@pytest.mark.parametrize("name, data, status, code", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_upload_is_refused_naming_input_reference_and_leaves_nothing(server, name, data, status, code):
    before = set(server["data_dir"].rglob("*"))
    jobs = len(httpx.get(server["url"] + "/v1/videos", params={"limit": 100}).json()["data"])
    r = httpx.post(server["url"] + "/v1/videos", data={"prompt": "a cat", "size": "32x32"},
                   files={"input_reference": ("cat.png", data, "image/png")}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == "input_reference" and error["code"] == code, error
    assert set(server["data_dir"].rglob("*")) == before, "no file is left behind"
    assert len(httpx.get(server["url"] + "/v1/videos", params={"limit": 100}).json()["data"]) == jobs
    stats = server["service"].engine.stats()
    assert (stats.waiting, stats.running, stats.loop_alive) == (0, 0, True), "no job is stuck"


@pytest.mark.parametrize("body, field", [
    ({"data": {"prompt": "a cat"}}, "input_reference"),                                     # missing
    ({"data": {"prompt": "a cat", "input_reference": "cat.png"}}, "input_reference"),       # text, not a file
    ({"json": {"prompt": "a", "input_reference": {"image_url": "https://x/cat.png"}}}, "input_reference"),
    ({"json": {"prompt": "a", "input_reference": {"image_url": "data:image/png;base64,@@"}}}, "input_reference"),
    ({"data": {"prompt": "a"}, "files": {"input_reference": ("a.png", PNG, "image/png"),
                                         "last_image": ("b.png", PNG, "image/png")}}, "last_image"),  # one-image model
])
def test_other_bad_references_are_refused_naming_the_field(server, body, field):
    r = httpx.post(server["url"] + "/v1/videos", timeout=60, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_generate_with_an_image_writes_the_video(tmp_path, capfd):
    image = tmp_path / "cat.png"
    image.write_bytes(png_bytes(50, 30))
    out = tmp_path / "cat.mp4"
    assert main(["generate", "the cat walks away", "--model", "tiny-wan-i2v", "--workers", "1", "--device", "cpu",
                 "--image", str(image), "--frames", "5", "--size", "48x32", "--steps", "2", "--seed", "0",
                 "-o", str(out)]) == 0
    assert iio.imread(out, extension=".mp4").shape == (5, 32, 48, 3)
    assert main(["generate", "x", "--model", "tiny-wan-i2v", "--image", str(tmp_path / "none.png"),
                 "-o", str(tmp_path / "x.mp4")]) == 2
    assert "--image" in capfd.readouterr().err


def test_wan22_ti2v_serves_videos_with_and_without_an_input_reference_and_generates_from_the_cli(tmp_path):
    """Wan 2.2 TI2V takes an image or none: the openai client's `input_reference` upload, a create without one
    (text-to-video on the same checkpoint), a refused last_image; `longserve generate --image` by name."""
    from openai import OpenAI

    cat = tmp_path / "cat.png"
    cat.write_bytes(png_bytes(70, 52))
    with serving(tmp_path / "data", model="tiny-wan22-ti2v", workers=1, default_steps=2) as s:
        client = OpenAI(base_url=s["url"] + "/v1", api_key="unused", max_retries=0)
        with open(cat, "rb") as f:
            with_image = client.videos.create(prompt="the cat walks away", input_reference=f, size="64x32",
                                              seconds="1", extra_body={"fps": 4, "seed": 3})
        without = client.videos.create(prompt="the cat walks away", size="64x32", seconds="1",
                                       extra_body={"fps": 4, "seed": 3})
        videos = []
        for video in (with_image, without):
            done = client.videos.poll(video.id, poll_interval_ms=50)
            assert done.status == "completed", done.error
            videos.append(iio.imread(io.BytesIO(client.videos.download_content(video.id).read()), extension=".mp4"))
        assert done.model_extra["options"] == {} and with_image.model_extra["options"]["image"] == "70x52"
        assert videos[0].shape == videos[1].shape == (5, 32, 64, 3)
        assert np.abs(videos[0].astype(int) - videos[1]).max() > 10, "the image conditions the video"
        files = {"input_reference": ("a.png", PNG, "image/png"), "last_image": ("b.png", PNG, "image/png")}
        r = httpx.post(s["url"] + "/v1/videos", data={"prompt": "a"}, files=files, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "last_image", r.text
    out = tmp_path / "cat.mp4"
    assert main(["generate", "the cat walks away", "--model", "tiny-wan22-ti2v", "--workers", "1", "--device", "cpu",
                 "--image", str(cat), "--frames", "5", "--size", "64x32", "--steps", "2", "-o", str(out)]) == 0
    assert iio.imread(out, extension=".mp4").shape == (5, 32, 64, 3)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_queued_image_jobs_hold_their_files_not_their_pixels_and_admission_counts_them(server, monkeypatch):
    """Issue 32: 80 image-to-video jobs, each a 4096x4096 all-black PNG (a small file, 48 MiB of pixels), held in
    the queue (the scheduler admits none meanwhile): the server (this process) holds their files, so its RSS grows
    by less than 500 MiB (80 decoded images would be 3.8 GiB), and each job's admission cost counts its input's
    bytes."""
    service = server["service"]
    monkeypatch.setattr(service.requests, "config", dataclasses.replace(service.config,
                                                                        max_image_pixels=4096 * 4096))
    monkeypatch.setattr(service.engine.core.scheduler, "max_running", 0)     # held: every job waits in the queue
    buf = io.BytesIO()
    PIL.Image.new("RGB", (4096, 4096)).save(buf, format="PNG")
    black = buf.getvalue()
    assert len(black) < MAX_BODY
    http = httpx.Client(base_url=server["url"], timeout=60)
    body = {"prompt": "a cat", "size": "32x32", "num_frames": "1", "num_inference_steps": "2"}
    ids, before = [], _rss()
    try:
        for _ in range(80):
            r = http.post("/v1/videos", data=body, files={"input_reference": ("black.png", black, "image/png")})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        grown = _rss() - before
        stats = service.engine.stats()
        assert stats.running == 0 and stats.waiting == 80, stats
        assert grown < 500 << 20, f"RSS grew by {grown >> 20} MiB for 80 queued jobs"
        job = service.jobs.get(ids[-1])
        plain = service.admission.cost(dataclasses.replace(job.handle.spec, options={}), "video")
        lim = service.limits                   # bytes over the default request's video (admission.input_cost)
        assert job.cost - plain == pytest.approx(len(black) / (lim.default_frames * lim.default_width *
                                                               lim.default_height * 3))
    finally:
        for vid in ids:
            http.delete(f"/v1/videos/{vid}")
        http.close()


def test_the_client_s_seconds_fit_by_a_lower_fps_and_a_remix_starts_from_the_source_s_last_frame(server):
    """openai's `seconds` values ("4", "8", "12") on a model whose limit is 33 frames at 16 fps: "4" is made at 8 fps
    (33 frames, 4.1 s), "12" is refused naming "4"; `videos.remix` on an image-to-video model is the video its
    last frame starts, with the source's size, length and settings: the same frames as a create given that frame."""
    from openai import BadRequestError, OpenAI

    from longserve.server.api.stored_frames import last_frame

    client = OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)
    four = client.videos.create(prompt="a ball", input_reference=("a.png", PNG, "image/png"), size="32x32",
                                seconds="4")
    assert (four.seconds, four.model_extra["fps"], four.model_extra["num_frames"]) == ("4", 8, 33)
    client.videos.delete(four.id)                           # its length is what was asked: nothing to make
    with pytest.raises(BadRequestError) as e:
        client.videos.create(prompt="a ball", input_reference=("a.png", PNG, "image/png"), size="32x32",
                             seconds="12")
    assert e.value.body["param"] == "seconds" and 'the nearest seconds it takes is "4"' in e.value.body["message"]

    source = client.videos.create_and_poll(prompt="a cat", input_reference=("a.png", PNG, "image/png"),
                                           size="32x32", seconds="1", extra_body={"fps": 4, "seed": 3},
                                           poll_interval_ms=50)
    assert source.status == "completed", source.error
    remix = client.videos.remix(source.id, prompt="a dog", extra_body={"seed": 5})
    assert remix.remixed_from_video_id == source.id and remix.model_extra["extended_from"] is None
    assert (remix.size, remix.model_extra["num_frames"], remix.model_extra["fps"]) == ("32x32", 5, 4)
    path = server["service"].content_path(source.id, "video")
    buffer = io.BytesIO()
    iio.imwrite(buffer, last_frame(path), extension=".png")
    direct = client.videos.create(prompt="a dog", input_reference=("last.png", buffer.getvalue(), "image/png"),
                                  size="32x32", seconds="1", extra_body={"fps": 4, "seed": 5})
    made = []
    for video in (remix, direct):
        done = client.videos.poll(video.id, poll_interval_ms=50)
        assert done.status == "completed", done.error
        made.append(iio.imread(io.BytesIO(client.videos.download_content(video.id).read()), extension=".mp4"))
    assert made[0].shape == (5, 32, 32, 3) and np.array_equal(made[0], made[1])
