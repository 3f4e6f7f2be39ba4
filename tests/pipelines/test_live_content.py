"""`make demo-live` on the trained tiny-live: the 30-second video's chunks are red before the switch at 15 s and
blue from one chunk after it (tests/support/content.py names each chunk's colour), also through the small decoder
(`DECODER=tiny`) and in the stages live loop with a stream batch (every chunk the serial demo's colour); the ball
keeps bouncing as high at the end of each prompt as at its start (issue 45); and the README's strip is that run's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import imageio.v3 as iio
import imageio_ffmpeg
import numpy as np
import pytest
from content import describe, vertical_range

from longserve.weights.registry import TINY_MODELS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not (TINY_MODELS.get("tiny-live", Path("/nonexistent")) / "causal_config.json")
                                .exists(), reason="weights/tiny-live is not built")


#: the two variants' runs (the small decoder, the stages loop) stop 6 s after the switch, not 15: the chunks they
#: are checked on (every chunk's colour, the first blue one) are all there, at 60% of the demo's time
VARIANT_SECONDS = 21


def run_demo(out: Path, *decoder: str, seconds: int = 30) -> Path:
    from tools.live_demo import main

    assert main(["--model", "tiny-live", "--seconds", str(seconds), "--switch-at", "15", "-o",
                 str(out / "demo_live.mp4"), "--strip", str(out / "strip.png"), "--chunks-json",
                 str(out / "chunks.json"), *decoder]) == 0
    return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^demo-live:.*?\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "tools.live_demo --model tiny-live --seconds 30 --switch-at 15" in recipe
    assert "--decoder $(DECODER)" in recipe and re.search(r"^DECODER \?= vae$", makefile, re.M)
    return run_demo(tmp_path_factory.mktemp("demo-live"))


def read_demo(demo: Path) -> tuple[np.ndarray, dict]:
    """The demo's frames (T, H, W, 3) uint8, as the MP4 holds them, and its chunks.json."""
    info = json.loads((demo / "chunks.json").read_text())
    reader = imageio_ffmpeg.read_frames(str(demo / "demo_live.mp4"))
    meta = next(reader)
    W, H = meta["size"]
    return np.stack([np.frombuffer(f, np.uint8).reshape(H, W, 3) for f in reader]), info


def chunk_colours(demo: Path, seconds: int = 30) -> list:
    """Each chunk's colour in the demo's MP4 (a run of `seconds`)."""
    video, info = read_demo(demo)
    fps, switch, chunks = info["fps"], info["switch_chunk"], info["chunks"]
    assert len(video) == sum(c["frames"] for c in chunks) and abs(len(video) / fps - seconds) < 1
    assert abs(chunks[switch]["start"] / fps - 15) < 1
    return [describe(video[c["start"]:c["start"] + c["frames"]]).colour for c in chunks]


def assert_red_then_blue(demo: Path, seconds: int = 30) -> None:
    switch = json.loads((demo / "chunks.json").read_text())["switch_chunk"]
    colours = chunk_colours(demo, seconds)
    before, after = colours[:switch], colours[switch + 1:]
    red = sum(c == "red" for c in before) / len(before)
    blue = sum(c == "blue" for c in after) / len(after)
    assert red >= 0.9 and blue >= 0.9, (red, blue, colours)


def test_the_demo_is_red_before_the_switch_and_blue_from_one_chunk_after(demo):
    assert_red_then_blue(demo)


def bounce_heights(demo: Path) -> dict[str, float]:
    """The ball's vertical range (pixels) in the first and last 3 s of each prompt: 0-3 s, the 3 s before the
    switch, the 3 s from it, and the last 3 s; and the frame's height."""
    video, info = read_demo(demo)
    w = 3 * info["fps"]
    s = info["chunks"][info["switch_chunk"]]["start"]
    spans = {"first": (0, w), "before": (s - w, s), "after": (s, s + w), "last": (len(video) - w, len(video))}
    return {**{name: vertical_range(video[a:b]) for name, (a, b) in spans.items()}, "size": video.shape[1]}


def test_the_bounce_keeps_its_height_before_and_after_the_switch(demo):
    """Issue 45: the bounce used to die out (34 px of vertical range in the first 3 s, 5 px in the 3 s before the
    switch; 20 px after the switch, 9 px at the end). The acceptance rule: the range of the last 3 s of a prompt is
    at least 70% of its first 3 s's, before the switch and after it; and those first 3 s are a bounce (a range of
    at least a fifth of the frame: the training clips' arcs are half of it)."""
    heights = bounce_heights(demo)
    assert heights["first"] >= 0.2 * heights["size"] and heights["after"] >= 0.2 * heights["size"], heights
    assert heights["before"] >= 0.7 * heights["first"], heights
    assert heights["last"] >= 0.7 * heights["after"], heights


def test_the_demo_on_the_small_decoder_is_red_then_blue_too(tmp_path):
    """`make demo-live DECODER=tiny`: the same video's frames through tiny-live's small TAEHV-shaped decoder
    (weights/tiny-decoder-live) instead of its VAE."""
    assert_red_then_blue(run_demo(tmp_path, "--decoder", "tiny", seconds=VARIANT_SECONDS), VARIANT_SECONDS)


def test_the_demo_in_stages_with_a_stream_batch_goes_blue_at_the_same_chunk(demo, tmp_path):
    """The stages live loop on 2 workers, 2 chunks in flight (engine/live_stages.py: not the serial loop's numbers,
    docs/design.md says how), still shows red, then blue, and switches at the serial demo's chunk."""
    stages = run_demo(tmp_path, "--workers", "2", "--live-loop", "stages", seconds=VARIANT_SECONDS)
    assert_red_then_blue(stages, VARIANT_SECONDS)
    colours, serial = chunk_colours(stages, VARIANT_SECONDS), chunk_colours(demo)
    assert colours == serial[:len(colours)] and colours.index("blue") == serial.index("blue")   # every chunk's


def test_the_readme_strip_is_the_demo_s(demo):
    """The same frames, compared as decoded pixels: the PNG's bytes (its compression, the float arithmetic of a CPU's
    kernels) may differ between machines. Under ATEN_CPU_CAPABILITY=default one pixel of the strip differs by 1."""
    assert "docs/demo_live_strip.png" in (ROOT / "README.md").read_text()
    made = iio.imread(demo / "strip.png").astype(np.float64)
    shown = iio.imread(ROOT / "docs" / "demo_live_strip.png").astype(np.float64)
    assert made.shape == shown.shape
    assert np.abs(made - shown).mean() <= 2.0     # as the other demos' strips: up to the video encoder's rounding
