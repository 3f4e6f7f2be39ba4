"""The Wan family (`WanPipeline`: Wan 2.1, Wan 2.2 with two experts; `SkyReelsV2Pipeline`): full-attention
video DiTs, sharded on the sequence of F x H x W tokens by hooks on diffusers' own modules
(`engine/models/wan.py`: Ulysses, Ring, USP; CFG-parallel around them). This module is the
adapter: loading, prompts, latents, the expert of each step, and the streaming VAE decode.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.cache import StepCache, WanStepCache
from engine.config import MAX_STEPS, ModelDescription
from engine.families.base import (
    VideoFamily,
    WorkerRequest,
    cfg_rows,
    check_cache_option,
    check_common,
    check_number,
    generation_defaults,
    read_json,
    scheduler_step_kwargs,
    seeded_generator,
    to_pixels,
)
from engine.models.wan import WanSequenceParallel
from engine.offload import ExpertResidency
from engine.parallel import ParallelPlan, make_cfg_groups, make_sequence_parallel
from engine.request import GenerationSpec, RequestError

MAX_SEQUENCE_LENGTH = 512            # the prompt length both pipelines pad UMT5's output to
#: a fixed schedule instead of the scheduler's own spacing (few-step distilled models and LoRAs): a request
#: option, or the checkpoint's generation_defaults.json (see `check_schedule`)
SCHEDULE_OPTIONS = ("sigmas", "timesteps")
#: step caching on the Wan family: diffusers' FirstBlockCache and MagCache, per request (engine/cache.py)
CACHE_KINDS = ("first_block", "mag")


def vae_factors(vae_config: dict) -> tuple[int, int]:
    """(spatial, temporal) compression of an `AutoencoderKLWan` config."""
    down = vae_config.get("temperal_downsample", [False, True, True])
    spatial = vae_config.get("scale_factor_spatial") or 2 ** len(down)
    temporal = vae_config.get("scale_factor_temporal") or 2 ** sum(down)
    return spatial, temporal


def decoded_frames(latent_frames: int, temporal: int) -> int:
    """Pixel frames a causal VAE makes of `latent_frames` (the first latent frame is one frame)."""
    return 0 if latent_frames <= 0 else 1 + (latent_frames - 1) * temporal


@dataclass
class WanRequest(WorkerRequest):
    timesteps_cpu: list = None         # the scheduler's timesteps as floats: decisions without a device sync
    pending: torch.Tensor = None       # final latent frames not decoded yet (B, C, k, h, w)
    decoder: object = None             # the streaming VAE decoder, once decoding started
    latents_decoded: int = 0

    def decodable(self) -> bool:
        return self.pending is not None and self.pending.shape[2] > 0


class WanFamily(VideoFamily):
    """`WanPipeline` (Wan 2.1; Wan 2.2 with `transformer_2` and `boundary_ratio`) and `SkyReelsV2Pipeline`."""

    name = "wan"
    plans = ("ulysses", "ring", "usp")
    auto_plan = "sequence"
    cache_kinds = CACHE_KINDS
    #: diffusers' own defaults, per pipeline class (`__call__` signatures), and the fps the models were trained at
    pipeline_defaults = {
        "WanPipeline": {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50,
                        "guidance_scale": 5.0, "fps": 16},
        "SkyReelsV2Pipeline": {"height": 544, "width": 960, "num_frames": 97, "num_inference_steps": 50,
                               "guidance_scale": 6.0, "fps": 24},
    }
    pipeline_classes = frozenset(pipeline_defaults)
    request_class = WanRequest
    #: Wan 2.2 TI2V's per-token timesteps (`expand_timesteps` in model_index.json): engine/families/wan_ti2v.py
    expand_timesteps = False
    supports_lora = True
    supports_compile = True

    @classmethod
    def describe(cls, model_dir: Path) -> ModelDescription:
        model_dir = Path(model_dir)
        index = read_json(model_dir / "model_index.json")
        experts = [name for name in ("transformer", "transformer_2") if (index.get(name) or [None])[0]]
        cfg = read_json(model_dir / experts[0] / "config.json")
        spatial, temporal = vae_factors(read_json(model_dir / "vae" / "config.json"))
        two_experts = len(experts) == 2 and index.get("boundary_ratio") is not None
        if bool(index.get("expand_timesteps")) != cls.expand_timesteps:
            raise ValueError(f"{model_dir}: expand_timesteps is {bool(index.get('expand_timesteps'))}; the "
                             f"{cls.name} family serves checkpoints where it is {cls.expand_timesteps}")
        options = (*(("guidance_scale_2",) if two_experts else ()), *SCHEDULE_OPTIONS, "cache")
        mag_ratios = read_mag_ratios(model_dir)
        return ModelDescription(
            family=cls.name, pipeline=index["_class_name"], heads=cfg["num_attention_heads"],
            size_multiple=spatial * cfg["patch_size"][1], frame_multiple=temporal * cfg["patch_size"][0],
            defaults=generation_defaults(model_dir, cls.pipeline_defaults[index["_class_name"]]),
            options=options, capabilities=cls.capabilities(options, two_experts=two_experts,
                                                           mag_calibration=mag_ratios is not None),
            extra={"boundary_ratio": index.get("boundary_ratio") if two_experts else None,
                   "scheduler_config": read_json(model_dir / "scheduler" / "scheduler_config.json"),
                   # MagCache's calibration, when the checkpoint carries one: [ratios] or [[expert 1], [expert 2]]
                   "mag_ratios": mag_ratios})

    @classmethod
    def check_request(cls, desc: ModelDescription, spec: GenerationSpec) -> GenerationSpec:
        check_schedule(desc, spec)
        check_common(desc, spec)
        if "guidance_scale_2" in spec.options:
            check_number("guidance_scale_2", spec.options["guidance_scale_2"], 0, 100)
        return check_cache_option(spec, cls.cache_kinds, desc.extra.get("mag_ratios"))

    def __init__(self, ctx, config):
        import diffusers

        super().__init__(ctx, config)
        if config.engine.attention == "xformers":
            raise ValueError("attention='xformers' is not available for the Wan family (it uses PyTorch SDPA)")
        desc = self.describe(Path(config.model_dir))
        offload = config.engine.offload == "expert" and desc.capabilities.two_experts
        self.pipe = self.load_pipeline(getattr(diffusers, self.pipeline_class(desc)), self.component_dtypes(),
                                       on_host=("transformer", "transformer_2") if offload else ())
        if config.engine.loras:          # before the plan's hooks and the offload's copies, which must include them
            from engine.lora import LoraSet

            self.lora = LoraSet(self.pipe, config.engine.loras)
        self.desc = desc
        experts = [m for m in (self.pipe.transformer, getattr(self.pipe, "transformer_2", None)) if m is not None]
        # FP8 first (the compiled graph then takes its float8 matmuls), and both before any hook: a compiled block's
        # forward must be the innermost one the hooks wrap (engine/compile.py)
        if config.engine.quantize == "fp8":
            from engine.quantize import quantize_fp8

            for m in experts:
                quantize_fp8(m)
        if config.engine.compile == "blocks":
            from engine.compile import compile_blocks

            for m in experts:
                compile_blocks(m.blocks, config.engine.compile_backend)
        # step caching's hooks go on first, so they see a block's input after the sequence-parallel cut
        self.step_cache = StepCache(blocks=len(experts[0].blocks))
        for m in experts:
            WanStepCache(m, self.step_cache)
        self.experts = [WanSequenceParallel(m) for m in experts]
        #: expert offload (engine/offload.py): which expert is on the device; None when both are
        self.residency = ExpertResidency(experts, self.pg.device) if offload else None
        self.vae_spatial, self.vae_temporal = vae_factors(dict(self.pipe.vae.config))
        self.boundary = (desc.extra["boundary_ratio"] * self.pipe.scheduler.config.num_train_timesteps
                         if desc.capabilities.two_experts else None)
        self.set_plan(config.plan)

    def pipeline_class(self, desc: ModelDescription) -> str:
        """The diffusers pipeline class the workers load the checkpoint into: the one its index names."""
        return desc.pipeline

    def component_dtypes(self) -> dict:
        """The VAE stays in float32 (diffusers' Wan examples load it so); the rest in `dtype`."""
        return {"default": self.dtype, "vae": torch.float32}

    def set_plan(self, plan: ParallelPlan) -> None:
        """Build the worker groups of `plan` (collective: every rank calls it)."""
        pg = self.pg
        if plan.cfg_parallel and pg.world_size > 1:
            self.cfg_groups = make_cfg_groups(pg)
            ranks = list(range(pg.world_size))
            halves = [ranks[:len(ranks) // 2], ranks[len(ranks) // 2:]]
            # new_group is collective over the world: build both halves' groups on every rank
            sps = [make_sequence_parallel(self.cfg_groups.half if i == self.cfg_groups.index else None, plan.name,
                                          plan.ulysses_degree, members=m) for i, m in enumerate(halves)]
            self.sp_cfg = sps[self.cfg_groups.index]
        else:
            self.cfg_groups, self.sp_cfg = None, None
        self.sp = make_sequence_parallel(pg, plan.name, plan.ulysses_degree)
        self.plan = plan

    # -- a request ----------------------------------------------------------------------------------

    def expert(self, t: float) -> int:
        """Wan 2.2: the high-noise expert for t >= boundary, the low-noise one below (index 0 / 1)."""
        return 0 if self.boundary is None or t >= self.boundary else 1

    def batch_key(self, r: WanRequest) -> tuple:
        """Latent shape and expert; it also records the expert as the request's `model` (the scheduler groups
        batches by it under expert offload)."""
        expert = self.expert(r.timesteps_cpu[r.steps_done]) if r.steps_done < r.num_steps else -1
        r.model = max(expert, 0)
        return ("wan", *r.latents.shape, expert)

    def encode_prompt(self, spec: GenerationSpec):
        """UMT5 embeddings, zero-padded to 512 tokens as the pipelines do (rank 0 only)."""
        return self.pipe.encode_prompt(prompt=spec.prompt, negative_prompt=spec.negative_prompts(),
                                       do_classifier_free_guidance=spec.use_cfg, num_videos_per_prompt=1,
                                       max_sequence_length=MAX_SEQUENCE_LENGTH, device=self.pg.device)

    def latent_shape(self, spec: GenerationSpec, frames: int) -> tuple:
        return (spec.batch_size, self.pipe.vae.config.z_dim, frames,
                spec.height // self.vae_spatial, spec.width // self.vae_spatial)

    def prepare(self, spec: GenerationSpec, text: torch.Tensor) -> WanRequest:
        scheduler = self.new_scheduler(spec.num_inference_steps,
                                       **{k: spec.options[k] for k in SCHEDULE_OPTIONS if k in spec.options})
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        generator = seeded_generator(spec.seed)
        shape = self.latent_shape(spec, (spec.num_frames - 1) // self.vae_temporal + 1)
        latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(self.pg.device)  # prepare_latents
        req = self.request_class(spec=spec, num_steps=len(scheduler.timesteps), batch_key=(),
                                 num_frames=spec.num_frames, text=text, scheduler=scheduler, latents=latents,
                                 timesteps_cpu=scheduler.timesteps.tolist(),
                                 step_kwargs=scheduler_step_kwargs(scheduler, generator))
        req.batch_key = self.batch_key(req)
        return req

    def model_for(self, reqs: list[WanRequest]):
        i = self.expert(reqs[0].timesteps_cpu[reqs[0].steps_done])
        if self.residency is not None:
            t0 = time.perf_counter()
            if self.residency.use(i):     # the batch that needed the swap pays for it, in its requests' info
                for r in reqs:
                    r.timings["expert_swaps"] = r.timings.get("expert_swaps", 0) + 1
                    r.timings["swap_s"] = r.timings.get("swap_s", 0.0) + (time.perf_counter() - t0) / len(reqs)
        return self.experts[i]

    def cache_scope(self, reqs: list[WanRequest]) -> int:
        return self.expert(reqs[0].timesteps_cpu[reqs[0].steps_done])       # each expert its own cache state

    def cache_steps(self, r: WanRequest, scope: int) -> int:
        return sum(self.expert(t) == scope for t in r.timesteps_cpu)

    def inputs(self, r: WanRequest) -> dict:
        x = cfg_rows(r, r.latents).to(self.dtype)                                 # (2B|B, C, F, h, w)
        return {"x": x, "t": r.scheduler.timesteps[r.steps_done].reshape(1).expand(x.shape[0]), "text": r.text}

    def forward(self, model, inputs: dict, cfg_parallel: bool) -> torch.Tensor:
        x, t, text = (torch.cat(inputs[k]) for k in ("x", "t", "text"))
        image = torch.cat(inputs["image"]) if "image" in inputs else None        # image-to-video's CLIP tokens
        return model(x, t.to(self.pg.device), text, self.sp_cfg if cfg_parallel else self.sp,
                     cfg=self.cfg_groups if cfg_parallel else None, image=image)  # (rows, C, F, h, w)

    def guidance_scale(self, r: WanRequest) -> float:
        if self.expert(r.timesteps_cpu[r.steps_done]) == 0:
            return r.spec.guidance_scale
        return r.spec.options.get("guidance_scale_2", r.spec.guidance_scale)

    def advance(self, r: WanRequest, pred: torch.Tensor) -> None:
        super().advance(r, pred)
        if r.denoised:
            r.pending = r.latents
        r.batch_key = self.batch_key(r)

    # -- decoding ----------------------------------------------------------------------------------

    def unnormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """The pipelines' `latents / (1 / std) + mean`, in the VAE's dtype."""
        vae = self.pipe.vae
        z = vae.config.z_dim
        latents = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        return latents / inv_std + mean

    def start_decoder(self, latents: torch.Tensor):
        """A streaming decoder for videos shaped like `latents` (B, C, k, h, w): untiled, as diffusers' Wan
        pipelines decode, or in diffusers' default tiles (`vae.enable_tiling()`) with `vae_tiling`."""
        from engine.causal_vae import StreamingVAEDecoder, VAETiling

        B, _, _, h, w = latents.shape
        return StreamingVAEDecoder(self.pipe.vae, self.pg, B, h, w, tiling=VAETiling() if self.vae_tiling else None)

    def decode(self, r: WanRequest, max_frames: int):
        """The next final latent frames whose pixels fit in `max_frames` (at least one), through the request's
        streaming decoder across the workers (collective); rank 0 gets pixels (B, n, H, W, 3)."""
        start = r.decoded_frames
        k = 1
        while (k < r.pending.shape[2] and
               decoded_frames(r.latents_decoded + k + 1, self.vae_temporal) - start <= max_frames):
            k += 1
        chunk, r.pending = r.pending[:, :, :k], r.pending[:, :, k:]
        if r.decoder is None:
            r.decoder = self.start_decoder(chunk)
        with torch.no_grad():
            video = r.decoder.decode(self.unnormalize(chunk))                    # (B, 3, n, H, W) on rank 0
        r.latents_decoded += k
        r.decoded_frames = decoded_frames(r.latents_decoded, self.vae_temporal)
        if r.decoded_frames >= r.num_frames:
            r.decoder.close()
            r.decoder = None
        return None if video is None else to_pixels(video, self.pipe.video_processor, r.spec.output)


def read_mag_ratios(model_dir: Path) -> list | None:
    """A checkpoint's `mag_ratios.json` (`{"mag_ratios": [...]}`, per expert a list of lists), checked as a
    request's `cache.mag_ratios` is; None without one."""
    path = Path(model_dir) / "mag_ratios.json"
    if not path.is_file():
        return None
    from engine.cache import _mag_ratios

    try:
        return _mag_ratios(read_json(path).get("mag_ratios"), "mag_ratios")
    except RequestError as e:
        raise ValueError(f"{path}: {e}") from None


def check_schedule(desc: ModelDescription, spec: GenerationSpec) -> None:
    """A fixed schedule, `sigmas` or `timesteps`, set as diffusers' `retrieve_timesteps` sets it (RequestError naming
    the option); the list decides the step count, as in diffusers, so `num_inference_steps` becomes its length.

    A checkpoint's generation_defaults.json may carry one (a few-step distilled model: `"num_inference_steps": 4,
    "guidance_scale": 1.0, "sigmas": [...]`); it applies to a request that gives no list and asks for as many
    steps as it has (the default step count does), so asking for another count gets the scheduler's own spacing.
    Whether the checkpoint's scheduler takes the list is its own call: it is set on a copy here (Wan's
    `UniPCMultistepScheduler` takes `sigmas`, before its `flow_shift`, and no `timesteps`;
    `FlowMatchEulerDiscreteScheduler` takes both)."""
    import diffusers
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

    o, defaults = spec.options, desc.defaults.options
    given = [k for k in SCHEDULE_OPTIONS if o.get(k) is not None]
    if not given:
        given = [k for k in SCHEDULE_OPTIONS if isinstance(defaults.get(k), list)
                 and len(defaults[k]) == spec.num_inference_steps][:1]
        if not given:
            return
        spec.options = o = {**o, given[0]: defaults[given[0]]}
    if len(given) > 1:
        raise RequestError("timesteps", "give sigmas or timesteps, not both")
    name = given[0]
    values = o[name]
    if not isinstance(values, (list, tuple)) or not 1 <= len(values) <= MAX_STEPS or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in values):
        raise RequestError(name, f"{name} must be a list of 1 to {MAX_STEPS} numbers; got {values!r}")
    high = 1.0 if name == "sigmas" else desc.extra["scheduler_config"].get("num_train_timesteps", 1000)
    if not all(0 < v <= high for v in values) or any(a <= b for a, b in zip(values, values[1:])):
        raise RequestError(name, f"{name} must decrease strictly, within (0, {high:g}]; got {list(values)}")
    config = desc.extra["scheduler_config"]
    scheduler = getattr(diffusers, config["_class_name"]).from_config(config)
    try:
        retrieve_timesteps(scheduler, None, "cpu", **{name: np.asarray(values, dtype=np.float64)})
    except (ValueError, TypeError) as e:
        raise RequestError(name, f"{name}: this model's {config['_class_name']} refuses it: {e}") from None
    spec.options = {**o, name: [float(v) for v in values]}
    spec.num_inference_steps = len(values)


FAMILY = WanFamily
