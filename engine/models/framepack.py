"""Sequence parallelism for diffusers' FramePack transformer (`HunyuanVideoFramepackTransformer3DModel`): its own
shard plan (diffusers declares no `_cp_plan` for it).

A forward sees one section: the packed sequence FramePack builds in `_pack_history_states`, in this order,

    [4x-compressed history; 2x-compressed history; clean frames (the image, the 1x history); the section's latents]

(S tokens in all, each part patch-embedded at its own compression), beside the condition stream (SigLIP's image
tokens and the refined Llama prompt tokens, L of them). Every part of the packed sequence is a token like any other
to the blocks: they attend over all of it and the condition (HunyuanVideo's dual-stream then single-stream blocks),
and only the section's latents are read out. So the packed sequence is sharded whole: rank r of N keeps tokens
[r*Sl, (r+1)*Sl), Sl = ceil(S/N), zero-padded; the history is sharded with the latents, not replicated, so a rank's
share of the work and memory is S/N whatever the mix. Then diffusers' `forward` runs, unchanged between:

    where (module)                          rule
    transformer_blocks.0 (input)            the packed tokens: (B, S, D) -> my (B, Sl, D)
    *.attn (dual- and single-stream)        `FramepackJointAttention`: my rows of the packed RoPE table (built for
                                            all S, so positions are global), then HunyuanVideo-1.5's joint
                                            attention (engine/families/hunyuan15/plan.py: Ulysses, Ring or USP over the
                                            packed tokens, the condition stream replicated, its keys masked)
    the last block (output)                 all-gather of the packed tokens, trimmed: (B, S, D) on every rank;
                                            diffusers then keeps the section's latents and projects them out

The condition stream stays replicated and equal on every rank (the joint attention hands every rank its whole
output). A padded condition row (a batch of prompts of different lengths) is zeroed here where diffusers leaves the
values its key mask gives; no later token attends to it (it is masked as a key), so the video is the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from longserve.engine.parallel import SequenceParallel
from longserve.engine.sharding import At, Gather, ShardedModel, ShardPlan, Split, TokenShard, shard_model


def packed_length(model, x: torch.Tensor, clean: torch.Tensor, history_2x: torch.Tensor,
                  history_4x: torch.Tensor) -> int:
    """S: the tokens of the packed sequence, as the model's embedders make them (the compressed histories padded
    up to their kernels, as `_pad_for_3d_conv` pads them). x, clean, history_*: (B, C, frames, h, w) latents."""
    p, p_t = model.config.patch_size, model.config.patch_size_t
    _, _, f, h, w = x.shape
    total = (f // p_t) * (h // p) * (w // p) + clean.shape[2] * (h // 2) * (w // 2)
    for part, (kt, kh, kw) in ((history_2x, (2, 4, 4)), (history_4x, (4, 8, 8))):
        total += math.ceil(part.shape[2] / kt) * math.ceil(h / kh) * math.ceil(w / kw)
    return total


@dataclass(frozen=True)
class FramepackShard(TokenShard):
    """One forward's geometry: my tokens of the packed S (the condition stream is not sharded)."""

    @classmethod
    def of(cls, S: int, sp: SequenceParallel) -> "FramepackShard":
        return cls(sp, S, *cls.token_range(S, sp))


class FramepackJointAttention:
    """A dual- or single-stream block's attention over the sharded packed tokens; diffusers' own processor when no
    sharded forward runs."""

    def __init__(self, owner: ShardedModel, layer: int | None, original):
        self.owner, self.layer, self.original = owner, layer, original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        shard = self.owner.shard
        if shard is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        from diffusers.models.embeddings import apply_rotary_emb

        from longserve.engine.families.hunyuan15.plan import joint_attention

        dual = attn.add_q_proj is not None      # a single-stream block projects both streams with to_q/k/v
        q, k, v = (proj(hidden_states).unflatten(2, (attn.heads, -1))
                   for proj in (attn.to_q, attn.to_k, attn.to_v))                       # (B, Sl, H, hd)
        q, k = attn.norm_q(q), attn.norm_k(k)
        rope = tuple(shard.mine(t, 0) for t in image_rotary_emb)                        # (Sl, hd): my rows
        q, k = apply_rotary_emb(q, rope, sequence_dim=1), apply_rotary_emb(k, rope, sequence_dim=1)
        projections = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj) if dual else (attn.to_q, attn.to_k,
                                                                                         attn.to_v)
        cq, ck, cv = (proj(encoder_hidden_states).unflatten(2, (attn.heads, -1)) for proj in projections)  # (B, L, ..)
        norm_q, norm_k = (attn.norm_added_q, attn.norm_added_k) if dual else (attn.norm_q, attn.norm_k)
        cq, ck = (cq if norm_q is None else norm_q(cq)), (ck if norm_k is None else norm_k(ck))
        L = encoder_hidden_states.shape[1]
        mask = (torch.ones(cq.shape[:2], dtype=torch.bool, device=cq.device) if attention_mask is None
                else attention_mask.reshape(attention_mask.shape[0], -1)[:, -L:].bool())           # (B, L)
        video, cond = joint_attention(q, k, v, cq, ck, cv, mask, shard.sp, shard.S)
        video, cond = video.flatten(2, 3).to(q.dtype), cond.flatten(2, 3).to(q.dtype)  # (B, Sl, D), (B, L, D)
        if getattr(attn, "to_out", None) is not None:
            video = attn.to_out[1](attn.to_out[0](video))
        if getattr(attn, "to_add_out", None) is not None:
            cond = attn.to_add_out(cond)
        return video, cond


def framepack_plan(model) -> ShardPlan:
    """The plan for `model`: the gather sits on its last block (a single-stream one, if it has any)."""
    last = (f"single_transformer_blocks.{len(model.single_transformer_blocks) - 1}"
            if len(model.single_transformer_blocks) else f"transformer_blocks.{len(model.transformer_blocks) - 1}")
    return ShardPlan(FramepackShard, {
        "transformer_blocks.0": At(inputs={"hidden_states": Split(1)}),             # (B, S, D) -> (B, Sl, D)
        last: At(outputs={0: Gather(1)}),                                           # (B, Sl, D) -> (B, S, D)
    }, attention={"transformer_blocks.*.attn": FramepackJointAttention,
                  "single_transformer_blocks.*.attn": FramepackJointAttention})


class FramepackSequenceParallel:
    """Makes a `HunyuanVideoFramepackTransformer3DModel` run sequence-parallel.

        sp_model = FramepackSequenceParallel(model)     # once: the plan's hooks
        out = sp_model(inputs, sp)                      # diffusers' forward, sharded over `sp`

    Every rank of `sp` calls it with the same replicated inputs and gets the same output.
    """

    def __init__(self, model):
        self.model = model
        self.sharded = shard_model(model, framepack_plan(model))

    def __call__(self, inputs: dict, sp: SequenceParallel) -> torch.Tensor:
        """inputs: the forward's arguments by diffusers' names (`hidden_states` (B, C, F, h, w), `latents_clean`,
        `latents_history_2x`, `latents_history_4x` and their `indices_*`, `timestep`, `guidance`, the prompt's and
        the image's tensors) -> (B, C_out, F, h, w) on every rank."""
        S = packed_length(self.model, inputs["hidden_states"], inputs["latents_clean"], inputs["latents_history_2x"],
                          inputs["latents_history_4x"])
        return self.sharded(FramepackShard.of(S, sp), return_dict=False, **inputs)[0]
