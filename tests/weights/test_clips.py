"""The procedural clips of `tools/weights/clips.py` follow issue 11's rules, and the content helper
(`tests/support/content.py`) reads them back: every clip is recognised as its own prompt, never as another
colour or motion, and noise or a still object is recognised as nothing."""

import numpy as np
import pytest
from content import describe, recognises

from tools.weights.clips import FRAMES, SIZE, prompt_at, render_clip, render_long_clip
from tools.weights.prompts import COLOURS, MOTIONS, PROMPTS, SHAPES, parse_prompt


def test_vocabulary_is_four_colours_two_shapes_five_motions():
    assert len(PROMPTS) == 40 == len(COLOURS) * len(SHAPES) * len(MOTIONS)
    assert parse_prompt("a yellow square moving up") == ("yellow", "square", "moving up")
    with pytest.raises(ValueError):
        parse_prompt("a purple ball moving right")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_rendered_clip_is_recognised_as_its_prompt_and_only_its_prompt(prompt):
    rng = np.random.default_rng(PROMPTS.index(prompt))
    colour, shape, motion = parse_prompt(prompt)
    for _ in range(3):
        clip = render_clip(prompt, rng)
        assert clip.shape == (FRAMES, SIZE, SIZE, 3) and clip.dtype == np.float32
        assert 0.0 <= clip.min() and clip.max() <= 1.0
        d = describe(clip)
        assert (d.colour, d.shape, d.motion) == (colour, shape, motion), d
        track = d.track
        if motion == "bouncing":  # falls, then rises again; little horizontal travel
            y = track[:, 1]
            low = int(np.argmax(y))
            assert y[low] - y[:low + 1].min() >= 0.1 * SIZE and y[low] - y[low:].min() >= 0.1 * SIZE
            assert np.ptp(track[:, 0]) <= 0.2 * SIZE
        else:  # crosses at least 40% of the frame in the named direction
            net = track[-1] - track[0]
            axis, sign = {"moving right": (0, 1), "moving left": (0, -1), "moving up": (1, -1),
                          "moving down": (1, 1)}[motion]
            assert sign * net[axis] >= 0.4 * SIZE
        assert recognises(clip, prompt)


def test_noise_and_a_still_object_are_recognised_as_nothing():
    rng = np.random.default_rng(0)
    noise = rng.random((FRAMES, SIZE, SIZE, 3), dtype=np.float32)
    d = describe(noise)
    assert d.colour is None or d.motion is None
    still = np.repeat(render_clip("a red ball moving right", rng)[:1], FRAMES, axis=0)
    assert describe(still).motion is None


@pytest.mark.parametrize("seed", range(4))
def test_a_long_clip_keeps_bouncing_and_changes_colour_where_scheduled(seed):
    """30 s at 8 fps: every 16-frame window bounces, every 3-frame chunk has its scheduled colour, and the
    object's path runs on through the changes as if there were none (only the colour and shape change)."""
    rng = np.random.default_rng(seed)
    schedule = [(0, "a red ball bouncing"), (120, "a blue ball bouncing"), (201, "a green square bouncing")]
    clip = render_long_clip(schedule, 240, rng)
    assert clip.shape == (240, SIZE, SIZE, 3) and clip.dtype == np.float32
    assert 0.0 <= clip.min() and clip.max() <= 1.0
    for first in range(0, 240 - 15, 8):
        assert describe(clip[first:first + 16]).motion == "bouncing", first
    for first in range(0, 240, 3):
        d = describe(clip[first:first + 3])
        assert d.colour == parse_prompt(prompt_at(schedule, first))[0], first
    track = describe(clip).track                                                     # (240, 2), no gaps
    same = describe(render_long_clip("a red ball bouncing", 240, np.random.default_rng(seed))).track
    assert not np.isnan(track).any() and np.abs(track - same).max() < 0.5             # the path ignores the prompts
    assert describe(clip[201:]).shape == "square" and describe(clip[:120]).shape == "ball"


@pytest.mark.parametrize("motion", ["moving right", "moving left", "moving up", "moving down"])
def test_a_long_straight_clip_moves_its_way_and_wraps_round_the_frame(motion):
    """Every 16-frame window in which the object stays wholly in sight is recognised as the motion; the
    object leaves on one side and comes back on the other."""
    clip = render_long_clip(f"a green square {motion}", 96, np.random.default_rng(1))
    track = describe(clip).track                                                      # (96, 2)
    steps = np.abs(np.diff(track, axis=0))
    assert np.nanmax(steps) > SIZE / 2, "the object comes back in on the other side"
    inside = np.all((track > 10) & (track < SIZE - 10), axis=1)                       # NaN compares False
    windows = [f for f in range(0, 96 - 15) if inside[f:f + 16].all()]
    assert windows
    for first in windows:
        assert describe(clip[first:first + 16]).motion == motion, first


def test_long_clips_keep_one_motion_and_start_at_frame_0():
    rng = np.random.default_rng(0)
    assert render_long_clip("a yellow ball bouncing", 5, rng).shape == (5, SIZE, SIZE, 3)
    assert render_long_clip("a red ball moving right", 16, rng).shape == (16, SIZE, SIZE, 3)
    with pytest.raises(ValueError):
        render_long_clip([(0, "a red ball bouncing"), (8, "a red ball moving right")], 16, rng)
    with pytest.raises(ValueError):
        render_long_clip([(3, "a red ball bouncing")], 16, rng)
