"""Evaluate a causal tiny-live checkpoint: a long video whose prompt changes, made by a *recompute* sampler that
follows the runtime's semantics without a cache, and read back chunk by chunk with the content helper.

Usage::

    PYTHONPATH=.:tests/support python -m tools.weights.eval_tiny_live [--model weights/tiny-live] [--seconds 30]
        [--switch-at 15] [--seeds 0 1] [--frames-png out.png] [--cache]

The sampler (independent of the training code: diffusers' own rotary embedding and cross-attention, only
the self-attention mask is added): for chunk c, the context is the previous clean frames, at most
L - F_b of them (the first K, then the most recent), at positions 0..P-1; the chunk's frames are at
P..P+F_b-1. The model runs on [context at t = context_noise | the chunk at t_i], a context chunk seeing the
context chunks up to itself, the chunk seeing the whole context and itself, everything under the current
caption (after a prompt change the runtime recomputes the cached frames' K/V under the new caption, so the
context is always under the current caption). Steps: x0 = x - sigma_i v, then x = (1 - sigma_{i+1}) x0 +
sigma_{i+1} noise; the chunk is the last x0. The latents are de-normalised with the VAE's latents_mean /
latents_std and decoded by `AutoencoderKLWan.decode` (causal, frame by frame).

`--cache` samples in the runtime's own form instead: the engine's KV cache (`tools.weights.live_cache_rollout`), each
chunk's K/V written once by its context pass, a prompt change recaching the kept frames (the sink and the most
recent) under the new caption; with the same seed it makes `make demo-live`'s video. Both report the ball's vertical
range in the first and last 3 s of each prompt (issue 45's measure, `tests/pipelines/test_live_content.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from longserve.weights.causal_wan import load_causal_transformer, read_causal_config
from longserve.weights.registry import TINY_MODELS


class MaskedSelfAttn:
    """diffusers' WanAttnProcessor (self-attention) with a boolean attention mask."""

    mask: torch.Tensor | None = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        from tools.weights.live_teacher_forcing import rotate

        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        q, k = rotate(q, *rotary_emb), rotate(k, *rotary_emb)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=self.mask)
        return attn.to_out[1](attn.to_out[0](out.transpose(1, 2).flatten(2).type_as(q)))


def warp(step_list, shift: float) -> list[float]:
    return [1000.0 * shift * (n / 1000) / (1 + (shift - 1) * (n / 1000)) for n in step_list]


class Sampler:
    def __init__(self, model_dir: Path, shift: float | None = None, step_list=None):
        from diffusers import AutoencoderKLWan, WanPipeline
        from transformers import AutoTokenizer, UMT5EncoderModel

        self.cfg = read_causal_config(model_dir)
        self.model = load_causal_transformer(model_dir)
        self.proc = MaskedSelfAttn()
        for block in self.model.blocks:
            block.attn1.set_processor(self.proc)
        self.vae = AutoencoderKLWan.from_pretrained(model_dir, subfolder="vae").eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer")
        encoder = UMT5EncoderModel.from_pretrained(model_dir / "text_encoder").eval()
        self.pipe = WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=None, transformer=None, scheduler=None)
        self.fb = self.cfg["num_frame_per_block"]
        self.L, self.K = self.cfg["local_attn_size"], self.cfg["sink_size"]
        steps = step_list or self.cfg["denoising_step_list"]
        s = self.cfg["timestep_shift"] if shift is None else shift
        self.timesteps = warp(steps, s) if self.cfg["warp_denoising_step"] else [float(n) for n in steps]
        self._text = {}

    def text(self, prompt: str) -> torch.Tensor:
        if prompt not in self._text:
            with torch.no_grad():
                self._text[prompt] = self.pipe._get_t5_prompt_embeds(prompt, max_sequence_length=512,
                                                                     device=torch.device("cpu"))
        return self._text[prompt]

    @torch.no_grad()
    def forward(self, context: torch.Tensor, x: torch.Tensor, t: float, text: torch.Tensor) -> torch.Tensor:
        P, fb = context.shape[2], self.fb
        per_frame = (x.shape[3] // 2) * (x.shape[4] // 2)
        chunk_of = torch.tensor([f // fb for f in range(P)] + [P // fb] * fb)
        noisy = torch.tensor([False] * P + [True] * fb)
        mask = (chunk_of[None, :] <= chunk_of[:, None]) & (noisy[:, None] | ~noisy[None, :])
        self.proc.mask = mask.repeat_interleave(per_frame, 0).repeat_interleave(per_frame, 1)
        ts = torch.tensor([float(self.cfg["context_noise"])] * (P * per_frame) + [t] * (fb * per_frame))[None]
        out = self.model(torch.cat([context, x], dim=2), timestep=ts, encoder_hidden_states=text,
                         return_dict=False)[0]
        return out[:, :, P:]

    @torch.no_grad()
    def generate(self, prompt_of_chunk, seed: int) -> torch.Tensor:
        """Normalised latents (1, C, chunks * F_b, h, w) for the chunks' prompts."""
        g = torch.Generator().manual_seed(seed)
        C = self.model.config.in_channels
        frames = torch.zeros(1, C, 0, 8, 8)
        sigmas = [t / 1000 for t in self.timesteps]
        for prompt in prompt_of_chunk:
            text = self.text(prompt)
            keep = self.L - self.fb
            context = frames if frames.shape[2] <= keep else \
                torch.cat([frames[:, :, :self.K], frames[:, :, frames.shape[2] - (keep - self.K):]], dim=2)
            x = torch.randn(1, C, self.fb, 8, 8, generator=g)
            for i, t in enumerate(self.timesteps):
                v = self.forward(context, x, t, text)
                x0 = x - sigmas[i] * v
                if i + 1 < len(sigmas):
                    x = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * torch.randn(x0.shape, generator=g)
            frames = torch.cat([frames, x0], dim=2)
        return frames

    @torch.no_grad()
    def generate_cached(self, prompt_of_chunk, seed: int) -> torch.Tensor:
        """`generate` in the runtime's form (see the module docstring)."""
        from longserve.engine.models.causal import CausalConfig
        from tools.weights.live_cache_rollout import CacheRollout

        rollout = CacheRollout(self.model, CausalConfig.from_dict(self.cfg), 8, 8)
        g = torch.Generator().manual_seed(seed)
        keep = self.L - self.fb
        chunks, before = [], None
        for prompt in prompt_of_chunk:
            text = self.text(prompt)
            if before is None or prompt != before:
                rollout.new_rows(1, text.shape[1])
                if chunks:                                   # recache: the kept frames, oldest first
                    frames = torch.cat(chunks, dim=2)
                    if frames.shape[2] > keep:
                        frames = torch.cat([frames[:, :, :self.K], frames[:, :, frames.shape[2] - (keep - self.K):]],
                                           dim=2)
                    for i in range(0, frames.shape[2], self.fb):
                        rollout.context(frames[:, :, i:i + self.fb], text)
            chunks.append(rollout.make(text, g))
            before = prompt
        return torch.cat(chunks, dim=2)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        mean = torch.tensor(self.vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(self.vae.config.latents_std).view(1, -1, 1, 1, 1)
        video = self.vae.decode(latents * std + mean).sample                           # (1, 3, T, H, W) in [-1, 1]
        return ((video[0].permute(1, 2, 3, 0).numpy() + 1) / 2).clip(0, 1)             # (T, H, W, 3)


def evaluate(sampler: Sampler, seconds: float, switch_at: float, before: str, after: str, seed: int,
             cached: bool = False) -> dict:
    from content import describe, vertical_range

    fps, fb = sampler.cfg["fps"], sampler.fb
    chunks = int(round(seconds * fps)) // fb
    switch = int(round(switch_at * fps)) // fb
    prompts = [before if c < switch else after for c in range(chunks)]
    t0 = time.perf_counter()
    latents = (sampler.generate_cached if cached else sampler.generate)(prompts, seed)
    gen_s = time.perf_counter() - t0
    video = sampler.decode(latents)
    colours = [describe(video[c * fb:(c + 1) * fb]).colour for c in range(chunks)]
    want_before, want_after = before.split()[1], after.split()[1]
    pre = [c == want_before for c in colours[:switch]]
    post = [c == want_after for c in colours[switch + 1:]]
    motions = [describe(video[s:s + 16]).motion for s in range(0, len(video) - 15, 8)]
    w, s = 3 * fps, switch * fb
    pixels = (video * 255).round().astype(np.uint8)                         # as the demo's frames are read back
    spans = {"first": (0, w), "before": (s - w, s), "after": (s, s + w), "last": (len(video) - w, len(video))}
    heights = {name: round(vertical_range(pixels[a:b]), 1) for name, (a, b) in spans.items()}
    return {"seed": seed, "chunks": chunks, "switch_chunk": switch, "generate_s": round(gen_s, 1),
            "before_ok": float(np.mean(pre)), "after_ok": float(np.mean(post)),
            "switch_chunk_colour": colours[switch], "colours": "".join((c or "-")[0] for c in colours),
            "bouncing_windows": float(np.mean([m == "bouncing" for m in motions])),
            "motions": [m for m in motions], "heights": heights,
            "heights_every_3s": [round(vertical_range(pixels[a:a + w]), 1) for a in range(0, len(video), w)],
            "height_kept": [round(heights["before"] / max(heights["first"], 1e-9), 2),
                            round(heights["last"] / max(heights["after"], 1e-9), 2)], "video": video}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.weights.eval_tiny_live", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(TINY_MODELS["tiny-live"]))
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--switch-at", type=float, default=15.0)
    ap.add_argument("--before", default="a red ball bouncing")
    ap.add_argument("--after", default="a blue ball bouncing")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--shift", type=float, default=None, help="override the checkpoint's timestep_shift")
    ap.add_argument("--frames-png", default=None, help="write the first seed's video as a strip of frames")
    ap.add_argument("--cache", action="store_true", help="sample in the runtime's form (its KV cache)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    sampler = Sampler(Path(args.model), shift=args.shift)
    results = []
    for seed in args.seeds:
        r = evaluate(sampler, args.seconds, args.switch_at, args.before, args.after, seed, cached=args.cache)
        video = r.pop("video")
        results.append(r)
        print(json.dumps(r), flush=True)
        if args.frames_png and seed == args.seeds[0]:
            from PIL import Image

            rows = [np.concatenate(list(video[i:i + 24]), axis=1) for i in range(0, len(video) - 23, 24)]
            Image.fromarray((np.concatenate(rows, axis=0) * 255).astype(np.uint8)).save(args.frames_png)
    print(json.dumps({"before_ok": float(np.mean([r["before_ok"] for r in results])),
                      "after_ok": float(np.mean([r["after_ok"] for r in results])),
                      "bouncing_windows": float(np.mean([r["bouncing_windows"] for r in results])),
                      "height_kept_min": [min(r["height_kept"][i] for r in results) for i in (0, 1)]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
