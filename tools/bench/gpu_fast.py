"""`longserve bench gpu --profile fast` sections (docs/gpu.md, "To run when lent"): the fast profile lever by lever
against exact and diffusers, a whole Wan 1.3B video and one step at the Wan 2.1 I2V 14B 480p shape.

- `fast`: one whole video of the Wan 2.1 1.3B-shaped checkpoint (tools/bench/gpu_wan.py's, built once under
  `--work-dir`) through `VideoPipeline`: exact (bf16), then each lever the fast profile turns on on this device alone
  (engine/profile.py: an engine lever on its own engine, a request lever as the request's option), then the whole
  profile (`profile="fast"`), then diffusers' `WanPipeline` (bf16) at the same work: wall time, its ratio to exact
  and to diffusers, and the frames' PSNR against exact's (what each lever costs in quality).
- `step-14b`: one denoising step (the CFG batch of 2) at the Wan 2.1 I2V 14B shape (the published widths: 40 heads
  x 128, FFN 13824, 36 input channels, CLIP image tokens 257 x 1280) and 480p, 81 frames (21 x 60 x 104 latents:
  32760 tokens), with `--step-layers` of its 40 blocks (seeded random weights: a 14B model does not fit one GPU's
  time budget to build, and a step's time is its blocks' times), the figure scaled back to 40 blocks (x 40 /
  layers, said in the row). Rows: diffusers' forward, ours with the fast profile's step levers (regional compile, the
  best attention backend installed; ours exact is diffusers' step within 0.4%, docs/gpu.md), and FP8 weights with
  compile (engine/quantize.py; a row that cannot run says why). LightX2V's published one-H100 figure for this shape
  is 5.18 s per step (docs/gpu.md).

`--smoke`: tiny shapes, CPU-runnable: the mechanism, not the figures.
"""

from __future__ import annotations

import math
import time

PROMPT = "a red ball bouncing"
I2V_14B_LAYERS = 40
LIGHTX2V_14B_480P_STEP_S = 5.18      # LightX2V's published table, one H100 (docs/gpu.md)


def _psnr(a, b) -> float | None:
    import numpy as np

    if a is None or b is None or a.shape != b.shape:
        return None
    mse = float(np.mean((a.astype(np.float64) - b) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _video(pipe, steps, kw, **options):
    pipe(PROMPT, num_inference_steps=2, seed=0, **kw, **options)        # warm-up (and the compiled graphs)
    t = time.perf_counter()
    res = pipe(PROMPT, num_inference_steps=steps, seed=0, **kw, **options)
    return time.perf_counter() - t, res


def fast_profile(args, out, dev) -> None:
    import numpy as np
    import torch
    from diffusers import WanPipeline

    from longserve.engine.config import EngineConfig
    from longserve.engine.families import detect_family
    from longserve.engine.profile import fast_levers
    from longserve.pipelines import VideoPipeline
    from tools.bench.gpu_models import build_wan_dir, device_sync, free
    from tools.bench.gpu_wan import checkpoint, wan_video_kwargs

    steps = 3 if args.smoke else args.lever_steps
    kw = wan_video_kwargs(args.smoke)
    d = checkpoint(args, "wan2.1-1.3b", build_wan_dir)
    base = dict(workers=1, device=dev.type, dtype="float32" if args.smoke else "bfloat16")
    family = detect_family(d)
    desc = family.describe(d)
    config = EngineConfig(model=str(d), profile="fast", **base)
    plan = family.resolve_plan(desc, config.parallel, 1, None, False)
    levers = fast_levers(config, family, desc, plan, dev.type)
    if args.smoke and "compile" in levers:
        levers["compile"] = "blocks"
    rows = [("exact", {}, {})]
    for field, value in levers.items():
        if field in ("cache", "cfg_trunc_ratio"):
            from tools.bench.speed import request_options

            rows.append((f"{field}={value}", {}, request_options(field, value)))
        else:
            rows.append((f"{field}={value}", {field: value}, {}))
    rows.append(("profile fast", {"profile": "fast"}, {}))
    exact = exact_s = None
    for name, engine_options, request in rows:
        if out.over_budget():
            return
        try:
            extra = {"compile_backend": "eager"} if args.smoke and engine_options.get("compile") else {}
            if args.smoke and name == "profile fast" and "compile" in levers:
                extra = {"compile_backend": "eager"}
            with VideoPipeline.from_pretrained(str(d), **base, **engine_options, **extra) as pipe:
                wall, res = _video(pipe, steps, kw, **request)
        except Exception as err:  # noqa: BLE001 - a lever that cannot run here is a finding, not the end
            out.row(section="fast", lever=name, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
            free(dev)
            continue
        if name == "exact":
            exact, exact_s = res.frames, wall
        out.row(section="fast", lever=name, steps=steps, wall_s=wall,
                vs_exact=exact_s / wall if exact_s else None, transformer_s=res.timings.get("transformer_s"),
                vae_s=res.timings.get("vae_s"), psnr_vs_exact_db=_psnr(res.frames, exact), **kw)
        free(dev)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    ref = WanPipeline.from_pretrained(str(d), torch_dtype=dtype).to(dev)
    ref.set_progress_bar_config(disable=True)

    def theirs(n, ref=ref):
        return ref(PROMPT, num_inference_steps=n, generator=torch.Generator("cpu").manual_seed(0),
                   output_type="np", **kw).frames

    theirs(2)
    device_sync(dev)
    t = time.perf_counter()
    frames = np.asarray(theirs(steps))
    device_sync(dev)
    wall = time.perf_counter() - t
    out.row(section="fast", lever="diffusers WanPipeline", steps=steps, wall_s=wall,
            vs_exact=exact_s / wall if exact_s else None,
            psnr_vs_exact_db=_psnr(frames.reshape(exact.shape), exact) if exact is not None else None, **kw)
    del ref
    free(dev)


def i2v_14b_config(smoke: bool, layers: int) -> dict:
    """Wan 2.1 I2V 14B's transformer config (the published widths), with `layers` blocks."""
    from tools.bench.gpu_models import WAN_SMOKE
    from tools.weights.wan import WAN_2_1_T2V_14B_TRANSFORMER, init_kwargs

    cfg = init_kwargs(WAN_2_1_T2V_14B_TRANSFORMER)
    cfg.update(in_channels=36, image_dim=1280, added_kv_proj_dim=5120, num_layers=layers)
    if smoke:
        cfg.update(WAN_SMOKE, in_channels=8, image_dim=16, added_kv_proj_dim=36, num_layers=layers)
    return cfg


def step_14b(args, out, dev) -> None:
    import torch

    from longserve.engine.profile import best_attention_backend
    from tools.bench.gpu_models import build_wan, free, solo_group, time_call, wan_inputs

    layers = args.step_layers
    cfg = i2v_14b_config(args.smoke, layers)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    frames, h, w = (2, 4, 6) if args.smoke else (21, 60, 104)                 # 81 frames, 480x832
    x, t, e = wan_inputs(cfg, frames, h, w, dev, dtype)
    x = torch.cat([x, x[:, :4]], dim=1)[:, :cfg["in_channels"]]                # the I2V condition channels
    image = torch.randn(2, 257, cfg["image_dim"], device=dev, dtype=dtype)     # CLIP image tokens
    scale = I2V_14B_LAYERS / layers
    repeats = 1 if args.smoke else max(1, args.repeats)

    def timed(fn):
        with torch.no_grad():
            for _ in range(1 if args.smoke else 2):
                fn(x, t, e)
            return min(time_call(dev, fn, x, t, e) for _ in range(repeats))

    tokens = frames * (h // 2) * (w // 2)
    common = dict(section="step-14b", layers=layers, scaled_to_layers=I2V_14B_LAYERS, tokens=tokens,
                  lightx2v_h100_step_s=LIGHTX2V_14B_480P_STEP_S)

    def row(name, fn):
        if out.over_budget():
            return
        try:
            s = timed(fn)
        except Exception as err:  # noqa: BLE001 - a lever that cannot run here is a finding, not the end
            out.row(**common, variant=name, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
            return
        out.row(**common, variant=name, step_s_measured=s, step_s_at_40_layers=s * scale)

    from longserve.engine.compile import compile_blocks
    from longserve.engine.models.wan import WanSequenceParallel
    from longserve.engine.parallel import make_sequence_parallel

    sp = make_sequence_parallel(solo_group(dev), "ulysses")
    model = build_wan(cfg).to(dev, dtype)
    row("diffusers forward", lambda a, b, c: model(a, b, c, encoder_hidden_states_image=image, return_dict=False)[0])
    # ours with the step's fast levers: compile first (before the plan's hooks, engine/compile.py), then the hooks;
    # ours exact is diffusers' step within 0.4% (docs/gpu.md), so the diffusers row stands for it
    backend = best_attention_backend(_WanFamily(), _Plan(), 1) if dev.type == "cuda" else None
    if backend is not None:
        for m in model.modules():
            if hasattr(m, "set_attention_backend"):
                m.set_attention_backend(backend)
    compile_blocks(model.blocks, backend="eager" if args.smoke else "inductor")
    hooked = WanSequenceParallel(model)
    row(f"ours fast (compile blocks, attention {backend or 'default'})",
        lambda a, b, c: hooked(a, b, c, sp, image=image))
    del model, hooked
    free(dev)
    if dev.type != "cuda":
        out.row(**common, variant="ours fp8 + compile", skipped="FP8 needs CUDA (compute capability >= 8.9)")
        return
    try:
        from longserve.engine.quantize import quantize_fp8

        model = build_wan(cfg).to(dev, dtype)
        quantize_fp8(model)
        compile_blocks(model.blocks)
        hooked = WanSequenceParallel(model)
        row("ours fp8 + compile", lambda a, b, c: hooked(a, b, c, sp, image=image))
    except Exception as err:  # noqa: BLE001
        out.row(**common, variant="ours fp8 + compile", error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
    free(dev)


class _WanFamily:
    """What `best_attention_backend` reads of a family, for a bare Wan transformer (the Wan family's facts)."""

    name = "wan"
    dispatcher_attention = True
    dispatcher_attention_note = ""
    merges_across_workers = None


class _Plan:
    name = "ulysses"
    cfg_parallel = False
    ulysses_degree = None
