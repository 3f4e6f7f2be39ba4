"""`longserve bench serve --concurrency 1,4,16 [--workers 2] [--json out.json]`: the HTTP server under load.

Starts `longserve serve` on a free local port (or uses `--url`), then sends the same
`--requests` videos at each concurrency level: `c` clients, each creating a video and
waiting for it on its SSE stream before creating the next. Concurrency 1 always runs
first: it is the one-at-a-time baseline the other levels are compared with, in the same
run. Per level: videos per minute, p50/p95 latency (create -> completed), mean denoising
batch size (from the server's /metrics), and the speedup over one at a time.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time

COLUMNS = [
    ("concurrency", "concurrency"),
    ("requests", "requests"),
    ("completed", "completed"),
    ("wall s", "wall_s", ".2f"),
    ("videos/min", "videos_per_min", ".1f"),
    ("p50 latency s", "p50_s", ".2f"),
    ("p95 latency s", "p95_s", ".2f"),
    ("mean batch", "mean_batch", ".2f"),
    ("mean step ms", "step_ms", ".1f"),
    ("speedup vs 1-at-a-time", "speedup", ".2f"),
]


def add_arguments(p) -> None:
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts (1 is always run first)")
    p.add_argument("--requests", type=int, default=None, help="videos per level (default: the largest concurrency)")
    p.add_argument("--url", default=None, help="bench this running server instead of starting one")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default="tiny-latte")
    p.add_argument("--dtype", default=None, help="server --dtype (default: the server's)")
    p.add_argument("--workers", type=int, default=None,
                   help="server workers (default: 2 on CPU; with CUDA, 2 or the GPU count if fewer)")
    p.add_argument("--parallel", default="auto")
    p.add_argument("--max-batch", type=int, default=None, help="server --max-batch (default: the largest concurrency)")
    p.add_argument("--steps", type=int, default=20, help="num_inference_steps of every request")
    p.add_argument("--size", default="64x64")
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--interference", action="store_true",
                   help="instead: a long video's denoising rate alone and while another video's MP4 is encoded "
                        "and streamed, and the latency of GET /health and GET /v1/videos/{id} meanwhile")
    p.add_argument("--encode-size", default="256x256", help="--interference: size of the video being encoded")
    p.add_argument("--encode-frames", type=int, default=97, help="--interference: frames of the video being encoded")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--docs", default=None, help="replace the '## Serving (bench serve)' section of this markdown file")


def run(args) -> int:
    if args.workers is None:
        import torch

        args.workers = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2
    from longserve.server.api.protocol import parse_size
    from tools.bench.util import int_list, load_average, machine_info, text_table, write_json

    levels = int_list(args.concurrency, "--concurrency")
    if levels[0] != 1:
        levels = [1] + [c for c in levels if c != 1]
    n = args.requests or max(levels)
    body = {"size": args.size, "num_frames": args.frames, "num_inference_steps": args.steps}
    load_before = load_average()
    server = None
    url = args.url
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if url is None:
            extra = (["--decode-chunk-frames", str(args.encode_frames), "--max-steps", "1000", "--max-frames",
                      str(args.encode_frames), "--max-size", str(max(parse_size(args.encode_size)))]
                     if args.interference else [])
            server = start_server(args, max_batch=args.max_batch or max(levels), extra=extra)
            url = server.url
        if args.interference:
            return _report_interference(args, measure_interference(url, body, args, say), load_before)
        rows = measure(url, levels, n, body, api_key=args.api_key, progress=say)
    finally:
        if server is not None:
            server.stop()
    print(text_table(rows, COLUMNS))
    meta = {"machine": machine_info(_server_device(args)), "load_average": load_before,
            "command": "longserve " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    if args.json:
        write_json([dict(r, **meta) for r in rows], args.json)
    if args.docs:
        write_docs_section(args.docs, rows, args, meta)
    return 0


# -- measuring ------------------------------------------------------------------------------------------------


def measure(url: str, levels: list[int], n_requests: int, body: dict, api_key: str | None = None,
            timeout_s: float = 600.0, progress=None) -> list[dict]:
    """Send n_requests of the same work at each concurrency level; one row per level (see the module docstring).
    Each level's seeds are its own: a server reuses the video of an identical seeded request
    (--reuse-completed), and a level that repeated the last one's would measure no generation."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rows = []
    with httpx.Client(base_url=url, headers=headers, timeout=30) as admin:
        for level, c in enumerate(levels):
            requests = [dict(body, prompt=f"a red ball bouncing, take {i}", seed=level * n_requests + i)
                        for i in range(n_requests)]
            before = _step_counters(admin)
            results = _run_level(url, headers, requests, c, timeout_s)
            after = _step_counters(admin)
            wall = max(r["done_at"] for r in results) - min(r["sent_at"] for r in results)
            ok = [r for r in results if r["status"] == "completed"]
            lat = sorted(r["done_at"] - r["sent_at"] for r in ok)
            steps = after[1] - before[1]
            row = {
                "concurrency": c, "requests": n_requests, "completed": len(ok),
                "failed": len(results) - len(ok), "ids": sorted({r["id"] for r in ok}),
                "wall_s": wall, "videos_per_min": 60.0 * len(ok) / wall if wall > 0 else 0.0,
                "p50_s": _percentile(lat, 50), "p95_s": _percentile(lat, 95),
                "mean_batch": (after[0] - before[0]) / steps if steps else None, "steps": steps,
                "step_ms": 1000 * (after[2] - before[2]) / steps if steps else None,
            }
            rows.append(row)
            if progress:
                progress(f"concurrency {c}: {len(ok)}/{n_requests} completed in {wall:.2f} s, "
                         f"mean batch {row['mean_batch'] or 0:.2f}")
    base = rows[0]["videos_per_min"] if rows and rows[0]["concurrency"] == 1 else None
    for row in rows:
        row["speedup"] = row["videos_per_min"] / base if base else None
    return rows


def _run_level(url: str, headers: dict, requests: list[dict], concurrency: int, timeout_s: float) -> list[dict]:
    import httpx

    todo = list(enumerate(requests))
    lock = threading.Lock()
    results: list[dict] = []

    def client() -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(30, read=timeout_s)) as http:
            while True:
                with lock:
                    if not todo:
                        return
                    _, req = todo.pop(0)
                sent = time.perf_counter()
                status, vid = "failed", None
                try:
                    r = http.post("/v1/videos", json=req)
                    r.raise_for_status()
                    vid = r.json()["id"]
                    status = wait_for_video(http, vid)
                except Exception as e:  # counted as a failure in the row
                    status = f"error: {e}"
                with lock:
                    results.append({"id": vid, "status": status, "sent_at": sent, "done_at": time.perf_counter()})

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def wait_for_video(http, video_id: str) -> str:
    """Follow the video's SSE stream until it is completed or failed; returns the final status."""
    with http.stream("GET", f"/v1/videos/{video_id}/events") as r:
        r.raise_for_status()
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:].strip()
            elif line.startswith("data: ") and event in ("video.completed", "video.failed", "video.deleted"):
                return json.loads(line[6:]).get("status", "deleted")
    return http.get(f"/v1/videos/{video_id}").json()["status"]


def _step_counters(http) -> tuple[float, float, float]:
    """(requests stepped, steps, seconds stepping) so far, from the server's /metrics."""
    from longserve.server.api.metrics import parse_text

    m = parse_text(http.get("/metrics").text)
    return (m.get("longserve_step_batch_size_sum", 0.0), m.get("longserve_step_batch_size_count", 0.0),
            m.get("longserve_step_latency_seconds_sum", 0.0))


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np

    return float(np.percentile(values, q))


# -- denoising while a stream encodes -----------------------------------------------------------------------------


def measure_interference(url: str, body: dict, args, progress) -> dict:
    """A long video denoises alone for a while; then a second video (another shape, so another batch) is
    created and streamed; once it is denoised and decoded (one decode chunk: the server runs with
    --decode-chunk-frames = its frames), its MP4 is encoded and streamed while the long one denoises. The long
    video's steps per second in each window, from /metrics' step counter, and the latency of GET /health and
    GET /v1/videos/{id} (30 of each, alternating) in each window."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
        long = http.post("/v1/videos", json=dict(body, prompt="the long one", num_inference_steps=1000,
                                                 seed=1)).json()["id"]
        while http.get(f"/v1/videos/{long}").json()["progress"] < 1:
            time.sleep(0.01)
        alone = _window(http, long, until=lambda: None, min_s=3.0)
        progress(f"alone: {alone['steps_per_s']:.2f} steps/s")
        encoded = http.post("/v1/videos", json={"prompt": "the encoded one", "size": args.encode_size,
                                                "num_frames": args.encode_frames, "num_inference_steps": 2,
                                                "seed": 2}).json()["id"]
        streamed = bytearray()

        def stream():
            with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
                with c.stream("GET", f"/v1/videos/{encoded}/content", params={"stream": "true"}) as r:
                    for chunk in r.iter_bytes():
                        streamed.extend(chunk)

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        while http.get(f"/v1/videos/{encoded}").json()["progress"] < 99:    # denoised and decoded
            time.sleep(0.005)
        done = lambda: http.get(f"/v1/videos/{encoded}").json()["status"] in ("completed", "failed")  # noqa: E731
        encoding = _window(http, long, until=done, min_s=0.0)
        reader.join(60)
        progress(f"while encoding: {encoding['steps_per_s']:.2f} steps/s over {encoding['seconds']:.2f} s, "
                 f"{len(streamed)} bytes streamed")
        http.delete(f"/v1/videos/{long}")
    return {"alone": alone, "encoding": encoding, "streamed_bytes": len(streamed),
            "ratio": encoding["steps_per_s"] / alone["steps_per_s"]}


def _window(http, video_id: str, until, min_s: float) -> dict:
    """Steps per second (all batches: only `video_id` denoises) and request latencies until `until()` (or for
    `min_s` seconds when `until` returns None), with 30 GETs of /health and 30 of the video meanwhile."""
    import numpy as np

    def steps():
        return _step_counters(http)[1]

    s0, t0 = steps(), time.perf_counter()
    health, video = [], []
    while True:
        for path, out in (("/health", health), (f"/v1/videos/{video_id}", video)):
            if len(out) < 30:
                t = time.perf_counter()
                http.get(path)
                out.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - t0
        finished = until()
        if (finished is None and elapsed >= min_s and len(video) >= 30) or finished:
            break
        time.sleep(0.01)
    s1, t1 = steps(), time.perf_counter()
    ms = lambda xs: {"median_ms": 1000 * float(np.median(xs)), "worst_ms": 1000 * max(xs), "n": len(xs)}  # noqa: E731
    return {"steps_per_s": (s1 - s0) / (t1 - t0), "seconds": t1 - t0, "health": ms(health), "video": ms(video)}


def _report_interference(args, result: dict, load_before) -> int:
    from tools.bench.util import machine_info, replace_markdown_section, write_json

    rows = [dict(window=name, steps_per_s=w["steps_per_s"], seconds=w["seconds"],
                 health_median_ms=w["health"]["median_ms"], health_worst_ms=w["health"]["worst_ms"],
                 health_n=w["health"]["n"], video_median_ms=w["video"]["median_ms"],
                 video_worst_ms=w["video"]["worst_ms"], video_n=w["video"]["n"])
            for name, w in (("nothing encoding", result["alone"]), ("a stream encoding", result["encoding"]))]
    from tools.bench.util import markdown_table

    columns = [("window", "window"), ("steps/s", "steps_per_s", ".2f"), ("window s", "seconds", ".2f"),
               ("GET /health median ms", "health_median_ms", ".1f"), ("worst ms", "health_worst_ms", ".1f"),
               ("GET /v1/videos/{id} median ms", "video_median_ms", ".1f"), ("worst ms", "video_worst_ms", ".1f")]
    table = markdown_table(rows, columns)
    machine = machine_info(_server_device(args))
    command = "longserve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    print(table)
    print(f"steps/s while encoding / alone: {result['ratio']:.3f}")
    if args.json:
        write_json([dict(r, ratio=result["ratio"], machine=machine, load_average=load_before) for r in rows],
                   args.json)
    if args.docs:
        body = (f"Measured with `{command}` on {machine['cpu']} ({machine['cores']} cores, torch {machine['torch']}), "
                f"load average before {load_before}. A {args.size} video of {args.frames} frames denoises (model "
                f"{args.model}, {args.workers} workers) alone, then while a {args.encode_size} video of "
                f"{args.encode_frames} frames is MP4-encoded and streamed to a client; the latencies are of 30 "
                f"requests of each kind per window.\n\n{table}\n\nSteps per second while encoding / alone: "
                f"**{result['ratio']:.3f}**.")
        replace_markdown_section(args.docs, "## Serving: denoising while a stream encodes", body)
    return 0


# -- a server to bench ----------------------------------------------------------------------------------------


class _Server:
    def __init__(self, proc, url, data_dir):
        self.proc, self.url, self._data_dir = proc, url, data_dir

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._data_dir.cleanup()


def _server_device(args) -> str:
    """Where a server started by this bench runs (its --device default: CUDA when present); a --url server: unknown
    here, so this machine's CPU is what is recorded."""
    import torch

    return "cuda" if args.url is None and torch.cuda.is_available() else "cpu"


def start_server(args, max_batch: int, timeout_s: float = 300.0, extra: list[str] = ()) -> _Server:
    import httpx

    from longserve.server.api.app import free_port

    port = free_port()
    data_dir = tempfile.TemporaryDirectory(prefix="longserve-bench-")
    cmd = [sys.executable, "-m", "longserve.server.cli", "serve", "--model", args.model, "--workers", str(args.workers),
           "--parallel", args.parallel, "--host", "127.0.0.1", "--port", str(port), "--data-dir", data_dir.name,
           "--max-batch", str(max_batch), "--max-queue", "1024", "--max-steps", str(max(args.steps, 200)),
           "--log-level", "warning", "--score-model", "none", *extra]
    if getattr(args, "dtype", None):
        cmd += ["--dtype", args.dtype]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(cmd, cwd=root)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            data_dir.cleanup()
            raise RuntimeError(f"the server exited with code {proc.returncode} while starting")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return _Server(proc, url, data_dir)
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            data_dir.cleanup()
            raise RuntimeError("the server did not become healthy in time")
        time.sleep(0.25)


# -- docs ---------------------------------------------------------------------------------------------------------


def write_docs_section(path: str, rows: list[dict], args, meta: dict) -> None:
    from tools.bench.util import markdown_table, replace_markdown_section

    m = meta["machine"]
    base = rows[0]
    server = (f"the server at {args.url}" if args.url else
              f"model {args.model}, {args.workers} workers, server `--max-batch "
              f"{args.max_batch or max(r['concurrency'] for r in rows)}`")
    lines = [
        f"Measured with `{meta['command']}` on {m['cpu']} ({m['cores']} cores, torch {m['torch']}, "
        f"{m['backend']}), load average before the run {meta['load_average']}.",
        "",
        f"Every level sends the same {base['requests']} requests ({args.size}, {args.frames} frames, "
        f"{args.steps} steps, {server}); concurrency 1 is the one-at-a-time baseline "
        "of the same run. Latency is create -> completed (MP4 written); mean batch is requests per denoising "
        "step and mean step ms the wall time of one denoising step, both from `/metrics`.",
        "",
        markdown_table(rows, COLUMNS),
        "",
        "A step of many requests costs little more than a step of one (mean step ms), so denoising "
        "throughput grows with the batch; what caps the speedup of whole videos is the per-video work "
        "that does not batch: prompt encoding at admission, the VAE decode (per frame) and the MP4 encode. "
        "On real models the denoising steps dominate.",
    ]
    replace_markdown_section(path, "## Serving (bench serve)", "\n".join(lines))
