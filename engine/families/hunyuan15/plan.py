"""Sequence parallelism for diffusers' HunyuanVideo-1.5 transformer: longserve's shard plan (diffusers declares no
`_cp_plan` for `HunyuanVideo15Transformer3DModel`).

The model is a dual-stream (MMDiT) DiT: every block keeps two streams, the video tokens (S = F x H x W after a
1x1x1 patch embedding) and the condition tokens (L = image + ByT5 + Qwen tokens, built by its refiner and
projections, with a validity mask), and its attention runs over both joined. Rank r of N keeps video tokens
[r*Sl, (r+1)*Sl), Sl = ceil(S/N), zero-padded; the condition stream is short (L ~ 2k at the published sizes,
against S ~ 30k-100k) and stays replicated: every rank computes it whole, and every rank's copy stays equal
because the attention gives each rank the whole condition output. Then diffusers' `forward` runs, unchanged:

    where (module)                rule
    rope (output)                 cos/sin rows of my tokens' *global* positions: (S, hd) -> (Sl, hd)
    x_embedder (output)           my tokens: (B, S, D) -> (B, Sl, D)
    transformer_blocks.*.attn     joint attention (`HunyuanJointAttention`): Ulysses over the video stream, the
                                  condition stream's heads cut locally, its output gathered over heads
    proj_out (output)             all-gather of the output tokens, trimmed: (B, S, C_out) on every rank

Everything else (the refiner, the condition projections, the time embedding, the per-token modulation, the
FFNs and norm_out) is per token or replicated and runs as diffusers wrote it.

The joint attention, per rank of a Ulysses group of N (shapes per rank; Ring below):

    video q, k, v (B, Sl, H, hd) --all-to-all--> (B, S, Hl, hd)        Hl = ceil(H/N), heads zero-padded
    condition q, k, v (B, L, H, hd) --my heads--> (B, L, Hl, hd)        no communication (replicated)
    SDPA over the S + L keys, condition keys masked as diffusers masks them -> (B, S + L, Hl, hd)
    video part --all-to-all--> (B, Sl, H, hd);  condition part --all-gather over heads--> (B, L, H, hd)

A condition query whose token is padding sees no key: diffusers' mask (query valid and key valid) gives it
zeros from PyTorch's SDPA; here the key mask alone is applied and those rows are zeroed, the same values
without an (S + L)^2 mask. Ulysses covers any head count (heads fewer than N are padded), so every worker count
runs.

Ring (and the ring of USP): the video keys go round the ring as for Wan; the replicated condition keys are one
more block every rank folds into its running softmax first (`engine.parallel.ring_attention`'s `extra`, with the
key mask). The condition queries need every video key too: the L condition rows are split over the ring, ride
along with my video queries (rows = ceil(L/R) more queries per ring step), and one all-gather of (B, L, Hl, hd)
joins them, so each condition row is computed once and every rank's copy of the condition stream stays equal
bit for bit. Per rank and block the ring adds that gather to Wan's ring traffic: L x Hl x hd values, the size of
the condition stream, not of the video.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from longserve.engine import comm
from longserve.engine.attention import attend
from longserve.engine.parallel import SequenceParallel
from longserve.engine.sharding import At, Gather, ShardedModel, ShardPlan, Split, TokenShard, shard_model


@dataclass(frozen=True)
class HunyuanShard(TokenShard):
    """One forward's geometry: my video tokens of S (the condition stream is not sharded)."""

    @classmethod
    def of(cls, model, x: torch.Tensor, sp: SequenceParallel) -> "HunyuanShard":
        _, _, frames, height, width = x.shape
        p, p_t = model.config.patch_size, model.config.patch_size_t
        S = (frames // p_t) * (height // p) * (width // p)
        return cls(sp, S, *cls.token_range(S, sp))


@torch.compiler.disable
def joint_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cq: torch.Tensor, ck: torch.Tensor,
                    cv: torch.Tensor, cond_mask: torch.Tensor, sp: SequenceParallel, seq_len: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of [video; condition] tokens over both, the video sharded over `sp` (Ulysses, Ring or USP).

    q, k, v: (B, Sl, H, hd), my padded shard of `seq_len` video tokens; cq, ck, cv: (B, L, H, hd), the condition
    tokens (the same on every rank); cond_mask: (B, L) bool, True where a condition token is real.
    -> (B, Sl, H, hd) my video tokens' output, (B, L, H, hd) the condition tokens' output (on every rank).
    """
    u, r = sp.ulysses, sp.ring
    B, Sl, H, hd = q.shape
    # Ulysses: my group's tokens (all of them, trimmed, without a ring), my heads
    qkv = comm.all_to_all_switch(torch.stack([q, k, v]), scatter_dim=3, gather_dim=2,
                                 gather_size=seq_len if r.world_size == 1 else u.world_size * Sl,
                                 pg=u) if u.world_size > 1 else torch.stack([q, k, v])  # (3, B, chunk, Hl, hd)
    Hl = qkv.shape[3]
    cond = comm.pad_dim(torch.stack([cq, ck, cv]), 3, Hl * u.world_size).narrow(3, u.rank * Hl, Hl)  # (3, B, L, Hl, hd)
    if r.world_size == 1:
        q, k, v = (torch.cat([a, c], dim=1).transpose(1, 2) for a, c in zip(qkv, cond))   # (B, Hl, S + L, hd)
        keys = F.pad(cond_mask, (seq_len, 0), value=True)[:, None, None, :]                 # (B, 1, 1, S + L)
        out = attend(q, k, v, backend=sp.attention_backend, attn_mask=keys).transpose(1, 2)  # (B, S + L, Hl, hd)
        video, cond_out = out[:, :seq_len], out[:, seq_len:].contiguous()
    else:
        video, cond_out = _ring_joint(qkv, cond, cond_mask, r, seq_len)
    if u.world_size > 1:
        video = comm.all_to_all_switch(video, scatter_dim=1, gather_dim=2, gather_size=H, pg=u)  # (B, Sl, H, hd)
        cond_out = comm.all_gather(cond_out, 2, u, size=H)                                   # (B, L, H, hd)
    return video, cond_out * cond_mask[:, :, None, None]


def _ring_joint(qkv: torch.Tensor, cond: torch.Tensor, cond_mask: torch.Tensor, r, seq_len: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's part: my chunk of video queries, and my rows of the condition queries (L split over the ring so
    that each row is computed once and every rank gets the same bits), against the video keys passed round the
    ring plus the replicated condition keys (`ring_attention`'s `extra`). qkv (3, B, chunk, Hl, hd); cond
    (3, B, L, Hl, hd) -> (B, chunk, Hl, hd) video, (B, L, Hl, hd) condition output."""
    from longserve.engine.parallel import ring_attention

    chunk, L, hd = qkv.shape[2], cond.shape[2], qkv.shape[-1]
    rows = -(-L // r.world_size)
    cq = comm.pad_dim(cond[0], 1, rows * r.world_size).narrow(1, r.rank * rows, rows)      # (B, rows, Hl, hd)
    q = torch.cat([qkv[0], cq], dim=1).transpose(1, 2).float()                               # (B, Hl, chunk+rows, hd)
    kv = qkv[1:].transpose(2, 3)                                                              # (2, B, Hl, chunk, hd)
    out = ring_attention(q, kv, hd ** -0.5, r, key_len=seq_len,
                         extra=(cond[1].transpose(1, 2), cond[2].transpose(1, 2), cond_mask))
    out = out.to(qkv.dtype).transpose(1, 2)                                                  # (B, chunk+rows, Hl, hd)
    return out[:, :chunk], comm.all_gather(out[:, chunk:].contiguous(), 1, r, size=L)


class HunyuanJointAttention:
    """A dual-stream block's attention with the video stream sharded; diffusers' own processor when no sharded
    forward runs."""

    def __init__(self, owner: ShardedModel, layer: int | None, original):
        self.owner, self.layer, self.original = owner, layer, original

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        shard = self.owner.shard
        if shard is None:
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        from diffusers.models.embeddings import apply_rotary_emb

        q, k, v = (proj(hidden_states).unflatten(2, (attn.heads, -1))
                   for proj in (attn.to_q, attn.to_k, attn.to_v))                     # (B, Sl, H, hd)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
        k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        cq, ck, cv = (proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                      for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))  # (B, L, H, hd)
        if attn.norm_added_q is not None:
            cq = attn.norm_added_q(cq)
        if attn.norm_added_k is not None:
            ck = attn.norm_added_k(ck)
        video, cond = joint_attention(q, k, v, cq, ck, cv, attention_mask.bool(), shard.sp, shard.S)
        video = attn.to_out[1](attn.to_out[0](video.flatten(2, 3).to(q.dtype)))          # (B, Sl, D)
        return video, attn.to_add_out(cond.flatten(2, 3).to(q.dtype))                    # (B, L, D)


HUNYUAN15_PLAN = ShardPlan(HunyuanShard, {
    "rope": At(outputs={0: Split(0), 1: Split(0)}),                # (S, hd) -> (Sl, hd), global positions
    "x_embedder": At(outputs={0: Split(1)}),                       # (B, S, D) -> (B, Sl, D)
    "proj_out": At(outputs={0: Gather(1)}),                        # (B, Sl, C) -> (B, S, C)
}, attention={"transformer_blocks.*.attn": HunyuanJointAttention})


class Hunyuan15SequenceParallel:
    """Makes a `HunyuanVideo15Transformer3DModel` run sequence-parallel.

        sp_model = Hunyuan15SequenceParallel(model)     # once: the plan's hooks
        out = sp_model(x, t, cond, sp)                  # diffusers' forward, sharded over `sp`

    Every rank of `sp` calls it with the same replicated inputs and gets the same output.
    """

    def __init__(self, model):
        self.model = model
        self.sharded = shard_model(model, HUNYUAN15_PLAN)

    def __call__(self, x: torch.Tensor, timestep: torch.Tensor, cond: dict, sp: SequenceParallel) -> torch.Tensor:
        """x (B, C_in, F, H, W) (latents, condition latents and mask joined on channels); timestep (B,); cond:
        the forward's condition tensors by diffusers' argument names (`encoder_hidden_states` (B, L1, C1),
        `encoder_attention_mask` (B, L1), `encoder_hidden_states_2` (B, L2, C2), `encoder_attention_mask_2`
        (B, L2), `image_embeds` (B, L3, C3)) -> (B, C_out, F, H, W) on every rank. (CFG-parallel is the worker's,
        around it: `VideoFamily.denoise`.)"""
        shard = HunyuanShard.of(self.model, x, sp)
        return self.sharded(shard, hidden_states=x, timestep=timestep, return_dict=False, **cond)[0]
