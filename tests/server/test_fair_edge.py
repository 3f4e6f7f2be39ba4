"""Issue 42 at the edge, on one in-process server (tiny-live, one worker, two API keys, `--limit-concurrency 64`,
`--header-read-timeout 2`):

- WebRTC offers are bounded and admitted before any SDP work: a unit test of the candidate filter (other hosts,
  private ranges and mDNS names refused), a property test of the offer screen (any text: a clean 400 or an offer
  whose every candidate is allowed), and against the server an offer from 127.0.0.1 listing candidates at other
  loopback addresses (127.0.0.2 and up) that the test listens on: no packet reaches them, and the answer lists the
  address the client reached only. 500 m-sections are refused before admission; /health answers within 200 ms
  through a burst of offers; a garbage SDP gets a clear error. No test here puts a routable or private-range address
  where the server could send to it (those appear only in the filter's unit test, which sends nothing).
- Fair connections: one key's 120 event streams leave another key's requests answered; a key's request rate is a
  token bucket (429 with Retry-After); sockets that trickle their headers are cut by the header deadline.
- /docs is off by default and /openapi.json needs the key; with --docs the page loads nothing and runs no script.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import selectors
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import serving
from starlette.testclient import TestClient
from websockets.sync.client import connect

pytest.importorskip("aiortc", reason="WebRTC needs the webrtc extra: pip install '.[webrtc]'")

from longserve.server.api import webrtc  # noqa: E402
from longserve.server.api.edge import client_id  # noqa: E402
from longserve.server.api.webrtc import candidate_allowed, check_offer, parse_networks, screen_offer  # noqa: E402

KEY_A, KEY_B = "sk-edge-a", "sk-edge-b"
FINGERPRINT = ":".join(["AB"] * 32)


def auth(key):
    return {"Authorization": f"Bearer {key}"}


def offer_sdp(candidates=(), sections=1) -> str:
    """A browser-shaped offer of `sections` receive-only video sections (VP8), the first listing `candidates`
    ((host, port) pairs) as host candidates."""
    lines = ["v=0", "o=- 1 2 IN IP4 127.0.0.1", "s=-", "t=0 0",
             "a=group:BUNDLE " + " ".join(str(i) for i in range(sections)), "a=msid-semantic: WMS"]
    for i in range(sections):
        lines += ["m=video 9 UDP/TLS/RTP/SAVPF 96", "c=IN IP4 0.0.0.0"]
        if i == 0:
            lines += [f"a=candidate:{n} 1 udp 2113937151 {host} {port} typ host generation 0"
                      for n, (host, port) in enumerate(candidates)]
        lines += ["a=ice-ufrag:abcd", "a=ice-pwd:abcdefghijklmnopqrstuvwx", f"a=fingerprint:sha-256 {FINGERPRINT}",
                  "a=setup:actpass", f"a=mid:{i}", "a=recvonly", "a=rtcp-mux", "a=rtpmap:96 VP8/90000"]
    return "\r\n".join(lines) + "\r\n"


def bulky_offer(sections: int) -> str:
    """An offer of many minimal video sections that aiortc reads whole (500 of them: 54 KB, within the size bound;
    today's main answered four of them at once with its event loop stalled for seconds)."""
    body = "".join(f"m=video 9 UDP/TLS/RTP/SAVPF 96\r\nc=IN IP4 0.0.0.0\r\na=mid:{i}\r\na=recvonly\r\na=rtcp-mux\r\n"
                   f"a=rtpmap:96 VP8/90000\r\n" for i in range(sections))
    return ("v=0\r\no=- 1 2 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\na=ice-ufrag:abcd\r\n"
            f"a=ice-pwd:abcdefghijklmnopqrstuvwx\r\na=fingerprint:sha-256 {FINGERPRINT}\r\na=setup:actpass\r\n" + body)


# -- the offer's checks, as units ----------------------------------------------------------------------------


def test_the_candidate_filter_refuses_other_hosts_private_ranges_and_mdns_names():
    client = "127.0.0.1"
    for refused in ("127.0.0.2", "8.8.8.8", "10.1.2.3", "172.16.0.1", "192.168.1.20", "fd00::1", "::1",
                    "4e2f7a1c-0b3d-4c1e-9f00-1234567890ab.local", "printer.local", "example.com", "", "0.0.0.0"):
        assert not candidate_allowed(refused, client), refused
    assert candidate_allowed("127.0.0.1", client)                       # the client's own address
    networks = parse_networks("10.0.0.0/8, fd00::/8")                   # what an operator allows
    assert candidate_allowed("10.1.2.3", client, networks) and candidate_allowed("fd00::1", client, networks)
    assert not candidate_allowed("192.168.1.20", client, networks)
    sdp, removed = screen_offer(offer_sdp([("127.0.0.1", 5000), ("10.1.2.3", 5001), ("x.local", 5002),
                                           ("127.0.0.2", 5003)]), client)
    kept = [line for line in sdp.splitlines() if line.startswith("a=candidate:")]
    assert removed == 3 and len(kept) == 1 and " 127.0.0.1 5000 " in kept[0]
    with pytest.raises(ValueError, match="webrtc_networks"):
        parse_networks("10.0.0.0/8,not-a-network")


def test_an_offer_past_the_bounds_is_refused_by_a_scan_before_any_parse():
    big = bulky_offer(500)
    assert len(big) < webrtc.MAX_SDP_CHARS
    with pytest.raises(ValueError, match="500 media sections"):
        check_offer({"type": "offer", "sdp": big})
    many = offer_sdp([("127.0.0.1", 5000 + i) for i in range(40)])
    with pytest.raises(ValueError, match="40 candidates"):
        check_offer({"type": "offer", "sdp": many})
    assert check_offer({"type": "offer", "sdp": offer_sdp().replace("\r\n", "\n")})        # bare newlines: taken
    for garbage in ("v=0 nonsense", "hello", "v=0\r\nm=audio 9 RTP/AVP 0\r\n"):
        with pytest.raises(ValueError, match="not a session description"):
            check_offer({"type": "offer", "sdp": garbage})


SDP_LINES = st.one_of(
    st.sampled_from(["m=video 9 UDP/TLS/RTP/SAVPF 96", "a=rtpmap:96 VP8/90000", "a=mid:0", "a=recvonly",
                     "a=ice-ufrag:abcd", "c=IN IP4 0.0.0.0", "a=group:BUNDLE 0", "a=setup:actpass",
                     f"a=fingerprint:sha-256 {FINGERPRINT}", "a=candidate:", "m=", "=", "x", "a=rtpmap:"]),
    st.builds(lambda host, port, kind: f"a=candidate:1 1 udp 1 {host} {port} typ {kind}",
              st.sampled_from(["127.0.0.1", "127.0.0.2", "10.0.0.1", "a.local", "::1", "zz", "999.1.1.1"]),
              st.integers(-5, 70000), st.sampled_from(["host", "srflx", "x"])),
    st.text(max_size=30))


@settings(max_examples=300, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(lines=st.lists(SDP_LINES, max_size=25), header=st.booleans())
def test_any_offer_text_is_a_clear_refusal_or_an_offer_whose_every_candidate_is_allowed(lines, header):
    """The fuzzer's WebRTC offer bodies: whatever the text, the checks raise ValueError (answered 400 naming webrtc)
    or give an offer aiortc reads whose every candidate is the client's own address."""
    sdp = "\r\n".join((["v=0"] if header else []) + lines) + "\r\n"
    try:
        offer = check_offer({"type": "offer", "sdp": sdp})
        screened, _ = screen_offer(offer["sdp"], "127.0.0.1")
    except ValueError as e:
        assert str(e).startswith(("webrtc", "webrtc.sdp")), e
        return
    for line in screened.splitlines():
        if line.startswith("a=candidate:"):
            assert line.split()[4] == "127.0.0.1", line


# -- against the server --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("edge"), api_key=(KEY_A, KEY_B), model="tiny-live", workers=1,
                 max_live_seconds=30, limit_concurrency=64, header_read_timeout_s=2.0,
                 request_read_timeout_s=30.0) as s:
        s["ws"] = s["url"].replace("http", "ws", 1) + "/v1/videos/live"
        yield s


def start_live(server, key, **start):
    ws = connect(server["ws"], additional_headers=auth(key), open_timeout=30, max_size=None)
    ws.send(json.dumps({"type": "start", "prompt": "a red ball bouncing", "size": "32x32", "seed": 0, **start}))
    return ws


def events_until(ws, kind, timeout=60):
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(msg, str):
            seen.append(json.loads(msg))
            if seen[-1]["type"] in (kind, "error"):
                return seen
    raise AssertionError(f"no {kind} in {seen}")


@contextlib.contextmanager
def udp_listeners(n: int):
    """UDP sockets on 127.0.0.2 .. 127.0.0.(n+1): where an offer says the client is (it is not)."""
    socks = []
    try:
        for i in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((f"127.0.0.{i + 2}", 0))
            s.setblocking(False)
            socks.append(s)
        yield socks
    finally:
        for s in socks:
            s.close()


def received(socks) -> int:
    n = 0
    for s in socks:
        while True:
            try:
                s.recvfrom(65536)
                n += 1
            except BlockingIOError:
                break
    return n


def test_candidates_at_other_loopback_addresses_get_no_packet_and_the_answer_lists_only_the_address_reached(
        server):
    with udp_listeners(12) as socks:
        candidates = [s.getsockname() for s in socks]
        ws = start_live(server, KEY_A, webrtc={"type": "offer", "sdp": offer_sdp(candidates)})
        try:
            seen = events_until(ws, "webrtc.answer")
            assert seen[-1]["type"] == "webrtc.answer", seen
            answer = seen[-1]["answer"]["sdp"]
            hosts = {line.split()[4] for line in answer.splitlines() if line.startswith("a=candidate:")}
            assert hosts == {"127.0.0.1"}, answer            # no other interface of the server's
            time.sleep(3.0)                                  # ICE would have sent its checks by now
            assert received(socks) == 0
        finally:
            ws.close()


def test_500_media_sections_are_refused_before_admission_and_health_stays_fast_through_a_burst_of_offers(server):
    service = server["service"]
    admitted, screened = [], []
    admit, screen = service.admission.admit, webrtc.screen_offer

    def counting_admit(job, *args, **kwargs):
        admitted.append(job.id)
        return admit(job, *args, **kwargs)

    def counting_screen(*args):
        screened.append(1)
        return screen(*args)

    service.admission.admit, webrtc.screen_offer = counting_admit, counting_screen
    service.admission.max_work_per_key = 2        # one session of a key at a time: the rest refused at admission
    latencies, stop = [], threading.Event()

    def poll_health():
        with httpx.Client(base_url=server["url"], timeout=10) as http:
            while not stop.is_set():
                started = time.monotonic()
                http.get("/health")
                latencies.append(time.monotonic() - started)
                time.sleep(0.02)

    poller = threading.Thread(target=poll_health)
    poller.start()
    sockets = []
    try:
        time.sleep(1.5)                              # the machine's own /health latency, before the burst
        quiet, latencies[:] = list(latencies), []
        big = {"type": "offer", "sdp": bulky_offer(500)}
        fullest = {"type": "offer", "sdp": offer_sdp([("127.0.0.1", 9 + i) for i in range(16)],
                                                     sections=webrtc.MAX_MEDIA_SECTIONS)}
        for i in range(12):
            sockets.append(start_live(server, KEY_A, webrtc=big if i % 2 else fullest))
        answers = [events_until(ws, "webrtc.answer")[-1] for ws in sockets]
        time.sleep(0.5)
    finally:
        stop.set()
        poller.join(10)
        service.admission.admit, webrtc.screen_offer = admit, screen
        service.admission.max_work_per_key = None
        for ws in sockets:
            ws.close()
    refused_big = [a for i, a in enumerate(answers) if i % 2]
    assert all(a["type"] == "error" and a["param"] == "webrtc" and "500 media sections" in a["message"]
               for a in refused_big), refused_big
    assert len(admitted) == 6, "a 500-section offer never reached admission"
    assert [a["type"] for i, a in enumerate(answers) if not i % 2].count("webrtc.answer") == 1
    assert len(screened) == 1, "the SDP of an offer refused at admission was never read"
    print(f"\n/health: slowest {1000 * max(quiet):.0f} ms before the burst, {1000 * max(latencies):.0f} ms "
          f"through it ({len(latencies)} answers)")
    # under 200 ms on a quiet machine; on one loaded past its cores, within 200 ms of what it was before the burst
    assert max(latencies) < 0.2 + max(quiet), (sorted(quiet)[-3:], sorted(latencies)[-5:])


def test_a_garbage_sdp_gets_a_clear_error_naming_webrtc(server):
    for sdp in ("v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\nthis is not sdp\r\n",
                "v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\na=candidate:1 1 udp\r\n",
                "v=0\r\nm=video x\r\n"):
        ws = start_live(server, KEY_A, webrtc={"type": "offer", "sdp": sdp})
        error = events_until(ws, "error")[-1]
        ws.close()
        assert error["type"] == "error" and error["param"] == "webrtc" and "webrtc.sdp" in error["message"], error
        assert "None" not in error["message"] and "list" not in error["message"], error


# -- fair connections ------------------------------------------------------------------------------------------


@pytest.fixture
def slow_steps(monkeypatch):
    """Every denoising step takes 0.2 s more (a running video stays running, cheaply)."""
    from longserve.engine.core import EngineCore

    denoise = EngineCore._denoise

    def slow(self, batch, num_steps):
        time.sleep(0.2)
        return denoise(self, batch, num_steps)

    monkeypatch.setattr(EngineCore, "_denoise", slow)


def test_one_keys_120_event_streams_leave_another_keys_requests_answered_and_end_with_the_job(server,
                                                                                                slow_steps):
    with httpx.Client(base_url=server["url"], headers=auth(KEY_A), timeout=60) as a:
        vid = a.post("/v1/videos", json={"prompt": "a red ball bouncing", "size": "32x32", "num_frames": 24}).json()
        vid = vid["id"]

        async def streams(n):
            async with httpx.AsyncClient(base_url=server["url"], headers=auth(KEY_A), timeout=60,
                                         limits=httpx.Limits(max_connections=n)) as http:
                opening = asyncio.Semaphore(32)          # a client opens them 32 at a time (uvicorn's limit: 64)

                async def one():
                    async with opening:
                        r = await http.send(http.build_request("GET", f"/v1/videos/{vid}/events"), stream=True)
                    try:
                        if r.status_code != 200:
                            return r.status_code, r.headers.get("retry-after"), []
                        names = []
                        async for line in r.aiter_lines():
                            if line.startswith("event: "):
                                names.append(line[7:])
                                if len(names) == 1:
                                    held.append(1)
                        return 200, None, names
                    finally:
                        await r.aclose()

                held = []
                tasks = [asyncio.ensure_future(one()) for _ in range(n)]
                while len(held) + sum(t.done() for t in tasks) < n:
                    await asyncio.sleep(0.05)
                # the other key, while these are held
                async with httpx.AsyncClient(base_url=server["url"], headers=auth(KEY_B), timeout=10) as b:
                    others = [(await b.get("/v1/videos")).status_code for _ in range(10)]
                    others.append((await b.get("/health")).status_code)
                a.delete(f"/v1/videos/{vid}")                # the job ends: so do its streams
                return others, await asyncio.wait_for(asyncio.gather(*tasks), 30)

        others, results = asyncio.run(streams(120))
    cap = server["app"].state.fairness.max_streams
    statuses = [r[0] for r in results]
    assert others == [200] * 11, others
    # (on a machine loaded past its cores, a few of the client's own late requests meet the header deadline: 408)
    assert statuses.count(200) == cap and set(statuses) <= {200, 429, 408}, statuses
    assert statuses.count(429) >= 120 - cap - 10, statuses
    assert all(r[1] for r in results if r[0] == 429)                            # Retry-After
    assert all(r[2][-1] == "video.deleted" for r in results if r[0] == 200)     # they ended with the job
    deadline = time.monotonic() + 5
    while server["app"].state.fairness.open_streams(client_id(KEY_A)):         # every slot given back
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_keys_request_rate_is_a_token_bucket_answered_429_with_retry_after(server):
    fairness = server["app"].state.fairness
    saved = fairness.rate, fairness.burst
    fairness.rate, fairness.burst = 2.0, 5.0
    try:
        with httpx.Client(base_url=server["url"], headers=auth(KEY_A), timeout=10) as a, \
                httpx.Client(base_url=server["url"], headers=auth(KEY_B), timeout=10) as b:
            codes = [a.get("/v1/videos", params={"limit": 1}) for _ in range(12)]
            assert [r.status_code for r in codes[:5]] == [200] * 5
            limited = [r for r in codes if r.status_code == 429]
            assert len(limited) >= 6 and all(r.json()["error"]["code"] == "rate_limited" and
                                             int(r.headers["Retry-After"]) >= 1 for r in limited)
            assert b.get("/v1/videos").status_code == 200                       # another key's own bucket
            time.sleep(1.0)
            assert a.get("/v1/videos").status_code == 200                       # refilled
    finally:
        fairness.rate, fairness.burst = saved


def test_sockets_that_trickle_their_headers_are_cut_by_the_header_deadline(server):
    """70 sockets sending a header line now and then (uvicorn's --limit-concurrency is 64 here): cut at the 2 s
    header deadline, long before the 30 s request deadline; then another client is served."""
    port = int(server["url"].rsplit(":", 1)[1])
    sel, opened, closed = selectors.DefaultSelector(), {}, {}
    for _ in range(70):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setblocking(False)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sel.register(s, selectors.EVENT_READ)
        opened[s] = time.monotonic()
    deadline, next_trickle = time.monotonic() + 8, 0.0
    try:
        while len(closed) < len(opened) and time.monotonic() < deadline:
            if time.monotonic() >= next_trickle:
                for s in opened:
                    if s not in closed:
                        with contextlib.suppress(OSError):
                            s.send(b"X-a: b\r\n")
                next_trickle = time.monotonic() + 0.3
            for key, _ in sel.select(timeout=0.05):
                try:
                    data = key.fileobj.recv(4096)
                except (ConnectionResetError, BlockingIOError):
                    data = b""
                if not data:
                    closed[key.fileobj] = time.monotonic() - opened[key.fileobj]
                    sel.unregister(key.fileobj)
    finally:
        for s in opened:
            s.close()
    assert len(closed) == 70, f"{70 - len(closed)} of 70 slow sockets still open"
    assert max(closed.values()) < 4.0, sorted(closed.values())[-3:]
    assert httpx.get(server["url"] + "/health", timeout=10).status_code == 200


# -- /docs and the page -------------------------------------------------------------------------------------------


def test_docs_are_off_by_default_the_schema_needs_the_key_and_the_page_connects_to_itself_only(server):
    from longserve.server.api.app import create_app
    from tests.server.test_edge import StandInVideos

    url = server["url"]
    assert httpx.get(url + "/docs").status_code == 404
    assert httpx.get(url + "/openapi.json").status_code == 401
    assert httpx.get(url + "/openapi.json", headers=auth(KEY_B)).json()["info"]["title"] == "longserve"
    csp = httpx.get(url + "/ui/").headers["Content-Security-Policy"]
    assert "connect-src 'self';" in csp and "ws:" not in csp
    with TestClient(create_app(StandInVideos(docs=True), api_key="k"), base_url="http://127.0.0.1:8000") as c:
        assert c.get("/docs").status_code == 401
        page = c.get("/docs", headers={"Authorization": "Bearer k"})
        assert page.status_code == 200 and "/v1/videos" in page.text
        assert "<script" not in page.text.lower() and "src=" not in page.text and "https://" not in page.text
        assert page.headers["Content-Security-Policy"].startswith("default-src 'none'")
