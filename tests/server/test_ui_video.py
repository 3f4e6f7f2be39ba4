"""The page (/ui) in a real headless Chromium against a server on the trained tiny-latte: it makes a video whose
progress reaches 100, whose <video> plays (its currentTime advances) and whose painted frame is mostly red for "a red
ball bouncing"; the recent list deletes it; a wrong key shows the server's 401 message; no console errors. One
browser and one in-process server for the module (tests/support/browser.py)."""

from __future__ import annotations

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
        page.fill("#create [name=prompt]", "a red ball bouncing")
        page.fill("#create [name=num_inference_steps]", "6")
        page.fill("#create [name=seed]", "0")
        page.click("#generate")
        page.wait_for_function("document.getElementById('progress').value >= 100", timeout=90_000)
        assert page.text_content("#progress-text") == "completed"
        page.wait_for_function("document.getElementById('video').currentTime > 0.1", timeout=20_000)
        first = page.evaluate("document.getElementById('video').currentTime")
        red, deadline = [], time.monotonic() + 10
        while time.monotonic() < deadline and len(red) < 3:
            red.append(mostly(tab.frame("video"), "red"))
            time.sleep(0.15)
        assert page.evaluate("document.getElementById('video').currentTime") != first, "the video does not play"
        assert any(red), "no painted frame is mostly red"
        tab.screenshot("ui_video.png")
        video_id = page.evaluate("window.longserve.current.id")
        row = page.locator(f"#recent tr[data-id='{video_id}']")
        assert "completed" in row.text_content()
        row.locator("button[data-action=delete]").click()
        page.wait_for_selector(f"#recent tr[data-id='{video_id}']", state="detached", timeout=10_000)
        gone = httpx.get(f"{server}/v1/videos/{video_id}", headers={"Authorization": f"Bearer {KEY}"})
        assert gone.status_code == 404
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
