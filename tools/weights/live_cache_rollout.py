"""Rollouts of tiny-live in the runtime's own form, for `tools.weights.finetune_tiny_live`: the engine's KV cache
(`engine/models/causal.py`'s `CausalWan` and `KVCache`, in process, one worker) over a twin of the model being
trained (the same parameter tensors), and a forward of the trained model whose self-attention reads a row's cache,
so that the loss sees the context exactly as a live stream holds it.

Why the runtime's form and not teacher forcing's recompute form: the runtime writes a chunk's K/V once, in the
context pass after it, so every layer but the first of a cached frame carries the context of its own time (frames
the window has since evicted), where the recompute form (training stage one, `eval_tiny_live`) recomputes the
window's frames from the window alone. The two agree until the first eviction and then part: on
`make demo-live`'s seed the stage-one bounce held 88% of its height after 12 s in the recompute form and 13% in the
runtime's.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from longserve.engine.dist import ParallelGroup
from longserve.engine.models.causal import CausalConfig, CausalWan, KVCache, rotate
from longserve.engine.parallel import make_sequence_parallel


def solo():
    return make_sequence_parallel(ParallelGroup(rank=0, world_size=1, device=torch.device("cpu")), "ulysses")


def twin(model):
    """A second module tree over the same parameter tensors (its processors and hooks are its own)."""
    other = copy.deepcopy(model)
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        setattr(other.get_submodule(owner) if owner else other, leaf, p)
    return other


class CacheReadSelfAttn:
    """The trained model's self-attention for one chunk per row over that row's `KVCache` (detached: gradients flow
    through the chunk's own q/k/v only, as Self-Forcing's do): the chunk's q/k rotated at its frames' positions
    (`KVCache.prepare` set them), keys [cached frames | the chunk]."""

    def __init__(self, layer: int, caches: list):
        self.layer, self.caches = layer, caches

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1)).transpose(1, 2)   # (B, H, S, hd)
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        out = []
        for b, c in enumerate(self.caches[0]):
            cos, sin, start, _, _ = c._chunk
            keys = torch.cat([c.k[self.layer, :, :start].detach(), rotate(k[b], cos, sin)], dim=1)
            values = torch.cat([c.v[self.layer, :, :start].detach(), v[b]], dim=1)
            out.append(F.scaled_dot_product_attention(rotate(q[b], cos, sin)[None], keys[None], values[None])[0])
        out = torch.stack(out).transpose(1, 2).flatten(2).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


class CacheRollout:
    """The runtime's loop on rows of clips: `context` writes clean chunks into the rows' caches (context passes),
    `make` denoises a chunk over them (the warped steps, fresh noise between steps) as the engine does, and `flow`
    is the trained model's prediction for a noisy chunk over the caches, with gradients."""

    def __init__(self, model, cfg: CausalConfig, h: int, w: int):
        self.model, self.cfg, self.h, self.w = model, cfg, h, w
        self.twin = twin(model)
        self.cw = CausalWan(self.twin, cfg)
        self.sp = solo()
        self.rows: list[list[KVCache]] = [[]]

    def new_rows(self, batch: int, text_len: int) -> None:
        self.rows[0] = [self.cw.new_cache(self.h, self.w, self.sp, text_len) for _ in range(batch)]

    @torch.no_grad()
    def _forward(self, x, t: float, text, write: bool) -> torch.Tensor:
        B = x.shape[0]
        return self.cw(x, torch.full((B,), t), text, self.sp, self.rows[0], [0] * B, [write] * B)

    def context(self, chunk: torch.Tensor, text: torch.Tensor) -> None:
        """Clean latents (B, C, F_B, h, w) written as the next chunk of every row (a context pass)."""
        self._forward(chunk, self.cfg.context_noise, text, True)

    @torch.no_grad()
    def make(self, text: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """The next chunk of every row, as the engine makes it (then written: its context pass)."""
        B = text.shape[0]
        shape = (B, self.model.config.in_channels, self.cfg.frames_per_block, self.h, self.w)
        noises = [torch.randn(shape, generator=g) for _ in self.cfg.timesteps]
        x = noises[0]
        for i, t in enumerate(self.cfg.timesteps):
            x0 = x - self.cfg.sigma(t) * self._forward(x, t, text, False)
            if i + 1 < len(self.cfg.timesteps):
                s = self.cfg.sigma(self.cfg.timesteps[i + 1])
                x = (1 - s) * x0 + s * noises[i + 1]
        self.context(x0, text)
        return x0

    def flow(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """The trained model's flow for noisy chunks x (B, C, F_B, h, w) at timesteps t (B,) over the rows' caches
        (read, not written), differentiable in the model's parameters."""
        rotary = self.cw.rotary(self.h, self.w)
        for c in self.rows[0]:
            c.prepare(x.shape[2], rotary)
        saved = {}
        for i, block in enumerate(self.model.blocks):
            saved[i] = block.attn1.processor
            block.attn1.set_processor(CacheReadSelfAttn(i, self.rows))
        try:
            from diffusers.models.transformers.transformer_wan import WanAttnProcessor

            for block in self.model.blocks:
                block.attn2_saved = block.attn2.processor
                block.attn2.set_processor(WanAttnProcessor())
            return self.model(x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        finally:
            for i, block in enumerate(self.model.blocks):
                block.attn1.set_processor(saved[i])
                block.attn2.set_processor(block.attn2_saved)
                del block.attn2_saved
