"""LoRA adapters loaded while serving (issue 46): `POST /v1/loras` on one of two replicas (one PostgreSQL schema,
tiny-wan on 2 workers and on 1) loads the adapter into every worker of both; requests naming it make the frames a
server given the adapter at start makes; `DELETE` unloads it everywhere and the base model's frames come back; the
load leaves the requests running meanwhile alone; the routes' refusals name the field."""

from __future__ import annotations

import io
import logging
import shutil
import time

import httpx
import imageio.v3 as iio
import numpy as np
import pytest
from postgres import fresh_schema
from servers import serving

from longserve.server.api.errors import APIError
from longserve.server.api.tenants import Caller

pytestmark = pytest.mark.usefixtures("one_thread")

BODY = {"prompt": "a red ball bouncing", "size": "48x32", "num_frames": 5, "seed": 3, "guidance_scale": 1,
        "fps": 8}
COMMON = {"model": "tiny-wan", "device": "cpu", "default_steps": 2, "max_batch": 1, "warm_up": False,
          "lease_seconds": 3}


def made(http: httpx.Client, body: dict, n: int = 1) -> list[np.ndarray]:
    ids = []
    for _ in range(n):
        r = http.post("/v1/videos", json=body)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    out = []
    for vid in ids:
        wait_done(http, vid)
        out.append(iio.imread(io.BytesIO(http.get(f"/v1/videos/{vid}/content").content), extension=".mp4"))
    return out


def wait_done(http: httpx.Client, vid: str) -> dict:
    deadline = time.monotonic() + 120
    while (v := http.get(f"/v1/videos/{vid}").json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, v
        time.sleep(0.05)
    assert v["status"] == "completed", v
    return v


def close(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and float(np.abs(a.astype(int) - b.astype(int)).mean()) < 1.0


def test_an_adapter_loaded_over_http_on_two_replicas_equals_one_loaded_at_start_and_unloading_restores_the_base(
        tmp_path, caplog):
    from longserve.weights import resolve_lora

    loras = tmp_path / "loras"
    loras.mkdir()
    shutil.copy(resolve_lora("tiny-wan-lora"), loras / "style.safetensors")
    caplog.set_level(logging.INFO, logger="longserve.jobs")
    shared = {"lora_dir": str(loras), "media_store": (tmp_path / "media").as_uri(), **COMMON}
    with fresh_schema() as url, serving(tmp_path / "a", store=url, replica_id="a", workers=2, **shared) as a, \
            serving(tmp_path / "b", store=url, replica_id="b", workers=1, **shared) as b:
        ha, hb = httpx.Client(base_url=a["url"], timeout=120), httpx.Client(base_url=b["url"], timeout=120)
        [base] = made(ha, BODY)
        # a request running on both replicas while the adapter loads: its frames are the ones made with no load
        alone = {**BODY, "size": "64x64", "num_frames": 17, "num_inference_steps": 4, "seed": 9}
        [quiet] = made(ha, alone)
        during = [ha.post("/v1/videos", json=alone).json()["id"], hb.post("/v1/videos", json=alone).json()["id"]]
        while any(ha.get(f"/v1/videos/{v}").json()["status"] == "queued" for v in during):
            time.sleep(0.02)
        r = ha.post("/v1/loras", json={"name": "style", "path": "style.safetensors", "scale": 0.8})
        assert r.status_code == 200, r.text
        assert r.json()["replicas"]["a"] == "loaded" and r.json()["source"] == "api"
        deadline = time.monotonic() + 60
        while (listed := hb.get("/v1/loras").json()["data"])[0]["replicas"] != {"a": "loaded", "b": "loaded"}:
            assert time.monotonic() < deadline, listed
            time.sleep(0.1)
        for vid in during:
            v = wait_done(ha, vid)
            assert close(iio.imread(io.BytesIO(ha.get(f"/v1/videos/{v['id']}/content").content), extension=".mp4"),
                         quiet), "a load leaves the running requests' frames alone"
        # the load pauses the requests for its one worker job (the wrapping of the layers), never the file's read
        pauses = [s["service"].engine.loras.pauses["style"] for s in (a, b)]
        assert max(pauses) < 2.0, pauses

        with_lora = {**BODY, "lora": [{"name": "style"}]}
        big = {**with_lora, "size": "64x64", "num_frames": 17}       # past one replica's budget: both claim
        caplog.clear()
        styled = made(ha, with_lora, 1) + made(hb, with_lora, 1)
        spread = made(ha, big, 4)
        assert all(close(f, spread[0]) for f in spread)
        ran_on = {r.replica for r in caplog.records if getattr(r, "event", None) == "claimed"}
        assert ran_on == {"a", "b"}, "both replicas ran requests naming the adapter"
        assert all(close(f, styled[0]) for f in styled), "the same frames on every replica"
        assert float(np.abs(styled[0].astype(int) - base.astype(int)).mean()) > 3, "the adapter changes the frames"

        deleted = hb.delete("/v1/loras/style")
        assert deleted.status_code == 200 and deleted.json()["deleted"], deleted.text
        deadline = time.monotonic() + 60
        while ha.get("/v1/loras").json()["data"]:                  # every replica unloaded it
            assert time.monotonic() < deadline, ha.get("/v1/loras").json()
            time.sleep(0.1)
        refused = ha.post("/v1/videos", json=with_lora)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora", refused.text
        again = made(ha, BODY, 2)
        assert all(close(f, base) for f in again), "unloaded: the base model's frames again"

        for body, param in (({"name": "x", "path": "../outside.safetensors"}, "path"),
                            ({"name": "x", "path": "missing.safetensors"}, "path"),
                            ({"name": "bad name", "path": "style.safetensors"}, "name"),
                            ({"name": "x", "path": "style.safetensors", "scale": 99}, "scale"),
                            ({"name": "x", "path": "style.safetensors", "rank": 4}, "rank")):
            r = ha.post("/v1/loras", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert ha.delete("/v1/loras/nope").status_code == 404
        ha.close()
        hb.close()
    with serving(tmp_path / "ref", workers=1, loras=(f"style={loras / 'style.safetensors'}:0.8",),
                 **{k: v for k, v in COMMON.items() if k != "lease_seconds"}) as ref:
        with httpx.Client(base_url=ref["url"], timeout=120) as http:
            [at_start] = made(http, with_lora)
            assert http.delete("/v1/loras/style").json()["error"]["code"] == "lora_from_start"
            assert http.post("/v1/loras", json={"name": "x", "path": "style.safetensors"}).json()["error"][
                "param"] == "path", "no --lora-dir: loading while serving is off"
    assert close(styled[0], at_start) and close(styled[-1], at_start), "equal to the adapter loaded at start"


def test_only_an_admin_key_loads_or_unloads_adapters():
    from longserve.server.api.loras import LoraAdmin

    admin = LoraAdmin.__new__(LoraAdmin)
    with pytest.raises(APIError) as e:
        admin.check_admin(Caller(owner="key-0123456789ab", admin=False))
    assert e.value.status == 403 and e.value.code == "admin_key_required"
    admin.check_admin(Caller(owner="key-0123456789ab", admin=True))
    admin.check_admin(Caller())                           # a server without keys: one tenant, its own admin
