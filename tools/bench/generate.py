"""`longserve bench generate`: seconds per video, and how much of it the worker pool costs.

    longserve bench generate --workers 1,2 [--configs tiny,bench] [--steps 10] [--runs 2] [--json out.json]

Models:
- `tiny`: the shipped `weights/tiny-latte` checkpoint, 16 frames at 64x64.
- `tiny-wan`: the shipped `weights/tiny-wan` checkpoint (a Wan 2.1-format model), 17 frames at 64x64.
- `bench`: the transformer of `longserve bench transformer --config bench` (8 heads x 48,
  4 block pairs, random weights) with tiny-latte's VAE, T5 and scheduler, assembled in a
  temporary Latte-format directory; 16 frames at 192x192 pixels (a 24x24 latent).

Each (model, workers) pair starts one `VideoPipeline`, makes one warm-up video, then
`--runs` timed videos (median reported). Per video, rank 0 of the workers times its own
compute: prompt encoding, the denoising steps (the parallel transformer, its collectives
and the scheduler step) and the VAE decode (its share of the frames, and the gather).
`overhead_s` is the wall time seen by the caller minus the transformer and VAE time:
what the pool adds (IPC of every step's job, result transfer, encoding), as issue 3 asks.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from tools.bench import util as benchutil

CONFIGS = {
    "tiny": dict(model="tiny-latte", frames=16, size=64),
    "tiny-wan": dict(model="tiny-wan", frames=17, size=64),
    "bench": dict(model=None, frames=16, size=192),
}


def add_arguments(parser) -> None:
    from longserve.engine.config import EngineConfig, add_cli_args

    parser.add_argument("--workers", default="1,2", help="worker counts, comma-separated")
    parser.add_argument("--configs", default="tiny,bench", help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=10, help="denoising steps per video")
    parser.add_argument("--runs", type=int, default=2, help="timed videos per point (after one warm-up)")
    parser.add_argument("--steps-per-job", default="1,8",
                        help="denoising steps one worker job may run, comma-separated (1: one pool job per step)")
    parser.add_argument("--json", default=None, metavar="PATH")
    # the engine's own options (--parallel, --device, --dtype, ...), as `longserve generate` has them
    add_cli_args(parser, EngineConfig, groups=("model",), exclude=("model", "workers"),
                 titles={"model": "engine options (every point)"})


def build_bench_checkpoint(out_dir: Path) -> Path:
    """tiny-latte with its transformer replaced by the transformer benchmark's model."""
    from longserve.weights import resolve_latte
    from tools.bench.transformer import CONFIGS as TRANSFORMER_CONFIGS
    from tools.bench.transformer import build_model

    src = resolve_latte("tiny-latte")
    shutil.copytree(src, out_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("transformer"))
    import json

    caption = json.loads((src / "text_encoder" / "config.json").read_text())["d_model"]
    cfg = dict(TRANSFORMER_CONFIGS["bench"], caption_channels=caption)
    build_model(cfg, seed=0).save_pretrained(out_dir / "transformer")
    return out_dir


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run(args) -> int:
    from longserve.engine.config import EngineConfig, from_cli_args
    from longserve.pipelines import VideoPipeline
    from longserve.pipelines.video import PIPELINE_DEFAULTS

    workers = benchutil.int_list(args.workers, "--workers")
    steps_per_job = benchutil.int_list(args.steps_per_job, "--steps-per-job")
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise ValueError(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="longserve-bench-") as tmp:
        for name in names:
            cfg = CONFIGS[name]
            model = cfg["model"] or str(build_bench_checkpoint(Path(tmp) / "bench-latte"))
            for n, per_job in ((n, k) for n in workers for k in steps_per_job):
                print(f"[{name}] {n} worker(s), up to {per_job} step(s) per job ...", file=sys.stderr)
                config = from_cli_args(EngineConfig, args, model=model, workers=n,
                                       **{**PIPELINE_DEFAULTS, "max_steps_per_job": per_job})
                with VideoPipeline.from_config(config) as pipe:
                    kw = dict(num_frames=cfg["frames"], height=cfg["size"], width=cfg["size"],
                              num_inference_steps=args.steps, guidance_scale=4.5, seed=0)
                    pipe("warm-up", **kw)
                    timings = [pipe("a red ball bouncing", **kw).timings for _ in range(args.runs)]
                    plan = pipe.info.plan.describe()
                med = {k: statistics.median(t[k] for t in timings) for k in timings[0]}
                overhead = med["wall_s"] - med["transformer_s"] - med["vae_s"]
                rows.append(dict(config=name, workers=n, plan=plan, steps_per_job=per_job, frames=cfg["frames"],
                                 size=cfg["size"], steps=args.steps,
                                 video_s=med["wall_s"], transformer_s=med["transformer_s"], vae_s=med["vae_s"],
                                 encode_s=med["encode_s"], overhead_s=overhead,
                                 overhead_per_step_ms=1000 * (overhead - med["encode_s"]) / args.steps,
                                 overhead_frac=overhead / med["wall_s"]))
    machine = benchutil.machine_info(args.device or ("cuda" if _cuda() else "cpu"))
    for r in rows:
        base = next(b for b in rows if b["config"] == r["config"] and b["workers"] == min(workers)
                    and b["steps_per_job"] == r["steps_per_job"])
        r["speedup"] = base["video_s"] / r["video_s"]
        r["machine"] = machine
    columns = [("config", "config"), ("workers", "workers"), ("steps / job", "steps_per_job"),
               ("s / video", "video_s", ".3f"),
               ("transformer s", "transformer_s", ".3f"), ("VAE s", "vae_s", ".3f"),
               ("encode s", "encode_s", ".4f"), ("pool overhead s", "overhead_s", ".4f"),
               ("overhead %", lambda r: 100 * r["overhead_frac"], ".1f"),
               ("overhead / step ms", "overhead_per_step_ms", ".2f"), ("speedup", "speedup", ".2f")]
    print(benchutil.text_table(rows, columns))
    print()
    print(benchutil.markdown_table(rows, columns))
    if args.json:
        benchutil.write_json(rows, args.json)
    return 0
