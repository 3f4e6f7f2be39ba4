"""`EngineConfig`: every option of a video engine, declared once.

Every front door builds one and hands it on unchanged: `VideoPipeline.from_pretrained(model,
**options)`, `longserve generate | serve | bench ...` (their flags are generated from the
fields below, help text included, as vLLM's `EngineArgs.add_cli_args` / `from_cli_args`
do), the server's `ServeConfig`, the engine, the worker pool (a `WorkerConfig` is the one
argument every worker is set up with) and the model families.

Adding an option is adding a field here (with its `help`), the code that uses it, and its
test. A field's `group` says which commands offer it as a flag: "model" options are on
every command that loads a model, "scheduling" options only where several requests share
the engine (`serve`, the pipeline's keyword arguments take them all).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from longserve.weights.registry import TINY_MODELS, tiny_label

if typing.TYPE_CHECKING:
    from longserve.engine.parallel import ParallelPlan

DEVICES = (None, "cpu", "cuda")
MAX_STEPS = 1000                    # most denoising steps a request may ask for, anywhere
MAX_FPS = 1000                      # highest frames per second a request may ask for, anywhere
ATTENTION = ("auto", "sdpa", "xformers")
VAE_DTYPES = ("float32", "bfloat16", "float16")
LAUNCHERS = ("auto", "local", "torchrun")
COMPILE = ("none", "blocks")
VAE_SPLITS = ("items", "rows")
QUANTIZE = ("none", "fp8")
LIVE_LOOPS = ("serial", "overlapped", "pipelined", "stages")


def option(default, help: str, group: str = "model", flag: str | None = None, choices=None, metavar=None):
    """A config field: its default and what the CLI needs to offer it (help, group, flag name, choices)."""
    meta = {"help": help, "group": group, "flag": flag, "choices": choices, "metavar": metavar}
    if isinstance(default, (dict, list, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class EngineConfig:
    """How a video engine is built: the model, its workers and plan, the numerics, the scheduler's limits."""

    # -- the model and its workers --------------------------------------------------------------------
    profile: str = option("exact", "exact | fast: fast turns on, for every lever option left unset, the speed "
                                   "levers measured to win on the engine's device (CUDA: regional compile, the "
                                   "best attention backend installed, a bf16 VAE; several workers: the VAE's rows "
                                   "split; families that take them: step caching and CFG truncation at calibrated "
                                   "settings; never FP8: engine/profile.py, docs/benchmarks.md); exact: none",
                          choices=["exact", "fast"])
    model: str = option("tiny-latte", f"a shipped model ({', '.join(map(tiny_label, TINY_MODELS))}) or a local "
                                      "diffusers checkpoint directory")
    workers: int = option(1, "worker processes (one GPU each with CUDA)")
    parallel: str = option("auto", "auto | dsp | ulysses | ring | megatron-sp (Latte) | ulysses | ring | usp "
                                   "(Wan family)")
    ulysses_degree: int | None = option(None, "usp: Ulysses group size (ring degree = workers / it)")
    cfg_parallel: bool = option(False, "run the two classifier-free-guidance halves on two halves of the workers")
    device: str | None = option(None, "cpu | cuda (default: cuda when available)", choices=["cpu", "cuda"])
    dtype: str = option("float32", "float32 | bfloat16 | float16 (the transformer's; the Wan VAE stays float32)")
    vae_dtype: str | None = option(None, "the Wan-family VAE's dtype (default float32, as diffusers' Wan examples "
                                         "load it; bfloat16 decodes faster with bf16 rounding, as a Wan pipeline "
                                         "loaded whole in bfloat16 does; live (causal) models default to bfloat16 "
                                         "on CUDA)", choices=list(VAE_DTYPES))
    decoder: str = option("vae", "live (causal) models' frame decoder: vae (the model's own VAE) | tiny (the small "
                                 "decoder shipped for the model: tiny-live's) | PATH of a TAEHV weight file "
                                 "(.pth or .safetensors; taew2_1.pth for Wan 2.1 latents): a few convs a frame "
                                 "instead of the VAE (engine/small_decoder.py)", metavar="vae|tiny|PATH")
    attention: str = option("auto", "auto | sdpa | xformers (Latte on CUDA)", choices=list(ATTENTION))
    attention_backend: str | None = option(None, "diffusers' attention dispatcher backend for the families that run "
                                                 "diffusers' forward (Wan family, Helios, LTX-2, HunyuanVideo-1.5): "
                                                 "native, flash, _flash_3, sage, _native_cudnn, _native_efficient, "
                                                 "... (diffusers' AttentionBackendName); checked at start on the "
                                                 "device. Default: unset, PyTorch SDPA as diffusers' default "
                                                 "(docs/design.md, Attention backends)", metavar="NAME")
    vae_tiling: bool = option(False, "decode in the VAE's spatial tiles (diffusers' enable_tiling, default tile "
                                     "sizes): less VAE memory per worker, one Wan video's tiles spread over the "
                                     "workers; slower on one GPU")
    vae_split: str | None = option(None, "how the workers share a VAE decode: items (whole videos per worker, "
                                         "or diffusers' tiles with --vae-tiling: a lone untiled video decodes on "
                                         "one worker) | rows (every frame's rows across the workers, their edge "
                                         "rows exchanged per convolution: the untiled decode within float "
                                         "rounding, on N workers; Wan family, HunyuanVideo-1.5, LTX-2; without "
                                         "--vae-tiling; engine/vae_split.py). Default: items, rows under "
                                         "--profile fast", choices=list(VAE_SPLITS))
    cache: str | None = option(None, "step caching for requests that do not set their own `cache`: a preset "
                                     "(first_block, mag) or JSON such as '{\"kind\": \"first_block\", "
                                     "\"threshold\": 0.1}' (diffusers' FirstBlockCache, or MagCache on the Wan "
                                     "family: '{\"kind\": \"mag\", \"calibrate\": true}' measures its ratios; "
                                     "per request, engine/cache.py); default none: exact", metavar="PRESET|JSON")
    sparse_attention: str = option("none", "none | radial: the Wan family's (T2V, I2V, TI2V) self-attention under "
                                           "radial attention's static sparse mask, training-free (a query sees "
                                           "whole neighbouring frames and a window that halves as the frame "
                                           "distance doubles: O(n log n) keys; block-sparse FlexAttention on "
                                           "CUDA at one worker or Ulysses; engine/attention.py). Changes the "
                                           "frames: an approximation for long videos", choices=["none", "radial"])
    cfg_trunc_ratio: float | None = option(None, "CFG truncation for requests that do not set their own "
                                                 "`cfg_trunc_ratio`: step i of N runs the unconditional branch "
                                                 "only while (i + 1) / N <= this (diffusers' Lumina2 semantics; "
                                                 "Latte and the Wan family); default none: every step (exact)",
                                           metavar="RATIO")
    compile: str | None = option(None, "none | blocks: torch.compile the transformer's repeated block (Wan's "
                                  "WanTransformerBlock, Latte's spatial and temporal blocks), once per worker at "
                                  "start with a warm-up forward at the model's default size; frames equal the "
                                  "uncompiled ones within float reordering (1e-4 in float32). Not with --lora "
                                  "(docs/design.md, Regional compile and FP8). Default: none, blocks on CUDA under "
                                  "--profile fast", choices=list(COMPILE))
    quantize: str = option("none", "none | fp8: the transformer's linear layers in FP8 (torchao's float8 dynamic "
                                   "activation and weight quantisation; embeddings, norms and the output projection "
                                   "stay in --dtype); needs CUDA with compute capability >= 8.9, torchao "
                                   "(pip install '.[gpu]') and --dtype bfloat16", choices=list(QUANTIZE))
    #: the compile's torch backend: not a flag (the tests' "eager" and "aot_eager" check the mechanism without
    #: inductor's C++ code generation, which takes about half a minute a graph on a small CPU)
    cuda_graphs: bool = option(False, "with compile=blocks on CUDA, for live (causal) models: replay the compiled "
                                      "blocks as CUDA graphs (torch.compile's reduce-overhead mode): a live chunk's "
                                      "forwards have the same shapes from the first chunk on (engine/compile.py)")
    compile_backend: str = field(default="inductor", metadata={"group": "internal"})
    launcher: str = option("auto", "local: start --workers processes; torchrun: join the group torchrun started "
                                   "(auto: torchrun when launched by it)", choices=list(LAUNCHERS))
    loras: tuple = option((), "a LoRA adapter loaded at start, NAME=PATH[:SCALE] (repeatable): a .safetensors file in "
                              "diffusers or kohya/musubi format, or a shipped name (tiny-wan-lora); HIGH,LOW for one "
                              "file per expert of a two-expert model; SCALE is its scale when a request names it "
                              "without one (default 1). Requests choose adapters by name (engine/lora.py)",
                          flag="--lora", metavar="NAME=PATH[:SCALE]")

    # -- request defaults: what a request that leaves a field out gets, through every door ----------------
    default_steps: int | None = option(None, "num_inference_steps when a request gives none (default: the model's)",
                                       group="defaults")
    default_guidance_scale: float | None = option(None, "guidance_scale when a request gives none (default: the "
                                                        "model's)", group="defaults")
    default_fps: int | None = option(None, "frames per second when a request gives none: seconds x fps = frames, "
                                           "and the MP4's rate (default: the model's)", group="defaults")

    # -- the scheduler ------------------------------------------------------------------------------------
    max_batch: int = option(8, "most requests in one denoising step", group="scheduling")
    max_running: int | None = option(None, "most admitted requests (their latents live on the workers); "
                                           "default --max-batch", group="scheduling")
    max_queue: int | None = option(None, "most queued requests (refused beyond: HTTP 429); none = unbounded",
                                   group="scheduling")
    decode_chunk_frames: int = option(8, "frames per VAE decode call (and MP4 fragment)", group="scheduling")
    max_steps_per_job: int = option(4, "denoising steps one worker job may run while nothing else waits (fewer "
                                       "round trips; a newcomer waits at most this many steps minus one)",
                                    group="scheduling")
    live_loop: str = option("serial", "serial | overlapped | pipelined | stages: a causal (live) model's chunk "
                                      "loop. overlapped decodes chunk k on a decode lane while chunk k+1 denoises; "
                                      "pipelined (several workers) runs the transformer on workers 0..N-2 and "
                                      "the decode on worker N-1 (engine/live_lane.py; the same frames); stages "
                                      "(several workers) splits the transformer's blocks into one stage per "
                                      "worker and streams --stream-batch chunks through them at once "
                                      "(engine/live_stages.py; the serial loop's frames only with a stream batch "
                                      "of 1)", choices=list(LIVE_LOOPS), group="scheduling")
    stream_batch: int | None = option(None, "with --live-loop stages: chunks denoised at once, at different "
                                            "stages (StreamDiffusionV2's stream batch; default: the workers; 1 is "
                                            "exact, more changes what a chunk attends to: docs/design.md)",
                                      group="scheduling")
    job_timeout_s: float | None = option(600.0, "a worker job taking longer fails its batch and restarts the pool "
                                                "(seconds; none = no limit)", group="scheduling",
                                         flag="--job-timeout")
    oom_retry: bool = option(False, "when a batch runs out of memory, run its requests again one at a time "
                                    "instead of failing them", group="scheduling")
    live_kv_budget: float | None = option(None, "KV cache of causal (live) models' sessions and jobs, in MiB per "
                                                "worker: a request past it is refused (HTTP 503) instead of "
                                                "queued (default: a quarter of a worker's memory: of its GPU on "
                                                "CUDA, of the RAM shared by the workers on CPU)",
                                          group="scheduling", metavar="MIB")
    offload: str = option("none", "none | expert: a two-expert model (Wan 2.2 A14B) keeps only the current "
                                  "batch's expert on the device, the other in pinned host memory; batches are "
                                  "grouped by expert so that swaps are rare", choices=["none", "expert"],
                          group="scheduling")
    offload_max_wait: int = option(32, "with --offload expert: most batches of one expert that run while a "
                                       "request waits for the other, before the experts swap for it",
                                   group="scheduling")
    setup_retry_max_s: float = option(60.0, "longest wait between attempts to (re)load a model that fails to "
                                            "load (exponential backoff; seconds)", group="scheduling")

    def __post_init__(self):
        from longserve.engine.lora import parse_adapters

        object.__setattr__(self, "loras", parse_adapters(self.loras))     # any accepted shape -> LoraAdapter tuples
        _positive_int("workers", self.workers)
        if self.ulysses_degree is not None:
            _positive_int("ulysses_degree", self.ulysses_degree)
        for name in ("cfg_parallel", "vae_tiling", "oom_retry"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be 'cpu' or 'cuda' (default: cuda when available); got {self.device!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}; got {self.attention!r}")
        if self.attention_backend is not None:
            from longserve.engine.attention import check_name

            name = check_name(self.attention_backend)          # "none": unset; under "fast", explicitly off
            object.__setattr__(self, "attention_backend", "none" if name is None and self.profile == "fast" else name)
        if self.live_loop not in LIVE_LOOPS:
            raise ValueError(f"live_loop must be one of {', '.join(LIVE_LOOPS)}; got {self.live_loop!r}")
        if self.live_loop == "stages" and self.workers < 2:
            raise ValueError(f"live_loop 'stages' splits the transformer's blocks across the workers: it needs "
                             f"workers >= 2; got {self.workers}")
        if self.stream_batch is not None:
            _positive_int("stream_batch", self.stream_batch)
            if self.live_loop != "stages":
                raise ValueError(f"stream_batch is the stages live loop's (live_loop 'stages'); got live_loop "
                                 f"{self.live_loop!r}")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}; got {self.launcher!r}")
        from longserve.engine.dist import parse_dtype

        parse_dtype(self.dtype)
        if self.vae_dtype is not None and self.vae_dtype not in VAE_DTYPES:
            raise ValueError(f"vae_dtype must be one of {', '.join(VAE_DTYPES)}; got {self.vae_dtype!r}")
        if not isinstance(self.decoder, str) or not self.decoder:
            raise ValueError(f"decoder must be vae, tiny or the path of a TAEHV weight file; got {self.decoder!r}")
        if self.cache is not None:
            from longserve.engine.cache import parse_cache

            if not isinstance(self.cache, str):
                raise ValueError(f"cache must be a preset name or JSON text; got {type(self.cache).__name__}")
            if parse_cache(self.cache) is None:                # "none" / "off": no caching (under "fast": kept,
                object.__setattr__(self, "cache", None if self.profile == "exact" else "none")  # the lever is off)
        if self.profile not in ("exact", "fast"):
            raise ValueError(f"profile must be 'exact' or 'fast'; got {self.profile!r}")
        if self.cfg_trunc_ratio is not None and (isinstance(self.cfg_trunc_ratio, bool) or not isinstance(
                self.cfg_trunc_ratio, (int, float)) or not 0 <= self.cfg_trunc_ratio <= 1):
            raise ValueError(f"cfg_trunc_ratio must be a number in [0, 1] or None, got {self.cfg_trunc_ratio!r}")
        if self.profile == "exact":        # unset levers are off; under "fast" engine/profile.py decides them
            for name, off in (("compile", "none"), ("vae_split", "items")):
                if getattr(self, name) is None:
                    object.__setattr__(self, name, off)
        if self.sparse_attention not in ("none", "radial"):
            raise ValueError(f"sparse_attention must be 'none' or 'radial'; got {self.sparse_attention!r}")
        if self.vae_split not in (*VAE_SPLITS, None):
            raise ValueError(f"vae_split must be one of {', '.join(VAE_SPLITS)}; got {self.vae_split!r}")
        if self.vae_split == "rows" and self.vae_tiling:
            raise ValueError("vae_split 'rows' decodes untiled frames: not with vae_tiling")
        if self.compile not in (*COMPILE, None):
            raise ValueError(f"compile must be one of {', '.join(COMPILE)}; got {self.compile!r}")
        from longserve.engine.compile import BACKENDS

        if self.compile_backend not in BACKENDS:
            raise ValueError(f"compile_backend must be one of {', '.join(BACKENDS)}; got {self.compile_backend!r}")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}; got {self.quantize!r}")
        if self.offload not in ("none", "expert"):
            raise ValueError(f"offload must be 'none' or 'expert'; got {self.offload!r}")
        for name in ("max_batch", "decode_chunk_frames", "max_steps_per_job", "offload_max_wait"):
            _positive_int(name, getattr(self, name))
        if self.max_running is not None:
            _positive_int("max_running", self.max_running)
        if self.default_steps is not None and (_not_int(self.default_steps)
                                               or not 1 <= self.default_steps <= MAX_STEPS):
            raise ValueError(f"default_steps must be an integer in [1, {MAX_STEPS}] or None, got "
                             f"{self.default_steps!r}")
        if self.default_guidance_scale is not None and not (_positive_number(self.default_guidance_scale, True)
                                                            and self.default_guidance_scale <= 100):
            raise ValueError(f"default_guidance_scale must be a number in [0, 100] or None, got "
                             f"{self.default_guidance_scale!r}")
        if self.default_fps is not None and (_not_int(self.default_fps) or not 1 <= self.default_fps <= MAX_FPS):
            raise ValueError(f"default_fps must be an integer in [1, {MAX_FPS}] or None, got {self.default_fps!r}")
        if self.max_queue is not None and (_not_int(self.max_queue) or self.max_queue < 0):
            raise ValueError(f"max_queue must be a non-negative integer or None, got {self.max_queue!r}")
        if self.job_timeout_s is not None and not _positive_number(self.job_timeout_s):
            raise ValueError(f"job_timeout_s must be a positive number of seconds or None, got {self.job_timeout_s!r}")
        if self.live_kv_budget is not None and not _positive_number(self.live_kv_budget):
            raise ValueError(f"live_kv_budget must be a positive number of MiB or None, got {self.live_kv_budget!r}")
        if not _positive_number(self.setup_retry_max_s, allow_zero=True):
            raise ValueError(f"setup_retry_max_s must be a non-negative number, got {self.setup_retry_max_s!r}")

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        """`EngineConfig(**options)`, with an unknown option refused by name (ValueError, not TypeError)."""
        return build(cls, options)

    def replace(self, **changes) -> "EngineConfig":
        return build(type(self), {**dataclasses.asdict(self), **changes})

    def request_defaults(self, model: "GenerationDefaults") -> "GenerationDefaults":
        """What a request that leaves a field out gets: the model's defaults, with the operator's (the "defaults"
        group: --default-steps, --default-guidance-scale, --default-fps) in their place where set."""
        given = {"num_inference_steps": self.default_steps, "guidance_scale": self.default_guidance_scale,
                 "fps": self.default_fps}
        return dataclasses.replace(model, **{k: v for k, v in given.items() if v is not None})

    @property
    def live_kv_budget_bytes(self) -> int | None:
        return None if self.live_kv_budget is None else int(self.live_kv_budget * (1 << 20))

    @property
    def running_limit(self) -> int:
        return self.max_batch if self.max_running is None else self.max_running


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker is set up with: the engine's config, the checkpoint it resolved, the plan it chose."""

    engine: EngineConfig
    model_dir: str
    plan: ParallelPlan


@dataclass(frozen=True)
class GenerationDefaults:
    """A model's defaults for a request: diffusers' pipeline's (or the checkpoint's generation_defaults.json)."""

    num_frames: int
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    fps: int
    options: dict = field(default_factory=dict)       # the family's own options' defaults (base_num_frames, ...)

    @classmethod
    def from_dict(cls, d: dict) -> "GenerationDefaults":
        common = {f.name for f in dataclasses.fields(cls)} - {"options"}
        return cls(**{k: d[k] for k in common}, options={k: v for k, v in d.items() if k not in common})


#: how a model takes an input: never, when given, or always
REFUSED, OPTIONAL, REQUIRED = "refused", "optional", "required"
INPUT_RULES = (REFUSED, OPTIONAL, REQUIRED)


@dataclass(frozen=True)
class Capabilities:
    """What a loaded model can do: what the front doors (HTTP, the CLI, the page, the benches) read to build a
    request, refuse one early, or show a form. Each family fills it in its `describe`; nothing outside
    `engine/families/` reads the family's own facts."""

    image: str = REFUSED               # a first frame to start from (image-to-video): refused | optional | required
    last_image: str = REFUSED          # a last frame (first-last-frame)
    video: str = REFUSED               # a video to continue (extension by diffusion forcing)
    long_video: bool = False           # any length, streamed segment by segment (diffusion forcing, Helios, live)
    live: bool = False                 # live sessions over a rolling KV cache, prompt switches (causal models)
    frames_per_chunk: int = 0          # live: pixel frames a chunk holds
    live_window: int = 0               # live: latent frames a chunk attends to, itself included (sink + ring)
    two_experts: bool = False          # a high- and a low-noise denoiser (Wan 2.2 A14B: expert offload)
    cache_kinds: tuple[str, ...] = ()  # step caching a request may ask for (engine/cache.py)
    mag_calibration: bool = False      # the checkpoint carries MagCache's calibration (mag_ratios.json)
    lora: bool = False                 # loads --lora adapters, chosen per request
    compile: bool = False              # takes `compile` and `quantize`
    fps_conditioned: bool = False      # the model is given the video's fps (SkyReels-V2)
    sound: bool = False                # makes a sound track with the picture (LTX-2: `FramesChunk.audio`)
    # a model that makes sound (LTX-2): the transformer's sound tokens per second of video, and the video pixels
    # (frames x height x width) one of its video tokens stands for, so that a request's work counts both streams:
    # at a low fps the same frames are many more seconds of sound (admission's cost)
    sound_tokens_per_second: float = 0.0
    pixels_per_token: int = 0

    def __post_init__(self):
        for name in ("image", "last_image", "video"):
            if getattr(self, name) not in INPUT_RULES:
                raise ValueError(f"Capabilities.{name} must be one of {', '.join(INPUT_RULES)}")

    @property
    def takes_image(self) -> bool:
        return self.image != REFUSED

    @property
    def extends(self) -> bool:
        return self.video != REFUSED


@dataclass(frozen=True)
class FamilyFacts:
    """What a family knows of a checkpoint beyond the description every family gives (a Wan 2.2 expert boundary,
    a scheduler config, a causal model's loop): each family module defines its own frozen subclass, read by that
    family alone."""


@dataclass(frozen=True)
class ModelDescription:
    """What the coordinator knows of a checkpoint from its JSON configs alone (a family's `describe`)."""

    family: str
    pipeline: str
    heads: int
    size_multiple: int                 # height and width are multiples of it (VAE factor x patch size)
    frame_multiple: int                # frame counts are frame_multiple * k + 1 (1: any count)
    defaults: GenerationDefaults
    options: tuple[str, ...] = ()      # request options of this family (Wan 2.2's guidance_scale_2, ...)
    capabilities: Capabilities = field(default_factory=Capabilities)
    facts: FamilyFacts | None = None   # the family's own facts (its module's FamilyFacts subclass): families only


@dataclass(frozen=True)
class ModelInfo:
    """A loaded model: its description and what the workers report (plan, device, dtype, kernels)."""

    description: ModelDescription
    plan: ParallelPlan
    workers: int
    device: str
    dtype: str
    attention: str
    scheduler: str
    vae_tiling: bool
    compile: str = "none"
    compile_s: float | None = None     # the warm-up forward that compiled the blocks (rank 0's wall time)
    compiled_graphs: int = 0           # graphs compiled by then (one per block shape: batch sizes share one)
    quantize: str = "none"
    attention_backend: str | None = None     # diffusers' dispatcher backend the workers run (None: the default)

    def __getattr__(self, name: str) -> Any:      # info.family, info.defaults, ... read through
        if name == "description":
            raise AttributeError(name)
        return getattr(self.description, name)


# -- dataclass <-> command line ---------------------------------------------------------------------------


def build(cls, options: dict):
    """`cls(**options)` with unknown names refused by name, listing the known ones."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r}; {cls.__name__} takes: {', '.join(sorted(names))}")
    return cls(**options)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _base_type(f: dataclasses.Field, cls) -> type:
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


def _optional_parser(kind: type):
    def parse(text: str):
        return None if text.strip().lower() in ("none", "") else kind(text)

    parse.__name__ = kind.__name__
    return parse


def add_cli_args(parser: argparse.ArgumentParser, cls, groups: tuple[str, ...] | None = None,
                 defaults: dict | None = None, titles: dict | None = None, exclude: tuple[str, ...] = (),
                 aliases: dict[str, tuple[str, ...]] | None = None) -> None:
    """One flag per field of the dataclass `cls` whose group is in `groups` (all when None).

    `defaults` overrides a field's default for this command (the server queues at most 256,
    say); `titles` names the argument groups; `aliases` gives a field more spellings on this
    command (a flag's older name). Booleans are `--flag` (and `--no-flag`).
    """
    defaults = defaults or {}
    sections: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        group = f.metadata.get("group", "model")
        if (groups is not None and group not in groups) or f.name in exclude or "help" not in f.metadata:
            continue
        if group not in sections:
            sections[group] = parser.add_argument_group((titles or {}).get(group, group))
        target = sections[group]
        default = defaults.get(f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
        kind = _base_type(f, cls)
        help_text = f.metadata["help"] + ("" if default in (None, False, ()) else f" (default: {default})")
        kwargs = {"dest": f.name, "default": default, "help": help_text}
        flags = (_flag(f), *(aliases or {}).get(f.name, ()))
        if kind is tuple:           # a repeatable flag: each occurrence adds one item
            target.add_argument(*flags, action="append", type=str, metavar=f.metadata.get("metavar"),
                                **{**kwargs, "default": None})
            continue
        if kind is bool:
            target.add_argument(*flags, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
        if f.metadata.get("metavar"):
            kwargs["metavar"] = f.metadata["metavar"]
        optional = f.default is None or typing.get_origin(typing.get_type_hints(cls)[f.name]) in (
            typing.Union, types.UnionType)
        kwargs["type"] = _optional_parser(kind) if optional and kind in (int, float) else kind
        target.add_argument(*flags, **kwargs)


def from_cli_args(cls, args: argparse.Namespace, **overrides):
    """The dataclass `cls` from parsed arguments (fields without a flag keep their defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return build(cls, {**values, **overrides})


def _not_int(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _positive_int(name: str, value) -> None:
    if _not_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _positive_number(value, allow_zero: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return False
    return value >= 0 if allow_zero else value > 0
