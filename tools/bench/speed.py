"""`longserve bench speed`: the opt-in speed levers against the exact default, in one run on one machine.

    longserve bench speed [--model tiny-latte] [--prompts 40] [--spread] [--cache first_block] \\
        [--cache '{"kind": ...}'] [--compile blocks] [--profile fast] [--diffusers] [--steps N] [--frames N] \\
        [--json out.json] [--markdown docs/benchmarks.md]

Every row generates the same videos: the first `--prompts` prompts of the trained tiny-latte's
vocabulary (`weights.prompts.PROMPTS`), one request each, seed 0, all submitted at once so that the
engine batches them as a server would (`max_batch` per step). Rows: "exact" (no lever), then one per
`--cache` (step caching, engine/cache.py; any preset or JSON the `cache` request option takes), then with
`--compile blocks` two rows on a second engine whose transformer blocks are compiled (engine/compile.py):
"compile" (no other lever) and "stack" (compile with the first `--cache`). Both engines stay loaded and the
rows run in turn, so a busy spell of a shared machine falls on all of them alike. Per row:

- transformer block evaluations per video (one block applied to one latent row: cond and uncond rows
  count apart), and how many fewer than exact;
- wall time from the first submit to the last finished video (the fastest of `--repeats` runs, taken in
  turn with the other rows'), and exact's over it (the speed-up);
- PSNR of the frames against exact's (float frames in [0, 1], over every video; inf when equal);
- recognition rate: the fraction of videos whose colour and motion match their prompt
  (`tests/support/content.py`, present in a source checkout; with another `--model` the column is empty);
- compile rows: the compile time, that is the compiled engine's warm-up step at load (`ModelInfo.compile_s`:
  its default size) plus the bench's own first run on it (the bench's size, when it differs, recompiles there).

`--model wan-1.3b-shaped` builds (once, in the temporary directory: 5.7 GB) a checkpoint with Wan 2.1 T2V
1.3B's transformer shape (30 blocks, 12 heads x 128, FFN 8960; random weights) around tiny-wan's text
encoder and VAE (`tools.bench.models.shaped_checkpoint`): the block counts and the wall-time ratio of a
30-block model. A `mag` cache without `mag_ratios` is calibrated first, on the first prompt.

FP8 weights (`--quantize fp8`) need a GPU with FP8 and get no row on CPU; expert offload needs a two-expert
model and changes no frame, so it has none on tiny-latte.

`--profile fast` adds the fast profile's rows (engine/profile.py): one per lever it turns on for this model and
device (each alone: a request lever, step caching or CFG truncation, on the exact engine; an engine lever, compile,
attention backend, bf16 VAE, the VAE's rows split, on its own engine), then "profile fast" (all of them, on an engine
started with `profile="fast"`): each lever's share of the speed-up and of the quality lost, side by side.
`--diffusers` adds diffusers' own pipeline of the family (Latte: `LattePipeline`), the prompts one after another in
this process: the peer's wall time at the same work. `--spread` takes the prompts spread over the vocabulary
(prompt k: colour k mod 4, shape k/2 mod 2, motion k mod 5) instead of the first ones: `--prompts 12 --spread` is a
12-prompt grid with every colour, both shapes and every motion.

A family without step caching or block compilation (LTX-2, HunyuanVideo-1.5: `--model tiny-ltx2`,
`--model tiny-hunyuan15` or a published checkpoint's directory) gets the rows it has: "exact" (wall time, blocks);
`--cache` or `--compile` on it is refused naming the option.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path

from tools.bench.util import (
    Column,
    load_average,
    machine_info,
    markdown_table,
    replace_markdown_section,
    text_table,
    write_json,
)

SECTION = "## Speed levers: step caching against exact (bench speed)"
PROFILE_SECTION = "## The fast profile, lever by lever, against exact and diffusers (bench speed --profile fast)"
REPO = Path(__file__).resolve().parents[2]


def add_arguments(parser) -> None:
    from longserve.engine.config import EngineConfig, add_cli_args

    parser.add_argument("--prompts", type=int, default=40,
                        help="how many of the 40 vocabulary prompts (one video each)")
    parser.add_argument("--cache", dest="caches", action="append", default=None, metavar="PRESET|JSON",
                        help="a step-caching setting to measure (repeatable; default: the first_block presets)")
    parser.add_argument("--compile", dest="compile_rows", choices=["none", "blocks"], default="none",
                        help="blocks: add a 'compile' row (the transformer's blocks compiled, engine/compile.py) and "
                             "a 'stack' row (compiled, with the first --cache), on a second engine")
    parser.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
                        help="torch.compile backend of the compile rows (aot_eager, eager: the mechanism without "
                             "code generation, for tests)")
    parser.add_argument("--cfg-trunc", dest="cfg_truncs", action="append", type=float, default=None, metavar="RATIO",
                        help="a CFG truncation to measure alone (the request option cfg_trunc_ratio; repeatable)")
    parser.add_argument("--profile", dest="profile_rows", choices=["none", "fast"], default="none",
                        help="fast: add a row per lever of the fast profile on this device, and the whole profile")
    parser.add_argument("--diffusers", action="store_true",
                        help="add a row for diffusers' own pipeline of the family (Latte), the prompts in turn")
    parser.add_argument("--spread", action="store_true",
                        help="take the prompts spread over colours, shapes and motions, not the first ones")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    parser.add_argument("--frames", type=int, default=None, help="frames per video (default: the model's)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every row, in turn (exact, lever, exact, lever, ...); the fastest counts (other "
                             "processes on shared cores slow some runs)")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--markdown", default=None, metavar="PATH",
                        help=f"replace the section '{SECTION}' (with --profile: '{PROFILE_SECTION}') of this "
                             "Markdown file with the table")
    add_cli_args(parser, EngineConfig, groups=("model", "scheduling"),
                 exclude=("cache", "compile", "profile", "cfg_trunc_ratio"),
                 titles={"model": "engine options (every row)", "scheduling": "scheduling (every row)"})


def recogniser():
    """`recognises(clip, prompt)` from tests/support/content.py, or None outside a source checkout."""
    support = REPO / "tests" / "support"
    if not (support / "content.py").is_file():
        return None
    sys.path.insert(0, str(support))
    try:
        from content import recognises
    finally:
        sys.path.remove(str(support))
    return recognises


def spread_prompts(n: int) -> list[str]:
    """n prompts spread over the vocabulary: prompt k is colour k mod 4, shape k/2 mod 2, motion k mod 5 (distinct for
    n <= 20)."""
    from tools.weights.prompts import COLOURS, MOTIONS, SHAPES

    return [f"a {COLOURS[k % 4]} {SHAPES[k // 2 % 2]} {MOTIONS[k % 5]}" for k in range(n)]


def generate(pipe, prompts: list[str], steps: int | None, frames: int | None, cache) -> tuple[list, list, float]:
    """Every prompt as its own request, submitted at once -> (frames per video, timings per video, wall s). `cache`:
    the step-caching setting, or a dict of request options (a lever's)."""
    import numpy as np

    from longserve.engine.outputs import Failed, Finished, FramesChunk

    if isinstance(cache, dict) and "kind" not in cache:
        options = dict(cache)
    else:
        options = {} if cache is None else {"cache": cache}
    specs = [pipe.make_spec(p, num_inference_steps=steps, num_frames=frames, seed=0, **options) for p in prompts]
    t0 = time.perf_counter()
    handles = [pipe.engine.submit(s) for s in specs]
    videos, timings = [], []
    for h in handles:
        chunks = []
        for out in h:
            if isinstance(out, FramesChunk):
                chunks.append(out.frames)
            elif isinstance(out, Finished):
                timings.append(out.timings)
            elif isinstance(out, Failed):
                raise RuntimeError(f"a video failed: {out.error}")
        videos.append(np.concatenate(chunks, axis=1)[0])                  # (T, H, W, 3)
    return videos, timings, time.perf_counter() - t0


def calibrated(pipe, cache: dict | None, prompts: list[str], args) -> dict | None:
    """A `mag` cache without a calibration (and a checkpoint without mag_ratios.json) gets one: MagCache's
    calibration run on the first prompt, as diffusers' `MagCacheConfig(calibrate=True)` measures it."""
    if cache is None or cache["kind"] != "mag" or cache.get("mag_ratios") or cache.get("calibrate") \
            or pipe.info.capabilities.mag_calibration:
        return cache
    spec = pipe.make_spec(prompts[0], num_inference_steps=args.steps, num_frames=args.frames, seed=0,
                          cache={"kind": "mag", "calibrate": True})
    from longserve.engine.outputs import Failed, Finished

    for out in pipe.engine.submit(spec):
        if isinstance(out, Failed):
            raise RuntimeError(f"the MagCache calibration failed: {out.error}")
        if isinstance(out, Finished):
            ratios = out.timings["mag_ratios"]
    ratios = ratios[0] if len(ratios) == 1 else ratios
    print(f"  mag cache calibrated on {prompts[0]!r}: {ratios}", file=sys.stderr, flush=True)
    return dict(cache, mag_ratios=ratios)


def block_count(timings: list[dict]) -> int | None:
    """Transformer block evaluations over the videos, where the family counts them (its step-caching path);
    None where it does not (LTX-2, HunyuanVideo-1.5)."""
    if any("blocks" not in t for t in timings):
        return None
    return sum(t["blocks"] for t in timings)


def supported_caches(pipe, caches: list, args) -> list:
    """The `--cache` settings the model's family takes. A family whose forward takes no step caching (LTX-2,
    HunyuanVideo-1.5) gets the exact row alone (and the compile rows where it compiles); asking it for a cache, or
    a compile it does not have, is refused naming the option."""
    caps = pipe.info.capabilities
    if args.compile_rows != "none" and not caps.compile:
        raise ValueError(f"--compile: the {pipe.info.description.family} family does not compile its blocks")
    if caps.cache_kinds:
        return caches
    if args.caches:
        raise ValueError(f"--cache: the {pipe.info.description.family} family takes no step caching")
    print(f"  no step caching in the {pipe.info.description.family} family: the exact row alone", file=sys.stderr,
          flush=True)
    return []


def psnr(a, b) -> float:
    import numpy as np

    mse = float(np.mean([np.mean((x.astype(np.float64) - y) ** 2) for x, y in zip(a, b)]))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


COLUMNS = [
    Column("lever", "lever"),
    Column("blocks / video", "blocks_per_video", ".1f"),
    Column("fewer blocks", "fewer_blocks", ".2f"),
    Column("wall s", "wall_s", ".2f"),
    Column("speed-up", "speedup", ".2f"),
    Column("PSNR vs exact (dB)", lambda r: "exact" if r["psnr_db"] is None else f"{r['psnr_db']:.1f}"),
    Column("recognised", lambda r: "" if r["recognised"] is None else f"{r['recognised']}/{r['videos']}"),
    Column("compile s", lambda r: "" if r.get("compile_s") is None else f"{r['compile_s']:.1f}"),
]


def lever_name(cache: dict | None, compiled: bool) -> str:
    parts = ["compile blocks"] if compiled else []
    if cache is not None:
        parts.append("cache " + ", ".join(f"{k}={v}" for k, v in cache.items() if k != "mag_ratios"))
    return " + ".join(parts) or "exact"


REQUEST_LEVERS = ("cache", "cfg_trunc_ratio")


def profile_levers(pipe, config) -> dict:
    """The fast profile's levers for this model on this device: {field: value} (engine/profile.py)."""
    from longserve.engine.dist import default_device
    from longserve.engine.engine import resolve_checkpoint
    from longserve.engine.families import detect_family
    from longserve.engine.profile import fast_levers

    path = resolve_checkpoint(config.model)
    family = detect_family(path)
    desc = family.describe(path)
    fast = config.replace(profile="fast", cache=None, cfg_trunc_ratio=None, compile=None, vae_split=None)
    plan = family.resolve_plan(desc, fast.parallel, fast.workers, fast.ulysses_degree, fast.cfg_parallel)
    return fast_levers(fast, family, desc, plan, config.device or default_device())


def request_options(field: str, value) -> dict:
    """A request lever as request options (step caching's JSON parsed)."""
    from longserve.engine.cache import parse_cache

    return {"cache": parse_cache(value)} if field == "cache" else {field: value}


def diffusers_run(config, defaults, prompts, steps, frames) -> tuple[list, float]:
    """diffusers' own pipeline of the checkpoint (Latte: `LattePipeline`), the prompts one after another in this
    process, at the model's defaults (`defaults`: its GenerationDefaults) -> (videos, wall s)."""
    import diffusers
    import torch

    from longserve.engine.dist import parse_dtype
    from longserve.engine.engine import resolve_checkpoint
    from longserve.engine.families.base import read_json

    path = resolve_checkpoint(config.model)
    name = read_json(path / "model_index.json")["_class_name"]
    if name != "LattePipeline":
        raise ValueError(f"--diffusers: diffusers' row is for Latte checkpoints; {config.model!r} is a {name}")
    if frames and frames != defaults.num_frames:
        raise ValueError(f"--diffusers: LattePipeline makes the transformer's own {defaults.num_frames} frames only "
                         f"(its temporal position table); got --frames {frames}")
    pipe = getattr(diffusers, name).from_pretrained(str(path), torch_dtype=parse_dtype(config.dtype))
    pipe.set_progress_bar_config(disable=True)
    kw = dict(num_inference_steps=steps or defaults.num_inference_steps, video_length=frames or defaults.num_frames,
              height=defaults.height, width=defaults.width, guidance_scale=defaults.guidance_scale)
    videos, t0 = [], time.perf_counter()
    with torch.no_grad():
        for p in prompts:
            videos.append(pipe(p, generator=torch.Generator("cpu").manual_seed(0), output_type="np", **kw).frames[0])
    return videos, time.perf_counter() - t0


def run(args) -> int:
    from longserve.engine.cache import parse_cache
    from longserve.engine.config import EngineConfig, from_cli_args
    from longserve.pipelines import VideoPipeline
    from longserve.pipelines.video import PIPELINE_DEFAULTS
    from tools.bench.models import SHAPED_CHECKPOINTS, shaped_checkpoint
    from tools.weights.prompts import PROMPTS

    if not 1 <= args.prompts <= len(PROMPTS):
        raise ValueError(f"--prompts must be in [1, {len(PROMPTS)}]; got {args.prompts}")
    default = ["first_block"] if args.profile_rows == "none" and not args.cfg_truncs else []   # the preset's row
    caches = [parse_cache(c, "--cache") for c in (args.caches or default)]
    prompts = spread_prompts(args.prompts) if args.spread else list(PROMPTS[:args.prompts])
    if args.spread and args.prompts > 20:
        raise ValueError(f"--spread takes at most 20 prompts (distinct colour, shape, motion); got {args.prompts}")
    recognises = recogniser() if args.model == "tiny-latte" else None
    config = from_cli_args(EngineConfig, args, **PIPELINE_DEFAULTS)
    if args.model in SHAPED_CHECKPOINTS:            # a published model's shape, random weights, built once
        config = config.replace(model=str(shaped_checkpoint(args.model)))
    rows, load = [], load_average()
    with contextlib.ExitStack() as stack:
        pipe = stack.enter_context(VideoPipeline.from_config(config))
        caches = supported_caches(pipe, caches, args)
        generate(pipe, prompts[:1], 2, args.frames, None)                  # warm-up
        caches = [calibrated(pipe, c, prompts, args) for c in caches]
        levers = [(pipe, None), *((pipe, c) for c in caches)]              # (engine, cache) per row
        compile_s = None
        if args.compile_rows != "none":
            print(f"  compiling the transformer blocks ({args.compile_backend}) ...", file=sys.stderr, flush=True)
            compiled = stack.enter_context(VideoPipeline.from_config(
                config.replace(compile=args.compile_rows, compile_backend=args.compile_backend)))
            first = generate(compiled, prompts[:1], 2, args.frames, None)[2]  # the bench's size may recompile
            compile_s = compiled.info.compile_s + first
            print(f"  compiled: warm-up at load {compiled.info.compile_s:.1f} s, first run {first:.1f} s, "
                  f"{compiled.info.compiled_graphs} graphs", file=sys.stderr, flush=True)
            levers += [(compiled, None)] + [(compiled, c) for c in caches[:1]]
        names = [lever_name(c, e is not pipe) for e, c in levers]
        for ratio in args.cfg_truncs or []:
            levers.append((pipe, {"cfg_trunc_ratio": ratio}))
            names.append(f"cfg_trunc_ratio={ratio}")
        if args.profile_rows == "fast":
            fast = profile_levers(pipe, config)
            for field, value in fast.items():
                if field in REQUEST_LEVERS:
                    levers.append((pipe, request_options(field, value)))
                    names.append(f"fast: {field}={value}")
                else:
                    engine = stack.enter_context(VideoPipeline.from_config(config.replace(**{field: value})))
                    generate(engine, prompts[:1], 2, args.frames, None)      # warm-up (and compile)
                    levers.append((engine, None))
                    names.append(f"fast: {field}={value}")
            whole = pipe
            if any(f not in REQUEST_LEVERS for f in fast):
                whole = stack.enter_context(VideoPipeline.from_config(config.replace(profile="fast")))
                generate(whole, prompts[:1], 2, args.frames, None)
                levers.append((whole, None))
            else:                                           # request levers only: the exact engine with all of them
                options = {}
                for field, value in fast.items():
                    options.update(request_options(field, value))
                levers.append((pipe, options))
            names.append("profile fast")
        runs = {i: [] for i in range(len(levers))}
        for _ in range(args.repeats):
            for i, (engine, cache) in enumerate(levers):
                runs[i].append(generate(engine, prompts, args.steps, args.frames, cache))
                print(f"  {names[i]}: {runs[i][-1][2]:.2f} s", file=sys.stderr, flush=True)
        if args.diffusers:
            peer_videos, peer_wall = diffusers_run(config, pipe.info.defaults, prompts, args.steps, args.frames)
            print(f"  diffusers: {peer_wall:.2f} s", file=sys.stderr, flush=True)
        exact_videos = runs[0][0][0]
        exact_blocks = block_count(runs[0][0][1])
        exact_wall = min(w for _, _, w in runs[0])
        for i, (engine, cache) in enumerate(levers):
            videos, timings, _ = runs[i][0]
            walls = [w for _, _, w in runs[i]]
            blocks = block_count(timings)
            counted = blocks is not None and exact_blocks is not None
            rows.append(dict(
                lever=names[i], cache=cache if cache is None or "kind" in cache else None,
                options=None if cache is None or "kind" in cache else cache,
                compile=None if engine is pipe else args.compile_rows,
                compile_s=None if engine is pipe else compile_s, videos=len(videos),
                blocks_per_video=blocks / len(videos) if counted else None,
                blocks_skipped_per_video=sum(t["blocks_skipped"] for t in timings) / len(videos) if counted else None,
                fewer_blocks=exact_blocks / blocks if counted else None, wall_s=min(walls), wall_s_runs=walls,
                speedup=exact_wall / min(walls), psnr_db=None if i == 0 else psnr(videos, exact_videos),
                recognised=None if recognises is None else sum(recognises(v, p) for v, p in zip(videos, prompts))))
        if args.diffusers:
            rows.append(dict(lever="diffusers (its own pipeline, prompts in turn)", cache=None, options=None,
                             compile=None, compile_s=None, videos=len(peer_videos), blocks_per_video=None,
                             blocks_skipped_per_video=None, fewer_blocks=None, wall_s=peer_wall,
                             wall_s_runs=[peer_wall],
                             speedup=exact_wall / peer_wall, psnr_db=psnr(peer_videos, exact_videos),
                             recognised=None if recognises is None else
                             sum(recognises(v, p) for v, p in zip(peer_videos, prompts))))
        info = pipe.info
    import torch

    machine = machine_info(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for r in rows:
        r.update(machine=machine, model=args.model, workers=info.workers, plan=info.plan.describe(),
                 steps=args.steps or info.defaults.num_inference_steps, frames=args.frames or info.defaults.num_frames,
                 loadavg_before=load, loadavg_after=load_average())
    print()
    print(text_table(rows, COLUMNS))
    table = markdown_table(rows, COLUMNS)
    if args.json:
        write_json(rows, args.json)
    if args.markdown:
        flags = " ".join(f"--cache '{c}'" for c in (args.caches or []))
        if args.compile_rows != "none":
            flags += f" --compile {args.compile_rows}"
        flags += "".join(f" --cfg-trunc {r}" for r in args.cfg_truncs or [])
        if args.profile_rows != "none":
            flags += f" --profile {args.profile_rows}"
        if args.diffusers:
            flags += " --diffusers"
        if args.spread:
            flags += " --spread"
        if args.steps:
            flags += f" --steps {args.steps}"
        if args.frames:
            flags += f" --frames {args.frames}"
        command = (f"longserve bench speed --model {args.model} --workers {info.workers} --prompts {args.prompts} "
                   f"--repeats {args.repeats} {flags}")
        body = (f"Measured with `{command.strip()}` on {machine['cpu']} ({machine['cores']} cores, "
                f"{machine['device']}, torch {machine['torch']}), {rows[0]['steps']} steps, {rows[0]['frames']} "
                f"frames; load average before {load}, after {rows[-1]['loadavg_after']}.\n\n{table}")
        replace_markdown_section(args.markdown, PROFILE_SECTION if args.profile_rows != "none" else SECTION, body)
    return 0
