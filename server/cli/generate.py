"""`longserve generate "prompt" --model tiny-latte --workers 2 --frames 32 --size 64x64 --steps 20 --seed 0 -o out.mp4`"""

from __future__ import annotations

import sys
import time

from server.api.protocol import parse_size


def add_arguments(p) -> None:
    p.add_argument("prompt", help="what the video shows")
    p.add_argument("--model", default="tiny-latte",
                   help="a shipped model (tiny-latte, tiny-wan, ...) or a local diffusers checkpoint directory")
    p.add_argument("--workers", type=int, default=1, help="worker processes (one GPU each with CUDA)")
    p.add_argument("--parallel", default="auto",
                   help="auto | dsp | ulysses | ring | megatron-sp (Latte) | ulysses | ring | usp (Wan family)")
    p.add_argument("--ulysses-degree", type=int, default=None, help="usp: Ulysses group size (ring = workers / it)")
    p.add_argument("--cfg-parallel", action="store_true", help="run the two CFG halves on two worker groups")
    p.add_argument("--frames", type=int, default=None, help="number of frames (default: the model's)")
    p.add_argument("--size", default=None, help="WIDTHxHEIGHT in pixels (default: the model's)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--guidance-scale", type=float, default=None, help="(default: the model's)")
    p.add_argument("--negative-prompt", default="")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--fps", type=int, default=None, help="frames per second of the MP4 (default: the model's)")
    p.add_argument("--opt", action="append", default=[], metavar="NAME=VALUE",
                   help="a model-specific option, e.g. --opt guidance_scale_2=3 (Wan 2.2); repeatable")
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
    options = parse_options(args.opt)
    t0 = time.perf_counter()
    with VideoPipeline.from_pretrained(args.model, workers=args.workers, parallel=args.parallel,
                                       ulysses_degree=args.ulysses_degree, device=args.device, dtype=args.dtype,
                                       cfg_parallel=args.cfg_parallel, launcher=args.launcher) as pipe:
        loaded = time.perf_counter()
        info = pipe.info
        fps = args.fps or pipe.defaults["fps"]
        print(f"loaded {args.model} ({info['family']}) on {info['workers']} worker(s) ({info['device']}, "
              f"{info['dtype']}), parallel={info['plan'].describe()}, attention={info['attention']}", file=sys.stderr)
        bar = tqdm(total=args.steps, desc="denoising", unit="step", file=sys.stderr)

        def on_step(step: int, total: int) -> None:
            bar.total = total
            bar.update(step - bar.n)

        try:
            out = pipe(args.prompt, negative_prompt=args.negative_prompt, num_frames=args.frames,
                       height=height, width=width, num_inference_steps=args.steps,
                       guidance_scale=args.guidance_scale, seed=args.seed, callback=on_step, **options)
        finally:
            bar.close()
        out.save(args.output, fps=fps)
    T, H, W = out.frames.shape[1:4]
    t = out.timings
    print(f"wrote {args.output}: {T} frames {W}x{H} at {fps} fps")
    print(f"generation {t['wall_s']:.2f} s (transformer {t['transformer_s']:.2f} s, vae {t['vae_s']:.2f} s, "
          f"encode {t['encode_s']:.2f} s, pool overhead {t['overhead_s']:.2f} s); "
          f"model load {loaded - t0:.1f} s; total {time.perf_counter() - t0:.1f} s")
    return 0


def parse_options(items: list[str]) -> dict:
    """["guidance_scale_2=3", ...] -> {"guidance_scale_2": 3}: numbers and true/false read as such."""
    options = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--opt must look like NAME=VALUE; got {item!r}")
        value: object = text.strip()
        if text.strip().lower() in ("true", "false"):
            value = text.strip().lower() == "true"
        else:
            for parse in (int, float):
                try:
                    value = parse(text)
                    break
                except ValueError:
                    pass
        options[name.strip()] = value
    return options
