"""`longserve bench replicas [--replicas 1,2] [--concurrency 16] [--json out.json]`: jobs per minute of N
`longserve serve` replicas sharing one PostgreSQL store and one media directory, claim latency, and the time to
fail over after a SIGKILL.

For each replica count, a fresh PostgreSQL schema (on `--store`, default $LONGSERVE_TEST_POSTGRES or
postgresql://127.0.0.1:5432/test) and a fresh shared directory (or `--media-store`, e.g. an s3:// bucket with the
AWS_* settings in the environment). Each replica has one worker held to `--threads` threads (default 1:
OMP_NUM_THREADS, MKL_NUM_THREADS), and by default (`--pin`) each replica, with everything it starts (its worker, its
MP4 encoder's ffmpeg, its server threads), is pinned to a core of its own (`sched_setaffinity`, inherited by its
children): on a 2-core machine 2 replicas use one core each and never contend, and 1 replica uses one core, so the
two rows compare one core with two. `--concurrency` clients each create a video on
the replicas in turn and poll it (every POLL_S) until it completes, then create the next, `--requests` in all.
Claim latency is each replica's median of claim time minus the record's creation time (/health: `claim_p50_s`).
With two replicas or more, failover: a long job is created, the replica running it is SIGKILLed, and the time until
another replica claims it (attempt 2) is measured.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

#: how often a client polls its video: the clients share the 2 cores with the replicas they measure
POLL_S = 0.25

COLUMNS = [
    ("replicas", "replicas"),
    ("cores", "pinned"),
    ("threads", "threads"),
    ("requests", "requests"),
    ("completed", "completed"),
    ("wall s", "wall_s", ".2f"),
    ("jobs/min", "jobs_per_min", ".1f"),
    ("speedup vs 1", "speedup", ".2f"),
    ("claim p50 s", "claim_p50_s", ".2f"),
    ("failover s", "failover_s", ".2f"),
]


def add_arguments(p) -> None:
    p.add_argument("--replicas", default="1,2", help="comma-separated replica counts (each from a fresh store)")
    p.add_argument("--concurrency", type=int, default=16, help="clients at once")
    p.add_argument("--requests", type=int, default=32, help="videos per replica count")
    p.add_argument("--store", default=None, help="PostgreSQL server URL (a fresh schema is made on it per count)")
    p.add_argument("--model", default="tiny-latte")
    p.add_argument("--steps", type=int, default=10, help="num_inference_steps of every request")
    p.add_argument("--size", default="32x32")
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--lease-seconds", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=1, help="threads of each replica's worker (OMP_NUM_THREADS)")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                   help="pin each replica (and what it starts) to a core of its own (needs as many cores as replicas)")
    p.add_argument("--media-store", default=None,
                   help="the replicas' media store (default: a fresh shared directory; s3://bucket/prefix with the "
                        "AWS_* settings in the environment)")
    p.add_argument("--json", default=None, help="write the rows here")


def run(args) -> int:
    from tools.bench.util import int_list, load_average, machine_info, text_table, write_json

    counts = int_list(args.replicas, "--replicas")
    if args.threads < 1:
        print("--threads must be at least 1", file=sys.stderr)
        return 2
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.pin and len(cores) < max(counts):
        print(f"--pin needs a core per replica: {len(cores)} core(s) for {max(counts)} replicas; not pinned",
              file=sys.stderr)
        args.pin = False
    args.cores = cores
    store = args.store or os.environ.get("LONGSERVE_TEST_POSTGRES") or "postgresql://127.0.0.1:5432/test"
    body = {"size": args.size, "num_frames": args.frames, "num_inference_steps": args.steps}
    load_before = load_average()
    rows = []
    for n in counts:
        rows.append(measure(store, n, args, body))
        print(f"{n} replica(s): {rows[-1]['completed']}/{args.requests} in {rows[-1]['wall_s']:.2f} s",
              file=sys.stderr, flush=True)
    base = rows[0]["jobs_per_min"] if rows and rows[0]["replicas"] == 1 else None
    for row in rows:
        row["speedup"] = row["jobs_per_min"] / base if base else None
    print(text_table(rows, COLUMNS))
    if args.json:
        meta = {"machine": machine_info("cpu"), "load_average": load_before,
                "command": "longserve " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
        write_json([dict(r, **meta) for r in rows], args.json)
    return 0


def measure(server_url: str, n: int, args, body: dict) -> dict:
    import httpx
    import psycopg

    schema = f"ls_bench_{uuid.uuid4().hex[:10]}"
    admin = psycopg.connect(server_url, autocommit=True)
    admin.execute(f"CREATE SCHEMA {schema}")
    url = f"{server_url}{'&' if '?' in server_url else '?'}options=-csearch_path%3D{schema}"
    root = Path(tempfile.mkdtemp(prefix="longserve-bench-replicas-"))
    replicas = []
    try:
        replicas = [start(args, url, root, f"r{i}", args.cores[i] if args.pin else None) for i in range(n)]
        for proc, base in replicas:
            wait_healthy(proc, base)
        bases = [base for _, base in replicas]
        results, lock, counter = [], threading.Lock(), iter(range(args.requests))

        def client():
            with httpx.Client(timeout=60) as http:
                while True:
                    with lock:
                        i = next(counter, None)
                    if i is None:
                        return
                    base = bases[i % len(bases)]
                    sent = time.monotonic()
                    vid = http.post(base + "/v1/videos", json=dict(body, prompt=f"a red ball, take {i}",
                                                                   seed=i)).json()["id"]
                    while (v := http.get(f"{base}/v1/videos/{vid}").json())["status"] not in ("completed",
                                                                                                "failed"):
                        time.sleep(POLL_S)
                    with lock:
                        results.append((sent, time.monotonic(), v["status"]))

        threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = max(r[1] for r in results) - min(r[0] for r in results)
        ok = sum(1 for r in results if r[2] == "completed")
        row = {"replicas": n, "requests": args.requests, "completed": ok, "wall_s": wall, "threads": args.threads,
               "pinned": ",".join(str(args.cores[i]) for i in range(n)) if args.pin else None,
               "jobs_per_min": 60.0 * ok / wall if wall > 0 else 0.0,
               "claim_p50_s": claim_p50(replicas), "failover_s": failover(url, replicas, args, body) if n > 1 else None}
        return row
    finally:
        for proc, _ in replicas:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        admin.close()


def start(args, store_url: str, root: Path, name: str, core: int | None = None):
    """A replica (`core`: pinned to it, with every process it starts)."""
    from longserve.server.api.app import free_port

    port = free_port()
    media = args.media_store or f"file://{root / 'media'}"
    cmd = [sys.executable, "-m", "longserve.server.cli", "serve", "--model", args.model, "--workers", "1",
           "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(root / name),
           "--store", store_url, "--media-store", media, "--replica-id", name,
           "--lease-seconds", str(args.lease_seconds), "--max-batch", "1", "--score-model", "none",
           "--log-level", "warning", "--no-warm-up", "--max-steps", "1000"]
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads}
    pin = None if core is None else (lambda: os.sched_setaffinity(0, {core}))
    return subprocess.Popen(cmd, env=env, preexec_fn=pin), f"http://127.0.0.1:{port}"


def wait_healthy(proc, base: str, timeout_s: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"a replica exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("a replica did not start")
        time.sleep(0.2)


def claim_p50(replicas) -> float | None:
    """Median seconds from a job's creation to its claim, the mean of the replicas' medians (/health; the
    creation time is stored in whole seconds, so +-0.5 s)."""
    import httpx

    values = [httpx.get(base + "/health", timeout=10).json()["replica"]["claim_p50_s"] for _, base in replicas]
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def failover(store_url: str, replicas, args, body: dict) -> float:
    """Seconds from SIGKILL of the replica running a long job to another replica's claim of it."""
    import httpx
    import psycopg

    base = replicas[0][1]
    vid = httpx.post(base + "/v1/videos", json=dict(body, prompt="failover", num_inference_steps=1000),
                     timeout=30).json()["id"]
    with psycopg.connect(store_url, autocommit=True) as conn:
        while (row := conn.execute("SELECT lease_owner, status FROM videos WHERE id = %s", (vid,)).fetchone())[1] \
                != "in_progress":
            time.sleep(0.05)
        victim = next(p for p, b in replicas if b.endswith(str(_port_of(replicas, row[0]))))
        killed = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        while conn.execute("SELECT lease_owner FROM videos WHERE id = %s", (vid,)).fetchone()[0] in (None, row[0]):
            time.sleep(0.05)
        return time.monotonic() - killed


def _port_of(replicas, name: str) -> int:
    index = int(name[1:])
    return int(replicas[index][1].rsplit(":", 1)[1])
