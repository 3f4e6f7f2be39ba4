"""Tiny random causal Wan checkpoints for tests, and the recompute reference the cached loop must equal.

`build_tiny_causal(out, **causal)` writes a causal checkpoint (weights/causal_wan.py layout, the
released generators' key names) with tiny-wan's transformer config (3 heads x 12, 2 layers) and
components and seeded random weights. `recompute_reference(...)` generates the same video as the
engine's KV-cached chunk loop, but the plain way: every forward runs diffusers' own
`WanTransformer3DModel.forward` over all previous clean frames (at the context timestep) plus the
chunk (at its timestep, per-token timesteps), with the block-causal mask applied by an attention
processor written here from diffusers' modules, and no cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from longserve.weights.registry import TINY_MODELS
from tools.weights.build_causal import build_causal_checkpoint

TINY_CAUSAL = {"num_frame_per_block": 3, "denoising_step_list": [1000, 750, 500, 250], "warp_denoising_step": True,
               "timestep_shift": 5.0, "local_attn_size": 15, "sink_size": 1, "context_noise": 0, "fps": 16}
TINY_DEFAULTS = {"height": 16, "width": 80, "num_frames": 45, "num_inference_steps": 4, "guidance_scale": 1.0,
                 "fps": 16}


def build_tiny_causal(out: Path, weights_name: str = "model.safetensors", **causal) -> Path:
    config = json.loads((TINY_MODELS["tiny-wan"] / "transformer" / "config.json").read_text())
    return build_causal_checkpoint(out, config, {**TINY_CAUSAL, **causal}, weights_name=weights_name,
                                   defaults=TINY_DEFAULTS)


class MaskedAttention:
    """diffusers' Wan self-attention (projections, q/k norms, its rotary table) with a boolean mask."""

    def __init__(self):
        self.mask = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))

        def rotate(x, cos, sin):
            x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
            out = torch.empty_like(x)
            out[..., 0::2] = x1 * cos[..., 0::2] - x2 * sin[..., 1::2]
            out[..., 1::2] = x1 * sin[..., 1::2] + x2 * cos[..., 0::2]
            return out

        q, k = rotate(q, *rotary_emb), rotate(k, *rotary_emb)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=self.mask)
        return attn.to_out[1](attn.to_out[0](out.transpose(1, 2).flatten(2, 3)))


def recompute_reference(model_dir: Path, prompt: str, seed: int, chunks: int, height: int, width: int):
    """The video's latents (1, C, chunks * frames_per_block, h, w), chunk by chunk without a cache."""
    from diffusers import AutoencoderKLWan, WanPipeline
    from transformers import AutoTokenizer, UMT5EncoderModel

    from longserve.engine.models.causal import CausalConfig
    from longserve.weights.causal_wan import load_causal_transformer, read_causal_config

    cfg = CausalConfig.from_dict(read_causal_config(model_dir))
    model = load_causal_transformer(model_dir)
    proc = MaskedAttention()
    for block in model.blocks:
        block.attn1.set_processor(proc)
    pipe = WanPipeline(tokenizer=AutoTokenizer.from_pretrained(model_dir / "tokenizer"),
                       text_encoder=UMT5EncoderModel.from_pretrained(model_dir / "text_encoder"),
                       transformer=model, vae=AutoencoderKLWan.from_pretrained(model_dir / "vae"), scheduler=None)
    text = pipe.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=512)[0]
    C, p_h, p_w = model.config.in_channels, *model.config.patch_size[1:]
    h, w = height // 8, width // 8
    fb, tokens = cfg.frames_per_block, (h // p_h) * (w // p_w)
    gen = torch.Generator("cpu").manual_seed(seed)
    clean = []
    with torch.no_grad():
        for c in range(chunks):
            x = torch.randn((1, C, fb, h, w), generator=gen)
            frames = (c + 1) * fb
            block_of = torch.arange(frames * tokens) // (fb * tokens)
            proc.mask = block_of[:, None] >= block_of[None, :]                    # block-causal, by chunk
            for i, t in enumerate(cfg.timesteps):
                seq = torch.cat(clean + [x], dim=2)
                timestep = torch.full((1, frames * tokens), cfg.context_noise)
                timestep[:, c * fb * tokens:] = t
                v = model(seq, timestep, text, return_dict=False)[0][:, :, c * fb:]
                x0 = x - cfg.sigma(t) * v
                if i < len(cfg.timesteps) - 1:
                    s = cfg.sigma(cfg.timesteps[i + 1])
                    x = (1 - s) * x0 + s * torch.randn(x.shape, generator=gen)
            clean.append(x0)
    return torch.cat(clean, dim=2)


def switched_session(pipe, last: int, height: int, width: int):
    """A live session of "a red ball bouncing" (seed 1) switched to "a blue ball bouncing" as chunk 1 arrives, read
    to chunk `last`: ([(chunk index, prompt index)], the first chunk under the switch, the session)."""
    with pipe.live("a red ball bouncing", seconds=60, height=height, width=width, seed=1) as session:
        seen = []
        for chunk in session:
            seen.append((chunk.index, chunk.prompt_index))
            if chunk.index == 1:
                assert session.switch("a blue ball bouncing") == 1
            if chunk.index == last:
                break
    return seen, min(i for i, p in seen if p == 1), session


def stopped_session(pipe, height: int, width: int):
    """A live session (seed 2, an hour long) stopped as chunk 1 arrives: (the chunks it delivered, the session)."""
    session = pipe.live("a red ball bouncing", seconds=3600, height=height, width=width, seed=2)
    got = []
    for chunk in session:
        got.append(chunk)
        if chunk.index == 1:
            session.stop()
    return got, session


def cancelled_at_first_chunk(pipe, height: int, width: int):
    """A live request of 16 chunks (seed 3) cancelled as chunk 0's frames arrive: (every output, its handle)."""
    from longserve.engine.outputs import FramesChunk

    handle = pipe.engine.submit(pipe.make_spec("a red ball bouncing", num_frames=1 + (16 * 3 - 1) * 4, height=height,
                                               width=width, seed=3, live=True))
    outs = []
    for out in handle:
        outs.append(out)
        if isinstance(out, FramesChunk) and out.live.chunk == 0:
            handle.cancel()                          # ends at the next step boundary
    return outs, handle
