"""A video request as plain data (it travels to the workers), the one way a partial request is completed,
and the error that blames its input.

Every front door (the Python pipeline, `longserve generate`, HTTP create and extend, the live WebSocket)
hands the engine a `RequestInput`: what its caller gave, in the engine's terms, with None for "the
default". `complete_request` turns it into a `GenerationSpec` in one place, in this order:

1. the prompt: one string or a non-empty list of strings (blank ones are refused by `check_common`);
2. defaults: the model's (`ModelDescription.defaults`) where the operator set none (`EngineConfig`'s
   "defaults" group: `default_steps`, `default_guidance_scale`, `default_fps`), a random seed;
3. seconds -> frames at the request's fps under the VAE's frame rule (`frame_count`, the one function
   for it): the nearest count the model makes for a video, the seconds *added* for an extension (a
   `video` option), rounded down for a live session's length (`live`);
4. the engine's own request checks (the LoRA adapters loaded at start, the engine's default `cache`);
5. the family's `check_request` (its rules and options, `check_common` among them), which raises
   `RequestError` naming the field, so nothing a worker would refuse ever reaches the workers.

A door maps only its own syntax (a size string, a multipart field, a start message) and its own
limits (the server's longest video, largest size, most steps, longest prompt) on the completed spec.

`GenerationSpec` holds what every model family understands (prompts, frames, size, steps,
guidance, seed, what to return, the LoRA adapters of the request); `options` holds what only some families understand
(Wan 2.2's `guidance_scale_2`, diffusion forcing's `base_num_frames`, ...).
"""

from __future__ import annotations

import dataclasses
import math
import random
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from longserve.engine.errors import RequestError

if TYPE_CHECKING:
    from longserve.engine.config import EngineConfig, GenerationDefaults, ModelDescription

OUTPUTS = ("np", "uint8", "latent")
MAX_SEED = 2**63 - 1
#: more frames than any request may ask for (a door's own limit is far lower): seconds past it are refused before
#: they are counted in frames, where a float like 1e308 would overflow
MAX_FRAMES = 10**7
#: the option of an extension (diffusion forcing) that says how many of the video's last frames are made again
OVERLAP_OPTION = "overlap_history"
#: how deep a request's option values may nest (lists and objects in lists and objects): the deepest any family
#: takes is 2 (a list of LoRA adapter objects); anything deeper is refused before a checker walks it
MAX_NESTING = 16


def text_problem(text: str) -> str | None:
    """Why `text` is not Unicode text a tokenizer can encode, or None when it is.

    Every tokenizer the families load (HF tokenizers, SentencePiece) takes its text as UTF-8, so a string is
    encodable exactly when it encodes as UTF-8: a lone UTF-16 surrogate (U+D800..U+DFFF, which JSON's \\u escapes
    and Python strings can hold) is the one thing a `str` can hold that does not. Found here, it never reaches a
    worker (where the tokenizer would raise in `admit`)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"is not valid Unicode text: character {e.start} is a lone surrogate "
                f"(U+{ord(text[e.start]):04X}), which no tokenizer can encode")
    return None


def check_text(field_name: str, value, depth: int = 0) -> None:
    """Every string in `value` (a string, or lists and dicts of them, keys included) is encodable text
    (`text_problem`), and `value` nests at most MAX_NESTING deep; RequestError naming `field_name` otherwise."""
    if isinstance(value, str):
        problem = text_problem(value)
        if problem is not None:
            raise RequestError(field_name, f"{field_name} {problem}")
        return
    if isinstance(value, (list, tuple, dict)):
        if depth >= MAX_NESTING:
            raise RequestError(field_name, f"{field_name} nests lists or objects more than {MAX_NESTING} deep")
        items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
        for key, item in items:
            if key is not None:
                check_text(field_name, key, depth + 1)
            check_text(field_name, item, depth + 1)


def check_request_text(spec: "GenerationSpec") -> None:
    """Step 0 of the checks: every string a request holds -- prompts, negative prompts, the LoRA adapters' names,
    option names and values -- is text a tokenizer can encode (RequestError naming the field), so no checker's
    message and no worker ever meets one that is not."""
    check_text("prompt", spec.prompt)
    check_text("negative_prompt", spec.negative_prompt)
    check_text("lora", spec.lora)
    for name, value in spec.options.items():
        check_text("options", name)
        if not _is_array(value):
            check_text(name, value)


def _is_array(value) -> bool:
    return type(value).__module__ in ("numpy", "torch")        # images and videos: pixels, no text


@dataclass
class GenerationSpec:
    """One request. `prompt` is a list (one video per prompt); frames/size are in pixels.

    output: "np" -> float32 (B, n, H, W, 3) in [0, 1] per decoded chunk (diffusers' output_type="np");
            "uint8" -> the same pixels quantized as an MP4 writer wants them, round(x * 255);
            "latent" -> the final latents, in one chunk.
    decode_chunk_size: frames one worker pushes through the VAE at once (bounds its memory).
    lora: the adapters loaded at start that this request applies, [{"name", "scale"}, ...] once checked
          (`engine/lora.py`; the engine checks it, whatever the family).
    """

    request_id: str
    prompt: list[str]
    negative_prompt: list[str] | str
    num_frames: int
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    output: str = "np"
    decode_chunk_size: int = 8
    options: dict = field(default_factory=dict)
    lora: list = field(default_factory=list)
    fps: int | None = None          # the video's frames per second: what its seconds were counted in, the MP4's rate
    live: bool = False              # a live session (a causal model): no end of its own to wait for

    @property
    def batch_size(self) -> int:
        return len(self.prompt)

    @property
    def use_cfg(self) -> bool:
        return self.guidance_scale > 1.0

    def cfg_at(self, step: int) -> bool:
        """Does denoising step `step` (0-based) run the unconditional branch? Under CFG, unless the request's
        `cfg_trunc_ratio` option (diffusers' Lumina2Pipeline semantics) truncates it: step i of N runs without it
        once (i + 1) / N > ratio. 1.0, or no option: every step (exact). `step` may count on past one schedule
        (a long video's segments or chunks each run the N steps again): each schedule is truncated alike."""
        ratio = self.options.get("cfg_trunc_ratio")
        if ratio is None or not self.use_cfg:
            return self.use_cfg
        return (step % self.num_inference_steps + 1) / self.num_inference_steps <= ratio

    def to_params(self) -> dict:
        """The generation parameters of a one-prompt request as plain data (what the server stores), read back by
        `from_params`. `live` is kept among the options, where the records written before it was a field hold it
        (and the page reads it)."""
        return {"num_frames": self.num_frames, "height": self.height, "width": self.width,
                "num_inference_steps": self.num_inference_steps, "guidance_scale": self.guidance_scale,
                "seed": self.seed, "negative_prompt": self.negative_prompt,
                "options": {**self.options, **({"live": True} if self.live else {})},
                "lora": [dict(e) for e in self.lora or []], "fps": self.fps}

    @classmethod
    def from_params(cls, request_id: str, prompt: str, params: dict, output: str = "uint8") -> "GenerationSpec":
        """The inverse of `to_params` (other keys a record adds are ignored)."""
        options = dict(params.get("options") or {})
        return cls(request_id=request_id, prompt=[prompt], negative_prompt=params["negative_prompt"],
                   num_frames=params["num_frames"], height=params["height"], width=params["width"],
                   num_inference_steps=params["num_inference_steps"], guidance_scale=params["guidance_scale"],
                   seed=params["seed"], output=output, options=options, lora=list(params.get("lora") or []),
                   fps=params.get("fps"), live=options.pop("live", False) is True)

    def negative_prompts(self) -> list[str]:
        """One negative prompt per prompt."""
        if isinstance(self.negative_prompt, str):
            return [self.negative_prompt] * self.batch_size
        return list(self.negative_prompt)


@dataclass
class RequestInput:
    """A request as a front door hands it to the engine: what the caller gave; None means "the default".

    `seconds` is the video's length instead of `num_frames` (both may be given when they agree); for an
    extension (a `video` option) it is the length *added*. `options` are the family's own (and `image`,
    `video`, `live`, ...); `lora` takes any shape `engine.lora.check_request` does.
    """

    prompt: str | list[str]
    negative_prompt: str | list[str] | None = None
    num_frames: int | None = None
    seconds: float | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    fps: int | None = None
    output: str = "np"
    decode_chunk_size: int = 8
    options: dict = field(default_factory=dict)
    lora: object = None
    request_id: str | None = None
    live: bool = False               # a live session: its length rounded down, no end of its own (a causal model)


def default_request(desc: "ModelDescription", request_id: str) -> RequestInput:
    """A throw-away request at every default (the warm-up's, the start's check of the defaults): a grey image
    or video where the model needs one."""
    import numpy as np

    from longserve.engine.config import REQUIRED

    d, caps = desc.defaults, desc.capabilities
    grey = np.full((d.height, d.width, 3), 128, dtype=np.uint8)
    options = {}
    if caps.image == REQUIRED:
        options["image"] = grey
    if caps.last_image == REQUIRED:
        options["last_image"] = grey
    if caps.video == REQUIRED:
        options["video"] = np.stack([grey] * d.num_frames)
    return RequestInput(prompt="warm-up", seed=0, options=options, request_id=request_id)


def frame_count(frames: float, rule: int, *, down: bool = False, at_least: int = 1) -> int:
    """The frame count a model makes nearest to `frames` (rounded down with `down`), at least `at_least`.

    `rule` is the VAE's: counts are rule*k + 1 (a causal video VAE turns `rule` frames into one latent
    frame after the first); rule 1 takes any count. Halves round up."""
    steps = (frames - 1) / rule
    k = math.floor(steps + 1e-9) if down else math.floor(steps + 0.5)
    count = k * rule + 1
    while count < at_least:
        count += rule
    return max(1, count)


def prompt_list(prompt) -> list[str]:
    """One prompt or a non-empty list of them -> a list (RequestError naming "prompt" otherwise)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    raise RequestError("prompt", f"prompt must be a non-empty string or a non-empty list of strings; "
                                 f"got {type(prompt).__name__}")


def check_prompts(prompts, field_name: str = "prompt") -> None:
    """Prompts as the model takes them: strings, none of them blank (RequestError naming the field)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise RequestError(field_name, f"{field_name} must be a non-empty string or a non-empty list of strings")
    if any(not p.strip() for p in prompts):
        raise RequestError(field_name, f"{field_name} must not be empty")
    check_text(field_name, prompts)


def _integer(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(name, f"{name} must be an integer in [{low}, {high}]; got {value!r}")
    return value


def request_frames(request: RequestInput, desc: "ModelDescription", defaults: "GenerationDefaults", fps: int,
                   options: dict) -> int:
    """The request's num_frames: given, from its seconds under the frame rule, or the default."""
    rule = desc.frame_multiple
    extension = options.get("video") is not None
    overlap = (options.get(OVERLAP_OPTION, defaults.options.get(OVERLAP_OPTION)) or 0) if extension else 0
    if isinstance(overlap, bool) or not isinstance(overlap, int):
        overlap = 0                                   # the family names a bad overlap_history
    if request.seconds is None:
        if request.num_frames is not None:
            return request.num_frames
        # an extension re-makes the video's last `overlap` frames and adds at least one latent frame's worth
        return max(overlap + rule, defaults.num_frames) if extension else defaults.num_frames
    seconds = request.seconds
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds <= 0:
        raise RequestError("seconds", f"seconds must be a positive number; got {seconds!r}")
    if seconds * fps > MAX_FRAMES:                    # no model makes that many frames; past it, counts overflow
        raise RequestError("seconds", f"seconds={seconds:g} at fps={fps} is more than {MAX_FRAMES} frames")
    if extension:                                     # the seconds added: new frames in whole latent frames
        frames = frame_count(overlap + seconds * fps, rule, at_least=overlap + rule)
    else:                                             # a live session never runs past its length
        frames = frame_count(seconds * fps, rule, down=request.live)
    if request.num_frames is not None and request.num_frames != frames:
        raise RequestError("seconds", f"seconds={seconds:g} at fps={fps} is {frames} frames, but num_frames="
                                      f"{request.num_frames}; give one of them, or consistent values")
    return frames


def fill_request(request: RequestInput, desc: "ModelDescription", defaults: "GenerationDefaults") -> GenerationSpec:
    """Steps 1-3 of the completion (the module docstring): a spec with every field filled in, not yet checked."""
    from longserve.engine.config import MAX_FPS

    prompts = prompt_list(request.prompt)
    if not isinstance(request.live, bool):
        raise RequestError("live", f"live must be true or false; got {request.live!r}")
    if request.live and not desc.capabilities.live:
        raise RequestError("live", f"a {desc.family} model makes no live sessions (a causal model does)")
    fps = _integer("fps", defaults.fps if request.fps is None else request.fps, 1, MAX_FPS)
    options = {k: v for k, v in (request.options or {}).items() if v is not None}
    if "fps" in desc.options:                         # a model conditioned on fps gets the video's
        options.setdefault("fps", fps)
    pick = lambda given, default: default if given is None else given  # noqa: E731
    return GenerationSpec(
        request_id=request.request_id or uuid.uuid4().hex, prompt=prompts,
        negative_prompt=pick(request.negative_prompt, ""),
        num_frames=request_frames(request, desc, defaults, fps, options),
        height=pick(request.height, defaults.height), width=pick(request.width, defaults.width),
        num_inference_steps=pick(request.num_inference_steps, defaults.num_inference_steps),
        guidance_scale=pick(request.guidance_scale, defaults.guidance_scale),
        seed=random.randrange(MAX_SEED) if request.seed is None else request.seed,
        output=request.output, decode_chunk_size=request.decode_chunk_size, options=options,
        lora=request.lora, fps=fps, live=request.live)


def complete_request(request: "RequestInput | GenerationSpec", family, desc: "ModelDescription",
                     config: "EngineConfig") -> GenerationSpec:
    """A door's request -> a complete, checked `GenerationSpec` (the module docstring's steps; RequestError
    naming the field). A `GenerationSpec` is checked as it is (steps 4-5): checking is idempotent."""
    from longserve.engine import lora

    if isinstance(request, RequestInput):
        spec = fill_request(request, desc, config.request_defaults(desc.defaults))
    elif isinstance(request, GenerationSpec):
        spec = request
    else:
        raise TypeError(f"a request is a RequestInput or a GenerationSpec, not {type(request).__name__}")
    check_request_text(spec)
    spec.lora = lora.check_request(spec.lora, config.loras)                 # any family: the engine loaded them
    if config.cache is not None and "cache" not in spec.options:           # the engine's default step caching
        spec = dataclasses.replace(spec, options={**spec.options, "cache": config.cache})
    if config.cfg_trunc_ratio is not None and "cfg_trunc_ratio" not in spec.options \
            and "cfg_trunc_ratio" in desc.options:                          # the engine's default CFG truncation
        spec = dataclasses.replace(spec, options={**spec.options, "cfg_trunc_ratio": config.cfg_trunc_ratio})
    return family.check_request(desc, spec)
