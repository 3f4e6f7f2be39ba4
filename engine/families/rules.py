"""What a model family says on the coordinator: its rules (`FamilyRules`). Read from JSON configs only, no weights,
no torch work, and no model code imported: the engine's door, the scheduler and the server ask a family these
questions before any worker runs (the worker side is `engine/families/base.py`).

- `describe(model_dir)` -> `ModelDescription`: heads, defaults, size multiple, frame rule, options;
- `auto_plan`, `plans`, `resolve_plan`: which parallel plans it supports and which "auto" picks;
- `check_request(desc, spec)`: validate a request (RequestError naming the field), so nothing a worker would refuse
  is ever sent to the workers. This is the one validation of a request's model-facing fields; front doors add only
  their own limits;
- costs: `content_frames` (the frames a request hands out), `kv_bytes` (the KV cache it holds per worker).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from longserve.engine.config import MAX_STEPS, REQUIRED, Capabilities, GenerationDefaults, ModelDescription
from longserve.engine.request import OUTPUTS, GenerationSpec, RequestError, check_prompts

if TYPE_CHECKING:
    from longserve.engine.parallel import ParallelPlan


class FamilyRules:
    """The coordinator side of a model family (see the module docstring)."""

    name: ClassVar[str]
    pipeline_classes: ClassVar[frozenset[str]]
    plans: ClassVar[tuple[str, ...]]
    auto_plan: ClassVar[str]                       # "dsp" or "sequence" (see engine.parallel.resolve_plan)
    options: ClassVar[tuple[str, ...]] = ()        # family-specific request options it accepts
    split_variance: bool = False     # the model predicts [noise; variance] and the scheduler takes the noise alone
    #: pipeline components only rank 0 loads (it encodes for everyone and broadcasts the result)
    rank0_components: ClassVar[tuple[str, ...]] = ("text_encoder", "tokenizer")
    #: step caching (engine/cache.py), for the families whose forward takes it (Latte, the Wan family)
    step_cache = None
    cache_kinds: ClassVar[tuple[str, ...]] = ("first_block",)     # the `cache` kinds its forward takes
    #: loads `--lora` adapters (into `self.lora`, an `engine.lora.LoraSet`) and applies them per row in `step`
    supports_lora: ClassVar[bool] = False
    #: takes the `compile` and `quantize` engine options (engine/compile.py, engine/quantize.py): its workers compile
    #: / quantise their transformer's repeated blocks at load
    supports_compile: ClassVar[bool] = False
    #: takes `cuda_graphs` (its compiled blocks replayed as CUDA graphs): shapes fixed from step to step
    supports_cuda_graphs: ClassVar[bool] = False
    #: its attention runs through diffusers' dispatcher, so it takes `attention_backend` (engine/attention.py);
    #: else why not (a family without it takes only "native", which changes nothing)
    dispatcher_attention: ClassVar[bool] = False
    dispatcher_attention_note: ClassVar[str] = "its attention is longserve's own (PyTorch SDPA)"
    #: its attention takes a mask (the start's probe of the backend passes one)
    attention_masks: ClassVar[bool] = False
    #: what of its attention longserve merges across sequence-parallel workers itself (a backend other than
    #: "native" is refused there), or "" when only Ring does
    merges_across_workers: ClassVar[str] = ""

    @classmethod
    def claims(cls, model_dir: Path) -> bool:
        """Does this family serve `model_dir` whatever its `model_index.json` names? (Most families: no.)"""
        return False

    @classmethod
    def describe(cls, model_dir: Path) -> ModelDescription:
        raise NotImplementedError

    @classmethod
    def capabilities(cls, options: tuple[str, ...] = (), **facts) -> Capabilities:
        """The checkpoint's capabilities: what the family's class takes (LoRA, compile, step caching when `cache` is
        among its request `options`, the video's fps) and the checkpoint's own `facts` (inputs, experts, live)."""
        return Capabilities(lora=cls.supports_lora, compile=cls.supports_compile,
                            cache_kinds=tuple(cls.cache_kinds) if "cache" in options else (),
                            fps_conditioned="fps" in options, **facts)

    @classmethod
    def resolve_plan(cls, desc: ModelDescription, parallel: str, workers: int, ulysses_degree: int | None = None,
                     cfg_parallel: bool = False) -> ParallelPlan:
        from longserve.engine.parallel import resolve_plan

        return resolve_plan(parallel, cls.plans, workers, desc.heads, cls.auto_plan, ulysses_degree, cfg_parallel)

    @classmethod
    def check_request(cls, desc: ModelDescription, spec: GenerationSpec) -> GenerationSpec:
        """Validate what every family shares; families extend it for their own rules and options."""
        check_common(desc, spec)
        return spec

    @classmethod
    def check_cache(cls, desc: ModelDescription, spec) -> GenerationSpec:
        """The request's `cache` option checked against the kinds the family's forward takes (and the checkpoint's
        MagCache calibration, for a family that reads one)."""
        return check_cache_option(spec, cls.cache_kinds, cls.mag_ratios(desc))

    @classmethod
    def mag_ratios(cls, desc: ModelDescription) -> list | None:
        """The checkpoint's MagCache calibration (its `mag_ratios.json`), for a `mag` cache that brings none."""
        return None

    @classmethod
    def content_frames(cls, desc: ModelDescription, spec: GenerationSpec) -> int:
        """Frames a checked request hands out: its num_frames, but for an extension (diffusion forcing's `video`),
        which hands out the input's frames and then the new ones."""
        return spec.num_frames

    @classmethod
    def kv_bytes(cls, desc: ModelDescription, spec: GenerationSpec, config) -> int:
        """The KV cache a request holds per worker (counted against `live_kv_budget`): none but causal models'."""
        return 0

    @classmethod
    def check_decoder(cls, config, desc: ModelDescription, model_dir: Path) -> None:
        """Refuse at start a `decoder` the family cannot use (ValueError naming it): only the live (causal) family
        takes a small decoder."""
        if config.decoder != "vae":
            raise ValueError(f"decoder={config.decoder!r} is not available for {config.model!r} (a {desc.family} "
                             f"model): the small decoder is for live (causal) models")

    @classmethod
    def check_update(cls, desc: ModelDescription, spec: GenerationSpec, payload: dict) -> dict:
        """Validate a change to a running request (`VideoEngine.update`)."""
        raise RequestError("request", f"a {cls.name} request cannot be changed while it runs (live sessions of "
                                      f"causal models can)")

def read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def generation_defaults(model_dir: Path, fallback: dict) -> GenerationDefaults:
    """The checkpoint's optional `generation_defaults.json` (longserve's; diffusers ignores it) over `fallback`."""
    from longserve import weights
    return GenerationDefaults.from_dict({**fallback, **weights.generation_defaults(model_dir)})



# -- request validation shared by the families ---------------------------------------------------


def check_int(field_name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise RequestError(field_name, f"{field_name} must be an integer; got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(field_name, f"{field_name} must be {bound}; got {value}")


def check_number(field_name: str, value, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) \
            or not low <= value <= high:
        raise RequestError(field_name, f"{field_name} must be a number in [{low:g}, {high:g}]; got {value!r}")


def check_cache_option(spec: GenerationSpec, kinds: tuple[str, ...] = ("first_block",),
                       mag_ratios: list | None = None) -> GenerationSpec:
    """The request's `cache` (step caching, engine/cache.py) validated and normalised: a dict, or dropped.
    `kinds`: the cache kinds the family's forward takes; `mag_ratios`: the checkpoint's MagCache calibration
    (its `mag_ratios.json`), for a `mag` cache that brings none."""
    if "cache" not in spec.options:
        return spec
    from longserve.engine.cache import parse_cache

    config = parse_cache(spec.options["cache"])
    if config is not None and config["kind"] not in kinds:
        raise RequestError("cache.kind", f"cache.kind {config['kind']!r} is not available for this model (it takes "
                                         f"{', '.join(kinds)})")
    if config is not None and config["kind"] == "mag" and config.get("mag_ratios") is None \
            and not config.get("calibrate"):
        if mag_ratios is None:
            raise RequestError("cache.mag_ratios", "a mag cache needs the checkpoint's calibration: this checkpoint "
                                                   "has no mag_ratios.json, so give cache.mag_ratios, or run once "
                                                   "with cache.calibrate true to measure them")
        config["mag_ratios"] = mag_ratios
    options = {k: v for k, v in spec.options.items() if k != "cache"}
    if config is not None:
        options["cache"] = config
    spec.options = options
    return spec



def check_image_input(desc: ModelDescription, spec: GenerationSpec, i2v_pipeline: str) -> None:
    """A family with a text-to-video and an image-to-video checkpoint (`desc.capabilities.image` REQUIRED on the
    latter): the image-to-video one needs the `image` option (made an RGB array here), the other refuses it; both
    errors name `image` and `i2v_pipeline`, the checkpoint class that takes one."""
    if desc.capabilities.image == REQUIRED:
        from longserve.engine.images import as_rgb_array

        if spec.options.get("image") is None:
            raise RequestError("image", f"image is required: this is an image-to-video model (a {i2v_pipeline} "
                                        f"checkpoint)")
        spec.options = dict(spec.options, image=as_rgb_array(spec.options["image"], "image"))
    elif spec.options.get("image") is not None:
        raise RequestError("image", f"image is not supported: this checkpoint generates video from text only "
                                    f"(image-to-video needs a {i2v_pipeline} checkpoint)")


def check_common(desc: ModelDescription, spec: GenerationSpec) -> None:
    """Checks every family needs: prompts, frames, size, steps, guidance, seed, output, options."""
    check_prompts(spec.prompt)
    neg = spec.negative_prompt
    if isinstance(neg, (list, tuple)):
        if len(neg) != spec.batch_size or not all(isinstance(p, str) for p in neg):
            raise RequestError("negative_prompt", f"negative_prompt must be a string or a list of "
                                                  f"{spec.batch_size} strings (one per prompt)")
    elif not isinstance(neg, str):
        raise RequestError("negative_prompt", f"negative_prompt must be a string or a list of strings; "
                                              f"got {type(neg).__name__}")
    check_int("num_frames", spec.num_frames, 1)
    rule = desc.frame_multiple
    if rule > 1 and (spec.num_frames - 1) % rule:
        lower = (spec.num_frames - 1) // rule * rule + 1
        raise RequestError("num_frames", f"num_frames must be {rule}k+1 for this model (its VAE compresses "
                                         f"{rule} frames into one); got {spec.num_frames}, try {lower} or "
                                         f"{lower + rule}")
    m = desc.size_multiple
    for name, value in (("height", spec.height), ("width", spec.width)):
        check_int(name, value, m)
        if value % m:
            raise RequestError(name, f"{name} must be a multiple of {m} (VAE factor x patch size); got {value}")
    check_int("num_inference_steps", spec.num_inference_steps, 1, MAX_STEPS)
    check_number("guidance_scale", spec.guidance_scale, 0, 100)
    check_int("seed", spec.seed, 0, 2**63 - 1)
    if spec.output not in OUTPUTS:
        raise RequestError("output_type", f"output_type must be one of {', '.join(OUTPUTS)}; got {spec.output!r}")
    check_int("decode_chunk_size", spec.decode_chunk_size, 1)
    unknown = sorted(set(spec.options) - set(desc.options))
    for name in ("image", "last_image"):
        if name in unknown:
            raise RequestError(name, f"{name} is not supported: this model generates video from text only (a "
                                     f"{desc.family} model; image-to-video needs a WanImageToVideoPipeline checkpoint)")
    if "prompts" in unknown:
        raise RequestError("prompts", f"prompts (a prompt timeline) is for models that make a long video in segments "
                                      f"(diffusion forcing, Helios); a {desc.family} model makes one segment with "
                                      f"one prompt")
    if unknown:
        raise RequestError(unknown[0], f"{unknown[0]} is not an option of this model (a {desc.family} model "
                                       f"accepts: {', '.join(desc.options) or 'no extra options'})")
    if "cfg_trunc_ratio" in spec.options:
        ratio = spec.options["cfg_trunc_ratio"]
        check_number("cfg_trunc_ratio", ratio, 0, 1)
        spec.options = {**spec.options, "cfg_trunc_ratio": float(ratio)}
