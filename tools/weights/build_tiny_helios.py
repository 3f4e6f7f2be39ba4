"""Build the tiny, randomly initialised Helios checkpoints shipped as ``weights/tiny-helios`` (``HeliosPipeline``)
and ``weights/tiny-helios-distilled`` (``HeliosPyramidPipeline`` with the distilled DMD scheduler).

Usage::

    python -m tools.weights.build_tiny_helios                                  # (re)writes both shipped dirs
    python -m tools.weights.build_tiny_helios --kind distilled --out DIR       # writes DIR instead

A complete diffusers ``HeliosPipeline`` directory whose model_index.json names the published Helios
components (``T5TokenizerFast``, ``UMT5EncoderModel``, ``HeliosTransformer3DModel``, ``AutoencoderKLWan``,
``HeliosScheduler``). It shares tiny-wan's text encoder, tokenizer and VAE builders (same seeds, so the same
weights: 8x spatial and 4x temporal compression, z_dim 8) and adds:

* transformer: ``HeliosTransformer3DModel`` with diffusers' default (published) structure: the multi-term
  memory patches (short, mid at 2x, long at 4x), guidance cross-attention (the prompt reaches the current
  chunk's tokens only), zero timestep for the history, per-head history key amplification turned on so that
  path is exercised. Toy sizes: 3 heads x 12 (odd on purpose: 2 and 4 workers divide neither), rope split
  4 / 4 / 4, 2 blocks, ffn 64, text_dim 32 (the tiny UMT5's width), in/out channels 8 (the VAE's z_dim).
* scheduler: ``HeliosScheduler`` as diffusers' tiny Helios pipeline sets it: one stage, UniPC (bh2, order 2),
  flow prediction, no shift.
* generation_defaults.json: 64 x 64, 66 frames (2 chunks of 9 latent frames = 33 frames each, cut to
  65), 4 steps a chunk, guidance 5.0, fps 24, history [16, 2, 1] (the published one).

``tiny-helios-distilled`` is the same components (the same weights) in Helios-Distilled's layout: a
``HeliosPyramidPipeline`` with ``is_distilled: true``, ``is_cfg_zero_star: false`` and a ``HeliosDMDScheduler``
of three stages (diffusers' defaults but gamma 0.25: with the default 1/3 the block-noise covariance
(1 + gamma) I - gamma J of a 2x2 patch is singular, and diffusers' own `sample_block_noise` fails its Cholesky
factorisation on a CPU); generation_defaults 64 x 64 (the lowest stage is 4x smaller: one patch),
stages of [2, 2, 2] steps, guidance 1.0 (a distilled model runs without CFG).

Every parameter is redrawn from a generator seeded per component, so the same library versions give
byte-identical files. The weights are meaningless.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tools.weights.build_tiny_wan import (
    SEED,
    TINY_Z_DIM,
    UMT5_CONFIG,
    build_text_encoder,
    build_vae,
    build_wan_tokenizer,
    save_pipeline,
)
from tools.weights.seeded import redraw_
from tools.weights.writing import build_kind, kinds_main

HELIOS_MODEL_INDEX = {
    "_class_name": "HeliosPipeline",
    "scheduler": ["diffusers", "HeliosScheduler"],
    "text_encoder": ["transformers", "UMT5EncoderModel"],
    "tokenizer": ["transformers", "T5TokenizerFast"],
    "transformer": ["diffusers", "HeliosTransformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLWan"],
}
HELIOS_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, stages=1, stage_range=[0, 1 / 3, 2 / 3, 1],
                        gamma=1 / 3, thresholding=False, prediction_type="flow_prediction", solver_order=2,
                        predict_x0=True, solver_type="bh2", lower_order_final=True, disable_corrector=[],
                        solver_p=None, use_flow_sigmas=True, scheduler_type="unipc", use_dynamic_shifting=False,
                        time_shift_type="exponential")
HELIOS_TRANSFORMER = dict(
    patch_size=[1, 2, 2], num_attention_heads=3, attention_head_dim=12, in_channels=TINY_Z_DIM,
    out_channels=TINY_Z_DIM, text_dim=UMT5_CONFIG["d_model"], freq_dim=256, ffn_dim=64, num_layers=2,
    cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, added_kv_proj_dim=None, rope_dim=[4, 4, 4],
    rope_theta=10000.0, guidance_cross_attn=True, zero_history_timestep=True, has_multi_term_memory_patch=True,
    is_amplify_history=True, history_scale_mode="per_head",
)
HELIOS_GENERATION_DEFAULTS = {
    "height": 64, "width": 64, "num_frames": 66, "num_inference_steps": 4, "guidance_scale": 5.0, "fps": 24,
    "history_sizes": [16, 2, 1], "num_latent_frames_per_chunk": 9,
}


def build_helios_transformer(seed: int = SEED + 5, **overrides):
    from diffusers import HeliosTransformer3DModel

    model = HeliosTransformer3DModel(**{**HELIOS_TRANSFORMER, **overrides}).eval()
    return redraw_(model, seed)


def write_tiny_helios(out_dir: Path) -> None:
    from diffusers import HeliosPipeline, HeliosScheduler

    torch.manual_seed(SEED)
    tokenizer, spiece_model = build_wan_tokenizer()
    pipe = HeliosPipeline(tokenizer=tokenizer, text_encoder=build_text_encoder(), vae=build_vae(),
                          transformer=build_helios_transformer(), scheduler=HeliosScheduler(**HELIOS_SCHEDULER))
    save_pipeline(pipe, out_dir, HELIOS_MODEL_INDEX, spiece_model, HELIOS_GENERATION_DEFAULTS)


HELIOS_DISTILLED_MODEL_INDEX = {**HELIOS_MODEL_INDEX, "_class_name": "HeliosPyramidPipeline",
                                "scheduler": ["diffusers", "HeliosDMDScheduler"], "is_distilled": True,
                                "is_cfg_zero_star": False}
HELIOS_DISTILLED_GENERATION_DEFAULTS = {
    "height": 64, "width": 64, "num_frames": 66, "guidance_scale": 1.0, "fps": 24, "history_sizes": [16, 2, 1],
    "num_latent_frames_per_chunk": 9, "pyramid_num_inference_steps_list": [2, 2, 2], "num_inference_steps": 6,
}


def write_tiny_helios_distilled(out_dir: Path) -> None:
    from diffusers import HeliosDMDScheduler, HeliosPyramidPipeline

    torch.manual_seed(SEED)
    tokenizer, spiece_model = build_wan_tokenizer()
    pipe = HeliosPyramidPipeline(tokenizer=tokenizer, text_encoder=build_text_encoder(), vae=build_vae(),
                                 transformer=build_helios_transformer(), scheduler=HeliosDMDScheduler(gamma=0.25),
                                 is_distilled=True, is_cfg_zero_star=False)
    save_pipeline(pipe, out_dir, HELIOS_DISTILLED_MODEL_INDEX, spiece_model, HELIOS_DISTILLED_GENERATION_DEFAULTS)


WRITERS = {"helios": ("tiny-helios", write_tiny_helios), "distilled": ("tiny-helios-distilled",
                                                                       write_tiny_helios_distilled)}


def build(kind: str = "helios", out: str | Path | None = None) -> Path:
    return build_kind(WRITERS, kind, out)


def main(argv: list[str] | None = None) -> int:
    return kinds_main("python -m tools.weights.build_tiny_helios", __doc__.split("\n")[0], WRITERS, build, argv)

if __name__ == "__main__":
    raise SystemExit(main())
