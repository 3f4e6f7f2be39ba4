"""`longserve bench gpu`: what one GPU shows about the CUDA path (docs/gpu.md).

    longserve bench gpu --sections numerics,speed,memory,video [--json out.json] [--budget-s 480]
    longserve bench gpu --smoke --device cpu          # tiny shapes: checks this script on a CPU

Sections (each row is printed, and appended to --json, as soon as it is measured):

- numerics: a Latte-1-shaped (16 heads x 72, caption 4096) and a Wan 2.1 1.3B-shaped
  (`weights.wan.WAN_2_1_T2V_1_3B_TRANSFORMER`) transformer, real configs with 2 layers and
  seeded random weights: relative error (mean |x - ref| / mean |ref|) of our 1-worker bf16
  forward against diffusers' fp32 forward (TF32 off) on the same inputs, beside diffusers'
  own bf16 forward's.
- speed: one denoising step (the CFG batch of 2), bf16, full depth (Latte-1: 28 block pairs;
  Wan 1.3B: 30 blocks): our 1-worker step (`engine.models.latte.parallel_forward`,
  `engine.models.wan.WanSequenceParallel`) against
  diffusers' `model(...)`, interleaved, median over the timed repeats; then our step under
  each SDPA backend (flash, memory-efficient, cuDNN; `sdpa_kernel`), xformers if installed.
- memory: peak memory of one step (batch 2, bf16, our step) as the video grows, until the
  GPU runs out or one step takes longer than --step-limit-s; and the Latte VAE (Stable
  Diffusion's AutoencoderKL config, bf16) decoding T frames in one call vs in chunks.
- video: whole videos at 50 steps through `VideoPipeline` (1 worker, bf16) against diffusers'
  own pipeline on the same checkpoint directory (built here: the full-size transformer with
  random weights, a random full-size VAE, a one-layer text encoder as wide as the real one);
  wall time, and our pool overhead per step (`VideoOutput.timings`).
- wan-stages, levers (tools/bench/gpu_wan.py): the Wan 1.3B video's stages against diffusers' (where the
  difference is), and FP8 weights and regional compile on it.
- wan-vae: the Wan VAE's decode memory (see `wan_vae_memory`).
- backends: one Wan 1.3B-shaped step (bf16, full depth, 81 frames 480x832) per `attention_backend` (diffusers'
  dispatcher: native, flash, _flash_3, sage, _native_flash, _native_efficient, _native_cudnn, xformers) against
  the default, as an engine runs it; what is not installed or cannot run here is a row with the reason
  (tools/bench/backends.py).
- fast, step-14b (`--profile fast`; tools/bench/gpu_fast.py): the fast profile lever by lever on a whole Wan 1.3B
  video against exact and diffusers; one step at the Wan 2.1 I2V 14B 480p shape (blocks scaled, figure scaled back).

Peak memory: `engine.memory.PeakMemory` (CUDA: max_memory_allocated minus memory at entry).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from tools.bench.gpu_models import (
    build_latte,
    build_latte_dir,
    build_sd_vae,
    build_wan,
    build_wan_dir,
    device_sync,
    free,
    is_oom,
    latte_cfg,
    latte_inputs,
    latte_ours,
    latte_theirs,
    peak_memory,
    solo_group,
    time_call,
    wan_config,
    wan_inputs,
    wan_ours,
    wan_theirs,
)

SECTIONS = ("numerics", "speed", "memory", "video", "wan-vae", "wan-stages", "levers", "backends", "fast", "step-14b")
#: `--profile fast`: the sections that measure the fast profile (tools/bench/gpu_fast.py)
PROFILE_SECTIONS = {"fast": "fast,step-14b"}

def add_arguments(parser) -> None:
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few repeats (checks the script)")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if present")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per speed row (after 2 warm-ups)")
    parser.add_argument("--step-limit-s", type=float, default=20.0,
                        help="memory sweeps stop after a step longer than this")
    parser.add_argument("--budget-s", type=float, default=1e9, help="skip what is left after this many seconds")
    parser.add_argument("--models", default="latte-1,wan2.1-1.3b", help="video and speed sections: which models")
    parser.add_argument("--json", default=None, metavar="PATH", help="append every row here (JSON lines)")
    parser.add_argument("--work-dir", default=None, metavar="DIR",
                        help="keep the built checkpoints here and reuse them (wan-stages, levers; default: a "
                             "temporary directory for the run, removed at its end)")
    parser.add_argument("--lever-steps", type=int, default=20, help="levers, fast: steps per video")
    parser.add_argument("--profile", default=None, choices=sorted(PROFILE_SECTIONS),
                        help="fast: the fast profile's sections (fast, step-14b: tools/bench/gpu_fast.py), lever by "
                             "lever against exact and diffusers, in place of --sections")
    parser.add_argument("--step-layers", type=int, default=2,
                        help="step-14b: blocks of the 40 built and timed (the figure is scaled back to 40)")
    parser.add_argument("--levers", default="exact,fp8,compile,fp8+compile",
                        help="levers: which rows (comma-separated; exact is the reference of the frame difference)")


class _Out:
    def __init__(self, args):
        self.args, self.t0 = args, time.monotonic()
        self.path = Path(args.json) if args.json else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def row(self, **row) -> None:
        print(json.dumps(row), flush=True)
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def over_budget(self) -> bool:
        return time.monotonic() - self.t0 > self.args.budget_s


# -- sections -------------------------------------------------------------------------------------------------


def numerics(args, out: _Out, dev) -> None:
    import torch

    def rel(a, b):
        return ((a.float() - b).abs().mean() / b.abs().mean()).item()

    lc = latte_cfg(args.smoke)
    wc = wan_config(args.smoke, layers=2)
    cases = [
        ("latte-1 (2 layers)", lambda: build_latte(lc, layers=2),
         lambda: latte_inputs(lc, 16, 8 if args.smoke else 32, "cpu", torch.float32), latte_ours, latte_theirs),
        ("wan2.1-1.3b (2 layers)", lambda: build_wan(wc),
         lambda: wan_inputs(wc, 5, 6 if args.smoke else 30, 10 if args.smoke else 52, "cpu", torch.float32,
                            text_len=8 if args.smoke else 512), wan_ours, wan_theirs),
    ]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        for name, build, inputs, ours, theirs in cases:
            model = build().to(dev)
            x, t, e = (v.to(dev) for v in inputs())
            with torch.no_grad():
                want = theirs(model)(x, t, e).float()
                model = model.to(torch.bfloat16)
                xb, eb = x.to(torch.bfloat16), e.to(torch.bfloat16)
                d_bf16 = rel(theirs(model)(xb, t, eb), want)
                o_bf16 = rel(ours(model, dev)(xb, t, eb), want)
            out.row(section="numerics", model=name, input=list(x.shape), diffusers_bf16_rel_err=d_bf16,
                    ours_bf16_rel_err=o_bf16, ratio=o_bf16 / d_bf16)
            del model, want
            free(dev)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _speed_cases(args):
    import torch

    lc, wc = latte_cfg(args.smoke), wan_config(args.smoke)
    s = args.smoke
    return [
        ("latte-1", "16 frames 512x512", lambda: build_latte(lc),
         lambda dev: latte_inputs(lc, 16, lc["latent"], dev, torch.bfloat16), latte_ours, latte_theirs),
        ("latte-1", "64 frames 512x512", lambda: build_latte(lc, video_length=64 if not s else 24),
         lambda dev: latte_inputs(lc, 64 if not s else 24, lc["latent"], dev, torch.bfloat16), latte_ours,
         latte_theirs),
        ("wan2.1-1.3b", "81 frames 480x832", lambda: build_wan(wc),
         lambda dev: wan_inputs(wc, 21 if not s else 3, 60 if not s else 6, 104 if not s else 10, dev,
                                torch.bfloat16, text_len=8 if s else 512), wan_ours, wan_theirs),
    ]


def speed(args, out: _Out, dev) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = None
    for family, size, build, inputs, ours, theirs in _speed_cases(args):
        if out.over_budget():
            return
        if family not in args.models.split(","):
            continue
        if build is not None:
            model = None
            free(dev)
            model = build().to(dev, torch.bfloat16)
        x, t, e = inputs(dev)
        fns = {"ours": ours(model, dev), "diffusers": theirs(model)}
        times = {k: [] for k in fns}
        with torch.no_grad():
            for r in range(2 + args.repeats):
                for k, fn in fns.items():
                    s = time_call(dev, fn, x, t, e)
                    if r >= 2:
                        times[k].append(s)
            med = {k: statistics.median(v) for k, v in times.items()}
            out.row(section="speed", model=family, size=size, input=list(x.shape), ours_s=med["ours"],
                    diffusers_s=med["diffusers"], ratio=med["ours"] / med["diffusers"], repeats=args.repeats)
            if dev.type != "cuda":
                continue
            backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
            for name, backend in backends.items():
                if name == "math" and family == "wan2.1-1.3b":
                    continue  # a (32760 x 32760) score matrix per head: minutes, not a backend anyone would pick
                try:
                    with sdpa_kernel(backend):
                        ts = [time_call(dev, fns["ours"], x, t, e) for _ in range(1 + 3)][1:]
                    out.row(section="attention", model=family, size=size, backend=name, ours_s=statistics.median(ts))
                except Exception as err:  # noqa: BLE001 - a backend that cannot run these shapes is a finding
                    out.row(section="attention", model=family, size=size, backend=name,
                            error=f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")
                    free(dev)
            try:
                import xformers  # noqa: F401
            except ImportError:
                out.row(section="attention", model=family, size=size, backend="xformers", error="not installed")
        del x, e
        free(dev)
    del model
    free(dev)


def memory(args, out: _Out, dev) -> None:
    import torch

    s = args.smoke
    lc, wc = latte_cfg(s), wan_config(s)
    sweeps = [
        ("latte-1", "512x512", lambda: build_latte(lc), [16, 64, 128, 256, 512, 1024, 2048] if not s else [4, 8],
         lambda f: latte_inputs(lc, f, lc["latent"], dev, torch.bfloat16), latte_ours, lambda f: f),
        ("wan2.1-1.3b", "480x832", lambda: build_wan(wc), [81, 161, 321, 641] if not s else [5, 9],
         lambda f: wan_inputs(wc, (f - 1) // 4 + 1, 60 if not s else 6, 104 if not s else 10, dev, torch.bfloat16,
                              text_len=8 if s else 512), wan_ours, lambda f: (f - 1) // 4 + 1),
    ]
    for family, size, build, frames, inputs, ours, latent_frames in sweeps:
        if out.over_budget():
            return
        model = build().to(dev, torch.bfloat16)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        fn = ours(model, dev)
        for f in frames:
            if out.over_budget():
                break
            try:
                x, t, e = inputs(f)
                with torch.no_grad():
                    fn(x[:, :, :1], t, e)  # warm-up (kernels, allocator) on one frame
                    peak, secs = peak_memory(dev, fn, x, t, e)
                out.row(section="memory", component="transformer step (batch 2)", model=family, size=size, frames=f,
                        latent_frames=latent_frames(f), peak_gib=peak / 2**30, weights_gib=weights / 2**30,
                        seconds=secs)
                del x, e
            except Exception as err:  # noqa: BLE001
                if not is_oom(err):
                    raise
                out.row(section="memory", component="transformer step (batch 2)", model=family, size=size, frames=f,
                        latent_frames=latent_frames(f), peak_gib=None, error="out of memory")
                free(dev)
                break
            free(dev)
            if secs > args.step_limit_s:
                break
        del model, fn
        free(dev)
    if not out.over_budget():
        latte_vae_memory(args, out, dev)


def latte_vae_memory(args, out: _Out, dev, chunk: int = 16) -> None:
    """Stable Diffusion's VAE (Latte's) decoding T frames of 64x64 latents in one call, until OOM; then the
    largest T in chunks of `chunk` frames, each chunk moved to the CPU as uint8 (what a streaming decoder keeps)."""
    import torch

    vae = build_sd_vae(args.smoke).to(dev, torch.bfloat16)
    lat = 8 if args.smoke else 64
    largest = None
    for T in ([2, 4] if args.smoke else [16, 32, 64, 128, 256]):
        z = torch.randn(T, 4, lat, lat, device=dev, dtype=torch.bfloat16)
        try:
            with torch.no_grad():
                peak, secs = peak_memory(dev, vae.decode, z)
            out.row(section="memory", component="Latte VAE decode, one call", model="sd-vae", size=f"{lat * 8}px",
                    frames=T, peak_gib=peak / 2**30, seconds=secs)
            largest = T
        except Exception as err:  # noqa: BLE001
            if not is_oom(err):
                raise
            out.row(section="memory", component="Latte VAE decode, one call", model="sd-vae", size=f"{lat * 8}px",
                    frames=T, peak_gib=None, error="out of memory")
            free(dev)
            break
        del z
        free(dev)
        if out.over_budget():
            break
    T = 2 * (largest or 16)
    z = torch.randn(T, 4, lat, lat, device=dev, dtype=torch.bfloat16)

    def chunked(vae, z):
        for a in range(0, T, chunk):
            frames = vae.decode(z[a:a + chunk]).sample
            (frames.float().clamp(-1, 1).add(1).mul(127.5).round().to(torch.uint8)).cpu()

    with torch.no_grad():
        peak, secs = peak_memory(dev, chunked, vae, z)
    out.row(section="memory", component=f"Latte VAE decode, chunks of {chunk}", model="sd-vae", size=f"{lat * 8}px",
            frames=T, peak_gib=peak / 2**30, seconds=secs)
    del vae, z
    free(dev)


# -- whole videos ----------------------------------------------------------------------------------------------


def video(args, out: _Out, dev) -> None:
    import numpy as np
    import torch
    from diffusers import LattePipeline, WanPipeline

    from longserve.pipelines import VideoPipeline

    s = args.smoke
    steps = 3 if s else 50
    cases = [
        ("latte-1", build_latte_dir, LattePipeline,
         dict(num_frames=16, height=64 if s else 512, width=64 if s else 512, guidance_scale=7.5)),
        ("wan2.1-1.3b", build_wan_dir, WanPipeline,
         dict(num_frames=17 if not s else 5, height=48 if s else 480, width=80 if s else 832, guidance_scale=5.0)),
    ]
    prompt = "a red ball bouncing"
    with tempfile.TemporaryDirectory(prefix="longserve-gpu-") as tmp:
        for name, build, cls, kw in cases:
            if out.over_budget():
                return
            if name not in args.models.split(","):
                continue
            d = Path(tmp) / name
            d.mkdir()
            t = time.perf_counter()
            build(d, s)
            build_s = time.perf_counter() - t
            # ours
            with VideoPipeline.from_pretrained(str(d), workers=1, device=dev.type, dtype="bfloat16") as pipe:
                pipe(prompt, num_inference_steps=2, seed=0, **kw)  # warm-up
                t = time.perf_counter()
                res = pipe(prompt, num_inference_steps=steps, seed=0, **kw)
                ours_s = time.perf_counter() - t
                attention = pipe.info.attention
            tm = res.timings
            free(dev)
            # diffusers
            ref = cls.from_pretrained(str(d), torch_dtype=torch.bfloat16).to(dev)
            ref.set_progress_bar_config(disable=True)
            gen = lambda: torch.Generator("cpu").manual_seed(0)  # noqa: E731
            ref_kw = dict(kw)
            if cls is LattePipeline:  # diffusers' Latte names the frame count video_length
                ref_kw["video_length"] = ref_kw.pop("num_frames")
            ref(prompt, num_inference_steps=2, generator=gen(), output_type="np", **ref_kw)
            device_sync(dev)
            t = time.perf_counter()
            theirs = ref(prompt, num_inference_steps=steps, generator=gen(), output_type="np", **ref_kw).frames
            device_sync(dev)
            theirs_s = time.perf_counter() - t
            theirs = np.asarray(theirs[0] if isinstance(theirs, list) else theirs)
            diff = float(np.abs(res.frames.reshape(theirs.shape) - theirs).max()) if res.frames.size == theirs.size \
                else None
            out.row(section="video", model=name, steps=steps, attention=attention, build_s=build_s,
                    ours_s=ours_s, diffusers_s=theirs_s, ratio=ours_s / theirs_s,
                    transformer_s=tm.get("transformer_s"), vae_s=tm.get("vae_s"), encode_s=tm.get("encode_s"),
                    overhead_per_step_ms=1000 * tm["overhead_s"] / steps,
                    max_abs_diff_vs_diffusers=diff, **kw)
            del ref
            free(dev)
            shutil.rmtree(d, ignore_errors=True)


def wan_vae_memory(args, out: _Out, dev) -> None:
    """Wan 2.1's VAE (diffusers' default config, random weights, bf16; fp32 for --smoke on the CPU) at 480x832:
    diffusers' one-shot
    `vae.decode` of the whole video by length until OOM or --step-limit-s, then our streaming decoder
    (engine/causal_vae.py, one latent frame per call, each chunk's frames moved to the CPU) on the longest,
    untiled (the engine's default, as diffusers' pipelines) and in diffusers' default tiles (--vae-tiling)."""
    import torch
    from diffusers import AutoencoderKLWan

    from longserve.engine.causal_vae import StreamingVAEDecoder, VAETiling
    from tools.weights.wan import WAN_2_1_VAE, init_kwargs

    cfg = init_kwargs(WAN_2_1_VAE)
    if args.smoke:
        cfg.update(base_dim=16, z_dim=4, latents_mean=cfg["latents_mean"][:4], latents_std=cfg["latents_std"][:4])
    torch.manual_seed(0)
    dtype = torch.float32 if args.smoke and dev.type == "cpu" else torch.bfloat16  # CPU bf16 convs are slow
    vae = AutoencoderKLWan(**cfg).eval().to(dev, dtype)
    h, w = (6, 10) if args.smoke else (60, 104)
    longest = None
    for frames in ([5] if args.smoke else [81, 161, 321]):
        if out.over_budget():
            break
        z = torch.randn(1, cfg["z_dim"], (frames - 1) // 4 + 1, h, w, device=dev, dtype=dtype)
        try:
            with torch.no_grad():
                peak, secs = peak_memory(dev, vae.decode, z)
            out.row(section="memory", component="Wan VAE decode, diffusers one call", model="wan2.1-vae",
                    size=f"{h * 8}x{w * 8}", frames=frames, peak_gib=peak / 2**30, seconds=secs)
            longest = frames
        except Exception as err:  # noqa: BLE001
            if not is_oom(err):
                raise
            out.row(section="memory", component="Wan VAE decode, diffusers one call", model="wan2.1-vae",
                    size=f"{h * 8}x{w * 8}", frames=frames, peak_gib=None, error="out of memory")
            free(dev)
            break
        del z
        free(dev)
        if secs > args.step_limit_s:
            break
    frames = longest or 81
    z = torch.randn(1, cfg["z_dim"], (frames - 1) // 4 + 1, h, w, device=dev, dtype=dtype)

    def streamed(vae, z, tiling):
        dec = StreamingVAEDecoder(vae, solo_group(dev), 1, h, w, tiling=tiling)
        for a in range(z.shape[2]):
            dec.decode(z[:, :, a:a + 1]).float().cpu()
        dec.close()

    # the smoke VAE's frames are smaller than a default tile: tile it like the real one (2 x 2 tiles)
    tiles = VAETiling(32, 48, 24, 40) if args.smoke else VAETiling()
    for how, tiling in (("untiled", None), ("tiled", tiles)):
        with torch.no_grad():
            peak, secs = peak_memory(dev, streamed, vae, z, tiling)
        out.row(section="memory", component=f"Wan VAE decode, ours streamed (1 latent frame per call, {how})",
                model="wan2.1-vae", size=f"{h * 8}x{w * 8}", frames=frames, peak_gib=peak / 2**30, seconds=secs)
        free(dev)
    del vae, z
    free(dev)


def run(args) -> int:
    import torch

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = _Out(args)
    from tools.bench.util import machine_info

    out.row(section="machine", **machine_info(dev.type))
    if getattr(args, "profile", None):
        args.sections = PROFILE_SECTIONS[args.profile]
    sections = [s for s in args.sections.split(",") if s]
    for s in sections:
        if s not in SECTIONS:
            raise ValueError(f"--sections: unknown {s!r}; choose from {', '.join(SECTIONS)}")
    from longserve.engine.attention import keeping_active_backend
    from tools.bench.backends import backends
    from tools.bench.gpu_fast import fast_profile, step_14b
    from tools.bench.gpu_wan import levers, wan_stages

    funcs = {"numerics": numerics, "speed": speed, "memory": memory, "video": video, "wan-vae": wan_vae_memory,
             "wan-stages": wan_stages, "levers": levers, "backends": backends, "fast": fast_profile,
             "step-14b": step_14b}
    # the checkpoints the sections build: kept in --work-dir, else in one temporary directory the sections share
    with contextlib.ExitStack() as stack:
        if args.work_dir is None:
            args.work_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="longserve-gpu-"))
        for s in sections:
            if out.over_budget():
                out.row(section=s, skipped="over --budget-s")
                continue
            t = time.perf_counter()
            # a section that sets an attention backend on a model sets the process's too (engine/attention.py):
            # each section starts from, and leaves, the process's own
            with contextlib.suppress(KeyboardInterrupt), keeping_active_backend():
                try:
                    funcs[s](args, out, dev)
                except Exception as err:  # noqa: BLE001 - one section failing must not lose the others' figures
                    import traceback

                    traceback.print_exc()
                    out.row(section=s, error=f"{type(err).__name__}: {err}"[:400])
            out.row(section=s, seconds=time.perf_counter() - t, done=True)
    return 0
