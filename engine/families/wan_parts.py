"""What every family on Wan's architecture shares (Wan T2V/I2V/TI2V, diffusion forcing, Helios, causal Wan): UMT5
prompts encoded on rank 0 and the Wan VAE's factors and its streaming decode (the sequence-parallel groups of a plan
are every family's: `VideoFamily.set_plan`). `WanParts` is a complete mixin: a family takes it whole beside
`VideoFamily` and switches nothing off; what differs between these families (their transformers' sharded forwards,
their loops) stays in each family's module.
"""

from __future__ import annotations

import torch

from longserve.engine.decoding import WanVAEDecoder
from longserve.engine.request import GenerationSpec

MAX_SEQUENCE_LENGTH = 512            # the prompt length the Wan pipelines pad UMT5's output to


def vae_factors(vae_config: dict) -> tuple[int, int]:
    """(spatial, temporal) compression of an `AutoencoderKLWan` config."""
    down = vae_config.get("temperal_downsample", [False, True, True])
    spatial = vae_config.get("scale_factor_spatial") or 2 ** len(down)
    temporal = vae_config.get("scale_factor_temporal") or 2 ** sum(down)
    return spatial, temporal


class WanParts:
    """Mixed into a `VideoFamily` whose `pipe` holds Wan's text encoder (rank 0), VAE and scheduler."""

    def refuse_xformers(self, config) -> None:
        if config.engine.attention == "xformers":
            raise ValueError(f"attention='xformers' is not available for the {self.name} family (it uses PyTorch "
                             f"SDPA)")

    def component_dtypes(self) -> dict:
        """The VAE in float32 (diffusers' Wan examples load it so) unless `vae_dtype` says otherwise; the rest in
        `dtype`."""
        from longserve.engine.dist import parse_dtype

        vae = self.config.engine.vae_dtype
        return {"default": self.dtype, "vae": parse_dtype(vae) if vae else torch.float32}

    def encode_prompt(self, spec: GenerationSpec):
        """UMT5 embeddings, zero-padded to 512 tokens as the pipelines do (rank 0 only)."""
        return self.pipe.encode_prompt(prompt=spec.prompt, negative_prompt=spec.negative_prompts(),
                                       do_classifier_free_guidance=spec.use_cfg, num_videos_per_prompt=1,
                                       max_sequence_length=MAX_SEQUENCE_LENGTH, device=self.pg.device)

    def vae_decoder(self, spec: GenerationSpec, latents: torch.Tensor) -> WanVAEDecoder:
        """The Wan VAE's streaming decode across the workers (diffusers' tiles with `vae_tiling`)."""
        return WanVAEDecoder(self.pipe, self.pg, latents, self.vae_tiling, spec.output, split=self.vae_split)
