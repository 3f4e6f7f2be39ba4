"""Deterministic random `LatteTransformer3DModel`s for tests (same seed -> same weights in every process)."""

import torch
from diffusers import LatteTransformer3DModel


def tiny_latte_transformer(heads=3, head_dim=8, layers=2, video_length=13, caption_channels=16, seed=0):
    torch.manual_seed(seed)
    model = LatteTransformer3DModel(
        num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4, out_channels=8,
        num_layers=layers, sample_size=8, patch_size=2, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False,
        norm_eps=1e-6, attention_bias=True, caption_channels=caption_channels,
        cross_attention_dim=heads * head_dim, video_length=video_length,
    )
    # diffusers zero-initialises nothing we rely on, but make every weight matter and the
    # output unit-scale, so that a wrong shard or a missing term shows up as a big error.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            fan_in = param.shape[-1] if param.ndim > 1 else 1
            std = 0.3 if param.ndim == 1 else 1.0 / fan_in ** 0.5
            param.copy_(torch.randn(param.shape, generator=g) * std)
    return model.eval()


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

    from weights.build_tiny_latte import build_scheduler, build_vae
    from weights.latte import LATTE_1_TRANSFORMER_CONFIG, TINY_LATTE_DIR

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
