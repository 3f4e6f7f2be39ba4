"""Issue 42 on the replicas' shared store: two in-process replicas (tiny-live, one worker each) on one fresh
PostgreSQL schema of the machine's server and one shared media directory, two API keys. Replica A reaches the
database through a TCP proxy of the test's (tests/support/tcp_proxy.py), which the outage test closes and reopens:
the shared PostgreSQL is never stopped. Skipped, saying how to run it, when no PostgreSQL answers.

- Storage per owner: B's reuses and generations never evict A's videos; a reuse's hard-linked copy counts once;
  uploads count while their job is active, and a failed job's upload is gone from the media store.
- Admission on every store: live sessions count on PostgreSQL as on SQLite, across replicas; 24 parallel creates
  over the two replicas admit exactly the per-key limit, 20 runs of 20.
- A database that refuses connections: 503 storage_unavailable within 5 s on every route, /health degraded with
  the reason, and service again without a restart.
- 300 streamed downloads of a job another replica runs cost a few transactions a second.
- NUL characters are 400 naming the field here too.

Cheap on purpose: the replicas start once for the module, videos are 32x32 with 3 frames, and a job
that must stay queued does so because the replicas' claims are paused (`Replica.claim` answers nothing), not by
burning CPU."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import struct
import threading
import time
import zlib
from urllib.parse import urlsplit

import httpx
import pytest
from postgres import fresh_schema
from servers import serving
from tcp_proxy import TCPProxy
from websockets.sync.client import connect

from longserve.server.api.edge import client_id

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
SMALL = {"size": "32x32", "num_frames": 3}      # (tiny-live denoises in its 4 steps)


def auth(key):
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared")
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(fresh_schema("ls_security"))
        real = urlsplit(url)
        proxy = TCPProxy((real.hostname, real.port or 5432))
        stack.callback(proxy.close)
        common = dict(api_key=(KEY_A, KEY_B), model="tiny-live", workers=1, media_store=f"file://{root / 'media'}",
                      lease_seconds=5, max_live_seconds=30, store_timeout_s=1)
        a = stack.enter_context(serving(root / "a", replica_id="A", **common,
                                        store=url.replace(real.netloc, f"{real.hostname}:{proxy.port}", 1)))
        b = stack.enter_context(serving(root / "b", replica_id="B", store=url, **common))
        clients = {}
        for name, s in (("A", a), ("B", b)):
            for key in (KEY_A, KEY_B):
                clients[name, key] = stack.enter_context(httpx.Client(base_url=s["url"], headers=auth(key),
                                                                      timeout=60))
        yield {"A": a, "B": b, "url": url, "proxy": proxy, "media": root / "media", "http": clients}


@contextlib.contextmanager
def claims_paused(replicas):
    """Neither replica claims a queued job meanwhile (what is created stays queued, counted by admission)."""
    replicas_ = [replicas[n]["service"].replica for n in ("A", "B")]
    saved = [r.claim for r in replicas_]
    for r in replicas_:
        r.claim = lambda: []
    try:
        yield
    finally:
        for r, claim in zip(replicas_, saved):
            r.claim = claim


def wait(http, vid, timeout=120):
    deadline = time.monotonic() + timeout
    while (v := http.get(f"/v1/videos/{vid}").json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"{vid} is still {v['status']}"
        time.sleep(0.05)
    return v


def create(http, **body):
    r = http.post("/v1/videos", json={"prompt": "a red ball bouncing", **SMALL, **body})
    assert r.status_code == 200, r.text
    return r.json()


# -- storage per owner ---------------------------------------------------------------------------------------


def test_one_keys_reuse_and_generations_never_evict_another_keys_videos_and_a_linked_copy_counts_once(replicas):
    http = replicas["http"]
    services = [replicas[n]["service"] for n in ("A", "B")]
    a_videos = [wait(http["A", KEY_A], create(http["A", KEY_A], seed=100 + i)["id"]) for i in range(3)]
    assert all(v["status"] == "completed" for v in a_videos)
    quotas = services[0].storage.quotas
    owner_a, owner_b = client_id(KEY_A), client_id(KEY_B)
    size = quotas.usage(owner_a) / 3
    for service in services:                        # room for about three such videos a key
        service.storage.quotas.per_owner = int(3.5 * size)
    try:
        first = wait(http["A", KEY_B], create(http["A", KEY_B], seed=7)["id"])
        repeats = [create(http[("A", "B")[i % 2], KEY_B], seed=7) for i in range(25)]     # reused: nothing made
        assert all(r["status"] == "completed" for r in repeats)
        assert quotas.usage(owner_b) == first_bytes(services[0], first["id"]), "25 hard links count as one copy"
        for r in (first, *repeats[-2:]):
            assert http["B", KEY_B].get(f"/v1/videos/{r['id']}/content").status_code == 200
        made = [wait(http["B", KEY_B], create(http["B", KEY_B], seed=200 + i)["id"]) for i in range(5)]
        assert all(v["status"] == "completed" for v in made)
        for v in a_videos:                          # A's three videos are all still there
            r = http["A", KEY_A].get(f"/v1/videos/{v['id']}/content")
            assert r.status_code == 200 and r.content[4:8] == b"ftyp", r.text[:200]
        # B went over its own quota: its own oldest copies went, never its newest
        expired = [v for v in made + [first] if http["A", KEY_B].get(f"/v1/videos/{v['id']}").json()["expires_at"]
                   and http["A", KEY_B].get(f"/v1/videos/{v['id']}/content").status_code == 404]
        assert expired and made[-1] not in expired
        assert quotas.usage(owner_b) <= quotas.per_owner and quotas.usage(owner_a) == pytest.approx(3 * size)
    finally:
        for service in services:
            service.storage.quotas.per_owner = None


def first_bytes(service, video_id):
    return service.store.get(video_id).bytes


def damaged_png(width=32, height=32) -> bytes:
    """A PNG whose chunks and CRCs are right and whose compressed pixels are not (it passes the door's checks, which
    decode no pixel, and fails on the worker that decodes it)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"\x78\x9c" + b"\xff" * 500) + \
        chunk(b"IEND", b"")


def test_uploads_count_in_their_owners_quota_and_a_failed_or_deleted_jobs_upload_is_gone(replicas):
    http, media = replicas["http"]["A", KEY_A], replicas["media"]
    storage = replicas["A"]["service"].storage
    image = {"image_url": "data:image/png;base64," + base64.b64encode(damaged_png()).decode()}
    with claims_paused(replicas):
        queued = [create(http, prompt="from an image", input_reference=image)["id"] for _ in range(2)]
        assert all(inputs_of(media, vid) for vid in queued)     # in the shared media store, for any replica
        assert storage.store.active_inputs(client_id(KEY_A)) >= 2 * len(damaged_png())
        assert http.delete(f"/v1/videos/{queued[1]}").json()["deleted"] is True      # deleted: its upload goes
    failed = wait(http, queued[0])                  # claimed now: the worker cannot decode it
    assert failed["status"] == "failed" and failed["error"]["code"] == "invalid_request", failed
    # the failure is published first, then the files go, then the record is written (video_jobs.failed): both wait
    deadline = time.monotonic() + 5
    while any(inputs_of(media, vid) for vid in queued) or storage.store.active_inputs(client_id(KEY_A)):
        assert time.monotonic() < deadline, ([inputs_of(media, vid) for vid in queued],
                                             storage.store.active_inputs(client_id(KEY_A)))
        time.sleep(0.05)
    assert storage.store.active_inputs(client_id(KEY_A)) == 0


def inputs_of(media, vid):
    folder = media / "inputs" / vid              # (<media>/videos holds the videos)
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


# -- admission -------------------------------------------------------------------------------------------------


def live(server, key, **start):
    ws = connect(server["url"].replace("http", "ws", 1) + "/v1/videos/live", additional_headers=auth(key),
                 open_timeout=30, max_size=None)
    ws.send(json.dumps({"type": "start", "prompt": "a red ball bouncing", "size": "32x32", "seed": 0, **start}))
    return ws, json.loads(ws.recv(timeout=60))


def test_live_sessions_count_on_postgresql_as_on_sqlite_and_across_replicas(replicas):
    """`--max-work-per-key 2` (a session here costs more than 2: its 30 s of video): one session of a key is
    admitted, the rest refused key_work_limit, on either replica; when it ends the key may open another."""
    gates = [replicas[n]["service"].admission for n in ("A", "B")]
    for gate in gates:
        gate.max_work_per_key = 2
    sockets = []
    try:
        ws, first = live(replicas["A"], KEY_A)
        sockets.append(ws)
        assert first["type"] == "session.created", first
        for server in (replicas["A"], replicas["A"], replicas["B"]):
            ws, refused = live(server, KEY_A)
            sockets.append(ws)
            assert refused["type"] == "error" and refused["code"] == "key_work_limit", refused
        ws, other = live(replicas["B"], KEY_B)            # another key is not this key's limit
        sockets.append(ws)
        assert other["type"] == "session.created", other
        for ws in sockets:
            ws.close()
        deadline = time.monotonic() + 10
        while True:                                      # the sessions' rows go when they end
            ws, again = live(replicas["B"], KEY_A)
            ws.close()
            if again["type"] == "session.created":
                break
            assert time.monotonic() < deadline, again
            time.sleep(0.2)
    finally:
        for gate in gates:
            gate.max_work_per_key = None
        for ws in sockets:
            ws.close()


def test_parallel_creates_over_two_replicas_admit_exactly_the_per_key_limit_in_20_of_20_runs(replicas):
    """24 creates at once, 12 to each replica, of a key whose limit is 4 default requests: exactly 4 admitted in
    every run (the check and the insert are one transaction under an advisory lock): ten runs under the lock of
    everyone's work (a --max-queued-work is set), ten under the key's own."""
    services = [replicas[n]["service"] for n in ("A", "B")]
    http = [replicas["http"][n, KEY_B] for n in ("A", "B")]
    saved = [(s.admission.max_work, s.admission.shared.whole) for s in services]
    admitted_counts = []
    try:
        with claims_paused(replicas):
            for run in range(20):
                for s in services:
                    s.admission.max_work_per_key = 4
                    s.admission.max_work, s.admission.shared.whole = (256, True) if run < 10 else (None, False)
                barrier, results = threading.Barrier(24), []
                threads = [threading.Thread(target=create_at_once, args=(barrier, http[i % 2], f"run {run} #{i}",
                                                                         results)) for i in range(24)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(60)
                admitted = [r.json()["id"] for r in results if r.status_code == 200]
                other = [(r.status_code, r.text[:200]) for r in results
                         if r.status_code != 200 and r.json().get("error", {}).get("code") != "key_work_limit"]
                assert not other and len(results) == 24, (run, len(results), other)
                admitted_counts.append(len(admitted))
                for vid in admitted:
                    assert http[0].delete(f"/v1/videos/{vid}").status_code == 200
    finally:
        for s, (work, whole) in zip(services, saved):
            s.admission.max_work_per_key = None
            s.admission.max_work, s.admission.shared.whole = work, whole
    assert admitted_counts == [4] * 20, admitted_counts


def create_at_once(barrier, http, prompt, results):
    barrier.wait()
    results.append(http.post("/v1/videos", json={"prompt": prompt}))       # a default request: cost 1


def test_nul_characters_are_refused_naming_the_field_on_postgresql(replicas):
    http = replicas["http"]["A", KEY_A]
    r = http.post("/v1/videos", content=b'{"prompt": "a\\u0000b"}', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = http.post("/v1/videos", data={"prompt": "a", "negative_prompt": "b\x00"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "negative_prompt"
    ws, refused = live(replicas["A"], KEY_A, prompt="a\x00b")
    ws.close()
    assert refused["type"] == "error" and refused["param"] == "prompt", refused


# -- the replicas' watcher -------------------------------------------------------------------------------------


def test_300_streamed_downloads_of_a_job_another_replica_runs_cost_a_few_transactions_a_second(replicas):
    """The job runs on a third replica (the test plays it: its claimed row, its growing file in the shared media
    directory); 300 clients of replica A stream it. Once they all stream (each request looked its video up once),
    replica A's store is asked a few times a second more than without them, whatever their number (each client
    polled it 8 times a second before); every client gets the whole file."""
    service = replicas["A"]["service"]
    store = service.store
    fairness = replicas["A"]["app"].state.fairness
    vid = "video_elsewhere_" + str(int(time.time()))
    from longserve.server.api.store import VideoRecord

    params = {"num_frames": 3, "fps": 8, "width": 32, "height": 32, "num_inference_steps": 2, "guidance_scale": 1.0,
              "seed": 0, "negative_prompt": "", "options": {}}
    rec = VideoRecord(id=vid, created_at=int(time.time()), status="in_progress", model=service.model_name,
                      prompt="x", seconds="1", size="32x32", params=params, owner=client_id(KEY_A))
    with store.transaction() as conn:
        store.insert(rec, 1.0, conn=conn, lease=("X", 3600.0))     # claimed by replica "X", fence 1
    part = store.partial_path(vid, 1)
    part.write_bytes(b"\0\0\0\x18ftypisom" + b"a" * 1000)
    store.thumbnail_path(vid, 1).write_bytes(b"png")
    checkouts = count_checkouts(store)
    saved, fairness.max_streams = fairness.max_streams, None
    try:
        time.sleep(1.0)
        base = checkouts.rate(3.0)                       # replica A's own cycle (claims, heartbeats, leases, probe)

        async def clients(n):
            async with httpx.AsyncClient(base_url=replicas["A"]["url"], headers=auth(KEY_A), timeout=120,
                                         limits=httpx.Limits(max_connections=n + 5)) as http:
                async def one():
                    async with http.stream("GET", f"/v1/videos/{vid}/content", params={"stream": "true"}) as r:
                        assert r.status_code == 200
                        chunks = []
                        async for chunk in r.aiter_bytes():
                            if not chunks:
                                streaming.append(1)
                            chunks.append(chunk)
                        return b"".join(chunks)

                streaming = []
                tasks = [asyncio.ensure_future(one()) for _ in range(n)]
                deadline = time.monotonic() + 120
                while len(streaming) < n:                # every client is streaming (its request's lookups done)
                    assert time.monotonic() < deadline and not any(t.done() for t in tasks), len(streaming)
                    await asyncio.sleep(0.1)
                await asyncio.sleep(0.5)
                busy = await asyncio.get_running_loop().run_in_executor(None, checkouts.rate, 3.0)
                with part.open("ab") as f:
                    f.write(b"b" * 1000)
                part.rename(store.video_path(vid, 1))    # the other replica completes it and publishes it
                store.publish(vid, 1, status="completed", progress=100, completed_at=int(time.time()), bytes=2024)
                return busy, await asyncio.gather(*tasks)

        busy, bodies = asyncio.run(clients(300))
    finally:
        fairness.max_streams = saved
        checkouts.stop()
    final = store.video_path(vid).read_bytes()
    assert all(body == final for body in bodies), {len(b) for b in bodies}
    print(f"\nreplica A's store: {base:.1f} transactions/s alone, {busy:.1f} with 300 streamed downloads")
    assert busy - base <= 5.0, (base, busy)


class count_checkouts:
    """Counts the connections a store takes from its pool (one transaction each: autocommit, or one block)."""

    def __init__(self, store):
        self.pool, self.n = store.pool, 0
        original = self.pool.connection

        def counted(*args, **kwargs):
            self.n += 1
            return original(*args, **kwargs)

        self.pool.connection = counted

    def rate(self, seconds: float) -> float:
        start = self.n
        time.sleep(seconds)
        return (self.n - start) / seconds

    def stop(self):
        del self.pool.connection


# -- a database that goes away -------------------------------------------------------------------------------


def test_a_database_that_refuses_connections_is_503_within_5_s_on_every_route_and_health_says_degraded(replicas):
    a, proxy = replicas["A"], replicas["proxy"]
    http = replicas["http"]["A", KEY_A]
    vid = wait(http, create(http, seed=5)["id"])["id"]
    routes = [("POST", "/v1/videos", {"json": {"prompt": "x", **SMALL}}), ("GET", f"/v1/videos/{vid}", {}),
              ("GET", "/v1/videos", {}), ("GET", f"/v1/videos/{vid}/content", {}),
              ("GET", f"/v1/videos/{vid}/events", {}), ("DELETE", f"/v1/videos/{vid}", {}),
              ("GET", "/v1/models", {})]
    proxy.close()
    try:
        for method, path, kwargs in routes:
            started = time.monotonic()
            r = http.request(method, path, **kwargs)
            took = time.monotonic() - started
            assert r.status_code == 503 and r.json()["error"]["code"] == "storage_unavailable", (path, r.text)
            assert r.headers["Retry-After"] and took < 5.0, (path, took)
        health = httpx.get(a["url"] + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        assert "job store does not answer" in health.json()["reason"]
        assert "longserve_jobs" in httpx.get(a["url"] + "/metrics", timeout=10).text      # (from before)
    finally:
        proxy.open()
    deadline = time.monotonic() + 15
    while (health := httpx.get(a["url"] + "/health", timeout=10)).json()["status"] != "ok":
        assert time.monotonic() < deadline, health.json()
        time.sleep(0.2)
    assert http.get(f"/v1/videos/{vid}").json()["status"] == "completed"
    assert http.delete(f"/v1/videos/{vid}").status_code == 200


def test_a_store_that_cannot_connect_at_start_is_one_line_naming_store_before_the_model_loads(tmp_path):
    import subprocess
    import sys

    from servers import ROOT

    from longserve.server.api.app import free_port

    script = [sys.executable, "-m", "longserve.server.cli"]
    url = f"postgresql://longserve:secret@127.0.0.1:{free_port()}/longserve"       # nothing listens there
    started = time.monotonic()
    done = subprocess.run(script + ["serve", "--model", "tiny-latte", "--store", url, "--data-dir", str(tmp_path),
                                    "--store-timeout", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("longserve serve: error: --store postgresql://longserve:***@127.0.0.1:"), lines
    assert "secret" not in done.stderr and "refused" in lines[0] and took < 30, took
