"""Build the tiny, randomly initialised LTX-2 checkpoint shipped as ``weights/tiny-ltx2`` (video with sound).

Usage::

    python -m tools.weights.build_tiny_ltx2              # (re)writes weights/tiny-ltx2/
    python -m tools.weights.build_tiny_ltx2 --out DIR
    python -m tools.weights.build_tiny_ltx2 --kind i2v   # weights/tiny-ltx2-i2v: an LTX2ImageToVideoPipeline index
                                                          # over links to tiny-ltx2's components
    python -m tools.weights.build_tiny_ltx2 --kind upsample  # weights/tiny-ltx2-upsample: the same links and a
                                                              # latent upsampler (LTX2LatentUpsamplerModel)

A complete diffusers ``LTX2Pipeline`` directory: model_index.json names the published component classes
(``GemmaTokenizerFast``, ``Gemma3ForConditionalGeneration``, ``LTX2TextConnectors``,
``LTX2VideoTransformer3DModel``, ``AutoencoderKLLTX2Video``, ``AutoencoderKLLTX2Audio``, ``LTX2Vocoder``,
``FlowMatchEulerDiscreteScheduler``) and every model keeps its structure at toy sizes:

* transformer: video 3 heads x 8 (odd head count: divides by neither 2 nor 4; 24 splits into the 3-D rope's
  f/h/w parts), STG's perturbed self-attention on (``perturbed_attn``), audio 3 heads x 4, 2 layers,
  in/out channels 8 (= the video VAE's latents), audio in/out 8
  (= the audio VAE's 2 latent channels x 4 latent mel bins), caption channels 24 (= the text encoder's).
* vae: ``AutoencoderKLLTX2Video`` with LTX-2's compression (32x spatial: patch 4 then three 2x stages; 8x
  temporal), channels 8/16/16/16, one layer per block, 8 latent channels.
* audio_vae: ``AutoencoderKLLTX2Audio``, base channels 8, ch_mult (1, 2, 4) (4x in time and mel bins), 16 mel
  bins, 2 latent channels, stereo; 16 kHz, hop 160 (25 audio latent frames a second, as published).
* vocoder: ``LTX2Vocoder`` with the published upsampling (x240: 100 mel frames a second -> 24 kHz), 32 channels.
* connectors: ``LTX2TextConnectors``, 3 heads x 8, one layer each, 8 learnable registers.
* text_encoder: ``Gemma3ForConditionalGeneration``: a 2-layer Gemma 3 text model (hidden 24) and a tiny SigLIP
  vision tower (the class the published checkpoints name; the pipeline reads only the text model's hidden states,
  3 of them: ``text_proj_in_factor``).
* tokenizer: a Gemma BPE tokenizer over characters and byte fallback (no merges), left padding, 128 tokens.
* scheduler: ``FlowMatchEulerDiscreteScheduler`` with LTX's dynamic shifting settings.

Every parameter is redrawn from a generator seeded per component (``weights.seeded.reinit_``), so the same
library versions give byte-identical files. The weights are meaningless.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from longserve.weights.registry import GENERATION_DEFAULTS_FILE, TINY_MODELS
from tools.weights.seeded import reinit_
from tools.weights.writing import report, write_whole

SEED = 0
MAX_SEQUENCE_LENGTH = 128        # the tokenizer's model_max_length (the pipeline pads every prompt to its argument)

TEXT_HIDDEN = 24
TEXT_LAYERS = 2
GEMMA3_TEXT_CONFIG = dict(
    vocab_size=None,               # the tokenizer's size, filled in by build_text_encoder
    hidden_size=TEXT_HIDDEN, intermediate_size=48, num_hidden_layers=TEXT_LAYERS, num_attention_heads=2,
    num_key_value_heads=1, head_dim=12, max_position_embeddings=512, sliding_window=16, query_pre_attn_scalar=12,
    rope_theta=1_000_000.0, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
)
SIGLIP_CONFIG = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     image_size=28, patch_size=14, num_channels=3)

VIDEO_LATENT_CHANNELS = 8
AUDIO_LATENT_CHANNELS = 2
MEL_BINS = 16
TRANSFORMER_CONFIG = dict(
    in_channels=VIDEO_LATENT_CHANNELS, out_channels=VIDEO_LATENT_CHANNELS, patch_size=1, patch_size_t=1,
    num_attention_heads=3, attention_head_dim=8, cross_attention_dim=24,
    vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20, base_height=2048, base_width=2048,
    audio_in_channels=AUDIO_LATENT_CHANNELS * MEL_BINS // 4, audio_out_channels=AUDIO_LATENT_CHANNELS * MEL_BINS // 4,
    audio_num_attention_heads=3, audio_attention_head_dim=4, audio_cross_attention_dim=12,
    audio_scale_factor=4, audio_pos_embed_max_pos=20, audio_sampling_rate=16000, audio_hop_length=160,
    num_layers=2, caption_channels=TEXT_HIDDEN, perturbed_attn=True,
)
VAE_CONFIG = dict(
    in_channels=3, out_channels=3, latent_channels=VIDEO_LATENT_CHANNELS,
    block_out_channels=(8, 16, 16, 16), decoder_block_out_channels=(8, 16, 32),
    layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
    spatio_temporal_scaling=(True, True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=(False, False, False, False),
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"), upsample_residual=(True, True, True),
    upsample_factor=(2, 2, 2), timestep_conditioning=False, patch_size=4, patch_size_t=1,
    encoder_causal=True, decoder_causal=False, spatial_compression_ratio=32, temporal_compression_ratio=8,
)
AUDIO_VAE_CONFIG = dict(
    base_channels=8, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=1, in_channels=2, resolution=256,
    latent_channels=AUDIO_LATENT_CHANNELS, norm_type="pixel", causality_axis="height", sample_rate=16000,
    mel_hop_length=160, is_causal=True, mel_bins=MEL_BINS, double_z=True,
)
VOCODER_CONFIG = dict(in_channels=2 * MEL_BINS, hidden_channels=32, out_channels=2, output_sampling_rate=24000)
CONNECTORS_CONFIG = dict(
    caption_channels=TEXT_HIDDEN, text_proj_in_factor=TEXT_LAYERS + 1,
    video_connector_num_attention_heads=3, video_connector_attention_head_dim=8, video_connector_num_layers=1,
    video_connector_num_learnable_registers=8,
    audio_connector_num_attention_heads=3, audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
    audio_connector_num_learnable_registers=8,
    connector_rope_base_seq_len=MAX_SEQUENCE_LENGTH,
)
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
    base_image_seq_len=1024, max_image_seq_len=4096, invert_sigmas=False, shift_terminal=0.1,
    time_shift_type="exponential",
)
MODEL_INDEX = {
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "vae": ["diffusers", "AutoencoderKLLTX2Video"],
    "audio_vae": ["diffusers", "AutoencoderKLLTX2Audio"],
    "text_encoder": ["transformers", "Gemma3ForConditionalGeneration"],
    "tokenizer": ["transformers", "GemmaTokenizerFast"],
    "connectors": ["ltx2", "LTX2TextConnectors"],
    "transformer": ["diffusers", "LTX2VideoTransformer3DModel"],
    "vocoder": ["ltx2", "LTX2Vocoder"],
}
#: longserve's call defaults (diffusers ignores the file): 9 frames at 24 fps, 64 x 96, a few steps
GENERATION_DEFAULTS = {"height": 64, "width": 96, "num_frames": 9, "num_inference_steps": 4,
                       "guidance_scale": 3.0, "fps": 24}

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()"


def build_tokenizer():
    """A Gemma tokenizer: specials, the 256 byte-fallback pieces, "▁" and single characters; no merges."""
    from transformers import GemmaTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    pieces = specials + [f"<0x{i:02X}>" for i in range(256)] + ["▁"] + list(CHARS)
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = GemmaTokenizerFast(vocab=vocab, merges=[], model_max_length=MAX_SEQUENCE_LENGTH, padding_side="left")
    return tok


def build_text_encoder(vocab_size: int, seed: int = SEED + 1):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = Gemma3Config(text_config={**GEMMA3_TEXT_CONFIG, "vocab_size": vocab_size}, vision_config=SIGLIP_CONFIG,
                       mm_tokens_per_image=4, image_token_index=vocab_size - 1, boi_token_index=vocab_size - 2,
                       eoi_token_index=vocab_size - 3)
    return reinit_(Gemma3ForConditionalGeneration(cfg).eval(), seed)


def build_transformer(seed: int = SEED + 2, **overrides):
    from diffusers import LTX2VideoTransformer3DModel

    return reinit_(LTX2VideoTransformer3DModel(**{**TRANSFORMER_CONFIG, **overrides}).eval(), seed)


def build_vae(seed: int = SEED + 3):
    from diffusers import AutoencoderKLLTX2Video

    return reinit_(AutoencoderKLLTX2Video(**VAE_CONFIG).eval(), seed)


def build_audio_vae(seed: int = SEED + 4):
    from diffusers import AutoencoderKLLTX2Audio

    return reinit_(AutoencoderKLLTX2Audio(**AUDIO_VAE_CONFIG).eval(), seed)


def build_vocoder(seed: int = SEED + 5):
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    return reinit_(LTX2Vocoder(**VOCODER_CONFIG).eval(), seed)


def build_connectors(seed: int = SEED + 6):
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    return reinit_(LTX2TextConnectors(**CONNECTORS_CONFIG).eval(), seed)


def build_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    torch.manual_seed(SEED)
    tokenizer = build_tokenizer()
    return LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), vae=build_vae(), audio_vae=build_audio_vae(),
        text_encoder=build_text_encoder(len(tokenizer)), tokenizer=tokenizer, connectors=build_connectors(),
        transformer=build_transformer(), vocoder=build_vocoder())


def write_tiny_ltx2(out_dir: Path) -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - cosmetic only
        pass
    build_pipeline().save_pretrained(str(out_dir), safe_serialization=True)
    index_path = out_dir / "model_index.json"
    saved = json.loads(index_path.read_text())
    index = {k: saved[k] for k in ("_class_name", "_diffusers_version")}
    for key in MODEL_INDEX:
        index[key] = saved[key] if saved.get(key, [None])[0] is not None else None
    index.update({k: MODEL_INDEX[k] for k in ("tokenizer",)})
    index_path.write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")
    (out_dir / GENERATION_DEFAULTS_FILE).write_text(json.dumps(GENERATION_DEFAULTS, indent=2) + "\n")


#: tiny-ltx2-i2v: the same components (links to tiny-ltx2's) under an `LTX2ImageToVideoPipeline` index
I2V_SOURCE = "tiny-ltx2"
I2V_LINKED = ("audio_vae", "connectors", "scheduler", "text_encoder", "tokenizer", "transformer", "vae", "vocoder")


def write_tiny_ltx2_i2v(out_dir: Path) -> None:
    import os

    source = TINY_MODELS[I2V_SOURCE]
    index = json.loads((source / "model_index.json").read_text())
    index["_class_name"] = "LTX2ImageToVideoPipeline"
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out_dir / GENERATION_DEFAULTS_FILE).write_text(json.dumps(GENERATION_DEFAULTS, indent=2) + "\n")
    for name in I2V_LINKED:
        os.symlink(f"../{I2V_SOURCE}/{name}", out_dir / name, target_is_directory=True)
    for path in (out_dir / "model_index.json", out_dir / GENERATION_DEFAULTS_FILE):
        path.chmod(0o644)
    out_dir.chmod(0o755)


#: tiny-ltx2-upsample: tiny-ltx2's components (links) and a latent upsampler of its own (2x spatial)
UPSAMPLER_CONFIG = dict(in_channels=VIDEO_LATENT_CHANNELS, mid_channels=32, num_blocks_per_stage=1, dims=3,
                        spatial_upsample=True, temporal_upsample=False)


def write_tiny_ltx2_upsample(out_dir: Path) -> None:
    import os

    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel

    source = TINY_MODELS[I2V_SOURCE]
    (out_dir / "model_index.json").write_text((source / "model_index.json").read_text())
    (out_dir / GENERATION_DEFAULTS_FILE).write_text(json.dumps(GENERATION_DEFAULTS, indent=2) + "\n")
    for name in I2V_LINKED:
        os.symlink(f"../{I2V_SOURCE}/{name}", out_dir / name, target_is_directory=True)
    torch.manual_seed(SEED)
    upsampler = reinit_(LTX2LatentUpsamplerModel(**UPSAMPLER_CONFIG).eval(), SEED + 7)
    upsampler.save_pretrained(str(out_dir / "latent_upsampler"), safe_serialization=True)
    for path in out_dir.rglob("*"):
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
    out_dir.chmod(0o755)


def build(out: str | Path | None = None, kind: str = "t2v") -> Path:
    if kind == "i2v":
        return write_whole(TINY_MODELS["tiny-ltx2-i2v"] if out is None else out, write_tiny_ltx2_i2v,
                           resolve=False, normalise=False)
    if kind == "upsample":
        return write_whole(TINY_MODELS["tiny-ltx2-upsample"] if out is None else out, write_tiny_ltx2_upsample,
                           resolve=False, normalise=False)
    return write_whole(TINY_MODELS["tiny-ltx2"] if out is None else out, write_tiny_ltx2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.weights.build_tiny_ltx2", description=__doc__.split("\n")[0])
    ap.add_argument("--kind", choices=("t2v", "i2v", "upsample"), default="t2v",
                    help="t2v: weights/tiny-ltx2; i2v: weights/tiny-ltx2-i2v (links to tiny-ltx2's components); "
                         "upsample: weights/tiny-ltx2-upsample (the links and a latent upsampler)")
    ap.add_argument("--out", default=None, help="output directory (default: the shipped one)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    report(build(args.out, args.kind), time.perf_counter() - t0, kind=f"ltx2-{args.kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
