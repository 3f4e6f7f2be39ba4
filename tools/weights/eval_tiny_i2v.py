"""Evaluate an image-to-video tiny-i2v checkpoint: every prompt of the 40-prompt vocabulary, continued from the first
frame of a clip the training never saw (`render_long_clip` with another seed; the object wholly inside), at the
checkpoint's defaults, made by diffusers' `WanImageToVideoPipeline` in this process (the engine's frames equal its
frames: tests/pipelines/test_i2v_content.py), read back with the content helper.

Usage::

    PYTHONPATH=.:tests/support python -m tools.weights.eval_tiny_i2v [--model weights/tiny-i2v] [--seed 0]
        [--clip-seed 1000] [--json out.json]

Per prompt: the colour the helper names (right or not); the start, the object's centroid in the first frame against
the image's (within `START_TOLERANCE` pixels); and the motion: for the straight motions, the net displacement along
the prompt's direction (at least `MIN_MOVE` pixels, the displacement across it at most half of that, the object
found in every frame and never more than `MAX_STEP` pixels from one frame to the next); for
bouncing, whether the object falls by at least `MIN_MOVE` pixels (the clips start near the top of an arc, and 9
frames at 8 fps are most of a fall).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from longserve.weights.registry import TINY_MODELS
from tools.weights.prompts import PROMPTS, parse_prompt

START_TOLERANCE = 3.0
MIN_MOVE = 8.0
MAX_STEP = 6.0                  # pixels between two frames: the clips move 2-2.5 a frame; more is a jump
_DIRECTIONS = {"moving right": (1.0, 0.0), "moving left": (-1.0, 0.0), "moving up": (0.0, -1.0),
               "moving down": (0.0, 1.0)}


def judge(video: np.ndarray, first: np.ndarray, prompt: str) -> dict:
    from content import centroid_track, describe, object_mask

    colour, _, motion = parse_prompt(prompt)
    d = describe(video)
    start = centroid_track(object_mask(first[None]))[0]
    track = d.track[~np.isnan(d.track).any(axis=1)]
    found = len(track) >= 2 and not np.isnan(d.track[0]).any()
    start_ok = found and float(np.abs(d.track[0] - start).max()) <= START_TOLERANCE
    if not found:
        moved = False
    elif motion == "bouncing":
        moved = float(track[:, 1].max() - track[0, 1]) >= MIN_MOVE
    else:
        net = track[-1] - track[0]
        along = float(net @ np.array(_DIRECTIONS[motion]))
        across = abs(float(net @ np.array(_DIRECTIONS[motion][::-1])))
        steps = np.linalg.norm(np.diff(d.track, axis=0), axis=1)          # NaN next to a frame without the object
        moved = along >= MIN_MOVE and across <= 0.5 * along and bool((steps <= MAX_STEP).all())
    return {"prompt": prompt, "colour": d.colour, "colour_ok": d.colour == colour, "start_ok": bool(start_ok),
            "moved_ok": bool(moved), "track": np.round(d.track, 1).tolist()}


def evaluate(model_dir: Path, seed: int = 0, clip_seed: int = 1000, prompts=PROMPTS) -> dict:
    from content import centroid_track, object_mask
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    from longserve.weights import generation_defaults
    from tools.weights.clips import render_long_clip

    pipe = WanImageToVideoPipeline.from_pretrained(str(model_dir))
    pipe.set_progress_bar_config(disable=True)
    d = generation_defaults(model_dir)
    rng = np.random.default_rng(clip_seed)
    rows = []
    t0 = time.perf_counter()
    for prompt in prompts:
        while True:                 # a first frame with the object wholly inside (a straight motion's clip wraps)
            first = render_long_clip(prompt, 1, rng)[0]
            x, y = centroid_track(object_mask(first[None]))[0]
            if 12 <= x <= 52 and 12 <= y <= 52:
                break
        image = Image.fromarray(np.round(first * 255).astype(np.uint8))
        # diffusers rounds num_frames up by one for a VAE without temporal compression (weights/README.md)
        video = pipe(prompt=prompt, image=image, height=d["height"], width=d["width"], num_frames=d["num_frames"] - 1,
                     num_inference_steps=d["num_inference_steps"], guidance_scale=d["guidance_scale"],
                     generator=torch.Generator("cpu").manual_seed(seed), output_type="np").frames[0]
        rows.append(judge(video, first, prompt))
    n = len(rows)
    summary = {key: sum(r[f"{key}_ok"] for r in rows) for key in ("colour", "start", "moved")}
    summary["all"] = sum(r["colour_ok"] and r["start_ok"] and r["moved_ok"] for r in rows)
    return {"model": str(model_dir), "seed": seed, "clip_seed": clip_seed, "prompts": n, "settings": d,
            "counts": summary, "seconds": round(time.perf_counter() - t0, 1), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.weights.eval_tiny_i2v", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(TINY_MODELS["tiny-i2v"]))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clip-seed", type=int, default=1000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    result = evaluate(Path(args.model), args.seed, args.clip_seed)
    for r in result["rows"]:
        marks = "".join("+" if r[f"{k}_ok"] else "-" for k in ("colour", "start", "moved"))
        print(f"{marks}  {r['prompt']}")
    print(json.dumps({k: result[k] for k in ("prompts", "counts", "seconds")}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
