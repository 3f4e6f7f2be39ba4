"""Sequence parallelism for diffusers' `HeliosTransformer3DModel`: a shard plan (`engine/sharding.py`).

Helios denoises a chunk of latent frames while reading a compressed history: diffusers' forward embeds
the history at three scales (`patch_long`, `patch_mid`, `patch_short`) and the chunk (`patch_embedding`),
and concatenates them into one token sequence of S = S_hist + S_cur tokens, history first:

    [ long history | mid history | short history | current chunk ]      (B, S, D)
      timestep 0 (zero_history_timestep)          the step's timestep

Every block attends over the whole sequence (attn1), cross-attends to the prompt with the current tokens
only (attn2, `guidance_cross_attn`: the block splits off the last `original_context_length` tokens), and
runs its FFN per token. The plan shards that sequence after the embeddings (rank r keeps tokens
[r*Sl, (r+1)*Sl), Sl = ceil(S/N), zero-padded at the end) and lets diffusers' blocks run unchanged:

    where (module)            rule
    blocks.0 (input)          hidden states: my tokens (later blocks get the sharded output)
    every block (input)       the per-token modulation (B, S, 6, D) and the rotary table (B, S, 2hd): my
                              tokens, cut once per forward; `original_context_length` becomes the count of
                              my tokens the block must treat as current (`local_current`: my current tokens
                              plus the padding, which sits after them; cross-attention of padding is per
                              query and is dropped)
    every block's attn1       `HeliosAttention`: the history-key amplification by *global* position
                              (`is_amplify_history`), then Ulysses / Ring / USP attention
    norm_out (input)          all-gather the tokens (trimming the padding): norm_out and proj_out keep
                              only the current chunk's tokens, as diffusers wrote them

The embeddings before the blocks run replicated on every rank (three strided convolutions and the
rotary tables: cheap beside 40 blocks of attention over S tokens). diffusers' own `_cp_plan` for this
model is not used: it splits and gathers around every attn1, attn2 and FFN (three all-gathers a block),
and its amplification would read the history length from the local token count (docs/design.md,
"Shard plans as data").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers.models.transformers.transformer_helios import apply_rotary_emb_transposed

from longserve.engine.parallel import SequenceParallel
from longserve.engine.sharding import At, Gather, Replace, ShardedAttention, ShardPlan, Split, TokenShard, shard_model


@dataclass(frozen=True)
class HeliosShard(TokenShard):
    """One forward's geometry: tokens [start, stop) of S, padded to Sl; the first S - S_cur are history."""

    S_cur: int

    @classmethod
    def of(cls, S: int, S_cur: int, sp: SequenceParallel) -> "HeliosShard":
        return cls(sp, S, *cls.token_range(S, sp), S_cur)

    @property
    def history(self) -> int:
        return self.S - self.S_cur

    @property
    def my_history(self) -> int:
        """My tokens [0, n) that are history."""
        return max(0, min(self.stop, self.history) - self.start)

    @property
    def local_current(self) -> int:
        """My tokens the blocks treat as current: my current-chunk tokens and the padding after them."""
        return self.Sl - self.my_history


class HeliosAttention(ShardedAttention):
    """A Helios block's self-attention over the sharded sequence, history keys amplified by global position."""

    def rotate(self, x, rotary_emb):
        return apply_rotary_emb_transposed(x, rotary_emb)

    def keys(self, attn, shard: HeliosShard, k: torch.Tensor) -> torch.Tensor:
        if not (attn.is_amplify_history and shard.my_history > 0):
            return k
        scale = 1.0 + torch.sigmoid(attn.history_key_scale) * (attn.max_scale - 1.0)
        if attn.history_scale_mode == "per_head":
            scale = scale.view(1, 1, -1, 1)
        return torch.cat([k[:, :shard.my_history] * scale, k[:, shard.my_history:]], dim=1)   # (B, Sl, H, hd)


HELIOS_PLAN = ShardPlan(HeliosShard, {
    "blocks.0": At(inputs={"hidden_states": Split(1)}),                                         # (B, Sl, D)
    "blocks.*": At(inputs={"temb": Split(1),                                                    # (B, Sl, 6, D)
                           "rotary_emb": Split(1),                                              # (B|1, Sl, 2hd)
                           "original_context_length": Replace("local_current")}),
    "norm_out": At(inputs={"hidden_states": Gather(1)}),                                        # (B, S, D)
}, attention={"blocks.*.attn1": HeliosAttention})


class HeliosSequenceParallel:
    """Makes `model` (a `HeliosTransformer3DModel`) run sequence-parallel.

        sp_model = HeliosSequenceParallel(model)        # once: the plan's hooks
        out = sp_model(x, t, text, history, sp)         # diffusers' forward, sharded over `sp`

    Every rank of `sp` calls it with the same replicated inputs and gets the same output.
    """

    def __init__(self, model):
        self.model = model
        self.sharded = shard_model(model, HELIOS_PLAN)

    def tokens(self, x: torch.Tensor, history: dict) -> tuple[int, int]:
        """(S, S_cur): tokens of the whole sequence and of the current chunk, as diffusers' forward lays them
        out (the mid and long histories are padded to their kernels' multiples, then embedded with 2x and 4x
        the patch)."""
        p = self.model.config.patch_size

        def count(shape, scale):            # (B, C, F, H, W) embedded with a patch `scale` times p: ceil each dim
            return math.prod(-(-n // (scale * k)) for n, k in zip(shape[2:], p))

        S_cur = count(x.shape, 1)
        S = S_cur
        for name, scale in (("latents_history_short", 1), ("latents_history_mid", 2), ("latents_history_long", 4)):
            if history.get(name) is not None:
                S += count(history[name].shape, scale)
        return S, S_cur

    def __call__(self, x: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, history: dict,
                 sp: SequenceParallel) -> torch.Tensor:
        """diffusers' forward over the group. x (B, C, F, H, W) the chunk; timestep (B,); text (B, L, C_text);
        `history`: the forward's history arguments (`latents_history_short` (B, C, 1+n, H, W), `..._mid`,
        `..._long` and their `indices_*`, `indices_hidden_states`) -> (B, C_out, F, H, W) on every rank.

        One worker runs diffusers' forward itself (CFG-parallel is the worker's, around this forward:
        `VideoFamily.denoise`)."""
        if sp.world_size == 1:
            return self.model(x, timestep, text, return_dict=False, **history)[0]
        shard = HeliosShard.of(*self.tokens(x, history), sp)
        return self.sharded(shard, x, timestep, text, return_dict=False, **history)[0]
