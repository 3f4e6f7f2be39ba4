"""Sequence parallelism for diffusers' Wan and SkyReels-V2 transformers: a shard plan (`engine/sharding.py`).

The plan starts from diffusers' own `WanTransformer3DModel._cp_plan`, read as it is (`from_cp_plan`), and
changes one thing: the patch embedding sees only the frames that hold my tokens. SkyReels-V2 (no `_cp_plan`
in diffusers) adds diffusion forcing's per-frame modulation. Rank r of N keeps tokens [r*Sl, (r+1)*Sl),
Sl = ceil(S/N), zero-padded; then diffusers' `forward` runs, unchanged:

    where (module)             rule                                  from
    the model (input)          timestep (B, S) per token (Wan 2.2 TI2V): my tokens'     diffusers' _cp_plan
                               SkyReels: timestep (B, F) per frame: my frames' columns,
                               so the modulation diffusers repeats over tokens is
                               built for my frames only
    rope (output)              cos/sin rows of my tokens' *global* positions             diffusers' _cp_plan
    patch_embedding (input)    only the latent frames that hold my tokens                longserve
    blocks.0 (input)           those frames' tokens cut to mine                          longserve
    every block (input)        SkyReels, per-frame modulation (B, 6, my frames' tokens,
                               D): cut to my tokens
    every block's attn1        `WanAttention`: Ulysses / Ring / USP attention with diffusion forcing's
                               block-causal mask applied from global positions (the geometry's `causal`)
    norm_out (output)          SkyReels, per-frame modulation: my tokens placed in a buffer as long as
                               my frames, so diffusers' per-token shift/scale apply where they belong
    proj_out (input, output)   my tokens back (per-frame modulation); all-gather of     diffusers' _cp_plan
                               the output tokens, trimmed: (B, S, p*C_out) on every rank

Everything else (cross-attention against the replicated text, the FFN, norms, time and text embeddings,
unpatchify) is per token or replicated and runs as diffusers wrote it.

Diffusion forcing's block-causal mask: diffusers builds it as an S x S boolean when
`config.num_frame_per_block > 1` (1 GiB at 32k tokens). The engine keeps that config at 1 and passes the
block size here instead; the processor applies the same mask by global positions without materialising it
(`engine.parallel.BlockCausal`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

from longserve.engine.parallel import BlockCausal, SequenceParallel
from longserve.engine.sharding import (
    At,
    Place,
    ShardedAttention,
    ShardPlan,
    Split,
    TokenShard,
    from_cp_plan,
    shard_model,
)


@dataclass(frozen=True)
class WanShard(TokenShard):
    """One forward's geometry: F frames of `frame_tokens` tokens; my tokens lie in frames [f0, f1)."""

    frame_tokens: int
    f0: int
    f1: int
    p_t: int                            # latent frames per patch
    frame_timesteps: bool = False       # SkyReels' diffusion forcing: a timestep per frame, modulation per token
    causal: BlockCausal | None = None   # or radial attention's RadialMask (the same `visible` protocol)

    UNITS = ("tokens", "frames", "latent_frames", "tokens_of_my_frames")

    @classmethod
    def of(cls, model, x: torch.Tensor, sp: SequenceParallel, frames_per_block: int = 1, radial: bool = False,
           **extra) -> "WanShard":
        _, _, F, H, W = x.shape
        p_t, p_h, p_w = model.config.patch_size
        f, frame_tokens = F // p_t, (H // p_h) * (W // p_w)
        S = f * frame_tokens
        Sl, start, stop = cls.token_range(S, sp)
        f0 = min(start // frame_tokens, f - 1)                       # at least one frame, even with no tokens
        f1 = max(-(-stop // frame_tokens), f0 + 1)
        causal = BlockCausal(frame_tokens, frames_per_block) if frames_per_block > 1 else None
        if radial:                                    # radial attention's static sparse mask (engine/attention.py)
            from longserve.engine.attention import RadialMask

            if causal is not None:
                raise ValueError("radial attention with a block-causal mask (diffusion forcing) is not built")
            causal = RadialMask(f, frame_tokens)
        return cls(sp, S, Sl, start, stop, frame_tokens, f0, f1, p_t, causal=causal, **extra)

    def split(self, x: torch.Tensor, dim: int, unit: str) -> torch.Tensor:
        if unit == "frames":
            return x.narrow(dim, self.f0, self.f1 - self.f0)                    # (.., my frames, ..)
        if unit == "latent_frames":
            return x.narrow(dim, self.f0 * self.p_t, (self.f1 - self.f0) * self.p_t)
        if unit == "tokens_of_my_frames":
            return self.mine(x, dim, offset=self.f0 * self.frame_tokens)        # (.., Sl, ..)
        return super().split(x, dim, unit)

    def place(self, x: torch.Tensor, dim: int, unit: str) -> torch.Tensor:
        if unit != "tokens_of_my_frames":
            return super().place(x, dim, unit)
        shape = list(x.shape)
        shape[dim] = (self.f1 - self.f0) * self.frame_tokens
        full = x.new_zeros(shape)                                               # (.., my frames' tokens, ..)
        full.narrow(dim, self.start - self.f0 * self.frame_tokens, self.real_tokens).copy_(
            x.narrow(dim, 0, self.real_tokens))
        return full


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on interleaved pairs (what diffusers' processors apply). x (B, Sl, H, hd)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


class WanAttention(ShardedAttention):
    """A Wan block's self-attention over the sharded sequence."""

    def rotate(self, x, rotary_emb):
        return rotate(x, *rotary_emb)


#: diffusers' own plan, with the patch embedding cut to my frames before it runs
WAN_PLAN = ShardPlan(WanShard, from_cp_plan(WanTransformer3DModel._cp_plan),
                     attention={"blocks.*.attn1": WanAttention}).extended(modules={
    "patch_embedding": At(inputs={"input": Split(2, "latent_frames")}),      # (B, C, my latent frames, H, W)
    "blocks.0": At(inputs={"hidden_states": Split(1, "tokens_of_my_frames")}),
})

#: SkyReels-V2: per-frame timesteps instead of per-token ones, and the modulation they make cut by frames
SKYREELS_PLAN = WAN_PLAN.extended(modules={
    "": At(inputs={"timestep": Split(1, "frames", expected_dims=2)}),
    "blocks.*": At(inputs={"temb": Split(2, "tokens_of_my_frames", expected_dims=4)}),
    "norm_out": At(outputs={0: Place(1, "tokens_of_my_frames", when="frame_timesteps")}),
    "proj_out": At(inputs={0: Split(1, "tokens_of_my_frames", when="frame_timesteps")},
                   outputs=WAN_PLAN.modules["proj_out"].outputs),
})


class WanSequenceParallel:
    """Makes `model` (a `WanTransformer3DModel` or `SkyReelsV2Transformer3DModel`) run sequence-parallel.

        sp_model = WanSequenceParallel(model)           # once: the plan's hooks
        out = sp_model(x, t, text, sp)                  # diffusers' forward, sharded over `sp`

    Every rank of `sp` calls it with the same replicated inputs and gets the same output.
    """

    def __init__(self, model):
        self.model = model
        self.skyreels = hasattr(model.config, "num_frame_per_block")
        if self.skyreels and model.config.num_frame_per_block > 1:
            model._set_ar_attention(1)          # no S x S mask from diffusers: the processor applies it
        self.sharded = shard_model(model, SKYREELS_PLAN if self.skyreels else WAN_PLAN)

    def _tokens(self, x: torch.Tensor) -> int:
        """S, the tokens of a latent x (B, C, F, H, W) after the patch embedding."""
        p_t, p_h, p_w = self.model.config.patch_size
        return (x.shape[2] // p_t) * (x.shape[3] // p_h) * (x.shape[4] // p_w)

    def __call__(self, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, sp: SequenceParallel,
                 fps: int | None = None, frames_per_block: int = 1, image: torch.Tensor | None = None,
                 radial: bool = False) -> torch.Tensor:
        """diffusers' forward over the group. x (B, C, F, H, W); timestep (B,), or (B, F) per latent frame
        (diffusion forcing, SkyReels-V2), or (B, S) per token (Wan 2.2 TI2V's expand_timesteps: what
        `WanTransformer3DModel` reads a 2-D timestep as); text (B, L, C_text) -> (B, C_out, F, H, W) on every
        rank.

        `image`: image-to-video's CLIP tokens (`encoder_hidden_states_image`), (k B, T, C_img) with k images per
        row (FLF2V: 2, first and last, which diffusers' image embedder views as one row of 2T tokens). The image
        path is cross-attention (replicated keys, per-token queries) and the extra input channels (the condition
        concatenated to the latents) only widen `patch_embedding`'s input: neither needs a rule.

        CFG-parallel is the worker's, around this forward (`VideoFamily.denoise`). `fps`: SkyReels' fps id, one
        for the whole batch (diffusers' forward adds a batch of one fps embedding to every row; with one per row
        its per-frame broadcast fits a batch of one only). `frames_per_block` > 1: diffusion forcing's
        block-causal mask. `radial`: self-attention under radial attention's static sparse mask
        (engine/attention.py's `RadialMask`), a training-free approximation.
        """
        per_frame = timestep.ndim == 2 and self.skyreels
        if timestep.ndim == 2 and not self.skyreels and timestep.shape[1] != self._tokens(x):
            raise ValueError(f"per-token timesteps must be one per token: {self._tokens(x)}; got {timestep.shape[1]}")
        kwargs = {}
        if self.skyreels:
            kwargs = {"enable_diffusion_forcing": per_frame, "fps": None if fps is None else [fps]}
        if image is not None:
            kwargs["encoder_hidden_states_image"] = image
        shard = WanShard.of(self.model, x, sp, frames_per_block, radial=radial, frame_timesteps=per_frame)
        return self.sharded(shard, x, timestep, text, return_dict=False, **kwargs)[0]
