"""Train `weights/tiny-decoder-live/tiny_decoder.pth`: a small TAEHV-shaped decoder (engine/small_decoder.py) for
tiny-live's latents, the `decoder="tiny"` of `make demo-live DECODER=tiny`.

Usage::

    python -m tools.weights.train_tiny_decoder     # rewrites weights/tiny-decoder-live/, train_tiny_decoder_live.json
    python -m tools.weights.train_tiny_decoder --out DIR --steps 4 --videos 2   # a smoke run

The recipe: tiny-live makes `--videos` videos (the 8 bouncing prompts, in turn, and every other one switching
colour halfway through, as the live demo does) as latents; its own VAE (diffusers' `AutoencoderKLWan`, float32)
decodes them whole: those frames are the targets. The decoder (widths 24, 16, 16, 16; no time upscale, as tiny-live's
VAE has none; 8x in space) learns latents -> frames on random stretches of `WINDOW` consecutive latent frames (its
memory blocks start from zeros at a stretch's first frame, as at a stream's start), with a squared error in [0, 1]
pixels plus one on the frame-to-frame change (no flicker), AdamW, cosine learning rate, EMA weights. The weights are
stored in float16 (the published TAEHV files' precision; the loader reads them as float32), a state dict with
TAEHV's `decoder.<index>` keys. Everything is seeded and runs on the CPU in a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "weights" / "tiny-decoder-live"
WIDTHS = (24, 16, 16, 16)
WINDOW = 5                  # latent frames a training stretch
BATCH = 4                   # stretches a step
PROMPTS = [f"a {c} {s} bouncing" for c in ("red", "green", "blue", "yellow") for s in ("ball", "square")]


def make_videos(videos: int, seed: int, log) -> tuple[torch.Tensor, torch.Tensor]:
    """tiny-live's latents (V, C, T, h, w) and its VAE's frames of them (V, T, 3, H, W) in [0, 1]."""
    from diffusers import AutoencoderKLWan

    from longserve.pipelines import VideoPipeline
    from longserve.weights.registry import TINY_MODELS

    model = TINY_MODELS["tiny-live"]
    latents = []
    with VideoPipeline.from_pretrained("tiny-live", workers=1) as pipe:
        for i in range(videos):
            prompt, other = PROMPTS[i % len(PROMPTS)], PROMPTS[(i * 3 + 2) % len(PROMPTS)]
            kw = {"prompt_schedule": [[0, prompt], [4, other]]} if i % 2 else {}
            out = pipe("" if kw else prompt, seed=seed + i, num_frames=24, output_type="latent", **kw)
            latents.append(torch.as_tensor(out.frames).float())
            log(f"video {i + 1}/{videos}: {prompt!r}" + (f" -> {other!r}" if kw else ""))
    latents = torch.cat(latents)                                                  # (V, C, T, h, w)
    vae = AutoencoderKLWan.from_pretrained(model / "vae").eval()
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(latents * std + mean).sample                           # (V, 3, T, H, W) in [-1, 1]
    return latents, (video / 2 + 0.5).clamp(0, 1).transpose(1, 2).contiguous()


def train(out: Path, *, seed: int, steps: int, videos: int, lr: float, threads: int, log=print) -> dict:
    from longserve.engine.small_decoder import SmallDecoder

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    t0 = time.perf_counter()
    latents, frames = make_videos(videos, seed, log)
    made_s = time.perf_counter() - t0
    C, T = latents.shape[1], latents.shape[2]
    model = SmallDecoder(C, WIDTHS, (1, 1, 1), 1)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * (0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * step / max(1, steps))))
        v = torch.randint(len(latents), (BATCH,), generator=g)
        start = torch.randint(T - WINDOW + 1, (BATCH,), generator=g)
        z = torch.stack([latents[a, :, s:s + WINDOW] for a, s in zip(v.tolist(), start.tolist())])
        want = torch.stack([frames[a, s:s + WINDOW] for a, s in zip(v.tolist(), start.tolist())])
        got = model.decode(z, model.start())                                        # (B, WINDOW, 3, H, W)
        loss = (got - want).pow(2).mean() + (got.diff(dim=1) - want.diff(dim=1)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        decay = min(0.99, (1 + step) / (10 + step))
        with torch.no_grad():
            for k, p in model.state_dict().items():
                ema[k].mul_(decay).add_(p, alpha=1 - decay)
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            log(f"step {step + 1}/{steps}: loss {np.mean(losses[-50:]):.5f}, {time.perf_counter() - t0:.0f} s")
    model.load_state_dict(ema)
    with torch.no_grad():                                                           # whole videos, streamed
        mse = float((model.decode(latents, model.start()) - frames).pow(2).mean())
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "tiny_decoder.pth.tmp"
    torch.save({k: v.half() for k, v in model.state_dict().items()}, tmp)
    os.replace(tmp, out / "tiny_decoder.pth")
    record = {"seed": seed, "steps": steps, "videos": videos, "lr": lr, "threads": threads, "widths": WIDTHS,
              "params": sum(p.numel() for p in model.parameters()), "bytes": (out / "tiny_decoder.pth").stat().st_size,
              "final_loss": float(np.mean(losses[-50:])), "video_mse_vs_vae": mse,
              "make_videos_s": round(made_s, 1), "seconds": round(time.perf_counter() - t0, 1)}
    # the record beside the directory (weights/train_tiny_decoder.json), as the other trainers': not installed
    (out.parent / f"train_{out.name.replace('-', '_')}.json").write_text(json.dumps(record, indent=1) + "\n")
    log(json.dumps(record))
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.weights.train_tiny_decoder", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--videos", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (results depend on it)")
    args = ap.parse_args(argv)
    train(Path(args.out).resolve(), seed=args.seed, steps=args.steps, videos=args.videos, lr=args.lr,
          threads=args.threads, log=lambda msg: print(msg, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
