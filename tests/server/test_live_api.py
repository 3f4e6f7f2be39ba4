"""`WebSocket /v1/videos/live` against a real `longserve serve` process on a tiny causal model, with the
`websockets` client library: fragments that play as one MP4, a prompt switch and its `prompt.applied`,
stop, the API key, two sessions batched together, the KV budget refusing a third, and a disconnect
giving the cache back."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import imageio_ffmpeg
import numpy as np
import pytest
from causal_models import build_tiny_causal
from servers import wait_until_healthy
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from longserve.server.api.app import free_port

KEY = "sk-live-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROOT = Path(__file__).resolve().parents[2]
SIZE = "32x32"
# one session's KV cache at 32x32 on 2 workers is 0.30 MiB per worker: the budget holds two, not three
BUDGET_MIB = 0.7


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_tiny_causal(tmp_path_factory.mktemp("causal") / "tiny-causal")
    port = free_port()
    script = Path(sys.executable).parent / "longserve"
    head = [str(script)] if script.exists() else [sys.executable, "-m", "longserve.server.cli"]
    proc = subprocess.Popen(head + ["serve", "--model", str(model), "--workers", "2", "--device", "cpu",
                                    "--port", str(port), "--data-dir", str(tmp_path_factory.mktemp("data")),
                                    "--api-key", KEY, "--score-model", "none", "--log-level", "warning",
                                    "--live-kv-budget", str(BUDGET_MIB), "--max-live-seconds", "30", "--no-warm-up"],
                            cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url)
    yield {"url": url, "ws": f"ws://127.0.0.1:{port}/v1/videos/live"}
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server["url"] + "/metrics", headers=AUTH).text
    m = re.search(rf"^{re.escape(name + labels)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def start(server, prompt="a red ball bouncing", headers=AUTH, **extra):
    ws = connect(server["ws"], additional_headers=headers, open_timeout=30)
    ws.send(json.dumps({"type": "start", "prompt": prompt, "size": SIZE, "seed": 0, "fps": 16, **extra}))
    return ws


def event(ws, timeout=60):
    msg = ws.recv(timeout=timeout)
    assert isinstance(msg, str), "expected a JSON event, got a binary message"
    return json.loads(msg)


def test_a_session_plays_as_one_mp4_switches_its_prompt_and_stops(server, tmp_path):
    ws = start(server, record=True)                 # kept as a video too (issue 46)
    created = event(ws)
    assert created["type"] == "session.created" and created["size"] == SIZE and created["frames_per_chunk"] == 12
    assert created["record"] is True
    fragments, chunks, applied, received, switched_during, stopping = [], [], [], [], None, False
    while True:
        e = event(ws)
        if e["type"] in ("prompt.applied", "prompt.received"):
            (applied if e["type"] == "prompt.applied" else received).append(e)
            continue
        if e["type"] == "done":
            break
        assert e["type"] == "chunk", e
        data = ws.recv(timeout=60)
        assert isinstance(data, bytes) and len(data) == e["bytes"]
        fragments.append(data)
        chunks.append(e)
        if e["index"] == 1:
            ws.send(json.dumps({"type": "prompt", "prompt": "a blue ball bouncing"}))
            switched_during = 1
        if e["index"] >= 3 and applied and not stopping:      # after the switch applied: a stop arriving with it
            ws.send(json.dumps({"type": "stop"}))            # would end the session before the switch's chunk
            stopping = True
    ws.close()
    # (the chunks made while the stop was on its way depend on the machine's load; "stopped" is the stop's answer)
    assert e["reason"] == "stopped" and e["chunks"] == len(chunks) >= 4
    assert [c["index"] for c in chunks] == list(range(len(chunks)))
    # the switch applies at the next chunk the engine makes once it arrives, and prompt.applied names it. The engine
    # runs ahead of this client (a quiet machine makes several 32x32 chunks while the client reads one), so "next"
    # is the engine's: `prompt.received` says, when the switch is taken, the chunk it applies by (the chunk the
    # workers last reported making, plus one), and prompt.applied keeps that promise
    assert len(applied) == 1 and applied[0]["prompt_index"] == 1 and applied[0]["prompt"] == "a blue ball bouncing"
    assert len(received) == 1 and received[0]["prompt_index"] == 1, received
    first = applied[0]["chunk"]
    assert switched_during < first <= received[0]["by_chunk"], (first, received)
    assert [c["prompt_index"] for c in chunks] == [int(c["index"] >= first) for c in chunks]
    # the binary messages concatenated are one MP4 with every frame
    path = tmp_path / "live.mp4"
    path.write_bytes(b"".join(fragments))
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    frames = [np.frombuffer(f, np.uint8) for f in reader]
    assert meta["size"] == (32, 32) and len(frames) == sum(c["frames"] for c in chunks) == e["frames"]
    assert chunks[0]["frames"] == 9 and all(c["frames"] == 12 for c in chunks[1:])
    # recorded: a completed video under the session's id, its content every fragment the session made, listed
    assert e["video_id"] == created["id"]
    video = httpx.get(f"{server['url']}/v1/videos/{created['id']}", headers=AUTH).json()
    assert (video["status"], video["num_frames"], video["size"]) == ("completed", e["frames"], SIZE), video
    assert video["options"]["live"] is True and video["options"]["prompts"] == ["a red ball bouncing",
                                                                                "a blue ball bouncing"]
    stored = httpx.get(f"{server['url']}/v1/videos/{created['id']}/content", headers=AUTH).content
    if e["dropped"] == 0:
        assert stored == b"".join(fragments)
    assert created["id"] in [v["id"] for v in httpx.get(f"{server['url']}/v1/videos", headers=AUTH).json()["data"]]
    thumb = httpx.get(f"{server['url']}/v1/videos/{created['id']}/content?variant=thumbnail", headers=AUTH)
    assert thumb.status_code == 200 and thumb.content.startswith(b"\x89PNG")
    bad = start(server, record="yes")
    assert event(bad)["param"] == "record"
    bad.close()


def test_the_socket_needs_the_api_key_and_bad_starts_are_named(server):
    ws = connect(server["ws"], open_timeout=30)           # no key: a start is refused, the key was not said first
    ws.send(json.dumps({"type": "start", "prompt": "a red ball"}))
    e = event(ws)
    assert e["type"] == "error" and e["code"] == "invalid_api_key"
    with pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=10)
    assert closed.value.rcvd.code == 1008
    ws = connect(server["ws"] + f"?api_key={KEY}", open_timeout=30)       # a key in the URL (logged): refused
    e = event(ws)
    assert e["type"] == "error" and e["code"] == "invalid_api_key" and e["param"] == "api_key"
    ws = connect(server["ws"], open_timeout=30)
    ws.send(json.dumps({"type": "auth", "api_key": "sk-wrong"}))
    assert event(ws)["code"] == "invalid_api_key"
    ws = connect(server["ws"], open_timeout=30)                           # browsers: the key in the first message
    ws.send(json.dumps({"type": "auth", "api_key": KEY}))
    ws.send(json.dumps({"type": "start", "prompt": "a red ball", "size": "33x32"}))
    e = event(ws)
    assert e["type"] == "error" and e["param"] == "width" and "multiple of 16" in e["message"]
    ws.close()
    ws = start(server, prompt="  ")
    e = event(ws)
    assert e["type"] == "error" and e["param"] == "prompt"
    ws.close()


def test_two_sessions_batch_a_third_is_refused_and_a_disconnect_gives_the_cache_back(server):
    before = metric(server, "longserve_kv_cache_bytes")
    batched_before = (metric(server, "longserve_step_batch_size_count")
                      - metric(server, "longserve_step_batch_size_bucket", '{le="1"}'))
    a, b = start(server), start(server, prompt="a green square moving left")
    assert event(a)["type"] == "session.created" and event(b)["type"] == "session.created"
    one = metric(server, "longserve_kv_cache_bytes") / 2
    assert one > 0 and before == 0
    third = start(server)
    e = event(third)
    assert e["type"] == "error" and e["code"] == "live_capacity" and "live KV budget is full" in e["message"]
    with pytest.raises(ConnectionClosed) as closed:
        third.recv(timeout=10)
    assert closed.value.rcvd.code == 1013
    for ws in (a, b):                       # both stream; their steps share forwards
        for _ in range(4):
            m = ws.recv(timeout=60)
            assert m
    batched = (metric(server, "longserve_step_batch_size_count")
               - metric(server, "longserve_step_batch_size_bucket", '{le="1"}'))
    assert batched > batched_before
    a.close()                               # a disconnect: the session ends, its cache is freed
    deadline = time.monotonic() + 30
    while metric(server, "longserve_kv_cache_bytes") > one and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "longserve_kv_cache_bytes") == one
    c = start(server)                       # and a new session fits again
    assert event(c)["type"] == "session.created"
    for ws in (b, c):
        ws.close()
    deadline = time.monotonic() + 30
    while (metric(server, "longserve_kv_cache_bytes") > 0 or metric(server, "longserve_live_sessions") > 0) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "longserve_kv_cache_bytes") == 0 and metric(server, "longserve_live_sessions") == 0


def test_a_finite_job_on_a_causal_model_runs_through_post_videos(server):
    with httpx.Client(base_url=server["url"], headers=AUTH, timeout=60) as http:
        v = http.post("/v1/videos", json={"prompt": "a red ball bouncing", "size": SIZE, "seconds": "2"}).json()
        assert v["num_inference_steps"] == 4, v
        deadline = time.monotonic() + 120
        while v["status"] not in ("completed", "failed") and time.monotonic() < deadline:
            time.sleep(0.1)
            v = http.get(f"/v1/videos/{v['id']}").json()
        assert v["status"] == "completed", v
        data = http.get(f"/v1/videos/{v['id']}/content").content
    assert data[4:8] == b"ftyp"


def closed_with(ws) -> tuple[dict, int]:
    """The error event a session ends with (after any chunks still under way), and the socket's close code."""
    while True:
        try:
            msg = ws.recv(timeout=60)
        except ConnectionClosed as e:
            raise AssertionError(f"closed ({e.rcvd.code if e.rcvd else None}) without an error event") from None
        if isinstance(msg, str) and json.loads(msg)["type"] == "error":
            break
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            ws.recv(timeout=10)
    return json.loads(msg), closed.value.rcvd.code


def test_protocol_errors_close_the_socket_with_a_code_and_an_error_event(server):
    """Issue 32: a binary frame, JSON nested past the bound, a lone surrogate -- at the start or in a session."""
    deep = "[" * 5000 + "]" * 5000
    for first, code, close, param in ((b"\x00\x01binary", "unsupported_data", 1003, None),
                                      (deep, "invalid_json", 1007, None),
                                      ('{"type": "start", "prompt": "a\\ud800"}', "invalid_value", 1007, "prompt")):
        ws = connect(server["ws"], additional_headers=AUTH, open_timeout=30)
        ws.send(first)
        e, got = closed_with(ws)
        assert (e["code"], got, e["param"]) == (code, close, param), e
    nested = "[" * 100 + "]" * 100                  # parses, but deeper than any field takes
    for later, code, close in ((b"\xff", "unsupported_data", 1003),
                               ('{"type": "prompt", "prompt": ' + nested + "}", "invalid_value", 1007)):
        ws = start(server)
        assert event(ws)["type"] == "session.created"
        ws.send(later)
        e, got = closed_with(ws)
        assert (e["code"], got) == (code, close), e
    assert httpx.get(server["url"] + "/health").json()["status"] == "ok"
