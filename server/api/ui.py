"""The page (`/ui`, with `/` redirecting to it) and what it reads of the model (`GET /v1/models/{model}`).

The page is static HTML, CSS and JavaScript modules shipped in `longserve/server/ui/` (no build step, no CDN: it
works offline). It is same-origin, so it needs no exception from the edge's Host/Origin rules; it sends the API
key the way the API takes it (`Authorization: Bearer`, and the live socket's first message: never in a URL). Its
CSP lets it connect to its own origin only (`connect-src 'self'`, its socket included). Its form is built
from the model's capabilities, which `GET /v1/models/{model}` (OpenAI's retrieve-model, with two more fields)
publishes: what inputs the model takes and its defaults.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse

from longserve.server.api.errors import APIError
from longserve.server.api.protocol import ModelCard
from longserve.server.api.routes import require_api_key, require_started

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".png": "image/png"}
#: what the page may load and talk to: itself only ('self' covers its own ws:// and wss:// socket), media from blobs
#: it builds
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
       "media-src 'self' blob:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
       "frame-ancestors 'none'; form-action 'none'")

router = APIRouter(include_in_schema=False)                                   # the page: no key needed to load it
v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key), Depends(require_started)])


def page_files() -> dict[str, Path]:
    """The page's files by name: a fixed set read from the package, so a path never reaches the file system."""
    return {p.name: p for p in sorted(UI_DIR.iterdir()) if p.suffix in MEDIA_TYPES and p.is_file()}


FILES = page_files()


@router.get("/")
async def root():
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui")
async def ui_without_slash():
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui/{name}")
async def ui_file(name: str):
    path = FILES.get(name or "index.html")
    if path is None:
        raise APIError(404, f"the page has no file {name!r}", param="name", code="not_found")
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix],
                        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache",
                                 "X-Content-Type-Options": "nosniff"})


@router.get("/ui/")
async def ui_index():
    return await ui_file("index.html")


@v1.get("/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str):
    """OpenAI's retrieve-model, plus `capabilities` (engine/config.py's `Capabilities`: what inputs the model takes,
    live sessions) and `defaults` (its frames, size, steps, guidance and fps): what the page builds its form from."""
    videos = request.app.state.videos
    if model_id != videos.model_name:
        raise APIError(404, f"no model {model_id!r} is served here (this server serves {videos.model_name!r})",
                       param="model", code="model_not_found")
    info = videos.engine.info
    d = info.defaults
    defaults = {"num_frames": d.num_frames, "size": f"{d.width}x{d.height}", "num_inference_steps":
                d.num_inference_steps, "guidance_scale": d.guidance_scale, "fps": d.fps,
                "seconds": round(d.num_frames / d.fps, 3) if d.fps else None}
    card = ModelCard(id=videos.model_name, created=videos.started_at, kind="video").model_dump()
    return JSONResponse(card | {"family": info.family, "capabilities": dataclasses.asdict(info.capabilities),
                                "defaults": defaults, "size_multiple": info.size_multiple,
                                "max_live_seconds": videos.config.max_live_seconds})
