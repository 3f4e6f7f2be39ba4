"""`WebSocket /v1/videos/live`: a live video session on a causal model, chunk by chunk, with prompt switching.

    client -> server   {"type": "start", "prompt": "...", "size": "64x64", "seed": 0, "fps": 16}   (first)
                       {"type": "prompt", "prompt": "..."}        any time: applies at the next chunk
                       {"type": "stop"}                           ends after the chunk being made
    server -> client   {"type": "session.created", "id", "fps", "size", "max_seconds", "frames_per_chunk"}
                       per chunk: {"type": "chunk", "index", "frames", "start_frame", "prompt_index", "bytes",
                       "dropped"} then ONE binary message: that chunk's fMP4 fragment (the first one starts
                       with the init segment), so the binary messages concatenated play as one MP4
                       {"type": "prompt.applied", "prompt_index", "prompt", "chunk"}   before the first chunk
                       made under a new prompt
                       {"type": "error", "code", "message", "param"}   (the API's error codes)
                       {"type": "done", "reason": "stopped" | "max_live_seconds" | "error", "chunks", "frames"}

The session is an engine request (`options["live"]`, `num_frames` = --max-live-seconds at its
fps), so it batches with every other session and job at the step level, and its KV cache is
counted against --live-kv-budget when it starts: past it the start is answered with an error
event (`live_capacity`, HTTP 503's meaning) and the socket closes with 1013 ("try again later").
A disconnect cancels the request: its cache is freed at the next step boundary.

A slow client never slows the others: the engine hands this session's chunks to a queue of
`--live-buffer-chunks` fragments; when the client has not taken them, a new fragment is dropped
(the next chunk event counts it in `dropped`) instead of waiting. With --api-key, the socket
needs the key too: an `Authorization: Bearer KEY` header, or `?api_key=KEY` (browsers cannot
set headers on a WebSocket).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from engine.outputs import Cancelled, Failed, Finished, FramesChunk
from engine.request import GenerationSpec, RequestError
from engine.scheduler import KVBudgetError, QueueFullError
from server.api.edge import matching_key
from server.api.errors import APIError

log = logging.getLogger("longserve.live")

START_TIMEOUT_S = 30.0
CLOSE_TRY_LATER = 1013
CLOSE_POLICY = 1008
CLOSE_SERVICE_RESTART = 1012


def authorized(ws: WebSocket, keys: tuple[str, ...]) -> bool:
    if not keys:
        return True
    scheme, _, token = ws.headers.get("authorization", "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else ws.query_params.get("api_key", "")
    return matching_key(given, keys) is not None


class LiveSessions:
    """The live sessions of one server (a `VideoService`'s engine)."""

    def __init__(self, videos, max_seconds: float, buffer_chunks: int):
        self.videos = videos
        self.max_seconds = max_seconds
        self.buffer_chunks = buffer_chunks
        self.active: dict[str, object] = {}        # session id -> engine handle

    @property
    def supported(self) -> bool:
        return self.videos.engine.info.capabilities.live

    def resolve(self, msg: dict) -> tuple[GenerationSpec, int]:
        """A start message -> (spec, fps), with the server's limits (APIError naming the field)."""
        videos, lim = self.videos, self.videos.limits
        if msg.get("type") != "start":
            raise APIError(400, "the first message must be {\"type\": \"start\", \"prompt\": ...}", param="type",
                           code="invalid_value")
        unknown = sorted(set(msg) - {"type", "prompt", "size", "seed", "fps"})
        if unknown:
            raise APIError(400, f"unknown field {unknown[0]!r} in the start message", param=unknown[0],
                           code="unknown_parameter")
        prompt = msg.get("prompt")
        self.check_prompt(prompt)
        fps = msg.get("fps", lim.fps)
        if isinstance(fps, bool) or not isinstance(fps, int) or not 1 <= fps <= videos.config.max_fps:
            raise APIError(400, f"fps must be an integer in [1, {videos.config.max_fps}]; got {fps!r}", param="fps",
                           code="invalid_value")
        size = msg.get("size")
        if size is not None and not isinstance(size, str):
            raise APIError(400, f"size must be a string like \"64x64\"; got {size!r}", param="size",
                           code="invalid_value")
        width, height = videos._size(size)
        seed = msg.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise APIError(400, f"seed must be a non-negative integer; got {seed!r}", param="seed",
                           code="invalid_value")
        rule = lim.frame_multiple
        frames = max(1, round(self.max_seconds * fps))
        frames = (frames - 1) // rule * rule + 1 if rule > 1 else frames
        d = videos.engine.info.defaults
        spec = GenerationSpec(request_id=f"live_{uuid.uuid4().hex}", prompt=[prompt], negative_prompt="",
                              num_frames=frames, height=height, width=width, num_inference_steps=d.num_inference_steps,
                              guidance_scale=d.guidance_scale, seed=seed, output="uint8", options={"live": True})
        return spec, fps

    def check_prompt(self, prompt) -> None:
        if not isinstance(prompt, str) or not prompt.strip():
            raise APIError(400, "prompt must be a non-empty string", param="prompt", code="invalid_value")
        limit = self.videos.config.max_prompt_chars
        if len(prompt) > limit:
            raise APIError(400, f"prompt is {len(prompt)} characters long; the limit is {limit}", param="prompt",
                           code="invalid_value")

    # -- one session --------------------------------------------------------------------------------

    async def run(self, ws: WebSocket, api_keys: tuple[str, ...]) -> None:
        await ws.accept()
        if not authorized(ws, api_keys):
            await self._error(ws, "invalid_api_key", "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                                      "or ?api_key=<key>")
            await ws.close(CLOSE_POLICY)
            return
        if not self.supported:
            await self._error(ws, "unsupported_model", "this model does not stream live video (a causal model "
                                                        "does); use POST /v1/videos")
            await ws.close(CLOSE_POLICY)
            return
        if self.videos.draining:
            await self._error(ws, "server_shutdown", "the server is shutting down and starts no new sessions")
            await ws.close(CLOSE_SERVICE_RESTART)
            return
        try:
            msg = json.loads(await asyncio.wait_for(ws.receive_text(), START_TIMEOUT_S))
            if not isinstance(msg, dict):
                raise APIError(400, "messages must be JSON objects", param="type", code="invalid_value")
            spec, fps = self.resolve(msg)
            handle = self.videos.engine.submit(spec)
        except (asyncio.TimeoutError, WebSocketDisconnect):
            with contextlib.suppress(Exception):
                await ws.close(CLOSE_POLICY)
            return
        except (ValueError, KeyError) as e:            # bad JSON, RequestError (a ValueError) included
            param = getattr(e, "field", None)
            await self._error(ws, "invalid_request", str(e) if param else f"not a valid start message: {e}", param)
            await ws.close(CLOSE_POLICY)
            return
        except APIError as e:
            await self._error(ws, e.code or "invalid_request", e.message, e.param)
            await ws.close(CLOSE_POLICY)
            return
        except (KVBudgetError, QueueFullError) as e:
            await self._error(ws, "live_capacity", str(e))
            await ws.close(CLOSE_TRY_LATER)
            return
        self.active[spec.request_id] = handle
        try:
            await self._session(ws, handle, spec, fps)
        finally:
            self.active.pop(spec.request_id, None)
            handle.cancel()                             # a no-op once it finished; frees the cache otherwise

    async def _session(self, ws: WebSocket, handle, spec: GenerationSpec, fps: int) -> None:
        from server.live_media import ChunkMuxer

        prompts = [spec.prompt[0]]
        stopped = asyncio.Event()
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.buffer_chunks)
        await self._send(ws, {"type": "session.created", "id": spec.request_id, "fps": fps,
                              "size": f"{spec.width}x{spec.height}", "max_seconds": self.max_seconds,
                              "frames_per_chunk": self.videos.engine.info.capabilities.frames_per_chunk})

        async def receive() -> None:
            while True:
                try:
                    msg = json.loads(await ws.receive_text())
                except (ValueError, TypeError):
                    await queue.put(("event", _error_event("invalid_request", "messages must be JSON objects")))
                    continue
                kind = msg.get("type") if isinstance(msg, dict) else None
                try:
                    if kind == "prompt":
                        self.check_prompt(msg.get("prompt"))
                        if handle.switch(msg["prompt"]):
                            prompts.append(msg["prompt"])
                    elif kind == "stop":
                        stopped.set()
                        handle.stop()
                    else:
                        raise APIError(400, f"unknown message type {kind!r} (prompt, stop)", param="type",
                                       code="invalid_value")
                except APIError as e:
                    await queue.put(("event", _error_event(e.code or "invalid_request", e.message, e.param)))
                except RequestError as e:
                    await queue.put(("event", _error_event("invalid_request", str(e), e.field)))

        async def produce() -> None:
            loop = asyncio.get_running_loop()
            muxer = ChunkMuxer(spec.width, spec.height, fps)
            last_prompt, dropped, chunks, frames = 0, 0, 0, 0
            try:
                async for out in handle:
                    if isinstance(out, FramesChunk):
                        pixels = out.frames[0]
                        data = await loop.run_in_executor(self.videos._io, muxer.push, pixels)
                        p = out.info.get("prompt_index", 0)
                        items = []
                        if p != last_prompt:
                            items.append(("event", {"type": "prompt.applied", "prompt_index": p,
                                                    "prompt": prompts[p] if p < len(prompts) else None,
                                                    "chunk": out.info.get("chunk")}))
                            last_prompt = p
                        items.append(("chunk", {"type": "chunk", "index": out.info.get("chunk", chunks),
                                                "frames": len(pixels), "start_frame": out.start, "prompt_index": p,
                                                "bytes": len(data), "dropped": dropped}, data))
                        chunks, frames = chunks + 1, frames + len(pixels)
                        for item in items:
                            if queue.full() and item[0] == "chunk":
                                dropped += 1     # the client is behind: drop, never wait (others keep going)
                                continue
                            await queue.put(item)
                    elif isinstance(out, Finished):
                        reason = "stopped" if stopped.is_set() else "max_live_seconds"
                        await queue.put(("event", {"type": "done", "reason": reason, "chunks": chunks,
                                                   "frames": frames, "dropped": dropped}))
                    elif isinstance(out, Failed):
                        await queue.put(("event", _error_event(out.error.code, out.error.message, out.error.field)))
                        await queue.put(("event", {"type": "done", "reason": "error", "chunks": chunks,
                                                   "frames": frames, "dropped": dropped}))
                    elif isinstance(out, Cancelled):
                        await queue.put(("event", {"type": "done", "reason": "cancelled", "chunks": chunks,
                                                   "frames": frames, "dropped": dropped}))
            finally:
                await loop.run_in_executor(self.videos._io, muxer.close)
                await queue.put(None)

        async def send() -> None:
            while (item := await queue.get()) is not None:
                if item[0] == "chunk":
                    await self._send(ws, item[1])
                    await ws.send_bytes(item[2])
                else:
                    await self._send(ws, item[1])

        tasks = [asyncio.ensure_future(t) for t in (receive(), produce(), send())]
        try:
            # the session ends when everything was sent, or at once when the client goes away
            done, _ = await asyncio.wait([tasks[0], tasks[2]], return_when=asyncio.FIRST_COMPLETED)
        finally:
            handle.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if tasks[2] in done and ws.application_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await ws.close(1000)

    @staticmethod
    async def _send(ws: WebSocket, event: dict) -> None:
        await ws.send_text(json.dumps(event))

    async def _error(self, ws: WebSocket, code: str, message: str, param: str | None = None) -> None:
        with contextlib.suppress(Exception):
            await self._send(ws, _error_event(code, message, param))


def _error_event(code: str, message: str, param: str | None = None) -> dict:
    return {"type": "error", "code": code, "message": message, "param": param}
