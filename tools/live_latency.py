"""Engine -> painted latency of a live session in Chromium, over the WebSocket's fMP4 fragments and over WebRTC,
measured in one run (docs/benchmarks.md, "Live video in the browser"):

    python -m tools.live_latency [--model tiny-live] [--chunks 24] [--rounds 2] [--workers 1]

A dev script (needs the test extra's Playwright and Debian's chromium). One server (in this process) and one browser;
the paths take turns, `--rounds` sessions each. For every chunk the page takes the time from the chunk leaving the
engine (the chunk event's `t`, taken when the server's live sink receives it) to its first frame being painted
(`requestVideoFrameCallback`'s expected display time); both clocks are this machine's. The first two chunks of a
session (start-up) are left out.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time


def session(page, transport: str, chunks: int) -> tuple[list[float], float]:
    page.select_option("#live-form [name=transport]", transport)
    page.click("#live-start")
    page.wait_for_function(f"window.longserve.live.stats.chunks >= {chunks}", timeout=600_000)
    time.sleep(1.0)                                       # the last chunks painted
    lat = page.evaluate("window.longserve.live.stats.chunkList.filter(c => c.index >= 2 && c.latencyMs !== "
                        "undefined).map(c => c.latencyMs)")
    ttff = page.evaluate("window.longserve.live.stats.firstFrameMs")
    page.click("#live-stop")
    page.wait_for_function("String(window.longserve.live.state).startsWith('ended') || "
                           "String(window.longserve.live.state).startsWith('closed')", timeout=60_000)
    return lat, ttff


def main(argv=None) -> int:
    from playwright.sync_api import sync_playwright

    from longserve.server.api.app import create_app, serve_in_thread
    from longserve.server.api.service import ServeConfig, VideoService

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-live")
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args(argv)
    results = {"fmp4": ([], []), "webrtc": ([], [])}
    with tempfile.TemporaryDirectory() as data:
        service = VideoService(ServeConfig.from_options(model=args.model, workers=args.workers, device="cpu",
                                                        warm_up=False, data_dir=data)).start()
        try:
            with serve_in_thread(create_app(service)) as url, sync_playwright() as p:
                browser = p.chromium.launch(executable_path=shutil.which("chromium"),
                                            args=["--autoplay-policy=no-user-gesture-required"])
                page = browser.new_page(bypass_csp=True)
                page.goto(url + "/ui/")
                page.wait_for_selector("body[data-ready=true]")
                for _ in range(args.rounds):
                    for transport in ("fmp4", "webrtc"):
                        lat, ttff = session(page, transport, args.chunks)
                        results[transport][0].extend(lat)
                        results[transport][1].append(ttff)
                browser.close()
        finally:
            service.close()
    print(f"| path | chunks measured | median ms | p90 ms | time to first frame ms (median of {args.rounds}) |")
    print("| --- | --- | --- | --- | --- |")
    for transport, (lat, ttffs) in results.items():
        lat = sorted(lat)
        p90 = lat[min(len(lat) - 1, int(0.9 * len(lat)))] if lat else float("nan")
        med = statistics.median(lat) if lat else float("nan")
        print(f"| {transport} | {len(lat)} | {med:.0f} | {p90:.0f} | {statistics.median(ttffs):.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
