"""Build the tiny, randomly initialised Wan-family checkpoints shipped as ``weights/tiny-wan`` and
``weights/tiny-skyreels-df``.

Usage::

    python -m tools.weights.build_tiny_wan                                  # (re)writes weights/tiny-wan/
    python -m tools.weights.build_tiny_wan --kind skyreels-df --out DIR     # the random DF sibling, written to DIR

The shipped ``tiny-skyreels-df`` is trained (``python -m tools.weights.train_tiny_skyreels_df``, weights/README.md):
this builder writes its random sibling only where ``--out`` says, never over the shipped one.

``tiny-wan`` is a complete diffusers ``WanPipeline`` directory in Wan 2.1 T2V format and
``tiny-skyreels-df`` a ``SkyReelsV2DiffusionForcingPipeline`` directory in SkyReels-V2 DF 1.3B
format: model_index.json names the same component classes as the published checkpoints
(``T5TokenizerFast``, ``UMT5EncoderModel``, ``WanTransformer3DModel`` /
``SkyReelsV2Transformer3DModel``, ``AutoencoderKLWan``, ``UniPCMultistepScheduler``), the
scheduler has the published settings, and every model keeps its real structure at toy sizes:

* transformer: 3 heads x 12 (inner dim 36; 3 is odd on purpose, so head counts divide by
  neither 2 nor 4; 12 splits into the rope's t/h/w parts as 4/4/4), 2 blocks, ffn 64,
  freq_dim 256, patch (1, 2, 2), qk_norm "rms_norm_across_heads", cross_attn_norm, text_dim 32
  (= the text encoder's d_model), in/out channels 8 (= the VAE's z_dim). The DF transformer
  also has the fps embedding (inject_sample_info, as SkyReels-V2-DF-1.3B) and
  num_frame_per_block 1.
* vae: ``AutoencoderKLWan`` with Wan 2.1's structure (dim_mult of length 4,
  temperal_downsample [False, True, True]: 8x spatial, 4x temporal compression; attention in
  the middle blocks) but base_dim 4, one residual block per level, z_dim 8, and latents_mean /
  latents_std = the first 8 of Wan 2.1's 16, so the pipelines' de-normalisation is exercised.
* text_encoder: ``UMT5EncoderModel`` (gated-gelu, per-layer relative attention bias, untied
  embeddings, as umt5-xxl) with d_model 32, 4 heads x 8, d_ff 64, 2 layers, vocab 256.
* tokenizer: tiny-latte's 256-id T5 sentencepiece vocabulary (``build_tiny_latte.build_tokenizer``)
  with model_max_length 512, the length Wan pipelines pad prompts to.
* scheduler: ``UniPCMultistepScheduler`` with the published flow-prediction settings
  (weights.wan.WAN_2_1_T2V_SCHEDULER / SKYREELS_V2_SCHEDULER); any step count works.
* generation_defaults.json: small default call arguments for longserve (ignored by diffusers).

Every parameter is redrawn from a generator seeded per component (``weights.seeded.redraw_``: ``reinit_``
plus gains around 1 for the VAE's RMS norms), so the same library versions give byte-identical
files and the output is O(1) and depends on every weight. The weights are meaningless.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from longserve.weights.registry import GENERATION_DEFAULTS_FILE, TINY_MODELS
from tools.weights.build_tiny_latte import build_tokenizer
from tools.weights.seeded import redraw_
from tools.weights.wan import (
    MAX_SEQUENCE_LENGTH,
    SKYREELS_V2_DF_1_3B_540P_TRANSFORMER,
    SKYREELS_V2_DF_MODEL_INDEX,
    SKYREELS_V2_SCHEDULER,
    UMT5_XXL_ENCODER,
    WAN_2_1_T2V_1_3B_TRANSFORMER,
    WAN_2_1_T2V_MODEL_INDEX,
    WAN_2_1_T2V_SCHEDULER,
    WAN_2_1_VAE,
    init_kwargs,
)
from tools.weights.writing import report, write_whole

SEED = 0
KINDS = ("wan", "skyreels-df")
DEFAULT_OUT = {"wan": TINY_MODELS["tiny-wan"]}   # tiny-skyreels-df is trained: its random build needs an --out

# --- text encoder ----------------------------------------------------------------------------
UMT5_CONFIG = dict(
    vocab_size=256,  # == the tiny tokenizer's ids
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=UMT5_XXL_ENCODER["relative_attention_num_buckets"],
    relative_attention_max_distance=UMT5_XXL_ENCODER["relative_attention_max_distance"],
    feed_forward_proj=UMT5_XXL_ENCODER["feed_forward_proj"],
    tie_word_embeddings=False,
    dropout_rate=0.0,
    layer_norm_epsilon=1e-6,
    use_cache=False,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)

# --- vae -------------------------------------------------------------------------------------
TINY_Z_DIM = 8
VAE_CONFIG = dict(
    init_kwargs(WAN_2_1_VAE),
    base_dim=4,  # channels 4 / 8 / 16 / 16 (Wan 2.1: 96 / 192 / 384 / 384)
    num_res_blocks=1,
    z_dim=TINY_Z_DIM,
    latents_mean=WAN_2_1_VAE["latents_mean"][:TINY_Z_DIM],
    latents_std=WAN_2_1_VAE["latents_std"][:TINY_Z_DIM],
)

# --- transformers ----------------------------------------------------------------------------
_TINY_TRANSFORMER_SIZES = dict(
    num_attention_heads=3,
    attention_head_dim=12,
    num_layers=2,
    ffn_dim=64,
    text_dim=UMT5_CONFIG["d_model"],
    in_channels=TINY_Z_DIM,
    out_channels=TINY_Z_DIM,
)
WAN_TRANSFORMER_CONFIG = {**init_kwargs(WAN_2_1_T2V_1_3B_TRANSFORMER), **_TINY_TRANSFORMER_SIZES}
SKYREELS_DF_TRANSFORMER_CONFIG = {**init_kwargs(SKYREELS_V2_DF_1_3B_540P_TRANSFORMER), **_TINY_TRANSFORMER_SIZES}

# --- longserve call defaults (generation_defaults.json) ----------------------------------------
WAN_GENERATION_DEFAULTS = {
    "height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 20, "guidance_scale": 5.0, "fps": 16,
}
# 37 frames = 10 latent frames in windows of 5 (base_num_frames 17) that overlap by 3
# (overlap_history 9): 4 segments adding 5, 2, 2 and 1 latent frames. Synchronous diffusion
# forcing (ar_step 0, causal_block_size 1); guidance 6.0 and fps 24 are the DF pipeline's defaults.
SKYREELS_DF_GENERATION_DEFAULTS = {
    "height": 64, "width": 64, "num_frames": 37, "base_num_frames": 17, "overlap_history": 9,
    "ar_step": 0, "causal_block_size": 1, "addnoise_condition": 0,
    "num_inference_steps": 20, "guidance_scale": 6.0, "fps": 24,
}


# ------------------------------------------------------------------------------------------
def build_wan_tokenizer():
    """tiny-latte's T5 vocabulary, padded to the 512 tokens Wan pipelines use."""
    tokenizer, spiece_model = build_tokenizer()
    tokenizer.model_max_length = MAX_SEQUENCE_LENGTH
    return tokenizer, spiece_model


def build_text_encoder(seed: int = SEED + 1, **overrides):
    from transformers import UMT5Config, UMT5EncoderModel

    model = UMT5EncoderModel(UMT5Config(**{**UMT5_CONFIG, **overrides})).eval()
    return redraw_(model, seed)


def build_vae(seed: int = SEED + 3, **overrides):
    from diffusers import AutoencoderKLWan

    model = AutoencoderKLWan(**{**VAE_CONFIG, **overrides}).eval()
    return redraw_(model, seed)


def build_wan_transformer(seed: int = SEED + 2, **overrides):
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(**{**WAN_TRANSFORMER_CONFIG, **overrides}).eval()
    return redraw_(model, seed)


def build_skyreels_transformer(seed: int = SEED + 2, **overrides):
    from diffusers import SkyReelsV2Transformer3DModel

    model = SkyReelsV2Transformer3DModel(**{**SKYREELS_DF_TRANSFORMER_CONFIG, **overrides}).eval()
    return redraw_(model, seed)


def build_scheduler(config: dict[str, Any]):
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(**init_kwargs(config))


def save_pipeline(pipe, out_dir: Path, model_index: dict[str, Any], spiece_model: bytes | None = None,
                  generation_defaults: dict[str, Any] | None = None) -> None:
    """``pipe.save_pretrained`` plus what makes the directory look like the published one.

    The component entries of model_index.json are rewritten to ``model_index``'s (transformers 5
    saves the tokenizer as ``T5Tokenizer``, the Wan checkpoints name ``T5TokenizerFast``, which
    loads the same tokenizer.json) and keys the published file does not have are dropped (the
    Wan 2.1 one predates ``transformer_2`` / ``boundary_ratio`` / ``expand_timesteps``).
    """
    try:  # no "Writing model shards" progress bars in the build log
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - cosmetic only
        pass
    pipe.save_pretrained(str(out_dir), safe_serialization=True)
    index_path = out_dir / "model_index.json"
    saved = json.loads(index_path.read_text())
    index = {k: saved[k] for k in ("_class_name", "_diffusers_version")}
    for key, value in model_index.items():
        if key.startswith("_"):
            continue
        index[key] = list(value) if isinstance(value, (list, tuple)) else saved[key]
    index_path.write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")
    if spiece_model is not None:
        (out_dir / "tokenizer" / "spiece.model").write_bytes(spiece_model)
    if generation_defaults is not None:
        (out_dir / GENERATION_DEFAULTS_FILE).write_text(json.dumps(generation_defaults, indent=2) + "\n")


def write_tiny_wan(out_dir: Path) -> None:
    from diffusers import WanPipeline

    torch.manual_seed(SEED)  # only affects default inits, which redraw_ overwrites anyway
    tokenizer, spiece_model = build_wan_tokenizer()
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=build_text_encoder(), vae=build_vae(),
        transformer=build_wan_transformer(), scheduler=build_scheduler(WAN_2_1_T2V_SCHEDULER),
    )
    save_pipeline(pipe, out_dir, WAN_2_1_T2V_MODEL_INDEX, spiece_model, WAN_GENERATION_DEFAULTS)


def write_tiny_skyreels_df(out_dir: Path) -> None:
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    torch.manual_seed(SEED)
    tokenizer, spiece_model = build_wan_tokenizer()
    pipe = SkyReelsV2DiffusionForcingPipeline(
        tokenizer=tokenizer, text_encoder=build_text_encoder(), vae=build_vae(),
        transformer=build_skyreels_transformer(), scheduler=build_scheduler(SKYREELS_V2_SCHEDULER),
    )
    save_pipeline(pipe, out_dir, SKYREELS_V2_DF_MODEL_INDEX, spiece_model, SKYREELS_DF_GENERATION_DEFAULTS)


WRITERS: dict[str, Callable[[Path], None]] = {"wan": write_tiny_wan, "skyreels-df": write_tiny_skyreels_df}


def build(kind: str, out: str | Path | None = None) -> Path:
    """Build the ``kind`` checkpoint (``"wan"`` or ``"skyreels-df"``) into ``out`` (default: shipped dir)."""
    if kind not in WRITERS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if out is None and kind not in DEFAULT_OUT:
        raise ValueError(f"the shipped {kind} checkpoint is trained (python -m tools.weights.train_tiny_skyreels_df); "
                         f"give an output directory for the random build")
    return write_whole(DEFAULT_OUT[kind] if out is None else out, WRITERS[kind])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.weights.build_tiny_wan", description=__doc__.split("\n")[0])
    ap.add_argument("--kind", choices=KINDS, default="wan", help="which checkpoint (default: wan)")
    ap.add_argument("--out", default=None, help="output directory (default: weights/tiny-wan; needed for skyreels-df)")
    args = ap.parse_args(argv)
    kinds = (args.kind,)
    if args.out is None and args.kind not in DEFAULT_OUT:
        ap.error("tiny-skyreels-df is trained (python -m tools.weights.train_tiny_skyreels_df): "
                 "give --out for the random build")
    for kind in kinds:
        t0 = time.perf_counter()
        report(build(kind, args.out), time.perf_counter() - t0, kind=kind)
    return 0


if __name__ == "__main__":
    sys.exit(main())
