"""Sequence parallelism for diffusers' `HeliosTransformer3DModel`, as hooks on its own modules.

Helios denoises a chunk of latent frames while reading a compressed history: diffusers' forward embeds
the history at three scales (`patch_long`, `patch_mid`, `patch_short`) and the chunk (`patch_embedding`),
and concatenates them into one token sequence of S = S_hist + S_cur tokens, history first:

    [ long history | mid history | short history | current chunk ]      (B, S, D)
      timestep 0 (zero_history_timestep)          the step's timestep

Every block attends over the whole sequence (attn1), cross-attends to the prompt with the current tokens
only (attn2, `guidance_cross_attn`: the block splits off the last `original_context_length` tokens), and
runs its FFN per token. The hooks below shard that sequence over the workers (rank r of N keeps tokens
[r*Sl, (r+1)*Sl), Sl = ceil(S/N), zero-padded at the end) and then let diffusers' blocks run unchanged:

    where (module)            what the hook does
    every block (input)       hidden states (block 0 only: later blocks get the sharded output), the
                              per-token modulation (B, S, 6, D) and the rotary table (B, S, 2hd): my
                              tokens, cut once per forward; `original_context_length` becomes the count
                              of my tokens the block must treat as current: my current tokens plus the
                              padding, which sits after them (cross-attention of padding is per query and
                              is dropped)
    every block's attn1       `HeliosSequenceParallelProcessor`: diffusers' projections, q/k norms and
                              rotary on my tokens, the history-key amplification by *global* position
                              (`is_amplify_history`), then Ulysses / Ring / USP attention
                              (`engine.parallel.sequence_parallel_attention`)
    norm_out (input)          all-gather the tokens (trimming the padding): norm_out and proj_out keep
                              only the current chunk's tokens, as diffusers wrote them

The embeddings before the blocks run replicated on every rank (three strided convolutions and the
rotary tables: cheap beside 40 blocks of attention over S tokens). The hooks do nothing outside
`HeliosSequenceParallel.__call__`, so the model stays a plain diffusers model otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers.models.transformers.transformer_helios import apply_rotary_emb_transposed

from engine import comm
from engine.models.wan import project_qkv, register_shard_hook
from engine.parallel import CfgGroups, SequenceParallel, sequence_parallel_attention


@dataclass(frozen=True)
class HeliosShard:
    """One forward's geometry on this rank: tokens [start, stop) of S, padded to Sl; S - S_cur are history."""

    sp: SequenceParallel
    S: int
    S_cur: int
    Sl: int
    start: int
    stop: int

    @classmethod
    def of(cls, S: int, S_cur: int, sp: SequenceParallel) -> "HeliosShard":
        Sl = comm.shard_size(S, sp.world_size)
        start, stop = min(S, sp.pg.rank * Sl), min(S, (sp.pg.rank + 1) * Sl)
        return cls(sp, S, S_cur, Sl, start, stop)

    @property
    def history(self) -> int:
        return self.S - self.S_cur

    @property
    def local_current(self) -> int:
        """My tokens the blocks treat as current: my current-chunk tokens and the padding after them."""
        return self.Sl - max(0, min(self.stop, self.history) - self.start)

    def mine(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """My tokens of a tensor whose `dim` holds all S, zero-padded to Sl."""
        return comm.pad_dim(x.narrow(dim, self.start, self.stop - self.start), dim, self.Sl)


class HeliosSequenceParallelProcessor:
    """A block's self-attention over the sharded sequence; diffusers' own processor when no forward is sharded."""

    def __init__(self, owner: "HeliosSequenceParallel", original):
        self.owner, self.original = owner, original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 original_context_length=None, **kwargs):
        shard = self.owner.shard
        if shard is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb,
                                 original_context_length, **kwargs)
        if attention_mask is not None or encoder_hidden_states is not None:
            raise ValueError("the sequence-parallel processor is for Helios' self-attention (attn1) only")
        q, k, v = project_qkv(attn, hidden_states)                                                 # (B, Sl, H, hd)
        if rotary_emb is not None:
            q, k = apply_rotary_emb_transposed(q, rotary_emb), apply_rotary_emb_transposed(k, rotary_emb)
        mine_history = max(0, min(shard.stop, shard.history) - shard.start)      # my tokens [0, n) are history
        if attn.is_amplify_history and shard.history > 0 and mine_history > 0:
            scale = 1.0 + torch.sigmoid(attn.history_key_scale) * (attn.max_scale - 1.0)
            if attn.history_scale_mode == "per_head":
                scale = scale.view(1, 1, -1, 1)
            k = torch.cat([k[:, :mine_history] * scale, k[:, mine_history:]], dim=1)
        out = sequence_parallel_attention(q, k, v, shard.sp, shard.S)                             # (B, Sl, H, hd)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


class HeliosSequenceParallel:
    """Makes `model` (a `HeliosTransformer3DModel`) run sequence-parallel.

        sp_model = HeliosSequenceParallel(model)        # once: registers the hooks
        out = sp_model(x, t, text, history, sp)         # diffusers' forward, sharded over `sp`

    Every rank of `sp` calls it with the same replicated inputs and gets the same output.
    """

    def __init__(self, model):
        self.model = model
        self.shard: HeliosShard | None = None
        self._cut_in = self._cut_out = None
        register_shard_hook(self, model.blocks[0], pre=self._my_hidden)
        for block in model.blocks:
            register_shard_hook(self, block, pre=self._my_tables)
            block.attn1.set_processor(HeliosSequenceParallelProcessor(self, block.attn1.processor))
        register_shard_hook(self, model.norm_out, pre=self._gather)

    # -- the hooks ---------------------------------------------------------------------------------

    @staticmethod
    def _my_hidden(shard: HeliosShard, args, kwargs):
        args = list(args)
        args[0] = shard.mine(args[0], 1)                    # (B, Sl, D): later blocks get the sharded output
        return tuple(args), kwargs

    def _my_tables(self, shard: HeliosShard, args, kwargs):
        # block(hidden_states, encoder_hidden_states, temb (B, S, 6, D), rotary_emb (B|1, S, 2hd), ocl)
        hidden, text, temb, rope, _ = args
        if self._cut_in is not temb:                        # the same tables come to every block: cut them once
            self._cut_in = temb
            self._cut_out = (shard.mine(temb, 1), shard.mine(rope, 1))          # (B, Sl, 6, D), (B|1, Sl, 2hd)
        return (hidden, text, *self._cut_out, shard.local_current), kwargs

    @staticmethod
    def _gather(shard: HeliosShard, args, kwargs):
        args = list(args)
        args[0] = comm.gather(args[0], 1, shard.S, shard.sp.pg)                  # (B, S, D)
        return tuple(args), kwargs

    # -- a forward --------------------------------------------------------------------------------------

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
                 sp: SequenceParallel, cfg: CfgGroups | None = None) -> torch.Tensor:
        """diffusers' forward over the group. x (B, C, F, H, W) the chunk; timestep (B,); text (B, L, C_text);
        `history`: the forward's history arguments (`latents_history_short` (B, C, 1+n, H, W), `..._mid`,
        `..._long` and their `indices_*`, `indices_hidden_states`) -> (B, C_out, F, H, W) on every rank.

        `cfg`: the unconditional and conditional halves of the batch run on two halves of the workers (each
        half sharding its sequence over `sp`), then the pairs join them."""
        if cfg is not None:
            rows = x.shape[0] // 2
            half = slice(cfg.index * rows, (cfg.index + 1) * rows)
            mine = {k: (v[half] if torch.is_tensor(v) and v.shape[0] == x.shape[0] else v) for k, v in history.items()}
            out = self(x[half], timestep[half], text[half], mine, sp)                 # (B/2, C_out, F, H, W)
            return comm.all_gather(out, 0, cfg.pair)                                  # (B, C_out, F, H, W)
        S, S_cur = self.tokens(x, history)
        self.shard = HeliosShard.of(S, S_cur, sp) if sp.world_size > 1 else None
        try:
            return self.model(x, timestep, text, return_dict=False, **history)[0]
        finally:
            self.shard = self._cut_in = self._cut_out = None
