"""Token parallelism for diffusers' SANA-Video transformer (`SanaVideoTransformer3DModel`): a shard plan
(`engine/sharding.py`) whose attention is linear, so its cross-worker step is one all-reduce of a small state.

The model: a patch embedding (1x2x2) to S = F x H x W tokens, then blocks of
    linear self-attention   out_n = (sum_m v_m rot(k_m)^T) rot(q_n) / (sum_m k_m . q_n)   (ReLU kernels, RoPE)
    cross-attention         softmax over the replicated prompt tokens (per query: local)
    GLUMB FFN               1x1 conv, 3x3 depthwise conv inside each frame, 1x1 conv, then a temporal conv
                            (kernel 3 over frames: the only mixing across frames outside the attention)

Rank r of N keeps whole frames: frames [r*Fl, (r+1)*Fl) of F, Fl = ceil(F/N), zero-padded at the end, so its
tokens are [r*Sl, (r+1)*Sl) with Sl = Fl x H x W (a frame never straddles two ranks: the 3x3 conv stays local).
Then diffusers' `forward` runs, unchanged between these points:

    where (module)                     rule
    rope (output)                      cos/sin rows of my tokens' *global* positions: (1, S, 1, hd) -> (1, Sl, 1, hd)
    patch_embedding (input)            my latent frames, zero-padded: (B, C, F, H, W) -> (B, C, Fl, H, W)
    time_embed (input)                 image-to-video's per-token timesteps (B*S,) -> my tokens' (B*Sl,)
    transformer_blocks.* (input)       `frames` (which the FFN unflattens my tokens by) -> Fl
    transformer_blocks.*.attn1         `SanaLinearAttention`: the state summed over my tokens, all-reduced
    transformer_blocks.*.ff.conv_temp  `TemporalHalo`: my frames plus one neighbour frame each side
    proj_out (output)                  all-gather of the output tokens, trimmed: (B, S, p*C) on every rank

The linear attention per rank (shapes per rank; B batch, H heads, C head dim, Sl my tokens):

    q, k, v (B, H, C, Sl); padding tokens' k zeroed, so they add nothing to a sum
    kv = v @ rot(k)^T (B, H, C, C), ksum = sum_n k (B, H, C, 1) --all-reduce (one tensor, (B, H, C, C+1))-->
    out = (kv @ rot(q)) / (ksum^T @ q + 1e-15)  (B, H, C, Sl)

It is exact: the sums are the same sums in another order (diffusers' own fp32 state), at any head count (heads are
not split) and any frame count (frames fewer than N leave ranks with padding only). The all-reduce carries
H x C x (C+1) values per row and block, whatever the length: at the published 20 heads of 112, 254k floats,
against a Ulysses all-to-all pair's 4 x S x 2240 / N.

The temporal conv per rank: my frames (padding frames zeroed, which is the conv's own zero padding past the last
real frame), my first and last frames all-gathered, (N, 2, B, C, H*W), and the previous rank's last and the next
rank's first put around mine: (B, C, Fl + 2, H*W) through diffusers' conv (padding 1), trimmed back to Fl.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.hooks import HookRegistry, ModelHook

from longserve.engine import comm
from longserve.engine.models.wan import rotate
from longserve.engine.parallel import SequenceParallel
from longserve.engine.sharding import At, Gather, Replace, ShardedModel, ShardPlan, Split, TokenShard, shard_model

HALO_HOOK = "longserve_temporal_halo"


@dataclass(frozen=True)
class SanaShard(TokenShard):
    """One forward's geometry: F frames of `frame_tokens` tokens; my frames [f0, f0 + Fl), the real ones up to f1."""

    frame_tokens: int
    frames_local: int                  # Fl: my frames, padding included
    f0: int
    f1: int
    p_t: int                           # latent frames per patch
    batch: int
    token_timesteps: bool = False      # image to video: a timestep per token (the image's frame at 0)

    UNITS = ("tokens", "latent_frames", "token_rows")

    @classmethod
    def of(cls, model, x: torch.Tensor, sp: SequenceParallel, token_timesteps: bool = False) -> "SanaShard":
        B, _, F, H, W = x.shape
        p_t, p_h, p_w = model.config.patch_size
        f, frame_tokens = F // p_t, (H // p_h) * (W // p_w)
        Fl = comm.shard_size(f, sp.world_size)
        f0, f1 = min(f, sp.pg.rank * Fl), min(f, (sp.pg.rank + 1) * Fl)
        return cls(sp, f * frame_tokens, Fl * frame_tokens, f0 * frame_tokens, f1 * frame_tokens, frame_tokens,
                   Fl, f0, f1, p_t, B, token_timesteps)

    @property
    def real_frames(self) -> int:
        return self.f1 - self.f0

    def split(self, x: torch.Tensor, dim: int, unit: str) -> torch.Tensor:
        if unit == "latent_frames":                                              # (.., Fl * p_t, ..), zero-padded
            p = self.p_t
            return comm.pad_dim(x.narrow(dim, self.f0 * p, self.real_frames * p), dim, self.frames_local * p)
        if unit == "token_rows":                                                 # (B*S,) -> (B*Sl,)
            return self.mine(x.unflatten(dim, (self.batch, -1)), dim + 1).flatten(dim, dim + 1)
        return super().split(x, dim, unit)


@torch.compiler.disable
def linear_attention(q: torch.Tensor, k: torch.Tensor, qr: torch.Tensor, kr: torch.Tensor, v: torch.Tensor,
                     sp: SequenceParallel) -> torch.Tensor:
    """SANA's linear attention over tokens sharded on `sp`. q, k (ReLU'd), qr, kr (and rotated), v: (B, H, C, Sl),
    padding keys zero -> (B, H, C, Sl) my tokens' output, float32 (diffusers' state is float32)."""
    kv = torch.matmul(v.float(), kr.float().transpose(-1, -2))                 # (B, H, C, C)
    ksum = k.sum(dim=-1, keepdim=True)                                         # (B, H, C, 1)
    state = comm.all_reduce(torch.cat([kv, ksum.float()], dim=-1), sp.pg)      # (B, H, C, C + 1): the sums of all
    kv, ksum = state[..., :-1], state[..., -1:].to(k.dtype)
    z = 1 / (ksum.transpose(-2, -1) @ q + 1e-15)                               # (B, H, 1, Sl)
    return torch.matmul(kv, qr.float()) * z                                    # (B, H, C, Sl)


class SanaLinearAttention:
    """A block's linear self-attention over the sharded tokens; diffusers' own processor when no sharded forward
    runs."""

    def __init__(self, owner: ShardedModel, layer: int | None, original):
        self.owner, self.layer, self.original = owner, layer, original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        shard = self.owner.shard
        if shard is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        dtype = hidden_states.dtype
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)  # (B, Sl, H*C)
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))                      # (B, Sl, H, C)
        real = (torch.arange(shard.Sl, device=k.device) < shard.real_tokens)[None, :, None, None]
        q, k = torch.relu(q), torch.relu(k) * real                             # padding keys: nothing to any sum
        qr, kr = rotate(q, *rotary_emb), rotate(k, *rotary_emb)
        q, k, qr, kr, v = (t.permute(0, 2, 3, 1) for t in (q, k, qr, kr, v))     # (B, H, C, Sl)
        out = linear_attention(q, k, qr, kr, v, shard.sp)                       # (B, H, C, Sl)
        out = out.flatten(1, 2).transpose(1, 2).to(dtype)                       # (B, Sl, H*C)
        return attn.to_out[1](attn.to_out[0](out))


class TemporalHalo(ModelHook):
    """The FFN's temporal conv (kernel 3 over frames) on my frames, with the neighbouring ranks' edge frames."""

    def __init__(self, owner: ShardedModel):
        super().__init__()
        self.owner = owner

    def pre_forward(self, module, x, *args, **kwargs):
        shard = self.owner.shard
        if shard is None:
            return (x, *args), kwargs
        sp, N = shard.sp, shard.sp.world_size
        real = (torch.arange(shard.frames_local, device=x.device) < shard.real_frames)[None, None, :, None]
        x = x * real                                                            # (B, C, Fl, HW): padding zeroed
        edges = torch.stack([x[:, :, 0], x[:, :, -1]])                          # (2, B, C, HW)
        every = comm.all_gather(edges[None], 0, sp.pg)                          # (N, 2, B, C, HW)
        r, zero = sp.pg.rank, torch.zeros_like(edges[0])
        before = every[r - 1, 1] if r > 0 else zero                             # (B, C, HW)
        after = every[r + 1, 0] if r < N - 1 else zero
        return (torch.cat([before[:, :, None], x, after[:, :, None]], dim=2), *args), kwargs   # (B, C, Fl+2, HW)

    def post_forward(self, module, output):
        shard = self.owner.shard
        return output if shard is None else output.narrow(2, 1, shard.frames_local)           # (B, C, Fl, HW)


SANA_VIDEO_PLAN = ShardPlan(SanaShard, {
    "rope": At(outputs={0: Split(1), 1: Split(1)}),                            # (1, S, 1, hd) -> (1, Sl, 1, hd)
    "patch_embedding": At(inputs={"input": Split(2, "latent_frames")}),        # (B, C, Fl * p_t, H, W)
    "time_embed": At(inputs={"timestep": Split(0, "token_rows", when="token_timesteps")}),   # (B*Sl,)
    "transformer_blocks.*": At(inputs={"frames": Replace("frames_local")}),    # the FFN's unflatten: Fl frames
    "proj_out": At(outputs={0: Gather(1)}),                                    # (B, Sl, C) -> (B, S, C)
}, attention={"transformer_blocks.*.attn1": SanaLinearAttention})


class SanaVideoSequenceParallel:
    """Makes a `SanaVideoTransformer3DModel` run token-parallel.

        sp_model = SanaVideoSequenceParallel(model)     # once: the plan's hooks
        out = sp_model(x, t, cond, sp)                  # diffusers' forward, sharded over `sp`

    Every rank of `sp` calls it with the same replicated inputs and gets the same output.
    """

    def __init__(self, model):
        self.model = model
        self.sharded = shard_model(model, SANA_VIDEO_PLAN)
        for block in model.transformer_blocks:
            registry = HookRegistry.check_if_exists_or_initialize(block.ff.conv_temp)
            if registry.get_hook(HALO_HOOK) is not None:
                registry.remove_hook(HALO_HOOK, recurse=False)
            registry.register_hook(TemporalHalo(self.sharded), HALO_HOOK)

    def __call__(self, x: torch.Tensor, timestep: torch.Tensor, cond: dict, sp: SequenceParallel) -> torch.Tensor:
        """x (B, C, F, H, W); timestep (B,), or (B, 1, F, H', W') per token (image to video: 0 on the image's
        frame); cond: `encoder_hidden_states` (B, L, C_text) and `encoder_attention_mask` (B, L) -> (B, C_out, F,
        H, W) on every rank (CFG-parallel is the worker's, around it: `VideoFamily.denoise`)."""
        shard = SanaShard.of(self.model, x, sp, token_timesteps=timestep.ndim > 1)
        return self.sharded(shard, hidden_states=x, timestep=timestep, return_dict=False, **cond)[0]
