"""Evaluate a diffusion-forcing tiny-skyreels-df checkpoint over segments: every prompt of the 40-prompt vocabulary
at `make demo-long`'s settings, made by diffusers' `SkyReelsV2DiffusionForcingPipeline` in this process (the
engine's frames equal its frames: tests/pipelines/test_long_video.py; the demo's own video is checked by
tests/pipelines/test_long_content.py), read back segment by segment with the content helper; and the control
with `overlap_history` at its minimum (1 frame), whose boundary jumps are reported, not judged.

Usage::

    PYTHONPATH=.:tests/support python -m tools.weights.eval_tiny_skyreels_df [--model weights/tiny-skyreels-df]
        [--prompts all|demo] [--control bouncing|all|demo] [--seed 0] [--json out.json]

A prompt's video is recognised (`content.long_video_recognised`) when its colour is named in at least 90% of
the segments (each segment's new frames) and no boundary jump (the object's centroid from a segment's last
frame to the next segment's first new frame) is larger than the largest jump between two frames inside a
segment.
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
from tools.weights.prompts import PROMPTS

DEMO_PROMPT = "a red ball bouncing"
#: `make demo-long`'s settings beyond the checkpoint's generation_defaults.json (tests/pipelines/test_long_content.py
#: checks that the Makefile passes these)
DEMO_FRAMES = 89                                  # 10 segments of 17 frames overlapping by 9
CONTROL_OVERLAP = 1                               # overlap_history's minimum


def demo_settings(model_dir: Path) -> dict:
    from longserve.weights import generation_defaults

    d = dict(generation_defaults(model_dir), num_frames=DEMO_FRAMES)
    return {k: d[k] for k in ("height", "width", "num_frames", "base_num_frames", "overlap_history", "ar_step",
                              "causal_block_size", "addnoise_condition", "num_inference_steps", "guidance_scale",
                              "fps")}


def load(model_dir: Path):
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    pipe = SkyReelsV2DiffusionForcingPipeline.from_pretrained(str(model_dir))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def make(pipe, prompt: str, settings: dict, seed: int) -> np.ndarray:
    """(T, H, W, 3) float in [0, 1]. diffusers is asked for num_frames - 1: given a VAE without temporal compression
    its 4k+1 rounding adds a frame to any count (weights/README.md, "Things to know")."""
    call = dict(settings, num_frames=settings["num_frames"] - 1)
    video = pipe(prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **call).frames[0]
    assert len(video) == settings["num_frames"], video.shape
    return video


def judge(video: np.ndarray, prompt: str, settings: dict) -> dict:
    from content import describe_segments, segment_starts

    starts = segment_starts(len(video), settings["base_num_frames"], settings["overlap_history"])
    r = describe_segments(video, starts, prompt)
    return {"prompt": prompt, "segments": len(starts), "colour_rate": r.colour_rate,
            "colours": "".join((c or "-")[0] for c in r.colours), "continuous": r.continuous,
            "recognised": r.colour_rate >= 0.9 and r.continuous,
            "largest_inside_jump": round(r.largest_inside_jump, 2),
            "median_inside_jump": round(r.median_inside_jump, 2),
            "largest_boundary_jump": round(r.largest_boundary_jump, 2),
            "largest_jump_of_width": round(r.largest_jump / video.shape[2], 3),
            "frames_not_one_object": r.frames_not_one_object,
            "frames_not_one_object_count": len(r.frames_not_one_object),
            "boundary_jumps": [round(j, 2) for j in r.boundary_jumps],
            "largest_inside_acceleration": round(r.largest_inside_acceleration, 2),
            "boundary_accelerations": [round(a, 2) for a in r.boundary_accelerations]}


def _ratios(results: list[dict]) -> dict:
    """Median over videos of (largest boundary jump) / (largest jump inside a segment), and the largest."""
    r = [x["largest_boundary_jump"] / x["largest_inside_jump"] for x in results
         if x["largest_inside_jump"] > 0 and not np.isnan(x["largest_boundary_jump"])]
    return {"median": round(float(np.median(r)), 3), "max": round(float(np.max(r)), 3)} if r else {}


def _median(results: list[dict], key: str) -> float | None:
    values = [v for r in results for v in (r[key] if isinstance(r[key], list) else [r[key]]) if not np.isnan(v)]
    return round(float(np.median(values)), 2) if values else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.weights.eval_tiny_skyreels_df",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(TINY_MODELS["tiny-skyreels-df"]))
    ap.add_argument("--prompts", choices=("all", "demo"), default="all")
    ap.add_argument("--control", choices=("bouncing", "all", "demo"), default="bouncing",
                    help="prompts of the overlap_history=1 control (default: the 8 bouncing ones)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every result here")
    ap.add_argument("--steps", type=int, default=None, help="num_inference_steps (default: the checkpoint's)")
    ap.add_argument("--guidance", type=float, default=None, help="guidance_scale (default: the checkpoint's)")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    model = Path(args.model)
    settings = demo_settings(model)
    if args.steps is not None:
        settings["num_inference_steps"] = args.steps
    if args.guidance is not None:
        settings["guidance_scale"] = args.guidance
    print(json.dumps({"settings": settings}), flush=True)
    prompts = list(PROMPTS) if args.prompts == "all" else [DEMO_PROMPT]
    control_prompts = {"all": list(PROMPTS), "demo": [DEMO_PROMPT],
                       "bouncing": [p for p in PROMPTS if p.endswith("bouncing")]}[args.control]
    results, controls = [], []
    t0 = time.perf_counter()
    control = dict(settings, overlap_history=CONTROL_OVERLAP)
    pipe = load(model)
    for prompt in prompts:
        results.append(judge(make(pipe, prompt, settings, args.seed), prompt, settings))
        print(json.dumps(results[-1]), flush=True)
    for prompt in control_prompts:
        controls.append(judge(make(pipe, prompt, control, args.seed), prompt, control))
        print(json.dumps({"control": controls[-1]}), flush=True)
    summary = {
        "prompts": len(results), "rate": float(np.mean([r["recognised"] for r in results])),
        "colour_ok": float(np.mean([r["colour_rate"] >= 0.9 for r in results])),
        "continuous": float(np.mean([r["continuous"] for r in results])),
        "control_overlap": CONTROL_OVERLAP, "control_prompts": len(controls),
        "largest_boundary_vs_inside": _ratios(results), "control_largest_boundary_vs_inside": _ratios(controls),
        "control_continuous": float(np.mean([r["continuous"] for r in controls])),
        "control_colour_ok": float(np.mean([r["colour_rate"] >= 0.9 for r in controls])),
        # smoothness inside segments (the rendered clips: at most 13 px a frame), and the velocity change at the
        # boundaries (a segment that forgets the motion turns there: what the control should show)
        "largest_inside_jump_median": _median(results, "largest_inside_jump"),
        "control_largest_inside_jump_median": _median(controls, "largest_inside_jump"),
        "boundary_acceleration_median": _median(results, "boundary_accelerations"),
        "control_boundary_acceleration_median": _median(controls, "boundary_accelerations"),
        "inside_acceleration_median": _median(results, "largest_inside_acceleration"),
        "misses": [r["prompt"] for r in results if not r["recognised"]],
        # issue 45: the object in one piece in every frame, and its largest step between two frames (of the width)
        "one_object_every_frame": float(np.mean([not r["frames_not_one_object"] for r in results])),
        "frames_not_one_object_median": _median(results, "frames_not_one_object_count"),
        "largest_jump_of_width_median": _median(results, "largest_jump_of_width"),
        "largest_jump_at_most_quarter": float(np.mean([r["largest_jump_of_width"] <= 0.25 for r in results])),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings, "summary": summary, "results": results,
                                               "control": controls}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
