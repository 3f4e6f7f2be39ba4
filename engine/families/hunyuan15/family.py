"""The HunyuanVideo-1.5 family (`HunyuanVideo15Pipeline`, `HunyuanVideo15ImageToVideoPipeline`): a dual-stream
full-attention video DiT with two text encoders (Qwen2.5-VL's text model, and ByT5 for the glyphs a prompt quotes),
sharded on its F x H x W video tokens by the plan in `engine/models/hunyuan15.py` (Ulysses, Ring or USP;
CFG-parallel around them). This module is the adapter: the prompts as diffusers' pipeline encodes them, latents
and the condition channels, the rows of one forward, and the VAE decode (streamed in time: engine/hunyuan15_vae.py).

Image-to-video (rank 0 encodes, as for the prompts, and broadcasts): the image is resized and centre-cropped to
the request's height x width (`video_processor.resize(..., resize_mode="crop")`, diffusers' rule), its SigLIP
tokens become the transformer's `image_embeds` and its VAE latent the first latent frame of the condition
channels, with a mask of ones there (`prepare_cond_latents_and_mask`). diffusers' pipeline picks the size itself,
the bucket of the checkpoint's `target_size` nearest the image's aspect ratio; longserve takes the request's
(default: the checkpoint's), so a request at that bucket's size is diffusers' call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from longserve.engine.config import REQUIRED, ModelDescription
from longserve.engine.decoding import FramesPolicy, to_pixels
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
from longserve.engine.families.wan_parts import WanParts
from longserve.engine.images import as_rgb_array, to_pil
from longserve.engine.models.hunyuan15 import Hunyuan15SequenceParallel
from longserve.engine.request import GenerationSpec, RequestError

#: the condition tensors of one forward row, by the transformer's argument names
CONDITIONS = ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2",
              "encoder_attention_mask_2")


@dataclass
class Hunyuan15Request(WorkerRequest):
    conditions: dict = field(default_factory=dict)   # CONDITIONS' tensors, [negative; positive] rows under CFG
    condition: torch.Tensor = None     # (B, C + 1, f, h, w): the image's latent frame and its mask (image-to-video)
    image_embeds: torch.Tensor = None  # (B, T, C_img): the image's SigLIP tokens (image-to-video)


class Hunyuan15Family(VideoFamily):
    """`HunyuanVideo15Pipeline` (text-to-video) and `HunyuanVideo15ImageToVideoPipeline` checkpoints."""

    name = "hunyuan15"
    plans = ("ulysses", "ring", "usp")
    auto_plan = "sequence"
    #: diffusers' `__call__` defaults (its default size is the 16:9 bucket of the transformer's target_size)
    pipeline_defaults = {"height": 480, "width": 848, "num_frames": 121, "num_inference_steps": 50,
                         "guidance_scale": 6.0, "fps": 24}
    pipeline_classes = frozenset({"HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"})
    rank0_components = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "image_encoder",
                        "feature_extractor")

    @classmethod
    def describe(cls, model_dir: Path) -> ModelDescription:
        model_dir = Path(model_dir)
        index = read_json(model_dir / "model_index.json")
        cfg = read_json(model_dir / "transformer" / "config.json")
        vae = read_json(model_dir / "vae" / "config.json")
        i2v = index["_class_name"] == "HunyuanVideo15ImageToVideoPipeline"
        return ModelDescription(
            family=cls.name, pipeline=index["_class_name"], heads=cfg["num_attention_heads"],
            size_multiple=vae.get("spatial_compression_ratio", 16) * cfg.get("patch_size", 1),
            frame_multiple=vae.get("temporal_compression_ratio", 4) * cfg.get("patch_size_t", 1),
            defaults=generation_defaults(model_dir, cls.pipeline_defaults), options=("image",) if i2v else (),
            capabilities=cls.capabilities((), image=REQUIRED) if i2v else cls.capabilities(()))

    @classmethod
    def resolve_plan(cls, desc: ModelDescription, parallel: str, workers: int, ulysses_degree: int | None = None,
                     cfg_parallel: bool = False):
        """"auto" is Ulysses at every worker count: heads fewer than the group are zero-padded, and one all-to-all
        pair per block sends less than a ring (the generic rule would pick USP or Ring where the heads do not
        cover the group)."""
        return super().resolve_plan(desc, "ulysses" if parallel == "auto" else parallel, workers, ulysses_degree,
                                    cfg_parallel)

    @classmethod
    def check_request(cls, desc: ModelDescription, spec: GenerationSpec) -> GenerationSpec:
        if desc.capabilities.image == REQUIRED:
            if spec.options.get("image") is None:
                raise RequestError("image", "image is required: this is an image-to-video model (a "
                                            "HunyuanVideo15ImageToVideoPipeline checkpoint)")
            spec.options = dict(spec.options, image=as_rgb_array(spec.options["image"], "image"))
        elif spec.options.get("image") is not None:
            raise RequestError("image", "image is not supported: this checkpoint generates video from text only "
                                        "(image-to-video needs a HunyuanVideo15ImageToVideoPipeline checkpoint)")
        check_common(desc, spec)
        return spec

    def __init__(self, ctx, config):
        import diffusers

        super().__init__(ctx, config)
        self.refuse_xformers(config)
        self.desc = self.describe(Path(config.model_dir))
        self.i2v = self.desc.capabilities.image == REQUIRED
        self.pipe = self.load_pipeline(getattr(diffusers, self.desc.pipeline),
                                       {"default": self.dtype, "vae": torch.float32})
        self.transformer = self.load_denoisers(Denoisers((self.pipe.transformer,)))[0]
        self.set_plan(config.plan)
        self._conditions = None

    def shard(self, denoiser):
        return Hunyuan15SequenceParallel(denoiser)

    set_plan = WanParts.set_plan          # the sequence-parallel groups of a plan (and of each CFG half)
    refuse_xformers = WanParts.refuse_xformers   # PyTorch SDPA only
    dispatcher_attention = True           # attention_backend: diffusers' processors and our joint attention
    attention_masks = True                # the joint attention masks the prompt's padding

    # -- a request ----------------------------------------------------------------------------------

    def encode_prompt(self, spec: GenerationSpec):
        """Qwen2.5-VL's prompt embeddings, as the pipeline makes them (rank 0 only); the pipeline's other
        condition tensors (the Qwen mask, ByT5's embeddings and mask) wait for `encode_conditions`."""
        pipe, dtype, device = self.pipe, self.dtype, self.pg.device
        positive = pipe.encode_prompt(prompt=spec.prompt, device=device, dtype=dtype, batch_size=spec.batch_size)
        negative = pipe.encode_prompt(prompt=spec.negative_prompts(), device=device, dtype=dtype,
                                      batch_size=spec.batch_size) if spec.use_cfg else None
        pairs = list(zip(negative, positive)) if negative is not None else [(None, p) for p in positive]
        self._conditions = {name: (torch.cat(pair) if pair[0] is not None else pair[1])
                            for name, pair in zip(CONDITIONS[1:], pairs[1:])}     # [negative; positive] rows
        return positive[0], None if negative is None else negative[0]

    def encode_conditions(self, spec: GenerationSpec) -> dict[str, torch.Tensor]:
        """Rank 0: the prompts' other tensors (`encode_prompt`) and, for image-to-video, the image's SigLIP tokens
        and its condition latents, by the pipeline's own methods."""
        conditions, self._conditions = self._conditions, None
        if not self.i2v:
            return conditions
        pipe, device, B = self.pipe, self.pg.device, spec.batch_size
        image = pipe.video_processor.resize(to_pil(spec.options["image"]), height=spec.height, width=spec.width,
                                            resize_mode="crop")
        embeds = pipe.encode_image(image=image, batch_size=B, device=device, dtype=self.dtype)     # (B, T, C_img)
        shape = self.latent_shape(spec)
        cond, mask = pipe.prepare_cond_latents_and_mask(
            latents=torch.empty(shape, device=device), image=image, batch_size=B, height=spec.height,
            width=spec.width, dtype=self.dtype, device=device)                  # (B, C, f, h, w), (B, 1, f, h, w)
        return {**conditions, "image_embeds": embeds, "condition": torch.cat([cond, mask], dim=1)}

    def latent_shape(self, spec: GenerationSpec) -> tuple:
        pipe = self.pipe
        return (spec.batch_size, pipe.num_channels_latents, (spec.num_frames - 1) // pipe.vae_scale_factor_temporal + 1,
                spec.height // pipe.vae_scale_factor_spatial, spec.width // pipe.vae_scale_factor_spatial)

    def prepare(self, spec: GenerationSpec, text: torch.Tensor, condition: torch.Tensor = None,
                image_embeds: torch.Tensor = None, **conditions) -> Hunyuan15Request:
        steps = spec.num_inference_steps
        scheduler = self.new_scheduler(steps, sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1].tolist())
        generator = seeded_generator(spec.seed)
        latents = torch.randn(self.latent_shape(spec), generator=generator, dtype=torch.float32).to(self.pg.device)
        req = Hunyuan15Request(spec=spec, num_steps=len(scheduler.timesteps), batch_key=(), num_frames=spec.num_frames,
                               text=text, scheduler=scheduler, latents=latents,
                               conditions={**conditions, "encoder_hidden_states": text}, condition=condition,
                               image_embeds=image_embeds,
                               step_kwargs=scheduler_step_kwargs(scheduler, generator),
                               frames=self.frame_stream(spec, spec.num_frames,
                                                        FramesPolicy(self.pipe.vae_scale_factor_temporal,
                                                                     whole=self.vae_tiling)))
        # the model zeroes the image tokens of a batch only when every row's image embedding is zero: text-only
        # and image requests never share a forward
        req.batch_key = ("hunyuan15", *latents.shape, "i2v" if self.i2v else "t2v")
        return req

    def inputs(self, r: Hunyuan15Request) -> dict:
        pipe = self.pipe
        B, C, F, h, w = r.latents.shape
        condition = r.latents.new_zeros(B, C + 1, F, h, w) if r.condition is None else r.condition
        x = torch.cat([r.latents, condition.to(r.latents.dtype)], dim=1)             # latents, condition, mask
        x = cfg_rows(r, x).to(self.dtype)                                             # (2B|B, 2C+1, F, h, w)
        rows = x.shape[0]
        if r.image_embeds is None:                                                    # text-to-video: no image
            image = torch.zeros(rows, pipe.vision_num_semantic_tokens, pipe.vision_states_dim, dtype=self.dtype,
                                device=x.device)
        else:
            image = cfg_rows(r, r.image_embeds).to(self.dtype)                        # (2B|B, T, C_img)
        t = r.scheduler.timesteps[r.steps_done].reshape(1).expand(rows).to(self.dtype)
        return {"x": x, "t": t, "image_embeds": image,
                **{name: r.conditions[name].to(self.dtype) for name in CONDITIONS}}

    def forward(self, model, inputs: dict, cfg_parallel: bool) -> torch.Tensor:
        x, t = torch.cat(inputs["x"]), torch.cat(inputs["t"]).to(self.pg.device)
        cond = {name: torch.cat(inputs[name]) for name in (*CONDITIONS, "image_embeds")}
        return self.transformer(x, t, cond, self.sp_cfg if cfg_parallel else self.sp,
                                cfg=self.cfg_groups if cfg_parallel else None)    # (rows, C, F, h, w)

    def vae_decoder(self, spec: GenerationSpec, latents: torch.Tensor) -> "Hunyuan15Decoder":
        from longserve.engine.vae_split import split_rows_fits

        rows = self.vae_split == "rows" and self.pg.world_size > 1 and split_rows_fits(latents.shape[3],
                                                                                       self.pg.world_size)
        return Hunyuan15Decoder(self.pipe, self.pg, self.vae_tiling, spec.output,
                                rows_of=latents.shape[3] if rows else None)


class Hunyuan15Decoder:
    """The HunyuanVideo-1.5 VAE on rank 0: streamed in time, a chunk of latent frames at a time as the frame stream
    hands them (engine/hunyuan15_vae.py: the decoder is causal in time, so the chunks' frames are diffusers' decode);
    with `vae_tiling`, the clip whole through diffusers' tiled decode, as the pipeline does; with `rows`, streamed on
    every rank, each its band of the frame's rows (engine/vae_split.py), gathered on rank 0."""

    def __init__(self, pipe, pg, tiling: bool, output: str, rows_of: int | None = None):
        """rows_of: the latent height whose rows split across the workers (None: rank 0 decodes whole frames)."""
        from longserve.engine.hunyuan15_vae import HunyuanVAEStream
        from longserve.engine.vae_split import RowSplit

        self.pipe, self.pg, self.output, self.tiling = pipe, pg, output, tiling
        self.rows = rows_of is not None and not tiling
        if tiling:
            pipe.vae.enable_tiling()
        else:
            pipe.vae.disable_tiling()
        self.stream = None
        if self.rows:
            self.stream = HunyuanVAEStream(pipe.vae, RowSplit(pg, rows_of))
        elif pg.rank == 0 and not tiling:
            self.stream = HunyuanVAEStream(pipe.vae)

    def decode(self, latents: torch.Tensor, keep: slice):
        vae = self.pipe.vae
        if self.rows:
            video = self.stream.decode(latents.to(vae.dtype) / vae.config.scaling_factor)  # (B, 3, n, H, W) on 0
            return None if video is None else to_pixels(video[:, :, keep], self.pipe.video_processor, self.output)
        if self.pg.rank != 0:
            return None
        z = latents.to(vae.dtype) / vae.config.scaling_factor
        if self.stream is not None:
            video = self.stream.decode(z)                                        # (B, 3, n, H, W)
        else:
            with torch.no_grad():
                video = vae.decode(z, return_dict=False)[0]
        return to_pixels(video[:, :, keep], self.pipe.video_processor, self.output)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


FAMILY = Hunyuan15Family
