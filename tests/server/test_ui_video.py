"""The page (/ui) in a real headless Chromium against a server on the trained tiny-latte: it makes a video whose
progress reaches 100, whose <video> plays (its currentTime advances) and whose painted frame is mostly red for "a red
ball bouncing"; its progress line and its history row show one progress state (stage, elapsed, ETA); the form's
settings are the model's; the history has thumbnails and pages; the layout has no sideways scroll and no wrapped
row of settings at 1280 px, and stacks on a 390 px phone; the history deletes it; a wrong key shows the server's
401 message; no console errors. One browser and one in-process server for the module (tests/support/browser.py)."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from browser import Tab, chromium, mostly
from servers import serving

KEY = "sk-ui-test"
UNAUTHORIZED = "the server responded with a status of 401"


@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture(scope="module")
def server(browser, tmp_path_factory):
    with serving(tmp_path_factory.mktemp("data"), poll_after_ms=250, api_key=KEY, model="tiny-latte", workers=1,
                 warm_up=False) as s:
        yield s["url"]


def test_the_page_makes_a_red_ball_video_that_plays_and_the_recent_list_deletes_it(browser, server):
    tab = Tab(browser, server + "/", KEY)               # / redirects to /ui/
    page = tab.page
    try:
        tab.ready()
        assert page.url == server + "/ui/"
        assert page.text_content("#model").startswith("tiny-latte")
        assert page.is_hidden("#live") and page.is_hidden("[name=input_reference]")    # latte: no live, no image
        # the model's settings (GET /v1/models/{model}'s defaults) are what an empty field gets
        placeholders = {n: page.get_attribute(f"#create [name={n}]", "placeholder")
                        for n in ("size", "length", "fps", "num_inference_steps", "guidance_scale")}
        assert placeholders == {"size": "64x64", "length": "2", "fps": "8", "num_inference_steps": "25",
                                "guidance_scale": "7.5"}, placeholders
        page.select_option("#create [name=length_unit]", "num_frames")
        assert page.get_attribute("#create [name=length]", "placeholder") == "16"
        page.fill("#create [name=prompt]", "a red ball bouncing")
        page.fill("#create [name=num_inference_steps]", "24")
        page.fill("#create [name=seed]", "0")
        # one progress state: while it denoises, its history row says what the progress line says. Seen by a
        # MutationObserver (after every DOM change: each SSE event is a task of its own), not by polling a
        # moment that a loaded machine can render past (the row appears after one listing round trip)
        page.evaluate("""() => { window.__rowMatched = null;
            new MutationObserver(() => {
                const p = document.getElementById('progress-text').textContent;
                const id = window.longserve.current && window.longserve.current.id;
                const row = id && document.querySelector(`#recent tr[data-id="${id}"] td.status`);
                if (p.startsWith('step ') && row && row.textContent.startsWith(p + ' · ')) {
                    window.__rowMatched = window.__rowMatched || {
                        p, time: document.getElementById('progress-time').textContent };
                }
            }).observe(document.body, { subtree: true, childList: true, characterData: true }); }""")
        page.click("#generate")
        page.wait_for_function("document.getElementById('progress').value >= 100", timeout=90_000)
        matched = page.evaluate("window.__rowMatched")
        assert matched, "the history row never said what the progress line said while it denoised"
        assert re.fullmatch(r"\d+(\.\d)? s( · about \d+(\.\d)? s left)?", matched["time"]), matched
        assert page.text_content("#progress-text") == "completed"
        video_id = page.evaluate("window.longserve.current.id")
        done = page.text_content("#progress-time")
        assert re.fullmatch(r"in \d+(\.\d)? s", done), done
        page.wait_for_function(f"""() => {{
            const r = document.querySelector('#recent tr[data-id="{video_id}"] td.status');
            return r && r.textContent === 'completed · {done}'; }}""", timeout=10_000)
        page.wait_for_function("document.getElementById('video').currentTime > 0.1", timeout=20_000)
        first = page.evaluate("document.getElementById('video').currentTime")
        red, deadline = [], time.monotonic() + 10
        while time.monotonic() < deadline and len(red) < 3:
            red.append(mostly(tab.frame("video"), "red"))
            time.sleep(0.15)
        assert page.evaluate("document.getElementById('video').currentTime") != first, "the video does not play"
        assert any(red), "no painted frame is mostly red"
        page.wait_for_function(f"""() => {{ const i = document.querySelector('#recent tr[data-id="{video_id}"] img');
            return i && i.src.startsWith('blob:') && i.naturalWidth === 64; }}""", timeout=10_000)   # its thumbnail
        layout = tab.layout()
        assert layout["scroll"] <= layout["width"], layout
        assert tab.fields_in_a_grid(), f"the settings wrap raggedly at 1280 px: {layout['fields']}"
        finite, history = layout["sections"]["finite"], layout["sections"]["history"]
        assert abs(history[1] - finite[1]) < 1 and history[0] > finite[0] + finite[2], "side by side at 1280 px"
        tab.screenshot("ui_video.png")
        row = page.locator(f"#recent tr[data-id='{video_id}']")
        assert "completed" in row.text_content()
        row.locator("button[data-action=delete]").click()
        page.wait_for_selector(f"#recent tr[data-id='{video_id}']", state="detached", timeout=10_000)
        gone = httpx.get(f"{server}/v1/videos/{video_id}", headers={"Authorization": f"Bearer {KEY}"})
        assert gone.status_code == 404
        assert tab.errors == []
    finally:
        tab.close()


def test_the_history_pages_and_the_page_stacks_on_a_phone(browser, server):
    """Eleven more videos than a page holds: "older" shows the rest, "newer" comes back; at 390 px the panels stack
    and nothing scrolls sideways (docs/ui_video_phone.png)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    for i in range(11):
        r = httpx.post(server + "/v1/videos", headers=auth, json={"prompt": f"a blue square moving left {i}",
                                                                  "num_frames": 1, "num_inference_steps": 1})
        assert r.status_code == 200, r.text
    tab = Tab(browser, server + "/ui/", KEY, width=390, height=844, phone=True)
    page = tab.page
    try:
        tab.ready()
        page.wait_for_selector("#recent tbody tr", timeout=10_000)
        first = page.eval_on_selector_all("#recent tbody tr", "rows => rows.map(r => r.dataset.id)")
        assert len(first) == 10 and page.is_enabled("#older") and not page.is_enabled("#newer")
        page.click("#older")
        page.wait_for_function("document.getElementById('page-info').textContent === 'page 2'", timeout=10_000)
        second = page.eval_on_selector_all("#recent tbody tr", "rows => rows.map(r => r.dataset.id)")
        assert second and not set(second) & set(first)
        page.click("#newer")
        page.wait_for_function("document.getElementById('page-info').textContent === 'page 1'", timeout=10_000)
        layout = tab.layout()
        finite, history = layout["sections"]["finite"], layout["sections"]["history"]
        assert layout["scroll"] <= layout["width"], layout
        assert history[1] >= finite[1] + finite[3] and abs(history[0] - finite[0]) < 1, "stacked, one column"
        assert finite[2] <= 390 - 2 * 4 and tab.fields_in_a_grid(), layout
        tab.screenshot("ui_video_phone.png")
        assert tab.errors == []
    finally:
        tab.close()


def test_a_wrong_key_shows_the_servers_401_message(browser, server):
    tab = Tab(browser, server + "/ui/", type_key="sk-wrong")
    try:
        tab.page.wait_for_selector("#error:not([hidden])", timeout=10_000)
        assert tab.page.get_attribute("#error", "data-status") == "401"
        assert "missing or wrong API key" in tab.page.text_content("#error")
        assert tab.page.evaluate("sessionStorage.getItem('longserve.api_key')") == "sk-wrong"   # kept for the tab
        # the browser logs every failed load; the 401s are what this test asks for, anything else is an error
        assert [e for e in tab.errors if UNAUTHORIZED not in e] == []
    finally:
        tab.close()


def test_the_page_is_same_origin_only_and_serves_no_other_file(server):
    page = httpx.get(server + "/ui/")
    assert page.status_code == 200 and "default-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(server + "/ui/../pyproject.toml").status_code == 404
    assert httpx.get(server + "/ui/__init__.py").status_code == 404
    model = httpx.get(server + "/v1/models/tiny-latte")
    assert model.status_code == 401                     # the capabilities are the API's: the key is needed
    # a start image where the checkpoint cannot take one: refused naming the field, before any worker
    refused = httpx.post(server + "/v1/videos", headers={"Authorization": f"Bearer {KEY}"},
                         json={"prompt": "a red ball", "input_reference": {"image_url": "data:image/png;base64,AA=="}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input_reference"
