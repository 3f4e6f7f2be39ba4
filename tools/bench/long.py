"""`longserve bench long`: long video by diffusion forcing, segment by segment, against diffusers' one-shot pipeline.

    longserve bench long --workers 1,2,4 --segments 1,3,9 [--model tiny-skyreels-df] [--size 256x256] \\
        [--steps 10] [--json out.json] [--markdown docs/benchmarks.md]

For each segment count s the video has the frames that make s segments of the
checkpoint's `base_num_frames` overlapping by `overlap_history` (tiny-skyreels-df: 17 and 9
frames, so 17 + 8 (s - 1) frames). Rows, on the same checkpoint, prompt and seed:

- longserve, N workers (`VideoPipeline.stream`, the default plan): seconds for the video,
  seconds per segment, seconds to the first streamed frame (from the call to the first
  chunk); then, in a second run with the memory tracker on, the peak tensor memory per
  worker over the whole generation (engine/memory.py: CPU, live tensor storage counted by a
  TorchDispatchMode; CUDA, max_memory_allocated), largest over the workers;
- diffusers' `SkyReelsV2DiffusionForcingPipeline` in this process, one shot: seconds (the
  first frame exists only at the end) and peak tensor memory, measured the same way.

Memory runs are separate from timed runs because the tracker slows every op.
"""

from __future__ import annotations

import sys
import time

from tools.bench.util import (
    Column,
    int_list,
    load_average,
    machine_info,
    markdown_table,
    replace_markdown_section,
    text_table,
    write_json,
)

SECTION = "## Long video: diffusion forcing, segment by segment"
PROMPT = "a ship sailing along a coast at sunset"


def add_arguments(parser) -> None:
    from longserve.engine.config import EngineConfig, add_cli_args

    parser.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
    parser.add_argument("--segments", default="1,3,9", help="segment counts, comma-separated")
    parser.add_argument("--size", default="256x256",
                        help="WIDTHxHEIGHT in pixels (large enough that the video, not the 512-token prompt encoding, "
                             "sets the peak)")
    parser.add_argument("--steps", type=int, default=10, help="denoising steps per segment")
    parser.add_argument("--no-diffusers", action="store_true", help="skip diffusers' one-shot pipeline")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--markdown", default=None, metavar="PATH",
                        help=f"replace the section '{SECTION}' of this Markdown file with the table")
    # the engine's own options (--model: a diffusion-forcing checkpoint; --device, --dtype, ...)
    add_cli_args(parser, EngineConfig, groups=("model",), exclude=("workers",), defaults={"model": "tiny-skyreels-df"},
                 titles={"model": "engine options (every point)"})


def frames_for(segments: int, base: int, overlap: int, temporal: int = 4) -> int:
    """Pixel frames of a video that diffusion forcing makes in `segments` segments."""
    base_latent, overlap_latent = (base - 1) // temporal + 1, (overlap - 1) // temporal + 1
    latent = base_latent + (segments - 1) * (base_latent - overlap_latent)
    return 1 + (latent - 1) * temporal


def _longserve_rows(pipe, workers: int, plan: list[tuple[int, int]], kw: dict) -> list[dict]:
    from longserve.engine import worker

    rows = []
    pipe(PROMPT, num_frames=plan[0][1], **kw)                       # warm-up
    for segments, frames in plan:
        t0 = time.perf_counter()
        first = None
        got = 0
        for chunk in pipe.stream(PROMPT, num_frames=frames, **kw):
            first = first or time.perf_counter() - t0
            got += len(chunk)
        seconds = time.perf_counter() - t0
        assert got == frames, (got, frames)
        pipe.pool.run(worker.memory_start)
        for _ in pipe.stream(PROMPT, num_frames=frames, **kw):
            pass
        peaks = pipe.pool.run(worker.memory_stop)
        rows.append(dict(impl="longserve", workers=workers, segments=segments, frames=frames, seconds=seconds,
                         seconds_per_segment=seconds / segments, first_frame_s=first, peak_bytes=max(peaks),
                         peak_bytes_per_worker=peaks))
        _print(rows[-1])
    return rows


def _diffusers_rows(model_dir: str, plan: list[tuple[int, int]], kw: dict, options: dict) -> list[dict]:
    import torch
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    from longserve.engine.memory import PeakMemory

    pipe = SkyReelsV2DiffusionForcingPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    rows = []
    # with a VAE that does not compress time, diffusers makes num_frames + 1 frames (weights/README.md)
    fewer = 1 if pipe.vae_scale_factor_temporal == 1 else 0
    for segments, frames in plan:
        call = dict(prompt=PROMPT, num_frames=frames - fewer, height=kw["height"], width=kw["width"],
                    num_inference_steps=kw["num_inference_steps"], output_type="np", **options)
        t0 = time.perf_counter()
        pipe(generator=torch.Generator("cpu").manual_seed(0), **call)
        seconds = time.perf_counter() - t0
        with PeakMemory("cpu") as mem:
            pipe(generator=torch.Generator("cpu").manual_seed(0), **call)
        rows.append(dict(impl="diffusers (one shot)", workers=1, segments=segments, frames=frames, seconds=seconds,
                         seconds_per_segment=seconds / segments, first_frame_s=seconds, peak_bytes=mem.peak_bytes,
                         peak_bytes_per_worker=[mem.peak_bytes]))
        _print(rows[-1])
    return rows


def _print(r: dict) -> None:
    print(f"  {r['impl']:<20} workers={r['workers']} segments={r['segments']:>2} frames={r['frames']:>4}  "
          f"{r['seconds']:7.2f} s  first frame {r['first_frame_s']:6.2f} s  peak {r['peak_bytes'] / 2**20:7.2f} MiB",
          file=sys.stderr, flush=True)


COLUMNS = [
    Column("implementation", "impl"),
    Column("workers", "workers"),
    Column("segments", "segments"),
    Column("frames", "frames"),
    Column("s / video", "seconds", ".2f"),
    Column("s / segment", "seconds_per_segment", ".2f"),
    Column("s to first frame", "first_frame_s", ".2f"),
    Column("peak MiB / worker", lambda r: f"{r['peak_bytes'] / 2**20:.2f}"),
    Column("peak vs 1 segment", "peak_vs_one_segment", ".2f"),
]


def run(args) -> int:
    from longserve.engine.config import EngineConfig, from_cli_args
    from longserve.pipelines import VideoPipeline
    from longserve.pipelines.video import PIPELINE_DEFAULTS
    from longserve.server.api.protocol import parse_size
    from longserve.weights import resolve_model

    workers = int_list(args.workers, "--workers")
    segment_counts = int_list(args.segments, "--segments")
    width, height = parse_size(args.size)
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    model_dir = str(resolve_model(args.model))
    kw = dict(height=height, width=width, num_inference_steps=args.steps, seed=0)
    rows, load = [], load_average()
    for n in workers:
        config = from_cli_args(EngineConfig, args, model=model_dir, workers=n, **PIPELINE_DEFAULTS)
        with VideoPipeline.from_config(config) as pipe:
            if not pipe.info.capabilities.long_video or pipe.info.capabilities.live:
                raise ValueError(f"--model: {args.model} is not a long-video (diffusion forcing) checkpoint")
            d = pipe.defaults.options
            options = {k: d[k] for k in ("base_num_frames", "overlap_history", "ar_step", "causal_block_size")}
            plan = [(s, frames_for(s, d["base_num_frames"], d["overlap_history"])) for s in segment_counts]
            rows += _longserve_rows(pipe, n, plan, dict(kw, **options))
    if not args.no_diffusers:
        rows += _diffusers_rows(model_dir, plan, kw, options)
    import torch

    machine = machine_info(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for r in rows:
        one = next(b for b in rows if b["impl"] == r["impl"] and b["workers"] == r["workers"]
                   and b["segments"] == min(segment_counts))
        r.update(peak_vs_one_segment=r["peak_bytes"] / one["peak_bytes"], machine=machine, model=args.model,
                 size=args.size, steps_per_segment=args.steps, options=options, loadavg_before=load,
                 loadavg_after=load_average())
    print()
    print(text_table(rows, COLUMNS))
    table = markdown_table(rows, COLUMNS)
    print()
    print(table)
    if args.json:
        write_json(rows, args.json)
    if args.markdown:
        command = (f"longserve bench long --workers {args.workers} --segments {args.segments} --model {args.model} "
                   f"--size {args.size} --steps {args.steps}")
        body = (f"Measured with `{command}` on {machine['cpu']} ({machine['cores']} cores, {machine['device']}, "
                f"torch {machine['torch']}); load average before {load}.\n\n{table}")
        replace_markdown_section(args.markdown, SECTION, body)
    return 0
