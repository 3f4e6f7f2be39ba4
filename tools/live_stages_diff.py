"""How far the stages live loop's stream batch moves a video from the serial loop's, and what it shows.

    python -m tools.live_stages_diff [--model tiny-live] [--chunks 20] [--switch-at 10] [--workers 2]
                                     [--stream-batch 2] [--seed 0] [--json OUT]

Makes one video of `--chunks` chunks, red until chunk `--switch-at` and blue from it (a prompt schedule, as `make
demo-live`), with the serial loop on one worker and with `--live-loop stages` on `--workers` workers, and reports the
frames' largest difference and PSNR (uint8 frames, peak 255), each chunk's colour (tests/support/content.py's
`describe`) in both, and the first blue chunk of each. docs/design.md ("The stages live loop") quotes its figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RED, BLUE = "a red ball bouncing", "a blue ball bouncing"


def make(model: str, chunks: int, switch_at: int, seed: int, **engine) -> list[np.ndarray]:
    """The video's chunks as uint8 (n, H, W, 3) frames."""
    from longserve.pipelines import VideoPipeline

    with VideoPipeline.from_pretrained(model, **engine) as pipe:
        temporal = pipe.info.frame_multiple
        fb = pipe.info.capabilities.frames_per_chunk // temporal
        frames = (chunks * fb - 1) * temporal + 1
        return [np.asarray(part * 255).round().astype(np.uint8) if part.dtype != np.uint8 else part
                for part in pipe.stream([(0, RED), (switch_at, BLUE)], num_frames=frames, seed=seed)]


def colours(video: list[np.ndarray]) -> list[str | None]:
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from content import describe

    return [describe(chunk).colour for chunk in video]


def compare(model: str = "tiny-live", chunks: int = 20, switch_at: int = 10, workers: int = 2,
            stream_batch: int | None = None, seed: int = 0) -> dict:
    serial = make(model, chunks, switch_at, seed, workers=1)
    stages = make(model, chunks, switch_at, seed, workers=workers, live_loop="stages", stream_batch=stream_batch)
    a, b = (np.concatenate(v).astype(np.float64) for v in (serial, stages))
    mse = float(((a - b) ** 2).mean())
    named = {"serial": colours(serial), "stages": colours(stages)}
    return {"model": model, "chunks": chunks, "switch_at": switch_at, "workers": workers,
            "stream_batch": stream_batch or workers, "max_abs": float(np.abs(a - b).max()),
            "mean_abs": float(np.abs(a - b).mean()),
            "psnr_db": math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse),
            "colours": named, "first_blue": {k: next((i for i, c in enumerate(v) if c == "blue"), None)
                                             for k, v in named.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-live")
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--switch-at", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--stream-batch", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    report = compare(args.model, args.chunks, args.switch_at, args.workers, args.stream_batch, args.seed)
    print(f"{report['model']}: {report['chunks']} chunks, stages on {report['workers']} workers, stream batch "
          f"{report['stream_batch']}, against the serial loop: max |diff| {report['max_abs']:.0f} / 255, mean "
          f"{report['mean_abs']:.2f}, PSNR {report['psnr_db']:.1f} dB; first blue chunk {report['first_blue']}")
    for k, v in report["colours"].items():
        print(f"  {k:7s} {' '.join(str(c) for c in v)}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
