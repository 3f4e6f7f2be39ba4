"""Build the tiny, randomly initialised SANA-Video checkpoints shipped as ``weights/tiny-sana-video`` (text to
video, a ``SanaVideoPipeline`` directory) and ``weights/tiny-sana-video-i2v`` (image to video, a
``SanaImageToVideoPipeline`` directory).

Usage::

    python -m tools.weights.build_tiny_sana_video                      # (re)writes both
    python -m tools.weights.build_tiny_sana_video --kind i2v --out DIR

model_index.json names the published SANA-Video 2B components (``Gemma2Model`` + ``GemmaTokenizerFast``,
``SanaVideoTransformer3DModel``, the Wan 2.1 ``AutoencoderKLWan``, ``DPMSolverMultistepScheduler`` with flow
sigmas for text to video, ``FlowMatchEulerDiscreteScheduler`` for image to video), each at toy sizes:

* transformer: 3 heads x 12 (inner dim 36; 3 divides by neither 2 nor 4; rope axes 4/4/4), 2 blocks of linear
  self-attention (ReLU kernels, RoPE on the numerator) + softmax cross-attention (3 heads x 12) + the GLUMB
  temporal-conv FFN (mlp ratio 2.5), the published patch 1x2x2, in/out 8 channels (= the VAE's z_dim), caption
  channels 32 (= Gemma's hidden size).
* vae: tiny-wan's ``AutoencoderKLWan`` (z_dim 8, 8x spatial, 4x temporal), drawn by tools/weights/build_tiny_wan.
* text_encoder: ``Gemma2Model``, hidden 32, 2 layers, 4 heads (2 KV heads) of 8; tokenizer: tiny-ltx2's Gemma
  tokenizer (characters and byte fallback, no merges). The pipeline pads every prompt to its 300 tokens (plus the
  complex human instruction's, which it prepends to the prompt).
* generation_defaults.json: 96 x 128 (6 x 8 latent tokens after the 2x2 patch: 48 a frame), 9 frames (3 latent
  frames, 144 tokens), 4 steps, guidance 6 (the pipeline's default).

Every tensor is drawn from generators seeded per component, so the same library versions give byte-identical files.
The weights are meaningless.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tools.weights.build_tiny_ltx2 import build_tokenizer
from tools.weights.build_tiny_wan import build_vae, save_pipeline
from tools.weights.seeded import redraw_
from tools.weights.writing import build_kind, kinds_main

SEED = 0
LATENT_CHANNELS = 8            # tiny-wan's VAE z_dim
MODEL_INDEX = {
    "_class_name": "SanaVideoPipeline",
    "scheduler": ["diffusers", "DPMSolverMultistepScheduler"],
    "text_encoder": ["transformers", "Gemma2Model"],
    "tokenizer": ["transformers", "GemmaTokenizerFast"],
    "transformer": ["diffusers", "SanaVideoTransformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLWan"],
}
I2V_MODEL_INDEX = {**MODEL_INDEX, "_class_name": "SanaImageToVideoPipeline",
                   "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
GEMMA2_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, max_position_embeddings=4096, sliding_window=4096,
                     pad_token_id=0, eos_token_id=1, bos_token_id=2)
TRANSFORMER = dict(in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_attention_heads=3,
                   attention_head_dim=12, num_layers=2, num_cross_attention_heads=3, cross_attention_head_dim=12,
                   cross_attention_dim=36, caption_channels=GEMMA2_CONFIG["hidden_size"], mlp_ratio=2.5,
                   patch_size=(1, 2, 2), sample_size=30, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024)
#: the published text-to-video sampler: DPM-Solver++ on flow sigmas (shift 8)
T2V_SCHEDULER = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
                     flow_shift=8.0, solver_order=2, algorithm_type="dpmsolver++", final_sigmas_type="zero")
I2V_SCHEDULER = dict(num_train_timesteps=1000, shift=8.0)
GENERATION_DEFAULTS = {"height": 96, "width": 128, "num_frames": 9, "num_inference_steps": 4, "guidance_scale": 6.0,
                       "fps": 16}


def build_text_encoder(vocab_size: int, seed: int = SEED + 1):
    from transformers import Gemma2Config, Gemma2Model

    return redraw_(Gemma2Model(Gemma2Config(vocab_size=vocab_size, **GEMMA2_CONFIG)).eval(), seed)


def build_transformer(seed: int = SEED + 2, **overrides):
    from diffusers import SanaVideoTransformer3DModel

    return redraw_(SanaVideoTransformer3DModel(**{**TRANSFORMER, **overrides}).eval(), seed)


def components() -> dict:
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = 4096         # the instruction and the prompt's 300 tokens, unwarned
    return dict(tokenizer=tokenizer, text_encoder=build_text_encoder(len(tokenizer)),
                transformer=build_transformer(), vae=build_vae())


def write_tiny_sana_video(out_dir: Path) -> None:
    from diffusers import DPMSolverMultistepScheduler, SanaVideoPipeline

    torch.manual_seed(SEED)
    pipe = SanaVideoPipeline(**components(), scheduler=DPMSolverMultistepScheduler(**T2V_SCHEDULER))
    save_pipeline(pipe, out_dir, MODEL_INDEX, generation_defaults=GENERATION_DEFAULTS)


def write_tiny_sana_video_i2v(out_dir: Path) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaImageToVideoPipeline

    torch.manual_seed(SEED)
    pipe = SanaImageToVideoPipeline(**components(), scheduler=FlowMatchEulerDiscreteScheduler(**I2V_SCHEDULER))
    save_pipeline(pipe, out_dir, I2V_MODEL_INDEX, generation_defaults=GENERATION_DEFAULTS)


WRITERS = {"t2v": ("tiny-sana-video", write_tiny_sana_video),
           "i2v": ("tiny-sana-video-i2v", write_tiny_sana_video_i2v)}


def build(kind: str = "t2v", out: str | Path | None = None) -> Path:
    return build_kind(WRITERS, kind, out)


def main(argv: list[str] | None = None) -> int:
    return kinds_main("python -m tools.weights.build_tiny_sana_video", __doc__.split("\n")[0], WRITERS, build, argv)


if __name__ == "__main__":
    raise SystemExit(main())
