"""`VideoRequests`: the HTTP shapes -> a complete request. This door maps only its own syntax and its own limits.

Its syntax: the `size` string ("WxH"), `seconds` as text, the multipart files (`input_reference`, an image or,
on a model that extends, an MP4 to continue; `last_image`), the extend route's source video, the live start
message. Its limits (`Limits`, from `ServeConfig` and the model): the longest video, the largest size, the
most steps, the highest fps, the longest prompt, the largest upload. Everything else -- defaults, seconds ->
frames under the VAE's frame rule, the prompt's and the model's checks -- is the engine's one accept path
(`VideoEngine.accept`, engine/request.py), whose `RequestError` becomes a 400 naming the HTTP field.
The server's limits are applied to the filled-in spec before the model's checks see it (`ServerLimits.check`),
and its admission prices the checked request in the same call (`ServerLimits.cost`): each door returns the
engine's `Accepted` (spec, content frames, cost), which the service queues as it is.
"""

from __future__ import annotations

import io
import math
import uuid
from dataclasses import dataclass

import PIL.Image

from longserve.engine.config import REQUIRED
from longserve.engine.engine import Accepted
from longserve.engine.errors import public_message
from longserve.engine.request import OVERLAP_OPTION, GenerationSpec, RequestError, RequestInput, frame_count
from longserve.pipelines.media import VideoInputError, encoded_video, is_mp4
from longserve.server.api.admission import job_cost
from longserve.server.api.errors import APIError
from longserve.server.api.protocol import VideoCreateRequest, VideoExtendRequest, parse_size
from longserve.server.api.store import VideoRecord
from longserve.server.api.uploads import decode_image, image_bytes

#: inputs that come as files, or from the source video, never as option fields
MEDIA_OPTIONS = ("image", "video", "last_image")
#: the `seconds` values the openai client's types allow (`VideoSeconds`; an extension's also 16 and 20): the ones a
#: refusal names as the nearest a model takes
SDK_SECONDS = (4, 8, 12)


@dataclass(frozen=True)
class Limits:
    """The server's limits on a request (and the default request, the admission's unit of work)."""

    size_multiple: int
    default_width: int
    default_height: int
    max_size: int
    frame_multiple: int      # frame counts are frame_multiple*k + 1 (1: any)
    default_frames: int
    max_frames: int
    max_steps: int
    default_steps: int
    fps: int
    sound_tokens_per_second: float = 0.0   # a model that makes sound: its cost counts the sound's tokens too
    pixels_per_token: int = 1

    @classmethod
    def of(cls, engine, config) -> "Limits":
        """From the served model (its request defaults, `VideoEngine.defaults`) and the `ServeConfig`."""
        info, d = engine.info, engine.defaults
        m, rule = info.size_multiple, info.frame_multiple
        max_size = config.max_size if config.max_size is not None else 2 * max(d.width, d.height)
        if config.max_frames is not None:
            max_frames = config.max_frames
        elif info.capabilities.long_video:
            if not config.max_seconds > 0:
                raise ValueError(f"max_seconds must be positive, got {config.max_seconds!r}")
            max_frames = max(d.num_frames, round(config.max_seconds * d.fps) + rule)
        else:
            max_frames = 4 * d.num_frames
        max_frames = frame_count(max_frames, rule, down=True)
        if max_size < m or max_frames < 1:
            raise ValueError(f"max_size must be >= {m} and max_frames >= 1")
        if d.num_inference_steps > config.max_steps:
            raise ValueError(f"the default step count ({d.num_inference_steps}) exceeds max_steps "
                             f"({config.max_steps})")
        fit = lambda v: max(m, min(v, max_size) // m * m)  # noqa: E731
        return cls(size_multiple=m, default_width=fit(d.width), default_height=fit(d.height), max_size=max_size,
                   frame_multiple=rule, default_frames=min(d.num_frames, max_frames), max_frames=max_frames,
                   max_steps=config.max_steps, default_steps=d.num_inference_steps, fps=d.fps,
                   sound_tokens_per_second=info.capabilities.sound_tokens_per_second,
                   pixels_per_token=max(1, info.capabilities.pixels_per_token))


class ServerLimits:
    """The server's `DoorLimits` for one request: `check` (its own limits on the filled-in spec, before the
    model's; none for a stored job read back) and `cost` (admission's price, `admission.job_cost`)."""

    def __init__(self, limits: Limits, frames_per_chunk: int = 0, check=None):
        self.limits, self.frames_per_chunk, self._check = limits, frames_per_chunk, check

    def check(self, spec: GenerationSpec) -> None:
        if self._check is not None:
            self._check(spec)

    def cost(self, spec: GenerationSpec) -> float:
        return job_cost(self.limits, spec, self.frames_per_chunk)


class VideoRequests:
    """`engine`: the `VideoEngine` (read at every request: its capabilities decide what an upload may be)."""

    def __init__(self, engine, config, limits: Limits, model_name: str, tmp_dir=None):
        self.engine, self.config, self.limits = engine, config, limits
        self.tmp_dir = tmp_dir            # the data dir's temp area (swept at start): an upload's trip to a decoder
        self.model_name = model_name
        self.model_names = {model_name, str(config.model)}
        self.elsewhere = None     # with replicas: a model not served here -> 400 naming `model` (replicas.py)

    # -- the three doors --------------------------------------------------------------------------------

    def create(self, req: VideoCreateRequest) -> Accepted:
        """`POST /v1/videos` -> a complete spec (APIError naming the field)."""
        self._check_model(req.model)
        self.check_text("prompt", req.prompt)
        self.check_text("negative_prompt", req.negative_prompt)
        self._check_fps(req.fps)
        options = req.options()
        refs = self._references(req.input_reference, options)
        self._check_schedule(options)
        width, height = self._size(req.size)
        seconds = None if req.seconds is None else parse_seconds(req.seconds)
        num_frames, fps = req.num_frames, req.fps
        if seconds is not None and fps is None and num_frames is None and "video" not in refs:
            fps = self.fps_for(seconds)              # past the frame limit at the model's fps: a lower fps
        if seconds is None and num_frames is None and "video" not in refs \
                and self.limits.default_frames != self.engine.defaults.num_frames:
            num_frames = self.limits.default_frames             # the model's default is past --max-frames
        request = RequestInput(prompt=req.prompt, negative_prompt=req.negative_prompt, num_frames=num_frames,
                               seconds=seconds, height=height, width=width,
                               num_inference_steps=req.num_inference_steps, guidance_scale=req.guidance_scale,
                               seed=req.seed, fps=fps, output="uint8", options={**options, **refs},
                               lora=req.lora, request_id=f"video_{uuid.uuid4().hex}")
        return self._complete(request, "input_reference", given_frames="num_frames" if seconds is None else None)

    def extend(self, source: VideoRecord, path, req: VideoExtendRequest) -> Accepted:
        """`POST /v1/videos/{id}/extend` of the completed `source` (its MP4 at `path`): its size, fps, steps,
        guidance, negative prompt, LoRA adapters and model options carry over unless the request sets them."""
        self.check_extends()
        self._check_model(req.model)
        self.check_text("prompt", req.prompt)
        self.check_text("negative_prompt", req.negative_prompt)
        p = source.params
        options = {k: v for k, v in (p.get("options") or {}).items() if k not in MEDIA_OPTIONS}
        options.update(req.options())
        for name in (*MEDIA_OPTIONS, "input_reference"):
            if name in options:
                raise APIError(400, f"{name}: an extension continues the video {source.id}; it takes no other input",
                               param=name, code="invalid_value")
        seconds = None if req.seconds is None else parse_seconds(req.seconds)
        pick = lambda given, stored: stored if given is None else given  # noqa: E731
        request = RequestInput(prompt=req.prompt, negative_prompt=pick(req.negative_prompt, p["negative_prompt"]),
                               seconds=seconds, height=p["height"], width=p["width"],
                               num_inference_steps=pick(req.num_inference_steps, p["num_inference_steps"]),
                               guidance_scale=pick(req.guidance_scale, p["guidance_scale"]), seed=req.seed,
                               fps=p["fps"], output="uint8",
                               options={**options, "video": self.read_video(path, "video_id")},
                               lora=pick(req.lora, p.get("lora") or []), request_id=f"video_{uuid.uuid4().hex}")
        return self._complete(request, "video_id")

    def remix(self, source: VideoRecord, path, req: VideoExtendRequest) -> tuple[Accepted, str]:
        """`POST /v1/videos/{id}/remix` of the completed `source` (its MP4 at `path`) with a new prompt -> (spec,
        how): on a model that extends ("extension"), the source continued under the new prompt; on one that takes
        an image ("image"), a video of the source's size, length and settings whose first frame is the source's
        last; elsewhere 400 naming `model`."""
        caps = self.engine.info.capabilities
        if caps.extends:
            return self.extend(source, path, req), "extension"
        if not caps.takes_image:
            raise APIError(400, f"this model ({self.model_name}, a {self.engine.info.family} model) cannot remix a "
                                f"video: a remix continues it (a diffusion-forcing model) or starts from its last "
                                f"frame (an image-to-video model); this one makes video from text only",
                           param="model", code="unsupported_operation")
        self._check_model(req.model)
        self.check_text("prompt", req.prompt)
        self.check_text("negative_prompt", req.negative_prompt)
        if req.seconds is not None:
            raise APIError(400, "seconds: a remix has the length of the video it remixes", param="seconds",
                           code="invalid_value")
        from longserve.server.api.stored_frames import last_frame

        p = source.params
        options = {k: v for k, v in (p.get("options") or {}).items() if k not in MEDIA_OPTIONS}
        options.update(req.options())
        buffer = io.BytesIO()
        PIL.Image.fromarray(last_frame(path)).save(buffer, format="PNG")
        pick = lambda given, stored: stored if given is None else given  # noqa: E731
        request = RequestInput(prompt=req.prompt, negative_prompt=pick(req.negative_prompt, p["negative_prompt"]),
                               num_frames=p["num_frames"], height=p["height"], width=p["width"],
                               num_inference_steps=pick(req.num_inference_steps, p["num_inference_steps"]),
                               guidance_scale=pick(req.guidance_scale, p["guidance_scale"]), seed=req.seed,
                               fps=p["fps"], output="uint8",
                               options={**options, "image": decode_image(buffer.getvalue(), "video_id",
                                                                         self.config.max_image_pixels)},
                               lora=pick(req.lora, p.get("lora") or []), request_id=f"video_{uuid.uuid4().hex}")
        return self._complete(request, "video_id", params={"image": "video_id"}), "image"

    def fps_for(self, seconds: float) -> int | None:
        """The fps a create asking for `seconds` (and no fps or frame count) gets: None (the model's) while its
        frames fit --max-frames, else the highest lower fps, down to half the model's, at which they do (the MP4
        lasts `seconds`; the model makes fewer frames). Past that, 400 naming `seconds` and the nearest value this
        model takes (one of the openai client's values where one fits)."""
        lim, fps = self.limits, self.engine.defaults.fps
        frames = lambda rate: frame_count(seconds * rate, lim.frame_multiple)  # noqa: E731
        if self.engine.info.capabilities.long_video:
            return None                              # its limit is --max-seconds: a lower fps would not keep it
        if not 0 < seconds * fps < 1e7 or frames(fps) <= lim.max_frames:
            return None                              # (the engine refuses a seconds not positive, or past 10^7 frames)
        lowest = max(1, math.ceil(fps / 2))
        for rate in range(fps - 1, lowest - 1, -1):
            if frames(rate) <= lim.max_frames:
                return rate
        fits = [v for v in SDK_SECONDS if frame_count(v * lowest, lim.frame_multiple) <= lim.max_frames]
        most = math.floor(4 * lim.max_frames / lowest) / 4          # the longest, in quarter seconds, that fits
        while most > 0.25 and frame_count(most * lowest, lim.frame_multiple) > lim.max_frames:
            most -= 0.25
        nearest = f"{max(fits)}" if fits else f"{most:g}"
        raise APIError(400, f"seconds={seconds:g} is {frames(fps)} frames at the model's {fps} fps and "
                            f"{frames(lowest)} at {lowest} fps (the lowest it is lowered to); this server makes at "
                            f"most {lim.max_frames} frames: the nearest seconds it takes is \"{nearest}\"",
                       param="seconds", code="invalid_value")

    def live(self, msg: dict, max_seconds: float) -> Accepted:
        """A live session's start message -> its spec: a request as long as `max_seconds` (--max-live-seconds)."""
        if msg.get("type") != "start":
            raise APIError(400, "the first message must be {\"type\": \"start\", \"prompt\": ...}", param="type",
                           code="invalid_value")
        unknown = sorted(set(msg) - {"type", "prompt", "size", "seed", "fps", "input_reference"})
        if unknown:
            raise APIError(400, f"unknown field {unknown[0]!r} in the start message", param=unknown[0],
                           code="unknown_parameter")
        prompt = msg.get("prompt")
        self.check_text("prompt", prompt)
        self._check_fps(msg.get("fps"))
        size = msg.get("size")
        if size is not None and not isinstance(size, str):
            raise APIError(400, f"size must be a string like \"64x64\"; got {size!r}", param="size",
                           code="invalid_value")
        width, height = self._size(size)
        image = msg.get("input_reference")        # a start image: a data URL, or {"image_url": data URL} as in create
        refs = self._references({"image_url": image} if isinstance(image, str) else image, {}) if image else {}
        request = RequestInput(prompt=prompt, seconds=max_seconds, height=height, width=width, seed=msg.get("seed"),
                               fps=msg.get("fps"), output="uint8", options=refs, live=True,
                               request_id=f"live_{uuid.uuid4().hex}")
        return self._complete(request, "input_reference", session=True, params={"image": "input_reference"})

    def check_extends(self) -> None:
        if not self.engine.info.capabilities.extends:
            raise APIError(400, f"this model ({self.model_name}, a {self.engine.info.family} model) cannot extend "
                                f"videos: extension needs a diffusion-forcing (SkyReels-V2 DF) checkpoint",
                           param="model", code="unsupported_operation")

    def check_text(self, name: str, text) -> None:
        """The server's limit on a prompt's length (the engine checks what a prompt must be)."""
        limit = self.config.max_prompt_chars
        if isinstance(text, str) and len(text) > limit:
            raise APIError(400, f"{name} is {len(text)} characters long; the limit is {limit}", param=name,
                           code="invalid_value")

    # -- completion with the server's limits ---------------------------------------------------------------

    def stored(self, rec: VideoRecord, inputs: dict | None = None) -> Accepted:
        """A stored job read back (a restart's queued job, a replica's claim; `inputs`: its uploads) -> `Accepted`:
        checked again as it is by this server's engine (its adapters, its model), priced by its admission."""
        spec = GenerationSpec.from_params(rec.id, rec.prompt, rec.params)
        spec.options.update(inputs or {})
        return self.engine.accept(spec, ServerLimits(self.limits))

    def _complete(self, request: RequestInput, source_field: str, given_frames: str | None = None,
                  session: bool = False, params: dict | None = None) -> Accepted:
        """`engine.accept` with the server's limits and price; a RequestError is a 400 naming the HTTP field
        (`params`: the engine's field -> the door's, by default a size's sides -> `size`, a media input -> its
        file)."""
        lim = self.limits
        video = request.options.get("video")

        def limits(spec: GenerationSpec) -> None:          # the filled-in spec, before the model's checks
            self._check_fps(spec.fps)
            if not session and spec.num_frames > lim.max_frames:
                if given_frames:
                    raise APIError(400, f"num_frames must be in [1, {lim.max_frames}]; got {spec.num_frames}",
                                   param=given_frames, code="invalid_value")
                self._too_long(spec, request, source_field, video)
            if not 1 <= spec.num_inference_steps <= lim.max_steps:
                raise APIError(400, f"num_inference_steps must be in [1, {lim.max_steps}]; got "
                                    f"{spec.num_inference_steps}", param="num_inference_steps", code="invalid_value")

        per_chunk = self.engine.info.capabilities.frames_per_chunk if session else 0
        try:
            accepted = self.engine.accept(request, ServerLimits(lim, per_chunk, limits))
        except RequestError as e:
            if params is None:
                params = {"height": "size", "width": "size", "image": "input_reference", "video": source_field}
            param = params.get(e.field, e.field)
            raise APIError(400, public_message(e), param=param, code="invalid_value") from None
        if video is not None and accepted.content_frames > lim.max_frames:
            self._too_long(accepted.spec, request, source_field, video, accepted.content_frames)
        return accepted

    def _too_long(self, spec, request: RequestInput, source_field: str, video, content: int | None = None):
        lim, fps = self.limits, spec.fps
        limit = f"the limit is {lim.max_frames} frames ({lim.max_frames / fps:g} s at {fps} fps)"
        param = "seconds" if request.seconds is not None else source_field
        if video is not None:
            if content is None:                 # before the model's checks: its new frames as the engine counts them
                d = self.engine.defaults.options
                content = len(video) + spec.num_frames - (spec.options.get(OVERLAP_OPTION, d.get(OVERLAP_OPTION)) or 0)
            made = f"{len(video)} + {content - len(video)} = {content}"
            raise APIError(400, f"the extended video would be {made} frames; {limit}", param=param,
                           code="invalid_value")
        raise APIError(400, f"seconds={request.seconds:g} at fps={fps} is {spec.num_frames} frames; {limit}",
                       param="seconds", code="invalid_value")

    # -- this door's syntax ----------------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            if self.elsewhere is not None:
                self.elsewhere(model)
            raise APIError(404, f"model {model!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _check_fps(self, fps) -> None:
        limit = self.config.max_fps
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int) or not 1 <= fps <= limit):
            raise APIError(400, f"fps must be an integer in [1, {limit}]; got {fps!r}", param="fps",
                           code="invalid_value")

    def _check_schedule(self, options: dict) -> None:
        for name in ("sigmas", "timesteps"):         # a fixed schedule sets the step count: the same limit
            if isinstance(options.get(name), list) and not 1 <= len(options[name]) <= self.limits.max_steps:
                raise APIError(400, f"{name} sets the steps: at most {self.limits.max_steps} values; got "
                                    f"{len(options[name])}", param=name, code="invalid_value")

    def _size(self, size: str | None) -> tuple[int | None, int | None]:
        """A `size` string -> (width, height) within the limits; None for the default (the model's, or the
        largest the limits allow)."""
        lim, d = self.limits, self.engine.defaults
        if size is None:
            if (lim.default_width, lim.default_height) == (d.width, d.height):
                return None, None
            return lim.default_width, lim.default_height
        try:
            width, height = parse_size(size)
        except ValueError:
            raise APIError(400, f"size must look like WIDTHxHEIGHT, e.g. \"{lim.default_width}x{lim.default_height}\"; "
                                f"got {size!r}", param="size", code="invalid_value") from None
        for name, v in (("width", width), ("height", height)):
            if not lim.size_multiple <= v <= lim.max_size:
                raise APIError(400, f"size: {name} must be in [{lim.size_multiple}, {lim.max_size}]; got {size!r}",
                               param="size", code="invalid_value")
        return width, height

    def _references(self, input_reference, options: dict) -> dict:
        """An image-to-video model's images, or the video a model extends, decoded: `input_reference` is the first
        frame's image (`server/api/uploads.py`) or, on a model that extends, an MP4 to continue (told apart by
        their bytes: `pipelines/media.py`); the `last_image` file field is the last frame's image. Refused,
        naming the field, where the model takes no such input, and when missing where it needs one."""
        last = options.pop("last_image", None)
        for name in ("image", "video"):
            if name in options:
                raise APIError(400, f"{name}: send the {name} as the file field input_reference", param=name,
                               code="invalid_value")
        caps = self.engine.info.capabilities
        if not caps.takes_image and not caps.extends:
            for name, value in (("input_reference", input_reference), ("last_image", last)):
                if value is not None:
                    raise APIError(400, f"{name} is not supported: this model generates video from text only",
                                   param=name, code="unsupported_parameter")
            return {}
        limit = self.config.max_image_pixels
        data = None if input_reference is None else image_bytes(input_reference, "input_reference")
        if data is not None and is_mp4(data[:12]):
            if not caps.extends:
                raise APIError(400, "input_reference is a video (MP4), but this model does not extend videos: send "
                                    "an image (PNG, JPEG or WebP)", param="input_reference", code="unsupported_video")
            refs = {"video": self.read_video(data, "input_reference")}
        elif data is not None:
            if not caps.takes_image:
                raise APIError(400, "input_reference must be an MP4 video: this model extends videos and takes no "
                                    "image", param="input_reference", code="unsupported_image")
            refs = {"image": decode_image(data, "input_reference", limit)}
        elif caps.video == REQUIRED:
            raise APIError(400, "input_reference is required: this model extends a video (send an MP4 file as the "
                                "multipart field input_reference, or use POST /v1/videos/{id}/extend)",
                           param="input_reference", code="missing_parameter")
        elif caps.image == REQUIRED:
            raise APIError(400, "input_reference is required: this model makes a video from an image (send a PNG, "
                                "JPEG or WebP file as the multipart field input_reference)",
                           param="input_reference", code="missing_parameter")
        else:                           # a model that takes an image or none (Wan 2.2 TI2V, diffusion forcing)
            refs = {}
        if last is not None:
            refs["last_image"] = decode_image(image_bytes(last, "last_image"), "last_image", limit)
        return refs

    def read_video(self, source, field: str):
        """An MP4 (bytes or a stored file) -> the checked file (`EncodedVideo`: a queued job holds it, not its frames;
        the worker decodes it again), bounded before decoding: at most --max-frames frames (the
        longest video this server makes), --max-image-pixels pixels each, and as many pixels in all as the
        longest video at the largest size holds."""
        lim = self.limits
        try:
            return encoded_video(source, field, max_frames=lim.max_frames, max_pixels=self.config.max_image_pixels,
                                 max_total_pixels=lim.max_frames * lim.max_size * lim.max_size, tmp_dir=self.tmp_dir)
        except VideoInputError as e:
            raise APIError(400, public_message(e), param=field, code=e.code) from None    # no temp file paths


def parse_seconds(text: str) -> float:
    """`seconds` as OpenAI sends it (text, "4") -> a number (the engine checks it is positive)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise APIError(400, f"seconds must be a number of seconds, e.g. \"4\"; got {text!r}", param="seconds",
                       code="invalid_value") from None
    if not math.isfinite(value):
        raise APIError(400, f"seconds must be a finite number; got {text!r}", param="seconds", code="invalid_value")
    return value
