"""The server's network edge and admission (issue 20): Host and Origin checks, API keys from a file, the
worker group on loopback only, scoring on its own bounded queue, slow clients cut off, and the queue
bounded by work. One in-process server (tiny-latte on 2 workers, tiny-lm scoring) serves the tests that
need one; the rest build an app around a stand-in video service."""

import json
import logging
import os
import selectors
import socket
import subprocess
import sys
import time
import warnings

import httpx
import pytest
from starlette.testclient import TestClient

from longserve.server.api.admission import most_expensive_cost, request_cost
from longserve.server.api.app import create_app
from longserve.server.api.config import ServeConfig
from longserve.server.api.score_service import ScoreService
from tests.support.servers import serving

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the openai client marks the Sora API deprecated

READ_TIMEOUT_S = 2.0
ALLOWED_ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    score = ScoreService("tiny-lm", workers=1, device="cpu", concurrency=1, max_queue=4)
    with serving(tmp_path_factory.mktemp("edge-data"), score=score, model="tiny-latte", workers=2, max_batch=4,
                 max_running=1, default_steps=2, max_steps=50, decode_chunk_frames=4,
                 request_read_timeout_s=READ_TIMEOUT_S, allowed_origins=ALLOWED_ORIGIN) as s:
        s["score"] = score
        with httpx.Client(base_url=s["url"], timeout=60) as http:
            s["http"] = http
            yield s


def wait(http, vid, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = http.get(f"/v1/videos/{vid}").json()
        if v["status"] in ("completed", "failed"):
            return v
        time.sleep(0.05)
    raise AssertionError(f"{vid} is still {v['status']}")


def job_count(server) -> int:
    return sum(server["service"].store.counts_by_status().values())


# -- Host and Origin ---------------------------------------------------------------------------------------


def test_a_foreign_host_header_is_refused_as_a_rebinding_page_would_send_it(server):
    http = server["http"]
    r = http.get("/v1/videos", headers={"Host": "attacker.example"})
    assert r.status_code in (400, 421) and r.json()["error"]["param"] == "host"
    r = http.get("/health", headers={"Host": "attacker.example:8000"})
    assert r.status_code in (400, 421)
    for host in ("localhost", "127.0.0.1:8000", "[::1]:8000"):      # the loopback names are served
        assert http.get("/v1/videos", headers={"Host": host}).status_code == 200, host


def test_a_cross_origin_form_create_without_a_key_is_refused_and_creates_nothing(server):
    http, before = server["http"], job_count(server)
    form = {"prompt": "a red ball bouncing", "size": "32x32", "num_frames": "2"}
    r = http.post("/v1/videos", data=form, headers={"Origin": "http://attacker.example"})
    assert r.status_code == 403 and r.json()["error"]["param"] == "origin"
    r = http.post("/v1/videos", content=b'{"prompt": "x"}', headers={"Origin": "null", "Content-Type": ""})
    assert r.status_code == 403
    assert http.delete("/v1/videos/video_x", headers={"Origin": "https://evil.example"}).status_code == 403
    assert job_count(server) == before
    # the server's own pages, an --allowed-origins page and non-browser clients (no Origin) may create
    same = http.post("/v1/videos", data=form, headers={"Origin": server["url"]})
    allowed = http.post("/v1/videos", data=form, headers={"Origin": ALLOWED_ORIGIN})
    plain = http.post("/v1/videos", data=form)
    assert (same.status_code, allowed.status_code, plain.status_code) == (200, 200, 200), same.text
    assert http.get("/v1/videos", headers={"Origin": "http://attacker.example"}).status_code == 200  # reads pass
    for r in (same, allowed, plain):
        assert wait(http, r.json()["id"])["status"] == "completed"


def test_the_live_socket_handshake_checks_the_origin_too(server):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    url = server["url"].replace("http://", "ws://") + "/v1/videos/live"
    with pytest.raises(InvalidStatus) as refused:
        connect(url, origin="http://attacker.example", open_timeout=10)
    assert refused.value.response.status_code == 403
    with connect(url, origin=ALLOWED_ORIGIN, open_timeout=10) as ws:   # accepted (tiny-latte then says no)
        ws.recv(timeout=10)


def test_the_openai_client_still_works_through_the_edge(server):
    from openai import OpenAI

    client = OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0)
    video = client.videos.create_and_poll(prompt="a blue cube", size="32x32", seconds="0.25", poll_interval_ms=50)
    assert video.status == "completed", video.error
    assert client.videos.delete(video.id).deleted


class StandInVideos:
    """Enough of a `VideoService` for the routes that read config and health only."""

    def __init__(self, **options):
        self.config = ServeConfig.from_options(**options)
        self.model_name, self.started_at, self.replica = "tiny-latte", 0, None    # one process: no replicas

    def health(self):
        return 200, {"status": "ok", "model": "tiny-latte", "workers": 1, "workers_ready": True,
                     "worker_state": "ready", "worker_restarts": 0, "setup_failures": 0, "queued": 0, "running": 0}


def test_an_open_server_on_a_reachable_address_says_so_in_health():
    with TestClient(create_app(StandInVideos(host="0.0.0.0")), base_url="http://10.1.2.3:8000") as c:
        warning = c.get("/health").json()["warnings"]
        assert len(warning) == 1 and "no API key" in warning[0]
    with TestClient(create_app(StandInVideos(host="0.0.0.0"), api_key="k"), base_url="http://10.1.2.3") as c:
        assert c.get("/health").json()["warnings"] == []
    with TestClient(create_app(StandInVideos()), base_url="http://127.0.0.1:8000") as c:
        assert c.get("/health").json()["warnings"] == []


# -- API keys ---------------------------------------------------------------------------------------------------


def test_keys_come_from_a_file_and_a_key_on_the_command_line_is_warned_about(tmp_path, caplog, monkeypatch):
    from longserve.server.cli import build_parser
    from longserve.server.cli.serve import api_keys, key_sets

    for name in ("LONGSERVE_API_KEY", "LONGSERVE_API_KEY_FILE", "LONGSERVE_ADMIN_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    keyfile = tmp_path / "keys"
    keyfile.write_text("# one key per client\nsk-alice\n\n  sk-bob  \n")
    parse = lambda *argv: build_parser().parse_args(["serve", *argv])  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="longserve.server"):
        assert api_keys(parse("--api-key-file", str(keyfile))) == ("sk-alice", "sk-bob")
        assert not caplog.records
        monkeypatch.setenv("LONGSERVE_API_KEY", "sk-env")
        assert api_keys(parse()) == ("sk-env",)
        assert not caplog.records
        assert api_keys(parse("--api-key", "sk-cli")) == ("sk-cli",)
    assert any("process list" in r.getMessage() for r in caplog.records)
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(SystemExit, match="no key"):
        api_keys(parse("--api-key-file", str(tmp_path / "empty")))
    # an admin key: marked in the file, or from its flag or variable; it is a valid key too
    (tmp_path / "admin").write_text("sk-alice\nadmin: sk-root\n")
    assert key_sets(parse("--api-key-file", str(tmp_path / "admin"))) == (("sk-alice", "sk-root"), ("sk-root",))
    monkeypatch.setenv("LONGSERVE_ADMIN_API_KEY", "sk-boss")
    assert key_sets(parse("--api-key-file", str(keyfile))) == (("sk-alice", "sk-bob", "sk-boss"), ("sk-boss",))

    app = create_app(StandInVideos(), api_key=api_keys(parse("--api-key-file", str(keyfile))))
    with TestClient(app, base_url="http://127.0.0.1") as c:
        assert c.get("/v1/models").status_code == 401
        for key in ("sk-alice", "sk-bob"):
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Bearer sk-env"}).status_code == 401
        # with a key, a cross-origin request is the key's business: without it, 401, not 403
        assert c.post("/v1/videos", json={"prompt": "x"}, headers={"Origin": "http://a.example"}).status_code == 401


def test_keys_are_tenants_another_key_gets_404_on_every_route_and_its_repeat_is_generated_anew(server):
    """Issue 32, finding 3: with keys A and B, B can neither list, read, download, follow, extend nor delete A's
    video (the same 404 as an unknown one), and B's identical seeded request is generated, not A's handed over.
    An admin key sees everything, the rows without an owner included."""
    service, http = server["service"], server["http"]
    app = create_app(service, api_key=("sk-a", "sk-b"), admin_api_key="sk-root")
    A, B, ROOT = ({"Authorization": f"Bearer {k}"} for k in ("sk-a", "sk-b", "sk-root"))
    body = {"prompt": "a secret red ball", "size": "32x32", "seconds": "0.25", "seed": 4321}
    unowned = http.post("/v1/videos", json=dict(body, seed=1)).json()["id"]   # no key: no owner, as old rows
    made = [unowned]
    with TestClient(app, base_url="http://127.0.0.1:8000") as c:
        def finished(vid, key):
            deadline = time.monotonic() + 60
            while (v := c.get(f"/v1/videos/{vid}", headers=key).json())["status"] not in ("completed", "failed"):
                assert time.monotonic() < deadline, v
                time.sleep(0.05)
            return v

        vid = c.post("/v1/videos", json=body, headers=A).json()["id"]
        made.append(vid)
        assert finished(vid, A)["status"] == "completed"
        more = {"json": {"prompt": "on", "seconds": "1"}}
        try:
            for method, path, extra in (("GET", f"/v1/videos/{vid}", {}), ("GET", f"/v1/videos/{vid}/content", {}),
                                        ("GET", f"/v1/videos/{vid}/content?variant=thumbnail", {}),
                                        ("GET", f"/v1/videos/{vid}/content?stream=true", {}),
                                        ("GET", f"/v1/videos/{vid}/events", {}),
                                        ("POST", f"/v1/videos/{vid}/extend", more),
                                        ("DELETE", f"/v1/videos/{vid}", {}), ("GET", f"/v1/videos?after={vid}", {})):
                r = c.request(method, path, headers=B, **extra)
                assert r.status_code == 404 and r.json()["error"]["code"] == "video_not_found", (method, path, r.text)
            ids = lambda key: {v["id"] for v in c.get("/v1/videos?limit=100", headers=key).json()["data"]}  # noqa
            assert vid not in ids(B) and unowned not in ids(B)
            assert vid in ids(A) and unowned not in ids(A)
            assert {vid, unowned} <= ids(ROOT) and c.get(f"/v1/videos/{unowned}", headers=ROOT).status_code == 200
            # A's own video: found (the model cannot extend: 400 for its owner, where B got 404)
            assert c.post(f"/v1/videos/{vid}/extend", json={"prompt": "on", "seconds": "1"},
                          headers=A).status_code == 400
            # reuse stays within an owner: B's identical seeded request is generated; A's repeat is reused
            steps = service.engine.stats().steps_run
            b = c.post("/v1/videos", json=body, headers=B).json()
            made.append(b["id"])
            assert b["status"] == "queued" and finished(b["id"], B)["status"] == "completed"
            assert service.engine.stats().steps_run > steps, "B's video was generated"
            again = c.post("/v1/videos", json=body, headers=A).json()
            made.append(again["id"])
            assert again["status"] == "completed", "A's own repeat is still reused"
            assert c.delete(f"/v1/videos/{vid}", headers=A).json()["deleted"] is True
        finally:
            for v in made:
                c.delete(f"/v1/videos/{v}", headers=ROOT)


# -- the worker group -----------------------------------------------------------------------------------------


def listening_addresses(pid: int) -> list[str]:
    """The local addresses of the TCP sockets process `pid` listens on (from /proc: its socket inodes)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:       # state LISTEN, owned by this process
                    address = bytes.fromhex(fields[1].split(":")[0])
                    # /proc writes each 32-bit word in host (little-endian) order
                    words = [address[i:i + 4][::-1] for i in range(0, len(address), 4)]
                    found.append(socket.inet_ntop(socket.AF_INET if table == "tcp" else socket.AF_INET6,
                                                  b"".join(words)))
    return found


@pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="reads /proc (Linux)")
def test_the_worker_group_listens_on_loopback_only(server):
    pids = server["service"].engine.pool.pids
    assert len(pids) == 2
    addresses = {pid: listening_addresses(pid) for pid in pids}
    assert any(addresses.values()), "the group's store and connections should show as listeners"
    for pid, found in addresses.items():
        assert found and all(a in ("127.0.0.1", "::1") for a in found), f"worker {pid} listens on {found}"


# -- scoring ------------------------------------------------------------------------------------------------------


FLOOD = """
import concurrent.futures, json, sys
import httpx
url, text, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
client = httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_connections=n))
def one(_):
    r = client.post("/v1/score", json={"text": text})
    code = r.json()["error"]["code"] if r.status_code != 200 else None
    return {"status": r.status_code, "retry_after": r.headers.get("Retry-After"), "code": code}
with concurrent.futures.ThreadPoolExecutor(n) as pool:
    print(json.dumps(list(pool.map(one, range(n)))))
"""


def test_a_score_flood_gets_429_beyond_its_queue_and_never_slows_video_reads(server):
    http, score = server["http"], server["score"]
    vid = http.post("/v1/videos", json={"prompt": "a red ball", "size": "32x32", "num_frames": 2}).json()["id"]
    wait(http, vid)
    text = "the quick brown fox jumps over the lazy dog."      # short: what is measured is the queueing
    assert http.post("/v1/score", json={"text": text}).status_code == 200      # the pool is up before the flood
    # the flood comes from another process, as real clients would: 64 client threads in this process would
    # share the in-process server's GIL and time themselves, not the server
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, server["url"], text, "64"], stdout=subprocess.PIPE,
                             text=True)
    latencies = []
    while flood.poll() is None or len(latencies) < 20:
        t0 = time.perf_counter()
        assert http.get(f"/v1/videos/{vid}").status_code == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.01)
    assert flood.returncode == 0
    responses = json.loads(flood.stdout.read())
    statuses = [r["status"] for r in responses]
    refused = [r for r in responses if r["status"] == 429]
    assert set(statuses) <= {200, 429} and statuses.count(200) >= score.concurrency + score.max_queue, statuses
    assert refused and refused[0]["retry_after"] and refused[0]["code"] == "queue_full"
    latencies.sort()
    p95 = latencies[int(0.95 * (len(latencies) - 1))]
    assert p95 < 0.100, f"GET p95 {1000 * p95:.0f} ms during the flood ({len(latencies)} GETs)"


def test_a_text_past_the_byte_bound_is_refused_before_it_is_tokenized(server, monkeypatch):
    http, score = server["http"], server["score"]
    limit = score.byte_limit()      # tiny-lm: 4096 positions x its longest token
    assert limit is not None
    tokenized = []
    monkeypatch.setattr(score._scorer, "tokenize", lambda text: tokenized.append(text))
    r = http.post("/v1/score", json={"text": "a" * (limit + 1)})
    assert r.status_code == 413 and r.json()["error"]["param"] == "text" and not tokenized


# -- slow clients --------------------------------------------------------------------------------------------------


def test_slowloris_connections_are_closed_within_the_read_timeout(server):
    port = int(server["url"].rsplit(":", 1)[1])
    sel = selectors.DefaultSelector()
    opened = {}
    for i in range(20):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setblocking(False)
        # half of them stall in the headers, half in the body
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" if i % 2 else
                  b"POST /v1/videos HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{")
        sel.register(s, selectors.EVENT_READ)
        opened[s] = time.monotonic()
    closed_after, answers = {}, {}
    deadline = time.monotonic() + READ_TIMEOUT_S + 3
    next_trickle = time.monotonic()
    try:
        while len(closed_after) < len(opened) and time.monotonic() < deadline:
            if time.monotonic() >= next_trickle:          # a byte now and then keeps a naive server waiting
                for s in opened:
                    if s not in closed_after:
                        try:
                            s.send(b"X-a: b\r\n" if s.fileno() % 2 else b" ")
                        except OSError:
                            pass
                next_trickle = time.monotonic() + 0.3
            for key, _ in sel.select(timeout=0.1):
                s = key.fileobj
                try:
                    data = s.recv(4096)
                except (ConnectionResetError, BlockingIOError):
                    data = b""
                answers[s] = answers.get(s, b"") + data
                if not data:
                    closed_after[s] = time.monotonic() - opened[s]
                    sel.unregister(s)
    finally:
        for s in opened:
            s.close()
    assert len(closed_after) == 20, f"{20 - len(closed_after)} of 20 slow connections are still open"
    assert max(closed_after.values()) < READ_TIMEOUT_S + 1.5, sorted(closed_after.values())
    assert all(b"408" in a or not a for a in answers.values())


# -- admission by work -------------------------------------------------------------------------------------------


def test_the_queue_is_bounded_by_work_and_the_most_expensive_request_counts_in_full(server):
    from longserve.server.api.errors import APIError
    from longserve.server.api.protocol import VideoCreateRequest
    from longserve.server.api.tenants import Caller

    http, service = server["http"], server["service"]
    admission, lim = service.admission, service.limits
    biggest = most_expensive_cost(lim)
    assert biggest == pytest.approx(lim.max_frames / lim.default_frames * lim.max_size ** 2
                                    / (lim.default_width * lim.default_height) * lim.max_steps / lim.default_steps)
    assert request_cost(lim, lim.default_frames, lim.default_width, lim.default_height, lim.default_steps) == 1
    huge = {"prompt": "a red ball", "size": f"{lim.max_size}x{lim.max_size}", "num_frames": lim.max_frames,
            "num_inference_steps": lim.max_steps}
    two = {"prompt": "a red ball", "num_inference_steps": 2 * lim.default_steps}      # costs 2
    made, saved = [], (admission.max_work, admission.max_work_per_key)
    admission.max_work = biggest + 2.5
    try:
        # the most expensive allowed request runs (one at a time: --max-running 1) and counts in full
        made.append(http.post("/v1/videos", json=huge).json()["id"])
        assert service.jobs.work() == pytest.approx(biggest)
        made.append(http.post("/v1/videos", json=two).json()["id"])
        assert service.jobs.work() == pytest.approx(biggest + 2)
        r = http.post("/v1/videos", json=two)                          # biggest + 4 > biggest + 2.5
        assert r.status_code == 429 and int(r.headers["Retry-After"]) > 0, r.text
        assert "--max-queued-work" in r.json()["error"]["message"]

        # per key: a key's own work is bounded; another key's is not touched by it
        admission.max_work, admission.max_work_per_key = None, 3
        made.append(service.create(VideoCreateRequest(**two), Caller("key-a", admin=False)).id)
        with pytest.raises(APIError) as refused:
            service.create(VideoCreateRequest(**two), Caller("key-a", admin=False))
        assert refused.value.status == 429 and refused.value.code == "key_work_limit"
        made.append(service.create(VideoCreateRequest(**two), Caller("key-b", admin=False)).id)
        assert service.jobs.work("key-a") == service.jobs.work("key-b") == pytest.approx(2)
    finally:
        admission.max_work, admission.max_work_per_key = saved
        for vid in made:
            http.delete(f"/v1/videos/{vid}")
    assert service.jobs.work() == 0, "deleted videos no longer count"


def test_one_gate_counts_a_live_session_in_whole_chunks_like_any_video():
    """The admission gate is the same for create, extend and live: a session costs its longest length in whole
    chunks, counts against the same work as videos, and is refused by the same 429 (503 while draining)."""
    from types import SimpleNamespace

    from longserve.server.api.admission import AdmissionGate
    from longserve.server.api.errors import APIError
    from longserve.server.api.jobs import LIVE, VIDEO, Job, JobRegistry

    limits = SimpleNamespace(default_frames=12, default_width=64, default_height=64, default_steps=4, fps=8,
                             pixels_per_token=1, sound_tokens_per_second=0.0)
    jobs, shutdown = JobRegistry(), SimpleNamespace(draining=False)
    gate = AdmissionGate(jobs, None, shutdown, limits, max_work=5, max_work_per_key=None, frames_per_chunk=12)
    session = SimpleNamespace(num_frames=13, width=64, height=64, num_inference_steps=4, fps=8)
    assert gate.cost(session, VIDEO) == pytest.approx(13 / 12) and gate.cost(session, LIVE) == 2, "two chunks"
    gate.admit(Job("live_a", LIVE, gate.cost(session, LIVE)))
    gate.admit(Job("video_b", VIDEO, 2.5))
    with pytest.raises(APIError) as refused:
        gate.admit(Job("live_c", LIVE, gate.cost(session, LIVE)))              # 2 + 2.5 + 2 > 5
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    assert jobs.remove(jobs.get("live_a")) and jobs.work() == 2.5
    gate.admit(Job("live_c", LIVE, gate.cost(session, LIVE)))                   # room again
    shutdown.draining = True
    with pytest.raises(APIError) as closed:
        gate.check_open(writes_files=False)
    assert closed.value.status == 503 and closed.value.code == "server_shutdown"
