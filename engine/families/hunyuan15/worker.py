"""HunyuanVideo-1.5's worker parts: the encoder (the prompts and the image as diffusers' pipeline encodes them, on
rank 0) and the loop (latents and the condition channels, the rows of one forward); the engine's generic step runs
them (engine/families/composed.py).

Image-to-video (rank 0 encodes, as for the prompts, and broadcasts): the image, resized and centre-cropped to the
request's size (`video_processor.resize(..., resize_mode="crop")`, diffusers' rule), gives its SigLIP tokens as the
transformer's `image_embeds` and its VAE latent as the first latent frame of the condition channels, with a mask of
ones there (`prepare_cond_latents_and_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from longserve.engine.config import REQUIRED
from longserve.engine.decoding import FramesPolicy
from longserve.engine.families.base import WorkerRequest, cfg_rows, scheduler_step_kwargs, seeded_generator
from longserve.engine.families.composed import DenoisingLoop
from longserve.engine.images import to_pil
from longserve.engine.request import GenerationSpec

#: the condition tensors of one forward row, by the transformer's argument names
CONDITIONS = ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2",
              "encoder_attention_mask_2")


@dataclass
class Hunyuan15Request(WorkerRequest):
    conditions: dict = field(default_factory=dict)   # CONDITIONS' tensors, [negative; positive] rows under CFG
    condition: torch.Tensor = None     # (B, C + 1, f, h, w): the image's latent frame and its mask (image-to-video)
    image_embeds: torch.Tensor = None  # (B, T, C_img): the image's SigLIP tokens (image-to-video)


def latent_shape(pipe, spec: GenerationSpec) -> tuple:
    return (spec.batch_size, pipe.num_channels_latents, (spec.num_frames - 1) // pipe.vae_scale_factor_temporal + 1,
            spec.height // pipe.vae_scale_factor_spatial, spec.width // pipe.vae_scale_factor_spatial)


class Hunyuan15Encoder:
    """Rank 0's encodings, by the pipeline's own methods."""

    components = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "image_encoder", "feature_extractor")

    def __init__(self, worker):
        self.w = worker
        self.i2v = worker.desc.capabilities.image == REQUIRED
        self._conditions = None

    def prompt(self, spec: GenerationSpec):
        """Qwen2.5-VL's prompt embeddings, as the pipeline makes them; the pipeline's other condition tensors (the
        Qwen mask, ByT5's embeddings and mask) wait for `conditions`."""
        pipe, dtype, device = self.w.pipe, self.w.dtype, self.w.pg.device
        positive = pipe.encode_prompt(prompt=spec.prompt, device=device, dtype=dtype, batch_size=spec.batch_size)
        negative = pipe.encode_prompt(prompt=spec.negative_prompts(), device=device, dtype=dtype,
                                      batch_size=spec.batch_size) if spec.use_cfg else None
        pairs = list(zip(negative, positive)) if negative is not None else [(None, p) for p in positive]
        self._conditions = {name: (torch.cat(pair) if pair[0] is not None else pair[1])
                            for name, pair in zip(CONDITIONS[1:], pairs[1:])}     # [negative; positive] rows
        return positive[0], None if negative is None else negative[0]

    def conditions(self, spec: GenerationSpec) -> dict[str, torch.Tensor]:
        """The prompts' other tensors (`prompt`) and, for image-to-video, the image's SigLIP tokens and its
        condition latents."""
        conditions, self._conditions = self._conditions, None
        if not self.i2v:
            return conditions
        pipe, device, B = self.w.pipe, self.w.pg.device, spec.batch_size
        image = pipe.video_processor.resize(to_pil(spec.options["image"]), height=spec.height, width=spec.width,
                                            resize_mode="crop")
        embeds = pipe.encode_image(image=image, batch_size=B, device=device, dtype=self.w.dtype)   # (B, T, C_img)
        cond, mask = pipe.prepare_cond_latents_and_mask(
            latents=torch.empty(latent_shape(pipe, spec), device=device), image=image, batch_size=B,
            height=spec.height, width=spec.width, dtype=self.w.dtype, device=device)  # (B, C, f, h, w), (B, 1, f, h, w)
        return {**conditions, "image_embeds": embeds, "condition": torch.cat([cond, mask], dim=1)}


class Hunyuan15Loop(DenoisingLoop):
    """Flow-matching latents with the condition channels joined on, one forward of every row per step."""

    def __init__(self, worker):
        super().__init__(worker)
        self.i2v = worker.desc.capabilities.image == REQUIRED

    def prepare(self, spec: GenerationSpec, text: torch.Tensor, condition: torch.Tensor = None,
                image_embeds: torch.Tensor = None, **conditions) -> Hunyuan15Request:
        w = self.w
        steps = spec.num_inference_steps
        scheduler = w.new_scheduler(steps, sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1].tolist())
        generator = seeded_generator(spec.seed)
        latents = torch.randn(latent_shape(w.pipe, spec), generator=generator, dtype=torch.float32).to(w.pg.device)
        req = Hunyuan15Request(spec=spec, num_steps=len(scheduler.timesteps), batch_key=(), num_frames=spec.num_frames,
                               text=text, scheduler=scheduler, latents=latents,
                               conditions={**conditions, "encoder_hidden_states": text}, condition=condition,
                               image_embeds=image_embeds,
                               step_kwargs=scheduler_step_kwargs(scheduler, generator),
                               frames=w.frame_stream(spec, spec.num_frames,
                                                     FramesPolicy(w.pipe.vae_scale_factor_temporal,
                                                                  whole=w.vae_tiling)))
        # the model zeroes the image tokens of a batch only when every row's image embedding is zero: text-only
        # and image requests never share a forward
        req.batch_key = ("hunyuan15", *latents.shape, "i2v" if self.i2v else "t2v")
        return req

    def inputs(self, r: Hunyuan15Request) -> dict:
        pipe, dtype = self.w.pipe, self.w.dtype
        B, C, F, h, w = r.latents.shape
        condition = r.latents.new_zeros(B, C + 1, F, h, w) if r.condition is None else r.condition
        x = torch.cat([r.latents, condition.to(r.latents.dtype)], dim=1)             # latents, condition, mask
        x = cfg_rows(r, x).to(dtype)                                                  # (2B|B, 2C+1, F, h, w)
        rows = x.shape[0]
        if r.image_embeds is None:                                                    # text-to-video: no image
            image = torch.zeros(rows, pipe.vision_num_semantic_tokens, pipe.vision_states_dim, dtype=dtype,
                                device=x.device)
        else:
            image = cfg_rows(r, r.image_embeds).to(dtype)                             # (2B|B, T, C_img)
        t = r.scheduler.timesteps[r.steps_done].reshape(1).expand(rows).to(dtype)
        return {"x": x, "t": t, "image_embeds": image, **{name: r.conditions[name].to(dtype) for name in CONDITIONS}}

    def forward(self, model, inputs: dict, cfg_parallel: bool) -> torch.Tensor:
        x, t = torch.cat(inputs["x"]), torch.cat(inputs["t"]).to(self.w.pg.device)
        cond = {name: torch.cat(inputs[name]) for name in (*CONDITIONS, "image_embeds")}
        return self.w.denoise(model, cfg_parallel, x, t, cond)                        # (rows, C, F, h, w)
