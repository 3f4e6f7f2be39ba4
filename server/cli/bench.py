"""`longserve bench TARGET`: every benchmark prints a table, and can write JSON and a plot.

The benchmarks are development tools, not part of the installed package: they live in a clone's `tools/bench/`
(one module per target, each with `add_arguments(parser)` and `run(args)`), found beside this package's source (an
editable install, `pip install -e .`) or in the current directory. An installed wheel has none: `longserve bench`
then says where to get them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH = "tools.bench."
BENCHES = {
    "transformer": (BENCH + "transformer", "parallel plans on one DiT denoising step (Latte: DSP and baselines; "
                                                "Wan: Ulysses, Ring, USP)"),
    "generate": (BENCH + "generate", "seconds per video and worker-pool overhead"),
    "serve": (BENCH + "serve", "HTTP server throughput and latency under concurrency"),
    "score": (BENCH + "score", "LSS / ring long-text scoring: time, memory, bytes"),
    "vae": (BENCH + "vae", "Wan VAE decode across workers, chunk by chunk: peak memory per worker"),
    "gpu": (BENCH + "gpu", "one GPU: bf16 error, step time vs diffusers, SDPA backends, memory by video length"),
    "live": (BENCH + "live", "live video on a causal model: first fragment, frames/s, memory by chunks, "
                                  "prompt switch, vs diffusion forcing"),
    "live-latency": (BENCH + "live_latency", "a live session's engine -> painted latency in Chromium: fMP4 on the "
                                                  "WebSocket against WebRTC, in one run"),
    "speed": (BENCH + "speed", "opt-in speed levers (step caching) against exact: block evaluations, wall time, "
                                    "PSNR, recognition on the trained tiny-latte"),
    "long": (BENCH + "long", "long video by diffusion forcing: s/segment, first frame, peak memory vs diffusers"),
    "replicas": (BENCH + "replicas", "jobs per minute of 1 and 2 replicas on one PostgreSQL store, claim latency, "
                                          "failover after a SIGKILL"),
    "lora": (BENCH + "lora", "LoRA per request: step time with no adapter, one, and two different ones in a "
                                  "batch"),
}
NOT_HERE = ("longserve bench runs from a clone of the repository: the benchmarks are its tools/bench/ folder, not "
            "part of the installed package. Clone it, install it editable with the bench extra (pip install -e "
            "'.[bench]') and run `longserve bench ...` there (or from its root directory).")


def clone_root() -> Path | None:
    """The clone that holds tools/bench/: this package's own source tree (an editable install), else the current
    directory; None for an installed wheel run elsewhere."""
    import longserve

    for root in (Path(longserve.__file__).resolve().parents[1], Path.cwd()):
        if (root / "tools" / "bench" / "__init__.py").is_file():
            return root
    return None


def add_arguments(parser) -> None:
    from longserve.server.cli import add_subcommands

    root = clone_root()
    if root is None:
        parser.add_argument("target", nargs=argparse.REMAINDER, help="(the benchmarks need a clone: run it for how)")
        parser.set_defaults(bench_fn=not_here)
        return
    if str(root) not in sys.path:          # after the installed packages: the clone adds only its tools
        sys.path.append(str(root))
    add_subcommands(parser, "target", BENCHES, "bench_fn")


def not_here(args) -> int:
    print(NOT_HERE, file=sys.stderr)
    return 2


def run(args) -> int:
    return args.bench_fn(args)
