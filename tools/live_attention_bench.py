"""The live loop's cached self-attention, one layer, before and after issue 41's change (docs/design.md, "The live
loop's levers"): keys stored before RoPE, every cached key rotated on every forward and a mask over every slot (the
old `KVCache`, rewritten here as tests/engine/test_causal_cache.py's reference does) against keys stored rotated and
one unmasked slice of the filled prefix (`engine.models.causal.KVCache`).

    python -m tools.live_attention_bench [--device cpu|cuda] [--tokens 256] [--heads 12] [--head-dim 64]

Prints one JSON line per case: chunk 0 (nothing cached: the mask's worst case) and a chunk once the window is full,
milliseconds per forward (median of `--repeats`). LongLive-1.3B's shape is --tokens 1560 --heads 12 --head-dim 128
(window 12, sink 3, chunks of 3 latent frames), a GPU's size.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=256, help="tokens a latent frame")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    from longserve.engine.models.causal import CausalConfig, KVCache, rotate

    cfg = CausalConfig.from_dict({"num_frame_per_block": 3, "denoising_step_list": [1000], "local_attn_size": 12,
                                  "sink_size": 3})
    device, dtype, ft, H, hd = torch.device(args.device), getattr(torch, args.dtype), args.tokens, args.heads, \
        args.head_dim
    S = cfg.frames_per_block * ft

    def rotary(start, frames):                  # any table of the right shape: the cost is what is measured
        pos = torch.arange(start * ft, (start + frames) * ft, device=device, dtype=torch.float32)[:, None]
        angle = pos / (1 + torch.arange(hd, device=device))
        return angle.cos().to(dtype), angle.sin().to(dtype)

    def old_forward(cache, q, k, v, cached):
        slots = (cfg.capacity + cfg.frames_per_block) * ft
        cos, sin = rotary(0, slots // ft)
        valid = torch.zeros(slots, dtype=torch.bool, device=device)
        valid[:cached * ft] = True
        valid[cfg.capacity * ft:] = True
        mask = None if bool(valid.all()) else valid.view(1, 1, 1, -1)
        chunk = slice(cfg.capacity * ft, slots)
        cache.k[0, :, chunk], cache.v[0, :, chunk] = k, v
        keys = rotate(cache.k[0], cos, sin)
        return F.scaled_dot_product_attention(rotate(q, cos[chunk], sin[chunk])[None], keys[None], cache.v[0][None],
                                              attn_mask=mask)[0]

    def new_forward(cache, q, k, v, cached):
        cache.prepare(cfg.frames_per_block, rotary)
        return cache.attend(0, q, k, v)

    def timed(fn):
        times = []
        for _ in range(args.repeats + 2):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[2:]) * 1000

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(H, S, hd, generator=g, device=device, dtype=dtype) for _ in range(3))
    for name, written in (("chunk 0", 0), ("window full", 30)):
        row = {"case": name, "device": args.device, "tokens_a_frame": ft, "heads": H, "head_dim": hd}
        for label, forward in (("old_ms", old_forward), ("new_ms", new_forward)):
            cache = KVCache(cfg, 1, ft, H, hd, 1, H, dtype, device)
            for _ in range(written // cfg.frames_per_block):
                cache.commit(cfg.frames_per_block)
            cached = cache.cached_frames
            with torch.no_grad():
                row[label] = round(timed(functools.partial(forward, cache, q, k, v, cached)), 3)
        row["speedup"] = round(row["old_ms"] / row["new_ms"], 2)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
