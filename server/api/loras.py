"""LoRA adapters loaded while serving: `POST /v1/loras`, `DELETE /v1/loras/{name}`, `GET /v1/loras` (admin key).

    POST /v1/loras {"name": "style", "path": "style.safetensors", "scale": 0.8}
        -> {"object": "lora", "name", "path", "scale", "source": "api", "replicas": {"a": "loaded", "b": "loading"}}

`path` is a `.safetensors` file (or a directory holding one) under the operator's `--lora-dir` (a relative path is
taken from there; nothing outside it, symbolic links included, is read). The adapter is written to the shared
settings (`server/api/settings_store.py`) and every replica that serves the model loads it into each of its
workers (`LoraSync`: each replica polls the settings' version every `SYNC_S`), between two step boundaries
(`engine/lora_runtime.py`): the requests running meanwhile pause for one worker job. Its state on each replica is
in the settings too (`loading`, `loaded`, `failed: why`, `unloading`). The POST answers once this replica has it
(a file this replica cannot load is a 400 naming `path`, and is not kept); requests then name it as they name
adapters given at start (`"lora": [{"name": "style"}]`). A replica that claims a job naming an adapter it is still
loading gives the job back to the queue.

DELETE unloads it everywhere (each replica as soon as no queued or running request of its own names it). Adapters
given at start (`--lora`) are listed (`source: "start"`) and stay: their removal is a restart without the flag.
The settings outlive the process: a restarted replica loads the adapters loaded over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from longserve.engine.lora import LoraAdapter, _adapter
from longserve.engine.lora_runtime import LoraInUse
from longserve.server.api.errors import APIError

log = logging.getLogger("longserve.server")

KIND, STATE = "lora", "lora_state"
#: how often a replica looks whether the adapters changed (one number read from the store)
SYNC_S = 0.5
#: the longest a POST waits for this replica's load
LOAD_WAIT_S = 300.0


class LoraAdmin:
    """The routes' side: checks, the shared settings, this replica's `LoraSync`. The parts: the `ServeConfig`, the
    engine, the settings store, the job runner (its loop and io threads) and this replica's id (None: one server)."""

    def __init__(self, config, engine, settings, runner, replica_id: str | None):
        self.config, self.engine, self.settings, self.runner = config, engine, settings, runner
        self.sync = LoraSync(engine, settings, runner, replica_id)

    def check_admin(self, caller) -> None:
        if not caller.admin:
            raise APIError(403, "loading and unloading LoRA adapters needs an admin key (--admin-api-key, or admin:KEY "
                                "in --api-key-file)", code="admin_key_required")

    def resolve(self, path) -> str:
        """`path` under --lora-dir -> the adapter file's real path (400 naming `path` otherwise)."""
        root = self.config.lora_dir
        if root is None:
            raise APIError(400, "loading LoRA adapters while serving is off: the operator starts the server with "
                                "--lora-dir DIR (the directory adapters may be loaded from)", param="path",
                           code="unsupported_operation")
        if not isinstance(path, str) or not path.strip() or "\0" in path:
            raise APIError(400, "path must be a file name under the server's --lora-dir", param="path",
                           code="invalid_value")
        from longserve.weights import resolve_lora

        base = Path(root).resolve()
        candidate = Path(os.path.realpath(base / path))
        if candidate != base and base not in candidate.parents:
            raise APIError(400, f"path {path!r} is outside the server's --lora-dir", param="path", code="invalid_value")
        try:
            resolved = Path(resolve_lora(candidate))
        except (OSError, ValueError) as e:
            raise APIError(400, f"path {path!r}: {e}".replace(str(base), "<lora-dir>"), param="path",
                           code="invalid_value") from None
        if base not in resolved.resolve().parents:
            raise APIError(400, f"path {path!r} is outside the server's --lora-dir", param="path", code="invalid_value")
        return str(resolved)

    async def add(self, body: dict, caller) -> dict:
        self.check_admin(caller)
        unknown = sorted(set(body) - {"name", "path", "scale"})
        if unknown:
            raise APIError(400, f"unknown field {unknown[0]!r}", param=unknown[0], code="unknown_parameter")
        name, scale = body.get("name"), body.get("scale", 1.0)
        try:
            _adapter(name, "x", scale)                     # the name's and the scale's rules (engine/lora.py)
        except ValueError as e:
            param = "scale" if "scale" in str(e) else "name"
            raise APIError(400, str(e).replace("--lora ", ""), param=param, code="invalid_value") from None
        path = self.resolve(body.get("path"))
        settings = self.settings
        if any(a.name == name for a in self.engine.config.loras) or \
                await self._io(settings.get, KIND, name) is not None:
            raise APIError(409, f"a LoRA adapter named {name!r} is loaded already (DELETE /v1/loras/{name} first)",
                           param="name", code="lora_exists")
        await self._io(settings.put, KIND, name, {"path": path, "scale": float(scale), "added_at": int(time.time())})
        state = await self.sync.settle(name, ("loaded", "failed"))
        if state.startswith("failed"):
            await self._io(settings.delete, KIND, name)
            await self.sync.reconcile()
            raise APIError(400, f"path: the adapter could not be loaded: {state[len('failed: '):]}", param="path",
                           code="invalid_value")
        return await self.describe(name)

    async def remove(self, name: str, caller) -> dict:
        self.check_admin(caller)
        settings = self.settings
        if await self._io(settings.get, KIND, name) is None:
            if any(a.name == name for a in self.engine.config.loras):
                raise APIError(409, f"LoRA adapter {name!r} was loaded at start (--lora): it stays until a restart "
                                    f"without it", param="name", code="lora_from_start")
            raise APIError(404, f"no LoRA adapter named {name!r}", param="name", code="lora_not_found")
        await self._io(settings.delete, KIND, name)
        state = await self.sync.settle(name, ("gone", "unloading"), timeout_s=30.0)
        return {"object": "lora.deleted", "name": name, "deleted": True, "unloaded_here": state == "gone"}

    async def describe(self, name: str) -> dict:
        return next(a for a in (await self.listing())["data"] if a["name"] == name)

    async def listing(self) -> dict:
        settings = self.settings
        rows = await self._io(settings.list, KIND)
        states = {}
        for _, _, data, _ in await self._io(settings.list, STATE):
            states.setdefault(data["name"], {})[data["replica"]] = data["state"]
        data = [{"object": "lora", "name": a.name, "path": Path(a.path).name, "scale": a.scale, "source": "start",
                 "replicas": {self.sync.replica: "loaded"}} for a in self.config.engine.loras]
        data += [{"object": "lora", "name": name, "path": Path(d["path"]).name, "scale": d["scale"], "source": "api",
                  "replicas": states.pop(name, {})} for name, _, d, _ in rows]
        # deleted, and still unloading on some replica (a request of its own names it): listed until it is gone
        data += [{"object": "lora", "name": name, "source": "api", "deleted": True, "replicas": where}
                 for name, where in sorted(states.items())]
        return {"object": "list", "data": data}

    async def _io(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


class LoraSync:
    """This replica's adapters made equal to the shared settings' (on the runner's loop)."""

    def __init__(self, engine, settings, runner, replica_id: str | None):
        self.engine, self.settings, self.runner = engine, settings, runner
        self.replica = replica_id or "local"
        self.loaded: set[str] = set()             # the adapters this replica loaded from the settings
        self.state: dict[str, str] = {}
        self._version = None
        self._lock: asyncio.Lock | None = None
        self._changed: asyncio.Event | None = None

    def wanted(self, name: str) -> bool:
        """Is `name` an adapter the settings hold (a job naming it waits for it rather than failing)?"""
        return self.settings.get(KIND, name) is not None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                version = await loop.run_in_executor(self.runner.io, self.settings.version)
                if version != self._version or any(s == "unloading" for s in self.state.values()):
                    self._version = version
                    await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the store may be away for a moment: the next round tries again
                log.exception("lora sync failed")
            await asyncio.sleep(SYNC_S)

    async def reconcile(self) -> None:
        """Load what the settings hold and this replica lacks; unload what they no longer hold (once no request of
        this replica names it)."""
        if self._lock is None:
            self._lock, self._changed = asyncio.Lock(), asyncio.Event()
        async with self._lock:
            loop, io = asyncio.get_running_loop(), self.runner.io
            rows = await loop.run_in_executor(io, self.settings.list, KIND)
            wanted = {name: data for name, _, data, _ in rows}
            engine = self.engine
            for name, data in wanted.items():
                if name in self.loaded or self.state.get(name, "").startswith("failed"):
                    continue
                await self._set(name, "loading")
                try:
                    await asyncio.wrap_future(engine.load_lora(LoraAdapter(name, data["path"], data["scale"])))
                    self.loaded.add(name)
                    await self._set(name, "loaded")
                except Exception as e:  # noqa: BLE001 - a file this replica cannot load: said in its state
                    await self._set(name, f"failed: {e}")
            for name in sorted(self.loaded - set(wanted)):
                try:
                    await asyncio.wrap_future(engine.unload_lora(name))
                except LoraInUse:
                    await self._set(name, "unloading")
                    continue
                self.loaded.discard(name)
                await self._set(name, None)
            for name in [n for n in self.state if n not in wanted and n not in self.loaded]:
                await self._set(name, None)          # a failed load whose adapter was removed
            self._changed.set()
            self._changed = asyncio.Event()

    async def _set(self, name: str, state: str | None) -> None:
        loop, settings = asyncio.get_running_loop(), self.settings
        key = f"{name}@{self.replica}"
        if state is None:
            self.state.pop(name, None)
            await loop.run_in_executor(self.runner.io, settings.delete, STATE, key)
        else:
            self.state[name] = state
            await loop.run_in_executor(self.runner.io, settings.put, STATE, key,
                                       {"name": name, "replica": self.replica, "state": state})

    async def settle(self, name: str, states: tuple[str, ...], timeout_s: float = LOAD_WAIT_S) -> str:
        """(From any loop) reconcile now, then wait until this replica's state of `name` starts with one of
        `states` ("gone": none); the state reached (or the last one at the timeout)."""
        runner = self.runner
        deadline = time.monotonic() + timeout_s
        while True:
            await asyncio.wrap_future(runner.spawn(self.reconcile()))
            state = self.state.get(name, "gone")
            if any(state.startswith(s) for s in states) or time.monotonic() > deadline:
                return state
            await asyncio.sleep(SYNC_S)


# -- routes -------------------------------------------------------------------------------------------------------

from fastapi import APIRouter, Depends, Request  # noqa: E402 - the routes below, after the parts they call
from fastapi.responses import JSONResponse  # noqa: E402

from longserve.server.api.routes import parse_json_object, read_body, require_api_key, require_started  # noqa: E402

v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key), Depends(require_started)])


@v1.post("/loras")
async def load_lora(request: Request):
    body = parse_json_object(await read_body(request))
    return JSONResponse(await request.app.state.videos.loras.add(body, request.state.caller))


@v1.get("/loras")
async def list_loras(request: Request):
    request.app.state.videos.loras.check_admin(request.state.caller)
    return JSONResponse(await request.app.state.videos.loras.listing())


@v1.delete("/loras/{name}")
async def unload_lora(request: Request, name: str):
    return JSONResponse(await request.app.state.videos.loras.remove(name, request.state.caller))
