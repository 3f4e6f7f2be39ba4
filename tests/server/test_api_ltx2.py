"""LTX-2's sound over HTTP (tiny-ltx2 on 1 worker): the official openai client's `download_content` carries an AAC
track as long as the sound the model made; `audio: false` gives a video-only file; a streamed download
(`?stream=true`) carries the sound in its fragments beside the picture, and is the stored file byte for byte
(docs/serving.md, docs/design.md "Sound in a streamed download"), also when the picture comes window by window."""

import threading
import time
import warnings

import httpx
import pytest
from servers import serving

from tests.support.sound import tracks

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the openai client marks the Sora API deprecated

# 17 frames at 24 fps (0.71 s), 96x160, two steps, CFG only (STG and modality guidance off: cheap)
LTX2 = {"num_frames": 17, "num_inference_steps": 2, "seed": 1, "stg_scale": 0, "audio_stg_scale": 0,
        "modality_scale": 1, "audio_modality_scale": 1}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("serve-ltx2"), model="tiny-ltx2", workers=1, max_seconds=10,
                 max_frames=233) as s:
        yield s


@pytest.fixture(scope="module")
def server(served):
    return served["url"]


def test_the_admission_cost_counts_the_sound_so_a_lower_fps_costs_more(served):
    """Issue 42, finding 12: the same 17 frames at fps 1 are 17 s of sound (24x the sound of fps 24), which the
    transformer denoises beside the picture; their cost says so, in the tokens of both streams (tiny-ltx2: 25 sound
    tokens a second, a video token per 32 x 32 x 8 pixels)."""
    from longserve.server.api.protocol import VideoCreateRequest

    service = served["service"]
    caps = service.engine.info.capabilities
    assert (caps.sound_tokens_per_second, caps.pixels_per_token) == (25.0, 32 * 32 * 8)

    def cost(fps):
        body = {"prompt": "a red ball bouncing", "size": "160x96", "fps": fps, **LTX2}
        return service.requests.create(VideoCreateRequest.model_validate(body)).cost

    video_tokens = 17 * 160 * 96 / (32 * 32 * 8)
    assert cost(1) / cost(24) == pytest.approx((video_tokens + 17 * 25) / (video_tokens + 17 / 24 * 25))
    assert cost(1) > 5 * cost(24) and cost(12) > cost(24)


def test_the_openai_clients_download_carries_the_sound(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    video = client.videos.create_and_poll(prompt="a red ball bouncing", size="160x96", seconds="1",
                                          poll_interval_ms=50,
                                          extra_body={k: v for k, v in LTX2.items() if k != "num_frames"})
    assert video.status == "completed", video.error
    got = tracks(client.videos.download_content(video.id).read())
    assert got["video"] == (25, 160, 96)                   # 1 s at 24 fps: 25 frames (8k+1)
    codec, channels, rate, seconds = got["audio"]
    assert (codec, channels, rate) == ("aac", 2, 24000)
    # the model's sound for 25 frames: 26 audio latent frames -> 104 mel frames less the causal VAE's 3 -> 101 x 240
    # samples (1.01 s: as long as the picture, 1.04 s, to a mel frame)
    assert abs(seconds - 101 * 240 / 24000) < 0.05, seconds


def packet_tracks(mp4: bytes) -> list[str]:
    """The kind of every packet ("video" / "audio") in the order of their bytes in the file."""
    import io

    import av

    with av.open(io.BytesIO(mp4), format="mov") as c:
        packets = [(p.pos, p.stream.type) for p in c.demux() if p.size]
    return [kind for _, kind in sorted(packets)]


def test_audio_false_gives_a_video_only_file_and_a_stream_carries_picture_and_sound(server):
    with httpx.Client(base_url=server, timeout=120) as http:
        quiet = http.post("/v1/videos", json={"prompt": "a quiet sea", "size": "160x96", "audio": False, **LTX2})
        assert quiet.status_code == 200, quiet.text
        # a clip long enough to be decoded in two windows (30 latent frames: families/ltx2/vae.py), the sound before the
        # first: the writer has it for the first fragment
        loud = http.post("/v1/videos", json={"prompt": "a loud sea", "size": "64x64", **dict(LTX2, num_frames=233)})
        assert loud.status_code == 200, loud.text
        loud = loud.json()
        streamed = bytearray()

        def read_stream():
            with http.stream("GET", f"/v1/videos/{loud['id']}/content", params={"stream": "true"}) as r:
                assert r.status_code == 200
                for chunk in r.iter_bytes():
                    streamed.extend(chunk)

        reader = threading.Thread(target=read_stream)
        reader.start()
        for v in (quiet.json(), loud):
            while (cur := http.get(f"/v1/videos/{v['id']}").json())["status"] not in ("completed", "failed"):
                time.sleep(0.02)
            assert cur["status"] == "completed", cur
        reader.join(60)
        silent = tracks(http.get(f"/v1/videos/{quiet.json()['id']}/content").content)
        assert silent["video"] == (17, 160, 96) and silent["audio"] is None
        stored = http.get(f"/v1/videos/{loud['id']}/content").content
        assert bytes(streamed) == stored                          # one encode: the stream is the stored file
        got = tracks(bytes(streamed))
        assert got["video"] == (233, 64, 64)
        codec, channels, rate, seconds = got["audio"]          # 233 frames: 243 latent frames -> 969 x 240 samples
        assert (codec, channels, rate) == ("aac", 2, 24000) and abs(seconds - 969 * 240 / 24000) < 0.05, got
        kinds = packet_tracks(bytes(streamed))       # each fragment holds its span's picture and sound: interleaved
        assert kinds.index("audio") < len(kinds) - 1 - kinds[::-1].index("video"), kinds


def test_audio_is_refused_naming_the_field_where_it_is_not_an_option(server):
    with httpx.Client(base_url=server, timeout=30) as http:
        r = http.post("/v1/videos", json={"prompt": "x", "size": "160x96", "audio": "loud", **LTX2})
        assert r.status_code == 400 and "audio" in r.text, r.text


def test_a_sound_that_comes_after_the_first_frames_is_muxed_into_the_stored_file(tmp_path):
    """The writer's other way (a model that would hand its sound out after its first frames): the stream has the
    picture alone, the stored file the sound too; a writer given its sound at the start leaves no sound file."""
    import numpy as np

    from longserve.pipelines.sound import as_sound
    from longserve.server.media import FragmentedMP4Writer

    frames = np.random.default_rng(0).integers(0, 255, (9, 32, 48, 3), dtype=np.uint8)
    sound = np.sin(np.linspace(0, 200, 9000, dtype=np.float32))[None].repeat(2, 0) * 0.5        # 0.375 s at 24 kHz
    for start in (False, True):
        part, final = tmp_path / f"{start}.mp4.part", tmp_path / f"{start}.mp4"
        writer = FragmentedMP4Writer(part, final, 48, 32, 24, sound=as_sound(sound, 24000) if start else None)
        writer.write(frames)
        writer.add_audio(sound, 24000)
        writer.finish()
        assert writer.done.wait(30) and writer.ok, writer.error
        got = tracks(final.read_bytes())
        assert got["video"] == (9, 48, 32) and got["audio"][:3] == ("aac", 2, 24000), got
    assert sorted(p.name for p in tmp_path.iterdir()) == ["False.mp4", "True.mp4"]
