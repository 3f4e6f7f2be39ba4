"""`longserve bench live-latency`: a live session's engine -> painted latency in Chromium, over the WebSocket's fMP4
fragments and over WebRTC, measured in one run (docs/benchmarks.md, "Live video in the browser").

    longserve bench live-latency [--model tiny-live] [--workers 1] [--chunks 16] [--rounds 2] \\
        [--paths fmp4,webrtc] [--json out.json]

One server in this process (`VideoService` behind uvicorn, on the CPU, no warm-up) and one headless Chromium
(Debian's `chromium`, driven by Playwright for Python: `make install`'s test extra or the bench extra) on the
server's page (`/ui`). The paths take turns, `--rounds` sessions of `--chunks` chunks each, so a busy spell of a
shared machine falls on both alike. For every chunk the page takes the time from the chunk leaving the engine (the
chunk event's `t`, taken when the server's live sink receives it) to its first frame's expected display time
(`requestVideoFrameCallback`); both clocks are this machine's. The first two chunks of a session (start-up) are left
out of the latency and reported as the time to first frame (Start to the first painted frame). Per path: chunks
measured, median and p90 latency, the median time to first frame, every latency (JSON), the machine and the load
average before and after.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time

from tools.bench import util as benchutil

PATHS = {"fmp4": "fMP4 fragments on the WebSocket, MediaSource", "webrtc": "WebRTC track (aiortc, VP8)"}
HOW = ("needs Playwright for Python and Chromium: `pip install 'longserve[bench]'` (or `make install`) and "
       "`apt-get install -y chromium`")


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="tiny-live", help="a causal model (default: tiny-live)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--chunks", type=int, default=16, help="least chunks a session (the first 2 left out)")
    parser.add_argument("--rounds", type=int, default=2, help="sessions per path")
    parser.add_argument("--paths", default="fmp4,webrtc", help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--chromium", default=None, help="the browser's executable (default: chromium on PATH)")
    parser.add_argument("--json", default=None, metavar="PATH")


def check(args) -> None:
    """What can be refused before the model loads: the numbers, the paths, the browser and Playwright."""
    for name in ("workers", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1; got {getattr(args, name)}")
    if args.chunks < 3:
        raise ValueError(f"--chunks must be at least 3 (the first two are start-up); got {args.chunks}")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or set(paths) - set(PATHS):
        raise ValueError(f"--paths: expected some of {', '.join(PATHS)}; got {args.paths!r}")
    args.path_list = paths
    args.chromium = args.chromium or shutil.which("chromium") or shutil.which("chromium-browser")
    if args.chromium is None:
        raise ValueError(f"no chromium on PATH: {HOW}")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        raise ValueError(f"Playwright for Python is not installed: {HOW}") from None


def session(page, path: str, chunks: int) -> tuple[list[float], float]:
    """One session on the page over `path`: (latency ms of chunks 2.., time to first frame ms)."""
    page.select_option("#live-form [name=transport]", path)
    page.click("#live-start")
    page.wait_for_function(f"window.longserve.live.stats.chunks >= {chunks}", timeout=600_000)
    time.sleep(1.0)                                       # the last chunks painted
    latencies = page.evaluate("window.longserve.live.stats.chunkList.filter(c => c.index >= 2 && c.latencyMs !== "
                              "undefined).map(c => c.latencyMs)")
    ttff = page.evaluate("window.longserve.live.stats.firstFrameMs")
    page.click("#live-stop")
    page.wait_for_function("String(window.longserve.live.state).startsWith('ended') || "
                           "String(window.longserve.live.state).startsWith('closed')", timeout=60_000)
    return latencies, ttff


def summary(path: str, latencies: list[float], ttffs: list[float]) -> dict:
    ordered = sorted(latencies)
    return {"path": path, "what": PATHS[path], "chunks_measured": len(ordered),
            "median_ms": round(statistics.median(ordered), 1) if ordered else None,
            "p90_ms": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 1) if ordered else None,
            "ttff_ms": round(statistics.median(ttffs), 1) if ttffs else None,
            "latencies_ms": [round(v, 1) for v in latencies], "ttffs_ms": [round(v, 1) for v in ttffs]}


def run(args) -> int:
    if not hasattr(args, "path_list"):
        check(args)
    from playwright.sync_api import sync_playwright

    from longserve.server.api.app import create_app, serve_in_thread
    from longserve.server.api.service import ServeConfig, VideoService

    measured = {p: ([], []) for p in args.path_list}
    load_before = benchutil.load_average()
    with tempfile.TemporaryDirectory() as data:
        service = VideoService(ServeConfig.from_options(model=args.model, workers=args.workers, device="cpu",
                                                        warm_up=False, data_dir=data)).start()
        try:
            with serve_in_thread(create_app(service)) as url, sync_playwright() as p:
                browser = p.chromium.launch(executable_path=args.chromium,
                                            args=["--autoplay-policy=no-user-gesture-required", "--mute-audio"])
                try:
                    page = browser.new_page(bypass_csp=True)   # wait_for_function evaluates strings: no eval in CSP
                    page.goto(url + "/ui/")
                    page.wait_for_selector("body[data-ready=true]")
                    if not page.is_visible("#live"):
                        raise ValueError(f"{args.model} has no live sessions (not a causal model)")
                    for r in range(args.rounds):
                        for path in args.path_list:
                            print(f"round {r + 1}/{args.rounds}: {path}", file=sys.stderr)
                            latencies, ttff = session(page, path, args.chunks)
                            measured[path][0].extend(latencies)
                            measured[path][1].append(ttff)
                finally:
                    browser.close()
        finally:
            service.close()
    context = {"model": args.model, "workers": args.workers, "chunks": args.chunks, "rounds": args.rounds,
               "machine": benchutil.machine_info("cpu"), "load_before": load_before,
               "load_after": benchutil.load_average()}
    rows = [{**summary(path, *measured[path]), **context} for path in args.path_list]
    print(benchutil.text_table(rows, [("path", "what"), ("chunks measured", "chunks_measured"),
                                      ("median ms", "median_ms"), ("p90 ms", "p90_ms"),
                                      (f"time to first frame ms (median of {args.rounds})", "ttff_ms")]))
    print(f"load average before {load_before}, after {context['load_after']}")
    if args.json:
        benchutil.write_json(rows, args.json)
    return 0
