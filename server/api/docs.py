"""The API's own description: `GET /openapi.json` (what clients and the suite's fuzzer read) and, with `--docs`, a
reference page at `/docs`.

Both follow the API's key rules (with keys, `Authorization: Bearer` is needed). The page is plain HTML made here
from the schema, with no script at all and a CSP that lets it load nothing: FastAPI's Swagger UI loads its
script from a CDN, on the page's origin, where the page keeps its key (sessionStorage), so it is not served.
"""

from __future__ import annotations

import html
import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse

from longserve.server.api.routes import require_api_key

#: the reference page loads nothing and runs nothing
DOCS_CSP = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'"


def docs_router(serve_page: bool) -> APIRouter:
    router = APIRouter(include_in_schema=False, dependencies=[Depends(require_api_key)])

    @router.get("/openapi.json")
    async def openapi(request: Request):
        return JSONResponse(request.app.openapi())

    if serve_page:
        @router.get("/docs")
        async def reference(request: Request):
            return HTMLResponse(render(request.app.openapi()), headers={
                "Content-Security-Policy": DOCS_CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})

    return router


def render(schema: dict) -> str:
    """The schema's operations as HTML: each path and method, its summary, parameters and request body's schema."""
    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{html.escape(schema['info']['title'])} "
             f"API</title><style>body{{font:14px system-ui;max-width:60em;margin:2em auto}} pre{{background:#f4f4f4;"
             f"padding:.5em;overflow:auto}} code{{font-weight:bold}}</style></head><body>",
             f"<h1>{html.escape(schema['info']['title'])} {html.escape(schema['info'].get('version', ''))}</h1>",
             f"<p>{html.escape(schema['info'].get('description', ''))}. The machine-readable schema: "
             f"<a href=/openapi.json>/openapi.json</a>.</p>"]
    for path, methods in schema.get("paths", {}).items():
        for method, op in methods.items():
            parts.append(f"<h2><code>{html.escape(method.upper())} {html.escape(path)}</code></h2>")
            if op.get("summary") or op.get("description"):
                parts.append(f"<p>{html.escape(op.get('description') or op.get('summary'))}</p>")
            params = [f"<li><code>{html.escape(p['name'])}</code> ({html.escape(p.get('in', ''))}"
                      f"{', required' if p.get('required') else ''})</li>" for p in op.get("parameters", [])]
            if params:
                parts.append("<ul>" + "".join(params) + "</ul>")
            body = op.get("requestBody", {}).get("content", {})
            for media, content in body.items():
                parts.append(f"<p>Body ({html.escape(media)}):</p><pre>"
                             f"{html.escape(json.dumps(content.get('schema', {}), indent=2))}</pre>")
    parts.append("</body></html>")
    return "".join(parts)
