"""The OpenAI routes the current openai client (3.57) has beyond create, retrieve, list, delete and content:

    POST /v1/videos/extensions           `client.videos.extend(video={"id": ...} or a file, prompt=, seconds=)`
    POST /v1/videos/{id}/remix           `client.videos.remix(id, prompt=)`: a new video from a completed one
    /v1/webhook_endpoints[/{id}[/...]]   `client.webhooks.create / retrieve / update / list / delete /
                                         rotate_secret / test`: a key's endpoints for video.completed and video.failed

An extension of a stored video is `POST /v1/videos/{id}/extend`'s (longserve's own route, kept); of an uploaded MP4,
a create with the MP4 as `input_reference`. A remix is an extension on a model that extends, an image-to-video from
the source's last frame on one that takes an image, and refused naming `model` elsewhere (`VideoRequests.remix`).
A webhook endpoint belongs to the key that made it: other keys neither see nor change it (404, as a video).
"""

from __future__ import annotations

import secrets
import time

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from longserve.server.api.errors import APIError
from longserve.server.api.protocol import VideoCreateRequest, VideoExtendRequest
from longserve.server.api.routes import (
    body_as,
    json_body,
    parse_create_body,
    parse_json_object,
    read_body,
    require_api_key,
    require_started,
    validated,
)
from longserve.server.api.uploads import Upload
from longserve.server.api.webhooks import EVENTS, KIND, new_secret, secret_hint

v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key), Depends(require_started)])


# -- videos -------------------------------------------------------------------------------------------------------


class VideoExtensionRequest(VideoExtendRequest):
    """`POST /v1/videos/extensions`: `video` is {"id": a completed video} (multipart: `video[id]`) or an MP4 file."""

    video: object = None


@v1.post("/videos/extensions", openapi_extra=json_body(VideoExtensionRequest))
async def extend_video(request: Request):
    data = await parse_create_body(request, file_fields=("video",))
    video = data.pop("video", None)
    service, caller = request.app.state.videos, request.state.caller
    if isinstance(video, Upload):                    # an MP4 to continue: a create with it as input_reference
        req = validated(VideoCreateRequest, {**data, "input_reference": video})
        service.requests.check_extends()
        result = await run_in_threadpool(service.create, req, caller)
    elif isinstance(video, dict) and set(video) == {"id"} and isinstance(video["id"], str):
        req = validated(VideoExtendRequest, data)
        result = await run_in_threadpool(service.extend, video["id"], req, caller)
    else:
        raise APIError(400, "video must be {\"id\": \"video_...\"} (a completed video of this server; multipart: the "
                            "field video[id]) or an MP4 file", param="video",
                       code="missing_parameter" if video is None else "invalid_value")
    return JSONResponse(result.model_dump())


@v1.post("/videos/{video_id}/remix", openapi_extra=json_body(VideoExtendRequest))
async def remix_video(request: Request, video_id: str):
    req = await body_as(request, VideoExtendRequest)
    result = await run_in_threadpool(request.app.state.videos.remix, video_id, req, request.state.caller)
    return JSONResponse(result.model_dump())


# -- webhook endpoints -------------------------------------------------------------------------------------------


class WebhookEndpointRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, max_length=200)
    url: str | None = None
    event_types: list[str] | None = None


class WebhookTestRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    event_type: str


def _endpoint(endpoint_id: str, data: dict, created_at: int, with_secret: bool = False) -> dict:
    out = {"id": endpoint_id, "object": "webhook_endpoint", "created_at": created_at, "name": data["name"],
           "url": data["url"], "event_types": data["event_types"], "updated_at": data.get("updated_at", created_at),
           "signing_secret_hint": secret_hint(data["secret"])}
    if with_secret:
        out["signing_secret"] = data["secret"]
    return out


def _event_types(value) -> list[str]:
    if not isinstance(value, list) or not value or any(t not in EVENTS for t in value):
        raise APIError(400, f"event_types must be a non-empty list of {', '.join(EVENTS)} (the video events this "
                            f"server sends); got {value!r}", param="event_types", code="invalid_value")
    return list(dict.fromkeys(value))


def _mine(request: Request, endpoint_id: str) -> dict:
    found = request.app.state.videos.settings.get(KIND, endpoint_id)
    if found is None or found[0] != request.state.caller.owner:
        raise APIError(404, f"no webhook endpoint {endpoint_id!r}", param="webhook_endpoint_id",
                       code="webhook_endpoint_not_found")
    return {**found[1], "_created_at": found[2]}


@v1.post("/webhook_endpoints", openapi_extra=json_body(WebhookEndpointRequest))
async def create_endpoint(request: Request):
    req = await body_as(request, WebhookEndpointRequest)
    service = request.app.state.videos
    for name in ("name", "url", "event_types"):
        if getattr(req, name) is None:
            raise APIError(400, f"{name} is required", param=name, code="missing_parameter")
    url = await run_in_threadpool(service.webhooks.check_url, req.url)
    now = int(time.time())
    data = {"name": req.name, "url": url, "event_types": _event_types(req.event_types), "secret": new_secret(),
            "updated_at": now}
    endpoint_id = f"whep_{secrets.token_hex(12)}"
    await run_in_threadpool(service.settings.put, KIND, endpoint_id, data, request.state.caller.owner)
    return JSONResponse(_endpoint(endpoint_id, data, now, with_secret=True))


@v1.get("/webhook_endpoints")
async def list_endpoints(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)):
    rows = await run_in_threadpool(request.app.state.videos.settings.list, KIND, request.state.caller.owner)
    ids = [r[0] for r in rows]
    start = ids.index(after) + 1 if after in ids else 0
    page = rows[start:start + limit]
    data = [_endpoint(i, d, c) for i, _, d, c in page]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(rows)})


@v1.get("/webhook_endpoints/{endpoint_id}")
async def retrieve_endpoint(request: Request, endpoint_id: str):
    data = await run_in_threadpool(_mine, request, endpoint_id)
    return JSONResponse(_endpoint(endpoint_id, data, data["_created_at"]))


@v1.post("/webhook_endpoints/{endpoint_id}", openapi_extra=json_body(WebhookEndpointRequest))
async def update_endpoint(request: Request, endpoint_id: str):
    req = await body_as(request, WebhookEndpointRequest)
    service = request.app.state.videos
    data = await run_in_threadpool(_mine, request, endpoint_id)
    created_at = data.pop("_created_at")
    changed = {k: v for k, v in (("name", req.name), ("url", req.url), ("event_types", req.event_types))
               if v is not None and v != data[k]}
    if "url" in changed:
        changed["url"] = await run_in_threadpool(service.webhooks.check_url, req.url)
    if "event_types" in changed:
        changed["event_types"] = _event_types(req.event_types)
    if changed:
        data = {**data, **changed, "updated_at": int(time.time())}
        await run_in_threadpool(service.settings.put, KIND, endpoint_id, data, request.state.caller.owner)
    return JSONResponse(_endpoint(endpoint_id, data, created_at))


@v1.delete("/webhook_endpoints/{endpoint_id}")
async def delete_endpoint(request: Request, endpoint_id: str):
    await run_in_threadpool(_mine, request, endpoint_id)
    await run_in_threadpool(request.app.state.videos.settings.delete, KIND, endpoint_id)
    return JSONResponse({"id": endpoint_id, "object": "webhook_endpoint.deleted", "deleted": True})


@v1.post("/webhook_endpoints/{endpoint_id}/rotate_secret")
async def rotate_secret(request: Request, endpoint_id: str):
    """A new signing secret (returned once); the old one stops signing at once (a grace period for it is not
    kept: `keep_old_secret_active_for_24_hours` is refused rather than ignored)."""
    body = await read_body(request)
    options = parse_json_object(body) if body.strip() else {}
    if options.get("keep_old_secret_active_for_24_hours"):
        raise APIError(400, "keep_old_secret_active_for_24_hours is not supported here: the old secret stops at "
                            "once", param="keep_old_secret_active_for_24_hours", code="unsupported_parameter")
    data = await run_in_threadpool(_mine, request, endpoint_id)
    created_at = data.pop("_created_at")
    data = {**data, "secret": new_secret(), "updated_at": int(time.time())}
    await run_in_threadpool(request.app.state.videos.settings.put, KIND, endpoint_id, data,
                            request.state.caller.owner)
    return JSONResponse(_endpoint(endpoint_id, data, created_at, with_secret=True))


@v1.post("/webhook_endpoints/{endpoint_id}/test", openapi_extra=json_body(WebhookTestRequest))
async def test_endpoint(request: Request, endpoint_id: str):
    """One sample delivery of `event_type` (data.id: a made-up video id), tried once; the endpoint's status code."""
    req = await body_as(request, WebhookTestRequest)
    if req.event_type not in EVENTS:
        raise APIError(400, f"event_type must be one of {', '.join(EVENTS)}; got {req.event_type!r}",
                       param="event_type", code="invalid_value")
    data = await run_in_threadpool(_mine, request, endpoint_id)
    webhooks = request.app.state.videos.webhooks
    status = await webhooks.test_delivery(data["url"], data["secret"], req.event_type)
    return JSONResponse({"object": "webhook_endpoint.test", "webhook_endpoint_id": endpoint_id,
                         "event_type": req.event_type, "status_code": status or 0, "success": True})

