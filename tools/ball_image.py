"""A first frame for the image-to-video demo: one ball of the procedural clips' kind on their grey.

    python -m tools.ball_image red --x 16 --y 32 -o out/red_ball.png     # `make demo-i2v`'s image

The ball is drawn as `tools.weights.clips` draws it (antialiased, on `BACKGROUND`), 64x64, radius 7.5 pixels by
default; `weights/tiny-i2v` continues such a frame as its prompt's motion.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from tools.weights.clips import SIZE, draw_frame
from tools.weights.prompts import PALETTE


def ball_image(colour: str, x: float, y: float, radius: float = 7.5, shape: str = "ball") -> np.ndarray:
    """uint8 (64, 64, 3): one `colour` ball (or square) centred at (x, y) pixels."""
    if colour not in PALETTE:
        raise ValueError(f"colour must be one of {', '.join(PALETTE)}; got {colour!r}")
    return np.round(draw_frame((x, y), radius, shape, colour) * 255).astype(np.uint8)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.ball_image", description=__doc__.split("\n")[0])
    ap.add_argument("colour", choices=tuple(PALETTE))
    ap.add_argument("--x", type=float, default=16.0, help="centre, pixels from the left (default 16)")
    ap.add_argument("--y", type=float, default=SIZE / 2, help="centre, pixels from the top (default 32)")
    ap.add_argument("--radius", type=float, default=7.5)
    ap.add_argument("--shape", choices=("ball", "square"), default="ball")
    ap.add_argument("-o", "--output", required=True, help="the PNG to write")
    args = ap.parse_args(argv)
    import PIL.Image

    PIL.Image.fromarray(ball_image(args.colour, args.x, args.y, args.radius, args.shape)).save(args.output)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
