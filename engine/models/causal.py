"""Causal few-step Wan (Self-Forcing, LongLive, CausVid kind): chunked generation over a rolling KV cache,
as attention processors on diffusers' own `WanTransformer3DModel`.

A video is made a chunk of `frames_per_block` latent frames at a time. Each chunk is
denoised in a few steps (the warped step list, no guidance), attending to the cached K/V
of the frames before it and to itself; then a *context pass* runs the finished chunk at
`context_noise` and writes its self-attention K/V into the cache. The forward is diffusers'
(Wan's shard plan, `engine/models/wan.py`, cuts the chunk's tokens across the workers; the
causal plan is that plan with two attention processors, and its geometry carries each row's
cache and prompt version); what changes is each block's attention:

    attn1   `CachedSelfAttention`: diffusers' projections and q/k norms on my tokens; Ulysses
            all-to-all (tokens -> heads) when sharded; RoPE at cache-relative positions; attention
            over [cached frames | the chunk] of each row's `KVCache`; on a context pass the chunk's
            K/V (before RoPE) are written into the cache; all-to-all back
    attn2   `CachedCrossAttention`: the text's K/V come from the row's cache, computed once per prompt

The cache of one video (`KVCache`, one per row per worker) is preallocated: per layer K and V of
`capacity` frames (local_attn_size - frames_per_block) plus one chunk, for this worker's heads:

    slots [0, sink)             the first `sink_size` frames of the video, never evicted
    slots [sink, capacity)      a ring of the most recent frames: frame j >= sink goes to sink + (j - sink) % W
    slots [capacity, +chunk)    the chunk being computed (scratch; never valid across forwards)

Keys are stored before RoPE and rotated when read, at positions *relative to the cache*: the
cached frames, oldest first, take positions 0..P-1 and the chunk P..P+chunk-1. Before any
eviction that is exactly the absolute frame index (so cached generation equals a recompute
over all frames: the exactness test); after it the kept frames are rebased, so a stream never
needs a position past `local_attn_size` and runs past Wan's 1024-frame RoPE table. Shapes are
fixed from the first chunk (invalid slots are masked), and memory per video is
`KVCache.nbytes(...)`, known before admission.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longserve.engine import comm
from longserve.engine.models.wan import WAN_PLAN, WanShard, rotate
from longserve.engine.parallel import SequenceParallel
from longserve.engine.sharding import shard_model


def warp_timesteps(step_list, shift: float, warp: bool, num_train_timesteps: int = 1000) -> tuple[float, ...]:
    """Self-Forcing's `warp_denoising_step`: a listed step n is the shifted flow schedule's timestep at
    u = n / T, i.e. T * s*u / (1 + (s-1)*u) (1000 -> 1000; with shift 5: 750 -> 937.5, 500 -> 833.3)."""
    out = []
    for n in step_list:
        u = float(n) / num_train_timesteps
        out.append(num_train_timesteps * shift * u / (1 + (shift - 1) * u) if warp else float(n))
    return tuple(out)


@dataclass(frozen=True)
class CausalConfig:
    """What `causal_config.json` says about the loop (weights/causal_wan.py documents the file)."""

    frames_per_block: int
    timesteps: tuple[float, ...]          # warped, in [0, num_train_timesteps]
    local_attn_size: int                  # latent frames a chunk attends to, itself included
    sink_size: int
    context_noise: float
    fps: int
    num_train_timesteps: int = 1000

    @classmethod
    def from_dict(cls, d: dict) -> "CausalConfig":
        fb = int(d["num_frame_per_block"])
        cfg = cls(frames_per_block=fb,
                  timesteps=warp_timesteps(d["denoising_step_list"], float(d.get("timestep_shift", 5.0)),
                                           bool(d.get("warp_denoising_step", True))),
                  local_attn_size=int(d["local_attn_size"]), sink_size=int(d.get("sink_size", 0)),
                  context_noise=float(d.get("context_noise", 0)), fps=int(d.get("fps", 16)))
        if fb < 1 or not cfg.timesteps:
            raise ValueError("causal_config.json: num_frame_per_block must be >= 1 and denoising_step_list non-empty")
        if cfg.window < fb:
            raise ValueError(f"causal_config.json: local_attn_size ({cfg.local_attn_size}) must leave room for the "
                             f"sink ({cfg.sink_size}) and at least two chunks of {fb} frames (a finite window: a "
                             f"stream's memory must not grow)")
        return cfg

    @property
    def capacity(self) -> int:
        """Cached frames (the chunk itself not counted)."""
        return self.local_attn_size - self.frames_per_block

    @property
    def window(self) -> int:
        """Ring slots (the non-sink cached frames)."""
        return self.capacity - self.sink_size

    @property
    def steps_per_chunk(self) -> int:
        """Forwards per chunk: the denoising steps and the context pass."""
        return len(self.timesteps) + 1

    def sigma(self, t: float) -> float:
        return t / self.num_train_timesteps


class KVCache:
    """One video's K/V on one worker (see the module docstring for the slot layout)."""

    def __init__(self, cfg: CausalConfig, layers: int, frame_tokens: int, heads: int, head_dim: int,
                 text_len: int, text_heads: int, dtype, device):
        self.cfg, self.frame_tokens = cfg, frame_tokens
        slots = (cfg.capacity + cfg.frames_per_block) * frame_tokens
        self.k = torch.zeros(layers, heads, slots, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        # the text's K/V, per layer (all heads: cross-attention is not sharded)
        self.text_k = torch.zeros(layers, text_heads, text_len, head_dim, dtype=dtype, device=device)
        self.text_v = torch.zeros_like(self.text_k)
        self.text_version = None            # which prompt text_k/text_v hold (None: to compute)
        self.slot_frame = [-1] * cfg.capacity   # the video frame index held by each slot, -1: empty
        self.frames_written = 0                 # frames ever written (the next frame's index)
        self.write = False                      # this forward is a context pass: write the chunk
        self._prepared = None

    @staticmethod
    def nbytes(cfg: CausalConfig, layers: int, frame_tokens: int, heads_per_worker: int, heads: int,
               head_dim: int, text_len: int, dtype_bytes: int) -> int:
        """Bytes one video's cache takes on one worker."""
        slots = (cfg.capacity + cfg.frames_per_block) * frame_tokens
        return 2 * layers * head_dim * dtype_bytes * (heads_per_worker * slots + heads * text_len)

    @property
    def cached_frames(self) -> int:
        return sum(f >= 0 for f in self.slot_frame)

    def slot_of(self, frame: int) -> int:
        cfg = self.cfg
        return frame if frame < cfg.sink_size else cfg.sink_size + (frame - cfg.sink_size) % cfg.window

    def prepare(self, frames: int, rope_rows, device) -> None:
        """Positions, key rotations and mask of the coming forward over a chunk of `frames` frames."""
        ft = self.frame_tokens
        order = sorted((f, s) for s, f in enumerate(self.slot_frame) if f >= 0)   # oldest first
        P = len(order)
        pos = torch.zeros(self.cfg.capacity, dtype=torch.long)
        for rank, (_, s) in enumerate(order):
            pos[s] = rank
        frame_pos = torch.cat([pos, torch.arange(P, P + frames), torch.zeros(self.cfg.frames_per_block - frames,
                                                                             dtype=torch.long)])
        rows = (frame_pos[:, None] * ft + torch.arange(ft)).flatten().to(device)     # rope table rows per slot token
        cos, sin = rope_rows
        key_cos, key_sin = cos[rows], sin[rows]                                        # (slots, hd)
        valid = torch.tensor([f >= 0 for f in self.slot_frame] + [True] * frames +
                             [False] * (self.cfg.frames_per_block - frames))
        mask = None if bool(valid.all()) else valid.repeat_interleave(ft).to(device)
        chunk = slice(self.cfg.capacity * ft, (self.cfg.capacity + frames) * ft)
        self._prepared = (key_cos, key_sin, key_cos[chunk], key_sin[chunk], mask, chunk)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q/k/v: the chunk's (heads, S, hd), before RoPE -> (heads, S, hd)."""
        key_cos, key_sin, q_cos, q_sin, mask, chunk = self._prepared
        self.k[layer, :, chunk] = k
        self.v[layer, :, chunk] = v
        keys = rotate(self.k[layer], key_cos, key_sin)
        q = rotate(q, q_cos, q_sin)
        out = F.scaled_dot_product_attention(q[None], keys[None], self.v[layer][None],
                                             attn_mask=None if mask is None else mask.view(1, 1, 1, -1))[0]
        if self.write:
            frames = (chunk.stop - chunk.start) // self.frame_tokens
            for i in range(frames):
                s = self.slot_of(self.frames_written + i)
                dst = slice(s * self.frame_tokens, (s + 1) * self.frame_tokens)
                src = slice(i * self.frame_tokens, (i + 1) * self.frame_tokens)
                self.k[layer, :, dst] = k[:, src]
                self.v[layer, :, dst] = v[:, src]
        return out

    def commit(self, frames: int) -> None:
        """After a context pass over `frames` frames: they are cached now (evicting the oldest ring frames)."""
        for i in range(frames):
            f = self.frames_written + i
            self.slot_frame[self.slot_of(f)] = f
        self.frames_written += frames

    def reset(self) -> None:
        """Forget every cached frame (a recache rebuilds them); the buffers stay."""
        self.slot_frame = [-1] * self.cfg.capacity
        self.frames_written = 0


@dataclass(frozen=True)
class CausalShard(WanShard):
    """Wan's geometry of a chunk, with what travels with its rows: each row's cache and prompt version."""

    caches: tuple = ()
    versions: tuple = ()


def _running(owner) -> CausalShard:
    shard = owner.shard
    if shard is None:
        raise RuntimeError("a causal Wan model runs through CausalWan(...) only")
    return shard


class CachedSelfAttention:
    """A block's self-attention over [cached frames | chunk] of every row (see the module docstring)."""

    def __init__(self, owner, layer: int, original=None):
        self.owner, self.layer = owner, layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        shard = _running(self.owner)
        caches = shard.caches
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)  # (B, Sl, H*hd)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))                         # (B, Sl, H, hd)
        u = shard.sp.ulysses
        qkv = torch.stack([q, k, v])
        if u.world_size > 1:                      # tokens -> heads: (3, B, S, Hl, hd)
            qkv = comm.all_to_all_switch(qkv, scatter_dim=3, gather_dim=2, gather_size=shard.S, pg=u)
        else:
            qkv = qkv[:, :, :shard.S]
        qkv = qkv.transpose(2, 3)                                                            # (3, B, Hl, S, hd)
        out = torch.stack([c.attend(self.layer, *qkv[:, b]) for b, c in enumerate(caches)])  # (B, Hl, S, hd)
        out = out.transpose(1, 2).type_as(q)                                                 # (B, S, Hl, hd)
        if u.world_size > 1:                      # heads -> tokens
            out = comm.all_to_all_switch(out, scatter_dim=1, gather_dim=2, gather_size=attn.heads, pg=u)
        else:
            out = comm.pad_dim(out, 1, shard.Sl)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3)))


class CachedCrossAttention:
    """A block's cross-attention; the text's K/V per row are computed once per prompt and kept in its cache."""

    def __init__(self, owner, layer: int, original=None):
        self.owner, self.layer = owner, layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        shard = _running(self.owner)
        caches, versions = shard.caches, shard.versions
        for b, c in enumerate(caches):
            if c.text_version != versions[b]:
                text = encoder_hidden_states[b:b + 1]
                c.text_k[self.layer] = attn.norm_k(attn.to_k(text)).unflatten(2, (attn.heads, -1))[0].transpose(0, 1)
                c.text_v[self.layer] = attn.to_v(text).unflatten(2, (attn.heads, -1))[0].transpose(0, 1)
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1)).transpose(1, 2)  # (B, H, Sl, hd)
        k = torch.stack([c.text_k[self.layer] for c in caches])
        v = torch.stack([c.text_v[self.layer] for c in caches])
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


#: Wan's plan (the chunk's tokens cut across the workers) with the cached attention on every block
CAUSAL_WAN_PLAN = WAN_PLAN.extended(geometry=CausalShard, attention={"blocks.*.attn1": CachedSelfAttention,
                                                                    "blocks.*.attn2": CachedCrossAttention})


class CausalWan:
    """A `WanTransformer3DModel` run chunk by chunk over per-row `KVCache`s.

        cw = CausalWan(model, cfg)                    # once: the plan's hooks and processors
        cache = cw.new_cache(h, w, sp)                # per video
        flow = cw(x, t, text, sp, [cache], versions=[v], write=[False])   # x: (B, C, frames, h, w)
    """

    def __init__(self, model, cfg: CausalConfig):
        self.model, self.cfg = model, cfg
        self.sharded = shard_model(model, CAUSAL_WAN_PLAN)
        self._rope: dict[tuple, tuple] = {}

    def frame_tokens(self, h: int, w: int) -> int:
        _, p_h, p_w = self.model.config.patch_size
        return (h // p_h) * (w // p_w)

    def heads_per_worker(self, sp: SequenceParallel) -> int:
        return math.ceil(self.model.config.num_attention_heads / sp.ulysses.world_size)

    def new_cache(self, h: int, w: int, sp: SequenceParallel, text_len: int) -> KVCache:
        c = self.model.config
        p = self.model.patch_embedding.weight      # the compute dtype (the first parameter may be a float32-kept one)
        return KVCache(self.cfg, c.num_layers, self.frame_tokens(h, w), self.heads_per_worker(sp),
                       c.attention_head_dim, text_len, c.num_attention_heads, p.dtype, p.device)

    def rope_rows(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """diffusers' rotary table for frame positions 0..local_attn_size-1 at this size: (positions*tokens, hd)."""
        key = (h, w)
        if key not in self._rope:
            p = self.model.patch_embedding.weight
            dummy = torch.empty(1, 1, self.cfg.local_attn_size, h, w, device=p.device)
            cos, sin = self.model.rope(dummy)                    # (1, L*tokens, 1, hd); no shard is active here
            self._rope[key] = (cos[0, :, 0].to(p.dtype), sin[0, :, 0].to(p.dtype))
        return self._rope[key]

    def __call__(self, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, sp: SequenceParallel,
                 caches: list[KVCache], versions: list, write: list[bool]) -> torch.Tensor:
        """The flow prediction for a chunk per row. x (B, C, f, h, w) with f <= frames_per_block; timestep (B,);
        text (B, L, C_text); `versions[b]`: an id of row b's prompt (its text K/V are recomputed when it
        changes); `write[b]`: row b is a context pass (its chunk's K/V are written into its cache)."""
        if sp.ring.world_size > 1:
            raise ValueError("a causal model shards its chunks with Ulysses only (plan 'ulysses')")
        frames, h, w = x.shape[2:]
        rope = self.rope_rows(h, w)
        for c, wr in zip(caches, write):
            c.prepare(frames, rope, x.device)
            c.write = wr
        shard = CausalShard.of(self.model, x, sp, caches=tuple(caches), versions=tuple(versions))
        out = self.sharded(shard, x, timestep, text, return_dict=False)[0]
        for c, v, wr in zip(caches, versions, write):
            c.text_version = v
            if wr:
                c.commit(frames)
            c.write = False
        return out
