"""`longserve bench live`: a causal few-step model streamed chunk by chunk, against diffusion forcing.

    longserve bench live [--model tiny-live] [--size 64x64] [--seconds 10] [--memory-chunks 10,100,1000] \\
        [--workers 1,2] [--loops serial,overlapped,pipelined] [--threads 1] [--pin] \\
        [--df-steps 30] [--json out.json] [--markdown docs/benchmarks.md]

One run, one process, the same machine, side by side:

- loops: a live row per worker count and live loop (`--workers`, `--loops`; tools/bench/live_loops.py: a
  chunk's time by stage where each runs, transformer / VAE / transfer / mux / rest, the overlap achieved, and
  the frames per second against 1 worker's serial loop); the rows below run on the first pair;

- live: a `VideoPipeline.live` session of `--seconds` of video; time from the call to the first
  fMP4 fragment (the chunk decoded and muxed by `server.live_media.ChunkMuxer`, what the
  WebSocket sends first), sustained frames per second after the first chunk, seconds per chunk,
  and a chunk's milliseconds by stage on the worker (the session's transformer and VAE timings, the rest of the
  chunk's wall time) and the muxer's, which runs on the caller beside the worker's next chunk;
- memory: peak tensor memory per worker over sessions of 10, 100, 1000 chunks (separate runs
  with the tracker on: engine/memory.py), and each against the first (flat: 1.0), on each loop's first pair;
- prompt switch: `switch()` called as a chunk arrives; the latency in chunks (from the chunk
  being made at the call to the first chunk under the new prompt) and in seconds;
- diffusion forcing: the same number of frames by `SkyReelsV2DiffusionForcingPipeline`'s
  method in longserve (`skyreels-df`) on a transformer of the same shape (same width, heads,
  layers, VAE and text encoder; random weights), at `--df-steps` steps with guidance 6,
  segments of the causal model's window overlapping by 17 frames: frames per second, and the
  live / diffusion forcing ratio;
- work, independent of the machine: each row's video made again with `engine.workcount` on (after the timed
  runs, so the timings carry no counter): transformer forwards (calls x batch; guidance's two halves count two)
  and self-attention query x key token pairs attended (all layers, one pair per query and key token, heads not
  counted), per generated frame, on worker 0. On a dispatch-bound tiny model the wall time hides the difference
  in work that a GPU-sized model shows.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
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
    write_json,
)

SECTION = "## Live video: causal few-step chunks against diffusion forcing"
PROMPT = "a red ball bouncing"
SWITCH = "a blue ball bouncing"


def add_arguments(parser) -> None:
    from longserve.engine.config import EngineConfig, add_cli_args

    parser.add_argument("--size", default="64x64", help="WIDTHxHEIGHT in pixels")
    parser.add_argument("--seconds", type=float, default=10.0, help="video length of the timed session")
    parser.add_argument("--memory-chunks", default="10,100,1000", help="session lengths (chunks) for peak memory")
    parser.add_argument("--df-steps", type=int, default=30, help="diffusion forcing's steps per segment")
    parser.add_argument("--no-df", action="store_true", help="skip the diffusion-forcing comparison")
    parser.add_argument("--workers", default="1", help="worker counts, one row each (e.g. 1,2)")
    parser.add_argument("--loops", default="serial,overlapped,pipelined",
                        help="live loops (engine/live_lane.py, engine/live_stages.py), one row each; pipelined "
                             "and stages need 2 workers")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads of each worker (default: the machine's over the workers)")
    parser.add_argument("--pin", action="store_true", help="pin each worker to a core of its own")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--markdown", default=None, metavar="PATH",
                        help=f"replace the section '{SECTION}' of this Markdown file with the tables")
    add_cli_args(parser, EngineConfig, groups=("model",), defaults={"model": "tiny-live"},
                 titles={"model": "engine options"}, exclude=("workers",))


def counted(pipe, make) -> dict:
    """`make()` run with worker 0's work counter on: {"forwards", "self_pairs", "cross_pairs"}."""
    from longserve.engine import worker

    pipe.pool.run(worker.work_start)
    try:
        make()
    finally:
        counts = pipe.pool.run(worker.work_stop)
    return counts[0]


def add_work(row: dict, counts: dict) -> dict:
    frames = max(1, row["frames"])
    row.update(forwards_per_frame=counts["forwards"] / frames, self_pairs_per_frame=counts["self_pairs"] / frames,
               cross_pairs_per_frame=counts["cross_pairs"] / frames, work_counts=counts)
    return row


def _live_frames(pipe, seconds: float, width: int, height: int) -> int:
    with pipe.live(PROMPT, seconds=seconds, width=width, height=height, seed=0) as session:
        return sum(len(chunk.frames) for chunk in session)


def _live_row(pipe, seconds: float, width: int, height: int) -> dict:
    import dataclasses

    from longserve.pipelines.video import LiveSession
    from longserve.server.live_media import ChunkMuxer
    from tools.bench.live_loops import stage_columns

    fps = pipe.defaults.fps
    # the server's path: uint8 frames (as a live socket asks for them) into the muxer
    spec = dataclasses.replace(pipe.make_spec(PROMPT, "", None, height, width, None, None, 0, "np", seconds=seconds,
                                              live=True), output="uint8")
    t0 = time.perf_counter()
    first = None
    frames = chunks = 0
    mux_s = 0.0
    with LiveSession(pipe.engine.submit(spec), fps) as session, ChunkMuxer(width, height, fps) as muxer:
        for chunk in session:
            t_mux = time.perf_counter()
            data = muxer.push(chunk.frames)
            mux_s += time.perf_counter() - t_mux
            if first is None:
                first = time.perf_counter() - t0
                t_first, frames_first = time.perf_counter(), len(chunk.frames)
            frames += len(chunk.frames)
            chunks += 1
            assert data
        stages = session.timings               # the session's own (worker 0's, the lane's VAE), once it has finished
    total = time.perf_counter() - t0
    sustained = (frames - frames_first) / max(1e-9, time.perf_counter() - t_first) if chunks > 1 else 0.0
    row = dict(kind="live", chunks=chunks, frames=frames, seconds=total, first_fragment_s=first,
               fps=sustained, s_per_chunk=(total - first) / max(1, chunks - 1), video_seconds=frames / fps)
    return stage_columns(row, stages, chunks, total, mux_s)


def _switch_row(pipe, width: int, height: int) -> dict:
    t_switch = at_chunk = None
    with pipe.live(PROMPT, seconds=3600, width=width, height=height, seed=0) as session:
        for chunk in session:
            if chunk.index == 2:
                t_switch, at_chunk = time.perf_counter(), chunk.index + 1     # the chunk being made now
                session.switch(SWITCH)
            elif t_switch is not None and chunk.prompt_index == 1:
                return dict(kind="prompt switch", switch_chunks=chunk.index - at_chunk,
                            switch_s=time.perf_counter() - t_switch)
    raise RuntimeError("the switch never applied")


def _memory_rows(pipe, counts: list[int], width: int, height: int) -> list[dict]:
    from longserve.engine import worker

    temporal = pipe.info.frame_multiple
    fb = pipe.info.capabilities.frames_per_chunk // temporal          # latent frames a chunk
    rows = []
    for n in counts:
        frames = 1 + (n * fb - 1) * temporal
        pipe.pool.run(worker.memory_start)
        got = sum(1 for _ in pipe.stream(PROMPT, num_frames=frames, width=width, height=height, seed=0))
        peaks = pipe.pool.run(worker.memory_stop)
        assert got == n, (got, n)
        rows.append(dict(kind="memory", chunks=n, latent_frames=n * fb, peak_bytes=max(peaks),
                         peak_bytes_per_worker=peaks))
        print(f"  memory: {n} chunks ({n * fb} latent frames): peak {max(peaks) / 2**20:.2f} MiB per worker",
              file=sys.stderr, flush=True)
    for r in rows:
        r["vs_first"] = r["peak_bytes"] / rows[0]["peak_bytes"]
    return rows


def build_df_twin(causal_dir: Path, out: Path, window_frames: int) -> Path:
    """A SkyReels-V2 diffusion-forcing checkpoint with the causal model's transformer shape, VAE and text encoder."""
    import torch
    from diffusers import SkyReelsV2Transformer3DModel, UniPCMultistepScheduler

    from tools.weights.seeded import reinit_
    from tools.weights.wan import SKYREELS_V2_SCHEDULER

    out.mkdir(parents=True, exist_ok=True)
    for name in ("text_encoder", "tokenizer", "vae"):
        shutil.copytree(causal_dir / name, out / name, dirs_exist_ok=True)
    t = json.loads((causal_dir / "transformer" / "config.json").read_text())
    keys = ("added_kv_proj_dim", "attention_head_dim", "cross_attn_norm", "eps", "ffn_dim", "freq_dim", "image_dim",
            "in_channels", "num_attention_heads", "num_layers", "out_channels", "patch_size", "pos_embed_seq_len",
            "qk_norm", "rope_max_seq_len", "text_dim")
    with torch.no_grad():
        model = reinit_(SkyReelsV2Transformer3DModel(**{k: t[k] for k in keys if k in t}, inject_sample_info=True,
                                                     num_frame_per_block=1), 0)
    model.save_pretrained(out / "transformer")
    UniPCMultistepScheduler(**{k: v for k, v in SKYREELS_V2_SCHEDULER.items() if not k.startswith("_")}) \
        .save_pretrained(out / "scheduler")
    index = json.loads((causal_dir / "model_index.json").read_text())
    index.update(_class_name="SkyReelsV2DiffusionForcingPipeline", transformer=["diffusers",
                 "SkyReelsV2Transformer3DModel"], scheduler=["diffusers", "UniPCMultistepScheduler"])
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    return out


def _df_row(model_dir: str, config, frames: int, width: int, height: int, steps: int, window: int) -> dict:
    from longserve.pipelines import VideoPipeline

    with tempfile.TemporaryDirectory() as tmp:
        df_dir = build_df_twin(Path(model_dir), Path(tmp) / "df", window)
        base = 1 + (window - 1) * 4
        options = dict(base_num_frames=base, overlap_history=17, ar_step=0, causal_block_size=1)
        with VideoPipeline.from_config(config.replace(model=str(df_dir))) as pipe:
            t0 = time.perf_counter()

            def make() -> int:
                return sum(len(c) for c in pipe.stream(PROMPT, num_frames=frames, width=width, height=height, seed=0,
                                                       num_inference_steps=steps, guidance_scale=6.0, **options))

            got = make()
            seconds = time.perf_counter() - t0
            counts = counted(pipe, make)
    row = dict(kind=f"diffusion forcing ({steps} steps, CFG)", frames=got, seconds=seconds, fps=got / seconds,
               s_per_chunk=None, first_fragment_s=None, chunks=None)
    return add_work(row, counts)


COLUMNS = [
    Column("run", lambda r: r["kind"] if r["kind"] != "live" else f"live, {r['workers']} worker(s), {r['loop']}"),
    Column("frames", "frames"),
    Column("s", "seconds", ".2f"),
    Column("s to first fragment",
           lambda r: "" if r.get("first_fragment_s") is None else f"{r['first_fragment_s']:.2f}"),
    Column("frames / s", "fps", ".1f"),
    Column("cores", lambda r: r.get("pinned") or ""),
    Column("vs 1 worker serial", lambda r: "" if r.get("vs_serial_1") is None else f"{r['vs_serial_1']:.2f}x"),
    Column("ms / chunk: transformer, VAE, transfer, rest; mux", lambda r: "" if "vae_ms_per_chunk" not in r else
           " / ".join(f"{r[f'{k}_ms_per_chunk']:.0f}" for k in ("transformer", "vae", "transfer", "rest"))
           + f"; {r['mux_ms_per_chunk']:.0f}"),
    Column("overlap (stages / wall)", lambda r: "" if "overlap" not in r else f"{r['overlap']:.2f}"),
    Column("switch: chunks after", lambda r: "" if r.get("switch_chunks") is None else str(r["switch_chunks"])),
    Column("vs diffusion forcing", lambda r: "" if r.get("vs_df") is None else f"{r['vs_df']:.1f}x"),
    Column("transformer forwards / frame", lambda r: "" if "forwards_per_frame" not in r else
           f"{r['forwards_per_frame']:.2f}"),
    Column("self-attn q x k pairs / frame", lambda r: "" if "self_pairs_per_frame" not in r else
           f"{r['self_pairs_per_frame']:,.0f}"),
    Column("cross-attn q x k pairs / frame", lambda r: "" if "cross_pairs_per_frame" not in r else
           f"{r['cross_pairs_per_frame']:,.0f}"),
    Column("work vs live", lambda r: "" if "work_vs_live" not in r else f"{r['work_vs_live']:.1f}x"),
]
MEMORY_COLUMNS = [
    Column("workers, loop", lambda r: f"{r['workers']}, {r['loop']}"),
    Column("chunks", "chunks"),
    Column("latent frames", "latent_frames"),
    Column("peak MiB / worker", lambda r: f"{r['peak_bytes'] / 2**20:.2f}"),
    Column("vs first", "vs_first", ".3f"),
]


def run(args) -> int:
    import torch

    from longserve.engine.config import EngineConfig, from_cli_args
    from longserve.engine.families.causal_wan import TIMED_STAGES_ENV
    from longserve.pipelines.video import PIPELINE_DEFAULTS
    from longserve.server.api.protocol import parse_size
    from longserve.weights import resolve_model
    from tools.bench.live_loops import combos, markdown_command, open_pipeline, ratios, say

    # on CUDA the transformer's time needs a sync of its stream per step (the loop does none otherwise); the decode
    # lane's stream is not waited for by it (engine/families/base.py sync_cuda), so the overlap stays measured
    os.environ[TIMED_STAGES_ENV] = "1"
    width, height = parse_size(args.size)
    counts = int_list(args.memory_chunks, "--memory-chunks")
    pairs = combos(int_list(args.workers, "--workers"), [v.strip() for v in args.loops.split(",") if v.strip()])
    model_dir = str(resolve_model(args.model))
    config = from_cli_args(EngineConfig, args, model=model_dir, **{**PIPELINE_DEFAULTS, "workers": pairs[0][0]})
    load = load_average()

    def warm_up(pipe) -> None:
        if not pipe.info.capabilities.live:
            raise ValueError(f"--model: {args.model} is not a causal (live) checkpoint")
        list(pipe.stream(PROMPT, num_frames=2 * pipe.info.frame_multiple + 1, width=width, height=height))

    lives, memory, switch, window = [], [], None, None
    for i, (n, loop) in enumerate(pairs):
        with open_pipeline(config, n, loop, args.threads, args.pin, warm_up) as pipe:
            window = pipe.info.capabilities.live_window
            live = _live_row(pipe, args.seconds, width, height)
            live.update(workers=n, loop=loop, pinned=pipe.pinned, threads=args.threads)
            say(f"  live, {n} worker(s), {loop}: {live['frames']} frames, first fragment "
                f"{live['first_fragment_s']:.2f} s, {live['fps']:.1f} frames/s, overlap {live['overlap']:.2f}")
            row_switch = _switch_row(pipe, width, height)
            live.update(switch_chunks=row_switch["switch_chunks"], switch_s=row_switch["switch_s"])
            if i == 0:
                switch = row_switch
                add_work(live, counted(pipe, lambda: _live_frames(pipe, args.seconds, width, height)))
            if not any(m["loop"] == loop for m in memory):          # each loop's first pair: flat, whatever the loop
                for m in _memory_rows(pipe, counts, width, height):
                    memory.append({**m, "workers": n, "loop": loop})
            lives.append(live)
    ratios(lives)
    rows = list(lives)
    if not args.no_df:
        df = _df_row(model_dir, config.replace(workers=pairs[0][0]), lives[0]["frames"], width, height,
                     args.df_steps, window)
        for live in lives:
            live["vs_df"] = live["fps"] / df["fps"]
        rows.append(df)
    for r in rows:
        if "self_pairs_per_frame" in r:
            r["work_vs_live"] = r["self_pairs_per_frame"] / lives[0]["self_pairs_per_frame"]
    machine = machine_info(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for r in rows + memory + [switch]:
        r.update(machine=machine, model=args.model, size=args.size, loadavg_before=load,
                 loadavg_after=load_average())
        r.setdefault("workers", pairs[0][0])
    table, mem_table = markdown_table(rows, COLUMNS), markdown_table(memory, MEMORY_COLUMNS)
    switch_line = (f"Prompt switch ({pairs[0][0]} worker(s), {pairs[0][1]}): `switch()` called as chunk 2 arrived "
                   f"applied {switch['switch_chunks']} chunk(s) after the chunk then being made, "
                   f"{switch['switch_s']:.2f} s after the call.")
    print()
    print(text_table(rows, COLUMNS))
    print(text_table(memory, MEMORY_COLUMNS))
    print(switch_line)
    if args.json:
        write_json(rows + memory + [switch], args.json)
    if args.markdown:
        command = markdown_command(args, args.memory_chunks)
        pinned = "each worker pinned to a core of its own" if args.pin else "workers not pinned"
        body = (f"Measured with `{command}` on {machine['cpu']} ({machine['cores']} cores, {machine['device']}, "
                f"torch {machine['torch']}; {pinned}); load average before {load}, after "
                f"{rows[-1]['loadavg_after']}. A chunk's stages are measured where they run "
                f"(tools/bench/live_loops.py); 'overlap' is their sum over the wall time. The last four columns "
                f"do not depend on the machine (engine/workcount.py: counted on worker 0 in a second run of the "
                f"first row, after the timed ones); 'work vs live' is the ratio of self-attention pairs a frame."
                f"\n\n{table}\n\nPeak tensor memory per worker by session length (the tracker on; "
                f"engine/memory.py):\n\n{mem_table}\n\n{switch_line}")
        replace_markdown_section(args.markdown, SECTION, body)
    return 0
