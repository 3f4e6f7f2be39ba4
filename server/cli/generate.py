"""`longserve generate "prompt" --model tiny-latte --workers 2 --frames 32 --size 64x64 --steps 20 --seed 0 -o out.mp4`

Long video (a diffusion-forcing checkpoint)::

    longserve generate "a ship at sea" --model tiny-skyreels-df --frames 481 --base-frames 97 --overlap 17 \\
        --ar-step 5 --causal-block 5 -o long.mp4

Image-to-video (a WanImageToVideoPipeline checkpoint, or a diffusion-forcing one for a long video)::

    longserve generate "the cat walks away" --model tiny-wan-i2v --image cat.png [--last-image end.png] -o cat.mp4

Video extension (a diffusion-forcing checkpoint): the output is the whole extended video, the input's frames
first; --frames counts the frames the model makes, the first --overlap of which re-make the input's end, so
the video grows by frames - overlap::

    longserve generate "the ship sails on" --model tiny-skyreels-df --video ship.mp4 --frames 25 -o longer.mp4

The MP4 is written while the video is generated: every chunk of final frames (a long
video's segment) is encoded into a fragmented MP4 at once, so an interrupted run leaves a
playable file of the frames made so far. A tqdm bar counts every denoising step (of every
segment).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from longserve.server.api.protocol import parse_size

#: diffusion forcing's options, as flags (the names diffusers gives them in the comments)
LONG_VIDEO_FLAGS = {"base_frames": "base_num_frames", "overlap": "overlap_history", "ar_step": "ar_step",
                    "causal_block": "causal_block_size", "addnoise": "addnoise_condition"}


def add_arguments(p) -> None:
    from longserve.engine.config import EngineConfig, add_cli_args

    p.add_argument("prompt", help="what the video shows")
    g = p.add_argument_group("the video")
    g.add_argument("--frames", type=int, default=None, help="number of frames (default: the model's)")
    g.add_argument("--seconds", type=float, default=None, help="the length instead of --frames, at --fps (the "
                                                               "nearest frame count the model makes; with --video, "
                                                               "the seconds added)")
    g.add_argument("--size", default=None, help="WIDTHxHEIGHT in pixels (default: the model's)")
    g.add_argument("--steps", type=int, default=None, help="denoising steps (of each segment; default: "
                                                           "--default-steps, else the model's)")
    g.add_argument("--guidance-scale", type=float, default=None, help="(default: --default-guidance-scale, else the "
                                                                      "model's)")
    g.add_argument("--negative-prompt", default="")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--fps", type=int, default=None, help="frames per second: of the MP4, of --seconds, and given to "
                                                         "a model conditioned on it (default: --default-fps, else "
                                                         "the model's)")
    g.add_argument("--opt", action="append", default=[], metavar="NAME=VALUE",
                   help="a model-specific option, e.g. --opt guidance_scale_2=3 (Wan 2.2); repeatable")
    g.add_argument("-o", "--output", default="out.mp4", help="MP4 path to write (default: out.mp4); an existing file "
                                                              "is refused unless --overwrite is given")
    g.add_argument("--overwrite", action="store_true", help="replace the --output file if it exists")
    g = p.add_argument_group("image-to-video (WanImageToVideoPipeline and diffusion-forcing checkpoints)")
    g.add_argument("--image", default=None, metavar="PATH", help="the first frame's image (PNG, JPEG or WebP); "
                                                                 "resized to --size as diffusers' pipeline does")
    g.add_argument("--last-image", default=None, metavar="PATH", help="the last frame's image (first-last-frame "
                                                                      "checkpoints)")
    g.add_argument("--video", default=None, metavar="PATH", help="an MP4 to extend (diffusion-forcing checkpoints): "
                                                                 "the output is the whole extended video")
    g = p.add_argument_group("long video (diffusion-forcing checkpoints)")
    g.add_argument("--base-frames", type=int, default=None, help="frames per segment (base_num_frames)")
    g.add_argument("--overlap", type=int, default=None, help="frames a segment shares with the one before "
                                                             "(overlap_history)")
    g.add_argument("--ar-step", type=int, default=None, help="0: synchronous; > 0: later blocks lag by this many steps")
    g.add_argument("--causal-block", type=int, default=None, help="latent frames per causal block (causal_block_size)")
    g.add_argument("--addnoise", type=float, default=None, help="noise on the conditioning frames "
                                                                "(addnoise_condition)")
    add_cli_args(p, EngineConfig, groups=("model", "defaults"),
                 titles={"model": "model and workers", "defaults": "request defaults"})


def speed_levers(info) -> str:
    """The load line's words on `compile` and `quantize` ("" when neither is on)."""
    words = ""
    if info.compile != "none":
        words += f", compile {info.compile} (warm-up {info.compile_s:.1f} s, {info.compiled_graphs} graphs)"
    if info.quantize != "none":
        words += f", quantize {info.quantize}"
    return words


#: a request field -> the flag that sets it (a RequestError's field, named as the user typed it)
FIELD_FLAGS = {"num_frames": "--frames", "seconds": "--seconds", "height": "--size", "width": "--size",
               "size": "--size", "num_inference_steps": "--steps", "guidance_scale": "--guidance-scale",
               "negative_prompt": "--negative-prompt", "seed": "--seed", "fps": "--fps", "image": "--image",
               "last_image": "--last-image", "video": "--video", "lora": "--lora", "prompt": "prompt",
               **{name: "--" + flag.replace("_", "-") for flag, name in LONG_VIDEO_FLAGS.items()}}


def check(args) -> None:
    """What can be refused without the model, in well under a second (before the fork server starts and torch is
    imported): the size's syntax, the input files, the output file, --opt's syntax. ValueError naming the flag."""
    if args.size is not None:
        try:
            parse_size(args.size)
        except ValueError:
            raise ValueError(f"--size must look like WIDTHxHEIGHT, e.g. 64x64; got {args.size!r}") from None
    for flag, path in (("--image", args.image), ("--last-image", args.last_image), ("--video", args.video)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag}: no such file: {path}")
    for flag, value in (("--frames", args.frames), ("--steps", args.steps), ("--fps", args.fps)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1; got {value}")
    if args.seconds is not None and not args.seconds > 0:
        raise ValueError(f"--seconds must be positive; got {args.seconds}")
    if os.path.exists(args.output) and not args.overwrite:
        raise ValueError(f"--output: {args.output} exists (give --overwrite to replace it, or another -o path)")
    if os.path.isdir(args.output):
        raise ValueError(f"--output: {args.output} is a directory")
    parse_options(args.opt)


def run(args) -> int:
    from tqdm import tqdm

    from longserve.engine.config import EngineConfig, from_cli_args
    from longserve.engine.engine import check_before_load
    from longserve.engine.request import RequestError, RequestInput
    from longserve.pipelines import VideoPipeline
    from longserve.pipelines.video import PIPELINE_DEFAULTS
    from longserve.server.media import FragmentedMP4Writer

    check(args)
    width = height = None
    if args.size is not None:
        width, height = parse_size(args.size)
    options = parse_options(args.opt)
    for flag, name in (("--image", "image"), ("--last-image", "last_image")):
        path = getattr(args, name)
        if path is not None:
            options[name] = read_image(path, flag)
    if args.video is not None:
        from longserve.pipelines.media import read_mp4

        options["video"] = read_mp4(args.video, "--video")
    options.update({name: getattr(args, flag) for flag, name in LONG_VIDEO_FLAGS.items()
                    if getattr(args, flag) is not None})
    t0 = time.perf_counter()
    config = from_cli_args(EngineConfig, args, **PIPELINE_DEFAULTS)
    if config.loras:             # one video: every adapter given with --lora applies, at its scale
        options["lora"] = [{"name": a.name, "scale": a.scale} for a in config.loras]
    try:                         # the request against the checkpoint's description, before the workers load it
        check_before_load(config, RequestInput(
            prompt=args.prompt, negative_prompt=args.negative_prompt, num_frames=args.frames, seconds=args.seconds,
            height=height, width=width, num_inference_steps=args.steps, guidance_scale=args.guidance_scale,
            seed=args.seed, fps=args.fps, lora=options.get("lora"),
            options={k: v for k, v in options.items() if k != "lora"}))
    except RequestError as e:
        flag = FIELD_FLAGS.get(e.field, f"--opt {e.field}")
        raise ValueError(f"{flag}: {e}") from None
    print(f"writing {os.path.abspath(args.output)}", file=sys.stderr)
    if config.compile != "none":       # the workers compile at load: say so before the wait
        print(f"loading {args.model}; compiling its transformer blocks ({config.compile_backend}) with a warm-up "
              f"step at the default size ...", file=sys.stderr, flush=True)
    with VideoPipeline.from_config(config) as pipe:
        loaded = time.perf_counter()
        info = pipe.info
        fps = pipe.defaults.fps if args.fps is None else args.fps
        print(f"loaded {args.model} ({info.family}) on {info.workers} worker(s) ({info.device}, "
              f"{info.dtype}), parallel={info.plan.describe()}, attention={info.attention_backend or info.attention}"
              + "".join(f", lora {a.name} x{a.scale:g}" for a in config.loras) + speed_levers(info),
              file=sys.stderr)
        bar = None                   # made at the first step, with the total the workers planned (every segment's)

        def on_step(step: int, total: int) -> None:
            nonlocal bar
            if bar is None:
                bar = tqdm(total=total, desc="denoising", unit="step", file=sys.stderr)
            bar.total = total
            bar.update(step - bar.n)

        writer, frames, timings, sound = None, 0, {}, {}
        try:
            for chunk in pipe.stream(args.prompt, negative_prompt=args.negative_prompt, num_frames=args.frames,
                                     height=height, width=width, num_inference_steps=args.steps,
                                     guidance_scale=args.guidance_scale, seed=args.seed, callback=on_step,
                                     timings=timings, seconds=args.seconds, fps=args.fps, sound=sound, **options):
                pixels = (np.clip(chunk, 0, 1) * 255).round().astype(np.uint8)        # (n, H, W, 3)
                if writer is None:
                    # one file, grown in place: every keyframe starts a fragment a player can show
                    writer = FragmentedMP4Writer(args.output, args.output, pixels.shape[2], pixels.shape[1], fps,
                                                 keyframe_interval=fps)
                writer.write(pixels)
                frames += len(pixels)
        finally:
            if bar is not None:
                bar.close()
            if writer is not None:
                if sound:                                # a model with sound: an AAC track beside the picture
                    writer.add_audio(sound["samples"], sound["rate"])
                writer.finish()
                writer.done.wait(120)
        if writer is None or not writer.ok:
            raise RuntimeError(f"writing {args.output} failed: {writer.error if writer else 'no frames'}")
    t = timings
    wall = time.perf_counter() - loaded
    print(f"wrote {args.output}: {frames} frames {writer.width}x{writer.height} at {fps} fps")
    print(f"generation {wall:.2f} s (transformer {t['transformer_s']:.2f} s, vae {t['vae_s']:.2f} s, "
          f"encode {t['encode_s']:.2f} s, "
          f"pool overhead {wall - t['transformer_s'] - t['vae_s'] - t['encode_s']:.2f} s); "
          f"model load {loaded - t0:.1f} s; total {time.perf_counter() - t0:.1f} s")
    if "blocks" in t:           # transformer block evaluations (--cache skips some)
        print(f"transformer blocks {t['blocks']} evaluated, {t['blocks_skipped']} skipped by step caching")
    if "mag_ratios" in t:       # --cache '{"kind": "mag", "calibrate": true}': the checkpoint's mag_ratios.json
        print("mag_ratios (MagCache calibration): " + json.dumps({"mag_ratios": t["mag_ratios"][0] if len(
            t["mag_ratios"]) == 1 else t["mag_ratios"]}))
    if "expert_swaps" in t:     # --offload expert
        print(f"expert swaps {t['expert_swaps']} ({t['swap_s']:.2f} s)")
    return 0


def read_image(path: str, flag: str):
    """An image file -> (H, W, 3) uint8, decoded as the server decodes uploads; ValueError naming the flag."""
    from longserve.server.api.errors import APIError
    from longserve.server.api.uploads import decode_image

    try:
        with open(path, "rb") as f:
            data = f.read()
        return decode_image(data, flag, max_pixels=1 << 28)
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror or e}") from None
    except APIError as e:
        raise ValueError(e.message) from None


def parse_options(items: list[str]) -> dict:
    """["guidance_scale_2=3", ...] -> {"guidance_scale_2": 3}: numbers and true/false read as such."""
    options = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--opt must look like NAME=VALUE; got {item!r}")
        value: object = text.strip()
        if value.startswith("["):                  # a list: --opt sigmas=[1.0,0.75,0.5,0.25]
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(f"--opt {name.strip()}: {text!r} is not a JSON list") from None
        elif text.strip().lower() in ("true", "false"):
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
