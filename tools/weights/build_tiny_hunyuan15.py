"""Build the tiny, randomly initialised HunyuanVideo-1.5 checkpoints shipped as ``weights/tiny-hunyuan15`` (text to
video) and ``weights/tiny-hunyuan15-i2v`` (image to video).

Usage::

    python -m tools.weights.build_tiny_hunyuan15                      # (re)writes both
    python -m tools.weights.build_tiny_hunyuan15 --kind i2v --out DIR

A complete diffusers ``HunyuanVideo15Pipeline`` directory, loadable by diffusers' own ``HunyuanVideo15Pipeline``
and ``HunyuanVideo15ImageToVideoPipeline`` (its transformer has the image projection both read). model_index.json
names the published components (``Qwen2_5_VLTextModel`` + ``Qwen2Tokenizer``, ``T5EncoderModel`` +
``ByT5Tokenizer``, ``HunyuanVideo15Transformer3DModel``, ``AutoencoderKLHunyuanVideo15``,
``FlowMatchEulerDiscreteScheduler``, ``ClassifierFreeGuidance``), each at toy sizes:

* transformer: 3 heads x 12 (inner dim 36; 3 divides by neither 2 nor 4; rope axes 4/4/4), 2 dual-stream
  blocks, 1 refiner block, mlp ratio 2, patch 1x1x1, in 2*4+1 channels (latents, condition latents, mask),
  out 4, text dims 32 (Qwen) and 24 (ByT5), image_embed_dim 8. diffusers fixes the ByT5 projection's
  hidden width at 2048 (a 2048 x 2048 matrix): those three tensors are drawn as random signs times
  1/sqrt(fan_in), so git's zlib packs their 17 MB to a few hundred KB; every other weight is ``redraw_``n.
* vae: ``AutoencoderKLHunyuanVideo15`` with the published 16x spatial, 4x temporal compression, but
  block_out_channels (8, 8, 8, 8, 8), one layer per block, 4 latent channels.
* text_encoder: ``Qwen2_5_VLTextModel`` with hidden 32, 3 layers (the pipeline reads hidden_states[-3]),
  4 heads (2 KV heads) of 8 with M-RoPE sections 2/1/1 (of 4 frequencies), vocabulary 260; tokenizer: a
  byte-level ``Qwen2Tokenizer`` (256 byte tokens, no merges, ChatML's special tokens and a ChatML chat
  template, which the pipeline applies).
* text_encoder_2: ``T5EncoderModel`` in ByT5's layout (gated-gelu) with d_model 24, 3 heads of 8, 2 layers,
  vocabulary 384 (= ``ByT5Tokenizer``'s: bytes + 3 specials + 125 extra ids; ByT5's tokenizer has no file).
* scheduler: ``FlowMatchEulerDiscreteScheduler(shift=5.0)`` (the 480p T2V setting); guider:
  ``ClassifierFreeGuidance(guidance_scale=6.0)``.
* tiny-hunyuan15-i2v: a ``HunyuanVideo15ImageToVideoPipeline`` directory with the same components (the
  transformer's task_type "i2v") plus ``SiglipVisionModel`` (hidden 8 = the transformer's image_embed_dim, 2
  heads, 1 layer, 28 x 28 images in patches of 4: 49 tokens) and its ``SiglipImageProcessor`` (28 x 28).
* generation_defaults.json: 80 x 112, 9 frames (105 tokens: odd, and not a multiple of 2 or 4), 4 steps.

Every tensor is drawn from generators seeded per component, so the same library versions give byte-identical
files. The weights are meaningless.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tools.weights.build_tiny_wan import save_pipeline
from tools.weights.seeded import redraw_
from tools.weights.writing import build_kind, kinds_main

SEED = 0
LATENT_CHANNELS = 4
MODEL_INDEX = {
    "_class_name": "HunyuanVideo15Pipeline",
    "guider": ["diffusers", "ClassifierFreeGuidance"],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "tokenizer_2": ["transformers", "ByT5Tokenizer"],
    "transformer": ["diffusers", "HunyuanVideo15Transformer3DModel"],
    "vae": ["diffusers", "AutoencoderKLHunyuanVideo15"],
}
QWEN_CONFIG = dict(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   bos_token_id=256, eos_token_id=258, pad_token_id=256,
                   rope_parameters={"rope_theta": 1000000.0, "rope_type": "default", "mrope_section": [2, 1, 1]})
BYT5_CONFIG = dict(vocab_size=384, d_model=24, d_kv=8, d_ff=48, num_layers=2, num_heads=3,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128,
                   feed_forward_proj="gated-gelu", tie_word_embeddings=False, is_encoder_decoder=False,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
TRANSFORMER = dict(in_channels=2 * LATENT_CHANNELS + 1, out_channels=LATENT_CHANNELS, num_attention_heads=3,
                   attention_head_dim=12, num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1,
                   patch_size_t=1, qk_norm="rms_norm", text_embed_dim=QWEN_CONFIG["hidden_size"],
                   text_embed_2_dim=BYT5_CONFIG["d_model"], image_embed_dim=8, rope_theta=256.0,
                   rope_axes_dim=(4, 4, 4), target_size=96, task_type="t2v", use_meanflow=False)
VAE = dict(in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8, 8),
           layers_per_block=1, spatial_compression_ratio=16, temporal_compression_ratio=4, scaling_factor=1.03682)
SCHEDULER = dict(num_train_timesteps=1000, shift=5.0)
GUIDANCE_SCALE = 6.0
GENERATION_DEFAULTS = {"height": 80, "width": 112, "num_frames": 9, "num_inference_steps": 4,
                       "guidance_scale": GUIDANCE_SCALE, "fps": 24}
#: ChatML, as Qwen2.5's chat template writes a conversation (system, user, then the assistant's turn)
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_char(b: int) -> str:
    """The character byte-level BPE (GPT-2's, Qwen's) writes byte `b` as: printable Latin-1 bytes stand for
    themselves, the others are moved to code points 256 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if x not in printable))


def build_tokenizer():
    """A byte-level BPE ``Qwen2Tokenizer`` with no merges: one token per UTF-8 byte, ids 0-255 in GPT-2's byte
    order, then the three ChatML specials (256-258)."""
    from transformers import Qwen2Tokenizer

    vocab = {byte_char(b): b for b in range(256)}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token="<|endoftext|>",
                               pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 32768
    return tokenizer


def build_text_encoder(seed: int = SEED + 1):
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    return redraw_(Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**QWEN_CONFIG)).eval(), seed)


def build_text_encoder_2(seed: int = SEED + 2):
    from transformers import T5Config, T5EncoderModel

    return redraw_(T5EncoderModel(T5Config(**BYT5_CONFIG)).eval(), seed)


def build_transformer(seed: int = SEED + 3, **overrides):
    from diffusers import HunyuanVideo15Transformer3DModel

    model = redraw_(HunyuanVideo15Transformer3DModel(**{**TRANSFORMER, **overrides}).eval(), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():           # the ByT5 projection's 2048 wide layers: random signs (see the docstring)
        for name, p in sorted(model.context_embedder_2.named_parameters()):
            if name != "norm.weight" and name != "norm.bias":
                signs = torch.randint(0, 2, p.shape, generator=gen).float() * 2 - 1
                p.copy_(signs / (p.shape[-1] ** 0.5 if p.dim() == 2 else 20.0))
    return model


def build_vae(seed: int = SEED + 4):
    from diffusers import AutoencoderKLHunyuanVideo15

    return redraw_(AutoencoderKLHunyuanVideo15(**VAE).eval(), seed)


def build_pipeline(**transformer_overrides):
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline
    from transformers import ByT5Tokenizer

    torch.manual_seed(SEED)
    return HunyuanVideo15Pipeline(
        text_encoder=build_text_encoder(), tokenizer=build_tokenizer(),
        transformer=build_transformer(**transformer_overrides),
        vae=build_vae(), scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        text_encoder_2=build_text_encoder_2(), tokenizer_2=ByT5Tokenizer(),
        guider=ClassifierFreeGuidance(guidance_scale=GUIDANCE_SCALE))


def write_tiny_hunyuan15(out_dir: Path) -> None:
    save_pipeline(build_pipeline(), out_dir, MODEL_INDEX, generation_defaults=GENERATION_DEFAULTS)


I2V_MODEL_INDEX = {**MODEL_INDEX, "_class_name": "HunyuanVideo15ImageToVideoPipeline",
                   "image_encoder": ["transformers", "SiglipVisionModel"],
                   "feature_extractor": ["transformers", "SiglipImageProcessor"]}
SIGLIP_CONFIG = dict(hidden_size=TRANSFORMER["image_embed_dim"], intermediate_size=16, num_hidden_layers=1,
                     num_attention_heads=2, num_channels=3, image_size=28, patch_size=4)


def build_image_encoder(seed: int = SEED + 5):
    from transformers import SiglipVisionConfig, SiglipVisionModel

    return redraw_(SiglipVisionModel(SiglipVisionConfig(**SIGLIP_CONFIG)).eval(), seed)


def write_tiny_hunyuan15_i2v(out_dir: Path) -> None:
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipImageProcessorPil

    t2v = build_pipeline(task_type="i2v")
    size = SIGLIP_CONFIG["image_size"]
    pipe = HunyuanVideo15ImageToVideoPipeline(
        **{k: v for k, v in t2v.components.items()}, image_encoder=build_image_encoder(),
        feature_extractor=SiglipImageProcessorPil(size={"height": size, "width": size}))
    save_pipeline(pipe, out_dir, I2V_MODEL_INDEX, generation_defaults=GENERATION_DEFAULTS)


WRITERS = {"t2v": ("tiny-hunyuan15", write_tiny_hunyuan15), "i2v": ("tiny-hunyuan15-i2v", write_tiny_hunyuan15_i2v)}


def build(kind: str = "t2v", out: str | Path | None = None) -> Path:
    return build_kind(WRITERS, kind, out)


def main(argv: list[str] | None = None) -> int:
    return kinds_main("python -m tools.weights.build_tiny_hunyuan15", __doc__.split("\n")[0], WRITERS, build, argv)

if __name__ == "__main__":
    raise SystemExit(main())
