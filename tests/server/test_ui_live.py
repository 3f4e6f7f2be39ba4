"""The page's live session in a real headless Chromium against a server on the trained tiny-live: frames are painted
(through MediaSource, from the WebSocket's fMP4 fragments) and are red for "a red ball bouncing"; a switch to "a blue
ball bouncing" applies within two chunks of being sent and the painted frames turn blue; stop ends the stream and
the server's live-session gauge returns to 0; the page shows time to first frame and frames per second; a session
started from an image of a blue ball begins blue, on the page and through the Python API; no console errors. One
browser and one in-process server for the module (tests/support/browser.py); the Python API's test drives that
server's engine."""

from __future__ import annotations

import base64
import json
import logging
import re
import time

import httpx
import numpy as np
import pytest
from browser import Tab, chromium, mostly
from servers import serving
from websockets.sync.client import connect

KEY = "sk-ui-live"


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("data"), poll_after_ms=250, api_key=KEY, model="tiny-live", workers=1,
                 max_live_seconds=30, warm_up=False, log_level="info") as s:
        yield s


class ServerLog(logging.Handler):
    """Every line the in-process server logs (uvicorn's access and error logs, longserve's), as its handlers write
    them (after the filters on those loggers)."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))

    def emit(self, record):
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def server_log(served):
    log, names = ServerLog(), ("uvicorn.access", "uvicorn.error", "longserve")   # (after uvicorn configured them)
    for name in names:
        logging.getLogger(name).addHandler(log)
    yield log
    for name in names:
        logging.getLogger(name).removeHandler(log)


@pytest.fixture(scope="module")
def server(browser, served, server_log):
    return served["url"]


def live_sessions(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(r"^longserve_live_sessions ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_for_colour(tab: Tab, colour: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if mostly(tab.frame("live-video"), colour):
            return True
        time.sleep(0.1)
    return False


def test_a_live_session_paints_red_switches_to_blue_within_two_chunks_and_stops(browser, server, tmp_path):
    """... and, recorded (the page's Record box), it is a video in the history once it ends, whose download is the
    session: its frames red, then blue; the live log lists the newest entry first, numbered as it happened."""
    import imageio.v3 as iio

    tab = Tab(browser, server + "/ui/", KEY)
    page = tab.page
    try:
        tab.ready()
        assert page.is_visible("#live")
        page.fill("#live-form [name=prompt]", "a red ball bouncing")
        page.check("#live-form [name=record]")
        page.click("#live-start")
        page.wait_for_function("window.longserve.live.stats.frames >= 3", timeout=60_000)
        assert live_sessions(server) == 1
        assert wait_for_colour(tab, "red", 20), "the painted frames are not red"
        page.fill("#switch-form [name=prompt]", "a blue ball bouncing")
        page.click("#live-switch")
        # the page's own count runs behind the server's; the engine's promise on taking the switch is the bound
        page.wait_for_function("window.longserve.live.appliedChunk !== null", timeout=30_000)
        page.wait_for_function("window.longserve.live.stats.switchBy !== null", timeout=10_000)
        applied, by = page.evaluate("[window.longserve.live.appliedChunk, window.longserve.live.stats.switchBy]")
        sent_after = page.evaluate("window.longserve.live.stats.switchSentAtChunk")
        assert sent_after < applied <= by, (sent_after, applied, by)
        assert wait_for_colour(tab, "blue", 30), "the painted frames did not turn blue"
        assert page.locator("#live-log .switch").first.text_content().startswith(f"chunk {applied}:")
        assert re.fullmatch(r"\d+\.\d\d s", page.text_content("#live-ttff"))
        assert int(page.text_content("#live-fps")) >= 1
        tab.screenshot("ui_live.png")
        page.click("#live-stop")
        page.wait_for_function("String(window.longserve.live.state).startsWith('ended')", timeout=30_000)
        assert page.text_content("#live-state") == "ended (stopped)"
        deadline = time.monotonic() + 15
        while live_sessions(server) != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert live_sessions(server) == 0
        # the log: newest first, numbered in the order of events (the first, the session's id, is 1)
        numbers = page.eval_on_selector_all("#live-log li", "items => items.map(i => i.value)")
        assert numbers == list(range(len(numbers), 0, -1)), numbers
        assert page.locator("#live-log li").last.text_content().startswith("session live_")
        # recorded: in the history, marked live, downloaded as the session it was
        page.wait_for_function("window.longserve.live.recorded !== null", timeout=30_000)
        recorded = page.evaluate("window.longserve.live.recorded")
        assert recorded == page.evaluate("window.longserve.live.id")
        row = page.locator(f"#recent tr[data-id='{recorded}']")
        row.wait_for(timeout=10_000)
        assert row.locator(".badge").text_content() == "live" and "completed" in row.text_content()
        with page.expect_download(timeout=30_000) as download:
            row.locator("button[data-action=download]").click()
        path = tmp_path / "session.mp4"
        download.value.save_as(path)
        frames = iio.imread(path, extension=".mp4")
        assert len(frames) == page.evaluate("window.longserve.live.stats.framesReceived") >= 3 * 3
        assert mostly(frames[0], "red") and mostly(frames[-1], "blue"), "the recording is the session, switch and all"
        tab.screenshot("ui_live_recorded.png")
        assert tab.errors == []
    finally:
        tab.close()


def test_the_live_panel_stacks_on_a_phone(browser, server):
    """At 390 px: one column, no sideways scroll, the live panel under the video panel (docs/ui_live_phone.png)."""
    tab = Tab(browser, server + "/ui/", KEY, width=390, height=844, phone=True)
    page = tab.page
    try:
        tab.ready()
        page.click("#live-start")
        page.wait_for_function("window.longserve.live.stats.frames >= 3", timeout=60_000)
        layout = tab.layout()
        finite, live = layout["sections"]["finite"], layout["sections"]["live"]
        assert layout["scroll"] <= layout["width"], layout
        assert live[1] >= finite[1] + finite[3] and abs(live[0] - finite[0]) < 1, layout
        assert tab.fields_in_a_grid(), layout["fields"]
        tab.screenshot("ui_live_phone.png")
        page.click("#live-stop")
        page.wait_for_function("String(window.longserve.live.state).startsWith('ended')", timeout=30_000)
        assert tab.errors == []
    finally:
        tab.close()


def test_no_api_key_is_in_the_servers_log_after_the_pages_live_session(server, server_log):
    """(After the page's session above: its socket authenticated in its first message.) The server's log (uvicorn's
    access and WebSocket lines at info, longserve's) has no key, and a key a client puts in a URL is written
    redacted; a socket with one in its URL is refused."""
    httpx.get(server + f"/v1/videos?limit=1&api_key={KEY}")             # a client that puts it in the URL
    with connect(server.replace("http", "ws") + f"/v1/videos/live?api_key={KEY}", open_timeout=30) as ws:
        refused = json.loads(ws.recv(timeout=30))
    assert refused["code"] == "invalid_api_key" and refused["param"] == "api_key"
    text = "\n".join(server_log.lines)
    assert '"WebSocket /v1/videos/live' in text and "api_key=[redacted]" in text, text[-2000:]
    assert KEY not in text


def test_a_webrtc_session_paints_red_switches_to_blue_and_shows_its_latency(browser, server):
    """The same session over WebRTC (aiortc's track; the socket carries the offer, the answer and the events)."""
    tab = Tab(browser, server + "/ui/", KEY)
    page = tab.page
    try:
        tab.ready()
        page.select_option("#live-form [name=transport]", "webrtc")
        page.click("#live-start")
        page.wait_for_function("window.longserve.live.stats.frames >= 3", timeout=60_000)
        assert page.evaluate("window.longserve.live.stats.transport") == "webrtc"
        assert page.evaluate("document.getElementById('live-video').srcObject !== null")     # the track, not MSE
        assert wait_for_colour(tab, "red", 20), "the painted frames are not red"
        page.click("#live-switch")
        sent_after = page.evaluate("window.longserve.live.stats.switchSentAtChunk")
        page.wait_for_function("window.longserve.live.appliedChunk !== null", timeout=30_000)
        page.wait_for_function("window.longserve.live.stats.switchBy !== null", timeout=10_000)
        applied, by = page.evaluate("[window.longserve.live.appliedChunk, window.longserve.live.stats.switchBy]")
        assert sent_after < applied <= by, (sent_after, applied, by)
        assert wait_for_colour(tab, "blue", 30), "the painted frames did not turn blue"
        page.wait_for_function("window.longserve.live.stats.latencies.length > 0", timeout=10_000)
        assert re.fullmatch(r"\d+ ms \(webrtc\)", page.text_content("#live-latency"))
        page.click("#live-stop")
        page.wait_for_function("String(window.longserve.live.state).startsWith('ended')", timeout=30_000)
        assert tab.errors == []
    finally:
        tab.close()
    deadline = time.monotonic() + 15
    while live_sessions(server) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_sessions(server) == 0


def blue_ball() -> np.ndarray:
    """A blue ball on mid grey (the trained models' background), tiny-live's size: (64, 64, 3) uint8."""
    image = np.full((64, 64, 3), 128, np.uint8)
    yy, xx = np.mgrid[:64, :64]
    image[(yy - 24) ** 2 + (xx - 32) ** 2 <= 64] = (0, 0, 255)
    return image


def test_a_session_starts_from_an_image_chosen_on_the_page_and_bad_starts_are_refused_naming_the_field(
        browser, server, tmp_path):
    """The page sends the chosen image in the start message (`input_reference`, a data URL): the session begins
    with the image's frame, so the first painted frame (media time 0, as the page kept it: it is on screen for 1/8 s)
    is blue, and the frames after it red for "a red ball bouncing" (tiny-live draws the prompt's colour). A start
    message whose image is not one is refused with the error event naming input_reference, before any worker; one
    whose WebRTC offer cannot be answered, naming webrtc."""
    from PIL import Image

    png = tmp_path / "blue_ball.png"
    Image.fromarray(blue_ball()).save(png)
    tab = Tab(browser, server + "/ui/", KEY)
    page = tab.page
    try:
        tab.ready()
        assert page.is_visible("#live [name=image]")                 # the causal family takes a start image
        page.fill("#live-form [name=prompt]", "a red ball bouncing")
        page.set_input_files("#live [name=image]", str(png))
        page.click("#live-start")
        page.wait_for_function("window.longserve.live.stats.frames >= 3", timeout=60_000)
        first, media_time = tab.first_live_frame()
        assert media_time == 0 and mostly(first, "blue"), media_time
        assert wait_for_colour(tab, "red", 20), "the frames after the image's are not red"
        page.click("#live-stop")
        page.wait_for_function("String(window.longserve.live.state).startsWith('ended')", timeout=30_000)
        assert tab.errors == []
    finally:
        tab.close()
    auth = {"Authorization": f"Bearer {KEY}"}
    with connect(server.replace("http", "ws") + "/v1/videos/live", open_timeout=30, additional_headers=auth) as ws:
        bad = "data:image/png;base64," + base64.b64encode(b"not a png").decode()
        ws.send(json.dumps({"type": "start", "prompt": "a red ball", "input_reference": bad}))
        event = json.loads(ws.recv(timeout=30))
    assert event["type"] == "error" and event["param"] == "input_reference", event
    with connect(server.replace("http", "ws") + "/v1/videos/live", open_timeout=30, additional_headers=auth) as ws:
        offer = {"type": "offer", "sdp": "v=0 nonsense"}
        ws.send(json.dumps({"type": "start", "prompt": "a red ball", "webrtc": offer}))
        event = json.loads(ws.recv(timeout=30))
    assert event["type"] == "error" and event["param"] == "webrtc", event        # not a session description
    time.sleep(0.5)
    assert live_sessions(server) == 0                                   # refused before any admission


def test_a_python_session_from_a_blue_ball_image_begins_blue_and_goes_on_red(served):
    """`pipe.live(prompt, image=...)` on the trained tiny-live (the Python API over this module's server's engine):
    chunk 0 begins with the image's frame, blue; the frames made after it are red for "a red ball bouncing"."""
    from longserve.pipelines import VideoPipeline

    pipe = VideoPipeline(served["service"].engine)          # the server's: closed with it, not here
    with pipe.live("a red ball bouncing", seconds=2.0, seed=0, image=blue_ball()) as session:
        chunks = [(np.asarray(c.frames) * 255).round().astype(np.uint8) for c in session]
    assert len(chunks[0]) == 1 + 3 and sum(map(len, chunks)) == 16     # 2 s at 8 fps: the image's frame included
    assert mostly(chunks[0][0], "blue")
    assert all(mostly(f, "red") for f in np.concatenate(chunks)[1:])
