"""`longserve generate "prompt" --model tiny-latte --workers 2 --frames 32 --size 64x64 --steps 20 --seed 0 -o out.mp4`"""

from __future__ import annotations

import sys
import time

from server.api.protocol import parse_size


def add_arguments(p) -> None:
    p.add_argument("prompt", help="what the video shows")
    p.add_argument("--model", default="tiny-latte", help="tiny-latte, or a local Latte-format diffusers directory")
    p.add_argument("--workers", type=int, default=1, help="worker processes (one GPU each with CUDA)")
    p.add_argument("--parallel", default="dsp", help="dsp | ulysses | ring | megatron-sp")
    p.add_argument("--cfg-parallel", action="store_true", help="run the two CFG halves on two worker groups")
    p.add_argument("--frames", type=int, default=None, help="number of frames (default: the model's video_length)")
    p.add_argument("--size", default=None, help="WIDTHxHEIGHT in pixels (default: the model's sample size)")
    p.add_argument("--steps", type=int, default=50, help="denoising steps")
    p.add_argument("--guidance-scale", type=float, default=7.5)
    p.add_argument("--negative-prompt", default="")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--fps", type=int, default=8)
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--launcher", default="auto", choices=["auto", "local", "torchrun"],
                   help="local: start --workers processes; torchrun: join the group torchrun started "
                        "(auto: torchrun when launched by it)")
    p.add_argument("-o", "--output", default="out.mp4", help="MP4 path to write")


def run(args) -> int:
    from tqdm import tqdm

    from pipelines import VideoPipeline

    width = height = None
    if args.size is not None:
        width, height = parse_size(args.size)
    t0 = time.perf_counter()
    with VideoPipeline.from_pretrained(args.model, workers=args.workers, parallel=args.parallel,
                                       device=args.device, dtype=args.dtype,
                                       cfg_parallel=args.cfg_parallel, launcher=args.launcher) as pipe:
        loaded = time.perf_counter()
        info = pipe.info
        print(f"loaded {args.model} on {info['workers']} worker(s) ({info['device']}, {info['dtype']}), "
              f"parallel={info['strategy']}, attention={info['attention']}", file=sys.stderr)
        bar = tqdm(total=args.steps, desc="denoising", unit="step", file=sys.stderr)

        def on_step(step: int, total: int) -> None:
            bar.total = total
            bar.update(step - bar.n)

        try:
            out = pipe(args.prompt, negative_prompt=args.negative_prompt, num_frames=args.frames,
                       height=height, width=width, num_inference_steps=args.steps,
                       guidance_scale=args.guidance_scale, seed=args.seed, callback=on_step)
        finally:
            bar.close()
        out.save(args.output, fps=args.fps)
    T, H, W = out.frames.shape[1:4]
    t = out.timings
    print(f"wrote {args.output}: {T} frames {W}x{H} at {args.fps} fps")
    print(f"generation {t['wall_s']:.2f} s (transformer {t['transformer_s']:.2f} s, vae {t['vae_s']:.2f} s, "
          f"encode {t['encode_s']:.2f} s, pool overhead {t['overhead_s']:.2f} s); "
          f"model load {loaded - t0:.1f} s; total {time.perf_counter() - t0:.1f} s")
    return 0
