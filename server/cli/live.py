"""`longserve live "a red ball bouncing" --switch-at 15 "a blue ball bouncing" --seconds 30 -o live.mp4`: a live
video on a causal model (tiny-live, Self-Forcing / LongLive checkpoints) written to an MP4 as its chunks come.

The prompt switches are a schedule (`VideoPipeline.stream([(0, first), (k, second), ...])`): each `--switch-at
SECONDS PROMPT` applies from the first chunk that starts at or after SECONDS, so the video is the same on every
run with the same seed; the KV window is recomputed under the new prompt, as LongLive does. The file is written
as chunks are made (a playable file of what was made so far if interrupted), like `longserve generate`'s.
"""

from __future__ import annotations

import os
import sys

import numpy as np


def add_arguments(p) -> None:
    from longserve.engine.config import EngineConfig, add_cli_args

    p.add_argument("prompt", help="what the video shows first")
    g = p.add_argument_group("the live video")
    g.add_argument("--switch-at", nargs=2, action="append", default=[], metavar=("SECONDS", "PROMPT"),
                   help="from the first chunk at or after SECONDS, the prompt is PROMPT; repeatable")
    g.add_argument("--seconds", type=float, default=10.0, help="the video's length (default: 10)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("-o", "--output", default="live.mp4", help="MP4 path to write (default: live.mp4); an existing "
                                                              "file is refused unless --overwrite is given")
    g.add_argument("--overwrite", action="store_true", help="replace the --output file if it exists")
    add_cli_args(p, EngineConfig, groups=("model",), titles={"model": "model and workers"},
                 defaults={"model": "tiny-live"})


def switches(args) -> list[tuple[float, str]]:
    """[(seconds, prompt), ...] in time order; ValueError naming --switch-at."""
    out = []
    for when, prompt in args.switch_at:
        try:
            t = float(when)
        except ValueError:
            raise ValueError(f"--switch-at: {when!r} is not a number of seconds") from None
        if not 0 < t < args.seconds:
            raise ValueError(f"--switch-at {when}: must be inside the video (0, {args.seconds:g}) s")
        if not prompt.strip():
            raise ValueError("--switch-at: the prompt is empty")
        out.append((t, prompt))
    return sorted(out)


def check(args) -> None:
    """Refused before the fork server and the load (ValueError naming the flag)."""
    if not args.seconds > 0:
        raise ValueError(f"--seconds must be positive; got {args.seconds}")
    switches(args)
    if os.path.isdir(args.output):
        raise ValueError(f"--output: {args.output} is a directory")
    if os.path.exists(args.output) and not args.overwrite:
        raise ValueError(f"--output: {args.output} exists (give --overwrite to replace it, or another -o path)")


def chunk_starts(chunks: int, latent_per_chunk: int, temporal: int) -> list[int]:
    """The first frame of each chunk (the first latent frame is one frame, later ones `temporal`)."""
    return [0] + [1 + (c * latent_per_chunk - 1) * temporal for c in range(1, chunks)]


def run(args) -> int:
    from tqdm import tqdm

    from longserve.engine.config import EngineConfig, from_cli_args
    from longserve.pipelines import VideoPipeline
    from longserve.server.media import FragmentedMP4Writer

    check(args)
    config = from_cli_args(EngineConfig, args)
    with VideoPipeline.from_config(config) as pipe:
        caps = pipe.info.capabilities
        if not caps.live:
            raise ValueError(f"--model: {args.model} is not a causal (live) model; `longserve live` needs one, e.g. "
                             f"tiny-live")
        fps, temporal = pipe.defaults.fps, pipe.info.frame_multiple
        per_chunk = caps.frames_per_chunk // temporal                 # latent frames a chunk
        frames = (int(round(args.seconds * fps)) - 1) // temporal * temporal + 1
        latent = (frames - 1) // temporal + 1
        starts = chunk_starts(-(-latent // per_chunk), per_chunk, temporal)
        schedule = [(0, args.prompt)]
        for t, prompt in switches(args):
            chunk = next((c for c, s in enumerate(starts) if s >= t * fps), None)
            if chunk is not None:
                schedule.append((chunk, prompt))
                print(f"switch to {prompt!r} at chunk {chunk} ({starts[chunk] / fps:.2f} s)", file=sys.stderr)
        print(f"writing {os.path.abspath(args.output)}: {frames} frames at {fps} fps, {len(starts)} chunks",
              file=sys.stderr)
        writer, made = None, 0
        try:
            with tqdm(total=len(starts), unit="chunk", desc="live", file=sys.stderr) as bar:
                for part in pipe.stream(schedule, num_frames=frames, seed=args.seed):
                    pixels = (np.clip(part, 0, 1) * 255).round().astype(np.uint8)
                    if writer is None:
                        writer = FragmentedMP4Writer(args.output, args.output, pixels.shape[2], pixels.shape[1], fps,
                                                     keyframe_interval=fps)
                    writer.write(pixels)
                    made += len(pixels)
                    bar.update()
        finally:
            if writer is not None:
                writer.finish()
                writer.done.wait(120)
        if writer is None or not writer.ok:
            raise RuntimeError(f"writing {args.output} failed: {writer.error if writer else 'no frames'}")
    print(f"wrote {args.output}: {made} frames {writer.width}x{writer.height} at {fps} fps "
          f"({made / fps:.1f} s, {len(schedule)} prompt(s))")
    return 0
