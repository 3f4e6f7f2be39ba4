"""`longserve bench transformer`: parallel plans side by side on one denoising step of a video DiT.

    longserve bench transformer [--model latte] --strategies dsp,ulysses,ring,megatron-sp --workers 1,2,4 \\
        [--json out.json] [--plot out.png] [--steps 5 --warmup 2] [--config bench|tiny] \\
        [--frames T] [--size HxW]
    longserve bench transformer --model wan --strategies ulysses,ring,usp --ulysses-degree 2 --workers 1,2,4
    longserve bench transformer --model ltx2-shaped|hunyuan15-shaped [--layers N] [--frames F --size HxW] \\
        [--device cuda --dtype bfloat16]

`--model latte` (the default): DSP vs the embedded sequence-parallel baselines on a
spatial-temporal DiT (below). `--model wan`: Ulysses, Ring and USP on a full-attention
`WanTransformer3DModel` with Wan 2.1 1.3B's width (12 heads x 128 = 1536, FFN 8960, text
dim 4096; `CONFIGS_WAN["bench"]`) but 2 blocks instead of 30, through
`engine.models.wan.WanSequenceParallel` (hooks on diffusers' own forward); every row also carries
`formula_bytes`, what the
plan's formula (docs/design.md) says rank 0 sends per step, beside the measured bytes.
`--model ltx2-shaped|hunyuan15-shaped`: diffusers' LTX-2 / HunyuanVideo-1.5 480p transformer at the published
shape and default video size with random weights (`tools/bench/shaped.py`), every plan the family declares
against diffusers' forward; `--layers` keeps the first N blocks, `--frames`/`--size` the latent frames and size
(patch 1), `--dtype bfloat16` on a GPU. Every row carries `peak_memory_bytes` (below).

What a "step" is: one `LatteTransformer3DModel` forward on a classifier-free-guidance
batch of 2 (the latent duplicated, one timestep, negative and positive text embeddings),
as one denoising step runs it; fp32, `torch.no_grad`, through
`engine.models.latte.parallel_forward(model, x, t, enc, pg, strategy)`.

The model (`CONFIGS["bench"]`): a Latte-shaped transformer with random weights built in
every worker from a seed (same weights on every rank, no checkpoint; speed and bytes do
not depend on the values) -- 8 heads x 48 = hidden 384, 4 spatial + 4 temporal blocks,
MLP 4x, patch 2, 4 latent channels in / 8 out, captions of 120 tokens x 4096 channels
(T5-XXL-shaped, as Latte-1). Input: 16 frames of a 24x24 *latent* (`--size` is the
latent size; x8 through Latte's VAE it is a 192x192-pixel video), i.e. 12x12 = 144
patches per frame. Latte-1 itself is 16 heads x 72, 28 block pairs, 64x64 latents: too
big for a CPU benchmark; this one is sized so one step on 1 worker takes about a second on
a 2-core CPU. `--config tiny` is a seconds-long smoke configuration for tests.

How it is measured:
- One `WorkerPool` per worker count, started once; every strategy is timed on it in the
  same job, interleaved step by step (round r runs step r of every strategy), so that a
  drift in the machine's load hits all strategies alike. `--warmup` rounds are discarded.
- Step time: before each step all ranks meet at a barrier; each rank times its own
  forward from the barrier's release to its end; a step's time is the *largest* of the
  ranks' times (the forward ends in an all-gather, so the ranks finish together); the
  reported `step_time_s` is the median over the `--steps` measured steps.
- Bytes and collectives per step: `engine.comm.STATS` reset before the step and read
  after it, per rank; `bytes_per_step` is the largest rank's bytes sent (standard
  algorithm for each collective, see engine/comm.py), `collectives_per_step` rank 0's calls.
- 1 worker is always measured, and *every* strategy runs on it (the parallel code paths
  differ even with nothing to send, e.g. ring attention's own softmax), plus diffusers'
  own `model(...)` forward as row "diffusers". `speedup` is over the same strategy on 1
  worker; `speedup_vs_diffusers` over the diffusers row.
- `comm_time_s`: wall time inside engine.comm's collectives during the step (packing,
  the transfer, and waiting for slower peers), largest rank, median over steps.
- `max_abs_err`: the last step's output against diffusers' output on the same inputs.
- `peak_memory_bytes`: on CUDA, the largest rank's `torch.cuda.max_memory_allocated` over the strategy's own
  steps (weights included; the counter is reset before each step); on CPU, the largest rank's peak resident
  set over its whole job (`ru_maxrss`: every strategy of that worker count shares it, the model included).
- Workers share the machine: the pool gives each `cores // workers` torch threads (at
  least 1), so more workers than cores oversubscribe the cores.
- Other processes skew timings. Each row records `foreign_cpu_fraction`: the CPU time
  *other* processes used during its pool's timed job, over the machine's core-seconds
  (/proc/stat minus the benchmark's own processes); above 5% the run prints a warning.
  `loadavg_before` / `loadavg_after` (which count the benchmark's own processes) too.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import time

from tools.bench import util as benchutil

# engine.models.latte.STRATEGIES (not imported: --help stays fast)
STRATEGIES = ("dsp", "ulysses", "ring", "megatron-sp")
WAN_STRATEGIES = ("ulysses", "ring", "usp")              # engine.families.wan.WanFamily.plans
REFERENCE = "diffusers"
SHAPED = ("ltx2-shaped", "hunyuan15-shaped")             # tools/bench/shaped.py

#: Model and input configurations. heads x head_dim = hidden; frames and latent size are
#: the defaults of --frames / --size.
CONFIGS: dict[str, dict] = {
    "bench": dict(heads=8, head_dim=48, layers=4, frames=16, latent=(24, 24), caption_channels=4096, text_len=120),
    "tiny": dict(heads=2, head_dim=16, layers=2, frames=8, latent=(8, 8), caption_channels=32, text_len=8),
}
PATCH = 2
IN_CHANNELS, OUT_CHANNELS = 4, 8

#: Wan-shaped configurations: "bench" has Wan 2.1 T2V 1.3B's width, heads, FFN and text dim
#: (weights.wan.WAN_2_1_T2V_1_3B_TRANSFORMER) with 2 of its 30 blocks; frames are latent frames.
CONFIGS_WAN: dict[str, dict] = {
    "bench": dict(heads=12, head_dim=128, layers=2, ffn=8960, text_dim=4096, in_channels=16, frames=5,
                  latent=(16, 16), text_len=512),
    "tiny": dict(heads=3, head_dim=12, layers=2, ffn=48, text_dim=16, in_channels=4, frames=5, latent=(10, 14),
                 text_len=8),
}


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="latte", choices=["latte", "wan", *SHAPED],
                        help="latte: a spatial-temporal DiT (DSP and baselines); wan: a full-attention DiT; "
                             "ltx2-shaped / hunyuan15-shaped: LTX-2's / HunyuanVideo-1.5 480p's published transformer "
                             "shape, random weights (tools/bench/shaped.py)")
    parser.add_argument("--strategies", default=None,
                        help=f"comma-separated, of {', '.join(STRATEGIES)} (latte) or {', '.join(WAN_STRATEGIES)} "
                             f"(wan; the shaped models: their family's plans) (default: all of the model's)")
    parser.add_argument("--ulysses-degree", type=int, default=2,
                        help="usp: Ulysses group size (at N workers: gcd(it, N); ring degree N / that)")
    parser.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated (1 is always measured)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per strategy (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="discarded steps per strategy before measuring")
    parser.add_argument("--config", default="bench", choices=sorted(CONFIGS),
                        help="model/input size (shaped models: bench = the published shape, tiny = the tiny "
                             "checkpoint's)")
    parser.add_argument("--layers", type=int, default=None, help="transformer blocks (default: the config's)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and activations (bfloat16: for a GPU)")
    parser.add_argument("--frames", type=int, default=None, help="frames T (default: the config's)")
    parser.add_argument("--size", default=None, metavar="HxW",
                        help=f"latent height x width, divisible by the patch size ({PATCH}; 1 for the shaped models) "
                             f"(default: the config's)")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if present")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument("--plot", default=None, metavar="PATH", help="write a PNG: step time and bytes vs workers")


# -- the model, built identically in every worker --------------------------------------


def model_config(name: str, frames: int | None = None, size: tuple[int, int] | None = None,
                 model: str = "latte", layers: int | None = None) -> dict:
    if model in SHAPED:
        from tools.bench import shaped

        cfg = dict(shaped.model_config(model, name), model=model)
        if layers is not None:
            cfg["transformer"]["num_layers"] = layers
    else:
        cfg = dict((CONFIGS_WAN if model == "wan" else CONFIGS)[name], model=model)
        if layers is not None:
            cfg["layers"] = layers
    if frames is not None:
        cfg["frames"] = frames
    if size is not None:
        cfg["latent"] = tuple(size)
    return cfg


def build_model(cfg: dict, seed: int):
    """The benchmark's transformer: seeded random weights, activations unit-size."""
    from tools.bench.models import random_latte_transformer, random_wan_transformer

    if cfg.get("model") == "wan":
        return random_wan_transformer(cfg["heads"], cfg["head_dim"], cfg["layers"], cfg["text_dim"],
                                      cfg["in_channels"], ffn_dim=cfg["ffn"], seed=seed)
    return random_latte_transformer(cfg["heads"], cfg["head_dim"], cfg["layers"], video_length=cfg["frames"],
                                    sample_size=cfg["latent"][0], caption_channels=cfg["caption_channels"],
                                    seed=seed)


def step_inputs(cfg: dict, seed: int):
    """A CFG batch of 2: the same latent twice, one timestep, negative + positive text embeddings.

    -> x (2, C, T, H, W), t (2,), enc (2, text_len, caption_channels)
    """
    import torch

    g = torch.Generator().manual_seed(seed + 2)
    H, W = cfg["latent"]
    wan = cfg.get("model") == "wan"
    latent = torch.randn(1, cfg["in_channels"] if wan else IN_CHANNELS, cfg["frames"], H, W, generator=g)
    x = torch.cat([latent, latent])                                         # (2, C, T, H, W)
    t = torch.full((2,), 500.0) if wan else torch.full((2,), 500, dtype=torch.long)
    enc = torch.randn(2, cfg["text_len"], cfg["text_dim"] if wan else cfg["caption_channels"], generator=g)
    return x, t, enc


def usp_degree(requested: int, workers: int) -> int:
    import math

    return math.gcd(requested, workers)


def formula_bytes(cfg: dict, plan: str, n: int, k: int) -> float | None:
    """Bytes rank 0 sends per step by the plan's formula (docs/design.md), fp32; None for Latte's plans."""
    import math

    if cfg.get("model") in SHAPED:
        return None
    if cfg.get("model") != "wan" or n == 1:
        return None if cfg.get("model") != "wan" else 0.0
    B, e, L, H, hd = 2, 4, cfg["layers"], cfg["heads"], cfg["head_dim"]
    h, w = cfg["latent"][0] // PATCH, cfg["latent"][1] // PATCH
    S = cfg["frames"] * h * w
    Sl = math.ceil(S / n)
    gather = (n - 1) * B * Sl * PATCH * PATCH * cfg["in_channels"] * e
    if plan == "ulysses":
        return L * 4 * B * Sl * math.ceil(H / n) * n * hd * e * (n - 1) / n + gather
    if plan == "ring":
        return L * (n - 1) * 2 * B * H * Sl * hd * e + gather
    r = n // k
    Hl = math.ceil(H / k)
    return L * 4 * B * Sl * Hl * k * hd * e * (k - 1) / k + L * (r - 1) * 2 * B * Hl * k * Sl * hd * e + gather


def _bench_job(ctx, cfg: dict, seed: int, strategies: list[str], steps: int, warmup: int,
               ulysses_degree: int = 2, dtype: str = "float32") -> dict:
    """On every worker: time `warmup + steps` interleaved rounds of every strategy.

    Returns this rank's {"times": {s: [s]}, "bytes": {s: [b]}, "calls": {s: {kind: n}},
    "output": {s: last output (rank 0 only)}}.
    """
    import torch
    import torch.distributed as dist

    from longserve.engine import comm
    from longserve.engine.models import latte
    from longserve.engine.models.wan import WanSequenceParallel
    from longserve.engine.parallel import make_sequence_parallel
    from tools.bench import shaped

    pg = ctx.pg
    name, dt = cfg.get("model"), getattr(torch, dtype)
    key = ("bench_model", tuple(sorted((k, str(v)) for k, v in cfg.items())), seed, dtype)
    if ctx.state.get("model_key") != key:
        for held in ("model", "hooked"):                                       # free the last one first
            ctx.state.pop(held, None)
        if name in SHAPED:
            ctx.state["model"] = shaped.build(name, cfg, seed, pg.device, dt)
            ctx.state["hooked"] = shaped.wrap(name, ctx.state["model"])
        else:
            ctx.state["model"] = build_model(cfg, seed).to(pg.device, dt)
            ctx.state["hooked"] = WanSequenceParallel(ctx.state["model"]) if name == "wan" else None
        ctx.state["model_key"] = key
    model, hooked = ctx.state["model"], ctx.state["hooked"]
    if name in SHAPED:
        kw = shaped.step_inputs(name, cfg, seed, pg.device, dt)
    else:
        x, t, enc = (v.to(pg.device) for v in step_inputs(cfg, seed))
        x, enc = x.to(dt), enc.to(dt)
    cuda = pg.device.type == "cuda"

    if name != "latte":
        sps = {s: make_sequence_parallel(pg, s, usp_degree(ulysses_degree, pg.world_size) if s == "usp" else None)
               for s in strategies if s != REFERENCE}

    def forward(strategy):
        if name in SHAPED:
            if strategy == REFERENCE:
                return shaped.reference(name, model, kw)
            return shaped.parallel(name, hooked, kw, sps[strategy])
        if strategy == REFERENCE:
            return model(x, timestep=t, encoder_hidden_states=enc, return_dict=False)[0]
        if name == "wan":
            return hooked(x, t, enc, sps[strategy])
        return latte.parallel_forward(model, x, t, enc, pg, strategy)

    times = {s: [] for s in strategies}
    sent = {s: [] for s in strategies}
    in_comm = {s: [] for s in strategies}
    peak = {s: 0 for s in strategies}
    calls, outputs = {}, {}
    with torch.no_grad(), _timed_collectives() as comm_clock:
        for r in range(warmup + steps):
            for s in strategies:
                if pg.world_size > 1:
                    dist.barrier(group=pg.group)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(pg.device)
                comm.STATS.reset()
                comm_clock[0] = 0.0
                t0 = time.perf_counter()
                out = forward(s)                                            # (2, C_out, T, H, W)
                if cuda:
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t0
                stats = comm.STATS.snapshot()
                peak[s] = max(peak[s], torch.cuda.max_memory_allocated(pg.device) if cuda else _peak_rss())
                if r >= warmup:
                    times[s].append(elapsed)
                    sent[s].append(stats["bytes_sent"])
                    in_comm[s].append(comm_clock[0])
                    calls[s] = stats["calls"]
                if r == warmup + steps - 1 and pg.rank == 0:
                    outputs[s] = out.float().cpu()
                del out
    return {"times": times, "bytes": sent, "comm_s": in_comm, "calls": calls, "output": outputs, "peak": peak}


def _peak_rss() -> int:
    """This process's peak resident set so far, in bytes (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextlib.contextmanager
def _timed_collectives():
    """Accumulate the wall time spent inside engine.comm's collectives into clock[0].

    Wraps the module attributes that the forwards call (`comm.gather` goes through
    `comm.all_gather`); the time includes packing/unpacking and waiting for slower peers.
    """
    from longserve.engine import comm

    clock = [0.0]
    names = ("all_to_all_switch", "all_gather", "reduce_scatter", "ring_shift")
    saved = {name: getattr(comm, name) for name in names}

    def timed(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock[0] += time.perf_counter() - t0
        return wrapper

    try:
        for name, fn in saved.items():
            setattr(comm, name, timed(fn))
        yield clock
    finally:
        for name, fn in saved.items():
            setattr(comm, name, fn)


# -- the sweep -----------------------------------------------------------------------


def parse_size(text: str | None, patch: int = PATCH) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--size: expected HxW (latent height x width, e.g. 24x24), got {text!r}") from None
    if h < patch or w < patch or h % patch or w % patch:
        raise ValueError(f"--size: latent height and width must be positive multiples of the patch size {patch}, "
                         f"got {text!r}")
    return h, w


def known_strategies(model: str) -> tuple[str, ...]:
    if model in SHAPED:
        from tools.bench import shaped

        return shaped.strategies(model)
    return WAN_STRATEGIES if model == "wan" else STRATEGIES


def parse_strategies(text: str | None, model: str = "latte") -> list[str]:
    known = known_strategies(model)
    if text is None:
        return list(known)
    strategies = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in known]
    if not strategies or unknown:
        raise ValueError(f"--strategies: must be a comma-separated list of {', '.join(known)} for --model {model}; "
                         f"got {text!r}")
    return list(dict.fromkeys(strategies))


def command_line(args) -> str:
    cmd = "longserve bench transformer" + (f" --model {args.model}" if args.model != "latte" else "")
    cmd += f" --strategies {','.join(parse_strategies(args.strategies, args.model))} --workers {args.workers}"
    if args.model != "latte" and args.ulysses_degree != 2:
        cmd += f" --ulysses-degree {args.ulysses_degree}"
    if args.config != "bench":
        cmd += f" --config {args.config}"
    for opt in ("steps", "warmup", "layers", "frames", "size", "device", "dtype", "seed"):
        default = {"steps": 5, "warmup": 2, "seed": 0, "dtype": "float32"}.get(opt)
        v = getattr(args, opt)
        if v is not None and v != default:
            cmd += f" --{opt} {v}"
    for opt in ("json", "plot"):
        if getattr(args, opt):
            cmd += f" --{opt} {getattr(args, opt)}"
    return cmd


def measure(args) -> list[dict]:
    import torch

    from longserve.engine.dist import default_device
    from longserve.engine.pool import WorkerPool

    strategies = parse_strategies(args.strategies, args.model)
    worker_counts = sorted(set(benchutil.int_list(args.workers, "--workers")) | {1})
    if args.steps < 1:
        raise ValueError(f"--steps: must be at least 1, got {args.steps}")
    if args.warmup < 0:
        raise ValueError(f"--warmup: must be at least 0, got {args.warmup}")
    if args.frames is not None and args.frames < 1:
        raise ValueError(f"--frames: must be at least 1, got {args.frames}")
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers: must be at least 1, got {args.layers}")
    shaped_model = args.model in SHAPED
    cfg = model_config(args.config, args.frames, parse_size(args.size, 1 if shaped_model else PATCH), args.model,
                       args.layers)
    device = args.device or default_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda requested but no CUDA device is visible")
    if args.dtype == "bfloat16" and device != "cuda":
        raise ValueError("--dtype: bfloat16 is for --device cuda (CPU timings in bfloat16 mean little)")
    machine = benchutil.machine_info(device)
    if shaped_model:
        from tools.bench import shaped

        model_desc = {"model": args.model, **shaped.describe(cfg), "transformer": cfg["transformer"], "batch": 2,
                      "dtype": args.dtype}
    else:
        hidden = cfg["heads"] * cfg["head_dim"]
        H, W = cfg["latent"]
        channels = ({"in_channels": cfg["in_channels"], "out_channels": cfg["in_channels"]} if args.model == "wan"
                    else {"in_channels": IN_CHANNELS, "out_channels": OUT_CHANNELS})
        model_desc = {**cfg, **channels, "hidden": hidden, "patch": PATCH, "latent": [H, W],
                      "patches_per_frame": (H // PATCH) * (W // PATCH), "batch": 2, "dtype": args.dtype}
    print(f"bench transformer: config {args.config} {model_desc}, {machine}", file=sys.stderr, flush=True)

    rows: list[dict] = []
    reference_out = None
    for n in worker_counts:
        jobs = ([REFERENCE] if n == 1 else []) + strategies
        load = benchutil.load_average()
        t_start = time.perf_counter()
        with WorkerPool(n, device=device) as pool:
            foreign = benchutil.ForeignLoad().start([os.getpid(), *pool.pids])
            results = pool.run(_bench_job, cfg, args.seed, jobs, args.steps, args.warmup, args.ulysses_degree,
                               args.dtype)
            foreign.stop()
        elapsed = time.perf_counter() - t_start
        load_after = benchutil.load_average()
        for s in jobs:
            per_step = [max(r["times"][s][i] for r in results) for i in range(args.steps)]
            out = results[0]["output"][s]
            if s == REFERENCE:
                reference_out = out
            rows.append({
                "strategy": s,
                "workers": n,
                "step_time_s": statistics.median(per_step),
                "step_time_min_s": min(per_step),
                "step_time_max_s": max(per_step),
                "step_times_s": per_step,
                "comm_time_s": statistics.median(max(r["comm_s"][s][i] for r in results) for i in range(args.steps)),
                "bytes_per_step": max(r["bytes"][s][-1] for r in results),
                "collectives_per_step": dict(sorted(results[0]["calls"][s].items())),
                "max_abs_err": float((out - reference_out).abs().max()),
                "peak_memory_bytes": max(r["peak"][s] for r in results),
                "peak_memory_kind": "cuda_max_allocated" if device == "cuda" else "cpu_peak_rss_whole_job",
                "formula_bytes": formula_bytes(cfg, s, n, usp_degree(args.ulysses_degree, n)),
                "ulysses_degree": usp_degree(args.ulysses_degree, n) if s == "usp" else None,
                "config": args.config,
                "model": model_desc,
                "steps": args.steps,
                "warmup": args.warmup,
                "timing": "per step: max over ranks of barrier-release-to-forward-end wall time; median over steps",
                "foreign_cpu_fraction": foreign.fraction,
                "loadavg_before": load,
                "loadavg_after": load_after,
                "machine": machine,
            })
            _print_row(rows[-1])
        print(f"  ({n} worker(s): {elapsed:.1f} s including pool start)", file=sys.stderr, flush=True)
        if foreign.fraction is not None and foreign.fraction > 0.05:
            print(f"  warning: other processes used {foreign.fraction:.0%} of the machine's CPU while "
                  f"{n} worker(s) were measured; their timings are skewed", file=sys.stderr, flush=True)

    one = {r["strategy"]: r["step_time_s"] for r in rows if r["workers"] == 1}
    for r in rows:
        r["speedup"] = one[r["strategy"]] / r["step_time_s"]
        r["speedup_vs_diffusers"] = one[REFERENCE] / r["step_time_s"]
    return rows


def _print_row(r: dict) -> None:
    print(f"  {r['strategy']:<12} workers={r['workers']}  {r['step_time_s']:7.3f} s/step  "
          f"{r['bytes_per_step'] / 2**20:8.2f} MiB sent/rank  peak {r['peak_memory_bytes'] / 2**30:.2f} GiB  "
          f"err {r['max_abs_err']:.1e}",
          file=sys.stderr, flush=True)


def _mib(v) -> str:
    return f"{v / 2**20:.2f}"


def _calls(calls: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(calls.items())) or "-"


COLUMNS = [
    benchutil.Column("strategy", "strategy"),
    benchutil.Column("workers", "workers"),
    benchutil.Column("step s (median)", "step_time_s", ".3f"),
    benchutil.Column("min-max s", lambda r: f"{r['step_time_min_s']:.3f}-{r['step_time_max_s']:.3f}"),
    benchutil.Column("in collectives s", "comm_time_s", ".3f"),
    benchutil.Column("speedup vs 1 worker", "speedup", ".2f"),
    benchutil.Column("vs diffusers", "speedup_vs_diffusers", ".2f"),
    benchutil.Column("MiB sent / rank / step", "bytes_per_step", _mib),
    benchutil.Column("formula MiB", lambda r: "-" if r.get("formula_bytes") is None else _mib(r["formula_bytes"])),
    benchutil.Column("collectives / step", "collectives_per_step", _calls),
    benchutil.Column("peak GiB", "peak_memory_bytes", lambda v: f"{v / 2**30:.2f}"),
    benchutil.Column("max abs err", "max_abs_err", ".1e"),
]


TITLES = {"wan": "Wan-shaped", "ltx2-shaped": "LTX-2-shaped", "hunyuan15-shaped": "HunyuanVideo-1.5-shaped"}


def plot(rows: list[dict], path: str) -> None:
    ref = next(r for r in rows if r["strategy"] == REFERENCE)
    parallel = [r for r in rows if r["strategy"] != REFERENCE]
    # bytes are 0 on 1 worker: leave those points off the log-scale panel
    plotted = [dict(r, bytes_plot=r["bytes_per_step"] or None) for r in parallel]
    m = rows[0]["model"]
    benchutil.plot_lines(
        plotted, path, x="workers", group="strategy",
        panels=[benchutil.Panel("step_time_s", "seconds per step (median)", "step time (lower is better)"),
                benchutil.Panel("bytes_plot", "MiB sent per rank per step", "communication (log scale; 0 on 1 worker)",
                                scale=2**20, log_y=True)],
        hlines={0: [(ref["step_time_s"], "diffusers, 1 worker")]},
        title=(f"{TITLES.get(m.get('model'), 'Latte-shaped')} transformer step: {m['layers']} blocks, "
               f"hidden {m['hidden']}, "
               f"{m['frames']} frames x {m['patches_per_frame']} patches, CFG batch 2, {m['dtype']}, "
               f"{ref['machine']['backend']} on {ref['machine']['cores']} {ref['machine']['device']} cores"),
    )


def run(args) -> int:
    rows = measure(args)
    print()
    print(benchutil.text_table(rows, COLUMNS))
    print()
    print(benchutil.markdown_table(rows, COLUMNS))
    if args.json:
        benchutil.write_json(rows, args.json)
    if args.plot:
        plot(rows, args.plot)
    print(f"\n{command_line(args)}", file=sys.stderr)
    return 0
