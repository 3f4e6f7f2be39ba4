"""Wan 2.2 TI2V-5B: one checkpoint, text-to-video and image-to-video, with a timestep per latent token.

A `WanPipeline` directory whose model_index.json says `expand_timesteps: true`. diffusers runs it two ways:
`WanPipeline` without an image, and `WanImageToVideoPipeline` (loaded from the same directory) with one. Both
give the transformer a timestep per token, (B, S) with S = f x (h / 2) x (w / 2) tokens, instead of one per
row; the image enters as the first latent frame, not as extra channels:

    diffusers' __call__ (expand_timesteps)                  here
    encode_prompt (UMT5)                                    rank 0, broadcast (as text-to-video)
    image: preprocess + prepare_latents: VAE-encode the     rank 0, by the pipeline's own prepare_latents, with
      image alone -> condition (B, z, 1, h, w), and the       placeholder latents (it draws nothing then);
      first_frame_mask (1, 1, f, h, w), 0 on frame 0          broadcast with the prompt
    no image: mask = ones(latents.shape)                    a mask of ones (the same timesteps, bit for bit)
    randn latents from the generator                        every rank, from the request's seed
    per step: x = (1 - mask) condition + mask latents;      `inputs`: the same expressions per request; the
      timestep = (mask[0, 0][:, ::2, ::2] * t).flatten()     first frame's tokens get timestep 0 with an image
      expanded to (B, S)
    the transformer (per-token modulation (B, S, 6, D))     sharded: each rank gets its own tokens' timesteps
                                                              (engine/models/wan.py), so it builds (B, Sl, 6, D)
    scheduler.step on all latents; at the end               `advance` / `final_latents`: the same blend
      latents = (1 - mask) condition + mask latents
    vae.decode (the Wan 2.2 VAE: 16x, patchified)            the Wan family's streaming decode across workers
                                                              (engine/causal_vae.py unpatchifies as diffusers)

The workers load the checkpoint into `WanImageToVideoPipeline` (its image encoder and processor are absent and
stay None), whose `prepare_latents` makes the image's condition; without an image nothing of it is used, and
what remains (`encode_prompt`, the transformer, the VAE, the scheduler) is the same modules `WanPipeline`
would hold.

Batching: requests with and without an image share steps when their latent shapes agree. Both feed the
transformer the same inputs, a latent (B, z, f, h, w) and per-token timesteps (B, S); the image only changes
their values (its frame in the latent, 0 in its tokens' timesteps), so each row carries its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from longserve.engine.config import OPTIONAL, REFUSED, ModelDescription
from longserve.engine.families.base import cfg_rows, read_json
from longserve.engine.families.wan_i2v import WanI2VRequest, WanImageToVideoFamily
from longserve.engine.images import to_pil
from longserve.engine.request import GenerationSpec


@dataclass
class WanTI2VRequest(WanI2VRequest):
    mask: torch.Tensor = None           # (1, 1, f, h, w): diffusers' first_frame_mask with an image, else None
    token_mask: torch.Tensor = None     # (S,): the mask at each token (its patch's top-left latent pixel)


class WanTI2VFamily(WanImageToVideoFamily):
    """Wan 2.2 TI2V-5B (`expand_timesteps`): the Wan family's forward, experts, plans and decode; an image is
    optional and becomes the first latent frame, with per-token timesteps."""

    name = "wan-ti2v"
    #: diffusers' `__call__` defaults of both pipelines that load the checkpoint (the same numbers), and the
    #: 24 fps Wan 2.2 TI2V-5B was trained at
    pipeline_defaults = {
        cls: {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50, "guidance_scale": 5.0,
              "fps": 24}
        for cls in ("WanPipeline", "WanImageToVideoPipeline")
    }
    pipeline_classes = frozenset()      # claimed by expand_timesteps (the plain Wan family serves WanPipeline)
    request_class = WanTI2VRequest
    rank0_components = ("text_encoder", "tokenizer")
    expand_timesteps = True
    last_image_refusal = ("last_image is not supported by Wan 2.2 TI2V: it conditions on a first frame only "
                          "(diffusers' WanImageToVideoPipeline ignores last_image with expand_timesteps)")

    @classmethod
    def claims(cls, model_dir: Path) -> bool:
        index_path = Path(model_dir) / "model_index.json"
        if not index_path.is_file():
            return False
        try:
            index = read_json(index_path)
        except ValueError:
            return False
        return bool(index.get("expand_timesteps")) and index.get("_class_name") in cls.pipeline_defaults

    @classmethod
    def describe(cls, model_dir: Path) -> ModelDescription:
        desc = super().describe(model_dir)
        return dataclasses.replace(desc, capabilities=dataclasses.replace(desc.capabilities, image=OPTIONAL,
                                                                          last_image=REFUSED))

    # -- worker side -----------------------------------------------------------------------------------

    def pipeline_class(self, desc: ModelDescription) -> str:
        """`WanImageToVideoPipeline` whatever the index names: its `prepare_latents` encodes the image."""
        return "WanImageToVideoPipeline"

    def encode_conditions(self, spec: GenerationSpec) -> dict[str, torch.Tensor]:
        """Rank 0: the image's latent (B, z, 1, h, w) and diffusers' first-frame mask, by `prepare_latents`."""
        if spec.options.get("image") is None:
            return {}
        pipe, device = self.pipe, self.pg.device
        pixels = pipe.video_processor.preprocess(to_pil(spec.options["image"]), height=spec.height, width=spec.width)
        pixels = pixels.to(device, dtype=torch.float32)                                     # (1, 3, H, W)
        frames = (spec.num_frames - 1) // self.vae_temporal + 1
        placeholder = torch.zeros(self.latent_shape(spec, frames), device=device)         # the noise is drawn later
        _, condition, mask = pipe.prepare_latents(pixels, spec.batch_size, pipe.vae.config.z_dim, spec.height,
                                                  spec.width, spec.num_frames, torch.float32, device, None,
                                                  placeholder)
        return {"condition": condition, "mask": mask}               # (B, z, 1, h, w), (1, 1, f, h, w)

    def prepare(self, spec: GenerationSpec, text: torch.Tensor, condition: torch.Tensor = None,
                mask: torch.Tensor = None) -> WanTI2VRequest:
        req = super().prepare(spec, text, condition)
        if mask is not None:
            req.mask = mask.to(torch.float32)
        # WanPipeline's mask without an image: ones like the latents (only its [0, 0] is read)
        full = req.mask if req.mask is not None else torch.ones(req.latents.shape[2:], device=req.latents.device)
        _, p_h, p_w = self.pipe.transformer.config.patch_size      # diffusers writes ::2 (the patch of every Wan)
        req.token_mask = full.reshape(full.shape[-3:])[:, ::p_h, ::p_w].flatten()                 # (S,)
        return req

    def inputs(self, r: WanTI2VRequest) -> dict:
        t = r.scheduler.timesteps[r.steps_done]
        x = r.latents if r.mask is None else (1 - r.mask) * r.condition + r.mask * r.latents       # (B, z, f, h, w)
        x = cfg_rows(r, x).to(self.dtype)
        timesteps = (r.token_mask * t).unsqueeze(0).expand(x.shape[0], -1)                       # (rows, S)
        return {"x": x, "t": timesteps, "text": r.text}

    def final_latents(self, r: WanTI2VRequest) -> torch.Tensor:
        """The image's latent back in frame 0, as the pipeline blends it before decoding (or returning latents)."""
        if r.mask is None:
            return r.latents
        return (1 - r.mask) * r.condition + r.mask * r.latents


FAMILY = WanTI2VFamily
