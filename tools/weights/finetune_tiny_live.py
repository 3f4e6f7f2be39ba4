"""Fine-tune `weights/tiny-live`'s transformer on its own rollouts, so that its bounce keeps its height over a long
stream (issue 45): the second stage of tiny-live's recipe, after `tools.weights.train_tiny_live`'s teacher forcing.

Usage::

    python -m tools.weights.train_tiny_live --out /tmp/stage1                 # stage one (teacher forcing)
    python -m tools.weights.finetune_tiny_live --source /tmp/stage1           # stage two: writes weights/tiny-live
    python -m tools.weights.finetune_tiny_live --source DIR --out DIR2 --steps 4 --clips 2   # a smoke run

Why. Teacher forcing only ever shows the model the clips' own frames as context, recomputed from the window alone.
Its few-step chunks are a little flatter than the clips' and the next chunk continues the arc its context shows, so
lost height is never won back; and the runtime's cache is another form again (each chunk's K/V written once, by its
context pass, so deeper layers of a cached frame carry the context of their time). In `make demo-live` the ball's
vertical range fell from 34 px in the first 3 s to 5 px at 12-15 s; the recompute sampler decays less (weights/
README.md has the figures). Self-Forcing and LongLive fight that drift by training on the model's own rollouts.

What this does (a DAgger-like self-rollout; no teacher model exists for a distribution-matching loss): each step
has, besides a few of stage one's teacher-forced windows (so that colour and switches are kept), `CACHE_BATCH`
rollout windows in the runtime's form (`CacheRollouts`, `tools.weights.live_cache_rollout`): a clip's chunks
0..a-1 written into the engine's own KV cache by context passes, `k` (0..`MAX_ROLLOUT`) chunks made by the model as
the engine makes them, then the clip's next chunk, noised at one of the warped timesteps, trained over that cache:
"from where your own chunks left the ball, go back to the clip's arc". The model's chunks keep the clip's phase over
a few chunks, so the target continues them; what it corrects is what a long stream accumulates. `--roll-batch` adds
rollout windows in stage one's recompute form (`Rollouts`; not used by the shipped run). The checkpoint is then
written with the window it runs at (`RUNTIME_LOCAL_ATTN_SIZE`, `RUNTIME_SINK_SIZE`; the rollouts run at the source's).
Only the transformer changes: the VAE, text encoder, tokenizer and scheduler are the source checkpoint's, byte for
byte (tiny-skyreels-df, tiny-i2v and tiny-decoder-live rely on tiny-live's VAE).

Seeded like stage one (numpy and torch generators, deterministic algorithms, a fixed thread count): the same
source checkpoint (its digest is in the record), seed, thread count, CPU and library versions give the same file.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")      # see train_tiny_live.py: changes no result

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from longserve.weights.causal_wan import (  # noqa: E402
    CAUSAL_CONFIG_FILE,
    load_causal_transformer,
    read_causal_config,
    to_upstream,
)
from longserve.weights.registry import TINY_MODELS  # noqa: E402
from tools.weights.clips import render_long_clip  # noqa: E402
from tools.weights.live_teacher_forcing import (  # noqa: E402
    F_B,
    LOCAL_ATTN_SIZE,
    SINK_SIZE,
    Windows,
    flow_loss,
    install_processors,
    restore_processors,
    two_stream_forward,
)
from tools.weights.loop import train_with_ema  # noqa: E402
from tools.weights.train_tiny_latte import run_provenance, seed_everything  # noqa: E402
from tools.weights.train_tiny_live import (  # noqa: E402
    CLIP_FRAMES,
    PROMPTS,
    chunk_prompts,
    clip_schedule,
    compress_text,
    encode_clips,
    encode_prompts,
    load_text,
    warped_timesteps,
)
from tools.weights.writing import file_digests, write_whole  # noqa: E402

SEED = 1
THREADS = 1
DEFAULT_SOURCE = DEFAULT_OUT = TINY_MODELS["tiny-live"]
RECORDS = DEFAULT_OUT.parent
CLIPS = 48
STEPS = 400
START_BATCH, SINK_BATCH, ROLL_BATCH, CACHE_BATCH = 4, 8, 0, 12
MAX_ROLLOUT = 8                                 # chunks the model makes before the trained one
MAX_CACHE_START = 12                            # runtime-form windows: clip chunks written before the model's
# the window the fine-tuned model runs with (causal_config.json; stage one's is 12 frames with a 3-frame sink): a
# 6-frame sink (the first two chunks: the ball's whole first fall) and the same 6 recent frames (see weights/README.md)
RUNTIME_LOCAL_ATTN_SIZE, RUNTIME_SINK_SIZE = 15, 6
LR = 8e-4
WARMUP = 20
WEIGHT_DECAY = 0.01
EMA_DECAY = 0.99


class Rollouts:
    """Rollout windows: (x0, [n - 1], clean captions, noisy caption) as `Windows.sink` gives them, with the recent
    context the model's own chunks (see the module docstring)."""

    def __init__(self, windows: Windows, model, layout, text, text_bias, g: torch.Generator):
        self.w, self.model, self.layout, self.text, self.text_bias, self.g = windows, model, layout, text, text_bias, g
        self.sigmas = [t / 1000 for t in warped_timesteps()]

    @torch.no_grad()
    def _chunk(self, context: torch.Tensor, caption: torch.Tensor) -> torch.Tensor:
        """The model's next chunk after `context` (B, C, L - F_B, h, w), all under `caption` (B,) (recache)."""
        B, C, P, h, w = context.shape
        n = P // F_B
        x = torch.randn((B, C, F_B, h, w), generator=self.g)
        for i, s in enumerate(self.sigmas):
            t = torch.full((B, 1), 1000.0 * s)
            v = two_stream_forward(self.model, self.layout, context, x, [n], t, self.text, self.text_bias,
                                   caption[:, None].expand(B, n), caption[:, None])
            x0 = x - s * v
            if i + 1 < len(self.sigmas):
                x = (1 - self.sigmas[i + 1]) * x0 + self.sigmas[i + 1] * torch.randn(x0.shape, generator=self.g)
        return x0

    def __call__(self, batch: int):
        n = LOCAL_ATTN_SIZE // F_B
        sink_chunks = SINK_SIZE // F_B
        recent = n - 1 - sink_chunks
        k = 1 + self.w._int(MAX_ROLLOUT)                                 # the same for the batch: one forward
        latents, prompts = self.w.latents, self.w.prompts
        rows, firsts = [], []
        for _ in range(batch):
            rows.append(self.w._int(len(latents)))
            firsts.append(sink_chunks + self.w._int(self.w.chunks - sink_chunks - recent - k))
        frames = lambda chunks: [c * F_B + f for c in chunks for f in range(F_B)]   # noqa: E731
        context = torch.stack([latents[i][:, frames(list(range(sink_chunks)) + list(range(a, a + recent)))]
                               for i, a in zip(rows, firsts)])
        for j in range(k):
            made = self._chunk(context, torch.stack([prompts[i, a + recent + j] for i, a in zip(rows, firsts)]))
            context = torch.cat([context[:, :, :SINK_SIZE], context[:, :, SINK_SIZE + F_B:], made], dim=2)
        target = torch.stack([latents[i][:, frames([a + recent + k])] for i, a in zip(rows, firsts)])
        caption = torch.stack([prompts[i, a + recent + k] for i, a in zip(rows, firsts)])
        return (torch.cat([context, target], dim=2), [n - 1], caption[:, None].expand(batch, n - 1).clone(),
                caption[:, None])


class CacheRollouts:
    """Rollout windows in the runtime's form (`live_cache_rollout.CacheRollout`): the clip's chunks 0..a-1 written
    into a cache by context passes, `k` (0..max_rollout) chunks made by the model over it as the engine makes them,
    then the clip's chunk a + k, noised, predicted over that cache; returns its flow loss. k = 0 is teacher forcing
    in the runtime's form (each cached frame's K/V from its own context pass)."""

    def __init__(self, windows: Windows, rollout, embeds: torch.Tensor, timesteps: torch.Tensor, g: torch.Generator,
                 max_rollout: int = MAX_ROLLOUT):
        self.w, self.r, self.embeds, self.timesteps, self.g = windows, rollout, embeds, timesteps, g
        self.max_rollout = max_rollout

    def __call__(self, batch: int) -> torch.Tensor:
        latents, prompts = self.w.latents, self.w.prompts
        k = self.w._int(self.max_rollout + 1)                            # 0: the clip's own chunks only
        a = 2 + self.w._int(MAX_CACHE_START - 1)                         # 2..MAX_CACHE_START clip chunks first
        rows = [self.w._int(len(latents)) for _ in range(batch)]
        text = self.embeds[torch.stack([prompts[i, a + k] for i in rows])]  # the trained chunk's caption (recache)
        self.r.new_rows(batch, text.shape[1])
        chunk = lambda c: torch.stack([latents[i][:, c * F_B:(c + 1) * F_B] for i in rows])   # noqa: E731
        for c in range(a):
            self.r.context(chunk(c), text)
        for _ in range(k):
            self.r.make(text, self.g)
        x0 = chunk(a + k)
        t = self.timesteps[torch.randint(len(self.timesteps), (batch,), generator=self.g)]
        noise = torch.randn(x0.shape, generator=self.g)
        sigma = (t / 1000).view(-1, 1, 1, 1, 1)
        v = self.r.flow((1 - sigma) * x0 + sigma * noise, t, text)
        return ((v - (noise - x0)) ** 2).mean()


def finetune(out: Path, source: Path = DEFAULT_SOURCE, seed: int = SEED, steps: int = STEPS, clips: int = CLIPS,
             threads: int = THREADS, lr: float = LR, roll_batch: int = ROLL_BATCH, cache_batch: int = CACHE_BATCH,
             max_rollout: int = MAX_ROLLOUT, snapshot_every: int = 0, record_path: Path | None = None,
             log=print) -> dict:
    threads_before, deterministic_before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        return _finetune(Path(out), Path(source), seed=seed, steps=steps, n_clips=clips, threads=threads, lr=lr,
                         roll_batch=roll_batch, cache_batch=cache_batch, max_rollout=max_rollout,
                         snapshot_every=snapshot_every,
                         record_path=record_path, log=log)
    finally:
        torch.set_num_threads(threads_before)
        torch.use_deterministic_algorithms(deterministic_before)


def write_checkpoint(out: Path, source: Path, state_dict: dict, weights: str) -> None:
    """`source`'s directory with its transformer weights replaced by `state_dict`'s (written whole)."""
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        cfg = json.loads((tmp / CAUSAL_CONFIG_FILE).read_text())
        cfg.update(local_attn_size=RUNTIME_LOCAL_ATTN_SIZE, sink_size=RUNTIME_SINK_SIZE)
        (tmp / CAUSAL_CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
        save_file({k: v.detach().contiguous() for k, v in to_upstream(state_dict).items()}, str(tmp / weights))

    write_whole(out, write)


def _finetune(out, source, *, seed, steps, n_clips, threads, lr, roll_batch, cache_batch, max_rollout, snapshot_every,
              record_path, log) -> dict:
    from diffusers import AutoencoderKLWan

    t_start, cpu_start = time.perf_counter(), time.process_time()
    seed_everything(seed, threads)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    source_digests = file_digests(source)
    cfg = read_causal_config(source)

    tokenizer, encoder = load_text(source)
    embeds = encode_prompts(tokenizer, encoder, PROMPTS)
    text, text_bias = compress_text(embeds)

    t0 = time.perf_counter()
    schedules = [clip_schedule(rng, CLIP_FRAMES) for _ in range(n_clips)]
    clips = [render_long_clip(s, CLIP_FRAMES, rng) for s in schedules]
    prompts = torch.tensor([chunk_prompts(s, CLIP_FRAMES) for s in schedules])
    vae = AutoencoderKLWan.from_pretrained(source, subfolder="vae").eval()
    raw = encode_clips(vae, clips)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    latents = (raw - mean) / std
    del clips, vae
    data_s = time.perf_counter() - t0
    log(f"rendered and encoded {n_clips} clips of {CLIP_FRAMES} frames in {data_s:.0f} s")

    t0 = time.perf_counter()
    model = load_causal_transformer(source)
    for p in model.parameters():
        p.requires_grad_(True)
    layout = install_processors(model)
    timesteps = torch.tensor(warped_timesteps())
    windows = Windows(latents, prompts, g)
    rollouts = Rollouts(windows, model, layout, text, text_bias, g)
    if cache_batch:
        from longserve.engine.models.causal import CausalConfig
        from tools.weights.live_cache_rollout import CacheRollout

        h, w = latents.shape[-2:]
        cache_rollouts = CacheRollouts(windows, CacheRollout(model, CausalConfig.from_dict(cfg), h, w),
                                       torch.stack([embeds[p] for p in PROMPTS]), timesteps, g, max_rollout)

    def step_loss(step: int):
        parts = {}
        if START_BATCH:
            parts["start"] = (START_BATCH, flow_loss(model, layout, windows.start(START_BATCH), timesteps, text,
                                                     text_bias, g))
        if SINK_BATCH:
            parts["sink"] = (SINK_BATCH, flow_loss(model, layout, windows.sink(SINK_BATCH), timesteps, text,
                                                   text_bias, g))
        if roll_batch:
            parts["rollout"] = (roll_batch, flow_loss(model, layout, rollouts(roll_batch), timesteps, text,
                                                      text_bias, g))
        if cache_batch:
            parts["cache"] = (cache_batch, cache_rollouts(cache_batch))
        loss = sum(b * v for b, v in parts.values()) / sum(b for b, _ in parts.values())
        return loss, {name: v.item() for name, (_, v) in parts.items()}

    def snapshot(done: int, ema: dict) -> None:       # experiments: the EMA weights every `snapshot_every` steps
        if snapshot_every and done % snapshot_every == 0 and done < steps:
            write_checkpoint(out.parent / f"{out.name}-step{done}", source, ema, cfg["weights"])

    records = train_with_ema(model, step_loss, steps, lr=lr, warmup=WARMUP, weight_decay=WEIGHT_DECAY,
                             ema_decay=EMA_DECAY, log=log, name="rollout fine-tune", on_step=snapshot)
    restore_processors(model)
    train_s = time.perf_counter() - t0

    write_checkpoint(out, source, model.state_dict(), cfg["weights"])
    wall_s, cpu_s = time.perf_counter() - t_start, time.process_time() - cpu_start
    record = {
        "seed": seed, "threads": threads, "steps": steps, "clips": n_clips, "clip_frames": CLIP_FRAMES,
        "start_batch": START_BATCH, "sink_batch": SINK_BATCH, "rollout_batch": roll_batch,
        "cache_rollout_batch": cache_batch, "max_rollout_chunks": max_rollout, "max_cache_start": MAX_CACHE_START,
        "lr": lr, "warmup": WARMUP, "ema_decay": EMA_DECAY,
        "source_files": source_digests,
        "final_loss": {name: float(np.mean(v[-50:])) for name, v in records.items()},
        "losses": {name: [round(x, 5) for x in v] for name, v in records.items()},
        "seconds": {"data": round(data_s, 1), "transformer": round(train_s, 1), "total": round(wall_s, 1)},
        "cpu_seconds": round(cpu_s, 1),
        **run_provenance(out, "tools.weights.finetune_tiny_live", threads),
    }
    if record_path is not None:
        Path(record_path).write_text(json.dumps(record, indent=1) + "\n")
    log(f"wrote {out} in {wall_s / 60:.1f} min ({cpu_s / 60:.1f} min of CPU): "
        + ", ".join(f"{k} {v:.4f}" for k, v in record["final_loss"].items()))
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.weights.finetune_tiny_live",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--source", required=True, help="the stage-one checkpoint (python -m tools.weights.train_tiny_live "
                                                    "--out DIR; weights/tiny-live before issue 45)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help=f"output directory (default: {DEFAULT_OUT})")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--clips", type=int, default=CLIPS, help=f"long training clips of {CLIP_FRAMES} frames")
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--threads", type=int, default=THREADS, help="torch CPU threads (results depend on it)")
    ap.add_argument("--roll-batch", type=int, default=ROLL_BATCH, help="recompute-form rollout windows a step")
    ap.add_argument("--cache-batch", type=int, default=CACHE_BATCH, help="runtime-form rollout windows a step")
    ap.add_argument("--max-rollout", type=int, default=MAX_ROLLOUT, help="most chunks the model makes before the "
                                                                         "trained one (runtime-form windows)")
    ap.add_argument("--snapshot-every", type=int, default=0, help="also write DIR-stepN every N steps")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    record = RECORDS / "finetune_tiny_live.json" if out == DEFAULT_OUT else out.parent / f"{out.name}.json"
    finetune(out, Path(args.source).resolve(), seed=args.seed, steps=args.steps, clips=args.clips,
             threads=args.threads, lr=args.lr, roll_batch=args.roll_batch, cache_batch=args.cache_batch,
             max_rollout=args.max_rollout, snapshot_every=args.snapshot_every, record_path=record,
             log=lambda msg: print(msg, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
