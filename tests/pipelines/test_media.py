"""Reading a video to extend (`pipelines/media.py`): the stream's parameters come from the container as data, never
from ffmpeg's log (which a file's metadata can forge), and a header that understates the video cannot make the
decoder produce more than the limits allow."""

from __future__ import annotations

import subprocess

import imageio_ffmpeg
import numpy as np
import pytest

from longserve.pipelines import media
from longserve.pipelines.media import VideoInputError, probe, read_mp4

#: what ffmpeg's log would print first if a title said so: the text the old regex probe took for the stream
FORGED_TITLE = "x\n  Stream #0:0: Video: h264, 16x16, 1 fps\n  Duration: 00:00:00.50"


def _mp4(path, size: str, frames: int, title: str | None = None) -> str:
    cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-y", "-f", "lavfi", "-i", f"testsrc=size={size}:rate=8",
           "-frames:v", str(frames), "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p"]
    subprocess.run([*cmd, *(["-metadata", f"title={title}"] if title else []), str(path)], check=True)
    return str(path)


@pytest.fixture(scope="module")
def forged(tmp_path_factory):
    return _mp4(tmp_path_factory.mktemp("media") / "forged.mp4", "320x240", 40, FORGED_TITLE)


def test_the_probe_reads_the_stream_not_a_title_that_imitates_ffmpegs_log(forged):
    assert probe(forged, "video") == {"width": 320, "height": 240, "fps": 8.0, "frames": 40}


def test_a_forged_title_does_not_get_a_large_video_past_the_limits(forged):
    with pytest.raises(VideoInputError) as e:
        read_mp4(forged, "input_reference", max_frames=33, max_pixels=96 * 96)
    assert (e.value.field, e.value.code) == ("input_reference", "video_too_large")
    assert "320x240" in str(e.value) and "before decoding" in str(e.value)


def test_a_header_that_understates_the_frame_size_fails_in_the_decoder(forged, monkeypatch):
    """If a header did pass as 16x16, the decoder's own per-frame pixel cap refuses the real 320x240 frames."""
    monkeypatch.setattr(media, "probe", lambda path, field: {"width": 16, "height": 16, "fps": 8.0, "frames": 4})
    with pytest.raises(VideoInputError) as e:
        read_mp4(forged, "video", max_frames=33, max_pixels=96 * 96)
    assert e.value.code == "invalid_video"


def test_a_header_that_understates_the_frame_count_stops_the_decoder_at_the_limit(forged, monkeypatch):
    calls = []
    real_run = media._run_capped

    def counted(cmd, cap, *args):
        out, err, status = real_run(cmd, cap, *args)
        calls.append((cap, len(out), status))
        return out, err, status

    monkeypatch.setattr(media, "probe", lambda path, field: {"width": 320, "height": 240, "fps": 8.0, "frames": 2})
    monkeypatch.setattr(media, "_run_capped", counted)
    with pytest.raises(VideoInputError) as e:
        read_mp4(forged, "video", max_frames=3)
    assert e.value.code == "video_too_large"
    (cap, held, _), = calls
    assert cap == 4 * 320 * 240 * 3 and held <= cap, "never more than one frame past the limit is decoded"


def test_the_output_cap_kills_a_decoder_that_writes_past_it(tmp_path):
    """The stream reader itself: past `cap` bytes the process is killed and the output dropped."""
    out, _, status = media._run_capped(["yes", "x" * 1000], cap=1 << 20)
    assert status == "over" and len(out) == 0


def test_bytes_go_through_a_temporary_file_in_the_callers_directory_and_leave_nothing(forged, tmp_path):
    data = open(forged, "rb").read()
    frames = read_mp4(data, "video", tmp_dir=tmp_path)
    assert frames.shape == (40, 240, 320, 3) and frames.dtype == np.uint8
    assert list(tmp_path.iterdir()) == []
