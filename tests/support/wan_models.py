"""Test-only Wan-family checkpoints with a published model's transformer config but few layers.

Each builder writes a diffusers-format pipeline directory whose transformer has the real
config (hidden size, heads, head dim, text_dim, ffn, patch, norms, ...) exactly, except
``num_layers`` (1 by default) and seeded random weights; a tiny Wan VAE with the real z_dim
16 and latents_mean/std (so the transformer's in/out channels are the real 16); a one-layer
UMT5 encoder as wide as umt5-xxl's d_model (4096, what the transformer's text_dim sees) but
tiny otherwise; tiny-wan's tokenizer; and the published scheduler config and model_index
settings (e.g. Wan 2.2's boundary_ratio).

Sizes (fp32, one layer): a 1.3B-shaped transformer (1536 wide) is ~72M parameters, ~290 MB;
a 14B-shaped one (5120 wide) is ~570M, ~2.3 GB, too slow to write and load in a unit test.
The 14B configs are tested as data (meta-device parameter counts) and through
``narrow(config, heads)``, which keeps everything but the head count and ffn width.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tools.weights.build_tiny_wan import (
    build_scheduler,
    build_text_encoder,
    build_vae,
    build_wan_tokenizer,
    save_pipeline,
)
from tools.weights.seeded import redraw_
from tools.weights.wan import (
    SKYREELS_V2_DF_1_3B_540P_TRANSFORMER,
    SKYREELS_V2_DF_MODEL_INDEX,
    SKYREELS_V2_SCHEDULER,
    SKYREELS_V2_T2V_14B_540P_TRANSFORMER,
    SKYREELS_V2_T2V_MODEL_INDEX,
    UMT5_XXL_ENCODER,
    WAN_2_1_T2V_1_3B_TRANSFORMER,
    WAN_2_1_T2V_MODEL_INDEX,
    WAN_2_1_T2V_SCHEDULER,
    WAN_2_1_VAE,
    WAN_2_2_T2V_A14B_BOUNDARY_RATIO,
    WAN_2_2_T2V_A14B_MODEL_INDEX,
    WAN_2_2_T2V_A14B_SCHEDULER,
    WAN_2_2_T2V_A14B_TRANSFORMER,
    init_kwargs,
)

# One layer, 2 heads x 8, d_ff 16: only d_model is umt5-xxl's.
WIDE_UMT5 = dict(d_model=UMT5_XXL_ENCODER["d_model"], d_kv=8, num_heads=2, d_ff=16, num_layers=1)


def narrow(config: dict[str, Any], heads: int) -> dict[str, Any]:
    """``config`` with ``heads`` attention heads (same head_dim) and the ffn scaled to match."""
    ratio = heads / config["num_attention_heads"]
    return {**config, "num_attention_heads": heads, "ffn_dim": round(config["ffn_dim"] * ratio)}


def _transformer(cls, config: dict[str, Any], layers: int, seed: int):
    torch.manual_seed(seed)  # default inits only; redraw_ overwrites every parameter
    model = cls(**{**init_kwargs(config), "num_layers": layers}).eval()
    return redraw_(model, seed)


def _shared_components() -> dict[str, Any]:
    tokenizer, _ = build_wan_tokenizer()
    return dict(
        tokenizer=tokenizer,
        text_encoder=build_text_encoder(**WIDE_UMT5),
        vae=build_vae(z_dim=WAN_2_1_VAE["z_dim"], latents_mean=WAN_2_1_VAE["latents_mean"],
                      latents_std=WAN_2_1_VAE["latents_std"]),
    )


def build_wan21_checkpoint(path, config: dict[str, Any] = WAN_2_1_T2V_1_3B_TRANSFORMER, layers: int = 1,
                           seed: int = 0) -> Path:
    """A Wan 2.1 T2V ``WanPipeline`` (default: the 1.3B's transformer config) with ``layers`` blocks."""
    from diffusers import WanPipeline, WanTransformer3DModel

    pipe = WanPipeline(transformer=_transformer(WanTransformer3DModel, config, layers, seed),
                       scheduler=build_scheduler(WAN_2_1_T2V_SCHEDULER), **_shared_components())
    save_pipeline(pipe, Path(path), WAN_2_1_T2V_MODEL_INDEX)
    return Path(path)


def build_wan22_checkpoint(path, layers: int = 1, config: dict[str, Any] = WAN_2_2_T2V_A14B_TRANSFORMER,
                           seed: int = 0) -> Path:
    """A Wan 2.2 T2V A14B ``WanPipeline``: high-noise ``transformer`` and low-noise ``transformer_2``
    (same config, different seeds) and the published boundary_ratio. The default config is the
    real 5120-wide one (~1.1 GB per expert at one layer); pass ``narrow(config, heads)`` for speed."""
    from diffusers import WanPipeline, WanTransformer3DModel

    pipe = WanPipeline(
        transformer=_transformer(WanTransformer3DModel, config, layers, seed),
        transformer_2=_transformer(WanTransformer3DModel, config, layers, seed + 1000),
        boundary_ratio=WAN_2_2_T2V_A14B_BOUNDARY_RATIO,
        scheduler=build_scheduler(WAN_2_2_T2V_A14B_SCHEDULER), **_shared_components(),
    )
    save_pipeline(pipe, Path(path), WAN_2_2_T2V_A14B_MODEL_INDEX)
    return Path(path)


def build_skyreels_v2_checkpoint(path, kind: str = "df", layers: int = 1, config: dict[str, Any] | None = None,
                                 seed: int = 0) -> Path:
    """A SkyReels-V2 pipeline: ``kind="t2v"`` is ``SkyReelsV2Pipeline`` with the T2V 14B 540P
    transformer config, ``kind="df"`` is ``SkyReelsV2DiffusionForcingPipeline`` with the DF 1.3B
    540P one (fps embedding included); ``config`` overrides the transformer config."""
    from diffusers import SkyReelsV2DiffusionForcingPipeline, SkyReelsV2Pipeline, SkyReelsV2Transformer3DModel

    kinds = {
        "t2v": (SkyReelsV2Pipeline, SKYREELS_V2_T2V_14B_540P_TRANSFORMER, SKYREELS_V2_T2V_MODEL_INDEX),
        "df": (SkyReelsV2DiffusionForcingPipeline, SKYREELS_V2_DF_1_3B_540P_TRANSFORMER, SKYREELS_V2_DF_MODEL_INDEX),
    }
    if kind not in kinds:
        raise ValueError(f"kind must be 't2v' or 'df', got {kind!r}")
    pipeline_cls, default_config, model_index = kinds[kind]
    transformer = _transformer(SkyReelsV2Transformer3DModel, config or default_config, layers, seed)
    pipe = pipeline_cls(transformer=transformer, scheduler=build_scheduler(SKYREELS_V2_SCHEDULER),
                        **_shared_components())
    save_pipeline(pipe, Path(path), model_index)
    return Path(path)
