"""Content over segments (issues 23 and 45): `make demo-long` on the trained `weights/tiny-skyreels-df` writes "a red
ball bouncing" over at least 10 segments, red in at least 90% of them, with the ball's position continuous across
every segment boundary (no jump from a segment's last frame to the next one's first new frame larger than the
largest jump inside a segment), one ball in every frame (the red mask in one piece) and no step of the ball between
two frames over a quarter of the width (issue 45: the model used to split the ball inside segments), and the
README's strip is one frame of each of its segments. The helper (`tests/support/content.py`, `describe_segments`,
`blob_counts`) is pinned on rendered clips first. The 40-prompt rate at the
demo's settings and the control with `overlap_history` at its minimum are `tools/weights/eval_tiny_skyreels_df.py`'s
(minutes): weights/README.md has the figures."""

import shlex
from pathlib import Path

import imageio.v3 as iio
import numpy as np
from content import describe, describe_segments, segment_starts

from tools.weights.clips import draw_frame, render_long_clip
from tools.weights.prompts import BACKGROUND
from tools.weights.train_tiny_skyreels_df import BOUNCE

REPO = Path(__file__).resolve().parents[2]


def recipe(target: str) -> list[list[str]]:
    """The commands of a Makefile recipe, split into arguments."""
    lines = (REPO / "Makefile").read_text().replace("\\\n", " ").splitlines()
    start = lines.index(f"{target}: install") + 1
    out = []
    for line in lines[start:]:
        if not line.startswith("\t"):
            break
        out.append(shlex.split(line.strip()))
    return [c for c in out if c[0] != "mkdir"]


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_segment_helper_finds_continuous_clips_and_spliced_ones():
    starts = segment_starts(89, 17, 9)
    assert starts == [0, 17, 25, 33, 41, 49, 57, 65, 73, 81]
    # each splice moves the object 20 px across its motion from frame 41 (the fourth boundary) on
    for prompt, across in (("a blue ball bouncing", 2), ("a blue square moving left", 1)):
        clip = render_long_clip(prompt, 89, np.random.default_rng(0))
        r = describe_segments(clip, starts, prompt)
        assert r.colour_rate == 1.0 and r.continuous and r.largest_boundary_jump <= r.largest_inside_jump
        # the rendered motion is smooth: no jump inside a segment over 13 px (a bounce's speed at the floor; a wrap
        # round the frame is not a jump)
        assert r.largest_inside_jump <= 13, (prompt, r)
        spliced = clip.copy()
        spliced[41:] = np.roll(clip[41:], 20, axis=across)
        r = describe_segments(spliced, starts, prompt)
        assert not r.continuous and r.boundary_jumps[3] == r.largest_boundary_jump > r.largest_inside_jump
        assert describe_segments(clip, starts, prompt.replace("blue", "red")).colour_rate == 0.0


def test_the_helper_finds_one_ball_in_every_rendered_frame_and_counts_a_split_one():
    starts = segment_starts(89, 17, 9)
    # tiny-live's bounce (up to 13 px a frame) and the DF model's slower one (BOUNCE: under 8)
    for bounce, fastest in ((None, 13), (BOUNCE, 8)):
        clip = render_long_clip("a red ball bouncing", 89, np.random.default_rng(1), bounce=bounce)
        r = describe_segments(clip, starts, "a red ball bouncing")
        assert r.blobs == [1] * 89 and r.frames_not_one_object == [] and r.largest_jump <= fastest, (bounce, r)
    # a ball split in two halves of the frame (the old model's frames), and a frame without the ball
    split = clip.copy()
    top, bottom = draw_frame((32, 14), 7, "ball", "red"), draw_frame((32, 44), 7, "ball", "red")
    far = np.abs(bottom - BACKGROUND).sum(axis=-1, keepdims=True) > np.abs(top - BACKGROUND).sum(axis=-1, keepdims=True)
    split[40] = np.where(far, bottom, top)
    split[60] = BACKGROUND
    r = describe_segments(split, starts, "a red ball bouncing")
    assert r.blobs[40] == 2 and r.blobs[60] == 0 and r.frames_not_one_object == [40, 60]
    hop = clip.copy()                                        # one frame drawn 20 px aside, towards the middle
    x = describe(clip[50:51]).track[0, 0]
    hop[50] = np.roll(clip[50], 20 if x < 32 else -20, axis=1)
    r = describe_segments(hop, starts, "a red ball bouncing")
    assert r.frames_not_one_object == [] and r.largest_jump > 0.25 * 64


def test_make_demo_long_draws_a_red_ball_continuous_across_ten_segments_and_the_readme_strip_is_its_frames(tmp_path):
    from longserve.server.cli import main
    from tools.frame_strip import main as strip_main
    from tools.weights.eval_tiny_skyreels_df import demo_settings

    generate, strip = recipe("demo-long")
    assert generate[0] == "$(VENV)/bin/longserve" and strip[:3] == ["$(PY)", "-m", "tools.frame_strip"]
    assert generate[1:3] == ["generate", "a red ball bouncing"] and generate[-2:] == ["-o", "out/demo-long.mp4"]
    settings = demo_settings(REPO / "weights" / "tiny-skyreels-df")       # what the 40-prompt evaluation runs
    frames, base, overlap = (int(flag(generate, f)) for f in ("--frames", "--base-frames", "--overlap"))
    assert (frames, base, overlap) == (settings["num_frames"], settings["base_num_frames"], settings["overlap_history"])
    assert int(flag(generate, "--steps")) == settings["num_inference_steps"] and flag(generate, "--seed") == "0"
    assert flag(generate, "--size") == f"{settings['width']}x{settings['height']}"
    assert strip[3:6] == ["out/demo-long.mp4", "-o", "out/demo_long_strip.png"]
    assert flag(strip, "--segments") == f"{base},{overlap}"

    video_path, strip_path = tmp_path / "demo-long.mp4", tmp_path / "demo_long_strip.png"
    assert main(generate[1:-1] + [str(video_path)]) == 0
    video = iio.imread(video_path, extension=".mp4")
    starts = segment_starts(len(video), base, overlap)
    r = describe_segments(video, starts, "a red ball bouncing")
    print(f"\nmake demo-long: {video.shape}, {len(starts)} segments, colours {r.colours}, boundary jumps "
          f"{np.round(r.boundary_jumps, 1).tolist()} px, largest inside a segment {r.largest_inside_jump:.1f} px, "
          f"largest step {r.largest_jump / video.shape[2]:.3f} of the width, frames not one ball "
          f"{r.frames_not_one_object}")
    assert video.shape == (frames, 64, 64, 3) and len(starts) >= 10
    assert r.colour_rate >= 0.9, r.colours
    assert r.continuous, (r.boundary_jumps, r.largest_inside_jump)
    assert r.frames_not_one_object == [], r.blobs                                   # one ball in every frame
    assert r.largest_jump <= 0.25 * video.shape[2], r.largest_jump                    # issue 45

    assert strip_main([str(video_path), "-o", str(strip_path), *strip[6:]]) == 0
    made = iio.imread(strip_path).astype(np.float64)
    shown = iio.imread(REPO / "docs" / "demo_long_strip.png").astype(np.float64)
    assert made.shape == shown.shape == (2 * 64, len(starts) * (64 + 2) * 2 - 2 * 2, 3)
    assert np.abs(made - shown).mean() <= 2.0   # the same frames (up to the video encoder's rounding)
