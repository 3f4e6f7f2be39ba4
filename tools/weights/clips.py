"""Procedural clips that `weights/tiny-latte` is trained on: one coloured object moving on grey.

Every clip is 16 frames of 64x64 RGB, float32 in [0, 1], (T, H, W, 3), showing one object on
the plain `BACKGROUND` and described by ``"a {colour} {shape} {motion}"`` (the vocabulary, `weights.prompts`):

- colour: red, green, blue, yellow -- the pure RGB primaries and red+green (`PALETTE`);
- shape: ball (a disc) or square (axis-aligned);
- motion:
  * "moving right" / "left" / "up" / "down": a straight line at constant speed whose
    travel along that direction is `MIN_TRAVEL`..`MAX_TRAVEL` of the frame (the rule is
    at least 40%; the clips keep a margin above it), perpendicular travel zero;
    the path is centred in the frame within a few pixels;
  * "bouncing": the object falls and rises on parabolic arcs off a floor (image y grows
    downwards, so it falls while y increases); at least one floor contact falls inside the
    clip with at least `MIN_BOUNCE_DROP` of the frame of fall before it and of rise after
    it, and the horizontal drift is at most `MAX_BOUNCE_DRIFT` of the frame.

Object size, start position, speed, floor height, bounce period and phase and drift vary from
clip to clip, within narrow ranges around a centred path (a toy model of 1M parameters trained
for minutes learns a narrow distribution well; see weights/README.md); the object always lies
wholly inside the frame, so its centroid is where it is drawn.
Edges are antialiased (coverage of each pixel by the shape), which keeps sub-pixel motion
visible and the VAE's job smooth.

`render_clip(prompt, rng)` draws one clip; the rules are checked for many clips in
`tests/weights/test_clips.py` with the analysis helper of the content tests (`tests/support/content.py`).
"""

from __future__ import annotations

import numpy as np

from tools.weights.prompts import BACKGROUND, PALETTE, parse_prompt

FRAMES = 16
SIZE = 64

# Object size: ball radius / square half side, in pixels.
MIN_RADIUS, MAX_RADIUS = 6.5, 8.5
# Straight motion: travel along the named direction, as a fraction of the frame; the path is centred
# in the frame up to `START_JITTER` pixels along it and `ACROSS_JITTER` pixels across it.
MIN_TRAVEL, MAX_TRAVEL = 0.5, 0.65
START_JITTER, ACROSS_JITTER = 4.0, 8.0
# Bouncing: fall before and rise after a floor contact, and horizontal drift, as fractions of the frame.
MIN_BOUNCE_DROP = 0.2
MAX_BOUNCE_DRIFT = 0.06

_DIRECTIONS = {"moving right": (1, 0), "moving left": (-1, 0), "moving up": (0, -1), "moving down": (0, 1)}


def straight_track(direction: str, radius: float, rng: np.random.Generator) -> np.ndarray:
    """Centre positions (T, 2) as (x, y) pixels for a straight, constant-speed crossing."""
    dx, dy = _DIRECTIONS[direction]
    lo, hi = radius, SIZE - radius                                # centre range keeping the object inside
    travel = min(rng.uniform(MIN_TRAVEL, MAX_TRAVEL) * SIZE, hi - lo)
    slack = (hi - lo - travel) / 2                                # room left at each end of the path
    start_along = lo + slack + rng.uniform(-1, 1) * min(START_JITTER, slack)   # in the direction of motion
    across = SIZE / 2 + rng.uniform(-ACROSS_JITTER, ACROSS_JITTER)
    along = start_along + travel * np.linspace(0.0, 1.0, FRAMES)  # (T,)
    if dx + dy < 0:                                               # left / up: run the line backwards
        along = lo + hi - along
    track = np.empty((FRAMES, 2))
    track[:, 0], track[:, 1] = (along, across) if dx else (across, along)
    return track


def bounce_track(radius: float, rng: np.random.Generator) -> np.ndarray:
    """Centre positions (T, 2) of an object bouncing off a floor on parabolic arcs: it starts high,
    falls to the floor near the middle of the clip and rises again (rejection-sampled for the rule)."""
    t = np.arange(FRAMES, dtype=np.float64)
    min_drop = MIN_BOUNCE_DROP * SIZE
    while True:
        floor = rng.uniform(SIZE - radius - 6.0, SIZE - radius)     # centre height at contact (y grows down)
        height = rng.uniform(0.55, 0.65) * SIZE                    # arc height; the top stays inside
        height = min(height, floor - radius)
        period = rng.uniform(11.0, 14.0)                           # frames between floor contacts
        contact = rng.uniform(7.0, 8.5)                            # the contact inside the clip
        phase = ((t - contact) / period) % 1.0                     # 0 at every contact
        y = floor - 4.0 * height * phase * (1.0 - phase)           # (T,) parabolic arcs
        lowest = int(np.argmax(y))
        if y[lowest] - y[:lowest + 1].min() >= min_drop and y[lowest] - y[lowest:].min() >= min_drop:
            break
    drift = rng.uniform(-MAX_BOUNCE_DRIFT, MAX_BOUNCE_DRIFT) * SIZE
    x0 = SIZE / 2 - drift / 2 + rng.uniform(-ACROSS_JITTER, ACROSS_JITTER)
    return np.stack([x0 + drift * t / (FRAMES - 1), y], axis=1)


def draw_frame(centre: tuple[float, float], radius: float, shape: str, colour: str) -> np.ndarray:
    """One frame (H, W, 3): the object's pixel coverage blends its colour over the background."""
    px = np.arange(SIZE) + 0.5                                     # pixel centres
    dx = np.abs(px[None, :] - centre[0])                           # (1, W)
    dy = np.abs(px[:, None] - centre[1])                           # (H, 1)
    if shape == "ball":
        coverage = np.clip(radius - np.hypot(dx, dy) + 0.5, 0.0, 1.0)                       # (H, W)
    else:
        coverage = np.clip(radius - dx + 0.5, 0.0, 1.0) * np.clip(radius - dy + 0.5, 0.0, 1.0)
    colour_rgb = np.asarray(PALETTE[colour])
    background = np.asarray(BACKGROUND)
    return background + coverage[..., None] * (colour_rgb - background)


def render_clip(prompt: str, rng: np.random.Generator) -> np.ndarray:
    """A clip of `prompt` (in `PROMPTS`): float32 (16, 64, 64, 3) in [0, 1], drawn with `rng`."""
    colour, shape, motion = parse_prompt(prompt)
    radius = rng.uniform(MIN_RADIUS, MAX_RADIUS)
    track = bounce_track(radius, rng) if motion == "bouncing" else straight_track(motion, radius, rng)
    return np.stack([draw_frame(tuple(c), radius, shape, colour) for c in track]).astype(np.float32)


# -- long clips: any number of frames, with a prompt schedule ---------------------------------------
#
# `weights/tiny-live` (a causal, chunk-by-chunk video model) is trained on windows of long clips: a
# bouncing object that keeps bouncing for any number of frames, whose prompt (colour, and the shape if
# asked) changes at scheduled frames while the motion carries on. `weights/tiny-skyreels-df` (diffusion
# forcing) is trained on long clips of all 40 prompts: the straight motions wrap round the frame. The
# bounce is periodic (a perfectly elastic floor), so frame 2000 looks like frame 20; the parameters vary
# from clip to clip in narrow ranges, and a clip starts near the top of an arc, so that its first frames
# vary little.

#: Long bounces: the period in frames, the arc height as a fraction of the frame, the phase at frame 0
#: (0 = on the floor, 0.5 = the top of the arc), and the horizontal speed in pixels a frame (the object
#: turns back off the side margins).
LONG_PERIOD = (11.0, 13.0)
LONG_HEIGHT = (0.5, 0.6)
LONG_START_PHASE = (0.4, 0.6)
LONG_MAX_SPEED_X = 0.3
LONG_SIDE_MARGIN = 4.0
#: Long straight motions: pixels a frame along the named direction (16 frames cross 47-62% of the frame, as
#: the 16-frame clips do).
LONG_SPEED = (2.0, 2.5)


def long_bounce_track(frames: int, radius: float, rng: np.random.Generator, period_range=LONG_PERIOD,
                      height_range=LONG_HEIGHT) -> np.ndarray:
    """Centre positions (frames, 2) as (x, y) pixels of an object bouncing on parabolic arcs for `frames` frames.

    Every arc has the same height and period (a floor contact every `period` frames, whatever
    `frames` is; drawn from `period_range`, the height from `height_range` of the frame); the object drifts
    sideways slowly and turns back at `LONG_SIDE_MARGIN` pixels from the sides, so that any 16 frames drift at
    most `16 * LONG_MAX_SPEED_X` pixels. The fastest step, at a floor contact, is about 4 height / period."""
    t = np.arange(frames, dtype=np.float64)
    floor = rng.uniform(SIZE - radius - 4.0, SIZE - radius)              # centre height at contact (y grows down)
    height = min(rng.uniform(*height_range) * SIZE, floor - radius - 2.0)  # the top stays inside
    period = rng.uniform(*period_range)
    phase = (rng.uniform(*LONG_START_PHASE) + t / period) % 1.0           # 0 at every contact
    y = floor - 4.0 * height * phase * (1.0 - phase)
    lo, hi = radius + LONG_SIDE_MARGIN, SIZE - radius - LONG_SIDE_MARGIN
    start = SIZE / 2 + rng.uniform(-ACROSS_JITTER, ACROSS_JITTER) * 0.75
    unfolded = start - lo + rng.uniform(-LONG_MAX_SPEED_X, LONG_MAX_SPEED_X) * t   # reflect off [lo, hi]
    folded = np.mod(unfolded, 2 * (hi - lo))
    x = lo + np.where(folded > hi - lo, 2 * (hi - lo) - folded, folded)
    return np.stack([x, y], axis=1)


def long_straight_track(direction: str, frames: int, radius: float, rng: np.random.Generator) -> np.ndarray:
    """Centre positions (frames, 2) of an object moving in `direction` at a constant speed for `frames` frames.

    A straight motion cannot stay in the frame, so it wraps: the object leaves on one side and comes back in
    on the opposite one, like something on a conveyor; it is wholly out of sight at one position of the
    cycle (a cycle is SIZE + 2 radius pixels long). Across the motion it stays near the middle."""
    dx, dy = _DIRECTIONS[direction]
    cycle = SIZE + 2 * radius
    speed = rng.uniform(*LONG_SPEED)
    start = rng.uniform(0, cycle)
    along = np.mod(start + speed * np.arange(frames, dtype=np.float64), cycle) - radius     # (frames,)
    if dx + dy < 0:                                                                        # left / up
        along = SIZE - along
    across = np.full(frames, SIZE / 2 + rng.uniform(-ACROSS_JITTER, ACROSS_JITTER))
    return np.stack([along, across] if dx else [across, along], axis=1)


def normalise_schedule(prompt_schedule) -> list[tuple[int, str]]:
    """A prompt, or [(first_frame, prompt), ...] starting at frame 0 -> the sorted list, checked: every
    prompt in the vocabulary and all of one motion (a change of prompt changes colour or shape, the motion
    carries on)."""
    schedule = [(0, prompt_schedule)] if isinstance(prompt_schedule, str) else \
        sorted((int(f), p) for f, p in prompt_schedule)
    if not schedule or schedule[0][0] != 0:
        raise ValueError(f"a prompt schedule starts at frame 0; got {prompt_schedule!r}")
    motions = {parse_prompt(prompt)[2] for _, prompt in schedule}
    if len(motions) > 1:
        raise ValueError(f"a long clip keeps one motion; {prompt_schedule!r} has {sorted(motions)}")
    return schedule


def prompt_at(prompt_schedule, frame: int) -> str:
    """The prompt that `prompt_schedule` shows at `frame`."""
    current = None
    for first, prompt in normalise_schedule(prompt_schedule):
        if first <= frame:
            current = prompt
    return current


def render_long_clip(prompt_schedule, frames: int, rng: np.random.Generator, bounce: dict | None = None) -> np.ndarray:
    """A clip of any length: float32 (frames, 64, 64, 3) in [0, 1], drawn with `rng`.

    `prompt_schedule` is one prompt ("a red ball bouncing") or [(first_frame, prompt), ...] from frame 0,
    e.g. [(0, "a red ball bouncing"), (120, "a blue ball bouncing")]: from each first_frame on the object
    takes that prompt's colour and shape and keeps its motion. Bouncing is `long_bounce_track`; the
    straight motions are `long_straight_track` (the object wraps round the frame). `bounce` ({"period_range": ...,
    "height_range": ...}) sets the bounce's ranges instead of `LONG_PERIOD` and `LONG_HEIGHT`."""
    schedule = normalise_schedule(prompt_schedule)
    radius = rng.uniform(MIN_RADIUS, MAX_RADIUS)
    motion = parse_prompt(schedule[0][1])[2]
    track = long_bounce_track(frames, radius, rng, **(bounce or {})) if motion == "bouncing" else \
        long_straight_track(motion, frames, radius, rng)
    out = np.empty((frames, SIZE, SIZE, 3), dtype=np.float32)
    for index, (first, prompt) in enumerate(schedule):
        colour, shape, _ = parse_prompt(prompt)
        last = schedule[index + 1][0] if index + 1 < len(schedule) else frames
        for f in range(first, min(last, frames)):
            out[f] = draw_frame(tuple(track[f]), radius, shape, colour)
    return out
