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
