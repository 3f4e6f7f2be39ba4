"""What a model family is: the adapter between the generic video engine and one kind of checkpoint.

The engine (`engine/engine.py`, `engine/core.py`, `engine/scheduler.py`, `engine/worker.py`)
never names a model. A family says, for the checkpoints whose `model_index.json`
`_class_name` it lists in `pipeline_classes`:

coordinator side (class methods; they read JSON configs only, no weights, no torch work):
- `describe(model_dir)` -> `ModelDescription`: heads, defaults, size multiple, frame rule, options;
- `auto_plan`, `plans`: which parallel plans it supports and which "auto" picks;
- `check_request(desc, spec)`: validate a request (RequestError naming the field), so
  nothing a worker would refuse is ever sent to the workers. This is the one validation
  of a request's model-facing fields; front doors add only their own limits.

worker side (an instance per worker process, built by `engine.worker.setup_worker` from a
`WorkerConfig`): loading, and a request's life on the workers. Loading, `admit`, `step` and
`decode_next` are written once, here; a family fills in the parts that differ:

    load         load_pipeline (diffusers' components)  ->  load_denoisers: the load pipeline over the
                 denoisers the family declares (`Denoisers`): FP8 -> compile of the repeated blocks ->
                 step caching's hooks -> `shard` (the family's sharded forward) -> expert offload
    admit        encode_prompt (rank 0, broadcast)  ->  prepare (latents, scheduler, the request's
                 `FrameStream`: engine/decoding.py)
    step         model_for (Wan 2.2: the expert)  ->  inputs per request  ->  forward (the plan's
                 parallel forward, engine/models/)  ->  guidance_scale  ->  advance (scheduler step; final
                 latents pushed into the request's frame stream)
    decode_next  the request's frame stream: its next final frames through the family's VAE path
                 (`vae_decoder`), timed; or its latents for output "latent"

The parallel forwards themselves (DSP for Latte; hooks on diffusers' Wan modules) live in
`engine/models/`, apart from these adapters. Families share what they share by composition: the Wan
architecture's parts (`engine/families/wan_parts.py`) are a mixin every Wan-based family takes whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import numpy as np
import torch

from longserve.engine import comm
from longserve.engine.config import MAX_STEPS, Capabilities, GenerationDefaults, ModelDescription, WorkerConfig
from longserve.engine.decoding import FramesPolicy, FrameStream
from longserve.engine.dist import parse_dtype
from longserve.engine.errors import public_message
from longserve.engine.lora import step_rows
from longserve.engine.parallel import ParallelPlan, resolve_plan
from longserve.engine.request import (
    OUTPUTS,
    GenerationSpec,
    RequestError,
    check_prompts,
    complete_request,
    default_request,
)
from longserve.engine.results import EncodeRefused

log = logging.getLogger("longserve.engine")


@dataclass
class WorkerRequest:
    """A request's state on one worker; every rank holds an identical copy and steps it in lockstep.

    num_steps: denoising steps in all (every segment's, for long video).
    batch_key: requests with equal keys can share a `step` (same latent shape, same model).
    decoded_frames: output frames handed out so far; num_frames: all of them; frames: the stream its final
    latents go into and its frames come out of (engine/decoding.py).
    """

    spec: GenerationSpec
    num_steps: int
    batch_key: tuple
    num_frames: int
    text: torch.Tensor = None          # (2B or B, L, C_text): [negative; positive] when CFG
    latents: torch.Tensor = None       # identical on every rank
    scheduler: object = None           # the request's own diffusers scheduler
    step_kwargs: dict = field(default_factory=dict)
    steps_done: int = 0
    model: int = 0                     # which denoiser its next step uses (a two-expert family's expert)
    decoded_frames: int = 0
    frames: FrameStream = None
    cache_state: dict = field(default_factory=dict)   # step caching (engine/cache.py): (expert, branch) -> state
    timings: dict = field(default_factory=lambda: {"encode_s": 0.0, "transformer_s": 0.0, "vae_s": 0.0})

    @property
    def denoised(self) -> bool:
        return self.steps_done >= self.num_steps

    def decodable(self) -> bool:
        """Are there final frames not yet handed out?"""
        return self.frames is not None and self.frames.ready()

    def handed_out(self) -> tuple:
        """(sound, live chunk) of what the last decode handed out (`FrameStream.handed_out`; (None, None) without)."""
        return self.frames.handed_out() if self.frames is not None else (None, None)

    def progress(self):
        """What the coordinator learns after each job (`engine.results.Progress`)."""
        from longserve.engine.results import Progress

        return Progress(self.steps_done, self.batch_key, self.decodable(), self.num_steps, self.num_frames,
                        self.model, self.switch_ready(), self.chunk_steps())

    def chunk_steps(self) -> int:
        """Forwards per chunk of a chunk loop (the causal family's), 0 for a request that is not one: outside the
        serial live loop a job runs a chunk's forwards whole, beside the previous chunk's decode."""
        return 0

    def chunk_start(self) -> bool:
        """At a chunk's start (before its first forward): where an overlapped live loop's job ends."""
        return False

    def switch_ready(self) -> bool:
        """Would a prompt switch sent now apply at once (`Progress.switch_ready`)? Yes, but for a chunk loop."""
        return True


class VideoFamily:
    """Base class of a model family (see the module docstring)."""

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

    # -- coordinator side ------------------------------------------------------------------

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

    # -- worker side: loading ------------------------------------------------------------------

    def __init__(self, ctx, config: WorkerConfig):
        self.ctx, self.pg = ctx, ctx.pg
        self.config = config
        self.model_dir = config.model_dir
        self.dtype = parse_dtype(config.engine.dtype)
        self.plan = config.plan
        # decode in diffusers' spatial tiles (what `pipe.vae.enable_tiling()` does); off, as in diffusers
        self.vae_tiling = config.engine.vae_tiling
        self.vae_split = config.engine.vae_split         # "rows": every frame's rows across the workers
        self.attention = "sdpa"
        self.cfg_groups = None
        self.lora = None                 # engine.lora.LoraSet, when the family loaded adapters
        self.residency = None            # engine.offload.ExpertResidency, under expert offload

    def load_pipeline(self, pipeline_class, dtype, on_host=()):
        """The family's diffusers pipeline on this worker's device (the text encoder on rank 0 only; the
        components named in `on_host` stay in host memory, for an offload to place)."""
        import diffusers
        import transformers

        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
        skip = {} if self.pg.rank == 0 else dict.fromkeys(self.rank0_components)
        pipe = pipeline_class.from_pretrained(self.model_dir, dtype=dtype, **skip)
        if on_host:
            for name, component in pipe.components.items():
                if name not in on_host and isinstance(component, torch.nn.Module):
                    component.to(self.pg.device)
        else:
            pipe.to(self.pg.device)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def load_denoisers(self, denoisers: "Denoisers") -> list:
        """The load pipeline, in the one order that works (docs/design.md, "Regional compile and FP8"): FP8 weights
        (the compiled graph then takes their float8 matmuls) -> compile of the repeated blocks (before any hook, so
        that a compiled block's forward is the innermost one the hooks wrap) -> step caching's hooks (before the
        plan's, so that they see a block's input after the sequence-parallel cut) -> `shard`, the family's sharded
        forward -> expert offload (its host copies are of the tensors the stages above left). -> the sharded
        forwards, one per denoiser."""
        engine, modules = self.config.engine, list(denoisers.modules)
        if engine.attention_backend is not None and self.dispatcher_attention:
            for m in modules:            # diffusers' own processors (the plan's keep them as their originals)
                m.set_attention_backend(engine.attention_backend)
        if (engine.quantize != "none" or engine.compile != "none") and denoisers.blocks is None:
            raise ValueError(f"compile and quantize are not built for the {self.name} family")
        if engine.quantize == "fp8":
            from longserve.engine.quantize import quantize_fp8

            for m in modules:
                quantize_fp8(m)
        if engine.compile == "blocks":
            from longserve.engine.compile import compile_blocks

            for m in modules:
                compile_blocks(denoisers.blocks(m), engine.compile_backend,
                               "reduce-overhead" if engine.cuda_graphs else None)
        if denoisers.cache_units:
            from longserve.engine.cache import StepCache

            self.step_cache = StepCache(blocks=denoisers.cache_units)
        if denoisers.cache_hooks:
            for m in modules:
                denoisers.cache_hooks(m, self.step_cache)  # step caching reads the running forward's shard itself
        sharded = [self.shard(m) for m in modules]
        if denoisers.offload:
            from longserve.engine.offload import ExpertResidency

            self.residency = ExpertResidency(modules, self.pg.device)
        return sharded

    def shard(self, denoiser):
        """The plan's sharded forward of one denoiser: the load pipeline's last stage (Latte: the module itself, which
        its hand-written DSP forward takes)."""
        return denoiser

    def set_plan(self, plan: ParallelPlan) -> None:
        raise NotImplementedError

    def warm_up(self) -> float:
        """Denoising steps of throw-away requests at the model's default size (CFG's two rows, the default frames
        and size; an image-to-video model gets a grey image), so that the compiled blocks are compiled now rather
        than in the first requests: one request's step, then a step of it with a second whose prompt is longer
        (more rows, another text length and, for Latte, a text mask: the sizes that change between batches become
        symbolic here, also after Wan's graph break). Collective: every rank runs it at load. -> wall time (s)."""
        desc = self.describe(Path(self.model_dir))
        spec = complete_request(default_request(desc, "warm-up"), type(self), desc, self.config.engine)
        longer = dataclasses.replace(spec, request_id="warm-up-2",
                                     prompt=["a longer warm-up prompt, so that the length of the text changes"])
        t0 = time.perf_counter()
        first, second = self.admit(spec), self.admit(longer)
        self.step([first])
        if first.batch_key == second.batch_key and not first.denoised:
            self.step([first, second])
        sync_cuda()
        return time.perf_counter() - t0

    # -- worker side: a request ----------------------------------------------------------------

    def admit(self, spec: GenerationSpec) -> WorkerRequest:
        """Encode the prompt (and any other condition) on rank 0, the only rank with the encoders; share it in one
        broadcast; prepare the rest."""
        t0 = time.perf_counter()

        def encode():
            with torch.no_grad():
                positive, negative = self.encode_prompt(spec)
                conditions = {k: v.cpu() for k, v in self.encode_conditions(spec).items()}
            text = torch.cat([negative, positive]) if spec.use_cfg else positive          # (2B|B, L, C_text)
            return text.cpu(), conditions

        text, conditions = self.broadcast_from_first(encode)
        text = text.to(self.pg.device, self.dtype)
        conditions = {k: v.to(self.pg.device) for k, v in conditions.items()}
        encode_s = time.perf_counter() - t0
        req = self.prepare(spec, text, **conditions)
        req.timings["encode_s"] = encode_s
        return req

    def encode_prompt(self, spec: GenerationSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(positive, negative) prompt embeddings, as the family's diffusers pipeline makes them."""
        raise NotImplementedError

    def encode_conditions(self, spec: GenerationSpec) -> dict[str, torch.Tensor]:
        """Conditions besides the prompt, made on rank 0 and broadcast with it (an image's encodings); they reach
        `prepare` as keyword arguments. None for text-to-video."""
        return {}

    def prepare(self, spec: GenerationSpec, text: torch.Tensor) -> WorkerRequest:
        """Latents, the request's own scheduler and its batch key (plus `encode_conditions`' tensors, if any)."""
        raise NotImplementedError

    def step(self, reqs: list[WorkerRequest]) -> None:
        """One denoising step for a batch (equal batch keys; any timesteps, guidance scales and prompt lengths):
        one parallel forward of every request's rows, [uncond; cond] each under CFG."""
        t0 = time.perf_counter()
        model = self.model_for(reqs)
        cfg_parallel = self.cfg_groups is not None and all(r.spec.cfg_at(r.steps_done) for r in reqs)
        rows = [self.inputs(r) for r in reqs]                             # per request: {name: (rows, ...)}
        rows = [x if r.spec.cfg_at(r.steps_done) or not r.spec.use_cfg else conditional_rows(x)
                for r, x in zip(reqs, rows)]                              # CFG truncated: the cond half only
        names = list(rows[0])
        columns = order_rows([[r[n] for n in names] for r in rows], cfg_parallel)
        sizes = [len(r[names[0]]) for r in rows]
        with torch.no_grad():
            with self.cached(reqs, cfg_parallel) as run, \
                    step_rows(self.lora, reqs, sizes, cfg_parallel) as lora_rows:   # each request's adapters, per row
                if run is not None and lora_rows is not None:
                    run.on_take.append(lora_rows.take)        # the blocks step caching runs for some rows only
                out = self.forward(model, dict(zip(names, columns)), cfg_parallel)    # (all rows, C_out, ...)
            for r, o in zip(reqs, split_rows(out, sizes, cfg_parallel)):
                if self.split_variance:
                    o = o.chunk(2, dim=1)[0]
                self.advance(r, self.guide(r, o))
                if r.denoised:
                    r.cache_state.clear()         # its residuals are not needed to decode
        sync_cuda()  # one wait per step (not per request): the step's kernels count in its time
        elapsed = time.perf_counter() - t0
        for r in reqs:
            r.timings["transformer_s"] += elapsed / len(reqs)

    def model_for(self, reqs: list[WorkerRequest]):
        """The denoiser of this step (one per batch key)."""
        return self.pipe.transformer

    def cached(self, reqs: list[WorkerRequest], cfg_parallel: bool):
        """Step caching around one forward (engine/cache.py): each request's rows with their own state."""
        if self.step_cache is None:
            return contextlib.nullcontext()
        scope = self.cache_scope(reqs)
        return self.step_cache.step(reqs, scope, self.cfg_groups if cfg_parallel else None,
                                    steps=lambda r: self.cache_steps(r, scope))

    def cache_scope(self, reqs: list[WorkerRequest]) -> int:
        """Which denoiser's cache state the batch uses (Wan 2.2: the expert's)."""
        return 0

    def cache_steps(self, r: WorkerRequest, scope: int) -> int:
        """The request's denoising steps on denoiser `scope` (MagCache resamples its calibration to them)."""
        return r.spec.num_inference_steps

    def inputs(self, r: WorkerRequest) -> dict[str, torch.Tensor | list]:
        """The request's rows of every forward input (latents duplicated under CFG)."""
        raise NotImplementedError

    def forward(self, model, inputs: dict[str, list], cfg_parallel: bool) -> torch.Tensor:
        """The plan's parallel forward of the batch -> the model output, every row, on every rank. `inputs`: per
        input, the requests' parts in forward order (`order_rows`)."""
        raise NotImplementedError

    def guidance_scale(self, r: WorkerRequest) -> float:
        return r.spec.guidance_scale

    def guide(self, r: WorkerRequest, out: torch.Tensor) -> torch.Tensor:
        """The request's prediction from its rows of the model output ([uncond; cond] under CFG)."""
        return guided(out, r.spec.cfg_at(r.steps_done), self.guidance_scale(r))

    def advance(self, r: WorkerRequest, pred: torch.Tensor) -> None:
        """The request's scheduler step with the guided prediction; once denoised, every latent frame is final."""
        t = r.scheduler.timesteps[r.steps_done]
        r.latents = r.scheduler.step(pred, t, r.latents, **r.step_kwargs, return_dict=False)[0]
        r.steps_done += 1
        if r.denoised:
            r.frames.push(self.final_latents(r), last=True)

    def final_latents(self, r: WorkerRequest) -> torch.Tensor:
        """The denoised latents as the pipeline decodes (or returns) them."""
        return r.latents

    def frame_stream(self, spec: GenerationSpec, limit: int, policy: FramesPolicy,
                     lead_frames: Callable | None = None) -> FrameStream:
        """A request's frame stream (engine/decoding.py) through the family's VAE path."""
        return FrameStream(policy, functools.partial(self.vae_decoder, spec), spec.output, self.pg.rank, limit,
                           lead_frames)

    def vae_decoder(self, spec: GenerationSpec, latents: torch.Tensor):
        """The family's VAE path for a request's run of final latents that starts with `latents` (see
        `engine.decoding.FrameStream`)."""
        raise NotImplementedError

    def decode_next(self, r: WorkerRequest, max_frames: int):
        """The next final frames (about `max_frames`), decoded across the workers: (B, n, H, W, 3) on rank 0,
        None elsewhere; latents for output "latent". Advances `r.decoded_frames`."""
        with Timer(r.timings, "vae_s") if r.spec.output != "latent" else contextlib.nullcontext():
            frames = r.frames.next(max_frames)
        r.decoded_frames = r.frames.frames_out
        return frames

    def update(self, r: WorkerRequest, payload: dict) -> dict:
        """A running request changes course (`engine.worker.update`); only live-capable families accept it."""
        raise ValueError(f"a {self.name} request cannot be changed while it runs")

    # -- helpers the families share ----------------------------------------------------------

    @property
    def text_group(self):
        """The ranks that take part in `broadcast_from_first`: every worker (a family whose ranks do not all need
        the embeddings narrows it: the causal family's pipelined loop, whose decode rank runs no transformer)."""
        return self.pg

    def broadcast_from_first(self, make):
        """Run `make()` on rank 0 only (e.g. the text encoder, loaded there alone) and share its result.

        When `make` fails (a tokenizer that cannot take the text, an image the encoder refuses), rank 0 shares the
        failure instead, and every rank raises `EncodeRefused` after the broadcast: no rank is left waiting in it,
        so the failure is the request's alone. Running out of memory is raised as it is (the pool's failure model)."""
        pg = self.text_group
        value = None
        if pg.rank == 0:
            try:
                value = make()
            except Exception as e:  # noqa: BLE001 - shared with the other ranks, raised on all
                from longserve.engine.pool import classify

                if classify(e) == "out_of_memory":
                    raise
                log.warning("rank 0 could not encode a request's inputs", exc_info=True)   # the log keeps it, once
                value = _Refused(f"{type(e).__name__}: {public_message(str(e))}", getattr(e, "field", None))
        value = comm.broadcast_object(value, pg)
        if isinstance(value, _Refused):
            raise EncodeRefused(value.message, value.field)
        return value

    def new_scheduler(self, steps: int, sigmas: list | None = None, timesteps: list | None = None):
        """A fresh copy of the checkpoint's diffusers scheduler, set to `steps` steps, or to a fixed list of `sigmas`
        or `timesteps` as diffusers' `retrieve_timesteps` sets one (the list decides the step count)."""
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        if sigmas is None and timesteps is None:
            scheduler.set_timesteps(steps, device=self.pg.device)
        else:
            from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import retrieve_timesteps

            # as arrays, as diffusers' pipelines pass them (UniPC's set_timesteps does array arithmetic on sigmas)
            retrieve_timesteps(scheduler, None, self.pg.device,
                               timesteps=None if timesteps is None else np.asarray(timesteps, dtype=np.float64),
                               sigmas=None if sigmas is None else np.asarray(sigmas, dtype=np.float64))
        return scheduler


@dataclass(frozen=True)
class Denoisers:
    """What a family declares to the load pipeline (`VideoFamily.load_denoisers`)."""

    modules: tuple[torch.nn.Module, ...]          # its denoisers (Wan 2.2: the high- and the low-noise expert)
    blocks: Callable | None = None                # a denoiser -> its repeated blocks (FP8, compile); None: not built
    cache_units: int = 0                          # step caching's units (engine/cache.py); 0: no step caching
    cache_hooks: Callable | None = None           # (denoiser, StepCache) -> step caching's hooks on its blocks
    offload: bool = False                         # expert offload: one denoiser on the device at a time


def read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def generation_defaults(model_dir: Path, fallback: dict) -> GenerationDefaults:
    """The checkpoint's optional `generation_defaults.json` (longserve's; diffusers ignores it) over `fallback`."""
    from longserve import weights
    return GenerationDefaults.from_dict({**fallback, **weights.generation_defaults(model_dir)})


def seeded_generator(seed: int) -> torch.Generator:
    """The generator diffusers' pipelines get in our tests: `torch.Generator("cpu").manual_seed(seed)`."""
    return torch.Generator("cpu").manual_seed(seed)


def scheduler_step_kwargs(scheduler, generator: torch.Generator) -> dict:
    """The extra `scheduler.step` arguments diffusers' pipelines pass: eta=0 (DDIM) and the request's
    generator, so samplers that add noise at every step (DDPM, Euler ancestral) draw the same noise
    as diffusers and the same on every rank."""
    params = set(inspect.signature(scheduler.step).parameters)
    kwargs = {}
    if "eta" in params:
        kwargs["eta"] = 0.0
    if "generator" in params:
        kwargs["generator"] = generator
    return kwargs


def order_rows(per_request: list[list], cfg_parallel: bool) -> list[list]:
    """Per request, its rows of every input ([uncond; cond] rows with CFG) -> per input, the parts in the order
    the batched forward takes them: request after request, or, with CFG-parallel, every request's
    unconditional half first, then every conditional half. Parts are tensors (rows first) or lists."""
    columns = [list(f) for f in zip(*per_request)]
    if cfg_parallel:
        columns = [[x[:len(x) // 2] if part == 0 else x[len(x) // 2:] for part in (0, 1) for x in f]
                   for f in columns]
    return columns


def split_rows(out: torch.Tensor, sizes: list[int], cfg_parallel: bool) -> list[torch.Tensor]:
    """The inverse of `order_rows` for the forward's output: each request's rows, [uncond; cond]."""
    if not cfg_parallel:
        return list(out.split(sizes))
    uncond, cond = out.chunk(2)
    halves = [n // 2 for n in sizes]
    return [torch.cat([u, c]) for u, c in zip(uncond.split(halves), cond.split(halves))]


def conditional_rows(inputs: dict) -> dict:
    """A request's forward inputs, [uncond; cond] rows each, -> the cond rows alone (a step past its CFG
    truncation)."""
    return {name: x[len(x) // 2:] for name, x in inputs.items()}


def guided(noise: torch.Tensor, use_cfg: bool, scale: float) -> torch.Tensor:
    """[uncond; cond] model output -> the guided prediction (or the output itself without CFG)."""
    if not use_cfg:
        return noise
    uncond, cond = noise.chunk(2)
    return uncond + scale * (cond - uncond)


def cfg_rows(r: WorkerRequest, x: torch.Tensor) -> torch.Tensor:
    """`x` once per forward row of the request: twice ([uncond; cond]) under CFG."""
    return torch.cat([x, x]) if r.spec.use_cfg else x


def sync_cuda() -> None:
    """Wait for this thread's CUDA work (nothing on CPU): a stage's time must include its kernels. Its current
    stream only: the live loop's decode lane runs on a stream of its own beside it (engine/live_lane.py), and a
    device-wide sync here would wait for that decode too."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


class Timer:
    """Adds the wall time of a `with` block to `timings[key]`.

    On CUDA the block's kernels are waited for at both ends (one device sync each): without it the
    time is that of queueing the kernels (docs/gpu.md, section 1)."""

    def __init__(self, timings: dict, key: str):
        self.timings, self.key = timings, key

    def __enter__(self):
        sync_cuda()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync_cuda()
        self.timings[self.key] += time.perf_counter() - self.t0


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


@dataclass(frozen=True)
class _Refused:
    """What rank 0 broadcasts in place of a result `broadcast_from_first`'s `make` could not make."""

    message: str
    field: str | None = None


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
                                      f"(diffusion forcing, Helios, FramePack); a {desc.family} model makes one "
                                      f"segment with one prompt")
    if unknown:
        raise RequestError(unknown[0], f"{unknown[0]} is not an option of this model (a {desc.family} model "
                                       f"accepts: {', '.join(desc.options) or 'no extra options'})")
    if "cfg_trunc_ratio" in spec.options:
        ratio = spec.options["cfg_trunc_ratio"]
        check_number("cfg_trunc_ratio", ratio, 0, 1)
        spec.options = {**spec.options, "cfg_trunc_ratio": float(ratio)}
