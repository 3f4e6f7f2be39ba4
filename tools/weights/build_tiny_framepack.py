"""Build the tiny, randomly initialised FramePack checkpoint shipped as ``weights/tiny-framepack``: a
``HunyuanVideoFramepackPipeline`` directory (image to video, in sections of ``latent_window_size`` latent frames over a
packed, compressed history).

Usage::

    python -m tools.weights.build_tiny_framepack [--out DIR]

model_index.json names the published components (FramePack's transformer over HunyuanVideo's text encoders, VAE and
the SigLIP image encoder: ``LlamaModel`` + ``LlamaTokenizerFast``, ``CLIPTextModel`` + ``CLIPTokenizer``,
``SiglipVisionModel`` + ``SiglipImageProcessor``, ``HunyuanVideoFramepackTransformer3DModel``,
``AutoencoderKLHunyuanVideo``, ``FlowMatchEulerDiscreteScheduler``), each at toy sizes:

* transformer: 3 heads x 12 (inner dim 36; 3 divides by neither 2 nor 4; rope axes 4/4/4), 1 dual-stream and 1
  single-stream block, 1 refiner block, mlp ratio 2, the published patch 1x2x2 and history embedders (1x2x2, 2x4x4,
  4x8x8 for the 1x, 2x and 4x compressed history), in/out 4 channels, text dims 32 (Llama) and 24 (CLIP's pooled
  output), image projection from 8 (= SigLIP's width), guidance embedding (the distilled guidance the published
  checkpoint takes).
* vae: ``AutoencoderKLHunyuanVideo`` with the published 8x spatial, 4x temporal compression at block_out_channels
  (8, 8, 8, 8), one layer per block, 4 latent channels.
* text_encoder: ``LlamaModel`` hidden 32, 3 layers (the pipeline reads hidden_states[-3]), 4 heads (2 KV heads);
  tokenizer: a Llama BPE tokenizer over characters and byte fallback (no merges).
* text_encoder_2: ``CLIPTextModel`` hidden 24, 1 layer; tokenizer_2: a byte-level ``CLIPTokenizer`` (no merges).
* image_encoder: ``SiglipVisionModel`` hidden 8, 1 layer, 28 x 28 images in patches of 4 (49 tokens);
  feature_extractor: its ``SiglipImageProcessor`` at 28 x 28.
* scheduler: ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting (the pipeline passes its `mu`).
* generation_defaults.json: 64 x 96 (4 x 6 tokens a latent frame after the 2x2 patch), 33 frames (one section of
  latent_window_size 9 is 33 frames), 4 steps, guidance 10 (FramePack's distilled guidance).

Every tensor is drawn from generators seeded per component, so the same library versions give byte-identical files.
The weights are meaningless.
"""

from __future__ import annotations

from pathlib import Path

import torch

from longserve.weights.registry import TINY_MODELS
from tools.weights.build_tiny_hunyuan15 import byte_char
from tools.weights.build_tiny_ltx2 import CHARS
from tools.weights.build_tiny_wan import save_pipeline
from tools.weights.seeded import redraw_
from tools.weights.writing import report, write_whole

SEED = 0
LATENT_CHANNELS = 4
MODEL_INDEX = {
    "_class_name": "HunyuanVideoFramepackPipeline",
    "feature_extractor": ["transformers", "SiglipImageProcessor"],
    "image_encoder": ["transformers", "SiglipVisionModel"],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "LlamaModel"],
    "text_encoder_2": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "LlamaTokenizerFast"],
    "tokenizer_2": ["transformers", "CLIPTokenizer"],
    "transformer": ["diffusers", "HunyuanVideoFramepackTransformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLHunyuanVideo"],
}
LLAMA_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
CLIP_CONFIG = dict(hidden_size=24, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                   max_position_embeddings=77, projection_dim=24)
SIGLIP_CONFIG = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_channels=3,
                     image_size=28, patch_size=4)
TRANSFORMER = dict(in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_attention_heads=3,
                   attention_head_dim=12, num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0,
                   patch_size=2, patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True,
                   text_embed_dim=LLAMA_CONFIG["hidden_size"], pooled_projection_dim=CLIP_CONFIG["hidden_size"],
                   rope_theta=256.0, rope_axes_dim=(4, 4, 4), image_condition_type=None, has_image_proj=True,
                   image_proj_dim=SIGLIP_CONFIG["hidden_size"], has_clean_x_embedder=True)
VAE = dict(in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8),
           layers_per_block=1, norm_num_groups=4, spatial_compression_ratio=8, temporal_compression_ratio=4)
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True)
GENERATION_DEFAULTS = {"height": 64, "width": 96, "num_frames": 33, "num_inference_steps": 4, "guidance_scale": 10.0,
                       "fps": 30, "latent_window_size": 9}


def build_tokenizer():
    """A Llama tokenizer: specials, the 256 byte-fallback pieces, "▁" and single characters; no merges."""
    from transformers import LlamaTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + ["▁"] + list(CHARS)
    return LlamaTokenizerFast(vocab={p: i for i, p in enumerate(pieces)}, merges=[], pad_token="<unk>",
                              model_max_length=1024)


def build_tokenizer_2():
    """A byte-level CLIP tokenizer: every byte as itself and as a word's end ("</w>"), no merges."""
    from transformers import CLIPTokenizer

    vocab = {byte_char(b): b for b in range(256)}
    vocab.update({byte_char(b) + "</w>": 256 + b for b in range(256)})
    vocab.update({"<|startoftext|>": 512, "<|endoftext|>": 513})
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def build_pipeline():
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoFramepackPipeline,
        HunyuanVideoFramepackTransformer3DModel,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        LlamaConfig,
        LlamaModel,
        SiglipImageProcessorPil,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    torch.manual_seed(SEED)
    tokenizer, tokenizer_2 = build_tokenizer(), build_tokenizer_2()
    size = SIGLIP_CONFIG["image_size"]
    return HunyuanVideoFramepackPipeline(
        text_encoder=redraw_(LlamaModel(LlamaConfig(vocab_size=len(tokenizer), **LLAMA_CONFIG)).eval(), SEED + 1),
        tokenizer=tokenizer,
        transformer=redraw_(HunyuanVideoFramepackTransformer3DModel(**TRANSFORMER).eval(), SEED + 2),
        vae=redraw_(AutoencoderKLHunyuanVideo(**VAE).eval(), SEED + 3),
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        text_encoder_2=redraw_(CLIPTextModel(CLIPTextConfig(vocab_size=len(tokenizer_2), bos_token_id=512,
                                                            eos_token_id=513, pad_token_id=513,
                                                            **CLIP_CONFIG)).eval(), SEED + 4),
        tokenizer_2=tokenizer_2,
        image_encoder=redraw_(SiglipVisionModel(SiglipVisionConfig(**SIGLIP_CONFIG)).eval(), SEED + 5),
        feature_extractor=SiglipImageProcessorPil(size={"height": size, "width": size}))


def write_tiny_framepack(out_dir: Path) -> None:
    save_pipeline(build_pipeline(), out_dir, MODEL_INDEX, generation_defaults=GENERATION_DEFAULTS)


def build(out: str | Path | None = None) -> Path:
    return write_whole(TINY_MODELS["tiny-framepack"] if out is None else out, write_tiny_framepack)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import time

    ap = argparse.ArgumentParser(prog="python -m tools.weights.build_tiny_framepack",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="output directory (default: weights/tiny-framepack)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    report(build(args.out), time.perf_counter() - t0, kind="framepack")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
