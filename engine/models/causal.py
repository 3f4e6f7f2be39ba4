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
            all-to-all (tokens -> heads) when sharded; RoPE on the chunk's q/k at its frames' positions;
            attention over [cached frames | the chunk] of each row's `KVCache`; on a context pass the
            chunk's rotated K/V are kept in the cache; all-to-all back
    attn2   `CachedCrossAttention`: the text's K/V come from the row's cache, computed once per prompt

The cache of one video (`KVCache`, one per row per worker) is preallocated: per layer K and V of
`capacity` frames (local_attn_size - frames_per_block) plus one chunk, for this worker's heads:

    slots [0, sink)             the first `sink_size` frames of the video, never evicted
    slots [sink, capacity)      a ring of the most recent frames: frame j >= sink goes to sink + (j - sink) % W
    slots [P, P + chunk)        the chunk being computed, right after the P cached frames (P = capacity once
                                full; before that its slots are the ones its frames are kept in)

Keys are stored *rotated*: RoPE is applied once, to the chunk's keys as they are computed, at
their frame's index j; a context pass keeps them. What attention sees is only the distance
between a query and a key, so frame j at position j is the cache-relative layout (oldest cached
frame 0, the chunk after the cached ones) shifted by a constant, except for the sink: its
frames must sit right before the oldest kept frame, which moves on as the ring evicts. So the
sink's keys are also kept before RoPE (`sink_k`, sink frames x tokens per layer) and re-rotated
from that copy, once per chunk and for every layer in one op, when the window has moved.
Before any eviction the positions are the frame indices exactly (so cached generation equals a
recompute over all frames: the exactness test). Frame positions past Wan's 1024-frame RoPE
table are computed as diffusers computes the table (float64 angles, `FrameRotary`): a stream
runs on past it, exact at any length.

The keys attended are always one contiguous slice, [0, P + chunk): no mask from the first
chunk on, so flash / cuDNN kernels run at every chunk, over the filled prefix only. Shapes are
fixed from the first full window, and memory per video is `KVCache.nbytes(...)`, known before
admission.
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


class FrameRotary:
    """Wan's rotary table at any frame position, built on the device: (cos, sin) of `frames` frames from frame
    position `start`, (frames * tokens, hd) in the compute dtype.

    diffusers' `WanRotaryPosEmbed` keeps a table of `rope_max_seq_len` (1024) frame positions; a live stream's
    keys sit at their frame's index (see `KVCache`), which runs past it. The frame axis's angles are computed
    here as diffusers computes its table (float64 `outer(position, inverse frequency)`, then cos/sin, then
    float32): bit for bit the table inside it, as exact past it. The height and width parts are the table's own."""

    def __init__(self, rope, h: int, w: int, dtype, device):
        _, p_h, p_w = rope.patch_size
        pph, ppw = h // p_h, w // p_w
        dims = [rope.t_dim, rope.h_dim, rope.w_dim]
        cos_t, cos_h, cos_w = rope.freqs_cos.to(device).split(dims, dim=1)
        sin_t, sin_h, sin_w = rope.freqs_sin.to(device).split(dims, dim=1)

        def spatial(h_part, w_part):            # (tokens, h_dim + w_dim): the same for every frame
            return torch.cat([h_part[:pph, None].expand(pph, ppw, -1), w_part[None, :ppw].expand(pph, ppw, -1)],
                             dim=-1).flatten(0, 1)

        self.spatial_cos, self.spatial_sin = spatial(cos_h, cos_w), spatial(sin_h, sin_w)
        self.tokens, self.dtype, self.device = pph * ppw, dtype, device
        self.inverse = 1.0 / (10000.0 ** (torch.arange(0, rope.t_dim, 2, dtype=torch.float64, device=device)
                                          / rope.t_dim))                                   # (t_dim / 2,)
        # a change of diffusers' formula (theta, layout) would show here; a device's last-bit cos/sin (float64 on
        # a GPU against the table's CPU values) or the table's bf16 copy would not
        probe = min(8, len(cos_t))
        mine = self._frame_axis(0, probe)
        if not (torch.allclose(mine[0], cos_t[:probe].float(), atol=4e-3) and
                torch.allclose(mine[1], sin_t[:probe].float(), atol=4e-3)):
            raise RuntimeError("diffusers' WanRotaryPosEmbed changed: the frame axis no longer matches its table")

    def _frame_axis(self, start: int, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + frames, dtype=torch.float64, device=self.device)   # no host copy
        angles = torch.outer(pos, self.inverse)                                                 # (frames, t_dim/2)
        return (angles.cos().repeat_interleave(2, dim=1).float(), angles.sin().repeat_interleave(2, dim=1).float())

    def __call__(self, start: int, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        t_cos, t_sin = self._frame_axis(start, frames)                                           # (frames, t_dim)
        ft = self.tokens

        def full(t_part, spatial):                                                               # (frames*ft, hd)
            return torch.cat([t_part[:, None].expand(-1, ft, -1), spatial[None].expand(frames, -1, -1)],
                             dim=-1).flatten(0, 1).to(self.dtype)

        return full(t_cos, self.spatial_cos), full(t_sin, self.spatial_sin)


class KVCache:
    """One video's K/V on one worker (see the module docstring for the slot layout and the positions)."""

    def __init__(self, cfg: CausalConfig, layers: int, frame_tokens: int, heads: int, head_dim: int,
                 text_len: int, text_heads: int, dtype, device, chunks: int = 1, first_layer: int = 0):
        # chunks: the chunks denoised at once after the cached frames (the stages loop's stream batch,
        # engine/live_stages.py); first_layer: the model's layer held at index 0 (a stage holds its blocks' only)
        self.cfg, self.frame_tokens, self.first_layer = cfg, frame_tokens, first_layer
        slots = (cfg.capacity + chunks * cfg.frames_per_block) * frame_tokens
        self.k = torch.zeros(layers, heads, slots, head_dim, dtype=dtype, device=device)    # rotated
        self.v = torch.zeros_like(self.k)
        # the sink's keys before RoPE: re-rotated from these, once per chunk, when the window moves on
        self.sink_k = torch.zeros(layers, heads, cfg.sink_size * frame_tokens, head_dim, dtype=dtype, device=device)
        # the text's K/V, per layer (all heads: cross-attention is not sharded)
        self.text_k = torch.zeros(layers, text_heads, text_len, head_dim, dtype=dtype, device=device)
        self.text_v = torch.zeros_like(self.text_k)
        self.text_version = None            # which prompt text_k/text_v hold (None: to compute)
        self.slot_frame = [-1] * cfg.capacity   # the video frame index held by each slot, -1: empty
        self.frames_written = 0                 # frames ever written (the next frame's index)
        self.write = False                      # this forward is a context pass: write the chunk
        self.sink_shift = 0                     # the position offset the sink's stored keys are rotated at
        self.sink_rotations = 0                 # times the sink was re-rotated (once per chunk past the window)
        self._chunk = None                      # the coming forward's (cos, sin, first slot, frames)

    @staticmethod
    def nbytes(cfg: CausalConfig, layers: int, frame_tokens: int, heads_per_worker: int, heads: int,
               head_dim: int, text_len: int, dtype_bytes: int, chunks: int = 1) -> int:
        """Bytes one video's cache takes on one worker (`layers`: the worker's)."""
        slots = (cfg.capacity + chunks * cfg.frames_per_block + cfg.sink_size) * frame_tokens  # K/V, chunks, sink
        return 2 * layers * head_dim * dtype_bytes * (heads_per_worker * slots + heads * text_len)

    @property
    def cached_frames(self) -> int:
        return min(self.frames_written, self.cfg.capacity)

    @property
    def shift(self) -> int:
        """Frames evicted from the ring so far: the sink sits just before the oldest kept frame, at positions
        shift..shift+sink-1 (0..sink-1 until the window is full)."""
        return max(0, self.frames_written - self.cfg.capacity)

    def slot_of(self, frame: int) -> int:
        cfg = self.cfg
        return frame if frame < cfg.sink_size else cfg.sink_size + (frame - cfg.sink_size) % cfg.window

    def prepare(self, frames: int, rotary: FrameRotary, offset: int = 0) -> None:
        """The coming forward over a chunk of `frames` frames: its rotary rows (the chunk's frame indices) and
        its slots, right after the cached ones; the sink re-rotated if the window moved since the last chunk.
        `offset`: the chunk comes that many frames after the cached ones (a stream batch's later member, whose
        predecessors' K/V of the same step sit in between: engine/live_stages.py); never on a context pass."""
        sink = self.cfg.sink_size
        shift = self.shift
        if sink and shift != self.sink_shift:
            cos, sin = rotary(shift, sink)                                      # (sink*ft, hd)
            self.k[:, :, :sink * self.frame_tokens] = rotate(self.sink_k, cos, sin)   # every layer, one op
            self.sink_shift = shift
            self.sink_rotations += 1
        start, first = (self.cached_frames + offset) * self.frame_tokens, self.frames_written + offset
        if self._chunk is None or self._chunk[2:] != (start, frames, first):
            cos, sin = rotary(first, frames)                      # once per chunk: its forwards share them
            self._chunk = (cos, sin, start, frames, first)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q/k/v: the chunk's (heads, S, hd), before RoPE -> (heads, S, hd). The keys attended are one
        contiguous slice, [cached frames | the chunk], so no mask: any SDPA kernel (flash, cuDNN) runs."""
        cos, sin, start, frames, _ = self._chunk
        layer -= self.first_layer
        end = start + k.shape[1]
        rotated = rotate(k, cos, sin)
        self.k[layer, :, start:end] = rotated
        self.v[layer, :, start:end] = v
        out = F.scaled_dot_product_attention(rotate(q, cos, sin)[None], self.k[layer, :, :end][None],
                                             self.v[layer, :, :end][None])[0]
        if self.write:
            self._keep(layer, k, start, frames)
        return out

    def _keep(self, layer: int, k: torch.Tensor, start: int, frames: int) -> None:
        """A context pass: each chunk frame's rotated K/V to its slot (where the chunk's slots are not already
        its own: once the ring wraps), and a sink frame's keys before RoPE to the sink's copy."""
        ft = self.frame_tokens
        for i in range(frames):
            frame = self.frames_written + i
            src = slice(start + i * ft, start + (i + 1) * ft)
            s = self.slot_of(frame)
            if s * ft != src.start:
                dst = slice(s * ft, (s + 1) * ft)
                self.k[layer, :, dst] = self.k[layer, :, src]
                self.v[layer, :, dst] = self.v[layer, :, src]
            if frame < self.cfg.sink_size:
                self.sink_k[layer, :, frame * ft:(frame + 1) * ft] = k[:, i * ft:(i + 1) * ft]

    def commit(self, frames: int) -> None:
        """After a context pass over `frames` frames: they are cached now (evicting the oldest ring frames)."""
        for i in range(frames):
            f = self.frames_written + i
            self.slot_frame[self.slot_of(f)] = f
        self.frames_written += frames

    def reset(self) -> None:
        """Forget every cached frame (a recache rebuilds them, from frame 0 again); the buffers stay."""
        self.slot_frame = [-1] * self.cfg.capacity
        self.frames_written = 0
        self.sink_shift = 0


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


@torch.compiler.disable
def cached_self_attention(owner, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Every row's attention over its `KVCache`, my tokens' q/k/v (B, Sl, H, hd) -> (B, Sl, H, hd). Inside a
    compiled block (`compile` blocks) it runs eager, by design: it reads and writes per-row caches (Python state
    that changes every chunk, which a graph would guard on) and does the Ulysses all-to-alls on our own process
    groups. The projections before it and the output projection after it stay in the graph."""
    shard = _running(owner)
    u = shard.sp.ulysses
    qkv = torch.stack([q, k, v])
    if u.world_size > 1:                      # tokens -> heads: (3, B, S, Hl, hd)
        qkv = comm.all_to_all_switch(qkv, scatter_dim=3, gather_dim=2, gather_size=shard.S, pg=u)
    else:
        qkv = qkv[:, :, :shard.S]
    qkv = qkv.transpose(2, 3)                                                            # (3, B, Hl, S, hd)
    out = torch.stack([c.attend(layer, *qkv[:, b]) for b, c in enumerate(shard.caches)])  # (B, Hl, S, hd)
    out = out.transpose(1, 2).type_as(q)                                                 # (B, S, Hl, hd)
    if u.world_size > 1:                      # heads -> tokens
        return comm.all_to_all_switch(out, scatter_dim=1, gather_dim=2, gather_size=q.shape[2], pg=u)
    return comm.pad_dim(out, 1, shard.Sl)


@torch.compiler.disable
def cached_text_kv(owner, layer: int, attn, encoder_hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every row's text K/V for this layer (B, H, L, hd) each, computed once per prompt into the row's cache (eager
    in a compiled block: whether to compute depends on each row's prompt version)."""
    shard = _running(owner)
    for b, c in enumerate(shard.caches):
        if c.text_version != shard.versions[b]:
            text = encoder_hidden_states[b:b + 1]
            i = layer - c.first_layer
            c.text_k[i] = attn.norm_k(attn.to_k(text)).unflatten(2, (attn.heads, -1))[0].transpose(0, 1)
            c.text_v[i] = attn.to_v(text).unflatten(2, (attn.heads, -1))[0].transpose(0, 1)
    return (torch.stack([c.text_k[layer - c.first_layer] for c in shard.caches]),
            torch.stack([c.text_v[layer - c.first_layer] for c in shard.caches]))


class CachedSelfAttention:
    """A block's self-attention over [cached frames | chunk] of every row (see the module docstring)."""

    def __init__(self, owner, layer: int, original=None):
        self.owner, self.layer = owner, layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)  # (B, Sl, H*hd)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))                         # (B, Sl, H, hd)
        out = cached_self_attention(self.owner, self.layer, q, k, v)                           # (B, Sl, H, hd)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3)))


class CachedCrossAttention:
    """A block's cross-attention; the text's K/V per row are computed once per prompt and kept in its cache."""

    def __init__(self, owner, layer: int, original=None):
        self.owner, self.layer = owner, layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        k, v = cached_text_kv(self.owner, self.layer, attn, encoder_hidden_states)             # (B, H, L, hd)
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1)).transpose(1, 2)  # (B, H, Sl, hd)
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
        self.cuda_graphs = False           # the compiled blocks are CUDA graphs: each forward is a new step
        self._rope: dict[tuple, FrameRotary] = {}

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

    def rotary(self, h: int, w: int) -> FrameRotary:
        """The rotary rows of any frame position at this size (built once per size, on the device)."""
        key = (h, w)
        if key not in self._rope:
            p = self.model.patch_embedding.weight
            self._rope[key] = FrameRotary(self.model.rope, h, w, p.dtype, p.device)
        return self._rope[key]

    def __call__(self, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, sp: SequenceParallel,
                 caches: list[KVCache], versions: list, write: list[bool]) -> torch.Tensor:
        """The flow prediction for a chunk per row. x (B, C, f, h, w) with f <= frames_per_block; timestep (B,);
        text (B, L, C_text); `versions[b]`: an id of row b's prompt (its text K/V are recomputed when it
        changes); `write[b]`: row b is a context pass (its chunk's K/V are written into its cache)."""
        if sp.ring.world_size > 1:
            raise ValueError("a causal model shards its chunks with Ulysses only (plan 'ulysses')")
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        frames, h, w = x.shape[2:]
        rotary = self.rotary(h, w)
        for c, wr in zip(caches, write):
            c.prepare(frames, rotary)
            c.write = wr
        shard = CausalShard.of(self.model, x, sp, caches=tuple(caches), versions=tuple(versions))
        out = self.sharded(shard, x, timestep, text, return_dict=False)[0]
        for c, v, wr in zip(caches, versions, write):
            c.text_version = v
            if wr:
                c.commit(frames)
            c.write = False
        return out
