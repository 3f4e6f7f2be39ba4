"""Sequence parallelism for diffusers' `LTX2VideoTransformer3DModel` (video with sound): a shard plan
(`engine/sharding.py`).

LTX-2 runs two token streams through every block: the video's S tokens (thousands: F x H x W latents) and the
audio's A tokens (25 a second: 126 for a 5 s clip), each with self-attention, cross-attention to the prompt, an
FFN, and two cross-modal attentions between them (audio -> video: video queries, audio keys; video -> audio:
audio queries, video keys). The plan splits the **video** tokens and **replicates** the audio ones: every rank
holds all A audio tokens and runs the audio stream whole (docs/design.md, "LTX-2: audio replicated"). Rank r of
N keeps video tokens [r*Sl, (r+1)*Sl), Sl = ceil(S/N), zero-padded; then diffusers' `forward` runs unchanged:

    where (module)                     rule                                            from
    the model (input)                  hidden_states (B, S, C): my video tokens        diffusers' _cp_plan
                                       timestep (B, S) per token (image-to-video's
                                       conditioned first frame): my tokens'
    rope (output)                      cos/sin rows of my tokens' *global* positions  diffusers' _cp_plan
    every block's attn1                video self-attention: Ulysses / Ring / USP       longserve
    every block's audio_to_video_attn  video queries (mine) against all audio keys:     longserve
                                       the processor cuts the cross-modal rope to mine
    every block's video_to_audio_attn  audio queries against all video keys: each rank   longserve
                                       attends to its own video keys, one all-gather of
                                       the (A-sized) partial outputs and a log-sum-exp
                                       merge join them
    proj_out (output)                  all-gather of the video tokens, trimmed          diffusers' _cp_plan

diffusers' own `_cp_plan` also splits the prompt's tokens (its ring attention joins them again); here the prompt
is replicated, as the Wan plan keeps it, so cross-attention to it is local. The audio stream, its self-attention,
its prompt cross-attention and its FFN are replicated (identical inputs on every rank give identical outputs);
the one exchange the audio adds is the video -> audio attention's merge, an all-gather of (B, H, A, hd + 1) per
rank and block: the size of the audio, not of the video.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longserve.engine.parallel import SequenceParallel
from longserve.engine.sharding import (
    At,
    Gather,
    ShardPlan,
    Split,
    TokenShard,
    exchanged_attention,
    shard_model,
)


@dataclass(frozen=True)
class LTX2Shard(TokenShard):
    """One forward's geometry: S video tokens; "rope" is a rotary table whose token dim is 1 (interleaved rope,
    (B, S, D)) or 2 (split rope, (B, H, S, D/H))."""

    UNITS = ("tokens", "rope")

    def split(self, x: torch.Tensor, dim: int, unit: str) -> torch.Tensor:
        if unit == "rope":
            return self.mine(x, 2 if x.ndim == 4 else 1)
        return super().split(x, dim, unit)

    def rope_mine(self, rotary):
        """My tokens' rows of a full-length rotary table pair (None passes)."""
        if rotary is None:
            return None
        return tuple(self.split(t, 1, "rope") for t in rotary)


def _rotate(attn, x: torch.Tensor, rotary) -> torch.Tensor:
    from diffusers.models.transformers.transformer_ltx2 import (
        apply_interleaved_rotary_emb,
        apply_split_rotary_emb,
    )

    if attn.rope_type == "interleaved":
        return apply_interleaved_rotary_emb(x, rotary)
    return apply_split_rotary_emb(x, rotary)


class _Processor:
    def __init__(self, owner, layer: int | None, original):
        self.owner, self.layer, self.original = owner, layer, original


class LTX2VideoSelfAttention(_Processor):
    """A block's video self-attention (`attn1`) over the sharded video tokens: diffusers' `LTX2AudioVideoAttnProcessor`
    with the attention itself exchanged across the group (its q/k norms span all heads, so they run before the
    exchange, on my tokens); STG's perturbation (the value path for perturbed rows) as diffusers applies it."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None, perturbation_mask=None, all_perturbed=None):
        shard = self.owner.shard
        if shard is None:
            # a checkpoint without `perturbed_attn` has diffusers' plain processor, which takes no perturbation
            stg = () if perturbation_mask is None and all_perturbed is None else (perturbation_mask, all_perturbed)
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                                 key_rotary_emb, *stg)
        if attention_mask is not None or encoder_hidden_states is not None:
            raise ValueError("the sequence-parallel LTX-2 video self-attention takes no mask")
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        value = attn.to_v(hidden_states)                                                  # (B, Sl, H*hd)
        if all_perturbed is None:
            all_perturbed = bool(torch.all(perturbation_mask == 0)) if perturbation_mask is not None else False
        if all_perturbed:
            out = value
        else:
            q, k = attn.norm_q(attn.to_q(hidden_states)), attn.norm_k(attn.to_k(hidden_states))
            if query_rotary_emb is not None:
                q = _rotate(attn, q, query_rotary_emb)
                k = _rotate(attn, k, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb)
            q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, value))            # (B, Sl, H, hd)
            out = exchanged_attention(self.owner, q, k, v).flatten(2, 3).to(q.dtype)       # (B, Sl, H*hd)
            if perturbation_mask is not None:
                out = torch.lerp(value, out, perturbation_mask)
        if gate_logits is not None:
            gates = 2.0 * torch.sigmoid(gate_logits)                                       # (B, Sl, H)
            out = (out.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


class LTX2AudioToVideoAttention(_Processor):
    """Video queries (my tokens) attend to every audio token (replicated): local, once the cross-modal rope of the
    video queries (built for all S tokens) is cut to my tokens."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None, *args, **kwargs):
        shard = self.owner.shard
        if shard is not None:
            if attention_mask is not None:
                raise ValueError("the sequence-parallel LTX-2 audio-to-video attention takes no mask")
            query_rotary_emb = shard.rope_mine(query_rotary_emb)
        return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                             key_rotary_emb, *args, **kwargs)


class LTX2VideoToAudioAttention(_Processor):
    """Audio queries (all of them, on every rank) attend to every video token. Each rank attends to its own video
    tokens (their keys rotated by their rows of the cross-modal rope) and keeps each query's log-sum-exp; one
    all-gather of the partial outputs, (B, H, A, hd + 1) per rank, and a log-sum-exp merge give every rank the
    attention over all S keys. The exchange is the size of the audio (A tokens), not of the video (S): gathering the
    video keys instead would move (N - 1)/N x S x D per rank and block."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None, *args, **kwargs):
        shard = self.owner.shard
        if shard is None or (shard.sp.attention_backend is not None and shard.sp.world_size == 1):
            # alone, every video key is mine: diffusers' own processor, through the engine's dispatcher backend
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                                 key_rotary_emb, *args, **kwargs)
        if shard.sp.attention_backend not in (None, "native"):        # refused at start (engine/attention.py)
            raise ValueError(f"attention_backend={shard.sp.attention_backend!r} cannot run in the video-to-audio "
                             f"attention's merge across workers")
        if attention_mask is not None:
            raise ValueError("the sequence-parallel LTX-2 video-to-audio attention takes no mask")
        from longserve.engine import comm

        n = shard.real_tokens                                        # my video tokens (no padding)
        video = encoder_hidden_states[:, :n]
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        q, k, v = attn.norm_q(attn.to_q(hidden_states)), attn.norm_k(attn.to_k(video)), attn.to_v(video)
        if query_rotary_emb is not None:
            q = _rotate(attn, q, query_rotary_emb)
            keys_rope = key_rotary_emb if key_rotary_emb is not None else query_rotary_emb
            k = _rotate(attn, k, tuple(t[:, :, :n] if t.ndim == 4 else t[:, :n] for t in shard.rope_mine(keys_rope)))
        q, k, v = (t.unflatten(2, (attn.heads, -1)).transpose(1, 2).float() for t in (q, k, v))   # (B, H, L, hd)
        B, H, A, hd = q.shape
        if n:
            scores = (q @ k.transpose(-1, -2)) / hd ** 0.5                                         # (B, H, A, n)
            lse = torch.logsumexp(scores, dim=-1, keepdim=True)                                    # (B, H, A, 1)
            part = torch.softmax(scores, dim=-1) @ v                                               # (B, H, A, hd)
        else:
            lse = torch.full((B, H, A, 1), float("-inf"), device=q.device)
            part = q.new_zeros(B, H, A, hd)
        both = comm.all_gather(torch.cat([part, lse], dim=-1)[None], 0, shard.sp.pg)            # (N, B, H, A, hd+1)
        parts, lses = both[..., :hd], both[..., hd:]
        weights = torch.exp(lses - lses.max(dim=0, keepdim=True).values)                         # 0 for no tokens
        out = (weights * parts).sum(0) / weights.sum(0)                                          # (B, H, A, hd)
        out = out.transpose(1, 2).flatten(2, 3).to(hidden_states.dtype)                          # (B, A, H*hd)
        if gate_logits is not None:
            gates = 2.0 * torch.sigmoid(gate_logits)
            out = (out.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


#: video tokens split, audio replicated (see the module docstring)
LTX2_PLAN = ShardPlan(LTX2Shard, {
    "": At(inputs={"hidden_states": Split(1, "tokens", expected_dims=3),
                   "timestep": Split(1, "tokens", expected_dims=2)}),
    "rope": At(outputs={0: Split(1, "rope"), 1: Split(1, "rope")}),
    "proj_out": At(outputs={0: Gather(1, expected_dims=3)}),
}, attention={
    "transformer_blocks.*.attn1": LTX2VideoSelfAttention,
    "transformer_blocks.*.audio_to_video_attn": LTX2AudioToVideoAttention,
    "transformer_blocks.*.video_to_audio_attn": LTX2VideoToAudioAttention,
})


class LTX2SequenceParallel:
    """Makes `model` (an `LTX2VideoTransformer3DModel`) run sequence-parallel.

        sp_model = LTX2SequenceParallel(model)                   # once: the plan's hooks and processors
        video, audio = sp_model(hidden_states, sp=sp, audio_hidden_states=..., ...)   # diffusers' forward kwargs

    Every rank of `sp` calls it with the same replicated inputs and gets the same outputs: video (B, S, C_out) and
    audio (B, A, C_audio_out). (CFG-parallel is the worker's, around it: `VideoFamily.denoise`.)"""

    def __init__(self, model):
        self.model = model
        self.sharded = shard_model(model, LTX2_PLAN)

    def __call__(self, hidden_states: torch.Tensor, sp: SequenceParallel, **kwargs):
        S = hidden_states.shape[1]
        Sl, start, stop = LTX2Shard.token_range(S, sp)
        shard = LTX2Shard(sp, S, Sl, start, stop)
        return tuple(self.sharded(shard, hidden_states=hidden_states, return_dict=False, **kwargs))
