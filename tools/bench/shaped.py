"""The published-shape transformers of `longserve bench transformer --model ltx2-shaped|hunyuan15-shaped`.

Each model is diffusers' own transformer class built at a published checkpoint's shape with seeded random
weights (speed and memory do not depend on the values), fed one denoising step's inputs at the published default
video size, and run two ways: diffusers' `model(...)` ("diffusers") and longserve's sequence-parallel wrapper of
the family's plan (`engine/families/ltx2/plan.py`, `engine/families/hunyuan15/plan.py`) under each plan the family
declares.

    --config bench   the published transformer and input sizes (below); `--layers`, `--frames`, `--size` cut them
    --config tiny    tiny-ltx2's / tiny-hunyuan15's transformer config (weights/): seconds on a CPU, for tests

Published shapes (diffusers-format transformer/config.json):
- LTX-2 (Lightricks/LTX-2, `LTX2VideoTransformer3DModel`, 19B): 48 blocks; video 32 heads x 128 = 4096, 128 latent
  channels, prompt cross-attention 4096 wide; audio 32 heads x 64 = 2048, 128 channels; captions 3840 wide
  (the text connectors' output). These are `LTX2VideoTransformer3DModel`'s defaults in diffusers 0.42 (the
  class documents them as LTX-2.0's), and the numbers the released checkpoint's metadata carries. Input: the
  pipeline's defaults, 512 x 768 x 121 frames at 24 fps -> latents 16 x 16 x 24 (8x time, 32x space, patch 1):
  6144 video tokens; 5.04 s of sound -> 126 audio latent frames (16 kHz, hop 160, 4x); 1024 prompt tokens.
- HunyuanVideo-1.5 480p (tencent/HunyuanVideo-1.5, `HunyuanVideo15Transformer3DModel`, 8.3B): 54 blocks,
  16 heads x 128 = 2048, 2 refiner blocks, MLP 4x, patch 1, 65 input channels (32 latent + 32 condition + 1 mask),
  32 out, Qwen2.5-VL text 3584 wide, ByT5 1472, SigLIP image tokens 1152 (diffusers'
  scripts/convert_hunyuan_video1_5_to_diffusers.py, "480p"). Input: 480 x 848 x 121 frames -> latents
  31 x 30 x 53 (4x time, 16x space): 49,290 video tokens; 1000 Qwen tokens, 256 ByT5, 729 image tokens.

Every step is a classifier-free-guidance batch of 2 (the same latent twice, negative and positive prompts).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

MODELS = ("ltx2-shaped", "hunyuan15-shaped")

PUBLISHED: dict[str, dict] = {
    "ltx2-shaped": dict(
        transformer=dict(num_layers=48, num_attention_heads=32, attention_head_dim=128, in_channels=128,
                         out_channels=128, cross_attention_dim=4096, audio_num_attention_heads=32,
                         audio_attention_head_dim=64, audio_in_channels=128, audio_out_channels=128,
                         audio_cross_attention_dim=2048, caption_channels=3840),
        frames=16, latent=(16, 24), audio_frames=126, text_len=1024),
    "hunyuan15-shaped": dict(
        transformer=dict(num_layers=54, num_attention_heads=16, attention_head_dim=128, num_refiner_layers=2,
                         mlp_ratio=4.0, patch_size=1, patch_size_t=1, in_channels=65, out_channels=32,
                         text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0,
                         rope_axes_dim=(16, 56, 56), target_size=640, task_type="t2v"),
        frames=31, latent=(30, 53), text_len=1000, text_2_len=256, image_len=729),
}

#: tiny configs: the shipped tiny checkpoints' transformers, at odd token counts
TINY_CHECKPOINT = {"ltx2-shaped": "tiny-ltx2", "hunyuan15-shaped": "tiny-hunyuan15"}
TINY_INPUT = {"ltx2-shaped": dict(frames=3, latent=(3, 5), audio_frames=7, text_len=8),
              "hunyuan15-shaped": dict(frames=3, latent=(5, 7), text_len=8, text_2_len=6, image_len=5)}


def strategies(model: str) -> tuple[str, ...]:
    """The plans the family declares (engine.families.*.plans)."""
    from longserve.engine.families import load_family

    return tuple(load_family("ltx2" if model == "ltx2-shaped" else "hunyuan15").plans)


def model_config(model: str, config: str) -> dict:
    """-> {"transformer": constructor kwargs, "frames", "latent", ... input sizes}."""
    if config == "tiny":
        from longserve.weights import resolve_model

        path = Path(resolve_model(TINY_CHECKPOINT[model])) / "transformer" / "config.json"
        transformer = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
        return dict(TINY_INPUT[model], transformer=transformer)
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in PUBLISHED[model].items()}


def describe(cfg: dict) -> dict:
    """The shape in the bench's common terms (heads, head_dim, layers, hidden, tokens)."""
    t = cfg["transformer"]
    H, W = cfg["latent"]
    return dict(heads=t["num_attention_heads"], head_dim=t["attention_head_dim"], layers=t["num_layers"],
                hidden=t["num_attention_heads"] * t["attention_head_dim"], frames=cfg["frames"], latent=[H, W],
                patch=1, patches_per_frame=H * W, video_tokens=cfg["frames"] * H * W,
                **{k: cfg[k] for k in ("audio_frames", "text_len", "text_2_len", "image_len") if k in cfg})


@contextlib.contextmanager
def _default_dtype(dtype):
    import torch

    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def build(model: str, cfg: dict, seed: int, device, dtype):
    """diffusers' transformer at `cfg`'s shape, allocated on `device` in `dtype` (no float32 copy of a
    many-GB model first), every weight redrawn from `seed` (`weights.seeded.reinit_`, drawn on the device)."""
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel, LTX2VideoTransformer3DModel

    from tools.weights.seeded import reinit_

    cls = LTX2VideoTransformer3DModel if model == "ltx2-shaped" else HunyuanVideo15Transformer3DModel
    with torch.random.fork_rng(devices=[]), torch.device(device), _default_dtype(dtype):
        torch.manual_seed(seed)
        net = cls(**cfg["transformer"])
    return reinit_(net, seed, device=device).eval()


def step_inputs(model: str, cfg: dict, seed: int, device, dtype) -> dict:
    """diffusers' forward's keyword arguments for one CFG step (batch 2)."""
    import torch

    t = cfg["transformer"]
    g = torch.Generator().manual_seed(seed + 2)
    F, (H, W) = cfg["frames"], cfg["latent"]

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    def pair(x):                                      # the same latent in both CFG rows
        return torch.cat([x, x])

    def mask(length, valid):                          # the first `valid` tokens real, per row
        return (torch.arange(length) < torch.tensor(valid)[:, None]).long().to(device)

    L = cfg["text_len"]
    if model == "ltx2-shaped":
        A = cfg["audio_frames"]
        step = torch.full((2,), 500.0, device=device, dtype=dtype)
        return dict(hidden_states=pair(randn(1, F * H * W, t["in_channels"])),
                    audio_hidden_states=pair(randn(1, A, t["audio_in_channels"])),
                    encoder_hidden_states=randn(2, L, t["caption_channels"]),
                    audio_encoder_hidden_states=randn(2, L, t["caption_channels"]),
                    encoder_attention_mask=mask(L, [max(1, L // 4), max(1, L // 2)]),
                    audio_encoder_attention_mask=mask(L, [max(1, L // 4), max(1, L // 2)]),
                    timestep=step, audio_timestep=step, sigma=step, num_frames=F, height=H, width=W,
                    audio_num_frames=A, use_cross_timestep=True)
    latent = randn(1, t["in_channels"], F, H, W)
    L2, L3 = cfg["text_2_len"], cfg["image_len"]
    return dict(hidden_states=pair(latent), timestep=torch.full((2,), 500.0, device=device, dtype=dtype),
                encoder_hidden_states=randn(2, L, t["text_embed_dim"]),
                encoder_attention_mask=mask(L, [max(1, L // 5), max(1, L // 3)]),
                encoder_hidden_states_2=randn(2, L2, t["text_embed_2_dim"]),
                encoder_attention_mask_2=mask(L2, [max(1, L2 // 8), max(1, L2 // 4)]),
                image_embeds=torch.zeros(2, L3, t["image_embed_dim"], device=device, dtype=dtype))   # text-to-video


def wrap(model: str, net):
    """The family's sequence-parallel wrapper (the plan's hooks and processors)."""
    if model == "ltx2-shaped":
        from longserve.engine.families.ltx2.plan import LTX2SequenceParallel

        return LTX2SequenceParallel(net)
    from longserve.engine.families.hunyuan15.plan import Hunyuan15SequenceParallel

    return Hunyuan15SequenceParallel(net)


def _joined(out):
    """LTX-2's (video, audio) as one tensor (B, S*C + A*Ca); HunyuanVideo-1.5's output as it is."""
    import torch

    if isinstance(out, (tuple, list)):
        return torch.cat([o.flatten(1) for o in out], dim=1)
    return out


def reference(model: str, net, kw: dict):
    """diffusers' own forward."""
    return _joined(net(**kw, return_dict=False) if model == "ltx2-shaped" else net(**kw, return_dict=False)[0])


def parallel(model: str, wrapped, kw: dict, sp):
    """The family's plan over `sp` (every rank gets the whole output)."""
    if model == "ltx2-shaped":
        return _joined(wrapped(sp=sp, **kw))
    cond = {k: v for k, v in kw.items() if k not in ("hidden_states", "timestep")}
    return wrapped(kw["hidden_states"], kw["timestep"], cond, sp)
