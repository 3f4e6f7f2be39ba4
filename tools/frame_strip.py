"""A video's frames side by side in one PNG: what the README shows of `make demo`.

    python -m tools.frame_strip out/demo.mp4 -o docs/demo_strip.png [--every 2] [--scale 2]
    python -m tools.frame_strip out/demo-long.mp4 -o out/demo_long_strip.png --segments 17,9  # a frame a segment

Frames are taken every `--every` frames (or, with `--segments BASE,OVERLAP`, the first new frame of each
segment of a diffusion-forcing video of BASE frames a segment overlapping by OVERLAP, no temporal
compression), scaled up `--scale` times without smoothing (the pixels stay visible), and separated by a thin
white gap.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

GAP = 2  # pixels of white between frames, before scaling


def frame_strip(frames: np.ndarray, every: int = 1, scale: int = 1) -> np.ndarray:
    """uint8 (T, H, W, 3) -> uint8 (H*scale, n*(W+GAP)*scale - GAP*scale, 3), n = ceil(T / every)."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 (T, H, W, 3); got {frames.dtype} {frames.shape}")
    if every < 1 or scale < 1:
        raise ValueError(f"every and scale must be >= 1; got every={every}, scale={scale}")
    picked = frames[::every]                                                  # (n, H, W, 3)
    n, H, W, _ = picked.shape
    strip = np.full((H, n * (W + GAP) - GAP, 3), 255, dtype=np.uint8)
    for i, frame in enumerate(picked):
        strip[:, i * (W + GAP):i * (W + GAP) + W] = frame
    return strip.repeat(scale, axis=0).repeat(scale, axis=1)


def main(argv: list[str] | None = None) -> int:
    import imageio.v3 as iio

    ap = argparse.ArgumentParser(prog="python -m tools.frame_strip", description=__doc__.split("\n")[0])
    ap.add_argument("video", help="an MP4 (or anything imageio reads as frames)")
    ap.add_argument("-o", "--output", required=True, help="PNG to write")
    ap.add_argument("--every", type=int, default=1, help="take every n-th frame (default 1)")
    ap.add_argument("--scale", type=int, default=2, help="integer upscaling (default 2)")
    ap.add_argument("--segments", default=None, metavar="BASE,OVERLAP",
                    help="take the first new frame of each diffusion-forcing segment instead")
    args = ap.parse_args(argv)
    frames = iio.imread(args.video)
    if args.segments:
        from longserve.engine.families.skyreels_df import segment_frame_starts

        base, overlap = (int(x) for x in args.segments.split(","))
        frames = frames[segment_frame_starts(len(frames), base, overlap)]
    strip = frame_strip(frames, every=args.every, scale=args.scale)
    iio.imwrite(args.output, strip)
    print(f"wrote {args.output}: {len(frames[::args.every])} frames of {frames.shape[2]}x{frames.shape[1]}, "
          f"{strip.shape[1]}x{strip.shape[0]} pixels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
