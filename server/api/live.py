"""`WebSocket /v1/videos/live`: a live video session on a causal model, chunk by chunk, with prompt switching.

    client -> server   {"type": "auth", "api_key": "..."}   first, with --api-key, unless the socket was opened with
                       an Authorization header (a browser cannot set one; a key in the URL is refused)
                       {"type": "start", "prompt": "...", "size": "64x64", "seed": 0, "fps": 16}   (then; optional
                       "input_reference": a start image as a data URL, on a model that takes one; "webrtc": the
                       browser's offer, for the frames as a WebRTC track instead: server/api/webrtc.py)
                       {"type": "prompt", "prompt": "..."}        any time: applies at the next chunk
                       {"type": "stop"}                           ends after the chunk being made
                       ("record": true in the start message keeps the session as a video: server/api/live_recording.py)
    server -> client   {"type": "session.created", "id", "fps", "size", "max_seconds", "frames_per_chunk"}
                       {"type": "webrtc.answer", "answer": {"type": "answer", "sdp"}}   with a WebRTC offer
                       per chunk: {"type": "chunk", "index", "frames", "start_frame", "prompt_index", "bytes",
                       "dropped", "t"} then ONE binary message: that chunk's fMP4 fragment (the first one starts
                       with the init segment), so the binary messages concatenated play as one MP4 (over WebRTC:
                       no binary message; {"type": "chunk.sent", "index", "pts"} when its first frame is sent on
                       the track). "t": when the chunk left the engine (epoch seconds), for a client's latency
                       {"type": "prompt.received", "prompt_index", "by_chunk"}   a switch taken: it applies
                       at chunk `by_chunk` at the latest (the chunk the workers last reported making, plus one;
                       null before the session's first chunk began)
                       {"type": "prompt.applied", "prompt_index", "prompt", "chunk"}   before the first chunk
                       made under a new prompt
                       {"type": "prompt.replaced", "prompt_index", "by"}   a switch that had not applied yet was
                       replaced by a newer one: it never applies
                       {"type": "error", "code", "message", "param"}   (the API's error codes)
                       {"type": "done", "reason": "stopped" | "max_live_seconds" | "error", "chunks", "frames"}
                       (recorded: and "video_id", the stored video's id, the session's)

The start message is mapped by the server's request door (`VideoRequests.live`: its size string
and limits) to an engine request (`live=True`, `seconds` = --max-live-seconds, rounded down
to whole latent frames by the engine's completion; a seed left out is a random one, as through
every door), so it batches with every other session and job at the step level. A session is a job
like any video: the admission gate counts it (its longest length in whole chunks x its size x its
steps; past --max-queued-work or --max-work-per-key the start is answered with the error event
`queue_full` or `key_work_limit` and the socket closes with 1013, "try again later"), it sits in the
job registry while it runs, and the job runner follows its engine handle (its final output handled
where every job's is). Its KV cache is counted against --live-kv-budget when it starts: past it the
error event is `live_capacity` (HTTP 503's meaning), close 1013. A disconnect ends the request
(`abort(id, "disconnected")`): its cache is freed at the next step boundary.

Prompt switches are one pending per session: the engine holds a switch until the session's next chunk
starts, and a newer one replaces it (`prompt.replaced`), so a flood of switches costs that session one text
encode and one recache per chunk and the other sessions nothing. The server keeps the texts of the switches
still pending and the one applied last: a session's prompt history is bounded.

A slow client never slows the others: the engine hands this session's chunks to a queue of
`--live-buffer-chunks` fragments; when the client has not taken them, a new fragment is dropped
(the next chunk event counts it in `dropped`) instead of waiting. With --api-key, the socket
needs the key too: an `Authorization: Bearer KEY` header, or the first message `{"type": "auth", "api_key": KEY}`
(browsers cannot set headers on a WebSocket); never the URL, which proxies and servers log. A session is one of
its key's open streams (`--max-streams-per-key`) and takes a token of its rate (`server/api/fairness.py`).

A WebRTC offer is checked for its size, m-sections and candidates before admission (bounded scans), and read only
after the session was admitted, on a worker thread: `server/api/webrtc.py` says what its candidates may be.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from starlette.concurrency import run_in_threadpool
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from longserve.engine.errors import public_message
from longserve.engine.outputs import FramesChunk, LiveChunkInfo
from longserve.engine.request import GenerationSpec, RequestError
from longserve.engine.scheduler import KVBudgetError, QueueFullError
from longserve.server.api import webrtc
from longserve.server.api.edge import client_id, matching_key
from longserve.server.api.errors import APIError, StoreUnavailable
from longserve.server.api.jobs import DISCONNECTED, LIVE, Job
from longserve.server.api.json_input import load_object

log = logging.getLogger("longserve.live")

START_TIMEOUT_S = 30.0
#: a socket must say its key this soon (an unauthenticated socket holds a connection slot meanwhile)
AUTH_TIMEOUT_S = 10.0
CLOSE_TRY_LATER = 1013
CLOSE_POLICY = 1008
CLOSE_SERVICE_RESTART = 1012
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_INVALID_PAYLOAD = 1007


def header_key(ws: WebSocket, keys: tuple[str, ...]) -> str | None:
    """The API key of the socket's Authorization header, if it is one of `keys` (None otherwise)."""
    scheme, _, token = ws.headers.get("authorization", "").partition(" ")
    return matching_key(token.strip(), keys) if scheme.lower() == "bearer" else None


class LiveSessions:
    """The live door: the engine, the request door (`VideoRequests`), the admission gate, the job registry and
    runner, the drain (`Shutdown`), and for a recorded session the storage side and the served model's name."""

    def __init__(self, config, engine, requests, admission, jobs, runner, shutdown, storage, model_name: str):
        self.engine, self.requests, self.admission, self.jobs = engine, requests, admission, jobs
        self.runner, self.shutdown, self.storage, self.model_name = runner, shutdown, storage, model_name
        self.max_seconds = config.max_live_seconds
        self.buffer_chunks = config.live_buffer_chunks
        self.networks = webrtc.parse_networks(config.webrtc_networks)

    @property
    def supported(self) -> bool:
        return self.engine.info.capabilities.live

    async def run(self, ws: WebSocket, api_keys: tuple[str, ...]) -> None:
        await ws.accept()
        if "api_key" in ws.query_params:            # it is in a URL already: logged by whatever relays it
            await self._refuse(ws, "invalid_api_key", "an API key in the URL is refused (URLs are written to logs): "
                                                      "send {\"type\": \"auth\", \"api_key\": ...} as the first "
                                                      "message, or the header 'Authorization: Bearer <key>'",
                               CLOSE_POLICY, "api_key")
            return
        fairness, slot = ws.app.state.fairness, None
        try:
            key, msg = await self._authenticate(ws, api_keys)
            client = client_id(key) if key else "addr:" + (ws.client.host if ws.client else "unknown")
            fairness.take(client)                   # 429 past the key's request rate
            slot = fairness.open_stream(client, "a live session")       # 429 past its open streams
            await self._start(ws, key, msg)
        except (asyncio.TimeoutError, WebSocketDisconnect):
            with contextlib.suppress(Exception):
                await ws.close(CLOSE_POLICY)
        except ProtocolError as e:                      # a binary frame, JSON too deep or not an object
            await self._refuse(ws, e.code, e.message, e.close_code, e.param)
        except APIError as e:                           # the key, the rate, the stream cap
            await self._refuse(ws, e.code or "invalid_request", e.message,
                               CLOSE_TRY_LATER if e.status in (429, 503) else CLOSE_POLICY, e.param)
        finally:
            if slot is not None:
                slot.release()

    async def _authenticate(self, ws: WebSocket, api_keys: tuple[str, ...]) -> tuple[str | None, dict | None]:
        """(the socket's key, None when the server has none; a message read that `_start` is to take, or None). The
        key comes in the Authorization header or, from a browser (which cannot set headers on a WebSocket), as the
        first message {"type": "auth", "api_key": KEY}, within AUTH_TIMEOUT_S."""
        if not api_keys:
            return None, None
        key = header_key(ws, api_keys)
        if key is not None:
            return key, None
        msg = await asyncio.wait_for(read_message(ws), AUTH_TIMEOUT_S)
        given = msg.get("api_key") if msg.get("type") == "auth" else None
        key = matching_key(given, api_keys) if isinstance(given, str) else None
        if key is None:
            raise APIError(401, "missing or wrong API key: send {\"type\": \"auth\", \"api_key\": <key>} as the "
                                "first message, or the header 'Authorization: Bearer <key>'",
                           param="api_key", code="invalid_api_key")
        return key, None

    async def _start(self, ws: WebSocket, key: str | None, msg: dict | None) -> None:
        """The start message (`msg`, or the next one), admission, then a WebRTC offer's answer, then the engine."""
        if not self.supported:
            raise APIError(400, "this model does not stream live video (a causal model does); use POST /v1/videos",
                           code="unsupported_model")
        if self.shutdown.draining:
            await self._refuse(ws, "server_shutdown", "the server is shutting down and starts no new sessions",
                               CLOSE_SERVICE_RESTART)
            return
        peer, job, admitted = None, None, False
        try:
            if msg is None:
                msg = await asyncio.wait_for(read_message(ws), START_TIMEOUT_S)
            if msg.get("type") == "auth":           # not needed here (no keys, or the header's): the next one
                msg = await asyncio.wait_for(read_message(ws), START_TIMEOUT_S)
            offer = webrtc.start_offer(msg.pop("webrtc", None))     # bounded checks only: no SDP read yet
            record = msg.pop("record", False)           # kept as a video (server/api/live_recording.py)
            if not isinstance(record, bool):
                raise APIError(400, f"record must be true or false; got {record!r}", param="record",
                               code="invalid_value")
            accepted = self.requests.live(msg, self.max_seconds)
            spec = accepted.spec
            job = Job(spec.request_id, LIVE, accepted.cost, client_id(key) if key else None)
            self.admission.check_open(writes_files=record)
            await run_in_threadpool(self.admission.admit, job)  # (with replicas: the shared store's transaction)
            admitted = True
            if offer is not None:                                   # admitted: now the SDP work, off the loop
                per_chunk = self.engine.info.capabilities.frames_per_chunk
                peer = await webrtc.answer_offer(offer, spec, per_chunk, ws, self.networks)
            self.runner.launch(job, accepted, follow=False)     # followed by this socket (`_session`)
        except BaseException as e:
            if peer is not None:
                await peer.close()
            if admitted:
                self.jobs.remove(job)
                await run_in_threadpool(self.admission.release, job)
            if isinstance(e, (ValueError, KeyError)) and not isinstance(e, APIError):   # RequestError included
                param = getattr(e, "field", None)
                raise APIError(400, str(e) if param else f"not a valid start message: {e}", param=param,
                               code="invalid_request") from None
            if isinstance(e, StoreUnavailable):
                raise APIError(503, str(e), code="storage_unavailable") from None
            if isinstance(e, (KVBudgetError, QueueFullError)):
                raise APIError(503, str(e), code="live_capacity") from None
            raise
        try:
            await self._session(ws, job, spec, peer, record)
        finally:
            await run_in_threadpool(self.admission.release, job)

    async def _session(self, ws: WebSocket, job: Job, spec: GenerationSpec, peer=None, record: bool = False) -> None:
        handle = job.handle
        recording = None
        if record:
            from longserve.server.api.live_recording import LiveRecording

            recording = await self.runner.run_io(LiveRecording, self.storage, self.model_name, spec, job.owner,
                                                 peer is not None)
        prompts = {0: spec.prompt[0]}           # prompt index -> text: the pending switch and the last applied
        stopped = asyncio.Event()
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.buffer_chunks)
        per_chunk = self.engine.info.capabilities.frames_per_chunk
        # made on the runner's thread: the fMP4 muxer starts an encoder process, which takes the event loop
        # hundreds of milliseconds in a large process
        job.sink = await self.runner.run_io(LiveOutputs, self.runner, spec, queue, prompts, stopped,
                                            peer.track if peer else None, recording)
        if peer is not None:
            def sent(index: int, pts: int) -> None:         # a chunk's first frame left on the track
                if not queue.full():
                    queue.put_nowait(("event", {"type": "chunk.sent", "index": index, "pts": pts}))

            peer.track.on_first = sent
        await self._send(ws, {"type": "session.created", "id": spec.request_id, "fps": spec.fps,
                              "size": f"{spec.width}x{spec.height}", "max_seconds": self.max_seconds,
                              "frames_per_chunk": per_chunk, "transport": "webrtc" if peer else "fmp4",
                              "record": record})
        if peer is not None:                            # a client gone meanwhile is found by the receive loop
            with contextlib.suppress(Exception):
                await self._send(ws, {"type": "webrtc.answer", "answer": peer.local})

        async def receive() -> None:
            while True:
                try:
                    msg = await read_message(ws)
                except ProtocolError as e:              # told, then the socket closes with its code
                    with contextlib.suppress(Exception):
                        await self._send(ws, _error_event(e.code, e.message, e.param))
                        await ws.close(e.close_code)
                    return
                kind = msg.get("type")
                try:
                    if kind == "prompt":
                        self.requests.check_text("prompt", msg.get("prompt"))
                        switched = handle.switch(msg.get("prompt"))
                        if switched is not None:
                            prompts[switched.prompt_index] = msg["prompt"]
                            await queue.put(("event", {"type": "prompt.received", "prompt_index":
                                                       switched.prompt_index, "by_chunk": switched.by_chunk}))
                            if switched.replaced is not None:
                                prompts.pop(switched.replaced, None)
                                await queue.put(("event", {"type": "prompt.replaced", "prompt_index":
                                                           switched.replaced, "by": switched.prompt_index}))
                    elif kind == "stop":
                        stopped.set()
                        handle.stop()
                    else:
                        raise APIError(400, f"unknown message type {kind!r} (prompt, stop)", param="type",
                                       code="invalid_value")
                except APIError as e:
                    await queue.put(("event", _error_event(e.code or "invalid_request", e.message, e.param)))
                except RequestError as e:
                    await queue.put(("event", _error_event("invalid_request", public_message(e), e.field)))

        async def produce() -> None:
            try:
                await self.runner.follow(job)
            finally:
                if job.sink.muxer is not None:
                    await self.runner.run_io(job.sink.muxer.close)
                await queue.put(None)

        async def send() -> None:
            while (item := await queue.get()) is not None:
                await self._send(ws, item[1])
                if item[0] == "chunk" and item[2] is not None:      # None: the frames went to the WebRTC track
                    await ws.send_bytes(item[2])

        tasks = [asyncio.ensure_future(t) for t in (receive(), produce(), send())]
        try:
            # the session ends when everything was sent, or at once when the client goes away
            done, _ = await asyncio.wait([tasks[0], tasks[2]], return_when=asyncio.FIRST_COMPLETED)
        finally:
            handle.abort(DISCONNECTED)                  # a no-op once it ended; frees the cache otherwise
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if peer is not None:
                await peer.close()
            if recording is not None and not recording.closed:     # the client left first: what was made is kept
                await self.runner.run_io(recording.finish)
        if tasks[2] in done and ws.application_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await ws.close(1000)

    @staticmethod
    async def _send(ws: WebSocket, event: dict) -> None:
        await ws.send_text(json.dumps(event))

    async def _refuse(self, ws: WebSocket, code: str, message: str, close_code: int, param: str | None = None):
        with contextlib.suppress(Exception):
            await self._send(ws, _error_event(code, message, param))
        await ws.close(close_code)


class LiveOutputs:
    """What a live session's outputs become (`runner.JobSink`): one fMP4 fragment per chunk for the socket's send
    queue, which drops a chunk rather than wait when the client is behind; and the session's last events."""

    def __init__(self, runner, spec: GenerationSpec, queue: asyncio.Queue, prompts: dict, stopped, track=None,
                 recording=None):
        from longserve.server.live_media import ChunkMuxer

        self.runner, self.queue, self.prompts, self.stopped = runner, queue, prompts, stopped
        # (a WebRTC session's frames go to its track: no fMP4)
        self.muxer = ChunkMuxer(spec.width, spec.height, spec.fps) if track is None else None
        self.track = track                      # a WebRTC session's track (server/api/webrtc.py), else None
        self.recording = recording              # `"record": true`: every chunk kept as a video (live_recording.py)
        self.last_prompt = self.dropped = self.chunks = self.frames = 0

    async def take(self, job: Job, out) -> None:
        if not isinstance(out, FramesChunk):
            return None
        pixels, left_engine = out.frames[0], time.time()
        live = out.live or LiveChunkInfo(self.chunks, 0)
        extra = {"t": round(left_engine, 4)}            # when the chunk left the engine (for clients' latency)
        if self.track is not None:
            data = None
            self.track.push(pixels, live.chunk)
        else:
            data = await self.runner.run_io(self.muxer.push, pixels)
        p = live.prompt_index
        if self.recording is not None:          # before any drop: the recording has every chunk
            await self.runner.run_io(self.recording.add, data, pixels, self.prompts.get(p))
        items = []
        if p != self.last_prompt:
            items.append(("event", {"type": "prompt.applied", "prompt_index": p, "prompt": self.prompts.get(p),
                                    "chunk": live.chunk}))
            for older in [i for i in self.prompts if i < p]:          # bounded: what applied before goes
                del self.prompts[older]
            self.last_prompt = p
        items.append(("chunk", {"type": "chunk", "index": live.chunk, "frames": len(pixels),
                                "start_frame": out.start, "prompt_index": p, "bytes": len(data or b""),
                                "dropped": self.dropped, **extra}, data))
        self.chunks, self.frames = self.chunks + 1, self.frames + len(pixels)
        for item in items:
            if self.queue.full() and item[0] == "chunk":
                self.dropped += 1         # the client is behind: drop, never wait (others keep going)
                continue
            await self.queue.put(item)
        return None

    async def finished(self, job: Job, timings: dict) -> None:
        await self._done("stopped" if self.stopped.is_set() else "max_live_seconds")

    async def failed(self, job: Job, error) -> None:
        await self.queue.put(("event", _error_event(error.code, error.message, error.field)))
        await self._done("error")

    async def cancelled(self, job: Job, reason: str) -> None:
        await self._done("cancelled")

    async def _done(self, reason: str) -> None:
        recorded = {}
        if self.recording is not None:          # its video: listed, downloadable (GET /v1/videos/{id}/content)
            recorded["video_id"] = await self.runner.run_io(self.recording.finish)
        await self.queue.put(("event", {"type": "done", "reason": reason, "chunks": self.chunks,
                                        "frames": self.frames, "dropped": self.dropped, **recorded}))


class ProtocolError(Exception):
    """A message the live protocol does not take: the session is told (an error event) and the socket closes with
    `close_code` (1003: a binary frame; 1007: not a JSON object within the bounds of `json_input.load_object`)."""

    def __init__(self, code: str, message: str, close_code: int, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.close_code, self.param = code, message, close_code, param


async def read_message(ws: WebSocket) -> dict:
    """The client's next message as a JSON object (`json_input.load_object`: its depth and text bounded);
    ProtocolError for anything else, WebSocketDisconnect when the client left."""
    message = await ws.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    text = message.get("text")
    if text is None:
        raise ProtocolError("unsupported_data", "binary messages are not part of the live protocol: send JSON "
                                                "text", CLOSE_UNSUPPORTED_DATA)
    try:
        return load_object(text, "message")
    except APIError as e:
        raise ProtocolError(e.code or "invalid_json", e.message, CLOSE_INVALID_PAYLOAD, e.param) from None


def _error_event(code: str, message: str, param: str | None = None) -> dict:
    return {"type": "error", "code": code, "message": message, "param": param}
