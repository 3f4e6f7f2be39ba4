"""`longserve serve --model tiny-latte --workers 2 --host 127.0.0.1 --port 8000`: the OpenAI-compatible server.

See docs/serving.md for the API, the scheduler and the deployment (Dockerfile).
"""

from __future__ import annotations

import logging
import os
import signal
import sys


def add_arguments(p) -> None:
    g = p.add_argument_group("model and workers")
    g.add_argument("--model", default="tiny-latte",
                   help="a shipped model (tiny-latte, tiny-wan, ...) or a local diffusers checkpoint directory")
    g.add_argument("--served-model-name", default=None, help="the model id clients use (default: the directory name)")
    g.add_argument("--workers", type=int, default=1, help="worker processes (one GPU each with CUDA)")
    g.add_argument("--parallel", default="auto",
                   help="auto | dsp | ulysses | ring | megatron-sp (Latte) | ulysses | ring | usp (Wan family)")
    g.add_argument("--ulysses-degree", type=int, default=None, help="usp: Ulysses group size (ring = workers / it)")
    g.add_argument("--cfg-parallel", action="store_true", help="run the two CFG halves on two worker groups")
    g.add_argument("--device", default=None, choices=["cpu", "cuda"])
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    g.add_argument("--attention", default="auto", choices=["auto", "sdpa", "xformers"])
    g.add_argument("--vae-tiling", action="store_true",
                   help="decode in the VAE's spatial tiles (diffusers' enable_tiling, default tile sizes): less VAE "
                        "memory per worker, one Wan video's tiles spread over the workers; slower on one GPU")

    g = p.add_argument_group("HTTP")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("LONGSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $LONGSERVE_API_KEY; none = open)")
    g.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body (413 beyond)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    g = p.add_argument_group("jobs and scheduling")
    g.add_argument("--data-dir", default="longserve-data",
                   help="SQLite job store and video files (kept across restarts)")
    g.add_argument("--max-queue", type=int, default=256, help="most queued videos (429 beyond)")
    g.add_argument("--max-batch", type=int, default=8, help="most requests in one denoising step")
    g.add_argument("--max-running", type=int, default=None,
                   help="most admitted requests (latents held by the workers); default --max-batch")
    g.add_argument("--decode-chunk-frames", type=int, default=8, help="frames per VAE decode call (and MP4 fragment)")
    g.add_argument("--job-timeout", type=float, default=600.0,
                   help="a worker call taking longer fails its batch and restarts the pool (seconds)")
    g.add_argument("--oom-retry", action="store_true",
                   help="when a batch runs out of memory, run its requests again one at a time instead of failing them")

    g = p.add_argument_group("request limits and defaults (limits default from the model)")
    g.add_argument("--max-frames", type=int, default=None,
                   help="longest video in frames (default: 4 x the model's default frame count; for a long-video "
                        "model, --max-seconds at its fps)")
    g.add_argument("--max-seconds", type=float, default=60.0,
                   help="longest video of a long-video (diffusion forcing) model, in seconds at its fps")
    g.add_argument("--max-size", type=int, default=None,
                   help="largest width or height in pixels; default: 2 x the model's native size")
    g.add_argument("--max-steps", type=int, default=200)
    g.add_argument("--default-steps", type=int, default=20, help="num_inference_steps when a request gives none")
    g.add_argument("--guidance-scale", type=float, default=None,
                   help="guidance_scale when a request gives none (default: the model's)")
    g.add_argument("--fps", type=int, default=None, help="frames per second: seconds x fps = frames (default: the model's)")

    g = p.add_argument_group("scoring (POST /v1/score)")
    g.add_argument("--score-model", default="tiny-lm",
                   help="causal LM for /v1/score (tiny-lm or a local directory); 'none' disables scoring")
    g.add_argument("--score-workers", type=int, default=1)
    g.add_argument("--score-strategy", default="lss", help="lss | ring")
    g.add_argument("--score-preload", action="store_true", help="start the scoring pool now, not on first use")


def build(args):
    """(video service, score service or None, app) from parsed arguments; the video workers are started."""
    from server.api.app import create_app
    from server.api.score_service import ScoreService
    from server.api.service import ServeConfig, VideoService

    config = ServeConfig(
        model=args.model, served_model_name=args.served_model_name, workers=args.workers, parallel=args.parallel,
        ulysses_degree=args.ulysses_degree, device=args.device, dtype=args.dtype, cfg_parallel=args.cfg_parallel, attention=args.attention,
        vae_tiling=args.vae_tiling, data_dir=args.data_dir, max_queue=args.max_queue, max_batch=args.max_batch, max_running=args.max_running,
        max_frames=args.max_frames, max_seconds=args.max_seconds, max_size=args.max_size, max_steps=args.max_steps,
        default_steps=args.default_steps, default_guidance_scale=args.guidance_scale, fps=args.fps,
        decode_chunk_frames=args.decode_chunk_frames, job_timeout_s=args.job_timeout,
        oom_retry=args.oom_retry)
    videos = VideoService(config).start()
    score = None
    if args.score_model and args.score_model.lower() != "none":
        score = ScoreService(args.score_model, workers=args.score_workers, strategy=args.score_strategy,
                             device=args.device)
        if args.score_preload:
            score.load()
    app = create_app(videos, score, api_key=args.api_key, max_body_bytes=args.max_body_bytes)
    return videos, score, app


def run(args) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"loading {args.model} on {args.workers} worker(s), parallel={args.parallel} ...", file=sys.stderr)
    videos, score, app = build(args)
    lim = videos.limits
    print(f"serving {videos.model_name} on http://{args.host}:{args.port} (data in {args.data_dir}; "
          f"max batch {args.max_batch}; frames <= {lim.max_frames}, sides <= {lim.max_size} px, "
          f"steps <= {lim.max_steps})", file=sys.stderr, flush=True)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal: make that an orderly exit
    # so the workers and the job store are closed below (instead of dying of the default action)
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="off",
                    timeout_graceful_shutdown=5)  # open SSE streams must not hold the shutdown
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        videos.close()
        if score is not None:
            score.close()
    return 0


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)
