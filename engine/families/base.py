"""The worker side of a model family: loading, and a request's life on the workers. The coordinator side (describe,
checks, costs) is `engine/families/rules.py`; a family is declared in `engine/families/declaration.py` and named in
`engine/family_index.py`.

The engine (`engine/engine.py`, `engine/core.py`, `engine/scheduler.py`, `engine/worker.py`) never names a model.
A worker (an instance per worker process, built by `engine.worker.setup_worker` from a `WorkerConfig`) runs loading,
`admit`, `step` and `decode_next`, written once here; a family fills in the parts that differ:

    load         load_pipeline (diffusers' components)  ->  load_denoisers: the load pipeline over the
                 denoisers the family declares (`Denoisers`): FP8 -> compile of the repeated blocks ->
                 step caching's hooks -> `shard` (the family's sharded forward) -> expert offload
    admit        encode_prompt (rank 0, broadcast)  ->  prepare (latents, scheduler, the request's
                 `FrameStream`: engine/decoding.py)
    step         model_for (Wan 2.2: the expert)  ->  inputs per request  ->  forward (the plan's
                 parallel forward through `denoise`, which puts CFG-parallel around it)  ->  guidance_scale
                 ->  advance (scheduler step; final latents pushed into the request's frame stream)
    decode_next  the request's frame stream: its next final frames through the family's VAE path
                 (`vae_decoder`), timed; or its latents for output "latent"

A declared family (`engine/families/composed.py`) takes these hooks from its parts (encoder, denoiser, loop,
decoder) instead of a subclass; the families still written as subclasses share what they share by composition (the
Wan architecture's parts, `engine/families/wan_parts.py`, are a mixin every Wan-based family takes whole).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from longserve.engine import comm, parallel
from longserve.engine.config import WorkerConfig
from longserve.engine.decoding import FramesPolicy, FrameStream
from longserve.engine.dist import parse_dtype
from longserve.engine.errors import public_message
from longserve.engine.families.rules import (  # noqa: F401 - the rules' helpers, where the families import them
    FamilyRules,
    check_cache_option,
    check_common,
    check_int,
    check_number,
    generation_defaults,
    read_json,
)
from longserve.engine.lora import step_rows
from longserve.engine.parallel import ParallelPlan
from longserve.engine.request import GenerationSpec, complete_request, default_request
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
    chunks_per_job: int = 1            # a chunk loop's chunks one job may make (the stages live loop's stream batch)
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
                        self.model, self.switch_ready(), self.chunk_steps(), self.chunk_now(), self.chunks_per_job)

    def chunk_steps(self) -> int:
        """Forwards per chunk of a chunk loop (the causal family's), 0 for a request that is not one: outside the
        serial live loop a job runs a chunk's forwards whole, beside the previous chunk's decode."""
        return 0

    def chunk_now(self) -> int:
        """The chunk a chunk loop is making (`Progress.chunk`), -1 for a request that is not one."""
        return -1

    def chunk_start(self) -> bool:
        """At a chunk's start (before its first forward): where an overlapped live loop's job ends."""
        return False

    def switch_ready(self) -> bool:
        """Would a prompt switch sent now apply at once (`Progress.switch_ready`)? Yes, but for a chunk loop."""
        return True


class VideoFamily(FamilyRules):
    """The worker side of a model family (see the module docstring); its coordinator side is `FamilyRules`."""

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

    @property
    def rules(self) -> type[FamilyRules]:
        """The family's coordinator side: a class-based family is its own."""
        return type(self)

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
        """Build the worker groups of `plan` (collective: every rank calls it): the sequence-parallel groups over
        all workers and, with CFG-parallel, over each half (`denoise` picks between them)."""
        pg, backend = self.pg, self.config.engine.attention_backend
        if plan.cfg_parallel and pg.world_size > 1:
            self.cfg_groups = parallel.make_cfg_groups(pg)
            ranks = list(range(pg.world_size))
            halves = [ranks[:len(ranks) // 2], ranks[len(ranks) // 2:]]
            # new_group is collective over the world: build both halves' groups on every rank
            sps = [parallel.make_sequence_parallel(self.cfg_groups.half if i == self.cfg_groups.index else None,
                                                   plan.name, plan.ulysses_degree, members=m,
                                                   attention_backend=backend)
                   for i, m in enumerate(halves)]
            self.sp_cfg = sps[self.cfg_groups.index]
        else:
            self.cfg_groups, self.sp_cfg = None, None
        self.sp = parallel.make_sequence_parallel(pg, plan.name, plan.ulysses_degree, attention_backend=backend)
        self.plan = plan

    def denoise(self, entry, cfg_parallel: bool, *args, **kwargs):
        """One parallel forward of a sharded denoiser (`entry(*args, sp=..., **kwargs)`, the plan's entry point),
        with CFG-parallel put around it here, once for every family: under CFG-parallel the batch's unconditional
        rows run on one half of the workers and its conditional rows on the other, each half sequence-parallel over
        its own group (`engine.parallel.cfg_parallel`); else every row runs on every worker's group."""
        if cfg_parallel:
            return parallel.cfg_parallel(entry, self.cfg_groups, *args, sp=self.sp_cfg, **kwargs)
        return entry(*args, sp=self.sp, **kwargs)

    def warm_up(self) -> float:
        """Denoising steps of throw-away requests at the model's default size (CFG's two rows, the default frames
        and size; an image-to-video model gets a grey image), so that the compiled blocks are compiled now rather
        than in the first requests: one request's step, then a step of it with a second whose prompt is longer
        (more rows, another text length and, for Latte, a text mask: the sizes that change between batches become
        symbolic here, also after Wan's graph break). Collective: every rank runs it at load. -> wall time (s)."""
        desc = self.rules.describe(Path(self.model_dir))
        spec = complete_request(default_request(desc, "warm-up"), self.rules, desc, self.config.engine)
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


@dataclass(frozen=True)
class _Refused:
    """What rank 0 broadcasts in place of a result `broadcast_from_first`'s `make` could not make."""

    message: str
    field: str | None = None
