"""The Wan family (`WanPipeline`: Wan 2.1, Wan 2.2 with two experts; `SkyReelsV2Pipeline`): full-attention
video DiTs, sharded on the sequence of F x H x W tokens by hooks on diffusers' own modules
(`engine/models/wan.py`: Ulysses, Ring, USP; CFG-parallel around them). This module is the
adapter: what it declares to the load pipeline, latents, and the expert of each step; the prompts, the
plan's groups and the streaming VAE decode are the Wan architecture's parts (engine/families/wan_parts.py).
"""

from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from longserve.engine.cache import WanStepCache
from longserve.engine.config import MAX_STEPS, FamilyFacts, ModelDescription
from longserve.engine.decoding import FramesPolicy
from longserve.engine.families.base import (
    Denoisers,
    VideoFamily,
    WorkerRequest,
    cfg_rows,
    check_common,
    check_number,
    generation_defaults,
    read_json,
    scheduler_step_kwargs,
    seeded_generator,
)
from longserve.engine.families.wan_parts import WanParts, vae_factors
from longserve.engine.models.wan import WanSequenceParallel
from longserve.engine.request import GenerationSpec, RequestError

#: a fixed schedule instead of the scheduler's own spacing (few-step distilled models and LoRAs): a request
#: option, or the checkpoint's generation_defaults.json (see `check_schedule`)
SCHEDULE_OPTIONS = ("sigmas", "timesteps")
#: step caching on the Wan family: diffusers' FirstBlockCache and MagCache, per request (engine/cache.py)
CACHE_KINDS = ("first_block", "mag")


@dataclass(frozen=True)
class WanFacts(FamilyFacts):
    scheduler_config: dict                # the checkpoint's scheduler_config.json (a fixed schedule is tried on it)
    boundary_ratio: float | None = None   # Wan 2.2: where the low-noise expert takes over (of the train timesteps)
    mag_ratios: list | None = None        # MagCache's calibration (mag_ratios.json): [ratios] or [[expert 1], [2]]


@dataclass
class WanRequest(WorkerRequest):
    timesteps_cpu: list = None         # the scheduler's timesteps as floats: decisions without a device sync


class WanFamily(WanParts, VideoFamily):
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
    dispatcher_attention = True             # attention_backend: cross-attention (diffusers') and self-attention (ours)

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
        options = (*(("guidance_scale_2",) if two_experts else ()), *SCHEDULE_OPTIONS, "cache", "cfg_trunc_ratio")
        mag_ratios = read_mag_ratios(model_dir)
        return ModelDescription(
            family=cls.name, pipeline=index["_class_name"], heads=cfg["num_attention_heads"],
            size_multiple=spatial * cfg["patch_size"][1], frame_multiple=temporal * cfg["patch_size"][0],
            defaults=generation_defaults(model_dir, cls.pipeline_defaults[index["_class_name"]]),
            options=options, capabilities=cls.capabilities(options, two_experts=two_experts,
                                                           mag_calibration=mag_ratios is not None),
            facts=WanFacts(scheduler_config=read_json(model_dir / "scheduler" / "scheduler_config.json"),
                           boundary_ratio=index.get("boundary_ratio") if two_experts else None, mag_ratios=mag_ratios))

    @classmethod
    def mag_ratios(cls, desc: ModelDescription) -> list | None:
        return desc.facts.mag_ratios

    @classmethod
    def check_request(cls, desc: ModelDescription, spec: GenerationSpec) -> GenerationSpec:
        check_schedule(desc, spec)
        check_common(desc, spec)
        if "guidance_scale_2" in spec.options:
            check_number("guidance_scale_2", spec.options["guidance_scale_2"], 0, 100)
        return cls.check_cache(desc, spec)

    def __init__(self, ctx, config):
        import diffusers

        super().__init__(ctx, config)
        self.refuse_xformers(config)
        self.desc = desc = self.describe(Path(config.model_dir))
        offload = config.engine.offload == "expert" and desc.capabilities.two_experts
        self.pipe = self.load_pipeline(getattr(diffusers, self.pipeline_class(desc)), self.component_dtypes(),
                                       on_host=("transformer", "transformer_2") if offload else ())
        if config.engine.loras:          # before the load pipeline's hooks and host copies, which must include them
            from longserve.engine.lora import LoraSet

            self.lora = LoraSet(self.pipe, config.engine.loras)
        experts = tuple(m for m in (self.pipe.transformer, getattr(self.pipe, "transformer_2", None)) if m is not None)
        self.experts = self.load_denoisers(Denoisers(experts, blocks=operator.attrgetter("blocks"),
                                                     cache_units=len(experts[0].blocks), cache_hooks=WanStepCache,
                                                     offload=offload))
        self.vae_spatial, self.vae_temporal = vae_factors(dict(self.pipe.vae.config))
        self.boundary = (desc.facts.boundary_ratio * self.pipe.scheduler.config.num_train_timesteps
                         if desc.capabilities.two_experts else None)
        self.set_plan(config.plan)

    def shard(self, denoiser):
        return WanSequenceParallel(denoiser)

    def pipeline_class(self, desc: ModelDescription) -> str:
        """The diffusers pipeline class the workers load the checkpoint into: the one its index names."""
        return desc.pipeline

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
                                 step_kwargs=scheduler_step_kwargs(scheduler, generator),
                                 frames=self.frame_stream(spec, spec.num_frames, FramesPolicy(self.vae_temporal)))
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
        return self.denoise(model, cfg_parallel, x, t.to(self.pg.device), text, image=image,
                            radial=self.config.engine.sparse_attention == "radial")  # (rows, C, F, h, w)

    def guidance_scale(self, r: WanRequest) -> float:
        if self.expert(r.timesteps_cpu[r.steps_done]) == 0:
            return r.spec.guidance_scale
        return r.spec.options.get("guidance_scale_2", r.spec.guidance_scale)

    def advance(self, r: WanRequest, pred: torch.Tensor) -> None:
        super().advance(r, pred)
        r.batch_key = self.batch_key(r)


def read_mag_ratios(model_dir: Path) -> list | None:
    """A checkpoint's `mag_ratios.json` (`{"mag_ratios": [...]}`, per expert a list of lists), checked as a
    request's `cache.mag_ratios` is; None without one."""
    path = Path(model_dir) / "mag_ratios.json"
    if not path.is_file():
        return None
    from longserve.engine.cache import checked_mag_ratios

    try:
        return checked_mag_ratios(read_json(path).get("mag_ratios"), "mag_ratios")
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
    config = desc.facts.scheduler_config
    high = 1.0 if name == "sigmas" else config.get("num_train_timesteps", 1000)
    if not all(0 < v <= high for v in values) or any(a <= b for a, b in zip(values, values[1:])):
        raise RequestError(name, f"{name} must decrease strictly, within (0, {high:g}]; got {list(values)}")
    scheduler = getattr(diffusers, config["_class_name"]).from_config(config)
    try:
        retrieve_timesteps(scheduler, None, "cpu", **{name: np.asarray(values, dtype=np.float64)})
    except (ValueError, TypeError) as e:
        raise RequestError(name, f"{name}: this model's {config['_class_name']} refuses it: {e}") from None
    spec.options = {**o, name: [float(v) for v in values]}
    spec.num_inference_steps = len(values)


FAMILY = WanFamily
