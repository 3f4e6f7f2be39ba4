"""Deterministic random `LatteTransformer3DModel`s for tests (same seed -> same weights in every process)."""

import torch
from diffusers import LatteTransformer3DModel

from tools.bench.models import random_latte_transformer


def tiny_latte_transformer(heads=3, head_dim=8, layers=2, video_length=13, caption_channels=16, seed=0):
    return random_latte_transformer(heads, head_dim, layers, video_length=video_length, sample_size=8,
                                    caption_channels=caption_channels, seed=seed)


def latte_inputs(batch, frames, grid_h, grid_w, text_len=5, caption_channels=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, frames, 2 * grid_h, 2 * grid_w, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    enc = torch.randn(batch, text_len, caption_channels, generator=g)
    return x, t, enc


def build_latte1_shaped_checkpoint(path):
    """A Latte-format pipeline with Latte-1's exact transformer config but one block pair and random
    weights (~53M parameters), a T5 encoder of T5-XXL's width (4096, what the caption projection sees)
    but otherwise tiny, and tiny-latte's VAE, tokenizer and scheduler."""
    from diffusers import LattePipeline
    from transformers import T5Config, T5EncoderModel, T5Tokenizer

    from longserve.weights.latte import LATTE_1_TRANSFORMER_CONFIG, TINY_LATTE_DIR
    from tools.weights.build_tiny_latte import build_scheduler, build_vae

    torch.manual_seed(0)
    transformer = LatteTransformer3DModel(**{**LATTE_1_TRANSFORMER_CONFIG, "num_layers": 1}).eval()
    text_encoder = T5EncoderModel(
        T5Config(vocab_size=256, d_model=4096, d_kv=8, num_heads=2, d_ff=16, num_layers=1,
                 feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
                 pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    ).eval()
    tokenizer = T5Tokenizer.from_pretrained(TINY_LATTE_DIR / "tokenizer")
    assert len(tokenizer) == text_encoder.config.vocab_size
    pipe = LattePipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=build_vae(),
                         transformer=transformer, scheduler=build_scheduler())
    pipe.save_pretrained(path)
    return path
