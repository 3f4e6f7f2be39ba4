"""Seeded random models for benchmarks and tests (same seed -> same weights in every process).

Not shipped checkpoints (those live in `weights/`): these exist so a benchmark or a test can
build a model of a given shape, with weights that make every term visible in the output.
"""

from __future__ import annotations


def random_latte_transformer(heads: int, head_dim: int, layers: int, video_length: int, sample_size: int,
                             caption_channels: int, seed: int = 0):
    """A Latte-1-structured `LatteTransformer3DModel` with seeded random weights (same seed, same
    weights in every process), for tests and benchmarks.

    Every parameter is redrawn (std 1/sqrt(fan_in) for matrices, 0.3 for vectors) so the output
    is unit-scale and depends on every weight: a wrong shard or a lost term shows as a large error.
    """
    import torch
    from diffusers import LatteTransformer3DModel

    torch.manual_seed(seed)
    model = LatteTransformer3DModel(
        num_attention_heads=heads, attention_head_dim=head_dim, in_channels=4, out_channels=8,
        num_layers=layers, sample_size=sample_size, patch_size=2, activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False,
        norm_eps=1e-6, attention_bias=True, caption_channels=caption_channels,
        cross_attention_dim=heads * head_dim, video_length=video_length,
    )
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            fan_in = param.shape[-1] if param.ndim > 1 else 1
            std = 0.3 if param.ndim == 1 else 1.0 / fan_in ** 0.5
            param.copy_(torch.randn(param.shape, generator=g) * std)
    return model.eval()


def random_wan_transformer(heads: int = 3, head_dim: int = 12, layers: int = 2, text_dim: int = 16,
                           in_channels: int = 4, ffn_dim: int | None = None, skyreels: bool = False,
                           frames_per_block: int = 1, inject_sample_info: bool = False, seed: int = 0, **config):
    """A `WanTransformer3DModel` (or, `skyreels=True`, a `SkyReelsV2Transformer3DModel`) of the given
    shape with seeded random weights, every parameter redrawn so that the output is unit-scale and
    depends on every weight (diffusers zero-initialises some)."""
    import torch
    from diffusers import SkyReelsV2Transformer3DModel, WanTransformer3DModel

    torch.manual_seed(seed)
    kwargs = dict(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
                  in_channels=in_channels, out_channels=in_channels, text_dim=text_dim, freq_dim=32,
                  ffn_dim=ffn_dim or 4 * heads * head_dim, num_layers=layers, cross_attn_norm=True,
                  rope_max_seq_len=1024, **config)
    if skyreels:
        model = SkyReelsV2Transformer3DModel(**kwargs, num_frame_per_block=frames_per_block,
                                             inject_sample_info=inject_sample_info)
    else:
        model = WanTransformer3DModel(**kwargs)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            std = 0.3 if param.ndim == 1 else param.shape[-1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=g) * std)
    return model.eval()


def random_wan_vae(base_dim: int = 8, z_dim: int = 4, dim_mult: tuple[int, ...] = (1, 2, 2, 2), num_res_blocks: int = 1,
                   patch_size: int | None = None, seed: int = 0):
    """A Wan-structured `AutoencoderKLWan` with seeded random weights (same seed, same weights in every
    process), for tests and benchmarks.

    Wan 2.1's structure at a small width: 4 resolution levels (8x spatial compression), temporal
    downsampling [False, True, True] (4x in time, so latent frame 0 decodes to 1 frame and every later
    one to 4), causal 3D convolutions with per-conv caches, an attention block in the middle. With
    `patch_size=2` it is Wan 2.2's residual variant instead (16x spatial, output unpatchified).
    `latents_mean`/`latents_std` are the first `z_dim` entries of diffusers' Wan 2.1 defaults.
    PyTorch's default initialisation is kept: it already gives a unit-scale, mostly unclamped output.
    """
    import inspect

    import torch
    from diffusers import AutoencoderKLWan

    defaults = inspect.signature(AutoencoderKLWan.__init__).parameters
    residual = patch_size is not None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLWan(
            base_dim=base_dim, z_dim=z_dim, dim_mult=list(dim_mult), num_res_blocks=num_res_blocks,
            temperal_downsample=[False, True, True], is_residual=residual, patch_size=patch_size,
            in_channels=3 * (patch_size or 1) ** 2, out_channels=3 * (patch_size or 1) ** 2,
            scale_factor_spatial=8 * (patch_size or 1),
            latents_mean=list(defaults["latents_mean"].default[:z_dim]),
            latents_std=list(defaults["latents_std"].default[:z_dim]),
        )
    return vae.eval()


#: checkpoints `longserve bench speed --model NAME` builds: tiny-wan's text encoder, VAE and scheduler around a
#: transformer of a published model's shape (random weights; in/out channels and text width are tiny-wan's)
SHAPED_CHECKPOINTS = {
    "wan-1.3b-shaped": dict(heads=12, head_dim=128, layers=30, ffn_dim=8960),       # Wan 2.1 T2V 1.3B
}


def shaped_checkpoint(name: str, root: str | None = None):
    """The directory of a `SHAPED_CHECKPOINTS` model, built once (seeded: the same weights every time) under
    `root` (default: the system's temporary directory). Wan 1.3B's shape is 5.7 GB of float32 weights."""
    import json
    import os
    import shutil
    import tempfile
    from pathlib import Path

    from longserve.weights import resolve_model

    dest = Path(root or tempfile.gettempdir()) / f"longserve-{name}"
    if (dest / "model_index.json").is_file():
        return dest
    base = resolve_model("tiny-wan")
    cfg = json.loads((base / "transformer" / "config.json").read_text())
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        shutil.copytree(base, work, dirs_exist_ok=True, ignore=shutil.ignore_patterns("transformer"))
        model = random_wan_transformer(text_dim=cfg["text_dim"], in_channels=cfg["in_channels"],
                                       **SHAPED_CHECKPOINTS[name])
        model.save_pretrained(work / "transformer")
        os.replace(work, dest)          # whole or not at all
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest
