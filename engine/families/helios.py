"""Helios (`HeliosPipeline` checkpoints): real-time long video, chunk by chunk, with a compressed history.

A video is made of chunks of `num_latent_frames_per_chunk` latent frames (9: 33 video frames). Each chunk
starts from fresh noise and is denoised in `num_inference_steps` steps while the transformer reads the
history: the last `sum(history_sizes)` latent frames made so far ([16, 2, 1]: 16 at 4x compression, 2 at 2x,
1 at full resolution, plus the video's first latent frame as a prefix), all zeros before the first chunk.
The arguments and their meaning are diffusers' (`HeliosPipeline.__call__`); the schedule (the
`HeliosScheduler`, reset at every chunk with the chunk's `mu`), the history layout and the per-chunk
VAE decode are diffusers' own. What differs is where things happen:

- every step of every chunk is one parallel forward across the workers (Ulysses, Ring, USP over the
  sequence of history and chunk tokens, `engine/models/helios.py`; CFG-parallel around them);
- the request is one long sequence of steps for the engine's scheduler (it batches with other Helios
  requests of the same chunk shape, reports progress per step, cancels at the next step);
- when a chunk is done it is final: the scheduler decodes it (diffusers decodes each chunk on its own,
  so a fresh streaming decoder per chunk equals it) and hands its frames out while the next chunk
  denoises. A worker keeps only the history the transformer reads (`sum(history_sizes)` latent frames and
  the first-frame prefix), the current chunk and the chunk being decoded: memory does not grow with
  `num_frames` (diffusers keeps every latent and every decoded frame until the end).

Frames: `num_frames` asks for ceil(num_frames / 33) chunks; the video is their frames cut to 4k+1, as
diffusers cuts it (4 chunks: 132 frames made, 129 handed out).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from longserve.engine import timeline
from longserve.engine.config import FamilyFacts, ModelDescription
from longserve.engine.decoding import FramesPolicy, decoded_frames
from longserve.engine.families.base import (
    Denoisers,
    VideoFamily,
    WorkerRequest,
    cfg_rows,
    check_common,
    check_int,
    generation_defaults,
    read_json,
    seeded_generator,
)
from longserve.engine.families.wan_parts import MAX_SEQUENCE_LENGTH, WanParts, vae_factors
from longserve.engine.models.helios import HeliosSequenceParallel
from longserve.engine.request import GenerationSpec, RequestError

OPTIONS = ("history_sizes", "num_latent_frames_per_chunk", "sigmas", timeline.OPTION)
HISTORY = ("latents_history_long", "latents_history_mid", "latents_history_short")


def history_indices(history_sizes: list[int], chunk: int) -> dict[str, torch.Tensor]:
    """The frame indices diffusers' pipeline gives the forward (keep_first_frame): the first frame's prefix at 0,
    then the long, mid and 1x histories, then the chunk. Each (1, n)."""
    prefix, long, mid, short_1x, hidden = torch.arange(0, 1 + sum(history_sizes) + chunk).split(
        [1, *history_sizes, chunk])
    return {"indices_hidden_states": hidden[None], "indices_latents_history_short": torch.cat([prefix, short_1x])[None],
            "indices_latents_history_mid": mid[None], "indices_latents_history_long": long[None]}


def chunk_frames(chunk: int, temporal: int) -> int:
    """Video frames a chunk decodes to (33 for 9 latent frames)."""
    return decoded_frames(chunk, temporal)


def video_frames(num_frames: int, chunk: int, temporal: int) -> tuple[int, int]:
    """(chunks, frames handed out) for a request of `num_frames`: whole chunks, cut to 4k+1 as diffusers cuts."""
    window = chunk_frames(chunk, temporal)
    chunks = max(1, -(-num_frames // window))
    return chunks, (chunks * window - 1) // temporal * temporal + 1


@dataclass(frozen=True)
class HeliosFacts(FamilyFacts):
    temporal: int                         # the VAE's time compression (a chunk's frames)


@dataclass
class HeliosRequest(WorkerRequest):
    generator: torch.Generator = None     # draws every chunk's noise, in order (as diffusers)
    history_sizes: tuple = (16, 2, 1)     # long, mid, 1x
    chunk: int = 9                        # latent frames per chunk
    chunks: int = 1
    index: int = 0                        # the chunk being denoised
    stage: int = 0                        # its stage (the pyramid's resolutions; one stage without a pyramid)
    stage_step: int = 0                   # the step within the stage: the scheduler's timestep index
    start_point: torch.Tensor = None      # the stage's starting latents (the distilled DMD scheduler renoises to them)
    history: torch.Tensor = None          # (B, C, sum(history_sizes), h, w) float32: the last latent frames made
    prefix: torch.Tensor = None           # (B, C, 1, h, w): the video's first latent frame (zeros before it exists)
    texts: list = None                    # each distinct prompt's rows, like `text` (one without a timeline)
    chunk_prompts: list = None            # per chunk, which of them conditions it (engine/timeline.py)


class HeliosFamily(WanParts, VideoFamily):
    """`HeliosPipeline` checkpoints: text-to-video of any length in chunks with a multi-scale history."""

    name = "helios"
    dispatcher_attention = True             # attention_backend: cross-attention (diffusers') and self-attention (ours)
    plans = ("ulysses", "ring", "usp")
    auto_plan = "sequence"
    #: diffusers' `HeliosPipeline.__call__` defaults; Helios makes 24 fps video
    pipeline_defaults = {"HeliosPipeline": {"height": 384, "width": 640, "num_frames": 132, "num_inference_steps": 50,
                                            "guidance_scale": 5.0, "fps": 24, "history_sizes": [16, 2, 1],
                                            "num_latent_frames_per_chunk": 9}}
    pipeline_classes = frozenset(pipeline_defaults)

    @classmethod
    def describe(cls, model_dir: Path) -> ModelDescription:
        model_dir = Path(model_dir)
        index = read_json(model_dir / "model_index.json")
        cfg = read_json(model_dir / "transformer" / "config.json")
        spatial, temporal = vae_factors(read_json(model_dir / "vae" / "config.json"))
        patch = cfg.get("patch_size", [1, 2, 2])
        return ModelDescription(
            family=cls.name, pipeline=index["_class_name"], heads=cfg.get("num_attention_heads", 40),
            # diffusers' check_inputs: height and width divisible by 16 (and whole patches)
            size_multiple=math.lcm(16, spatial * patch[1]), frame_multiple=1,
            defaults=generation_defaults(model_dir, cls.pipeline_defaults[index["_class_name"]]),
            options=OPTIONS, capabilities=cls.capabilities(OPTIONS, long_video=True),
            facts=HeliosFacts(temporal=temporal))

    @classmethod
    def check_request(cls, desc: ModelDescription, spec: GenerationSpec) -> GenerationSpec:
        spec = timeline.check_timeline(spec, spec.fps or desc.defaults.fps)        # a prompt per chunk
        check_common(desc, spec)
        o, d = spec.options, desc.defaults.options
        sizes = o.get("history_sizes", d.get("history_sizes", [16, 2, 1]))
        if not isinstance(sizes, (list, tuple)) or len(sizes) != 3:
            raise RequestError("history_sizes", f"history_sizes must be a list of 3 integers (long, mid, short "
                                                f"history in latent frames, as [16, 2, 1]); got {sizes!r}")
        for v in sizes:
            check_int("history_sizes", v, 1, 1024)
        chunk = o.get("num_latent_frames_per_chunk", d.get("num_latent_frames_per_chunk", 9))
        check_int("num_latent_frames_per_chunk", chunk, 1, 256)
        sigmas = o.get("sigmas")
        if sigmas is not None:
            if not isinstance(sigmas, (list, tuple)) or len(sigmas) != spec.num_inference_steps or any(
                    isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1 for v in sigmas):
                raise RequestError("sigmas", f"sigmas must be a list of num_inference_steps "
                                             f"({spec.num_inference_steps}) numbers in [0, 1]; got {sigmas!r}")
        spec.options = {**o, "history_sizes": sorted((int(v) for v in sizes), reverse=True),
                        "num_latent_frames_per_chunk": int(chunk)}
        return spec

    @classmethod
    def content_frames(cls, desc: ModelDescription, spec: GenerationSpec) -> int:
        chunk = spec.options.get("num_latent_frames_per_chunk", 9)
        return video_frames(spec.num_frames, chunk, desc.facts.temporal)[1]

    # -- worker side: loading ---------------------------------------------------------------------

    def __init__(self, ctx, config):
        import diffusers

        super().__init__(ctx, config)
        self.refuse_xformers(config)
        self.desc = self.describe(Path(config.model_dir))
        self.pipe = self.load_pipeline(getattr(diffusers, self.desc.pipeline), self.component_dtypes())
        # no FP8, compile or step caching: its own hooks around a chunk's forward (docs/design.md)
        self.experts = self.load_denoisers(Denoisers((self.pipe.transformer,)))
        self.vae_spatial, self.vae_temporal = vae_factors(dict(self.pipe.vae.config))
        self.set_plan(config.plan)

    def shard(self, denoiser):
        return HeliosSequenceParallel(denoiser)

    # -- a request ----------------------------------------------------------------------------------

    def batch_key(self, r: HeliosRequest) -> tuple:
        if r.denoised:
            return ("helios", "done")
        return ("helios", *r.latents.shape, r.history_sizes)

    def encode_conditions(self, spec: GenerationSpec) -> dict[str, torch.Tensor]:
        """Rank 0: a prompt timeline's other prompts (engine/timeline.py), each once."""
        return timeline.encode_other_prompts(self.pipe, spec, self.pg.device, MAX_SEQUENCE_LENGTH)

    def prepare(self, spec: GenerationSpec, text: torch.Tensor, prompt_texts: torch.Tensor = None) -> HeliosRequest:
        o = spec.options
        sizes, chunk = tuple(o["history_sizes"]), o["num_latent_frames_per_chunk"]
        chunks, frames = video_frames(spec.num_frames, chunk, self.vae_temporal)
        h, w = spec.height // self.vae_spatial, spec.width // self.vae_spatial
        B, C = spec.batch_size, self.pipe.transformer.config.in_channels
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        # every chunk's steps, as the pipeline's schedule makes them (the request's scheduler, set again at every
        # stage); the first chunk may differ (the distilled pyramid's is_amplify_first_chunk)
        counts = [sum(self.stage_steps(scheduler, spec, stage, first) for stage in range(self.stages(spec)))
                  for first in (True, False)]
        req = HeliosRequest(spec=spec, num_steps=counts[0] + (chunks - 1) * counts[1], batch_key=(),
                            num_frames=frames, text=text, scheduler=scheduler, generator=seeded_generator(spec.seed),
                            history_sizes=sizes, chunk=chunk, chunks=chunks,
                            history=torch.zeros(B, C, sum(sizes), h, w, device=self.pg.device),
                            prefix=torch.zeros(B, C, 1, h, w, device=self.pg.device),
                            # each chunk decodes on its own, as diffusers decodes it
                            frames=self.frame_stream(spec, frames, FramesPolicy(self.vae_temporal, run=chunk)))
        # a prompt timeline: each chunk the prompt of its first frame's time (a chunk's frames decode on their own)
        window = chunk_frames(chunk, self.vae_temporal)
        req.chunk_prompts = timeline.segment_prompts(spec, [i * window for i in range(chunks)],
                                                     spec.fps or self.desc.defaults.fps)
        req.texts = timeline.prompt_rows(text, prompt_texts, spec.use_cfg)
        self._start_chunk(req)
        return req

    # -- the schedule: chunks, each of one stage here (the pyramid subclass has several) ------------------

    def stages(self, spec: GenerationSpec) -> int:
        return 1

    def set_timesteps(self, scheduler, spec: GenerationSpec, stage: int, first: bool, mu: float) -> None:
        """The stage's schedule, as `HeliosPipeline` sets it at every chunk."""
        steps, sigmas = spec.num_inference_steps, spec.options.get("sigmas")
        sigmas = np.linspace(0.999, 0.0, steps + 1)[:-1] if sigmas is None else np.asarray(sigmas, dtype=np.float64)
        scheduler.set_timesteps(steps, device=self.pg.device, sigmas=sigmas, mu=mu)

    def stage_steps(self, scheduler, spec: GenerationSpec, stage: int, first: bool) -> int:
        self.set_timesteps(scheduler, spec, stage, first, mu=1.0)          # the count does not depend on the shift
        return len(scheduler.timesteps)

    def chunk_start(self, noise: torch.Tensor) -> torch.Tensor:
        """The first stage's latents from the chunk's noise (B, C, chunk, h, w)."""
        return noise

    def stage_start(self, r: HeliosRequest) -> torch.Tensor:
        """A later stage's latents from the stage before (the pyramid's upsample and renoise)."""
        raise NotImplementedError

    def _start_chunk(self, r: HeliosRequest) -> None:
        """The chunk's noise (the request's generator, in order, as diffusers' `prepare_latents`)."""
        B, C, _, h, w = r.history.shape
        r.text = r.texts[r.chunk_prompts[r.index]]
        noise = torch.randn((B, C, r.chunk, h, w), generator=r.generator, dtype=torch.float32).to(self.pg.device)
        r.latents, r.stage = self.chunk_start(noise), 0
        self._start_stage(r)

    def _start_stage(self, r: HeliosRequest) -> None:
        """The scheduler reset to the stage's schedule (diffusers calls `set_timesteps` at every chunk and stage),
        with the shift `mu` of the latents the stage starts from, as the pipelines compute it."""
        from diffusers.pipelines.helios.pipeline_helios import calculate_shift

        config, p = self.pipe.scheduler.config, self.pipe.transformer.config.patch_size
        mu = calculate_shift(math.prod(r.latents.shape[2:]) // math.prod(p), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        self.set_timesteps(r.scheduler, r.spec, r.stage, r.index == 0, mu)
        if r.stage > 0:
            r.latents = self.stage_start(r)
        r.start_point, r.stage_step = r.latents, 0
        r.batch_key = self.batch_key(r)

    def model_for(self, reqs: list[HeliosRequest]):
        r = reqs[0]
        return functools.partial(self._forward_with_indices, history_indices(list(r.history_sizes), r.chunk))

    def _forward_with_indices(self, indices: dict, x, t, text, history: dict, sp):
        return self.experts[0](x, t, text, {**history, **indices}, sp)

    def inputs(self, r: HeliosRequest) -> dict:
        long, mid, short_1x = r.history.split(list(r.history_sizes), dim=2)
        short = torch.cat([r.prefix, short_1x], dim=2)                             # (B, C, 2, h, w)
        x = cfg_rows(r, r.latents).to(self.dtype)                                  # (2B|B, C, chunk, h', w')
        t = self.timestep(r).reshape(1).expand(x.shape[0])
        return {"x": x, "t": t, "text": r.text,
                **{name: cfg_rows(r, part).to(self.dtype) for name, part in zip(HISTORY, (long, mid, short))}}

    def timestep(self, r: HeliosRequest) -> torch.Tensor:
        """The forward's timestep: the scheduler's own (the pyramid pipeline casts it to int64)."""
        return r.scheduler.timesteps[r.stage_step]

    def forward(self, model, inputs: dict, cfg_parallel: bool) -> torch.Tensor:
        x, t, text = (torch.cat(inputs[k]) for k in ("x", "t", "text"))
        history = {name: torch.cat(inputs[name]) for name in HISTORY}
        return self.denoise(model, cfg_parallel, x, t.to(self.pg.device), text, history)   # (rows, C, chunk, h, w)

    def advance(self, r: HeliosRequest, pred: torch.Tensor) -> None:
        r.latents = self.scheduler_step(r, pred)
        r.steps_done += 1
        r.stage_step += 1
        if r.stage_step == len(r.scheduler.timesteps):
            if r.stage + 1 < self.stages(r.spec):
                r.stage += 1
                self._start_stage(r)
            else:
                self._finish_chunk(r)
        r.batch_key = self.batch_key(r)

    def scheduler_step(self, r: HeliosRequest, pred: torch.Tensor) -> torch.Tensor:
        t = r.scheduler.timesteps[r.stage_step]
        return r.scheduler.step(pred, t, r.latents, generator=r.generator, return_dict=False)[0]

    def _finish_chunk(self, r: HeliosRequest) -> None:
        """The chunk is final: into the history (only what the transformer reads is kept), out to decode."""
        new = r.latents                                                            # (B, C, chunk, h, w) float32
        if r.index == 0:
            r.prefix = new[:, :, :1].clone()         # keep_first_frame: the video's first latent frame, for good
        r.history = torch.cat([r.history, new], dim=2)[:, :, -sum(r.history_sizes):].contiguous()
        r.frames.push(new, last=r.index == r.chunks - 1)
        r.index += 1
        if r.index < r.chunks:
            self._start_chunk(r)
        else:
            r.latents = r.history = r.prefix = r.start_point = None


FAMILY = HeliosFamily
