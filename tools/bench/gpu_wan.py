"""`longserve bench gpu` sections on a Wan 2.1 1.3B-shaped checkpoint (docs/gpu.md): where a whole video's time
goes against diffusers', and the speed levers (FP8 weights, regional compile) on it.

- `wan-stages`: one whole video through `VideoPipeline` (1 worker) and through diffusers' `WanPipeline` on the same
  checkpoint directory, twice: with the VAE in bfloat16 (diffusers' pipeline loaded whole in bf16; ours with
  `--vae-dtype bfloat16`) and in float32 (how diffusers' Wan examples load it; our default). Then diffusers'
  pipeline again with its stages timed (prompt encoding, every transformer call, the VAE decode, each waited for
  on the device), beside our `VideoOutput.timings`. The plain runs give the ratio; the timed run says which stage
  holds the difference (the device waits it adds are a few per step).
- `levers`: the same video at `--lever-steps` steps, exact (bf16) against `--quantize fp8`, `--compile blocks` and
  both, each on its own engine: wall time, transformer time per step, compile time, and the largest frame
  difference from the exact row's frames.

The checkpoint (the full transformer with seeded random weights, a full-size random VAE, a one-layer text encoder as
wide as the real one) is built once under `--work-dir` and reused by every section and every later command that
names the same directory.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

PROMPT = "a red ball bouncing"


def wan_video_kwargs(smoke: bool) -> dict:
    return dict(num_frames=5 if smoke else 17, height=48 if smoke else 480, width=80 if smoke else 832,
                guidance_scale=5.0)


def checkpoint(args, name: str, build) -> Path:
    """`build(dir, smoke)`'s directory under `args.work_dir`, built once (whole or not at all) and reused."""
    root = Path(args.work_dir)
    d = root / (name + ("-smoke" if args.smoke else ""))
    if not (d / "model_index.json").is_file():
        work = root / f".{d.name}.partial"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        build(work, args.smoke)
        work.rename(d)
    return d


class StageTimer:
    """Wraps a diffusers pipeline's `encode_prompt`, `transformer.forward` and `vae.decode` to add their wall time
    (each waited for on the device) to `self.seconds[stage]`."""

    def __init__(self, pipe, sync):
        self.seconds = {"encode_s": 0.0, "transformer_s": 0.0, "vae_s": 0.0}
        self.calls = {"transformer": 0}
        self._undo = []
        self._wrap(pipe, "encode_prompt", "encode_s", sync)
        self._wrap(pipe.transformer, "forward", "transformer_s", sync, count="transformer")
        self._wrap(pipe.vae, "decode", "vae_s", sync)

    def _wrap(self, obj, attr, key, sync, count=None):
        inner = getattr(obj, attr)

        def timed(*a, **kw):
            sync()
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                sync()
                self.seconds[key] += time.perf_counter() - t
                if count:
                    self.calls[count] += 1

        setattr(obj, attr, timed)
        self._undo.append((obj, attr))

    def close(self):
        for obj, attr in self._undo:
            obj.__dict__.pop(attr, None)


def wan_stages(args, out, dev) -> None:
    import numpy as np
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline

    from longserve.pipelines import VideoPipeline
    from tools.bench.gpu_models import build_wan_dir, device_sync, free

    steps = 3 if args.smoke else 50
    kw = wan_video_kwargs(args.smoke)
    d = checkpoint(args, "wan2.1-1.3b", build_wan_dir)
    sync = lambda: device_sync(dev)  # noqa: E731
    ours = {}
    for vae_dtype in (None, "bfloat16"):            # the engine's default float32 VAE, and --vae-dtype bfloat16
        with VideoPipeline.from_pretrained(str(d), workers=1, device=dev.type, dtype="bfloat16",
                                           vae_dtype=vae_dtype) as pipe:
            if not args.smoke:                                   # (a smoke run checks the rows, not the times)
                pipe(PROMPT, num_inference_steps=2, seed=0, **kw)  # warm-up
            t = time.perf_counter()
            res = pipe(PROMPT, num_inference_steps=steps, seed=0, **kw)
            ours[vae_dtype or "float32"] = (time.perf_counter() - t, res)
        free(dev)
    for vae_dtype in ("bfloat16", "float32"):       # the whole pipeline in bf16; its VAE in fp32 (diffusers' Wan docs)
        vae = AutoencoderKLWan.from_pretrained(str(d), subfolder="vae", torch_dtype=getattr(torch, vae_dtype))
        ref = WanPipeline.from_pretrained(str(d), vae=vae, torch_dtype=torch.bfloat16).to(dev)
        ref.set_progress_bar_config(disable=True)

        def theirs(n=steps, ref=ref):
            return ref(PROMPT, num_inference_steps=n, generator=torch.Generator("cpu").manual_seed(0),
                       output_type="np", **kw).frames

        if not args.smoke:
            theirs(2)                                            # warm-up
        sync()
        t = time.perf_counter()
        frames = theirs()
        sync()
        theirs_s = time.perf_counter() - t
        timer = StageTimer(ref, sync)
        t = time.perf_counter()
        theirs()
        sync()
        timed_s = time.perf_counter() - t
        timer.close()
        frames = np.asarray(frames[0] if isinstance(frames, list) else frames)
        ours_s, res = ours[vae_dtype]
        diff = float(np.abs(res.frames.reshape(frames.shape) - frames).max()) \
            if res.frames.size == frames.size else None
        tm = res.timings
        out.row(section="wan-stages", vae_dtype=vae_dtype, steps=steps, ours_s=ours_s, diffusers_s=theirs_s,
                ratio=ours_s / theirs_s,
                ours_stages={k: tm.get(k) for k in ("encode_s", "transformer_s", "vae_s", "overhead_s")},
                diffusers_timed_s=timed_s, diffusers_stages=dict(timer.seconds),
                diffusers_other_s=timed_s - sum(timer.seconds.values()), diffusers_transformer_calls=timer.calls,
                max_abs_diff_vs_diffusers=diff, **kw)
        del ref, vae
        free(dev)


def levers(args, out, dev) -> None:
    import numpy as np

    from longserve.pipelines import VideoPipeline
    from tools.bench.gpu_models import build_wan_dir, free

    steps = 3 if args.smoke else args.lever_steps
    kw = wan_video_kwargs(args.smoke)
    d = checkpoint(args, "wan2.1-1.3b", build_wan_dir)
    # the engine compiles at the model's default size when it loads: make that this video's size, so the timed
    # runs use the graphs compiled then (static shapes), as a server whose default is the size it serves would
    defaults = d / "generation_defaults.json"
    if not defaults.is_file():
        defaults.write_text(json.dumps({k: kw[k] for k in ("height", "width", "num_frames")}) + "\n")
    rows = [("exact", {}), ("fp8", {"quantize": "fp8"}), ("compile", {"compile": "blocks"}),
            ("fp8+compile", {"quantize": "fp8", "compile": "blocks"})]
    wanted = [x for x in args.levers.split(",") if x] or [name for name, _ in rows]
    unknown = sorted(set(wanted) - {name for name, _ in rows})
    if unknown:
        raise ValueError(f"--levers: unknown {', '.join(unknown)}; choose from {', '.join(n for n, _ in rows)}")
    exact = None
    for name, opts in rows:
        if name not in wanted:
            continue
        if out.over_budget():
            return
        if opts.get("quantize") and dev.type != "cuda":
            out.row(section="levers", lever=name, skipped="fp8 needs CUDA")
            continue
        try:
            t = time.perf_counter()
            with VideoPipeline.from_pretrained(str(d), workers=1, device=dev.type, dtype="bfloat16", **opts) as pipe:
                load_s = time.perf_counter() - t
                t = time.perf_counter()
                pipe(PROMPT, num_inference_steps=2, seed=0, **kw)  # warm-up (compile: this size's graphs)
                first_s = time.perf_counter() - t
                t = time.perf_counter()
                res = pipe(PROMPT, num_inference_steps=steps, seed=0, **kw)
                wall = time.perf_counter() - t
                info = pipe.info
        except Exception as err:  # noqa: BLE001 - a lever that cannot run here is a finding, not the end
            out.row(section="levers", lever=name, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
            free(dev)
            continue
        frames = res.frames
        if exact is None and name == "exact":
            exact = frames
        diff = float(np.abs(frames - exact).max()) if exact is not None and exact.shape == frames.shape else None
        out.row(section="levers", lever=name, steps=steps, wall_s=wall, transformer_s=res.timings["transformer_s"],
                step_ms=1000 * res.timings["transformer_s"] / steps, load_s=load_s, first_video_s=first_s,
                compile_s=info.compile_s, compiled_graphs=info.compiled_graphs, max_abs_diff_vs_exact=diff, **kw)
        del pipe, res
        free(dev)
    if exact is None:
        out.row(section="levers", note="no exact row: nothing to compare with")
