"""`longserve bench TARGET`: every benchmark prints a table, and can write JSON and a plot.

Targets register here by module; each has `add_arguments(parser)` and `run(args)`.
"""

from __future__ import annotations

BENCH = "longserve.server.bench."
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


def add_arguments(parser) -> None:
    from longserve.server.cli import add_subcommands

    add_subcommands(parser, "target", BENCHES, "bench_fn")


def run(args) -> int:
    return args.bench_fn(args)
