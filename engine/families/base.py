"""What a model family is: the interface between the generic video engine and one kind of checkpoint.

The engine (`engine/engine.py`, `engine/scheduler.py`, `engine/worker.py`) never names a
model. A family says, for the checkpoints whose `model_index.json` `_class_name` it
lists in `pipeline_classes`:

coordinator side (class methods; they read JSON configs only, no weights, no torch work):
- `describe(model_dir)`: what the coordinator needs before any request: head count,
  defaults (frames, size, steps, guidance, fps), the size multiple, the frame rule;
- `auto_plan`, `plans`: which parallel plans it supports and which "auto" picks;
- `check_request(info, spec)`: validate a request (RequestError naming the field), so
  nothing a worker would refuse is ever sent to the workers.

worker side (an instance per worker process, built by `engine.worker.setup_worker`):
- load its components on this worker (the text encoder on rank 0 only);
- `admit(spec)`: encode the prompt on rank 0, broadcast it, prepare latents and a
  scheduler for the request -> a `WorkerRequest` (identical on every rank);
- `step(requests)`: one parallel denoising step for a batch of requests that share a
  `batch_key`;
- `decode_next(request, max_frames)`: VAE-decode the next frames that are final, split
  across the workers; rank 0 gets them.
"""

from __future__ import annotations

import inspect
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from engine import comm
from engine.parallel import ParallelPlan, resolve_plan
from engine.request import OUTPUTS, GenerationSpec, RequestError


@dataclass
class WorkerRequest:
    """A request's state on one worker; every rank holds an identical copy and steps it in lockstep.

    num_steps: denoising steps in all (every segment's, for long video).
    batch_key: requests with equal keys can share a `step` (same latent shape, same model).
    decoded_frames: output frames handed out so far; num_frames: all of them.
    """

    spec: GenerationSpec
    num_steps: int
    batch_key: tuple
    num_frames: int
    steps_done: int = 0
    decoded_frames: int = 0
    timings: dict = field(default_factory=lambda: {"encode_s": 0.0, "transformer_s": 0.0, "vae_s": 0.0})

    @property
    def denoised(self) -> bool:
        return self.steps_done >= self.num_steps

    def decodable(self) -> bool:
        """Are there final frames not yet decoded? (T2V: once every step is done.)"""
        return self.denoised and self.decoded_frames < self.num_frames

    def progress(self) -> dict:
        """What the coordinator learns after each job."""
        return {"steps_done": self.steps_done, "batch_key": self.batch_key, "decodable": self.decodable()}


class VideoFamily:
    """Base class of a model family (see the module docstring)."""

    name: ClassVar[str]
    pipeline_classes: ClassVar[frozenset[str]]
    plans: ClassVar[tuple[str, ...]]
    auto_plan: ClassVar[str]                       # "dsp" or "sequence" (see engine.parallel.resolve_plan)
    options: ClassVar[tuple[str, ...]] = ()        # family-specific request options it accepts

    # -- coordinator side ------------------------------------------------------------------

    @classmethod
    def describe(cls, model_dir: Path) -> dict:
        """{"family", "heads", "size_multiple", "frame_multiple", "defaults": {...}, ...} from JSON configs."""
        raise NotImplementedError

    @classmethod
    def resolve_plan(cls, desc: dict, parallel: str, workers: int, ulysses_degree: int | None = None,
                     cfg_parallel: bool = False) -> ParallelPlan:
        return resolve_plan(parallel, cls.plans, workers, desc["heads"], cls.auto_plan, ulysses_degree, cfg_parallel)

    @classmethod
    def check_request(cls, info: dict, spec: GenerationSpec) -> GenerationSpec:
        """Validate what every family shares; families extend it for their own rules and options."""
        check_common(info, spec, cls.options)
        return spec

    # -- worker side -----------------------------------------------------------------------

    def __init__(self, ctx, model_dir: str, plan: ParallelPlan, dtype: torch.dtype, attention: str,
                 vae_tiling: bool = False):
        self.ctx, self.pg = ctx, ctx.pg
        self.model_dir, self.dtype = model_dir, dtype
        self.plan = plan
        # decode in diffusers' spatial tiles (what `pipe.vae.enable_tiling()` does); off, as in diffusers
        self.vae_tiling = vae_tiling

    def info(self) -> dict:
        raise NotImplementedError

    def set_plan(self, plan: ParallelPlan) -> None:
        raise NotImplementedError

    def admit(self, spec: GenerationSpec) -> WorkerRequest:
        raise NotImplementedError

    def step(self, requests: list[WorkerRequest]) -> None:
        raise NotImplementedError

    def decode_next(self, request: WorkerRequest, max_frames: int) -> dict | None:
        """Decode the next final frames (at most about `max_frames`); rank 0 returns
        {"frames": (B, n, H, W, 3) or latents, "start", "stop", "vae_s"}, other ranks None."""
        raise NotImplementedError

    # -- helpers the families share ----------------------------------------------------------

    def broadcast_from_first(self, make):
        """Run `make()` on rank 0 only (e.g. the text encoder, loaded there alone) and share its result."""
        value = make() if self.pg.rank == 0 else None
        return comm.broadcast_object(value, self.pg)


def read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def generation_defaults(model_dir: Path, fallback: dict) -> dict:
    """The checkpoint's optional `generation_defaults.json` (longserve's; diffusers ignores it) over `fallback`."""
    import weights

    return {**fallback, **weights.generation_defaults(model_dir)}


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


def order_rows(per_request: list[list[torch.Tensor]], cfg_parallel: bool) -> list[list[torch.Tensor]]:
    """Per request, its row tensors ([uncond; cond] rows with CFG) field by field -> per field, the list of
    parts in the order the batched forward takes them: request after request, or, with CFG-parallel, every
    request's unconditional half first, then every conditional half."""
    fields = [list(f) for f in zip(*per_request)]
    if cfg_parallel:
        fields = [[x.chunk(2)[part] for part in (0, 1) for x in f] for f in fields]
    return fields


def split_rows(out: torch.Tensor, sizes: list[int], cfg_parallel: bool) -> list[torch.Tensor]:
    """The inverse of `order_rows` for the forward's output: each request's rows, [uncond; cond]."""
    if not cfg_parallel:
        return list(out.split(sizes))
    uncond, cond = out.chunk(2)
    halves = [n // 2 for n in sizes]
    return [torch.cat([u, c]) for u, c in zip(uncond.split(halves), cond.split(halves))]


def guided(noise: torch.Tensor, use_cfg: bool, scale: float) -> torch.Tensor:
    """[uncond; cond] model output -> the guided prediction (or the output itself without CFG)."""
    if not use_cfg:
        return noise
    uncond, cond = noise.chunk(2)
    return uncond + scale * (cond - uncond)


def to_pixels(video: torch.Tensor, video_processor, output: str):
    """Decoded (B, 3, n, H, W) in [-1, 1] -> float32 (B, n, H, W, 3) in [0, 1] (diffusers' "np"), or uint8."""
    frames = video_processor.postprocess_video(video=video.float().cpu(), output_type="np")
    if output == "uint8":
        return (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)
    return frames


def sync_cuda() -> None:
    """Wait for this process's CUDA work (nothing on CPU): a stage's time must include its kernels."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timer:
    """Adds the wall time of a `with` block to `timings[key]`.

    On CUDA the block's kernels are waited for at both ends (one device sync each): without it the
    time is that of queueing the kernels, and the GPU work lands in whatever syncs next (first seen on
    an H100: a 16-frame 512x512 VAE decode "took" 10 ms and the pool overhead looked 0.3 s larger)."""

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


MAX_STEPS = 1000


def check_common(info: dict, spec: GenerationSpec, options: tuple[str, ...]) -> None:
    """Checks every family needs: prompts, frames, size, steps, guidance, seed, output, options."""
    if not spec.prompt or not all(isinstance(p, str) for p in spec.prompt):
        raise RequestError("prompt", "prompt must be a non-empty string or a non-empty list of strings")
    if any(not p.strip() for p in spec.prompt):
        raise RequestError("prompt", "prompt must not be empty")
    neg = spec.negative_prompt
    if isinstance(neg, (list, tuple)):
        if len(neg) != spec.batch_size or not all(isinstance(p, str) for p in neg):
            raise RequestError("negative_prompt", f"negative_prompt must be a string or a list of "
                                                  f"{spec.batch_size} strings (one per prompt)")
    elif not isinstance(neg, str):
        raise RequestError("negative_prompt", f"negative_prompt must be a string or a list of strings; "
                                              f"got {type(neg).__name__}")
    check_int("num_frames", spec.num_frames, 1)
    rule = info.get("frame_multiple", 1)
    if rule > 1 and (spec.num_frames - 1) % rule:
        lower = (spec.num_frames - 1) // rule * rule + 1
        raise RequestError("num_frames", f"num_frames must be {rule}k+1 for this model (its VAE compresses "
                                         f"{rule} frames into one); got {spec.num_frames}, try {lower} or "
                                         f"{lower + rule}")
    m = info["size_multiple"]
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
    unknown = sorted(set(spec.options) - set(options))
    if unknown:
        raise RequestError(unknown[0], f"{unknown[0]} is not an option of this model (a "
                                       f"{info.get('family', '?')} model accepts: "
                                       f"{', '.join(options) or 'no extra options'})")
