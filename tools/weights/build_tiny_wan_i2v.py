"""Build the tiny, randomly initialised image-to-video Wan checkpoints shipped as ``weights/tiny-wan-i2v``
(Wan 2.1 I2V), ``weights/tiny-wan-flf2v`` (Wan 2.1 FLF2V, first and last frame), ``weights/tiny-wan22-ti2v``
(Wan 2.2 TI2V-5B: text or image to video, the Wan 2.2 VAE), ``weights/tiny-wan22-i2v-a14b`` (Wan 2.2 I2V A14B:
two experts, no image encoder) and ``weights/tiny-skyreels-i2v`` (SkyReels-V2 I2V).

Usage::

    python -m tools.weights.build_tiny_wan_i2v                               # (re)writes every shipped dir
    python -m tools.weights.build_tiny_wan_i2v --kind i2v --out DIR          # writes DIR instead

The Wan 2.1 ones are complete diffusers ``WanImageToVideoPipeline`` directories whose model_index.json names
the published components (``weights.wan.WAN_2_1_I2V_MODEL_INDEX``: the Wan 2.1 T2V ones plus
``CLIPVisionModel`` and ``CLIPImageProcessor``). They share tiny-wan's text encoder, tokenizer
and VAE builders (``tools.weights.build_tiny_wan``: same seeds, so the same weights) and add:

* transformer: tiny-wan's (3 heads x 12, 2 blocks, patch (1, 2, 2)) with the I2V branch of
  Wan 2.1 I2V 14B: in_channels 20 = latent 8 + condition 8 + the 4-channel first-frame mask
  (36 = 16 + 16 + 4 in the real one), image_dim 32 (= the tiny CLIP's width), added_kv_proj_dim 36
  (= the inner dim, as 5120 is the 14B's). FLF2V adds pos_embed_seq_len = 2 x 17 (the two
  images' CLIP tokens; 2 x 257 in the real one).
* image_encoder: ``CLIPVisionModel`` with ViT-H/14's structure (gelu, pre/post layer norms) at
  width 32, 4 heads x 8, mlp 64, 3 layers, 32 x 32 images in 8 x 8 patches: 16 patches + the class
  token = 17 tokens (257 in ViT-H/14). The pipeline reads ``hidden_states[-2]``.
* image_processor: ``CLIPImageProcessor`` with ViT-H/14's settings (shorter side resized,
  bicubic, centre crop, OpenAI CLIP mean/std) at 32 px instead of 224.
* scheduler: UniPC flow prediction, flow_shift 3.0 (I2V) / 16.0 (FLF2V), as the conversion script.
* generation_defaults.json: tiny-wan's (64 x 64, 9 frames, 20 steps, guidance 5.0, fps 16).

The Wan 2.2 and SkyReels ones, each in its published layout (``weights.wan``):

* ``tiny-wan22-ti2v``: a ``WanPipeline`` with ``expand_timesteps: true`` (diffusers loads the same directory
  into ``WanImageToVideoPipeline`` for image-to-video). vae: ``AutoencoderKLWan`` with the Wan 2.2 VAE's
  structure (residual blocks on 2x2-patchified pixels, 12 channels in and out, a wider decoder, 16x spatial
  and 4x temporal compression) at base_dim 4 / decoder_base_dim 6 (160 / 256), z_dim 12 (48) with the first 12
  of its latents_mean / latents_std; transformer: tiny-wan's with in/out channels 12; scheduler flow_shift 5.0;
  generation_defaults 64 x 64 (a multiple of 16 x patch 2 = 32), 9 frames, fps 24.
* ``tiny-wan22-i2v-a14b``: a ``WanImageToVideoPipeline`` with ``transformer`` (high noise) and ``transformer_2``
  (low noise, another seed), boundary_ratio 0.9, no image encoder or processor; each expert is tiny-wan's
  transformer with in_channels 20 (latent + condition + mask) and no image branch; tiny-wan's VAE.
* ``tiny-skyreels-i2v``: a ``SkyReelsV2ImageToVideoPipeline``: tiny-wan-i2v's transformer config as a
  ``SkyReelsV2Transformer3DModel`` (its own seed), the tiny CLIP as ``CLIPVisionModelWithProjection``, the
  SkyReels scheduler (flow_shift 1.0), fps 24. The published checkpoint's image_processor is a
  ``CLIPProcessor`` (the CLIP tokenizer beside the image processor); the pipeline calls only its image half,
  so the tiny one ships the ``CLIPImageProcessor`` alone (as diffusers' own tests of this pipeline do) and
  names it in model_index.json.

Every parameter is redrawn from a generator seeded per component, so the same library versions
give byte-identical files. The weights are meaningless.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from longserve.weights.registry import TINY_MODELS
from tools.weights.build_tiny_wan import (
    SEED,
    TINY_Z_DIM,
    WAN_GENERATION_DEFAULTS,
    WAN_TRANSFORMER_CONFIG,
    build_scheduler,
    build_text_encoder,
    build_vae,
    build_wan_tokenizer,
    save_pipeline,
)
from tools.weights.seeded import redraw_
from tools.weights.wan import (
    CLIP_IMAGE_PROCESSOR,
    CLIP_VIT_H_14_VISION,
    SKYREELS_V2_I2V_MODEL_INDEX,
    SKYREELS_V2_SCHEDULER,
    SKYREELS_V2_T2V_14B_540P_TRANSFORMER,
    WAN_2_1_FLF2V_SCHEDULER,
    WAN_2_1_I2V_MODEL_INDEX,
    WAN_2_1_I2V_SCHEDULER,
    WAN_2_2_I2V_A14B_BOUNDARY_RATIO,
    WAN_2_2_I2V_A14B_MODEL_INDEX,
    WAN_2_2_I2V_A14B_SCHEDULER,
    WAN_2_2_TI2V_5B_FPS,
    WAN_2_2_TI2V_5B_MODEL_INDEX,
    WAN_2_2_TI2V_5B_SCHEDULER,
    WAN_2_2_VAE,
    init_kwargs,
)
from tools.weights.writing import report, write_whole

KINDS = ("i2v", "flf2v", "wan22-ti2v", "wan22-i2v-a14b", "skyreels-i2v")
DEFAULT_OUT = {"i2v": TINY_MODELS["tiny-wan-i2v"], "flf2v": TINY_MODELS["tiny-wan-flf2v"],
               "wan22-ti2v": TINY_MODELS["tiny-wan22-ti2v"], "wan22-i2v-a14b": TINY_MODELS["tiny-wan22-i2v-a14b"],
               "skyreels-i2v": TINY_MODELS["tiny-skyreels-i2v"]}

# --- image encoder -----------------------------------------------------------------------------
TINY_CLIP_IMAGE_SIZE = 32
CLIP_VISION_CONFIG = dict(
    CLIP_VIT_H_14_VISION,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_hidden_layers=3,
    image_size=TINY_CLIP_IMAGE_SIZE,
    patch_size=8,
    projection_dim=16,
)
CLIP_TOKENS = (TINY_CLIP_IMAGE_SIZE // CLIP_VISION_CONFIG["patch_size"]) ** 2 + 1   # 17
CLIP_PROCESSOR_CONFIG = dict(
    CLIP_IMAGE_PROCESSOR,
    crop_size={"height": TINY_CLIP_IMAGE_SIZE, "width": TINY_CLIP_IMAGE_SIZE},
    size={"shortest_edge": TINY_CLIP_IMAGE_SIZE},
)

# --- transformers ------------------------------------------------------------------------------
MASK_CHANNELS = 4        # the first-frame mask: one channel per pixel frame of a latent frame (VAE temporal 4x)
I2V_TRANSFORMER_CONFIG = {
    **WAN_TRANSFORMER_CONFIG,
    "in_channels": 2 * TINY_Z_DIM + MASK_CHANNELS,
    "image_dim": CLIP_VISION_CONFIG["hidden_size"],
    "added_kv_proj_dim": WAN_TRANSFORMER_CONFIG["num_attention_heads"] * WAN_TRANSFORMER_CONFIG["attention_head_dim"],
    "pos_embed_seq_len": None,
}
FLF2V_TRANSFORMER_CONFIG = {**I2V_TRANSFORMER_CONFIG, "pos_embed_seq_len": 2 * CLIP_TOKENS}
# Wan 2.2 I2V A14B: the condition channels without the CLIP branch (image_dim, added_kv_proj_dim None)
A14B_I2V_TRANSFORMER_CONFIG = {**I2V_TRANSFORMER_CONFIG, "image_dim": None, "added_kv_proj_dim": None}
# SkyReels-V2 I2V: tiny-wan-i2v's transformer with the SkyReels keys (no fps embedding, frame-level blocks)
SKYREELS_I2V_TRANSFORMER_CONFIG = {
    **{k: SKYREELS_V2_T2V_14B_540P_TRANSFORMER[k] for k in ("inject_sample_info", "num_frame_per_block")},
    **I2V_TRANSFORMER_CONFIG,
}

# --- Wan 2.2 TI2V-5B: the Wan 2.2 VAE at toy width ----------------------------------------------
TINY22_Z_DIM = 12
VAE22_CONFIG = dict(
    init_kwargs(WAN_2_2_VAE),
    base_dim=4,                 # encoder channels 4 / 8 / 16 / 16 (160 / 320 / 640 / 640)
    decoder_base_dim=6,         # the decoder wider than the encoder, as 256 against 160
    num_res_blocks=1,
    z_dim=TINY22_Z_DIM,
    latents_mean=WAN_2_2_VAE["latents_mean"][:TINY22_Z_DIM],
    latents_std=WAN_2_2_VAE["latents_std"][:TINY22_Z_DIM],
)
TI2V_TRANSFORMER_CONFIG = {**WAN_TRANSFORMER_CONFIG, "in_channels": TINY22_Z_DIM, "out_channels": TINY22_Z_DIM}
# 64 x 64 is a multiple of the 16x VAE times the 2x2 patch; 24 fps as the real model
TI2V_GENERATION_DEFAULTS = {**WAN_GENERATION_DEFAULTS, "fps": WAN_2_2_TI2V_5B_FPS}
SKYREELS_I2V_GENERATION_DEFAULTS = {**WAN_GENERATION_DEFAULTS, "fps": 24}


def build_image_encoder(seed: int = SEED + 4, with_projection: bool = False, **overrides):
    """The tiny CLIP vision tower: ``CLIPVisionModel`` (Wan), or ``CLIPVisionModelWithProjection`` (SkyReels)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel, CLIPVisionModelWithProjection

    cls = CLIPVisionModelWithProjection if with_projection else CLIPVisionModel
    model = cls(CLIPVisionConfig(**{**CLIP_VISION_CONFIG, **overrides})).eval()
    return redraw_(model, seed)


def build_image_processor():
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(**CLIP_PROCESSOR_CONFIG)


def build_i2v_transformer(config: dict, seed: int = SEED + 2, cls=None):
    from diffusers import WanTransformer3DModel

    model = (cls or WanTransformer3DModel)(**config).eval()
    return redraw_(model, seed)


def write_tiny_i2v(out_dir: Path, transformer_config: dict, scheduler_config: dict) -> None:
    from diffusers import WanImageToVideoPipeline

    torch.manual_seed(SEED)  # only affects default inits, which the redraws overwrite
    tokenizer, spiece_model = build_wan_tokenizer()
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer, text_encoder=build_text_encoder(), vae=build_vae(),
        scheduler=build_scheduler(scheduler_config), image_processor=build_image_processor(),
        image_encoder=build_image_encoder(), transformer=build_i2v_transformer(transformer_config),
    )
    save_pipeline(pipe, out_dir, WAN_2_1_I2V_MODEL_INDEX, spiece_model, WAN_GENERATION_DEFAULTS)


def write_tiny_ti2v(out_dir: Path) -> None:
    """Wan 2.2 TI2V-5B: a ``WanPipeline`` with expand_timesteps (the model_index says so), the Wan 2.2 VAE."""
    from diffusers import AutoencoderKLWan, WanPipeline

    torch.manual_seed(SEED)
    tokenizer, spiece_model = build_wan_tokenizer()
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=build_text_encoder(),
        vae=redraw_(AutoencoderKLWan(**VAE22_CONFIG).eval(), SEED + 5),
        transformer=build_i2v_transformer(TI2V_TRANSFORMER_CONFIG, SEED + 6),
        scheduler=build_scheduler(WAN_2_2_TI2V_5B_SCHEDULER), expand_timesteps=True,
    )
    save_pipeline(pipe, out_dir, WAN_2_2_TI2V_5B_MODEL_INDEX, spiece_model, TI2V_GENERATION_DEFAULTS)


def write_tiny_i2v_a14b(out_dir: Path) -> None:
    """Wan 2.2 I2V A14B: high- and low-noise experts (different seeds), boundary_ratio 0.9, no CLIP."""
    from diffusers import WanImageToVideoPipeline

    torch.manual_seed(SEED)
    tokenizer, spiece_model = build_wan_tokenizer()
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer, text_encoder=build_text_encoder(), vae=build_vae(),
        scheduler=build_scheduler(WAN_2_2_I2V_A14B_SCHEDULER),
        transformer=build_i2v_transformer(A14B_I2V_TRANSFORMER_CONFIG, SEED + 7),
        transformer_2=build_i2v_transformer(A14B_I2V_TRANSFORMER_CONFIG, SEED + 8),
        boundary_ratio=WAN_2_2_I2V_A14B_BOUNDARY_RATIO,
    )
    save_pipeline(pipe, out_dir, WAN_2_2_I2V_A14B_MODEL_INDEX, spiece_model, WAN_GENERATION_DEFAULTS)


def write_tiny_skyreels_i2v(out_dir: Path) -> None:
    """SkyReels-V2 I2V: tiny-wan-i2v's parts as the SkyReels pipeline's classes."""
    from diffusers import SkyReelsV2ImageToVideoPipeline, SkyReelsV2Transformer3DModel

    torch.manual_seed(SEED)
    tokenizer, spiece_model = build_wan_tokenizer()
    pipe = SkyReelsV2ImageToVideoPipeline(
        tokenizer=tokenizer, text_encoder=build_text_encoder(), vae=build_vae(),
        scheduler=build_scheduler(SKYREELS_V2_SCHEDULER), image_processor=build_image_processor(),
        image_encoder=build_image_encoder(with_projection=True),
        transformer=build_i2v_transformer(SKYREELS_I2V_TRANSFORMER_CONFIG, SEED + 9, SkyReelsV2Transformer3DModel),
    )
    index = {**SKYREELS_V2_I2V_MODEL_INDEX, "image_processor": ["transformers", "CLIPImageProcessor"]}
    save_pipeline(pipe, out_dir, index, spiece_model, SKYREELS_I2V_GENERATION_DEFAULTS)


WRITERS: dict[str, Callable[[Path], None]] = {
    "i2v": lambda out: write_tiny_i2v(out, I2V_TRANSFORMER_CONFIG, WAN_2_1_I2V_SCHEDULER),
    "flf2v": lambda out: write_tiny_i2v(out, FLF2V_TRANSFORMER_CONFIG, WAN_2_1_FLF2V_SCHEDULER),
    "wan22-ti2v": write_tiny_ti2v,
    "wan22-i2v-a14b": write_tiny_i2v_a14b,
    "skyreels-i2v": write_tiny_skyreels_i2v,
}


def build(kind: str, out: str | Path | None = None) -> Path:
    """Build the ``kind`` checkpoint (one of ``KINDS``) into ``out`` (default: the shipped dir)."""
    if kind not in WRITERS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return write_whole(DEFAULT_OUT[kind] if out is None else out, WRITERS[kind])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.weights.build_tiny_wan_i2v", description=__doc__.split("\n")[0])
    ap.add_argument("--kind", choices=(*KINDS, "all"), default="all", help="which checkpoint (default: all)")
    ap.add_argument("--out", default=None, help="output directory (default: the shipped one; needs one --kind)")
    args = ap.parse_args(argv)
    kinds = KINDS if args.kind == "all" else (args.kind,)
    if args.out is not None and len(kinds) > 1:
        ap.error("--out needs one --kind")
    for kind in kinds:
        t0 = time.perf_counter()
        report(build(kind, args.out), time.perf_counter() - t0, kind=kind)
    return 0


if __name__ == "__main__":
    sys.exit(main())
