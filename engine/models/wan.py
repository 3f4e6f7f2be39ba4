"""Sequence parallelism for diffusers' Wan and SkyReels-V2 transformers, as hooks on their own modules.

`WanSequenceParallel(model)` registers hooks (diffusers' `ModelHook`s, the machinery of
its own context parallelism and caches) on the modules where the token sequence of
F x H x W patches must be split or joined; then `diffusers`' own `forward` runs, unchanged:

    where (module)                 what the hook does (rank r of N, Sl = ceil(S/N) tokens each)
    the model (input)              per-frame timesteps (diffusion forcing): keep my frames' columns, so
                                   diffusers' per-token modulation is built for my frames only;
                                   per-token timesteps (Wan 2.2 TI2V's expand_timesteps): keep my tokens'
                                   [r*Sl, (r+1)*Sl), zero-padded to Sl, so the modulation diffusers builds
                                   is already my tokens' (blocks and norm_out need nothing more)
    rope (output)                  keep the cos/sin rows of my tokens' *global* positions, zero-pad to Sl
    patch_embedding (input)        embed only the frames that hold my tokens
    blocks.0 (input)               cut those frames' tokens to mine [r*Sl, (r+1)*Sl), zero-pad to Sl
    every block (input)            per-token modulation (diffusion forcing): cut it to my tokens the same way
    every block's attn1            `SequenceParallelAttnProcessor`: diffusers' projections, q/k norms and
                                   rotary on my tokens, then Ulysses / Ring / USP attention
                                   (`engine.parallel.sequence_parallel_attention`), with diffusion
                                   forcing's block-causal mask applied from global positions
    norm_out (output)              per-token modulation only: place my tokens in a buffer as long as my
                                   frames, so diffusers' per-token shift/scale apply where they belong
    proj_out (input, output)       take my tokens back (per-token modulation); all-gather the output
                                   tokens (trimming the padding): every rank gets (B, S, p*C_out)

Everything else (cross-attention against the replicated text, the FFN, norms, time and
text embeddings, unpatchify) is per token or replicated and runs as diffusers wrote it. The
hooks do nothing outside `WanSequenceParallel.__call__`, so the model stays a plain diffusers
model otherwise. Padded tokens are never attended to (trimmed before local attention,
masked in the ring) and are dropped by the final gather.

Diffusion forcing's block-causal mask: diffusers builds it as an S x S boolean when
`config.num_frame_per_block > 1` (1 GiB at 32k tokens). The engine keeps that config at 1
and passes the block size here instead; the processor applies the same mask by global
positions without materialising it (`engine.parallel.BlockCausal`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.hooks import HookRegistry, ModelHook

from engine import comm
from engine.parallel import BlockCausal, CfgGroups, SequenceParallel, sequence_parallel_attention

HOOK = "longserve_sequence_parallel"


@dataclass(frozen=True)
class Shard:
    """One forward's geometry on this rank: tokens [start, stop) of S, padded to Sl; frames [f0, f1) hold them."""

    sp: SequenceParallel
    S: int
    Sl: int
    start: int
    stop: int
    frame_tokens: int
    f0: int
    f1: int
    per_token_modulation: bool         # per-frame timesteps (SkyReels' diffusion forcing), cut by frames
    causal: BlockCausal | None
    token_timesteps: bool = False      # a timestep per token (Wan 2.2 TI2V), cut to my tokens

    @classmethod
    def of(cls, model, x: torch.Tensor, sp: SequenceParallel, per_token: bool, frames_per_block: int,
           token_timesteps: bool = False) -> "Shard":
        _, _, F, H, W = x.shape
        p_t, p_h, p_w = model.config.patch_size
        f, frame_tokens = F // p_t, (H // p_h) * (W // p_w)
        S = f * frame_tokens
        Sl = comm.shard_size(S, sp.world_size)
        start, stop = min(S, sp.pg.rank * Sl), min(S, (sp.pg.rank + 1) * Sl)
        f0 = min(start // frame_tokens, f - 1)                       # at least one frame, even with no tokens
        f1 = max(-(-stop // frame_tokens), f0 + 1)
        causal = BlockCausal(frame_tokens, frames_per_block) if frames_per_block > 1 else None
        return cls(sp, S, Sl, start, stop, frame_tokens, f0, f1, per_token, causal, token_timesteps)

    def mine(self, x: torch.Tensor, dim: int, offset: int = 0) -> torch.Tensor:
        """My tokens of a tensor whose `dim` holds tokens [offset, ...), zero-padded to Sl."""
        return comm.pad_dim(x.narrow(dim, self.start - offset, self.stop - self.start), dim, self.Sl)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on interleaved pairs (what diffusers' processors apply). x (B, Sl, H, hd)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


def project_qkv(attn, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A diffusers Wan-style self-attention's q, k, v of my tokens: its projections (fused or not) and q/k norms.
    hidden_states (B, Sl, D) -> (B, Sl, H, hd) each."""
    if getattr(attn, "fused_projections", False):
        q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
    else:
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)    # (B, Sl, H*hd)
    q, k = attn.norm_q(q), attn.norm_k(k)
    return tuple(t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))


@torch.compiler.disable
def _exchanged_attention(owner: "WanSequenceParallel", q, k, v) -> torch.Tensor:
    """`sequence_parallel_attention` over the owner's current shard. Inside a compiled block (`compile` blocks) it
    runs eager: its all-to-alls and ring passes are gloo / NCCL calls on our own process groups, which dynamo would
    break the graph on anyway. The break is here by design: the projections before it and the output projection
    after it stay in the graph, and the shard (a new object every forward) is read here, never guarded on."""
    shard = owner.shard
    return sequence_parallel_attention(q, k, v, shard.sp, shard.S, causal=shard.causal)


class SequenceParallelAttnProcessor:
    """A block's self-attention over the sharded sequence; diffusers' own processor when no forward is sharded."""

    def __init__(self, owner: "WanSequenceParallel", original):
        self.owner, self.original = owner, original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        shard = self.owner.shard
        if shard is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        if attention_mask is not None:
            raise ValueError("a sequence-parallel forward applies its mask itself; got an attention_mask")
        q, k, v = project_qkv(attn, hidden_states)                                                 # (B, Sl, H, hd)
        if rotary_emb is not None:
            q, k = _rotate(q, *rotary_emb), _rotate(k, *rotary_emb)
        out = _exchanged_attention(self.owner, q, k, v)                                          # (B, Sl, H, hd)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


class _Hook(ModelHook):
    """A hook that reads the owner's current shard and does nothing without one."""

    def __init__(self, owner, pre=None, post=None):
        super().__init__()
        self.owner, self.pre, self.post = owner, pre, post

    def pre_forward(self, module, *args, **kwargs):
        shard = self.owner.shard
        if shard is None or self.pre is None:
            return args, kwargs
        return self.pre(shard, list(args), kwargs)

    def post_forward(self, module, output):
        shard = self.owner.shard
        if shard is None or self.post is None:
            return output
        return self.post(shard, output)


def register_shard_hook(owner, module, pre=None, post=None) -> None:
    """A `_Hook` on `module` that runs `pre(shard, args, kwargs)` / `post(shard, output)` while `owner.shard` is
    set (one sharded forward) and does nothing otherwise."""
    registry = HookRegistry.check_if_exists_or_initialize(module)
    name = HOOK if HOOK not in registry.hooks else f"{HOOK}_{len(registry.hooks)}"
    registry.register_hook(_Hook(owner, pre, post), name)


class WanSequenceParallel:
    """Makes `model` (a `WanTransformer3DModel` or `SkyReelsV2Transformer3DModel`) run sequence-parallel.

        sp_model = WanSequenceParallel(model)           # once: registers the hooks
        out = sp_model(x, t, text, sp)                  # diffusers' forward, sharded over `sp`

    Every rank of `sp` calls it with the same replicated inputs and gets the same output.
    """

    def __init__(self, model):
        self.model = model
        self.skyreels = hasattr(model.config, "num_frame_per_block")
        self.shard: Shard | None = None
        self._temb_in = self._temb_out = None
        if self.skyreels and model.config.num_frame_per_block > 1:
            model._set_ar_attention(1)          # no S x S mask from diffusers: the processor applies it
        self._register(model, pre=self._my_timesteps)
        self._register(model.rope, post=self._rope)
        self._register(model.patch_embedding, pre=self._my_frames)
        self._register(model.blocks[0], pre=self._my_tokens)
        for block in model.blocks:
            self._register(block, pre=self._my_modulation)
            block.attn1.set_processor(SequenceParallelAttnProcessor(self, block.attn1.processor))
        self._register(model.norm_out, post=self._full_length)
        self._register(model.proj_out, pre=self._back_to_mine, post=self._gather)

    def _register(self, module, pre=None, post=None) -> None:
        register_shard_hook(self, module, pre, post)

    # -- the hooks ---------------------------------------------------------------------------------

    @staticmethod
    def _my_timesteps(shard: Shard, args, kwargs):
        # diffusers repeats per-frame timesteps' modulation over every token of every frame: (B, 6, S, D) on
        # every rank; given my frames' timesteps only, it builds (B, 6, (f1 - f0) h w, D). Per-token timesteps
        # (B, S) would make (B, S, 6, D) on every rank; given my tokens' (B, Sl), diffusers builds the
        # modulation of exactly the tokens the blocks and norm_out see here (padding: timestep 0, dropped)
        if shard.per_token_modulation or shard.token_timesteps:
            t = kwargs["timestep"] if "timestep" in kwargs else args[1]
            t = shard.mine(t, 1) if shard.token_timesteps else t[:, shard.f0:shard.f1]
            if "timestep" in kwargs:
                kwargs["timestep"] = t
            else:
                args[1] = t
        return tuple(args), kwargs

    @staticmethod
    def _rope(shard: Shard, freqs):
        return tuple(shard.mine(t, 1) for t in freqs)                          # (1, Sl, 1, hd) each

    def _my_frames(self, shard: Shard, args, kwargs):
        p_t = self.model.config.patch_size[0]
        args[0] = args[0][:, :, shard.f0 * p_t:shard.f1 * p_t]                 # (B, C, frames, H, W)
        return tuple(args), kwargs

    @staticmethod
    def _my_tokens(shard: Shard, args, kwargs):
        args[0] = shard.mine(args[0], 1, offset=shard.f0 * shard.frame_tokens)  # (B, Sl, D)
        return tuple(args), kwargs

    def _my_modulation(self, shard: Shard, args, kwargs):
        if not shard.per_token_modulation:
            return tuple(args), kwargs
        temb = args[2]                          # SkyReels (B, 6, my frames' tokens, D)
        if temb is not self._temb_in:           # the same tensor comes to every block: cut it once
            self._temb_in = temb
            self._temb_out = shard.mine(temb, 2 if self.skyreels else 1, offset=shard.f0 * shard.frame_tokens)
        args[2] = self._temb_out
        return tuple(args), kwargs

    @staticmethod
    def _full_length(shard: Shard, out: torch.Tensor) -> torch.Tensor:
        if not shard.per_token_modulation:
            return out                          # (B, Sl, D); shift/scale (B, 1, D) broadcast
        offset = shard.f0 * shard.frame_tokens
        full = out.new_zeros((out.shape[0], (shard.f1 - shard.f0) * shard.frame_tokens, out.shape[2]))
        full[:, shard.start - offset:shard.stop - offset] = out[:, :shard.stop - shard.start]
        return full                             # (B, my frames' tokens, D)

    @staticmethod
    def _back_to_mine(shard: Shard, args, kwargs):
        if shard.per_token_modulation:
            args[0] = shard.mine(args[0], 1, offset=shard.f0 * shard.frame_tokens)  # (B, Sl, D)
        return tuple(args), kwargs

    @staticmethod
    def _gather(shard: Shard, out: torch.Tensor) -> torch.Tensor:
        return comm.gather(out, 1, shard.S, shard.sp.pg)                       # (B, S, p*C_out)

    # -- a forward --------------------------------------------------------------------------------------

    def _tokens(self, x: torch.Tensor) -> int:
        """S, the tokens of a latent x (B, C, F, H, W) after the patch embedding."""
        p_t, p_h, p_w = self.model.config.patch_size
        return (x.shape[2] // p_t) * (x.shape[3] // p_h) * (x.shape[4] // p_w)

    def __call__(self, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, sp: SequenceParallel,
                 cfg: CfgGroups | None = None, fps: int | None = None, frames_per_block: int = 1,
                 image: torch.Tensor | None = None) -> torch.Tensor:
        """diffusers' forward over the group. x (B, C, F, H, W); timestep (B,), or (B, F) per latent frame
        (diffusion forcing, SkyReels-V2), or (B, S) per token (Wan 2.2 TI2V's expand_timesteps: what
        `WanTransformer3DModel` reads a 2-D timestep as); text (B, L, C_text) -> (B, C_out, F, H, W) on every
        rank.

        `image`: image-to-video's CLIP tokens (`encoder_hidden_states_image`), (k B, T, C_img) with k images per
        row (FLF2V: 2, first and last, which diffusers' image embedder views as one row of 2T tokens). The image
        path is cross-attention (replicated keys, per-token queries) and the extra input channels (the condition
        concatenated to the latents) only widen `patch_embedding`'s input: neither needs a hook.

        `cfg`: the unconditional and conditional halves of the batch run on two halves of the workers
        (each half sharding its sequence over `sp`), then the pairs join them. `fps`: SkyReels' fps id, one
        for the whole batch (diffusers' forward adds a batch of one fps embedding to every row; with one per
        row its per-frame broadcast fits a batch of one only). `frames_per_block` > 1: diffusion forcing's
        block-causal mask.
        """
        if cfg is not None:
            half = slice(cfg.index * (x.shape[0] // 2), (cfg.index + 1) * (x.shape[0] // 2))
            image_half = None if image is None else image.chunk(2)[cfg.index]      # (k B/2, T, C_img)
            out = self(x[half], timestep[half], text[half], sp, fps=fps,
                       frames_per_block=frames_per_block, image=image_half)      # (B/2, C_out, F, H, W)
            return comm.all_gather(out, 0, cfg.pair)                              # (B, C_out, F, H, W)
        per_frame = timestep.ndim == 2 and self.skyreels
        per_token = timestep.ndim == 2 and not self.skyreels
        if per_token and timestep.shape[1] != self._tokens(x):
            raise ValueError(f"per-token timesteps must be one per token: {self._tokens(x)}; got {timestep.shape[1]}")
        kwargs = {}
        if self.skyreels:
            kwargs = {"enable_diffusion_forcing": per_frame, "fps": None if fps is None else [fps]}
        if image is not None:
            kwargs["encoder_hidden_states_image"] = image
        self.shard = Shard.of(self.model, x, sp, per_frame, frames_per_block, token_timesteps=per_token)
        try:
            return self.model(x, timestep, text, return_dict=False, **kwargs)[0]
        finally:
            self.shard = self._temb_in = self._temb_out = None

