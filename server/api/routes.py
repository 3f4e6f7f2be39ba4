"""Route handlers: parse and check the HTTP request, call the service, shape the answer.

Request and response bodies are the models of `server/api/protocol.py`; the work is done by
`server/api/service.py` (videos and live sessions) and `server/api/score_service.py` (scoring). Every error is an
`APIError`, answered in the OpenAI envelope by `server/api/errors.py`.
"""

from __future__ import annotations

import asyncio
import re
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request, WebSocket
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect

from longserve.server.api import metrics
from longserve.server.api.edge import matching_key
from longserve.server.api.errors import APIError, validation_error
from longserve.server.api.json_input import check_field_text, load_object
from longserve.server.api.protocol import (
    Health,
    ModelCard,
    ModelList,
    ScoreRequest,
    VideoCreateRequest,
    VideoExtendRequest,
)
from longserve.server.api.streaming import TERMINAL_EVENTS, SlotStream, shutdown_envelope, sse_stream, tail_file
from longserve.server.api.tenants import NO_KEY, Caller
from longserve.server.api.uploads import Upload

FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
#: the create body's file fields: OpenAI's image (or other reference) and the first-last-frame extension
FILE_FIELDS = ("input_reference", "last_image")


def require_api_key(request: Request) -> None:
    """401 without a valid key (when the server has keys); `request.state.caller`: who it is (`tenants.Caller`).
    Every request takes a token of its client's rate (`fairness.py`): its key's, or its address's without one."""
    keys = request.app.state.api_keys
    fairness = request.app.state.fairness
    request.state.caller = NO_KEY
    if not keys:
        fairness.take(client_of(request))
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    key = matching_key(token.strip(), keys) if scheme.lower() == "bearer" else None
    if key is None:
        fairness.take(client_of(request))        # wrong keys count where they come from
        raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
    request.state.caller = Caller.of_key(key, request.app.state.admin_keys)
    fairness.take(client_of(request))


def client_of(request) -> str:
    """Who a request (or a WebSocket) counts against for fairness: its key's id, else its address."""
    caller = getattr(request.state, "caller", NO_KEY)
    if caller.owner is not None:
        return caller.owner
    return "addr:" + (request.client.host if request.client is not None else "unknown")


def require_started(request: Request) -> None:
    """503 `model_loading` (Retry-After) while the server still loads: it listens first (`/health/live` answers,
    `/health/ready` tells the stage), and the API answers once the model is loaded and warm."""
    videos = request.app.state.videos
    if not getattr(videos, "started", True):      # (a stand-in service of a test has no start)
        stage = videos.startup.view()
        raise APIError(503, f"the server is starting ({stage['stage']}: {stage['detail'] or '...'}); retry in a "
                            f"moment (GET /health/ready says when it is ready)", code="model_loading",
                       headers={"Retry-After": "5"})


def json_body(model) -> dict:
    """The OpenAPI `requestBody` of a route that parses its own body (`parse_json_object`): `model`'s JSON schema, so
    the published schema says what the route takes (clients, and the suite's fuzzer, read it)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


#: OpenAPI links from a response that is a video to what may be done with it next (the fuzzer's stateful runs
#: follow them: create, then read, stream, extend or delete that video)
def video_links(what: str, pointer: str) -> dict:
    return {"responses": {"200": {"description": what, "links": {
        name: {"operationId": operation, "parameters": {"video_id": f"$response.body#{pointer}"}}
        for name, operation in (("RetrieveVideo", "retrieveVideo"), ("DeleteVideo", "deleteVideo"),
                                ("DownloadContent", "downloadVideoContent"), ("ExtendVideo", "extendVideo"))}}}}


VIDEO_LINKS = video_links("The video.", "/id")


router = APIRouter()                                                     # no auth: probes and scrapers
v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key), Depends(require_started)])   # the API


# -- body parsing ------------------------------------------------------------------------------------


async def read_body(request: Request) -> bytes:
    """The raw body, refused with 413 beyond the server's limit (announced or streamed)."""
    limit = request.app.state.max_body_bytes
    announced = request.headers.get("content-length")
    if announced is not None:
        try:
            if int(announced) > limit:
                raise APIError(413, f"request body is {announced} bytes; the limit is {limit}",
                               code="request_too_large")
        except ValueError:
            raise APIError(400, "the Content-Length header is not a number", code="invalid_request") from None
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:    # gone, or cut off by --request-read-timeout: nobody reads the answer
        raise APIError(408, "the request body was not received in full", code="request_timeout") from None
    return b"".join(chunks)


def _content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def validated(model, data: dict):
    """`data` as `model` (pydantic), or the API's 400 naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


async def body_as(request: Request, model):
    """The body, a JSON object whatever its Content-Type says, as `model` (`validated`)."""
    return validated(model, parse_json_object(await read_body(request)))


async def json_request(request: Request, model):
    """A JSON-only route's body as `model`: 415 for another content type, 400 naming the field."""
    ctype = _content_type(request)
    if ctype not in ("", "application/json", "text/json") and not ctype.endswith("+json"):
        raise APIError(415, f"unsupported Content-Type {ctype!r}: send application/json",
                       code="unsupported_media_type")
    return await body_as(request, model)


def parse_json_object(body: bytes, what: str = "request body") -> dict:
    if not body.strip():
        raise APIError(400, f"the {what} is empty; send a JSON object", code="invalid_json")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the {what} is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from None
    return load_object(text, what)            # depth and text checked before any field is read


_BRACKETS = re.compile(r"([^\[\]]+)\[\](?:\[([^\[\]]+)\])?|([^\[\]]+)\[([^\[\]]+)\]")


def unflatten_form(fields: list[tuple[str, object]]) -> dict:
    """Form fields in the bracket notation the openai client writes a list or an object of `extra_body` in
    (`sigmas[]=1.0`, `lora[][name]=style`, `lora[][scale]=0.5`, `opt[key]=v`) -> the list or dict they spell. In
    a list of objects a key that repeats starts the next object, as Rails and qs read them. (Repeated plain
    fields keep the last value, as before; only bracketed names are grouped.)"""
    out: dict = {}
    for key, value in fields:
        m = _BRACKETS.fullmatch(key)
        if m is None:
            out[key] = value
        elif m.group(1) and m.group(2) is None:                          # name[]
            out.setdefault(m.group(1), []).append(value)
        elif m.group(1):                                                 # name[][key]
            items = out.setdefault(m.group(1), [])
            if not items or not isinstance(items[-1], dict) or m.group(2) in items[-1]:
                items.append({})
            items[-1][m.group(2)] = value
        else:                                                            # name[key]
            out.setdefault(m.group(3), {})[m.group(4)] = value
    return out


async def parse_create_body(request: Request, file_fields: tuple[str, ...] = FILE_FIELDS) -> dict:
    """JSON, multipart/form-data or urlencoded form -> a dict for `VideoCreateRequest` (file parts as `Upload`s;
    `file_fields`: the fields that may be files)."""
    ctype = _content_type(request)
    try:
        body = await read_body(request)
    except APIError as e:
        if e.status == 413 and ctype == "multipart/form-data":
            # what makes a form that large is its file: 413 (the status --max-body-bytes' help gives every body over
            # the limit) naming input_reference, code file_too_large (a JSON body: request_too_large)
            raise APIError(413, f"input_reference is too large: {e.message}", param="input_reference",
                           code="file_too_large") from None
        raise
    if ctype in FORM_TYPES:
        async def replay():
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            form = await Request(request.scope, replay).form(max_files=2, max_fields=32)
        except Exception as e:  # python-multipart's and starlette's parse errors
            raise APIError(400, f"malformed form data: {getattr(e, 'detail', None) or e}", code="invalid_form") \
                from None
        fields = []
        try:
            for key, value in form.multi_items():
                if isinstance(value, UploadFile):
                    if key not in file_fields:
                        raise APIError(400, f"{key} must be a text field, not a file upload", param=key,
                                       code="invalid_value")
                    fields.append((key, Upload(await value.read(), value.filename, value.content_type)))
                else:
                    fields.append((key, value))
        finally:
            await form.close()             # starlette's spooled temporary files go with it
        for key, value in fields:          # a form's text is held to what a JSON body's is (`json_input`)
            check_field_text(key, value)
        return unflatten_form(fields)
    if ctype in ("", "application/json", "text/json") or ctype.endswith("+json"):
        return parse_json_object(body)
    raise APIError(415, f"unsupported Content-Type {ctype!r}: send application/json or multipart/form-data",
                   code="unsupported_media_type")


# -- videos -----------------------------------------------------------------------------------------------


@router.websocket("/v1/videos/live")
async def live_video(websocket: WebSocket):
    """A live session on a causal model (server/api/live.py): JSON events and one fMP4 fragment per chunk."""
    if not getattr(websocket.app.state.videos, "started", True):          # still loading: try again later (1013)
        await websocket.close(code=1013, reason="the server is starting")
        return
    await websocket.app.state.videos.live.run(websocket, websocket.app.state.api_keys)


@router.get("/v1/videos/live")
async def live_video_without_upgrade():
    """A plain GET of the live endpoint (a browser, curl): 426 saying it is a WebSocket, not 404."""
    raise APIError(426, "/v1/videos/live is a WebSocket endpoint: connect with ws:// (or wss://) and send "
                        "{\"type\": \"start\", \"prompt\": ...}; docs/serving.md, Live video",
                   code="upgrade_required", headers={"Upgrade": "websocket", "Connection": "Upgrade"})


@v1.post("/videos", operation_id="createVideo", openapi_extra={**json_body(VideoCreateRequest), **VIDEO_LINKS})
async def create_video(request: Request):
    req = validated(VideoCreateRequest, await parse_create_body(request))
    video = await run_in_threadpool(request.app.state.videos.create, req, request.state.caller)
    return JSONResponse(video.model_dump())


@v1.post("/videos/{video_id}/extend", operation_id="extendVideo",
         openapi_extra={**json_body(VideoExtendRequest), **VIDEO_LINKS})
async def extend_video(request: Request, video_id: str):
    """Continue a completed video (a diffusion-forcing model): a new video whose content is the whole extended
    video, streamed like any other (`/content?stream=true`)."""
    req = await json_request(request, VideoExtendRequest)
    video = await run_in_threadpool(request.app.state.videos.extend, video_id, req, request.state.caller)
    return JSONResponse(video.model_dump())


@v1.get("/videos", operation_id="listVideos", openapi_extra=video_links("A page of videos.", "/first_id"))
async def list_videos(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100),
                      order: Literal["asc", "desc"] = "desc"):
    page = await run_in_threadpool(request.app.state.videos.list, after, limit, order,
                                   request.state.caller)
    return JSONResponse(page.model_dump())


@v1.get("/videos/{video_id}", operation_id="retrieveVideo")
async def retrieve_video(request: Request, video_id: str):
    video = await run_in_threadpool(request.app.state.videos.get, video_id, request.state.caller)
    headers = {}
    if video.status in ("queued", "in_progress"):  # the openai client's poll() honours this
        headers["openai-poll-after-ms"] = str(request.app.state.poll_after_ms)
    return JSONResponse(video.model_dump(), headers=headers)


@v1.delete("/videos/{video_id}", operation_id="deleteVideo")
async def delete_video(request: Request, video_id: str):
    deleted = await run_in_threadpool(request.app.state.videos.delete, video_id, request.state.caller)
    return JSONResponse(deleted.model_dump())


@v1.get("/videos/{video_id}/content", operation_id="downloadVideoContent")
async def download_content(request: Request, video_id: str, variant: str = "video", stream: bool = False):
    """The MP4, the PNG thumbnail (its first frame) or the spritesheet (a PNG grid of its frames) of a completed
    video; with stream=true the MP4 of a video that is still being generated, sent while its frames are decoded (a
    fragmented MP4)."""
    service = request.app.state.videos
    if variant not in ("video", "thumbnail", "spritesheet"):
        raise APIError(400, f"variant must be 'video', 'thumbnail' or 'spritesheet'; got {variant!r}",
                       param="variant", code="invalid_value")
    if variant == "spritesheet":
        from longserve.server.api.stored_frames import spritesheet

        path = await run_in_threadpool(service.content_path, video_id, "video", request.state.caller)
        return Response(await run_in_threadpool(spritesheet, path), media_type="image/png",
                        headers={"Content-Disposition": f'attachment; filename="{video_id}.sprites.png"'})
    rec = await run_in_threadpool(service.record, video_id, request.state.caller)
    if stream and variant == "video" and rec.status in ("queued", "in_progress"):
        slot = request.app.state.fairness.open_stream(client_of(request), "a streamed download")   # 429 past it
        try:
            writer = await service.live_writer(video_id, request.is_disconnected)   # wakes when the writer exists
            if writer is None and service.replica is not None:                     # written by another replica
                writer = await service.replica.remote_writer(video_id, request.is_disconnected)
        except BaseException:
            slot.release()
            raise
        if writer is not None:
            body = writer.stream() if hasattr(writer, "stream") else tail_file(writer)   # (object storage's pieces)
            releases = [slot.release, *([writer.release] if hasattr(writer, "release") else [])]
            return SlotStream(body, releases, media_type="video/mp4", headers={"Cache-Control": "no-store"})
        slot.release()
        if await request.is_disconnected():
            return PlainTextResponse("", status_code=204)
        if service.draining:
            raise APIError(503, f"the server is shutting down before video {video_id!r} is written",
                           param="video_id", code="server_shutdown", headers={"Retry-After": "10"})
    path = await run_in_threadpool(service.content_path, video_id, variant, request.state.caller)
    media_type = "video/mp4" if variant == "video" else "image/png"
    return FileResponse(path, media_type=media_type, filename=path.name)


@v1.get("/videos/{video_id}/events")
async def video_events(request: Request, video_id: str):
    """Server-Sent Events: queue position, every denoising step, decoding, then completed or failed."""
    service = request.app.state.videos
    await run_in_threadpool(service.record, video_id, request.state.caller)  # 404 before subscribing
    slot = request.app.state.fairness.open_stream(client_of(request), "an event stream")    # 429 past the cap
    sub = service.broker.subscribe(video_id)
    try:
        first = await run_in_threadpool(service.event_snapshot, video_id, request.state.caller)
    except BaseException:
        service.broker.unsubscribe(sub)
        slot.release()
        raise
    events = [first]
    if first[0] not in TERMINAL_EVENTS and service.replica is not None:   # it may run on another replica
        service.replica.watch(video_id)
    if first[0] not in TERMINAL_EVENTS and service.stream_ends_now(video_id):   # no more events will come
        events.append(("error", shutdown_envelope()))
    return SlotStream(sse_stream(sub, events, lambda: service.broker.unsubscribe(sub)), [slot.release],
                      media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- models, scoring ------------------------------------------------------------------------------------------


@v1.get("/models")
async def list_models(request: Request):
    videos = request.app.state.videos
    replica = videos.replica            # with replicas: the models every live replica serves
    names = [videos.model_name] if replica is None else await run_in_threadpool(replica.live_models)
    cards = [ModelCard(id=name, created=videos.started_at, kind="video") for name in names]
    score = request.app.state.score
    if score is not None:
        cards.append(ModelCard(id=score.model_name, created=videos.started_at, kind="score"))
    return JSONResponse(ModelList(data=cards).model_dump())


@v1.post("/score", openapi_extra=json_body(ScoreRequest))
async def score_text(request: Request):
    score = request.app.state.score
    if score is None:
        raise APIError(404, "scoring is not enabled on this server (start it with --score-model)",
                       code="scoring_disabled")
    req = await json_request(request, ScoreRequest)
    score.check_model(req.model)
    result = await asyncio.wrap_future(score.submit(req.text))    # its own threads and queue, not the API's
    return JSONResponse(result.model_dump())


# -- operations -----------------------------------------------------------------------------------------------


@router.get("/health")
@router.get("/health/ready")
async def health(request: Request):
    """Ready: 200 only while the model is loaded and warm, the workers up and the store fine (a load balancer's and
    Kubernetes' readiness probe); 503 with the reason, and while starting the start's stage, otherwise."""
    status, body = request.app.state.videos.health()
    body["warnings"] = request.app.state.edge_warnings
    return JSONResponse(Health(**body).model_dump(), status_code=status)


@router.get("/health/live")
async def health_live(request: Request):
    """Live: 200 whenever the process answers (from the moment it listens, while it loads or drains): a liveness
    probe that restarts only a server that stopped answering."""
    return JSONResponse(request.app.state.videos.monitor.live())


@router.get("/metrics")
async def prometheus_metrics(request: Request):
    text = await run_in_threadpool(request.app.state.videos.metrics_text)   # reads job counts from the store
    return Response(text, media_type=metrics.CONTENT_TYPE)
