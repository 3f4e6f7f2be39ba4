"""SANA-Video at the front doors: over HTTP (tiny-sana-video-i2v on 1 worker) the official openai client's
`videos.create(input_reference=...)` makes a streamed MP4 of the asked size and frames from an image; a create without
the image, and bad options, get 400 naming the field, before any worker sees them. `longserve generate --model
tiny-sana-video` writes its MP4."""

import io
import warnings

import httpx
import imageio.v3 as iio
import pytest
from images import png_bytes
from servers import serving

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the openai client marks the Sora API deprecated


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("serve-sana-video"), model="tiny-sana-video-i2v", workers=1,
                 default_steps=2) as s:
        yield s


def test_openai_client_makes_a_sana_video_from_an_uploaded_image(server, tmp_path):
    from openai import OpenAI

    cat = tmp_path / "cat.png"
    cat.write_bytes(png_bytes(70, 52))
    client = OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)
    with open(cat, "rb") as f:
        video = client.videos.create(prompt="a cat", input_reference=f, size="64x64",
                                     extra_body={"num_frames": 5, "seed": 3})
    done = client.videos.poll(video.id, poll_interval_ms=50)
    assert done.status == "completed", done.error
    assert done.model_extra["options"]["image"] == "70x52"
    frames = iio.imread(io.BytesIO(client.videos.download_content(video.id).read()), extension=".mp4")
    assert frames.shape == (5, 64, 64, 3) and frames.std() > 3


@pytest.mark.parametrize("body, files, field", [
    ({"prompt": "a", "size": "64x64"}, None, "input_reference"),                  # the image-to-video model needs one
    ({"prompt": "a", "size": "64x48"}, {"input_reference": ("a.png", png_bytes(8, 8), "image/png")}, "size"),
    ({"prompt": "a", "num_frames": "8"}, {"input_reference": ("a.png", png_bytes(8, 8), "image/png")}, "num_frames"),
])
def test_bad_sana_video_requests_get_400_naming_the_field(server, body, files, field):
    r = httpx.post(server["url"] + "/v1/videos", data=body, files=files or {"x": ("", b"", "text/plain")}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_generate_writes_a_sana_video_from_the_cli(tmp_path):
    from longserve.server.cli import main

    out = tmp_path / "ball.mp4"
    assert main(["generate", "a red ball", "--model", "tiny-sana-video", "--workers", "1", "--device", "cpu",
                 "--frames", "5", "--size", "64x32", "--steps", "1", "--seed", "0", "-o", str(out)]) == 0
    assert iio.imread(out, extension=".mp4").shape == (5, 32, 64, 3)
