"""A real headless Chromium for the page's tests (Playwright for Python driving Debian's `chromium`), and what the
tests read of the pixels it paints.

Playwright's own browser download is not used: the system browser is launched by its path. Where either is missing
the tests skip, saying how to get them (`make install` installs Playwright; `.ci/run` installs chromium).
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from content import as_float_clip, object_mask

from tools.weights.prompts import PALETTE

ROOT = Path(__file__).resolve().parents[2]
HOW = ("needs Chromium and Playwright for Python: `apt-get install -y chromium` (as root; .ci/run does it) and "
       "`make install` (the test extra pins playwright); then rerun this file")
#: where the tests save screenshots; docs/ui_*.png (README.md, docs/serving.md) are copies: `make screenshots`
SCREENSHOTS = ROOT / "out" / "ui"
# what the page draws a video frame to, as the tests read it: the <video>'s current frame on a canvas, as PNG
FRAME_PNG = """(id) => { const v = document.getElementById(id); if (!v.videoWidth) return null;
  const c = document.createElement('canvas'); c.width = v.videoWidth; c.height = v.videoHeight;
  c.getContext('2d').drawImage(v, 0, 0); return c.toDataURL('image/png'); }"""


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@contextlib.contextmanager
def chromium():
    """One headless Chromium (the module's: share it); skips with HOW when there is none."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(f"Playwright for Python is not installed: {HOW}")
    path = chromium_path()
    if path is None:
        pytest.skip(f"no chromium on PATH: {HOW}")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=["--autoplay-policy=no-user-gesture-required",
                                                                "--disable-gpu", "--mute-audio"])
        try:
            yield browser
        finally:
            browser.close()


class Tab:
    """A page in its own browser context (its own sessionStorage), with `key` kept for the tab (as the page keeps
    what a user typed: sessionStorage) before it loads, and every console error and page exception kept
    (`errors`). `type_key`: typed into the page's key field after it loaded instead, as a user would."""

    def __init__(self, browser, url: str, key: str | None = None, type_key: str | None = None,
                 width: int = 1280, height: int = 800, phone: bool = False):
        # bypass_csp: Playwright's wait_for_function evaluates strings, which the page's CSP (no eval) refuses;
        # a phone (390 px wide) is a touch screen that scales as one does
        self.context = browser.new_context(bypass_csp=True, viewport={"width": width, "height": height},
                                           **({"is_mobile": True, "has_touch": True, "device_scale_factor": 2}
                                              if phone else {}))
        if key is not None:
            self.context.add_init_script(f"sessionStorage.setItem('longserve.api_key', {json.dumps(key)})")
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"exception: {e}"))
        self.page.goto(url)
        if type_key is not None:
            self.page.fill("#api-key", type_key)
            self.page.press("#api-key", "Enter")

    def ready(self, timeout_ms: float = 30_000) -> None:
        self.page.wait_for_selector("body[data-ready=true]", timeout=timeout_ms)

    def frame(self, video_id: str) -> np.ndarray | None:
        """The <video>'s current frame, drawn to a canvas: (H, W, 3) uint8, or None before the first frame."""
        url = self.page.evaluate(FRAME_PNG, video_id)
        return None if url is None else png_pixels(url)

    def screenshot(self, name: str) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / name
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def first_live_frame(self) -> tuple[np.ndarray | None, float | None]:
        """The live panel's first painted frame, as the page kept it when it painted it (on screen for 1/fps only),
        and its media time: ((H, W, 3) uint8, seconds), or (None, None) before it."""
        first = self.page.evaluate("() => { const f = window.longserve.live.stats.firstFrame; "
                                   "return f ? [f.canvas.toDataURL('image/png'), f.mediaTime] : null; }")
        return (None, None) if first is None else (png_pixels(first[0]), first[1])

    def layout(self) -> dict:
        """What a layout check reads: the page's width against the viewport's (no sideways scroll), each visible
        section's box and each settings field's box ([left, top, width, height])."""
        return self.page.evaluate("""() => {
            const box = (el) => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; };
            return {scroll: document.documentElement.scrollWidth, width: window.innerWidth,
                    sections: Object.fromEntries([...document.querySelectorAll('main > section')]
                        .filter((s) => !s.hidden).map((s) => [s.id, box(s)])),
                    fields: [...document.querySelectorAll('#create .fields label')].map((l) => box(l))}; }""")

    def fields_in_a_grid(self) -> bool:
        """The form's settings sit in full rows of equal cells, one line each: not a ragged wrap."""
        boxes = self.layout()["fields"]
        columns = sum(1 for b in boxes if abs(b[1] - boxes[0][1]) < 1)
        lefts = sorted({round(b[0]) for b in boxes})
        heights = {round(b[3]) for b in boxes}
        return len(boxes) % columns == 0 and len(lefts) == columns and len(heights) == 1

    def close(self) -> None:
        self.context.close()


def png_pixels(data_url: str) -> np.ndarray:
    """A PNG data URL's pixels: (H, W, 3) uint8."""
    import imageio.v3 as iio

    return iio.imread(base64.b64decode(data_url.split(",", 1)[1]), extension=".png")[..., :3]


def colour_share(frame: np.ndarray, colour: str) -> tuple[float, int]:
    """Of a frame's object pixels (far from its median, the grey background: content.object_mask), the share whose
    nearest palette colour is `colour`, and how many object pixels there are."""
    clip = as_float_clip(frame[None])
    mask = object_mask(clip)[0]
    pixels = clip[0][mask]
    if not len(pixels):
        return 0.0, 0
    names = list(PALETTE)
    rgb = np.array([PALETTE[n] for n in names])
    nearest = np.linalg.norm(pixels[:, None, :] - rgb[None], axis=-1).argmin(axis=1)
    return float((nearest == names.index(colour)).mean()), int(len(pixels))


def mostly(frame: np.ndarray | None, colour: str, share: float = 0.6, min_pixels: int = 16) -> bool:
    if frame is None:
        return False
    s, n = colour_share(frame, colour)
    return n >= min_pixels and s >= share
