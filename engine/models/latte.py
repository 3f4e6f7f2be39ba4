"""Parallel forwards of diffusers' `LatteTransformer3DModel` (a spatial-temporal DiT).

Every strategy drives the model's own sub-modules and weights (patch embedding,
AdaLN-single, caption projection, `BasicTransformerBlock`s, final layer); only the
sharding around them, and for the embedded baselines the inside of attention/MLP,
differ. Latte is the one model with a hand-written forward: DSP re-shards the activations
between every spatial and temporal block, which no hook on a module boundary can express.
Shapes: B batch, T frames, S = h*w patches, D hidden, N workers, `Tl`/`Sl` the padded
local shard of T/S (ceil(T/N), ceil(S/N)).

- "dsp" (Dynamic Sequence Parallelism): rest sharded on T. Spatial blocks (self-attn
  over S, cross-attn, MLP) are local. One all-to-all switches to S-sharding before
  each temporal block; one switches back before the next spatial block. After the last
  temporal block the final layer (per token) runs on the S-shard, so that switch back
  is skipped: 2L-1 all-to-alls for L block pairs, then one gather of the output.
- "ulysses" (DeepSpeed-Ulysses, embedded): rest sharded on S. Spatial self-attention
  trades S for heads with all-to-alls of Q, K, V and the output (4 per block pair).
- "ring" (Ring attention, embedded): rest sharded on S. Spatial self-attention passes
  K/V blocks around the ring (N-1 steps) and merges partial softmaxes by log-sum-exp.
- "megatron-sp" (Megatron-LM sequence parallelism with tensor parallelism): rest
  sharded on S; before every attention and MLP, all-gather the tokens; each worker
  computes its slice of heads / MLP columns; a reduce-scatter sums the partial outputs
  and re-shards them.

Temporal blocks are local for the three embedded strategies (S-sharding keeps every
frame of a patch together); cross-attention is local everywhere except megatron-sp.
Uneven T, S and head counts are zero-padded and trimmed (see `engine.comm`).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.embeddings import get_1d_sincos_pos_embed_from_grid

from longserve.engine import comm
from longserve.engine.compile import CompiledBlock
from longserve.engine.dist import ParallelGroup
from longserve.engine.parallel import CfgGroups, cfg_parallel, ring_attention

STRATEGIES = ("dsp", "ulysses", "ring", "megatron-sp")


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"parallel must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    return strategy


def temporal_pos_embed(model, num_frames: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Latte's sinusoidal frame embedding for any frame count (the config's buffer has `video_length` rows).

    -> (1, T, D), identical to `model.temp_pos_embed` when T == video_length.
    """
    if num_frames == model.temp_pos_embed.shape[1]:
        return model.temp_pos_embed.to(device=device, dtype=dtype)
    D = model.temp_pos_embed.shape[-1]
    emb = get_1d_sincos_pos_embed_from_grid(D, torch.arange(0, num_frames).unsqueeze(1), output_type="pt")
    return emb.float().unsqueeze(0).to(device=device, dtype=dtype)


# -- attention processors for the embedded baselines ---------------------------------


def _head_range(heads: int, pg: ParallelGroup) -> tuple[int, int]:
    """This rank's contiguous slice of heads for tensor parallelism (may be empty)."""
    per = math.ceil(heads / pg.world_size)
    return min(heads, pg.rank * per), min(heads, (pg.rank + 1) * per)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(n, L, H*hd) -> (n, H, L, hd)"""
    n, L, _ = x.shape
    return x.view(n, L, -1, head_dim).transpose(1, 2)


class UlyssesSpatialAttention:
    """Self-attention over S-sharded tokens: all-to-all Q, K, V (S <- heads), attend, all-to-all back."""

    def __init__(self, pg: ParallelGroup, num_patches: int):
        self.pg, self.S = pg, num_patches

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kw):
        pg, S = self.pg, self.S
        n, Sl, _ = hidden_states.shape                                   # (B*T, Sl, D)
        H = attn.heads
        hd = attn.to_q.out_features // H

        def to_full_sequence(x):                                         # (B*T, Sl, H*hd)
            x = x.view(n, Sl, H, hd)                                     # (B*T, Sl, H, hd)
            x = comm.all_to_all_switch(x, scatter_dim=2, gather_dim=1, gather_size=S, pg=pg)
            return x.transpose(1, 2)                                     # (B*T, Hl, S, hd)

        q = to_full_sequence(attn.to_q(hidden_states))
        k = to_full_sequence(attn.to_k(hidden_states))
        v = to_full_sequence(attn.to_v(hidden_states))
        out = F.scaled_dot_product_attention(q, k, v, scale=attn.scale)  # (B*T, Hl, S, hd)
        out = comm.all_to_all_switch(out.transpose(1, 2), scatter_dim=1, gather_dim=2, gather_size=H, pg=pg)
        out = out.reshape(n, Sl, H * hd)                                 # (B*T, Sl, D)
        return attn.to_out[1](attn.to_out[0](out))


class RingSpatialAttention:
    """Self-attention over S-sharded tokens: K/V blocks travel the ring; softmaxes merge by log-sum-exp."""

    def __init__(self, pg: ParallelGroup, num_patches: int):
        self.pg, self.S = pg, num_patches

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kw):
        pg = self.pg
        n, Sl, _ = hidden_states.shape                                   # (B*T, Sl, D)
        hd = attn.to_q.out_features // attn.heads
        q = _heads(attn.to_q(hidden_states), hd).float()                 # (B*T, H, Sl, hd)
        kv = torch.stack([_heads(attn.to_k(hidden_states), hd),
                          _heads(attn.to_v(hidden_states), hd)])                   # (2, B*T, H, Sl, hd)
        out = ring_attention(q, kv, attn.scale, pg, key_len=self.S)      # (B*T, H, Sl, hd)
        out = out.to(hidden_states.dtype).transpose(1, 2).reshape(n, Sl, -1)
        return attn.to_out[1](attn.to_out[0](out))


class TensorParallelAttention:
    """Megatron-SP attention: all-gather tokens, this rank's heads only, reduce-scatter the output.

    `seq_dim` is the sharded token dimension of the input: 1 for spatial blocks
    ((B*T, Sl, D), trimmed to the true S so padded patches are never attended to), 0 for
    temporal blocks ((B*Sl, T, D): rows are independent sequences, order is irrelevant).
    """

    def __init__(self, pg: ParallelGroup, seq_dim: int, seq_len: int | None):
        self.pg, self.seq_dim, self.seq_len = pg, seq_dim, seq_len

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kw):
        pg, d = self.pg, self.seq_dim
        local = hidden_states.shape[d]
        x = comm.all_gather(hidden_states, d, pg, size=self.seq_len)          # full token dim
        ctx = x if encoder_hidden_states is None else encoder_hidden_states
        if d == 0 and encoder_hidden_states is not None:
            raise NotImplementedError("cross-attention over gathered rows")
        H = attn.heads
        hd = attn.to_q.out_features // H
        h0, h1 = _head_range(H, pg)
        rows = slice(h0 * hd, h1 * hd)
        q = _heads(F.linear(x, attn.to_q.weight[rows], _bias(attn.to_q, rows)), hd)    # (n, Hr, L, hd)
        k = _heads(F.linear(ctx, attn.to_k.weight[rows], _bias(attn.to_k, rows)), hd)
        v = _heads(F.linear(ctx, attn.to_v.weight[rows], _bias(attn.to_v, rows)), hd)
        mask = None if attention_mask is None else attention_mask[:, None]           # (n, 1, 1, Lk)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale)  # (n, Hr, L, hd)
        out = out.transpose(1, 2).reshape(*x.shape[:2], -1)                          # (n, L, Hr*hd)
        partial = F.linear(out, attn.to_out[0].weight[:, rows])                      # (n, L, D), partial sum
        partial = comm.pad_dim(partial, d, local * pg.world_size)
        y = comm.reduce_scatter(partial, d, pg)                                      # local shard, summed
        if attn.to_out[0].bias is not None:
            y = y + attn.to_out[0].bias
        return attn.to_out[1](y)


def _bias(linear: nn.Linear, rows: slice):
    return None if linear.bias is None else linear.bias[rows]


class TensorParallelFeedForward(nn.Module):
    """Megatron-SP MLP around diffusers' `FeedForward` (GELU variants): column- then row-parallel."""

    def __init__(self, ff: nn.Module, pg: ParallelGroup):
        super().__init__()
        act = ff.net[0]
        if type(act).__name__ != "GELU":
            raise NotImplementedError(f"megatron-sp supports GELU feed-forwards, not {type(act).__name__}")
        self.ff, self.pg = ff, pg

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        pg = self.pg
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])                              # (rows_local, D)
        x = comm.all_gather(x, 0, pg)                                         # (N*rows_local, D)
        act, fc2 = self.ff.net[0], self.ff.net[2]
        inner = act.proj.out_features
        per = math.ceil(inner / pg.world_size)
        cols = slice(min(inner, pg.rank * per), min(inner, (pg.rank + 1) * per))
        h = act.gelu(F.linear(x, act.proj.weight[cols], _bias(act.proj, cols)))
        partial = F.linear(self.ff.net[1](h), fc2.weight[:, cols])            # (N*rows_local, D), partial
        y = comm.reduce_scatter(partial, 0, pg)                               # (rows_local, D)
        if fc2.bias is not None:
            y = y + fc2.bias
        for extra in self.ff.net[3:]:
            y = extra(y)
        return y.reshape(shape)


@contextlib.contextmanager
def _swapped(block, pg, strategy: str, num_patches: int, spatial: bool):
    """Install a strategy's attention processors / MLP in one block; restore on exit."""
    saved = (block.attn1.processor, block.attn2.processor if block.attn2 is not None else None, block.ff)
    compiled = block.__dict__.get("forward")
    if isinstance(compiled, CompiledBlock):
        # new processors every call: a compiled graph would guard on them and recompile each time; eager instead
        block.forward = compiled.eager
    try:
        if strategy == "ulysses" and spatial:
            block.attn1.processor = UlyssesSpatialAttention(pg, num_patches)
        elif strategy == "ring" and spatial:
            block.attn1.processor = RingSpatialAttention(pg, num_patches)
        elif strategy == "megatron-sp":
            seq_dim, seq_len = (1, num_patches) if spatial else (0, None)
            block.attn1.processor = TensorParallelAttention(pg, seq_dim, seq_len)
            if block.attn2 is not None:
                block.attn2.processor = TensorParallelAttention(pg, seq_dim, seq_len)
            block.ff = TensorParallelFeedForward(block.ff, pg)
        yield block
    finally:
        block.attn1.processor = saved[0]
        if block.attn2 is not None:
            block.attn2.processor = saved[1]
        block.ff = saved[2]
        if isinstance(compiled, CompiledBlock):
            block.forward = compiled


# -- the forward ---------------------------------------------------------------------


def parallel_forward(
    model,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    pg: ParallelGroup,
    strategy: str = "dsp",
    cfg: CfgGroups | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    cache=None,
) -> torch.Tensor:
    """`LatteTransformer3DModel.forward` over the group; every rank returns the full output.

    hidden_states (B, C, T, H, W), timestep (B,), encoder_hidden_states (B, L, C_text)
    -> (B, C_out, T, H, W)

    `encoder_attention_mask` (B, L), 1 = keep, lets prompts of different lengths share a
    batch (padded text tokens are masked out of cross-attention).

    `cache`: step caching's `engine.cache.StepRun` for the rows this rank runs (under `cfg`, its half's):
    the first spatial block is the head; the other blocks run on the rows that recompute.
    """
    check_strategy(strategy)
    if cfg is not None:                 # each half of the group takes half of the batch, then the pair joins them
        return cfg_parallel(functools.partial(parallel_forward, model, pg=cfg.half, strategy=strategy, cache=cache),
                            cfg, hidden_states, timestep, encoder_hidden_states,
                            encoder_attention_mask=encoder_attention_mask)
    bias = None
    if encoder_attention_mask is not None:
        keep = encoder_attention_mask.to(torch.bool)
        bias = torch.zeros(keep.shape, dtype=hidden_states.dtype, device=hidden_states.device)
        bias = bias.masked_fill(~keep, -10000.0)[:, None, :]               # (B, 1, L), as diffusers builds it
    if strategy == "dsp":
        return _dsp_forward(model, hidden_states, timestep, encoder_hidden_states, pg, bias, cache)
    return _embedded_forward(model, hidden_states, timestep, encoder_hidden_states, pg, strategy, bias, cache)


def _repeat(x: torch.Tensor | None, times: int) -> torch.Tensor | None:
    return None if x is None else x.repeat_interleave(times, dim=0)


def _conditioning(model, timestep, encoder_hidden_states, batch_size, dtype):
    t6, t_final = model.adaln_single(
        timestep, added_cond_kwargs={"resolution": None, "aspect_ratio": None},
        batch_size=batch_size, hidden_dtype=dtype,
    )                                                                   # (B, 6D), (B, D)
    text = model.caption_projection(encoder_hidden_states)              # (B, L, D)
    return t6, t_final, text


def _final_layer(model, tokens: torch.Tensor, t_final: torch.Tensor) -> torch.Tensor:
    """Latte's output head, per token. tokens (B, t, s, D) -> (B, t, s, p*p*C_out)"""
    shift, scale = (model.scale_shift_table[None] + t_final[:, None]).chunk(2, dim=1)  # (B, 1, D) each
    x = model.norm_out(tokens)
    x = x * (1 + scale[:, :, None]) + shift[:, :, None]
    return model.proj_out(x)


def _unpatchify(model, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, T, h*w, p*p*C) -> (B, C, T, h*p, w*p)"""
    B, T = x.shape[:2]
    p, C = model.config.patch_size, model.out_channels
    x = x.reshape(B * T, h, w, p, p, C)
    x = torch.einsum("nhwpqc->nchpwq", x).reshape(B, T, C, h * p, w * p)
    return x.permute(0, 2, 1, 3, 4)


def _first(dim: int, n: int):
    """t -> its first n entries along `dim` (a shard's real frames or patches, its padding cut)."""
    return lambda t: t.narrow(dim, 0, n)


def _dsp_forward(model, x, timestep, encoder_hidden_states, pg, text_bias=None, cache=None):
    B, C, T, H, W = x.shape
    p = model.config.patch_size
    h, w = H // p, W // p
    S = h * w
    t6, t_final, text = _conditioning(model, timestep, encoder_hidden_states, B, x.dtype)

    frames = comm.shard(x, 2, pg)                                           # (B, C, Tl, H, W)
    Tl = frames.shape[2]
    tokens = model.pos_embed(frames.permute(0, 2, 1, 3, 4).reshape(B * Tl, C, H, W))  # (B*Tl, S, D)
    D = tokens.shape[-1]
    pos_t = temporal_pos_embed(model, T, tokens.dtype, tokens.device)       # (1, T, D)
    text_spatial = text.repeat_interleave(Tl, dim=0)                        # (B*Tl, L, D)
    bias_spatial = _repeat(text_bias, Tl)                                   # (B*Tl, 1, L)
    t6_spatial = t6.repeat_interleave(Tl, dim=0)                            # (B*Tl, 6D)
    L = len(model.transformer_blocks)
    head_in = head_out = None
    for i, (spatial, temporal) in enumerate(zip(model.transformer_blocks, model.temporal_transformer_blocks)):
        if i == 0 and cache is not None:
            head_in = tokens.view(B, Tl, S, D)
        tokens = spatial(tokens, None, text_spatial, bias_spatial, t6_spatial)  # (B*Tl, S, D)
        if i == 0 and cache is not None:
            # the head's metric on my frames (T-sharded); the residuals live in the S-sharded layout below
            real = comm.valid_length(T, pg)
            cache.decide(head_in, tokens.view(B, Tl, S, D), None if real == Tl else _first(1, real), pg)
        tokens = comm.all_to_all_switch(tokens.view(B, Tl, S, D), scatter_dim=2, gather_dim=1,
                                        gather_size=T, pg=pg)               # (B, T, Sl, D)
        if i == 0 and cache is not None:
            head_out, tokens = tokens, cache.take(tokens)                   # (B', T, Sl, D): the rows that recompute
            text_bias, t6, text = cache.take(text_bias), cache.take(t6), cache.take(text)
            B = tokens.shape[0]
            text_spatial, bias_spatial = text.repeat_interleave(Tl, dim=0), _repeat(text_bias, Tl)
            t6_spatial = t6.repeat_interleave(Tl, dim=0)
            if B == 0:
                break
        Sl = tokens.shape[2]
        seq = tokens.permute(0, 2, 1, 3).reshape(B * Sl, T, D)              # (B*Sl, T, D)
        if i == 0 and T > 1:
            seq = seq + pos_t
        seq = temporal(seq, None, None, None, t6.repeat_interleave(Sl, dim=0))
        tokens = seq.view(B, Sl, T, D).permute(0, 2, 1, 3)                  # (B, T, Sl, D)
        if i < L - 1:
            tokens = comm.all_to_all_switch(tokens, scatter_dim=1, gather_dim=2, gather_size=S, pg=pg)
            tokens = tokens.reshape(B * Tl, S, D)                            # (B*Tl, S, D)
    if cache is not None:
        tokens = cache.leave(tokens, head_out)                              # (B, T, Sl, D), every row
    out = _final_layer(model, tokens, t_final)                              # (B, T, Sl, p*p*C_out)
    out = comm.gather(out, 2, S, pg)                                        # (B, T, S, p*p*C_out)
    return _unpatchify(model, out, h, w)


def _embedded_forward(model, x, timestep, encoder_hidden_states, pg, strategy, text_bias=None, cache=None):
    B, C, T, H, W = x.shape
    p = model.config.patch_size
    h, w = H // p, W // p
    S = h * w
    t6, t_final, text = _conditioning(model, timestep, encoder_hidden_states, B, x.dtype)

    tokens = model.pos_embed(x.permute(0, 2, 1, 3, 4).reshape(B * T, C, H, W))  # (B*T, S, D)
    tokens = comm.shard(tokens, 1, pg)                                       # (B*T, Sl, D)
    Sl, D = tokens.shape[1], tokens.shape[2]
    pos_t = temporal_pos_embed(model, T, tokens.dtype, tokens.device)       # (1, T, D)
    text_spatial = text.repeat_interleave(T, dim=0)                         # (B*T, L, D)
    bias_spatial = _repeat(text_bias, T)                                    # (B*T, 1, L)
    t6_spatial = t6.repeat_interleave(T, dim=0)                             # (B*T, 6D)
    t6_temporal = t6.repeat_interleave(Sl, dim=0)                           # (B*Sl, 6D)
    head_out = None
    for i, (spatial, temporal) in enumerate(zip(model.transformer_blocks, model.temporal_transformer_blocks)):
        head_in = tokens
        with _swapped(spatial, pg, strategy, S, spatial=True):
            tokens = spatial(tokens, None, text_spatial, bias_spatial, t6_spatial)  # (B*T, Sl, D)
        if i == 0 and cache is not None:
            real = comm.valid_length(S, pg)
            head_out = tokens.view(B, T, Sl, D)
            cache.decide(head_in.view(B, T, Sl, D), head_out, None if real == Sl else _first(2, real), pg)
            tokens = cache.take(tokens, per_item=T)                         # (B'*T, Sl, D): the rows that recompute
            text_bias, t6, text = cache.take(text_bias), cache.take(t6), cache.take(text)
            B = tokens.shape[0] // T
            text_spatial, bias_spatial = text.repeat_interleave(T, dim=0), _repeat(text_bias, T)
            t6_spatial, t6_temporal = t6.repeat_interleave(T, dim=0), t6.repeat_interleave(Sl, dim=0)
            if B == 0:
                break
        seq = tokens.view(B, T, Sl, D).permute(0, 2, 1, 3).reshape(B * Sl, T, D)  # (B*Sl, T, D)
        if i == 0 and T > 1:
            seq = seq + pos_t
        with _swapped(temporal, pg, strategy, S, spatial=False):
            seq = temporal(seq, None, None, None, t6_temporal)              # (B*Sl, T, D)
        tokens = seq.view(B, Sl, T, D).permute(0, 2, 1, 3).reshape(B * T, Sl, D)
    if cache is not None:
        tokens = cache.leave(tokens.view(B, T, Sl, D), head_out).flatten(0, 1)    # (B*T, Sl, D), every row
        B = tokens.shape[0] // T
    out = _final_layer(model, tokens.view(B, T, Sl, D), t_final)            # (B, T, Sl, p*p*C_out)
    out = comm.gather(out, 2, S, pg)                                        # (B, T, S, p*p*C_out)
    return _unpatchify(model, out, h, w)
