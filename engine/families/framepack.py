"""FramePack (`HunyuanVideoFramepackPipeline`): image-to-video of any length, a section of `latent_window_size`
latent frames at a time, each conditioned on the image and on a fixed-size history packed at three compressions
(the newest latent frame at 1x, the next 2 at 2x, 16 more at 4x: 19 latent frames whatever the length). The
sharded forward is `engine/models/framepack.py`'s; this module is the adapter: the prompts (Llama + CLIP pooled),
the image (SigLIP tokens, VAE latent), the sections' schedule and history, and the decode as diffusers does it.

Sampling (`sampling_type`, diffusers' two):
- "vanilla" (FramePack-F1): sections in time order. Each section's frames are final once the next section's decode
  has blended into them (diffusers' `_soft_append` over `(latent_window_size - 1) * 4 + 1` frames), so every
  section but the last hands out all its frames except that blended tail, while the next section denoises.
- "inverted_anti_drifting" (diffusers' default, the original FramePack): sections from the end of the video back to
  its start, the image's frame last; the start of the video is made last, so the frames go out when the last section
  is done, in one piece. `last_image` (first and last frame) is this sampling's.

Memory per worker is flat in the length: a request keeps the 19 history frames, the previous section's latents and,
on rank 0, the blended tail's pixels (vanilla); inverted sampling keeps every section's latents (16 x h x w values a
frame) and decodes them at the end, on rank 0.

Rank 0 encodes (the prompt, the image; the image's VAE sample draws from the request's generator, as diffusers'
`prepare_image_latents` does, and the other ranks draw the same numbers to stay in step) and broadcasts. FramePack is
guidance-distilled: `guidance_scale` is the embedded guidance (x 1000, as the pipeline passes it) and a forward has
one row per video, so CFG-parallel is refused. diffusers' `true_cfg_scale` is not offered.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from longserve.engine import timeline
from longserve.engine.config import OPTIONAL, REQUIRED, ModelDescription
from longserve.engine.decoding import decoded_frames
from longserve.engine.families.base import (
    Denoisers,
    VideoFamily,
    WorkerRequest,
    check_common,
    check_int,
    generation_defaults,
    read_json,
    seeded_generator,
)
from longserve.engine.families.wan_parts import WanParts
from longserve.engine.framepack_decoding import SectionStream
from longserve.engine.images import as_rgb_array, to_pil
from longserve.engine.models.framepack import FramepackSequenceParallel
from longserve.engine.request import GenerationSpec, RequestError

VANILLA, INVERTED = "vanilla", "inverted_anti_drifting"
OPTIONS = ("image", "last_image", "latent_window_size", "sampling_type", timeline.OPTION)
HISTORY = {VANILLA: (16, 2, 1), INVERTED: (1, 2, 16)}      # the latent frames at 4x/2x/1x, in the pipeline's order
CONDITIONS = ("encoder_hidden_states", "encoder_attention_mask", "pooled_projections", "image_embeds")


def sections_of(num_frames: int, window: int, temporal: int = 4) -> tuple[int, int]:
    """(sections, frames made) of a request, as the pipeline counts them: ceil(num_frames / a window's frames)
    sections, each adding 4 x window frames after the image's first."""
    sections = max(1, -(-num_frames // decoded_frames(window, temporal)))
    return sections, 1 + temporal * window * sections


@dataclass
class FramepackRequest(WorkerRequest):
    conditions: dict = field(default_factory=dict)   # CONDITIONS' tensors (B, ...)
    image_latents: torch.Tensor = None    # (B, C, 1, h, w)
    last_latents: torch.Tensor = None     # (B, C, 1, h, w): the last frame's (inverted sampling)
    generator: torch.Generator = None     # every section's noise, in order (after the images' samples)
    sampling: str = INVERTED
    window: int = 9
    sections: int = 1
    section: int = 0
    section_step: int = 0
    history: torch.Tensor = None          # (B, C, 19, h, w) float32: the packed history's frames
    previous: torch.Tensor = None         # (B, C, window, h, w): the section before's latents (its decode's overlap)
    indices: dict = field(default_factory=dict)    # the section's frame indices (the model's RoPE positions)
    packed: dict = field(default_factory=dict)     # the section's clean frames and 2x / 4x history latents
    section_prompts: list = None                   # per section (in the order made), its prompt's index


class FramepackFamily(WanParts, VideoFamily):
    """`HunyuanVideoFramepackPipeline` checkpoints (FramePack I2V, FramePack-F1)."""

    name = "framepack"
    plans = ("ulysses", "ring", "usp")
    auto_plan = "sequence"
    pipeline_classes = frozenset({"HunyuanVideoFramepackPipeline"})
    #: diffusers' `__call__` defaults (FramePack makes 30 fps video)
    pipeline_defaults = {"height": 720, "width": 1280, "num_frames": 129, "num_inference_steps": 50,
                         "guidance_scale": 6.0, "fps": 30, "latent_window_size": 9}
    rank0_components = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "image_encoder",
                        "feature_extractor")

    @classmethod
    def describe(cls, model_dir: Path) -> ModelDescription:
        model_dir = Path(model_dir)
        index = read_json(model_dir / "model_index.json")
        cfg = read_json(model_dir / "transformer" / "config.json")
        vae = read_json(model_dir / "vae" / "config.json")
        return ModelDescription(
            family=cls.name, pipeline=index["_class_name"], heads=cfg["num_attention_heads"],
            size_multiple=vae.get("spatial_compression_ratio", 8) * cfg.get("patch_size", 2), frame_multiple=1,
            defaults=generation_defaults(model_dir, cls.pipeline_defaults), options=OPTIONS,
            capabilities=cls.capabilities(OPTIONS, image=REQUIRED, last_image=OPTIONAL, long_video=True))

    @classmethod
    def resolve_plan(cls, desc, parallel, workers, ulysses_degree=None, cfg_parallel=False):
        if cfg_parallel:
            raise ValueError("cfg_parallel is not available for FramePack: it is guidance-distilled (one row per "
                             "video, no unconditional half)")
        return super().resolve_plan(desc, parallel, workers, ulysses_degree, cfg_parallel)

    @classmethod
    def check_request(cls, desc: ModelDescription, spec: GenerationSpec) -> GenerationSpec:
        spec = timeline.check_timeline(spec, spec.fps or desc.defaults.fps)         # a prompt per section
        o, d = dict(spec.options), desc.defaults.options
        if o.get("image") is None:
            raise RequestError("image", "image is required: FramePack makes video from an image (and a prompt)")
        o["image"] = as_rgb_array(o["image"], "image")
        o["sampling_type"] = o.get("sampling_type", d.get("sampling_type", INVERTED))
        if o["sampling_type"] not in (VANILLA, INVERTED):
            raise RequestError("sampling_type", f"sampling_type must be {VANILLA!r} or {INVERTED!r}; got "
                                                f"{o['sampling_type']!r}")
        if o.get("last_image") is not None:
            if o["sampling_type"] != INVERTED:
                raise RequestError("last_image", f"last_image needs sampling_type {INVERTED!r} (FramePack makes "
                                                 f"the last section first there)")
            o["last_image"] = as_rgb_array(o["last_image"], "last_image")
        o["latent_window_size"] = o.get("latent_window_size", d.get("latent_window_size", 9))
        check_int("latent_window_size", o["latent_window_size"], 1, 64)
        spec.options = {k: v for k, v in o.items() if v is not None}
        check_common(desc, spec)
        return spec

    @classmethod
    def content_frames(cls, desc: ModelDescription, spec: GenerationSpec) -> int:
        return sections_of(spec.num_frames, spec.options["latent_window_size"])[1]

    def __init__(self, ctx, config):
        import diffusers

        super().__init__(ctx, config)
        self.refuse_xformers(config)
        self.desc = self.describe(Path(config.model_dir))
        self.pipe = self.load_pipeline(getattr(diffusers, self.desc.pipeline), self.component_dtypes())
        self.transformer = self.load_denoisers(Denoisers((self.pipe.transformer,)))[0]
        self.set_plan(config.plan)

    def shard(self, denoiser):
        return FramepackSequenceParallel(denoiser)

    # -- a request ----------------------------------------------------------------------------------

    def admit(self, spec: GenerationSpec) -> FramepackRequest:
        """The prompt and the images encoded on rank 0 (one broadcast), then the request's sections."""
        t0 = time.perf_counter()

        def encode():
            with torch.no_grad():
                return {k: v.cpu() for k, v in self.encode_inputs(spec).items()}

        encoded = {k: v.to(self.pg.device) for k, v in self.broadcast_from_first(encode).items()}
        req = self.prepare(spec, **encoded)
        req.timings["encode_s"] = time.perf_counter() - t0
        return req

    def image_shape(self, spec: GenerationSpec) -> tuple:
        """The shape of one image's VAE sample (one image for every prompt of the request): (1, C, 1, h, w)."""
        f = self.pipe.vae_scale_factor_spatial
        return (1, self.pipe.transformer.config.in_channels, 1, spec.height // f, spec.width // f)

    def encode_inputs(self, spec: GenerationSpec) -> dict[str, torch.Tensor]:
        """Rank 0: the pipeline's own encodings: Llama's prompt tokens and mask, CLIP's pooled output, SigLIP's
        image tokens, the images' VAE samples."""
        pipe, device, dtype, o = self.pipe, self.pg.device, self.dtype, spec.options
        # a prompt timeline's distinct prompts, each encoded once: rows [B * p, (p + 1) * B) are prompt p's
        prompts = timeline.distinct_prompts(spec) if timeline.OPTION in spec.options else spec.prompt
        embeds, pooled, mask = pipe.encode_prompt(prompt=prompts, device=device, max_sequence_length=256)
        out = {"encoder_hidden_states": embeds.to(dtype), "encoder_attention_mask": mask.to(dtype),
               "pooled_projections": pooled.to(dtype)}
        generator = seeded_generator(spec.seed)            # as the pipeline's: the images' samples draw first
        image = pipe.video_processor.preprocess(to_pil(o["image"]), spec.height, spec.width)
        out["image_embeds"] = pipe.encode_image(image, device=device).to(dtype)
        out["image_latents"] = pipe.prepare_image_latents(image, dtype=torch.float32, device=device,
                                                          generator=generator)
        if o.get("last_image") is not None:
            last = pipe.video_processor.preprocess(to_pil(o["last_image"]), spec.height, spec.width)
            # diffusers averages the two images' SigLIP tokens into a variable its transformer call never reads:
            # the first image's alone condition the video, here as there
            out["last_latents"] = pipe.prepare_image_latents(last, dtype=torch.float32, device=device,
                                                             generator=generator)
        return {k: (v.expand(spec.batch_size, *v.shape[1:]) if k in ("image_embeds", "image_latents",
                                                                     "last_latents") else v) for k, v in out.items()}

    def prepare(self, spec: GenerationSpec, image_latents: torch.Tensor, last_latents: torch.Tensor = None,
                **conditions) -> FramepackRequest:
        o = spec.options
        window, sampling = o["latent_window_size"], o["sampling_type"]
        sections, frames = sections_of(spec.num_frames, window, self.pipe.vae_scale_factor_temporal)
        generator = seeded_generator(spec.seed)
        for _ in range(1 if last_latents is None else 2):   # rank 0 drew the images' samples from its own copy
            torch.randn(self.image_shape(spec), generator=generator)
        B, C, _, h, w = image_latents.shape
        history = torch.zeros(B, C, sum(HISTORY[sampling]), h, w, device=self.pg.device)
        if sampling == VANILLA:
            history = torch.cat([history, image_latents.float()], dim=2)[:, :, 1:]     # the image's frame is history
        steps = len(self.section_scheduler(spec, window, h, w).timesteps)
        # per section, which prompt's rows: the prompt at the time of its first frame in the finished video (the
        # inverted sampling makes the video's last section first)
        starts = [1 + 4 * window * k if k else 0 for k in range(sections)]
        per_section = timeline.segment_prompts(spec, starts, spec.fps or self.desc.defaults.fps)
        if sampling == INVERTED:
            per_section = per_section[::-1]
        req = FramepackRequest(spec=spec, num_steps=sections * steps, batch_key=(), num_frames=frames,
                               conditions=conditions, section_prompts=per_section, image_latents=image_latents.float(),
                               last_latents=None if last_latents is None else last_latents.float(),
                               generator=generator, sampling=sampling, window=window, sections=sections,
                               history=history)
        req.frames = SectionStream(self.pipe, self.pg.rank, spec.output, frames, window, sampling)
        self._start_section(req)
        return req

    def section_scheduler(self, spec: GenerationSpec, window: int, h: int, w: int):
        """The pipeline's per-section schedule: sigmas 1 -> 0 shifted by `mu` of a section's tokens, capped at
        log(7) (FramePack's `exp_max`)."""
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video_framepack import (
            calculate_shift,
            retrieve_timesteps,
        )

        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        c = scheduler.config
        seq_len = window * h * w / self.pipe.transformer.config.patch_size ** 2
        mu = min(calculate_shift(seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                 c.get("base_shift", 0.5), c.get("max_shift", 1.15)), math.log(7.0))
        steps = spec.num_inference_steps
        retrieve_timesteps(scheduler, steps, self.pg.device, sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1], mu=mu)
        return scheduler

    def _start_section(self, r: FramepackRequest) -> None:
        """The section's noise, schedule, packed history and its frame indices, as the pipeline lays them out."""
        k, window, sizes = r.section, r.window, HISTORY[r.sampling]
        B, C, _, h, w = r.image_latents.shape
        if r.sampling == INVERTED:
            paddings = list(reversed(range(r.sections)))
            if r.sections > 4:
                paddings = [3] + [2] * (r.sections - 3) + [1, 0]
            pad = paddings[k] * window
            prefix, _, latents_idx, idx_1x, idx_2x, idx_4x = torch.arange(sum([1, pad, window, *sizes])).split(
                [1, pad, window, *sizes])
            h1, h2, h4 = r.history[:, :, :sum(sizes)].split(sizes, dim=2)
            if r.last_latents is not None and k == 0:
                h1 = r.last_latents
        else:
            pad = 0
            prefix, idx_4x, idx_2x, idx_1x, latents_idx = torch.arange(sum([1, *sizes, window])).split(
                [1, *sizes, window])
            h4, h2, h1 = r.history[:, :, -sum(sizes):].split(sizes, dim=2)
        r.indices = {"indices_latents": latents_idx, "indices_latents_clean": torch.cat([prefix, idx_1x]),
                     "indices_latents_history_2x": idx_2x, "indices_latents_history_4x": idx_4x}
        r.packed = {"latents_clean": torch.cat([r.image_latents, h1], dim=2), "latents_history_2x": h2,
                    "latents_history_4x": h4}
        r.latents = torch.randn((B, C, window, h, w), generator=r.generator, dtype=torch.float32).to(self.pg.device)
        r.scheduler, r.section_step = self.section_scheduler(r.spec, window, h, w), 0
        r.batch_key = ("framepack", B, C, window, h, w, r.sampling, pad)

    def inputs(self, r: FramepackRequest) -> dict:
        B = r.latents.shape[0]
        t = r.scheduler.timesteps[r.section_step]
        guidance = torch.full((B,), r.spec.guidance_scale, device=r.latents.device).to(self.dtype) * 1000.0
        return {"hidden_states": r.latents.to(self.dtype), "timestep": t.expand(B), "guidance": guidance,
                **{k: v.to(self.dtype) for k, v in r.packed.items()},
                **self.prompt_conditions(r), "image_embeds": r.conditions["image_embeds"], **r.indices}

    def prompt_conditions(self, r: FramepackRequest) -> dict:
        """The section's prompt tensors (a timeline's distinct prompts are stacked, B rows each)."""
        B, p = r.latents.shape[0], r.section_prompts[r.section]
        return {k: r.conditions[k][p * B:(p + 1) * B] for k in CONDITIONS if k != "image_embeds"}

    def forward(self, model, inputs: dict, cfg_parallel: bool) -> torch.Tensor:
        # one set of frame indices per batch (the batch key holds the section's layout)
        args = {k: (v[0] if k.startswith("indices_") else torch.cat(v)) for k, v in inputs.items()}
        return self.transformer(args, self.sp).float()                    # (B, C, window, h, w)

    def guide(self, r: FramepackRequest, out: torch.Tensor) -> torch.Tensor:
        return out                        # guidance-distilled: one row, its guidance embedded

    def advance(self, r: FramepackRequest, pred: torch.Tensor) -> None:
        t = r.scheduler.timesteps[r.section_step]
        r.latents = r.scheduler.step(pred, t, r.latents, return_dict=False)[0]
        r.section_step += 1
        r.steps_done += 1
        if r.section_step == len(r.scheduler.timesteps):
            self._finish_section(r)

    def _finish_section(self, r: FramepackRequest) -> None:
        """The section's latents join the history (its 19 frames kept) and go to the stream with the frames the
        pipeline decodes them with (the section before's, and the image's where it belongs)."""
        first, last = r.section == 0, r.section == r.sections - 1
        new, window = r.latents, r.window
        if r.sampling == INVERTED:
            if last:
                new = torch.cat([r.image_latents, new], dim=2)
            r.history = torch.cat([new, r.history], dim=2)[:, :, :sum(HISTORY[INVERTED])]
            decode = new if first else torch.cat([new, r.previous], dim=2)
        else:
            r.history = torch.cat([r.history, new], dim=2)[:, :, -sum(HISTORY[VANILLA]):]
            decode = torch.cat([r.image_latents, new], dim=2) if first else torch.cat([r.previous, new], dim=2)
        r.previous = r.latents[:, :, :window]
        r.frames.push(decode, first=first, last=last, new=new)
        r.section += 1
        if r.section < r.sections:
            self._start_section(r)
        else:
            r.latents = r.history = r.previous = None

    def vae_decoder(self, spec, latents):            # the SectionStream decodes (diffusers' whole-section decode)
        raise NotImplementedError


FAMILY = FramepackFamily
