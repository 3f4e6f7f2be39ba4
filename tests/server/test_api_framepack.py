"""FramePack at the front doors: over HTTP (tiny-framepack on 1 worker) the official openai client's
`videos.create(input_reference=...)` makes a streamed MP4 from an image, vanilla sampling's sections handed out as
they are final; a create without the image, and bad options, get 400 naming the field. `longserve generate --model
tiny-framepack --image` writes its MP4."""

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
    with serving(tmp_path_factory.mktemp("serve-framepack"), model="tiny-framepack", workers=1,
                 default_steps=1) as s:
        yield s


def test_openai_client_makes_a_framepack_video_from_an_uploaded_image(server, tmp_path):
    from openai import OpenAI

    cat = tmp_path / "cat.png"
    cat.write_bytes(png_bytes(70, 52))
    client = OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)
    with open(cat, "rb") as f:
        video = client.videos.create(prompt="a cat", input_reference=f, size="32x32",
                                     extra_body={"num_frames": 9, "seed": 3, "latent_window_size": 2,
                                                 "sampling_type": "vanilla"})
    done = client.videos.poll(video.id, poll_interval_ms=50)
    assert done.status == "completed", done.error
    assert done.num_frames == 17 and done.model_extra["options"]["sampling_type"] == "vanilla"
    frames = iio.imread(io.BytesIO(client.videos.download_content(video.id).read()), extension=".mp4")
    assert frames.shape == (17, 32, 32, 3) and frames.std() > 3


@pytest.mark.parametrize("body, files, field", [
    ({"prompt": "a", "size": "32x32"}, None, "input_reference"),
    ({"prompt": "a", "size": "40x32"}, {"input_reference": ("a.png", png_bytes(8, 8), "image/png")}, "size"),
    ({"prompt": "a", "sampling_type": "forward"}, {"input_reference": ("a.png", png_bytes(8, 8), "image/png")},
     "sampling_type"),
])
def test_bad_framepack_requests_get_400_naming_the_field(server, body, files, field):
    r = httpx.post(server["url"] + "/v1/videos", data=body, files=files or {"x": ("", b"", "text/plain")}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_generate_writes_a_framepack_video_from_the_cli(tmp_path):
    from longserve.server.cli import main

    img, out = tmp_path / "cat.png", tmp_path / "cat.mp4"
    img.write_bytes(png_bytes(40, 30))
    assert main(["generate", "a cat", "--model", "tiny-framepack", "--image", str(img), "--workers", "1",
                 "--device", "cpu", "--frames", "9", "--size", "32x32", "--steps", "1", "--seed", "0",
                 "--opt", "latent_window_size=2", "-o", str(out)]) == 0
    assert iio.imread(out, extension=".mp4").shape == (17, 32, 32, 3)
