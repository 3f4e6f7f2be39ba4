"""`make demo-live`: a 30-second live video of "a red ball bouncing" that switches to "a blue ball bouncing" at 15 s.

    python -m tools.live_demo [--model tiny-live] [--seconds 30] [--switch-at 15] -o out/demo_live.mp4 \\
        [--strip out/demo_live_strip.png] [--chunks-json out/demo_live_chunks.json] [--decoder vae|tiny|PATH] \
        [--workers N --live-loop serial|overlapped|pipelined|stages]

The switch is a prompt schedule (`VideoPipeline.stream([(0, red), (k, blue)])`): chunk k is the
first chunk that starts at or after `--switch-at` seconds, so the switch is deterministic.
Writes the MP4, a strip of frames around the switch (the README shows it), and per chunk its
first frame index, frame count and prompt index (what the content test checks).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

RED, BLUE = "a red ball bouncing", "a blue ball bouncing"


def chunk_starts(chunks: int, frames_per_block: int, temporal: int) -> list[int]:
    """The first frame of each chunk (the first latent frame is one frame, later ones `temporal`)."""
    return [0] + [1 + (c * frames_per_block - 1) * temporal for c in range(1, chunks)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-live")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--switch-at", type=float, default=15.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--strip", default=None, help="PNG of the frames around the switch")
    ap.add_argument("--chunks-json", default=None)
    ap.add_argument("--decoder", default="vae", help="vae (the model's VAE), tiny (its shipped small decoder) or "
                                                     "the path of a TAEHV weight file (engine/small_decoder.py)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--live-loop", default="serial", help="the engine's live loop (engine/config.py live_loop)")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from longserve.pipelines import VideoPipeline
    from longserve.pipelines.video import save_video

    with VideoPipeline.from_pretrained(args.model, decoder=args.decoder, workers=args.workers,
                                       live_loop=args.live_loop) as pipe:
        fps, temporal = pipe.defaults.fps, pipe.info.frame_multiple
        fb = pipe.info.capabilities.frames_per_chunk // temporal          # latent frames a chunk
        frames = int(round(args.seconds * fps))
        frames = (frames - 1) // temporal * temporal + 1
        latent = (frames - 1) // temporal + 1
        starts = chunk_starts(-(-latent // fb), fb, temporal)
        switch = next(c for c, s in enumerate(starts) if s >= args.switch_at * fps)
        chunks, out = [], []
        bar = tqdm(total=len(starts), unit="chunk", desc="live demo", file=sys.stderr)
        with bar:
            for i, part in enumerate(pipe.stream([(0, RED), (switch, BLUE)], num_frames=frames, seed=args.seed)):
                chunks.append({"chunk": i, "start": starts[i], "frames": len(part), "prompt_index": int(i >= switch)})
                out.append(part)
                bar.update()
    video = np.concatenate(out)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    save_video(video, args.output, fps=fps)
    print(f"{args.output}: {len(video)} frames at {fps} fps ({len(video) / fps:.1f} s), {len(chunks)} chunks, "
          f"switch to {BLUE!r} at chunk {switch} (frame {starts[switch]}, {starts[switch] / fps:.2f} s)")
    if args.chunks_json:
        Path(args.chunks_json).write_text(json.dumps({"fps": fps, "switch_chunk": switch, "chunks": chunks}, indent=1))
    if args.strip:
        from PIL import Image

        from tools.frame_strip import frame_strip

        s = starts[switch]
        around = (np.clip(video[max(0, s - 24):s + 24], 0, 1) * 255).round().astype(np.uint8)
        Image.fromarray(frame_strip(around, every=4, scale=2)).save(args.strip)
    return 0


if __name__ == "__main__":
    sys.exit(main())
