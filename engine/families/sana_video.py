"""The SANA-Video family (`SanaVideoPipeline`, `SanaImageToVideoPipeline`): a DiT of linear self-attention, softmax
cross-attention to Gemma 2's prompt tokens and a temporal-conv FFN, over the Wan 2.1 VAE's latents. Sharded on whole
frames of its tokens by the plan in `engine/models/sana_video.py` (the linear attention's state all-reduced: exact at
any worker count; CFG-parallel around it). This module is the adapter: the prompts as diffusers' pipeline encodes
them (the complex human instruction prepended, 300 tokens kept), latents, the rows of one forward; the VAE's
streaming decode is the Wan architecture's (engine/families/wan_parts.py).

Image-to-video (rank 0 encodes, as for the prompts, and broadcasts): the image is resized to the request's size by
the pipeline's `video_processor.preprocess`, its VAE latent (the distribution's mode, normalised as the pipeline
does) replaces the first latent frame of the noise, that frame's tokens get timestep 0 (a timestep per token) and
the scheduler steps the other frames only (`SanaImageToVideoPipeline.__call__`).

Sizes: diffusers' pipelines map the asked size to the nearest bucket of their aspect-ratio table
(`use_resolution_binning`, on by default) and resize the video back; longserve generates at the asked size, which is
diffusers' call with `use_resolution_binning=False` (the same as the default at a bucket's own size).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from longserve.engine.config import REQUIRED, ModelDescription
from longserve.engine.decoding import FramesPolicy
from longserve.engine.families.base import (
    Denoisers,
    VideoFamily,
    WorkerRequest,
    cfg_rows,
    check_common,
    generation_defaults,
    read_json,
    scheduler_step_kwargs,
    seeded_generator,
)
from longserve.engine.families.rules import check_image_input
from longserve.engine.families.wan_parts import WanParts, vae_factors
from longserve.engine.images import to_pil
from longserve.engine.models.sana_video import SanaVideoSequenceParallel
from longserve.engine.request import GenerationSpec

MAX_SEQUENCE_LENGTH = 300           # the prompt tokens the pipeline keeps (its `max_sequence_length` default)
#: diffusers' pipelines check height and width against 32 (`check_inputs`)
SIZE_MULTIPLE = 32


@dataclass
class SanaVideoRequest(WorkerRequest):
    text_mask: torch.Tensor = None       # (2B|B, L): the prompt tokens' mask, [negative; positive] rows under CFG
    image_frame: bool = False            # image to video: latent frame 0 is the image's and is not denoised


class SanaVideoFamily(WanParts, VideoFamily):
    """`SanaVideoPipeline` (text to video) and `SanaImageToVideoPipeline` checkpoints."""

    name = "sana_video"
    plans = ("tokens",)
    auto_plan = "tokens"
    #: diffusers' `__call__` defaults (frames 81 at 480 x 832; the published 16 fps)
    pipeline_defaults = {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50,
                         "guidance_scale": 6.0, "fps": 16}
    pipeline_classes = frozenset({"SanaVideoPipeline", "SanaImageToVideoPipeline"})
    dispatcher_attention = True           # the cross-attention is diffusers' processor (the dispatcher)
    dispatcher_attention_note = "its self-attention is linear (longserve's, summed across workers)"
    attention_masks = True                # the cross-attention masks the prompt's padding

    @classmethod
    def describe(cls, model_dir: Path) -> ModelDescription:
        model_dir = Path(model_dir)
        index = read_json(model_dir / "model_index.json")
        cfg = read_json(model_dir / "transformer" / "config.json")
        spatial, temporal = vae_factors(read_json(model_dir / "vae" / "config.json"))
        p_t, p_h, _ = cfg.get("patch_size", (1, 2, 2))
        i2v = index["_class_name"] == "SanaImageToVideoPipeline"
        return ModelDescription(
            family=cls.name, pipeline=index["_class_name"], heads=cfg["num_attention_heads"],
            size_multiple=max(SIZE_MULTIPLE, spatial * p_h), frame_multiple=temporal * p_t,
            defaults=generation_defaults(model_dir, cls.pipeline_defaults), options=("image",) if i2v else (),
            capabilities=cls.capabilities((), image=REQUIRED) if i2v else cls.capabilities(()))

    @classmethod
    def check_request(cls, desc: ModelDescription, spec: GenerationSpec) -> GenerationSpec:
        check_image_input(desc, spec, "SanaImageToVideoPipeline")
        check_common(desc, spec)
        return spec

    def __init__(self, ctx, config):
        import diffusers

        super().__init__(ctx, config)
        self.refuse_xformers(config)
        self.desc = self.describe(Path(config.model_dir))
        self.i2v = self.desc.capabilities.image == REQUIRED
        self.pipe = self.load_pipeline(getattr(diffusers, self.desc.pipeline), self.component_dtypes())
        self.transformer = self.load_denoisers(Denoisers((self.pipe.transformer,)))[0]
        self.set_plan(config.plan)
        self._mask = None
        # the pipeline's default instruction, prepended to every prompt as its `__call__` does
        self.instruction = inspect.signature(type(self.pipe).__call__).parameters["complex_human_instruction"].default

    def shard(self, denoiser):
        return SanaVideoSequenceParallel(denoiser)

    def set_plan(self, plan) -> None:
        """"tokens": one group of all the workers (and, with CFG-parallel, one per half), built as Ulysses' groups
        are; the linear attention all-reduces over it."""
        VideoFamily.set_plan(self, dataclasses.replace(plan, name="ulysses", ulysses_degree=None))
        self.plan = plan

    # -- a request ----------------------------------------------------------------------------------

    def encode_prompt(self, spec: GenerationSpec):
        """Gemma 2's prompt embeddings as the pipeline makes them (rank 0 only); the masks wait for
        `encode_conditions`."""
        embeds, mask, neg, neg_mask = self.pipe.encode_prompt(
            spec.prompt, spec.use_cfg, negative_prompt=spec.negative_prompts(), device=self.pg.device,
            max_sequence_length=MAX_SEQUENCE_LENGTH, complex_human_instruction=self.instruction)
        self._mask = torch.cat([neg_mask, mask]) if spec.use_cfg else mask               # (2B|B, L)
        return embeds, neg

    def encode_conditions(self, spec: GenerationSpec) -> dict[str, torch.Tensor]:
        """Rank 0: the prompts' mask and, for image to video, the image's normalised VAE latent (B, C, 1, h, w)."""
        conditions, self._mask = {"text_mask": self._mask}, None
        if not self.i2v:
            return conditions
        pipe, vae, device = self.pipe, self.pipe.vae, self.pg.device
        image = pipe.video_processor.preprocess(to_pil(spec.options["image"]), height=spec.height,
                                                width=spec.width).to(device, torch.float32)     # (1, 3, H, W)
        latent = vae.encode(image.unsqueeze(2).to(vae.dtype)).latent_dist.mode()            # (1, C, 1, h, w)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(latent)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(latent)
        return {**conditions, "image_latent": ((latent - mean) * inv_std).repeat(spec.batch_size, 1, 1, 1, 1)}

    def latent_shape(self, spec: GenerationSpec) -> tuple:
        pipe = self.pipe
        return (spec.batch_size, pipe.transformer.config.in_channels,
                (spec.num_frames - 1) // pipe.vae_scale_factor_temporal + 1,
                spec.height // pipe.vae_scale_factor_spatial, spec.width // pipe.vae_scale_factor_spatial)

    def prepare(self, spec: GenerationSpec, text: torch.Tensor, text_mask: torch.Tensor = None,
                image_latent: torch.Tensor = None) -> SanaVideoRequest:
        scheduler = self.new_scheduler(spec.num_inference_steps)
        generator = seeded_generator(spec.seed)
        latents = torch.randn(self.latent_shape(spec), generator=generator, dtype=torch.float32).to(self.pg.device)
        if image_latent is not None:
            latents[:, :, :1] = image_latent.to(latents.dtype)
        req = SanaVideoRequest(spec=spec, num_steps=len(scheduler.timesteps), batch_key=(),
                               num_frames=spec.num_frames, text=text, scheduler=scheduler, latents=latents,
                               step_kwargs=scheduler_step_kwargs(scheduler, generator), text_mask=text_mask,
                               image_frame=image_latent is not None,
                               frames=self.frame_stream(spec, spec.num_frames,
                                                        FramesPolicy(self.pipe.vae_scale_factor_temporal)))
        req.batch_key = ("sana_video", *latents.shape, "i2v" if self.i2v else "t2v")
        return req

    def inputs(self, r: SanaVideoRequest) -> dict:
        x = cfg_rows(r, r.latents).to(self.dtype)                                # (2B|B, C, F, h, w)
        rows = x.shape[0]
        t = r.scheduler.timesteps[r.steps_done]
        if r.image_frame:                # a timestep per token, 0 on the image's frame: (rows, 1, F, h', w')
            _, p_h, p_w = self.pipe.transformer.config.patch_size
            keep = torch.ones(rows, 1, x.shape[2], x.shape[3] // p_h, x.shape[4] // p_w, device=x.device)
            keep[:, :, 0] = 0.0
            t = t.expand(keep.shape) * keep
        else:
            t = t.expand(rows)
        return {"x": x, "t": t, "encoder_hidden_states": r.text.to(self.dtype),
                "encoder_attention_mask": r.text_mask}

    def forward(self, model, inputs: dict, cfg_parallel: bool) -> torch.Tensor:
        x, t = torch.cat(inputs["x"]), torch.cat(inputs["t"]).to(self.pg.device)
        cond = {name: torch.cat(inputs[name]) for name in ("encoder_hidden_states", "encoder_attention_mask")}
        return self.denoise(self.transformer, cfg_parallel, x, t, cond).float()     # (rows, C, F, h, w)

    def advance(self, r: SanaVideoRequest, pred: torch.Tensor) -> None:
        """The scheduler's step; image to video steps the frames after the image's (its own frame stays)."""
        if not r.image_frame:
            return super().advance(r, pred)
        t = r.scheduler.timesteps[r.steps_done]
        stepped = r.scheduler.step(pred[:, :, 1:], t, r.latents[:, :, 1:], **r.step_kwargs, return_dict=False)[0]
        r.latents = torch.cat([r.latents[:, :, :1], stepped], dim=2)
        r.steps_done += 1
        if r.denoised:
            r.frames.push(self.final_latents(r), last=True)


FAMILY = SanaVideoFamily
