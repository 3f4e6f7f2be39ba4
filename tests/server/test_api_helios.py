"""Helios over HTTP (tiny-helios on 2 workers): its chunk options as request extensions, a streamed MP4 whose
first bytes come while later chunks still denoise, progress over every chunk's steps, and the content's frame
count as diffusers cuts it (whole chunks, then 4k+1)."""

import threading
import time

import httpx
import imageio.v3 as iio
import pytest
from servers import serving

# 4 chunks of 3 latent frames (9 frames each) at 48x80: 36 frames asked, 33 made
HELIOS = {"prompt": "a red ball bouncing", "size": "80x48", "num_frames": 36, "num_inference_steps": 12, "seed": 1,
          "guidance_scale": 1.0, "num_latent_frames_per_chunk": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("serve-helios"), model="tiny-helios", workers=2, max_seconds=10,
                 decode_chunk_frames=8) as s:
        yield s["url"]


def test_a_helios_video_streams_chunk_by_chunk_with_progress_over_every_chunk(server):
    with httpx.Client(base_url=server, timeout=120) as http:
        v = http.post("/v1/videos", json=HELIOS).json()
        assert v["status"] == "queued" and v["options"]["num_latent_frames_per_chunk"] == 3, v
        first_bytes_at, streamed = [], bytearray()

        def read_stream():
            with httpx.Client(base_url=server, timeout=120) as c:
                with c.stream("GET", f"/v1/videos/{v['id']}/content", params={"stream": "true"}) as r:
                    assert r.status_code == 200
                    for chunk in r.iter_bytes():
                        if not streamed:
                            first_bytes_at.append(time.monotonic())
                        streamed.extend(chunk)

        reader = threading.Thread(target=read_stream)
        reader.start()
        seen = []          # (when asked, progress): the progress at the first bytes is read off it, not asked by the
        while True:        # reader itself (its round trip, behind this loop's, came late on a loaded machine)
            asked = time.monotonic()
            cur = http.get(f"/v1/videos/{v['id']}").json()
            if cur["status"] in ("completed", "failed"):
                break
            seen.append((asked, cur["progress"]))
            time.sleep(0.02)
        reader.join(60)
        assert cur["status"] == "completed", cur
        progress = [p for _, p in seen]
        assert progress == sorted(progress) and len(set(progress)) > 4, seen
        assert first_bytes_at, "no bytes streamed"
        after = [p for t, p in seen if t >= first_bytes_at[0]]     # progress only grows: the first answer asked
        assert after and after[0] < 90, (first_bytes_at, seen)     # after them bounds it then: not the last chunk
        stored = http.get(f"/v1/videos/{v['id']}/content").content
        frames = iio.imread(stored, extension=".mp4")
        assert frames.shape == (33, 48, 80, 3)
        assert iio.imread(bytes(streamed), extension=".mp4").shape == frames.shape


@pytest.mark.parametrize("field, value", [("history_sizes", [16, 2]), ("num_latent_frames_per_chunk", 0)])
def test_bad_chunk_options_get_400_naming_the_field(server, field, value):
    with httpx.Client(base_url=server, timeout=60) as http:
        r = http.post("/v1/videos", json={**HELIOS, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
