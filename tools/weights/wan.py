"""The Wan family's published configs (Wan 2.1, Wan 2.2, SkyReels-V2), in diffusers format, as data.

Each transformer / VAE dict holds exactly the keys of the published diffusers-format
``config.json`` (``_class_name`` included, the ``_diffusers_version`` stamp left out); pass
:func:`init_kwargs` of it to the model class. Sources are cited next to each value. Where a
value could not be read from the published file itself, the comment says what it rests on.

Nothing here imports torch or diffusers.
"""

from __future__ import annotations

from typing import Any


def init_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments of a config dict: everything but the ``_``-prefixed keys."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


# --- transformers ----------------------------------------------------------------------------
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json (diffusers 0.33.0.dev0). Values as in
# huggingface/diffusers scripts/convert_wan_to_diffusers.py ("Wan-T2V-1.3B") plus the defaults
# that save_pretrained wrote then (image_dim, rope_max_seq_len); serialised the way diffusers
# does (indent 2, sorted keys) with that version stamp, these keys give exactly the 465 bytes
# the Hub lists for the file. 12 heads x 128 = 1536 wide.
WAN_2_1_T2V_1_3B_TRANSFORMER: dict[str, Any] = {
    "_class_name": "WanTransformer3DModel",
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 8960,
    "freq_dim": 256,
    "image_dim": None,
    "in_channels": 16,
    "num_attention_heads": 12,
    "num_layers": 30,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,
}

# Wan-AI/Wan2.1-T2V-14B-Diffusers, transformer/config.json: convert_wan_to_diffusers.py
# ("Wan-T2V-14B"); same key set as the 1.3B (same diffusers version). 40 heads x 128 = 5120.
WAN_2_1_T2V_14B_TRANSFORMER: dict[str, Any] = {
    **WAN_2_1_T2V_1_3B_TRANSFORMER,
    "ffn_dim": 13824,
    "num_attention_heads": 40,
    "num_layers": 40,
}

# Wan-AI/Wan2.2-T2V-A14B-Diffusers, transformer/config.json and transformer_2/config.json
# (identical; read from the Hub page of transformer_2/config.json, diffusers 0.35.0.dev0).
# `transformer` is the high-noise expert, `transformer_2` the low-noise one.
WAN_2_2_T2V_A14B_TRANSFORMER: dict[str, Any] = {
    **WAN_2_1_T2V_14B_TRANSFORMER,
    "pos_embed_seq_len": None,
}

# SkyReels-V2: huggingface/diffusers scripts/convert_skyreelsv2_to_diffusers.py
# ("SkyReels-V2-T2V-14B-540P", "SkyReels-V2-DF-1.3B-540P"); the remaining keys are
# SkyReelsV2Transformer3DModel's defaults, which save_pretrained writes. The published
# config.json files themselves could not be read: the key set is inferred, the values not.
SKYREELS_V2_T2V_14B_540P_TRANSFORMER: dict[str, Any] = {
    "_class_name": "SkyReelsV2Transformer3DModel",
    "added_kv_proj_dim": None,
    "attention_head_dim": 128,
    "cross_attn_norm": True,
    "eps": 1e-06,
    "ffn_dim": 13824,
    "freq_dim": 256,
    "image_dim": None,
    "in_channels": 16,
    "inject_sample_info": False,
    "num_attention_heads": 40,
    "num_frame_per_block": 1,
    "num_layers": 40,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "pos_embed_seq_len": None,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 1024,
    "text_dim": 4096,
}

# The diffusion-forcing 1.3B: Wan 2.1 1.3B's shape plus the fps conditioning
# (inject_sample_info: an fps embedding added to the timestep projection; the DF pipeline
# passes fps=16 as class 0, anything else as class 1). num_frame_per_block is not set by the
# conversion script, so it is the default 1 (frame-level causality); the DF pipeline's
# `causal_block_size` argument overrides it (and writes it into the transformer's config).
SKYREELS_V2_DF_1_3B_540P_TRANSFORMER: dict[str, Any] = {
    **SKYREELS_V2_T2V_14B_540P_TRANSFORMER,
    "ffn_dim": 8960,
    "inject_sample_info": True,
    "num_attention_heads": 12,
    "num_layers": 30,
}

# --- VAE -------------------------------------------------------------------------------------
# The Wan 2.1 VAE, shared by every checkpoint above (Wan 2.2 A14B and SkyReels-V2 convert the
# same Wan2.1_VAE.pth): vae/config.json as published with diffusers 0.33 (read from the Hub
# copy diffusers/Wan2.1-VAE, config.json; the conversion scripts build AutoencoderKLWan() with
# its defaults). Later diffusers versions add keys whose defaults keep this model
# (decoder_base_dim null, in/out_channels 3, is_residual false, patch_size null,
# scale_factor_spatial 8, scale_factor_temporal 4). 8x spatial and 4x temporal compression.
WAN_2_1_VAE: dict[str, Any] = {
    "_class_name": "AutoencoderKLWan",
    "attn_scales": [],
    "base_dim": 96,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "latents_mean": [
        -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
        0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
    ],
    "latents_std": [
        2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
        3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916,
    ],
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
    "z_dim": 16,
}

# --- text encoder ----------------------------------------------------------------------------
# google/umt5-xxl's encoder (UMT5EncoderModel), text_encoder/config.json of the Wan 2.1
# checkpoints (read from a Hub copy of Wan-AI/Wan2.1-T2V-14B-Diffusers' file; vocab_size is
# google/umt5-xxl's). The transformer only sees d_model: its `text_dim` is 4096. Prompts are
# padded to max_sequence_length=512 tokens (the pipelines' default).
UMT5_XXL_ENCODER: dict[str, Any] = {
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "feed_forward_proj": "gated-gelu",
    "num_heads": 64,
    "num_layers": 24,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "tie_word_embeddings": False,
    "vocab_size": 256384,
}
MAX_SEQUENCE_LENGTH = 512

# --- schedulers ------------------------------------------------------------------------------
# UniPC in flow-prediction mode. Wan 2.1 T2V: convert_wan_to_diffusers.py builds
# UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
# num_train_timesteps=1000, flow_shift=3.0) and the published model_index.json names
# UniPCMultistepScheduler; Wan-AI/Wan2.1-VACE-14B-diffusers' published scheduler_config.json
# shows the same flow_shift 3.0 with every other key at UniPC's default. The Wan 2.1 T2V
# scheduler_config.json files themselves could not be read.
WAN_2_1_T2V_SCHEDULER: dict[str, Any] = {
    "_class_name": "UniPCMultistepScheduler",
    "flow_shift": 3.0,
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
}
# Wan 2.2 T2V A14B: the conversion script uses flow_shift 3.0 here too (only FLF2V, TI2V and
# Animate differ), although the official code samples with shift 12.0
# (WAN_2_2_T2V_A14B_SAMPLE_SHIFT). The published file could not be read.
WAN_2_2_T2V_A14B_SCHEDULER: dict[str, Any] = dict(WAN_2_1_T2V_SCHEDULER)
# SkyReels-V2 (T2V and DF): convert_skyreelsv2_to_diffusers.py builds
# UniPCMultistepScheduler(prediction_type="flow_prediction", num_train_timesteps=1000,
# use_flow_sigmas=True), i.e. flow_shift stays at the default 1.0; diffusers' SkyReels-V2 docs
# then set flow_shift=8.0 for T2V/DF (SKYREELS_V2_RECOMMENDED_FLOW_SHIFT). Whether the
# published scheduler_config.json has 1.0 or 8.0 could not be confirmed.
SKYREELS_V2_SCHEDULER: dict[str, Any] = {**WAN_2_1_T2V_SCHEDULER, "flow_shift": 1.0}
SKYREELS_V2_RECOMMENDED_FLOW_SHIFT = 8.0

# --- pipelines -------------------------------------------------------------------------------
# model_index.json of Wan-AI/Wan2.1-T2V-1.3B-Diffusers and -14B-Diffusers (read from the Hub;
# 14B: refs/pr/5, after the scheduler was switched from FlowMatchEulerDiscreteScheduler). They
# predate Wan 2.2: there is no transformer_2 / boundary_ratio / expand_timesteps key at all;
# WanPipeline then takes its defaults (None, None, False). Newer saves spell the same thing
# "transformer_2": [null, null], "boundary_ratio": null, "expand_timesteps": false.
WAN_2_1_T2V_MODEL_INDEX: dict[str, Any] = {
    "_class_name": "WanPipeline",
    "scheduler": ["diffusers", "UniPCMultistepScheduler"],
    "text_encoder": ["transformers", "UMT5EncoderModel"],
    "tokenizer": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "WanTransformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLWan"],
}

# Wan 2.2 T2V A14B: two experts; `transformer` (high noise) runs while the timestep is at or
# above boundary_ratio * num_train_timesteps (875), `transformer_2` (low noise) below it.
# boundary_ratio: convert_wan_to_diffusers.py (WanPipeline(..., boundary_ratio=0.875)) and the
# official Wan-Video/Wan2.2 wan/configs/wan_t2v_A14B.py (boundary = 0.875).
WAN_2_2_T2V_A14B_BOUNDARY_RATIO = 0.875
WAN_2_2_T2V_A14B_MODEL_INDEX: dict[str, Any] = {
    **WAN_2_1_T2V_MODEL_INDEX,
    "boundary_ratio": WAN_2_2_T2V_A14B_BOUNDARY_RATIO,
    "expand_timesteps": False,
    "transformer_2": ["diffusers", "WanTransformer3DModel"],
}
# Official sampling settings, Wan-Video/Wan2.2 wan/configs/wan_t2v_A14B.py:
# sample_guide_scale = (3.0, 4.0) for (low noise, high noise), sample_steps 40, sample_shift 12.
# In WanPipeline terms guidance_scale goes with `transformer` (high noise), guidance_scale_2
# with `transformer_2` (low noise).
WAN_2_2_T2V_A14B_GUIDANCE: dict[str, float] = {"guidance_scale": 4.0, "guidance_scale_2": 3.0}
WAN_2_2_T2V_A14B_SAMPLE_STEPS = 40
WAN_2_2_T2V_A14B_SAMPLE_SHIFT = 12.0

# SkyReels-V2 pipelines (diffusers' SkyReelsV2Pipeline / SkyReelsV2DiffusionForcingPipeline
# with the components the conversion script gives them; tokenizer class as the Wan ones,
# since both are google/umt5-xxl's tokenizer saved by AutoTokenizer).
SKYREELS_V2_T2V_MODEL_INDEX: dict[str, Any] = {
    **WAN_2_1_T2V_MODEL_INDEX,
    "_class_name": "SkyReelsV2Pipeline",
    "transformer": ["diffusers", "SkyReelsV2Transformer3DModel"],
}
SKYREELS_V2_DF_MODEL_INDEX: dict[str, Any] = {
    **SKYREELS_V2_T2V_MODEL_INDEX,
    "_class_name": "SkyReelsV2DiffusionForcingPipeline",
}

#: Published checkpoint (Hub id) -> its configs, for tools that want them by name.
PUBLISHED: dict[str, dict[str, Any]] = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": {
        "model_index": WAN_2_1_T2V_MODEL_INDEX, "transformer": WAN_2_1_T2V_1_3B_TRANSFORMER,
        "vae": WAN_2_1_VAE, "text_encoder": UMT5_XXL_ENCODER, "scheduler": WAN_2_1_T2V_SCHEDULER,
    },
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": {
        "model_index": WAN_2_1_T2V_MODEL_INDEX, "transformer": WAN_2_1_T2V_14B_TRANSFORMER,
        "vae": WAN_2_1_VAE, "text_encoder": UMT5_XXL_ENCODER, "scheduler": WAN_2_1_T2V_SCHEDULER,
    },
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": {
        "model_index": WAN_2_2_T2V_A14B_MODEL_INDEX, "transformer": WAN_2_2_T2V_A14B_TRANSFORMER,
        "transformer_2": WAN_2_2_T2V_A14B_TRANSFORMER, "vae": WAN_2_1_VAE,
        "text_encoder": UMT5_XXL_ENCODER, "scheduler": WAN_2_2_T2V_A14B_SCHEDULER,
    },
    "Skywork/SkyReels-V2-T2V-14B-540P-Diffusers": {
        "model_index": SKYREELS_V2_T2V_MODEL_INDEX, "transformer": SKYREELS_V2_T2V_14B_540P_TRANSFORMER,
        "vae": WAN_2_1_VAE, "text_encoder": UMT5_XXL_ENCODER, "scheduler": SKYREELS_V2_SCHEDULER,
    },
    "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers": {
        "model_index": SKYREELS_V2_DF_MODEL_INDEX, "transformer": SKYREELS_V2_DF_1_3B_540P_TRANSFORMER,
        "vae": WAN_2_1_VAE, "text_encoder": UMT5_XXL_ENCODER, "scheduler": SKYREELS_V2_SCHEDULER,
    },
}

# --- image-to-video (WanImageToVideoPipeline) ---------------------------------------------------
# Wan 2.1 I2V 14B (480P and 720P share it): huggingface/diffusers scripts/convert_wan_to_diffusers.py
# ("Wan-I2V-14B-480p" / "-720p"): the 14B T2V transformer plus the image branch. in_channels 36 = the noisy
# latent (16) + the VAE-encoded condition video (16) + the 4-channel first-frame mask; image_dim 1280 is the
# CLIP ViT-H/14 hidden size (the penultimate layer's tokens, 257 of them); added_kv_proj_dim = the inner dim,
# the image tokens' own K/V projections in every cross-attention. The published config.json files could not
# be read: the keys beyond the script's are the class defaults save_pretrained writes.
WAN_2_1_I2V_14B_TRANSFORMER: dict[str, Any] = {
    **WAN_2_1_T2V_14B_TRANSFORMER,
    "added_kv_proj_dim": 5120,
    "image_dim": 1280,
    "in_channels": 36,
    "pos_embed_seq_len": None,
}
# Wan 2.1 FLF2V 14B 720P (first-last-frame): the same plus a learned position table over the two images'
# 2 x 257 CLIP tokens (the pipeline encodes [image, last_image] and the model views them as one sequence).
WAN_2_1_FLF2V_14B_TRANSFORMER: dict[str, Any] = {
    **WAN_2_1_I2V_14B_TRANSFORMER,
    "pos_embed_seq_len": 2 * 257,
}

# The image encoder: the vision tower of laion/CLIP-ViT-H-14-laion2B-s32B-b79K (what the conversion script
# loads), used as a CLIPVisionModel; WanImageToVideoPipeline.encode_image takes hidden_states[-2].
CLIP_VIT_H_14_VISION: dict[str, Any] = {
    "hidden_act": "gelu",
    "hidden_size": 1280,
    "image_size": 224,
    "intermediate_size": 5120,
    "layer_norm_eps": 1e-05,
    "num_attention_heads": 16,
    "num_channels": 3,
    "num_hidden_layers": 32,
    "patch_size": 14,
    "projection_dim": 1024,
}
# Its CLIPImageProcessor: the shorter side resized to 224 (bicubic), a 224 x 224 centre crop, OpenAI CLIP's
# mean and std.
CLIP_IMAGE_PROCESSOR: dict[str, Any] = {
    "crop_size": {"height": 224, "width": 224},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"shortest_edge": 224},
}

# Schedulers: the conversion script's flow_shift is 3.0 for I2V and 16.0 for FLF2V.
WAN_2_1_I2V_SCHEDULER: dict[str, Any] = dict(WAN_2_1_T2V_SCHEDULER)
WAN_2_1_FLF2V_SCHEDULER: dict[str, Any] = {**WAN_2_1_T2V_SCHEDULER, "flow_shift": 16.0}

# model_index.json: WanImageToVideoPipeline with the CLIP image encoder and processor (the component names
# and classes of WanImageToVideoPipeline.__init__ as the conversion script fills them).
WAN_2_1_I2V_MODEL_INDEX: dict[str, Any] = {
    **WAN_2_1_T2V_MODEL_INDEX,
    "_class_name": "WanImageToVideoPipeline",
    "image_encoder": ["transformers", "CLIPVisionModel"],
    "image_processor": ["transformers", "CLIPImageProcessor"],
}

PUBLISHED.update({
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": {
        "model_index": WAN_2_1_I2V_MODEL_INDEX, "transformer": WAN_2_1_I2V_14B_TRANSFORMER, "vae": WAN_2_1_VAE,
        "text_encoder": UMT5_XXL_ENCODER, "image_encoder": CLIP_VIT_H_14_VISION,
        "image_processor": CLIP_IMAGE_PROCESSOR, "scheduler": WAN_2_1_I2V_SCHEDULER,
    },
    "Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers": {
        "model_index": WAN_2_1_I2V_MODEL_INDEX, "transformer": WAN_2_1_FLF2V_14B_TRANSFORMER, "vae": WAN_2_1_VAE,
        "text_encoder": UMT5_XXL_ENCODER, "image_encoder": CLIP_VIT_H_14_VISION,
        "image_processor": CLIP_IMAGE_PROCESSOR, "scheduler": WAN_2_1_FLF2V_SCHEDULER,
    },
})

# --- Wan 2.2 TI2V-5B (text and image to video, one checkpoint) ----------------------------------------
# huggingface/diffusers scripts/convert_wan_to_diffusers.py ("Wan2.2-TI2V-5B"): 24 heads x 128 = 3072 wide, 30
# blocks, in/out channels 48 (= the Wan 2.2 VAE's z_dim), no image branch; the keys beyond the script's are
# the class defaults save_pretrained writes (as for the A14B, whose key set is read from the Hub).
WAN_2_2_TI2V_5B_TRANSFORMER: dict[str, Any] = {
    **WAN_2_2_T2V_A14B_TRANSFORMER,
    "ffn_dim": 14336,
    "in_channels": 48,
    "num_attention_heads": 24,
    "num_layers": 30,
    "out_channels": 48,
}

# The Wan 2.2 VAE (Wan2.2_VAE.pth; the script's `vae22_diffusers_config`): a residual encoder/decoder on 2x2
# patchified pixels (12 channels in and out), a wider decoder (decoder_base_dim 256 against base_dim 160),
# 16x spatial and 4x temporal compression into z_dim 48. The script's dict also carries "clip_output": False,
# which AutoencoderKLWan (diffusers 0.42) no longer takes; it is left out here.
WAN_2_2_VAE: dict[str, Any] = {
    **WAN_2_1_VAE,
    "base_dim": 160,
    "decoder_base_dim": 256,
    "in_channels": 12,
    "is_residual": True,
    "latents_mean": [
        -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
        0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
        -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
        -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
    ],
    "latents_std": [
        0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
        0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
        0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
        0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
    ],
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_spatial": 16,
    "scale_factor_temporal": 4,
    "z_dim": 48,
}

# The script builds WanPipeline(..., expand_timesteps=True) (transformer_2 and boundary_ratio unset) with
# flow_shift 5.0 (TI2V and Animate). diffusers loads the same directory into WanImageToVideoPipeline for
# image-to-video: its image_encoder and image_processor are optional and stay None.
WAN_2_2_TI2V_5B_SCHEDULER: dict[str, Any] = {**WAN_2_1_T2V_SCHEDULER, "flow_shift": 5.0}
WAN_2_2_TI2V_5B_MODEL_INDEX: dict[str, Any] = {
    **WAN_2_1_T2V_MODEL_INDEX,
    "boundary_ratio": None,
    "expand_timesteps": True,
    "transformer_2": [None, None],
}
# Official settings (Wan-Video/Wan2.2 wan/configs/wan_ti2v_5B.py): 24 fps, 121 frames at 1280x704 or 704x1280,
# 50 steps, guidance 5.0, sample_shift 5.0.
WAN_2_2_TI2V_5B_FPS = 24

# --- Wan 2.2 I2V A14B: two experts, no image encoder ---------------------------------------------
# convert_wan_to_diffusers.py ("Wan2.2-I2V-14B-720p"): the A14B's 14B transformer with in_channels 36 (noisy
# latent 16 + condition 16 + the 4-channel first-frame mask) and no CLIP branch (image_dim None), high- and
# low-noise stages as `transformer` / `transformer_2`, WanImageToVideoPipeline(..., boundary_ratio=0.9) with
# flow_shift 3.0 and no image_encoder / image_processor.
WAN_2_2_I2V_A14B_TRANSFORMER: dict[str, Any] = {**WAN_2_2_T2V_A14B_TRANSFORMER, "in_channels": 36}
WAN_2_2_I2V_A14B_BOUNDARY_RATIO = 0.9
WAN_2_2_I2V_A14B_SCHEDULER: dict[str, Any] = dict(WAN_2_1_T2V_SCHEDULER)
WAN_2_2_I2V_A14B_MODEL_INDEX: dict[str, Any] = {
    **WAN_2_1_T2V_MODEL_INDEX,
    "_class_name": "WanImageToVideoPipeline",
    "boundary_ratio": WAN_2_2_I2V_A14B_BOUNDARY_RATIO,
    "expand_timesteps": False,
    "image_encoder": [None, None],
    "image_processor": [None, None],
    "transformer_2": ["diffusers", "WanTransformer3DModel"],
}

# --- SkyReels-V2 I2V (SkyReelsV2ImageToVideoPipeline) ---------------------------------------------
# huggingface/diffusers scripts/convert_skyreelsv2_to_diffusers.py ("SkyReels-V2-I2V-14B-540P"): the T2V 14B
# transformer with Wan 2.1 I2V's image branch (in_channels 36, image_dim 1280, added_kv_proj_dim 5120), the
# laion CLIP ViT-H/14 as CLIPVisionModelWithProjection (the pipeline reads hidden_states[-2], as Wan's), the
# SkyReels scheduler (flow_shift 1.0; diffusers' example sets 5.0 for I2V). The script passes
# `AutoProcessor.from_pretrained(laion/CLIP-ViT-H-14)` as image_processor, a CLIPProcessor (image processor +
# CLIP tokenizer) of which the pipeline calls only the image half (`image_processor(images=...)`).
SKYREELS_V2_I2V_14B_540P_TRANSFORMER: dict[str, Any] = {
    **SKYREELS_V2_T2V_14B_540P_TRANSFORMER,
    "added_kv_proj_dim": 5120,
    "image_dim": 1280,
    "in_channels": 36,
}
SKYREELS_V2_I2V_MODEL_INDEX: dict[str, Any] = {
    **SKYREELS_V2_T2V_MODEL_INDEX,
    "_class_name": "SkyReelsV2ImageToVideoPipeline",
    "image_encoder": ["transformers", "CLIPVisionModelWithProjection"],
    "image_processor": ["transformers", "CLIPProcessor"],
}
SKYREELS_V2_I2V_RECOMMENDED_FLOW_SHIFT = 5.0

PUBLISHED.update({
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": {
        "model_index": WAN_2_2_TI2V_5B_MODEL_INDEX, "transformer": WAN_2_2_TI2V_5B_TRANSFORMER, "vae": WAN_2_2_VAE,
        "text_encoder": UMT5_XXL_ENCODER, "scheduler": WAN_2_2_TI2V_5B_SCHEDULER,
    },
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": {
        "model_index": WAN_2_2_I2V_A14B_MODEL_INDEX, "transformer": WAN_2_2_I2V_A14B_TRANSFORMER,
        "transformer_2": WAN_2_2_I2V_A14B_TRANSFORMER, "vae": WAN_2_1_VAE, "text_encoder": UMT5_XXL_ENCODER,
        "scheduler": WAN_2_2_I2V_A14B_SCHEDULER,
    },
    "Skywork/SkyReels-V2-I2V-14B-540P-Diffusers": {
        "model_index": SKYREELS_V2_I2V_MODEL_INDEX, "transformer": SKYREELS_V2_I2V_14B_540P_TRANSFORMER,
        "vae": WAN_2_1_VAE, "text_encoder": UMT5_XXL_ENCODER, "image_encoder": CLIP_VIT_H_14_VISION,
        "image_processor": CLIP_IMAGE_PROCESSOR, "scheduler": SKYREELS_V2_SCHEDULER,
    },
})
