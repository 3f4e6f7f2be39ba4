"""The HTTP protocol: every request and response body of the server, as pydantic models.

Shapes follow the OpenAI Videos API (`openai.types.Video`, `VideoCreateParams`,
`VideoDeleteResponse`, the cursor-page list envelope) so the official `openai` client
works unchanged; the extensions (`num_frames`, `fps`, `num_inference_steps`,
`guidance_scale`, `negative_prompt`, `seed`, `lora`) are optional fields of the same create body; `extended_from`
is the provenance of a video made by `POST /v1/videos/{id}/extend`.
Route handlers live in `server/api/routes.py`; nothing here does I/O.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def parse_size(text: str) -> tuple[int, int]:
    """A `size` string, "WxH" (OpenAI's order: width first) -> (width, height); ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*", str(text))
    if not m:
        raise ValueError(f"size must look like WIDTHxHEIGHT, e.g. 64x64; got {text!r}")
    return int(m.group(1)), int(m.group(2))


# -- field types that accept JSON values and the strings of a multipart form alike --------


def _int_from_text(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("must be an integer, not a boolean")
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"must be an integer, got {value!r}") from None
    return value


def _float_from_text(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise ValueError(f"must be a number, got {value!r}") from None
    return value


def _seconds_text(value: Any) -> Any:
    # OpenAI sends seconds as a string ("4"); accept a JSON number too, keep it as text
    if isinstance(value, bool):
        raise ValueError("must be a number of seconds, e.g. \"4\"")
    if isinstance(value, (int, float)):
        return repr(value) if isinstance(value, float) else str(value)
    return value


FormInt = Annotated[int, BeforeValidator(_int_from_text), Field(strict=True)]
FormFloat = Annotated[float, BeforeValidator(_float_from_text)]
SecondsText = Annotated[str, BeforeValidator(_seconds_text)]


# -- errors -----------------------------------------------------------------------------------


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error envelope: every 4xx and 5xx body."""

    error: ErrorBody


# -- videos -------------------------------------------------------------------------------------


class VideoCreateRequest(BaseModel):
    """`POST /v1/videos` (JSON or multipart/form-data).

    Fields beyond the ones below are the served model's own options (Wan 2.2's
    `guidance_scale_2`, diffusion forcing's `base_num_frames`, ...): they are handed to the
    model family, which refuses, naming it, any field it does not know.
    """

    model_config = ConfigDict(extra="allow", str_strip_whitespace=False)

    prompt: str
    model: str | None = None
    seconds: SecondsText | None = None
    size: str | None = None
    input_reference: Any = None  # image-to-video: an uploaded file (`uploads.Upload`) or {"image_url": data URL}
    # extensions
    num_frames: FormInt | None = None
    fps: FormInt | None = None
    num_inference_steps: FormInt | None = None
    guidance_scale: FormFloat | None = None
    negative_prompt: str | None = None
    seed: FormInt | None = None
    # LoRA adapters loaded at start (--lora NAME=PATH), by name: [{"name": "style", "scale": 0.8}]; in a
    # multipart form the same as JSON text, or "style:0.8,fast" (checked by the engine: engine/lora.py)
    lora: Annotated[Any, BeforeValidator(lambda v: _form_value(v) if isinstance(v, list) else v)] = None

    def options(self) -> dict:
        """The model-specific fields, with form text ("5", "0.5", "true") read as the number or flag it spells."""
        return {k: _form_value(v) for k, v in (self.model_extra or {}).items() if v is not None}


class VideoExtendRequest(BaseModel):
    """`POST /v1/videos/{id}/extend` (JSON): continue a completed video by `seconds` (a longserve endpoint; OpenAI
    has none). Unset fields are the source video's (steps, guidance, negative prompt, LoRA adapters, its model
    options); extra fields are the model's own options, as in create."""

    model_config = ConfigDict(extra="allow")

    prompt: str
    model: str | None = None
    seconds: SecondsText | None = None
    num_inference_steps: FormInt | None = None
    guidance_scale: FormFloat | None = None
    negative_prompt: str | None = None
    seed: FormInt | None = None
    lora: Any = None          # as create's; unset: the source's adapters

    def options(self) -> dict:
        return {k: _form_value(v) for k, v in (self.model_extra or {}).items() if v is not None}


def _form_value(value: Any) -> Any:
    if isinstance(value, list):                        # a form's `sigmas[]` fields (routes.unflatten_form)
        return [_form_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _form_value(v) for k, v in value.items()}
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):     # a list in a form field (sigmas): its JSON text
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return value
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return value


class VideoError(BaseModel):
    code: str
    message: str


VideoStatus = Literal["queued", "in_progress", "completed", "failed"]


class Video(BaseModel):
    """The Video object (`openai.types.Video`) plus the generation parameters actually used."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: VideoStatus
    progress: int = Field(ge=0, le=100)
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    error: VideoError | None = None
    prompt: str | None = None
    remixed_from_video_id: str | None = None
    extended_from: str | None = None     # an extension (POST /v1/videos/{id}/extend): the video it continues
    seconds: str
    size: str
    # extensions: what was generated
    num_frames: int
    fps: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    negative_prompt: str = ""
    options: dict[str, Any] = Field(default_factory=dict)   # the model's own options, as given
    lora: list[dict[str, Any]] = Field(default_factory=list)  # the LoRA adapters applied: [{"name", "scale"}]
    #: once completed: transformer block evaluations made and skipped by step caching (the `cache` option)
    transformer_blocks: dict[str, int] | None = None
    #: where it stands (`video_jobs.progress_state`): stage, percent, step, frames, queue position, elapsed, ETA
    state: dict[str, Any] | None = None


class VideoList(BaseModel):
    """`GET /v1/videos`: OpenAI's cursor page (`SyncConversationCursorPage`)."""

    object: Literal["list"] = "list"
    data: list[Video]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


# -- models, health -------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "longserve"
    kind: Literal["video", "score"] = "video"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthError(BaseModel):
    kind: str
    rank: int | None = None
    message: str


class Health(BaseModel):
    """`GET /health`: 200 with status "ok" only while every worker is up and loaded; 503 otherwise."""

    status: Literal["ok", "starting", "restarting", "unavailable", "degraded", "draining"]
    model: str
    workers: int
    workers_ready: bool
    worker_state: str
    worker_restarts: int
    setup_failures: int
    queued: int
    running: int
    last_error: HealthError | None = None
    warnings: list[str] = []          # the deployment's risks (an open server on a reachable address)
    reason: str | None = None               # why "degraded" (storage) or "draining" (SIGTERM)
    disk_free_bytes: int | None = None      # the data dir's file system, as last measured
    replica: dict | None = None             # with replicas: its id, models and capacity (server/api/replicas.py)
    warm_up_s: float | None = None          # the warm-up video's time (--warm-up-shape; none without one)
    #: the start's stages (store, workers, warm_up, recover): {"stage", "detail", "elapsed_s", "stages", "error"}
    startup: dict | None = None


# -- scoring ----------------------------------------------------------------------------------------


class ScoreRequest(BaseModel):
    """`POST /v1/score`: the log-likelihood of `text` under a causal LM."""

    model_config = ConfigDict(extra="forbid")

    text: str
    model: str | None = None


class ScoreResponse(BaseModel):
    object: Literal["score"] = "score"
    model: str
    num_tokens: int
    num_bytes: int | None
    total_nll: float
    mean_nll: float
    perplexity: float | None       # None when it overflows a float
    bits_per_byte: float | None
    seconds: float
