"""`bench live`'s loop comparison: the same session under each live loop and worker count, a chunk's time by stage.

    longserve bench live --model tiny-live --workers 1,2 --loops serial,overlapped,pipelined --threads 1 --pin

One row per (workers, loop) that exists (the pipelined and stages loops need two workers; stages runs its default
stream batch, one chunk per worker): the session's frames per second after
its first chunk, the first fMP4 fragment, and a chunk's milliseconds by stage, each measured where it runs:

    transformer   worker 0's forwards (every step and the context pass)
    VAE           the decode, on the rank and thread that ran it (the lane outside the serial loop)
    transfer      the chunk's way to the caller: the final latents' hand-over to the decode worker (pipelined) and
                  the coordinator's read of the uint8 frames from their shared-memory slot (engine/live_frames.py)
    mux           the caller's fMP4 muxer (server/live_media.py), beside the workers' next chunk
    rest          the chunk's wall time less transformer, VAE and transfer: the pool's round trips and the sampler's
                  own work when the stages run one after the other; negative when they overlap

and the overlap achieved: the sum of the four stages over the wall time (1.0: one after the other; 2.0: two stages
always at once). `--threads N` holds each worker to N intra-op threads (the decode lane gets its own N) and `--pin`
pins each worker, with its threads, to a core of its own (`sched_setaffinity`, as `bench replicas` does), and a
decode lane that runs beside its worker's steps (the overlapped loop) to the next core no worker has, when there is
one (its own thread budget): the "cores" column says which. So 1 worker's serial loop uses 1 core, its overlapped
loop 2 (on a 2-core machine), and 2 workers 2.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

LOOPS = ("serial", "overlapped", "pipelined", "stages")


def combos(workers: list[int], loops: list[str]) -> list[tuple[int, str]]:
    """The (workers, loop) rows of a run: every pair but a pipelined loop on one worker (it would be overlapped) and
    a stages loop on one (there is nothing to split)."""
    for loop in loops:
        if loop not in LOOPS:
            raise ValueError(f"--loops: {loop!r} is not one of {', '.join(LOOPS)}")
    return [(n, loop) for n in workers for loop in loops if not (loop in ("pipelined", "stages") and n < 2)]


def pin_workers(pids: list[int], lanes: list[int | None]) -> str:
    """Pin worker r (every thread it has, and what it starts later) to the r-th core this process may use; a decode
    lane beside a worker's steps (`lanes`: its thread id, engine/live_lane.py) to the next core no worker has, its
    own thread budget, or its worker's core when there is none left. -> the cores, as the table shows them."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < len(pids):
        raise ValueError(f"--pin needs a core per worker: {len(cores)} core(s) for {len(pids)} workers")
    free = cores[len(pids):]
    shown = []
    for r, pid in enumerate(pids):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), {cores[r]})
        text = str(cores[r])
        if lanes[r] is not None:
            core = free.pop(0) if free else cores[r]
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(lanes[r], {core})
            text += f" (lane {core})"
        shown.append(text)
    return ", ".join(shown)


@contextlib.contextmanager
def worker_threads(threads: int | None, workers: int):
    """The pool gives each CPU worker the coordinator's intra-op threads over the workers (engine/pool.py): `threads`
    each, for the pool started inside."""
    import torch

    if not threads:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads * workers)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def open_pipeline(config, workers: int, loop: str, threads: int | None, pin: bool, warm_up):
    """A `VideoPipeline` for one row, its workers started, warmed up (`warm_up(pipe)`) and pinned when asked."""
    from longserve.pipelines import VideoPipeline

    with worker_threads(threads, workers):
        pipe = VideoPipeline.from_config(config.replace(workers=workers, live_loop=loop))
        try:
            warm_up(pipe)
        except BaseException:
            pipe.close()
            raise
    if pin:
        from longserve.engine import worker

        pipe.pinned = pin_workers(pipe.pool.pids, pipe.pool.run(worker.lane_thread))
    else:
        pipe.pinned = None
    return pipe


def stage_columns(row: dict, stages: dict, chunks: int, total_s: float, mux_s: float) -> dict:
    """A chunk's milliseconds by stage (the module docstring), the rest and the overlap achieved."""
    n = max(1, chunks)
    per = {f"{k}_ms_per_chunk": 1000 * stages.get(f"{k}_s", 0.0) / n for k in ("transformer", "vae", "transfer")}
    wall = 1000 * total_s / n
    per["rest_ms_per_chunk"] = wall - sum(per.values())
    per["mux_ms_per_chunk"] = 1000 * mux_s / n
    per["overlap"] = (sum(v for k, v in per.items() if k != "rest_ms_per_chunk")) / wall if wall else 0.0
    row.update(per)
    return row


def ratios(rows: list[dict]) -> None:
    """Each live row's frames per second against the 1-worker serial row's and its own worker count's serial row."""
    base = next((r for r in rows if r.get("workers") == 1 and r.get("loop") == "serial"), None)
    for r in rows:
        if base is not None and base["fps"]:
            r["vs_serial_1"] = r["fps"] / base["fps"]


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def markdown_command(args, counts_text: str) -> str:
    parts = [f"longserve bench live --model {args.model} --size {args.size} --seconds {args.seconds:g}",
             f"--workers {args.workers} --loops {args.loops}"]
    if args.threads:
        parts.append(f"--threads {args.threads}")
    if args.pin:
        parts.append("--pin")
    parts.append(f"--memory-chunks {counts_text} --df-steps {args.df_steps}")
    return " ".join(parts)


def model_path(model: str) -> Path:
    from longserve.weights import resolve_model

    return Path(resolve_model(model))
