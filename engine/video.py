"""Video generation on the worker pool: the jobs a coordinator sends, and their worker-side state.

A request lives on the workers from `admit` to `release`. Every worker holds the same
latent and its own copy of the request's scheduler (elementwise, cheap), so after each
parallel transformer forward (whose output every rank receives) all ranks take the same
scheduler step and stay in lockstep. What is placed where:

- prompt encoding: once per request, on rank 0 only (the only rank that loads the text
  encoder), through diffusers' own `LattePipeline.encode_prompt`; the embeddings are
  then broadcast to the group.
- denoising: `step` runs one denoising step for a *batch of requests* (they may be at
  different timesteps and guidance scales; prompts of different lengths are padded and
  masked), the transformer sharded by the chosen strategy (DSP by default).
- decoding: `decode` splits the frames of a finished request across the workers
  (Latte's VAE decodes frame by frame), each decodes its share in chunks that bound
  memory, and rank 0 gathers and post-processes them.

The coordinator (`pipelines.VideoPipeline`, or `engine.scheduler.StepScheduler` for the
server) decides which requests each `step` runs; it never touches the model.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine import comm
from engine.dist import parse_dtype
from engine.latte import check_strategy, make_cfg_groups, parallel_forward

@dataclass
class GenerationSpec:
    """One request, as validated by the pipeline (plain data: it travels to the workers)."""

    request_id: str
    prompt: list[str]
    negative_prompt: list[str] | str
    num_frames: int
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    decode_chunk_size: int = 8

    @property
    def batch_size(self) -> int:
        return len(self.prompt)

    @property
    def use_cfg(self) -> bool:
        return self.guidance_scale > 1.0


@dataclass
class _Request:
    spec: GenerationSpec
    scheduler: object
    timesteps: torch.Tensor
    latents: torch.Tensor          # (B, C, T, h, w), identical on every rank
    text: torch.Tensor             # (2B or B, L, C_text): [negative; positive] when CFG
    step_kwargs: dict
    step_index: int = 0
    timings: dict = field(default_factory=lambda: {"encode_s": 0.0, "transformer_s": 0.0, "vae_s": 0.0})


def setup_video_worker(ctx, model_dir: str, strategy: str = "dsp", dtype: str = "float32",
                       cfg_parallel: bool = False, attention: str = "auto") -> None:
    """Load the Latte pipeline once on this worker (text encoder on rank 0 only)."""
    import diffusers
    import transformers

    check_strategy(strategy)
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    torch_dtype = parse_dtype(dtype)
    skip = {} if ctx.pg.rank == 0 else {"text_encoder": None, "tokenizer": None}
    pipe = diffusers.LattePipeline.from_pretrained(model_dir, dtype=torch_dtype, **skip)
    pipe.to(ctx.pg.device)
    pipe.set_progress_bar_config(disable=True)
    ctx.state["attention"] = _select_attention(pipe.transformer, ctx.pg.device, attention)
    ctx.state.update(
        pipe=pipe,
        strategy=strategy,
        dtype=torch_dtype,
        requests={},
        cfg=make_cfg_groups(ctx.pg) if cfg_parallel and ctx.pg.world_size > 1 else None,
    )


def _select_attention(transformer, device: torch.device, attention: str) -> str:
    """xformers on CUDA when installed (and asked for or 'auto'); else PyTorch SDPA."""
    if attention not in ("auto", "sdpa", "xformers"):
        raise ValueError(f"attention must be auto, sdpa or xformers; got {attention!r}")
    if device.type == "cuda" and attention in ("auto", "xformers"):
        try:
            import xformers  # noqa: F401

            transformer.enable_xformers_memory_efficient_attention()
            return "xformers"
        except ImportError:
            if attention == "xformers":
                raise ValueError("attention='xformers' but xformers is not installed (pip install '.[gpu]')")
    return "sdpa"


def set_strategy(ctx, strategy: str) -> None:
    """Switch the parallel strategy of a running pool (weights stay loaded)."""
    ctx.state["strategy"] = check_strategy(strategy)


def model_info(ctx) -> dict:
    """What the coordinator needs to validate requests: sizes, limits, the scheduler's name."""
    pipe = ctx.state["pipe"]
    cfg = pipe.transformer.config
    return {
        "vae_scale_factor": pipe.vae_scale_factor,
        "patch_size": cfg.patch_size,
        "sample_size": cfg.sample_size,
        "video_length": cfg.video_length,
        "in_channels": cfg.in_channels,
        "scheduler": type(pipe.scheduler).__name__,
        "strategy": ctx.state["strategy"],
        "attention": ctx.state["attention"],
        "device": str(ctx.pg.device),
        "dtype": str(ctx.state["dtype"]).replace("torch.", ""),
        "workers": ctx.pg.world_size,
    }


def admit(ctx, spec: GenerationSpec) -> dict:
    """Encode the prompt (rank 0), share it, and prepare latents and a scheduler for one request."""
    pipe, pg = ctx.state["pipe"], ctx.pg
    t0 = time.perf_counter()
    text = None
    if pg.rank == 0:
        with torch.no_grad():
            positive, negative = pipe.encode_prompt(
                spec.prompt, spec.use_cfg, negative_prompt=spec.negative_prompt, num_images_per_prompt=1,
                device=pg.device, clean_caption=False, mask_feature=True,
            )
        text = torch.cat([negative, positive]) if spec.use_cfg else positive   # (2B or B, L, C_text)
        text = text.cpu()
    text = comm.broadcast_object(text, pg).to(pg.device)
    encode_s = time.perf_counter() - t0

    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(spec.num_inference_steps, device=pg.device)
    shape = (spec.batch_size, pipe.transformer.config.in_channels, spec.num_frames,
             spec.height // pipe.vae_scale_factor, spec.width // pipe.vae_scale_factor)
    # the same noise as diffusers with generator=torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn(shape, generator=torch.Generator("cpu").manual_seed(spec.seed), dtype=ctx.state["dtype"])
    latents = noise.to(pg.device) * scheduler.init_noise_sigma
    step_kwargs = {}
    params = set(inspect.signature(scheduler.step).parameters)
    if "eta" in params:
        step_kwargs["eta"] = 0.0
    req = _Request(spec=spec, scheduler=scheduler, timesteps=scheduler.timesteps, latents=latents,
                   text=text.to(ctx.state["dtype"]), step_kwargs=step_kwargs)
    req.timings["encode_s"] = encode_s
    ctx.state["requests"][spec.request_id] = req
    return {"request_id": spec.request_id, "steps": len(req.timesteps), "encode_s": encode_s}


def _pad_text(texts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate prompt embeddings of different lengths: zero-pad, and a mask when lengths differ.

    [(b_i, L_i, C)] -> (sum b_i, max L_i, C), mask (sum b_i, max L_i) or None
    """
    L = max(t.shape[1] for t in texts)
    if all(t.shape[1] == L for t in texts):
        return torch.cat(texts), None
    padded = torch.cat([comm.pad_dim(t, 1, L) for t in texts])
    mask = torch.cat([(torch.arange(L, device=t.device) < t.shape[1]).expand(t.shape[0], L) for t in texts])
    return padded, mask


def step(ctx, request_ids: list[str]) -> dict:
    """One denoising step for every listed request, batched into one parallel forward.

    Returns {request_id: steps done} (rank 0) and the transformer time.
    """
    pipe, pg = ctx.state["pipe"], ctx.pg
    reqs = [ctx.state["requests"][rid] for rid in request_ids]
    t0 = time.perf_counter()
    use_cfg_parallel = ctx.state["cfg"] is not None and all(r.spec.use_cfg for r in reqs)
    inputs, times, texts = [], [], []
    for r in reqs:
        t = r.timesteps[r.step_index]
        x = torch.cat([r.latents] * 2) if r.spec.use_cfg else r.latents           # (2B|B, C, T, h, w)
        inputs.append(r.scheduler.scale_model_input(x, t))
        times.append(t.reshape(1).expand(x.shape[0]))
        texts.append(r.text)
    if use_cfg_parallel:
        # CFG-parallel wants every unconditional half first, then every conditional half.
        halves = lambda xs: [h for part in (0, 1) for x in xs for h in [x.chunk(2)[part]]]  # noqa: E731
        inputs, times, texts = halves(inputs), halves(times), halves(texts)
    text, mask = _pad_text(texts)
    with torch.no_grad():
        noise = parallel_forward(pipe.transformer, torch.cat(inputs), torch.cat(times).to(pg.device), text, pg,
                                 ctx.state["strategy"], cfg=ctx.state["cfg"] if use_cfg_parallel else None,
                                 encoder_attention_mask=mask)                      # (sum, C_out, T, h, w)
    sizes = [r.latents.shape[0] * (2 if r.spec.use_cfg else 1) for r in reqs]
    if use_cfg_parallel:
        uncond, cond = noise.chunk(2)
        half_sizes = [s // 2 for s in sizes]
        per_req = [torch.cat([u, c]) for u, c in zip(uncond.split(half_sizes), cond.split(half_sizes))]
    else:
        per_req = list(noise.split(sizes))
    learned_sigma = getattr(pipe.scheduler.config, "variance_type", None) in ("learned", "learned_range")
    done = {}
    with torch.no_grad():
        for r, eps in zip(reqs, per_req):
            if r.spec.use_cfg:
                uncond, cond = eps.chunk(2)
                eps = uncond + r.spec.guidance_scale * (cond - uncond)
            if not learned_sigma:
                eps = eps.chunk(2, dim=1)[0]
            t = r.timesteps[r.step_index]
            r.latents = r.scheduler.step(eps, t, r.latents, **r.step_kwargs, return_dict=False)[0]
            r.step_index += 1
            done[r.spec.request_id] = r.step_index
    elapsed = time.perf_counter() - t0
    for r in reqs:
        r.timings["transformer_s"] += elapsed / len(reqs)
    return {"done": done, "compute_s": elapsed}


def _decode_split(ctx, r: _Request, start: int, stop: int) -> np.ndarray | None:
    """VAE-decode frames [start, stop) of every video in the request, split across the workers.

    Each rank decodes its share of the B*(stop-start) frames (Latte's VAE is per-frame) in
    chunks of `decode_chunk_size`; rank 0 gathers them and returns diffusers' "np" output,
    float32 (B, stop - start, H, W, 3) in [0, 1]; other ranks return None.
    """
    pipe, pg = ctx.state["pipe"], ctx.pg
    B, C, T, h, w = r.latents.shape
    t0 = time.perf_counter()
    n = stop - start
    frames = r.latents[:, :, start:stop].permute(0, 2, 1, 3, 4).flatten(0, 1)  # (B*n, C, h, w)
    frames = frames / pipe.vae.config.scaling_factor
    mine = comm.shard(frames, 0, pg)                                           # (ceil(B*n/N), C, h, w)
    count = comm.valid_length(B * n, pg)                                       # real frames in my shard
    chunk = max(1, r.spec.decode_chunk_size)
    with torch.no_grad():
        outs = [pipe.vae.decode(mine[i:min(i + chunk, count)]).sample for i in range(0, count, chunk)]
    f = pipe.vae_scale_factor
    decoded = torch.cat(outs) if outs else mine.new_zeros((0, pipe.vae.config.out_channels, h * f, w * f))
    decoded = comm.pad_dim(decoded, 0, mine.shape[0])                          # (ceil(B*n/N), 3, H, W)
    video = comm.gather(decoded, 0, B * n, pg)                                 # (B*n, 3, H, W)
    r.timings["vae_s"] += time.perf_counter() - t0
    if pg.rank != 0:
        return None
    video = video.reshape(B, n, *video.shape[1:]).permute(0, 2, 1, 3, 4).float()  # (B, 3, n, H, W)
    return pipe.video_processor.postprocess_video(video=video.cpu(), output_type="np")  # (B, n, H, W, 3)


def decode(ctx, request_id: str, output_type: str = "np"):
    """Decode a finished request's frames across the workers; rank 0 returns the video.

    output_type "np": float32 (B, T, H, W, 3) in [0, 1], as diffusers; "latent": (B, C, T, h, w).
    """
    r = ctx.state["requests"][request_id]
    if output_type == "latent":
        return {"video": r.latents.cpu() if ctx.pg.rank == 0 else None, "timings": dict(r.timings)}
    video = _decode_split(ctx, r, 0, r.latents.shape[2])
    return None if video is None else {"video": video, "timings": dict(r.timings)}


def release(ctx, request_ids: list[str]) -> None:
    for rid in request_ids:
        ctx.state["requests"].pop(rid, None)


def decode_frames(ctx, request_id: str, start: int, stop: int) -> dict | None:
    """Decode frames [start, stop) of a denoised request across the workers; rank 0 gets uint8 pixels.

    The coordinator calls this chunk after chunk (and may run denoising steps of other
    requests in between), so a long video streams out while it is still being decoded
    and no single call holds the VAE for the whole video. Pixels are those `decode` gives,
    quantized as `pipelines.video.save_video` does: round(clip(x, 0, 1) * 255).
    Rank 0 returns {"frames": uint8 (B, stop - start, H, W, 3), "vae_s": seconds}.
    """
    r = ctx.state["requests"][request_id]
    T = r.latents.shape[2]
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= T):
        raise ValueError(f"frame range must satisfy 0 <= start < stop <= {T}; got [{start}, {stop})")
    vae_before = r.timings["vae_s"]
    video = _decode_split(ctx, r, start, stop)
    if video is None:
        return None
    pixels = (video.clip(0, 1) * 255).round().astype("uint8")
    return {"frames": pixels, "vae_s": r.timings["vae_s"] - vae_before}
