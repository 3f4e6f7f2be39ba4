"""`longserve bench vae`: Wan VAE decode across workers, chunk by chunk: peak memory and time per worker.

    longserve bench vae [--model tiny] --workers 1,2,4 --frames 33 --long-frames 129 --size 192x128 \\
        --tile 64/48 [--chunk 1] [--batch 1] [--split items,rows] [--threads 1] [--pin] [--no-memory] \\
        [--json out.json] [--markdown docs/benchmarks.md]

Rows, all on the same seeded random `AutoencoderKLWan` (`random_wan_vae` in tools/bench/models.py;
`--model tiny`: Wan 2.1's structure at base_dim 16, `--model wan2.1`: Wan 2.1's exact size, diffusers'
default config, 127M parameters) and the same random de-normalised latents:

- diffusers' own one-shot `vae.decode` of the whole video, plain and tiled
  (`enable_tiling(MIN, MIN, STRIDE, STRIDE)`), on one worker: the baselines;
- `StreamingVAEDecoder` (engine/causal_vae.py) on 1, 2, 4 ... workers, `--chunk` latent frames
  per call;
- the same on one worker in a single chunk (the whole video at once) and, in chunks, for a
  `--long-frames` video: peak memory must not grow with the video's length;
- with `--split rows`: engine/vae_split.py's `RowSplitWanDecoder` (every frame's rows split across the
  workers, halos exchanged per convolution; untiled, so compared with diffusers' plain decode) on the same
  worker counts: the split made for speed, where the item split leaves a lone untiled video to one worker.

Per row: peak tensor memory above the loaded model per worker (engine/memory.py; CPU: live
tensor storage counted by a TorchDispatchMode, CUDA: max_memory_allocated), the largest
over the workers and split into the destination rank (which also gathers, blends and
returns each chunk) and the others; the caches a worker holds between calls (largest);
bytes sent per worker (engine/comm.py); seconds on the slowest worker in a run without the
memory tracker; the largest absolute difference to diffusers' one-shot decode (tiled when
tiling is on). Every worker runs `--threads` torch threads (default one, see `_worker_setup`); `--pin` puts
worker r on core r alone (of the cores this process may use), so that N workers measure N cores.

A memory run decodes the whole video but keeps no returned chunk (a streaming caller
writes each one out): its peak counts one returned chunk, not the video.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

from tools.bench.util import (
    Column,
    int_list,
    load_average,
    machine_info,
    markdown_table,
    replace_markdown_section,
    text_table,
)

SECTION = "## Wan VAE decode across workers"
MODELS = {  # random_wan_vae arguments
    "tiny": dict(base_dim=16, z_dim=16, dim_mult=(1, 2, 4, 4), num_res_blocks=1),
    "wan2.1": dict(base_dim=96, z_dim=16, dim_mult=(1, 2, 4, 4), num_res_blocks=2),  # diffusers' defaults
}


def section(model: str, split: str = "items") -> str:
    name = SECTION if split == "items" else f"{SECTION}, split {split.replace(',', ' and ')}"
    return name if model == "tiny" else f"{name} ({model} size)"


def add_arguments(parser) -> None:
    parser.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS),
                        help="random Wan VAE: tiny (base_dim 16) or wan2.1 (the real size, slow on CPU)")
    parser.add_argument("--frames", type=int, default=33, help="pixel frames of the video (Wan: 4k+1)")
    parser.add_argument("--long-frames", type=int, default=129,
                        help="pixel frames of the longer video decoded on 1 worker in chunks (0: skip)")
    parser.add_argument("--size", default="192x128", help="pixel frame size WxH (multiples of the VAE's 8)")
    parser.add_argument("--tile", default="64/48",
                        help="MIN/STRIDE tile size in pixels (square, as enable_tiling takes them), or 'off'")
    parser.add_argument("--chunk", type=int, default=1, help="latent frames per decode call")
    parser.add_argument("--batch", type=int, default=1, help="videos decoded together")
    parser.add_argument("--split", default="items",
                        help="the multi-worker decodes to run, comma-separated: items (tiles or whole videos per "
                             "worker, engine/causal_vae.py), rows (every frame's rows across the workers, "
                             "engine/vae_split.py; untiled)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--pin", action="store_true", help="pin worker r to core r (one core each)")
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="skip the memory-tracked runs (time and error only; half the run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--markdown", default=None, metavar="PATH",
                        help=f"write/replace the '{SECTION}' section (tiny; '... (wan2.1 size)' for wan2.1; "
                             "', split rows' with --split rows) of this markdown file")


def _tiling(text: str):
    from longserve.engine.causal_vae import VAETiling

    if text == "off":
        return None
    try:
        size, stride = (int(v) for v in text.split("/"))
    except ValueError:
        raise ValueError(f"--tile: expected MIN/STRIDE in pixels (e.g. 64/48) or 'off', got {text!r}") from None
    return VAETiling(size, size, stride, stride)


SPLITS = ("items", "rows")


def _splits(text: str) -> list[str]:
    splits = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in splits if s not in SPLITS]
    if not splits or bad:
        raise ValueError(f"--split: a comma-separated list of {', '.join(SPLITS)}; got {text!r}")
    return splits


def _setup(args):
    """Validated (latent frames, long latent frames, latent h, latent w, tiling) from the options."""
    from longserve.server.api.protocol import parse_size

    width, height = parse_size(args.size)
    if not width or not height:
        raise ValueError(f"--size: width and height must be positive, got {args.size!r}")
    for name in ("frames", "chunk", "batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: must be >= 1, got {getattr(args, name)}")
    if args.long_frames < 0:
        raise ValueError(f"--long-frames: must be >= 0, got {args.long_frames}")
    if args.threads < 1:
        raise ValueError(f"--threads: must be >= 1, got {args.threads}")
    _splits(args.split)
    if args.model not in MODELS:
        raise ValueError(f"--model: one of {', '.join(MODELS)}; got {args.model!r}")
    config = _build(args.model).config
    ratio, temporal = config.scale_factor_spatial, config.scale_factor_temporal
    if width % ratio or height % ratio:
        raise ValueError(f"--size: width and height must be multiples of {ratio}, got {args.size!r}")
    latent = lambda f: (f - 1) // temporal + 1  # noqa: E731 - the Wan pipelines' num_latent_frames
    return latent(args.frames), latent(args.long_frames) if args.long_frames else 0, height // ratio, \
        width // ratio, _tiling(args.tile)


@functools.lru_cache(maxsize=2)
def _build(model: str):
    from tools.bench.models import random_wan_vae

    return random_wan_vae(**MODELS[model], seed=0)


def _latents(model, batch, frames, h, w, seed):
    import torch

    config = _build(model).config
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, config.z_dim, frames, h, w, generator=g) * std + mean  # de-normalised, as Wan's


def _vae(ctx, model):
    if ctx.state.get("vae_model") != model:
        ctx.state["vae"], ctx.state["vae_model"] = _build(model), model
    return ctx.state["vae"]


def _diffusers_job(ctx, model, z, tiling, measure):
    """diffusers' one-shot vae.decode on this (single) worker: (output or None, peak bytes, seconds)."""
    import torch

    from longserve.engine.memory import PeakMemory

    vae = _vae(ctx, model)
    vae.use_tiling = False
    if tiling is not None:
        vae.enable_tiling(tiling.sample_min_height, tiling.sample_min_width,
                          tiling.sample_stride_height, tiling.sample_stride_width)
    with torch.no_grad(), PeakMemory(ctx.pg.device, enabled=measure) as mem:
        t0, c0 = time.perf_counter(), time.process_time()
        out = vae.decode(z).sample
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    vae.use_tiling = False
    return dict(video=None if measure else out, peak=mem.peak_bytes, seconds=seconds, cpu_s=cpu, bytes_sent=0)


def _stream_job(ctx, model, z, tiling, chunk, measure):
    """StreamingVAEDecoder over the whole of z in chunks; per rank: video (rank 0, unless measuring),
    peak bytes, bytes of the caches held after the last call, seconds, bytes sent."""
    import torch
    import torch.distributed as dist

    from longserve.engine import comm
    from longserve.engine.causal_vae import StreamingVAEDecoder
    from longserve.engine.memory import PeakMemory

    vae, pg = _vae(ctx, model), ctx.pg
    if pg.world_size > 1:
        dist.barrier(group=pg.group)
    comm.STATS.reset()
    outs = []
    with torch.no_grad(), PeakMemory(pg.device, enabled=measure) as mem:
        t0 = time.perf_counter()
        decoder = StreamingVAEDecoder(vae, pg, z.shape[0], z.shape[3], z.shape[4], tiling=tiling)
        for start in range(0, z.shape[2], chunk):
            out = decoder.decode(z[:, :, start:start + chunk])
            if not measure and out is not None:
                outs.append(out)
            del out  # a streaming caller writes the chunk out and lets it go
        caches = decoder.cache_bytes           # what a worker holds between calls
        decoder.close()
        seconds = time.perf_counter() - t0
    return dict(video=torch.cat(outs, dim=2) if outs else None, peak=mem.peak_bytes, seconds=seconds,
                bytes_sent=comm.STATS.bytes_sent, items=len(decoder.owned[pg.rank]), grid=decoder.grid,
                caches=caches)


def _rows_job(ctx, model, z, measure):
    """RowSplitWanDecoder over the whole of z, one latent frame per call (as `_stream_job`)."""
    import torch
    import torch.distributed as dist

    from longserve.engine import comm
    from longserve.engine.memory import PeakMemory
    from longserve.engine.vae_split import RowSplitWanDecoder

    vae, pg = _vae(ctx, model), ctx.pg
    if pg.world_size > 1:
        dist.barrier(group=pg.group)
    comm.STATS.reset()
    outs = []
    with torch.no_grad(), PeakMemory(pg.device, enabled=measure) as mem:
        t0, c0 = time.perf_counter(), time.process_time()
        decoder = RowSplitWanDecoder(vae, pg, z.shape[0], z.shape[3], z.shape[4])
        for start in range(z.shape[2]):
            out = decoder.decode(z[:, :, start:start + 1])
            if not measure and out is not None:
                outs.append(out)
            del out
        caches = decoder.cache_bytes
        decoder.close()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return dict(video=torch.cat(outs, dim=2) if outs else None, peak=mem.peak_bytes, seconds=seconds, cpu_s=cpu,
                bytes_sent=comm.STATS.bytes_sent, items=None, grid=None, caches=caches)


def _run_both(pool, job, *args, memory=True):
    """One tracked run for memory (unless `memory` is off), one untracked for time and output; per-rank results
    merged."""
    timed = pool.run(job, *args, False)
    if not memory:
        return [dict(t, peak=None) for t in timed]
    mem = pool.run(job, *args, True)
    return [dict(t, peak=m["peak"]) for m, t in zip(mem, timed)]


def _row(method, tiling_text, frames, latent_frames, chunk, results, reference):
    MiB = 2**20
    measured = results[0]["peak"] is not None          # --no-memory: no peak was measured
    peaks = [r["peak"] if measured else 0 for r in results]
    err = None
    if reference is not None and results[0]["video"] is not None:
        err = (results[0]["video"] - reference).abs().max().item()
    return dict(method=method, tiling=tiling_text, frames=frames, latent_frames=latent_frames, chunk=chunk,
                workers=len(results), peak_mib=max(peaks) / MiB if measured else None,
                dst_peak_mib=peaks[0] / MiB if measured else None,
                others_peak_mib=max(peaks[1:]) / MiB if len(peaks) > 1 and measured else None,
                items=[r.get("items") for r in results], grid=results[0].get("grid"),
                cache_mib=max(r["caches"] for r in results) / MiB if "caches" in results[0] else None,
                sent_mib=max(r["bytes_sent"] for r in results) / MiB,
                seconds=max(r["seconds"] for r in results),
                cpu_s=max(r["cpu_s"] for r in results) if all("cpu_s" in r for r in results) else None,
                max_abs_err=err)


def _worker_setup(ctx, threads: int = 1, pin: bool = False) -> None:
    # The 2 cores are shared: a process running 2 intra-op threads while others compete ran 10-40x
    # slower here, so every worker, at every worker count, runs one by default. Pinned, worker r has core r
    # of this process's cores to itself: N workers then measure N cores, not the scheduler's spread.
    import os

    import torch

    torch.set_num_threads(threads)
    if pin and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[ctx.pg.rank % len(cores)]})


def measure(args) -> list[dict]:
    from longserve.engine.pool import WorkerPool

    workers = int_list(args.workers, "--workers")
    splits = _splits(args.split)
    memory = args.memory
    T, T_long, h, w, tiling = _setup(args)
    tile = args.tile if tiling is not None else "off"
    videos = [(args.frames, T)] + ([(args.long_frames, T_long)] if T_long else [])
    z = {frames: _latents(args.model, args.batch, latent, h, w, args.seed) for frames, latent in videos}
    rows: list[dict] = []
    reference: dict[int, object] = {}  # frames -> diffusers' one-shot decode (tiled when tiling is on)
    plain: dict[int, object] = {}      # frames -> diffusers' plain (untiled) one-shot decode

    def log(row):
        rows.append(row)
        print(f"  {row['method']:<28} workers={row['workers']} frames={row['frames']} chunk={row['chunk']}: "
              f"peak {row['peak_mib'] or 0:.2f} MiB/worker, {row['seconds']:.2f} s", file=sys.stderr, flush=True)

    for n in sorted(set(workers) | {1}):
        with WorkerPool(n, setup=_worker_setup, setup_args=(args.threads, args.pin)) as pool:
            for frames, latent in videos:
                if n == 1:
                    for name, t in (("diffusers, plain", None), ("diffusers, tiled", tiling)):
                        if t is None and name.endswith("tiled"):
                            continue
                        res = _run_both(pool, _diffusers_job, args.model, z[frames], t, memory=memory)
                        reference[frames] = res[0]["video"]
                        if t is None:
                            plain[frames] = res[0]["video"]
                        log(_row(name, "off" if t is None else tile, frames, latent, latent, res, None))
                if frames == args.frames and n == 1 and "items" in splits:
                    res = _run_both(pool, _stream_job, args.model, z[frames], tiling, latent, memory=memory)
                    log(_row("streaming, one chunk", tile, frames, latent, latent, res, reference[frames]))
                if n in workers and (frames == args.frames or n == 1) and "items" in splits:
                    res = _run_both(pool, _stream_job, args.model, z[frames], tiling, args.chunk, memory=memory)
                    log(_row("streaming", tile, frames, latent, args.chunk, res, reference[frames]))
                if n in workers and frames == args.frames and "rows" in splits:
                    res = _run_both(pool, _rows_job, args.model, z[frames], memory=memory)
                    log(_row("rows split", "off", frames, latent, 1, res, plain[frames]))
    for r in rows:
        same = [b for b in rows if b["frames"] == r["frames"]]
        one = next((b for b in same if b["method"] == r["method"] and b["workers"] == 1), None)
        diffusers = same[1] if tiling is not None and r["method"] != "rows split" else same[0]
        split = r["method"] in ("streaming", "rows split")
        measured = r["peak_mib"] is not None
        r["vs_1_worker"] = r["peak_mib"] / one["peak_mib"] if measured and one and split else None
        r["vs_diffusers"] = r["peak_mib"] / diffusers["peak_mib"] if measured else None
        r["speedup"] = one["seconds"] / r["seconds"] if one and split else None
        r["cpu_speedup"] = one["cpu_s"] / r["cpu_s"] if one and split and r.get("cpu_s") and one.get("cpu_s") \
            else None
    return sorted(rows, key=lambda r: (r["frames"], not r["method"].startswith("diffusers"), r["workers"]))


COLUMNS = [
    Column("method", "method"),
    Column("tiling", "tiling"),
    Column("frames", "frames"),
    Column("latent frames / chunk", lambda r: f"{r['latent_frames']} / {r['chunk']}"),
    Column("workers", "workers"),
    Column("peak MiB / worker", "peak_mib", ".2f"),
    Column("dst", "dst_peak_mib", ".2f"),
    Column("others", "others_peak_mib", ".2f"),
    Column("caches MiB / worker", "cache_mib", ".2f"),
    Column("vs 1 worker", "vs_1_worker", lambda v: f"{v:.2f}x"),
    Column("vs diffusers", "vs_diffusers", lambda v: f"{v:.2f}x"),
    Column("MiB sent / worker", "sent_mib", ".2f"),
    Column("seconds", "seconds", ".2f"),
    Column("speed vs 1 worker", "speedup", lambda v: f"{v:.2f}x"),
    Column("CPU s / worker", "cpu_s", ".2f"),
    Column("CPU vs 1 worker", "cpu_speedup", lambda v: f"{v:.2f}x"),
    Column("max abs err", "max_abs_err", ".1e"),
]


def command_line(args) -> str:
    cmd = (f"longserve bench vae --model {args.model} --workers {args.workers} --frames {args.frames} "
           f"--long-frames {args.long_frames} "
           f"--size {args.size} --tile {args.tile} --chunk {args.chunk} --batch {args.batch}")
    if args.split != "items":
        cmd += f" --split {args.split}"
    if args.threads != 1:
        cmd += f" --threads {args.threads}"
    if args.pin:
        cmd += " --pin"
    if not args.memory:
        cmd += " --no-memory"
    if args.seed:
        cmd += f" --seed {args.seed}"
    for opt in ("json", "markdown"):
        if getattr(args, opt):
            cmd += f" --{opt} {getattr(args, opt)}"
    return cmd


def machine() -> str:
    import torch

    info = machine_info("cuda" if torch.cuda.is_available() else "cpu")
    gpu = f", {info['gpu']}" if "gpu" in info else ", no GPU"
    return f"{info['cpu']}, {info['cores']} CPU cores{gpu}, torch {info['torch']}, {info['backend']}"


def markdown_section(rows: list[dict], args, load) -> str:
    T, T_long, h, w, tiling = _setup(args)
    model = ", ".join(f"{k} {v}" for k, v in MODELS[args.model].items())
    grid = next((r["grid"] for r in rows if r["grid"]), (1, 1))
    grid = f"a {grid[0]}x{grid[1]} grid of tiles per video (edge tiles smaller)" if tiling else "one item per video"
    rows_only = _splits(args.split) == ["rows"]
    what = ("engine/vae_split.py's `RowSplitWanDecoder` (every frame's rows split across the workers, the "
            "decoder's convolutions exchanging their edge rows, bands gathered on one rank; one latent frame per "
            "call, the causal caches per band)" if rows_only else
            "engine/causal_vae.py's `StreamingVAEDecoder` (chunks of latent frames, per-(video, tile) caches, work "
            "split across workers, tiles gathered and blended on one rank)")
    return "\n".join([
        f"Decoding Wan latents with {what} against diffusers' own one-shot `AutoencoderKLWan.decode`. Rerun "
        "with:", "",
        "```", command_line(args), "```", "",
        f"- Machine: {machine()}; the CPU is shared with other work: 1/5/15-minute load average before "
        f"the run {load[0]}, after it {load[1]}. Memory is a count of tensor storage, independent of load; "
        "seconds are not (and more workers than cores time-share them).",
        f"- Model: `random_wan_vae` ({model}; seeded, Wan 2.1's structure: 8x spatial, 4x temporal). "
        f"Input: batch {args.batch}, {args.frames} frames ({T} latent frames) at {args.size} "
        f"({h}x{w} latent), random de-normalised latents; tiles {args.tile} pixels: {grid}.",
        "- peak MiB / worker: peak tensor memory above the loaded model, largest over the workers "
        "(engine/memory.py: every aten op's newly allocated storage counted until freed); \"dst\" is the rank "
        "that gathers, blends and returns each chunk, \"others\" the largest of the rest. A streaming run keeps "
        "no returned chunk (a streaming caller writes each out), so its peak counts one chunk of output; "
        "diffusers' one-shot decode returns (and counts) the whole video.",
        "- seconds: slowest worker, separate run without the memory tracker; CPU s / worker: the busiest worker's "
        "CPU time in that run (process time: time it waits for a shared core does not count, so it reads the "
        "split's work per worker when the machine is busy). MiB sent: engine/comm.py's "
        "accounting (a rank sends its padded tile chunks once per call; dst sends nothing).",
        "- vs 1 worker: over the same streaming run on 1 worker; vs diffusers: over diffusers' one-shot decode "
        "of the same frames (tiled when tiling is on). max abs err: the output against that decode.", "",
        markdown_table(rows, COLUMNS), "",
        summary(rows, args), "",
    ])


def summary(rows: list[dict], args) -> str:
    """The figures the section is for, in sentences, from the rows."""
    def find(method, frames, workers=1):
        return next((r for r in rows if r["method"] == method and r["frames"] == frames and r["workers"] == workers),
                    None)

    base = "diffusers, tiled" if args.tile != "off" else "diffusers, plain"
    streams = sorted((r for r in rows if r["method"] == "streaming" and r["frames"] == args.frames),
                     key=lambda r: r["workers"])
    one = find("streaming", args.frames)
    said = []
    split = sorted((r for r in rows if r["method"] == "rows split" and r["frames"] == args.frames),
                   key=lambda r: r["workers"])
    if split:
        per = ", ".join(f"{r['seconds']:.2f} s on {r['workers']}" + (f" ({r['speedup']:.2f}x)" if r["workers"] > 1
                                                                     else "") for r in split)
        err = max(r["max_abs_err"] for r in split if r["max_abs_err"] is not None)
        pinned = "each worker pinned to its own core, " if args.pin else ""
        cpu = ", ".join(f"{r['cpu_s']:.2f} s on {r['workers']}" + (f" ({r['cpu_speedup']:.2f}x)" if r["workers"] > 1
                                                                  else "") for r in split if r.get("cpu_s"))
        said.append(f"Rows split ({pinned}{args.threads} thread(s) each): {per} worker(s), at most {err:.1e} from "
                    f"diffusers' plain decode. CPU seconds of the busiest worker (what a worker computes, whatever "
                    f"else shares its core): {cpu}.")
    if one and args.memory:
        per = ", ".join(f"{r['peak_mib']:.2f} MiB on {r['workers']}" + (f" ({r['vs_1_worker']:.2f}x)" if
                                                                         r["workers"] > 1 else "")
                        for r in streams)
        caches = ", ".join(f"{r['cache_mib']:.2f}" for r in streams)
        said.append(f"Peak per worker, {args.frames} frames in chunks of {args.chunk} latent frame(s): {per} "
                    f"worker(s); of which the caches held between calls: {caches} MiB.")
        ref = find(base, args.frames)
        if ref:
            why = (", because it keeps every tile's cache alive between calls where diffusers' tiled decode holds "
                   "one tile's at a time (plus the whole decoded video)"
                   if args.tile != "off" and one["vs_diffusers"] > 1 else "")
            said.append(f"diffusers' one-shot {base.split(', ')[1]} decode of the same video peaks at "
                        f"{ref['peak_mib']:.2f} MiB: streaming on 1 worker is {one['vs_diffusers']:.2f}x that{why}.")
    long_stream, long_ref = find("streaming", args.long_frames), find(base, args.long_frames)
    if one and long_stream and long_ref and args.memory:
        ref = find(base, args.frames)
        said.append(f"For {args.long_frames} frames the streaming peak is {long_stream['peak_mib']:.2f} MiB "
                    f"({args.frames} frames: {one['peak_mib']:.2f}): it does not grow with the video, while "
                    f"diffusers' grows from {ref['peak_mib']:.2f} to {long_ref['peak_mib']:.2f} MiB.")
    return " ".join(said)


def run(args) -> int:
    load = [load_average()]
    rows = measure(args)
    load.append(load_average())
    print(text_table(rows, COLUMNS))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": command_line(args), "machine": machine(),
                                               "model": MODELS[args.model], "rows": rows}, indent=2) + "\n")
    if args.markdown:
        replace_markdown_section(args.markdown, section(args.model, args.split), markdown_section(rows, args, load))
    return 0
