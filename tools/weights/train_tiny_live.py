"""Train `weights/tiny-live`: a tiny causal few-step Wan model that draws `tools.weights.clips`' long bouncing clips
chunk by chunk, and follows a prompt that changes while it plays.

Usage::

    python -m tools.weights.train_tiny_live            # rewrites weights/tiny-live/ (+ train_tiny_live.json, -loss.png)
    python -m tools.weights.train_tiny_live --out DIR  # writes DIR instead (and DIR.json, DIR-loss.png beside it)
    python -m tools.weights.train_tiny_live --out DIR --vae-steps 4 --steps 4 --clips 4   # a smoke run

Everything runs on the CPU, seeded (numpy and torch generators, deterministic torch algorithms, a fixed
thread count), so the same seed, thread count, CPU and library versions give the same files.

What the model is for (the runtime, `weights/causal_wan.py`'s causal_config.json): a video is made of
chunks of `F_B` latent frames. Chunk c starts from noise and is denoised in the few steps of
`DENOISING_STEP_LIST`, warped by the shifted flow schedule (sigma(u) = s u / (1 + (s - 1) u), u = n / 1000),
re-noising the predicted x0 with fresh noise between steps; every step's model call sees the chunk (full
attention inside it) and the K/V of the previous clean frames, and the chunk's caption. The last x0 is
the chunk; a "context pass" at t = 0 then writes its K/V into the cache. The cache keeps at most
`L - F_B` frames: the first `K` (sink) forever plus the most recent, with positions rebased to 0..P-1, so
the model never sees a RoPE frame position >= L. When the prompt changes, the cached frames' K/V are
recomputed under the new caption (LongLive's recache).

The recipe, in order:

1. Text: the random tiny UMT5 encoder and tokenizer of `weights/tiny-wan`, frozen, encoding every
   caption as `WanPipeline` does (512 positions, zero past the prompt's tokens). The 512 - n zero rows
   all become the same key and value in every cross-attention, so training keeps the n real rows plus
   one zero row whose attention logit gets + log(512 - n): the same attention, exactly, at 1/50 of the cost.
2. Clips: `--clips` long clips (`tools.weights.clips.render_long_clip`, `CLIP_FRAMES` frames, one of the 8
   bouncing prompts "a {red|green|blue|yellow} {ball|square} bouncing") whose colour changes at 0 to 3
   chunk boundaries (the object keeps its motion and shape, the caption changes with the colour).
3. VAE: diffusers' `AutoencoderKLWan` at toy width (8x spatial, no temporal compression: one latent
   frame is one video frame), trained on 5-frame stretches of long clips (all frames at once: with no
   temporal down-sampling the causal encoder and decoder give the same result whole as chunked) with an
   object-weighted squared error and a small KL term. Its latents_mean / latents_std are the per-channel
   statistics of the encoded clips, and the transformer works on latents normalised by them, as
   diffusers' Wan pipelines normalise.
4. Latents: every clip encoded whole (posterior mean), normalised.
5. Transformer: diffusers' `WanTransformer3DModel` (adaLN-Zero start: the output projection, the timestep
   projection and every block's gates are zero), trained with "teacher forcing" in the two-stream form of
   the runtime: the sequence is [clean frames (t = context_noise) | noisy frames (each chunk at one t of the
   warped list)]; a clean chunk sees the clean chunks up to itself, a noisy chunk the clean chunks before
   it and itself; a noisy chunk has the RoPE frame positions of the clean chunk it stands for; every chunk
   (clean or noisy) cross-attends to its own caption. Per-token timesteps go through diffusers' own
   per-token (Wan 2.2 TI2V) path; masks, positions and per-chunk captions through this module's attention
   processors. Loss: MSE of the flow v = noise - x0 on the noisy chunks. Each step has two batches:
   * "start": the first L frames of a clip, noisy chunks 0..L/F_B-1 (the video's first chunks, before any
     eviction);
   * "sink": the clip's first K frames (the sink) followed by a later stretch of L - F_B - K clean frames
     and one noisy chunk, positions 0..L-1 contiguous: what every later chunk of a long video sees once the
     cache evicts. Half of these windows are placed 0, 1 or 2 chunks after a colour change, so the model
     learns to switch colour with the caption while its context is still the old colour.
   In windows with a change, the clean chunks get the current (the last noisy chunk's) caption most of the
   time, as recache gives them, and otherwise each its own. The clean frames get a little Gaussian noise
   now and then, and half of the windows get their clean frames mixed with a 3x3 spatial blur of themselves
   (still at t = 0), so that the model copes with its own imperfect frames as context: a few-step sampler's
   x0 is a little faded and blurred, and without this a faded chunk made the next one fainter until the
   object vanished for a few chunks (2 of 8 seeds of the 30-s evaluation).
   AdamW, warm-up and cosine decay, gradient clipping; the saved weights are the EMA.
6. Output: the causal checkpoint directory `weights.causal_wan` loads (weights in the released layout,
   `to_upstream`), its training record and the loss curves beside it.
"""

from __future__ import annotations

import os

# GNU OpenMP's default wait policy makes every parallel op wait for a thread that is off the CPU when
# another process shares the 2 cores (a small matmul 10x and an elementwise op 100x slower); PASSIVE
# only changes how idle threads wait, never a result. Set before torch starts its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from longserve.weights.causal_wan import CAUSAL_CONFIG_FILE, to_upstream  # noqa: E402
from longserve.weights.registry import GENERATION_DEFAULTS_FILE, TINY_MODELS  # noqa: E402
from tools.weights.clips import SIZE, render_long_clip  # noqa: E402
from tools.weights.live_teacher_forcing import (  # noqa: E402
    CONTEXT_AUG_MAX,
    CONTEXT_AUG_PROB,
    CONTEXT_BLUR_MAX,
    CONTEXT_BLUR_PROB,
    CONTEXT_NOISE,
    F_B,
    LOCAL_ATTN_SIZE,
    RECACHE_PROB,
    SINK_SIZE,
    SWITCH_WINDOW_PROB,
    Windows,
    flow_loss,
    install_processors,
    restore_processors,
)
from tools.weights.loop import cosine_lr, train_with_ema  # noqa: E402
from tools.weights.prompts import COLOURS, SHAPES  # noqa: E402
from tools.weights.train_tiny_latte import run_provenance, seed_everything  # noqa: E402
from tools.weights.writing import write_whole  # noqa: E402

SEED = 0
THREADS = 2
DEFAULT_OUT = TINY_MODELS["tiny-live"]
TEXT_FROM = TINY_MODELS["tiny-wan"]            # the random tiny UMT5 and its tokenizer, copied as they are
MAX_SEQUENCE_LENGTH = 512                      # WanPipeline's prompt length

# -- the runtime's settings (causal_config.json) --------------------------------------------------------
FPS = 8
DENOISING_STEP_LIST = [1000, 750, 500, 250]
TIMESTEP_SHIFT = 3.0
DEFAULT_FRAMES = 48                            # generation_defaults: 6 s, 16 chunks

PROMPTS = tuple(f"a {c} {s} bouncing" for c in COLOURS for s in SHAPES)

# -- models -----------------------------------------------------------------------------------------------
Z_DIM = 4
VAE_CONFIG = dict(
    base_dim=8,                                # channels 8 / 16 / 32 / 32
    z_dim=Z_DIM,
    dim_mult=[1, 2, 4, 4],                     # 3 down-samplings: 64x64 -> 8x8
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, False, False],
    dropout=0.0,
    scale_factor_spatial=8,
    scale_factor_temporal=1,
)
TRANSFORMER_CONFIG = dict(
    patch_size=[1, 2, 2],                      # 16 tokens an 8x8 latent frame
    num_attention_heads=4,
    attention_head_dim=24,                     # rope t/h/w = 8/8/8
    in_channels=Z_DIM,
    out_channels=Z_DIM,
    text_dim=32,                               # the tiny UMT5's d_model
    freq_dim=256,
    ffn_dim=256,
    num_layers=4,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
    pos_embed_seq_len=None,
)

# -- data ---------------------------------------------------------------------------------------------------
CLIPS = 128
CLIP_FRAMES = 96
MAX_SWITCHES = 3
MIN_SWITCH_GAP = 4                              # chunks between colour changes
# -- VAE training -------------------------------------------------------------------------------------------
VAE_STEPS = 550
VAE_FRAMES = 5
VAE_CROP, VAE_CROP_BATCH = 32, 16               # crops around the object: 4x cheaper a stretch than full frames
VAE_FULL_BATCH, VAE_FULL_FRACTION = 4, 0.15     # the last 15% of the steps on full frames
VAE_ANCHOR_WEIGHT, VAE_ANCHOR_SCALE = 1.0, 2.0  # latent channels 0-2 pulled towards 2 x the 8x8 mean colour
VAE_LR = 1e-3
VAE_KL_WEIGHT = 1e-5
VAE_OBJECT_WEIGHT = 4.0
VAE_INITIAL_LOGVAR = -6.0
# -- transformer training --------------------------------------------------------------------------------
STEPS = 1150
START_BATCH, SINK_BATCH = 8, 16
LR = 2e-3
WARMUP = 60
WEIGHT_DECAY = 0.01
EMA_DECAY = 0.995


def warped_timesteps(step_list=DENOISING_STEP_LIST, shift: float = TIMESTEP_SHIFT) -> list[float]:
    """Self-Forcing's warp: n -> 1000 sigma(n / 1000), sigma(u) = s u / (1 + (s - 1) u)."""
    return [1000.0 * shift * (n / 1000) / (1 + (shift - 1) * (n / 1000)) for n in step_list]


def causal_config() -> dict:
    return {"weights": "model.safetensors", "state_dict_key": None, "key_prefix": "model.",
            "num_frame_per_block": F_B, "denoising_step_list": list(DENOISING_STEP_LIST),
            "warp_denoising_step": True, "timestep_shift": TIMESTEP_SHIFT, "local_attn_size": LOCAL_ATTN_SIZE,
            "sink_size": SINK_SIZE, "context_noise": CONTEXT_NOISE, "fps": FPS}


# -- 1. text ------------------------------------------------------------------------------------------------

def load_text(text_from: Path = TEXT_FROM):
    from transformers import AutoTokenizer, UMT5EncoderModel

    tokenizer = AutoTokenizer.from_pretrained(text_from / "tokenizer")
    encoder = UMT5EncoderModel.from_pretrained(text_from / "text_encoder").eval()
    return tokenizer, encoder


@torch.no_grad()
def encode_prompts(tokenizer, encoder, prompts) -> dict[str, torch.Tensor]:
    """prompt -> its WanPipeline embedding (512, 32): the prompt's n token rows, then zeros."""
    from diffusers import WanPipeline

    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=None, transformer=None, scheduler=None)
    embeds = pipe._get_t5_prompt_embeds(list(prompts), max_sequence_length=MAX_SEQUENCE_LENGTH,
                                        device=torch.device("cpu"), dtype=torch.float32)
    return {p: e for p, e in zip(prompts, embeds)}


def compress_text(embeds: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt's rows as (P, N, C) text and (P, N) logit bias: its n real rows (bias 0), one zero row
    standing for the 512 - n zero rows (bias log(512 - n)), padding rows (bias -inf)."""
    lengths = [int((e.abs().sum(dim=1) > 0).nonzero().max()) + 1 for e in embeds.values()]
    N = max(lengths) + 1
    C = next(iter(embeds.values())).shape[1]
    text = torch.zeros(len(embeds), N, C)
    bias = torch.full((len(embeds), N), float("-inf"))
    for i, (e, n) in enumerate(zip(embeds.values(), lengths)):
        text[i, :n] = e[:n]
        bias[i, :n] = 0.0
        bias[i, n] = math.log(MAX_SEQUENCE_LENGTH - n)
    return text, bias


# -- 2. clips -----------------------------------------------------------------------------------------------

def clip_schedule(rng: np.random.Generator, frames: int) -> list[tuple[int, str]]:
    """A random prompt schedule: one shape, a start colour, 0..MAX_SWITCHES colour changes at chunk boundaries."""
    shape = SHAPES[rng.integers(len(SHAPES))]
    colour = COLOURS[rng.integers(len(COLOURS))]
    schedule = [(0, f"a {colour} {shape} bouncing")]
    chunks = frames // F_B
    chunk = 0
    for _ in range(rng.integers(0, MAX_SWITCHES + 1)):
        chunk += int(rng.integers(MIN_SWITCH_GAP, max(MIN_SWITCH_GAP + 1, chunks // 2)))
        if chunk >= chunks:
            break
        colour = [c for c in COLOURS if c != colour][rng.integers(len(COLOURS) - 1)]
        schedule.append((chunk * F_B, f"a {colour} {shape} bouncing"))
    return schedule


def chunk_prompts(schedule, frames: int) -> list[int]:
    """Index into PROMPTS of each chunk's prompt."""
    out = []
    for c in range(frames // F_B):
        prompt = [p for first, p in schedule if first <= c * F_B][-1]
        out.append(PROMPTS.index(prompt))
    return out


def to_vae_pixels(clip: np.ndarray) -> torch.Tensor:
    """float (T, H, W, 3) in [0, 1] -> (3, T, H, W) in [-1, 1]."""
    return torch.from_numpy(clip).permute(3, 0, 1, 2) * 2 - 1


# -- 3. VAE -------------------------------------------------------------------------------------------------

def new_vae(seed: int):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(**VAE_CONFIG)


def vae_encode(vae, x: torch.Tensor) -> torch.Tensor:
    """(B, 3, T, H, W) -> the posterior's (mean, logvar) stacked on channels (B, 2 z, T, h, w), all frames at once."""
    return vae.quant_conv(vae.encoder(x))


def vae_decode(vae, z: torch.Tensor) -> torch.Tensor:
    return vae.decoder(vae.post_quant_conv(z))


def vae_batch(clips: list[np.ndarray], rng: np.random.Generator, batch: int, crop: int) -> torch.Tensor:
    """`batch` stretches of VAE_FRAMES frames of random clips, (B, 3, T, crop, crop) in [-1, 1]: a crop of
    `crop` pixels (a multiple of 8, so the latent grid stays aligned) near the object's centre."""
    out = []
    for _ in range(batch):
        clip = clips[rng.integers(len(clips))]
        first = int(rng.integers(len(clip) - VAE_FRAMES + 1))
        stretch = clip[first:first + VAE_FRAMES]
        if crop < stretch.shape[1]:
            ys, xs = np.nonzero(np.abs(stretch[VAE_FRAMES // 2] - 0.5).max(axis=-1) > 0.2)
            cy, cx = (ys.mean(), xs.mean()) if len(ys) else (SIZE / 2, SIZE / 2)
            oy, ox = (int(np.clip(round((c - crop / 2 + rng.uniform(-8, 8)) / 8) * 8, 0, SIZE - crop))
                      for c in (cy, cx))
            stretch = np.ascontiguousarray(stretch[:, oy:oy + crop, ox:ox + crop])
        out.append(to_vae_pixels(stretch))
    return torch.stack(out)


def train_vae(vae, clips: list[np.ndarray], steps: int, rng: np.random.Generator, log) -> list[float]:
    """Object-weighted squared error + a small KL term + the anchor (latent channels 0-2 ~ the 8x8 mean colour);
    crops of VAE_CROP pixels (many objects a step, cheap) and then full frames for the last VAE_FULL_FRACTION."""
    with torch.no_grad():
        vae.quant_conv.bias[Z_DIM:] += VAE_INITIAL_LOGVAR
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=VAE_LR, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    losses = []
    t0 = time.perf_counter()
    full_from = steps - int(round(VAE_FULL_FRACTION * steps))
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, VAE_LR, min(WARMUP, steps // 10 + 1))
        full = step >= full_from
        x = vae_batch(clips, rng, VAE_FULL_BATCH if full else VAE_CROP_BATCH, SIZE if full else VAE_CROP)
        h = vae_encode(vae, x)
        mean, logvar = h[:, :Z_DIM], h[:, Z_DIM:].clamp(-30.0, 20.0)
        z = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=gen)
        recon = vae_decode(vae, z)
        on_object = (x.abs().amax(dim=1, keepdim=True) > 0.05).float()               # grey is 0
        weight = 1 + VAE_OBJECT_WEIGHT * on_object
        rec = ((recon - x) ** 2 * weight).mean() / weight.mean()
        kl = 0.5 * (mean ** 2 + logvar.exp() - 1 - logvar).mean()
        anchor = ((mean[:, :3] - VAE_ANCHOR_SCALE * F.avg_pool3d(x, (1, 8, 8))) ** 2).mean()
        loss = rec + VAE_KL_WEIGHT * kl + VAE_ANCHOR_WEIGHT * anchor
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        losses.append(rec.item())
        if step % 50 == 0 or step == steps - 1:
            log(f"vae {step + 1}/{steps} ({'full' if full else 'crops'}): reconstruction "
                f"{np.mean(losses[-50:]):.4f}, anchor {anchor.item():.4f}, kl {kl.item():.3f}, "
                f"{time.perf_counter() - t0:.0f} s")
    vae.eval()
    return losses


@torch.no_grad()
def encode_clips(vae, clips: list[np.ndarray]) -> torch.Tensor:
    """Posterior means (N, z, T, h, w) of whole clips."""
    return torch.stack([vae_encode(vae, to_vae_pixels(c)[None])[0, :Z_DIM] for c in clips])


# -- 4. transformer -------------------------------------------------------------------------------------------

def new_transformer(seed: int):
    """diffusers' initialisation from `seed`, then adaLN-Zero: the output projection, the timestep projection
    (the blocks' and the head's modulation) and the blocks' gates are zero, so every block starts as the
    identity plus its (ungated) cross-attention and the model starts by predicting 0."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return adaln_zero_(WanTransformer3DModel(**TRANSFORMER_CONFIG))


@torch.no_grad()
def adaln_zero_(model):
    """Zero a Wan-style transformer's output projection, timestep projection and block gates (in place)."""
    model.proj_out.weight.zero_()
    model.proj_out.bias.zero_()
    model.condition_embedder.time_proj.weight.zero_()
    model.condition_embedder.time_proj.bias.zero_()
    for block in model.blocks:
        block.scale_shift_table[:, 2].zero_()
        block.scale_shift_table[:, 5].zero_()
    return model


def train_transformer(model, windows: Windows, text, text_bias, steps: int, g: torch.Generator, log,
                      lr: float = LR) -> tuple[list[float], list[float]]:
    layout = install_processors(model)
    timesteps = torch.tensor(warped_timesteps())

    def step_loss(step: int):
        start = flow_loss(model, layout, windows.start(START_BATCH), timesteps, text, text_bias, g)
        sink = flow_loss(model, layout, windows.sink(SINK_BATCH), timesteps, text, text_bias, g)
        loss = (START_BATCH * start + SINK_BATCH * sink) / (START_BATCH + SINK_BATCH)
        return loss, {"start": start.item(), "sink": sink.item()}

    records = train_with_ema(model, step_loss, steps, lr=lr, warmup=WARMUP, weight_decay=WEIGHT_DECAY,
                             ema_decay=EMA_DECAY, log=log)
    restore_processors(model)
    return records.get("start", []), records.get("sink", [])


# -- 5. output ------------------------------------------------------------------------------------------------

def write_checkpoint(out: Path, transformer, vae, text_from: Path = TEXT_FROM) -> None:
    """The causal checkpoint directory (see weights/causal_wan.py), written to a temporary sibling and swapped in."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        (tmp / CAUSAL_CONFIG_FILE).write_text(json.dumps(causal_config(), indent=2) + "\n")
        sd = {k: v.detach().contiguous() for k, v in to_upstream(transformer.state_dict()).items()}
        save_file(sd, str(tmp / "model.safetensors"))
        transformer.save_config(str(tmp / "transformer"))
        vae.save_pretrained(str(tmp / "vae"), safe_serialization=True)
        FlowMatchEulerDiscreteScheduler(shift=TIMESTEP_SHIFT).save_pretrained(str(tmp / "scheduler"))
        for part in ("text_encoder", "tokenizer"):
            shutil.copytree(text_from / part, tmp / part)
        index = {"_class_name": "WanPipeline", "_diffusers_version": diffusers.__version__,
                 "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                 "text_encoder": ["transformers", "UMT5EncoderModel"],
                 "tokenizer": ["transformers", "T5TokenizerFast"], "transformer": [None, None],
                 "vae": ["diffusers", "AutoencoderKLWan"]}
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        defaults = {"height": 64, "width": 64, "num_frames": DEFAULT_FRAMES,
                    "num_inference_steps": len(DENOISING_STEP_LIST), "guidance_scale": 1.0, "fps": FPS}
        (tmp / GENERATION_DEFAULTS_FILE).write_text(json.dumps(defaults, indent=2) + "\n")

    write_whole(out, write)


def plot_losses(vae_losses, start_losses, sink_losses, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    curves = ((axes[0], [(vae_losses, "reconstruction")], "VAE (object-weighted MSE)"),
              (axes[1], [(start_losses, "start windows"), (sink_losses, "sink windows")], "transformer (v MSE)"))
    for ax, series, name in curves:
        for i, (values, label) in enumerate(series):
            window = max(1, len(values) // 40)
            smooth = np.convolve(values, np.ones(window) / window, mode="valid")
            ax.plot(np.arange(1, len(values) + 1), values, color="0.85", lw=0.5)
            ax.plot(np.arange(window, len(values) + 1), smooth, color=f"C{i}", lw=1.5, label=label)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train(out: Path, seed: int = SEED, vae_steps: int = VAE_STEPS, steps: int = STEPS, clips: int = CLIPS,
          threads: int = THREADS, lr: float = LR, record_path: Path | None = None, plot: Path | None = None,
          log=print) -> dict:
    threads_before, deterministic_before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        return _train(Path(out), seed=seed, vae_steps=vae_steps, steps=steps, n_clips=clips, threads=threads, lr=lr,
                      record_path=record_path, plot=plot, log=log)
    finally:
        torch.set_num_threads(threads_before)
        torch.use_deterministic_algorithms(deterministic_before)


def _train(out, *, seed, vae_steps, steps, n_clips, threads, lr, record_path, plot, log) -> dict:
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    t_start, cpu_start = time.perf_counter(), time.process_time()
    seed_everything(seed, threads)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)

    tokenizer, encoder = load_text()
    embeds = encode_prompts(tokenizer, encoder, PROMPTS)
    text, text_bias = compress_text(embeds)

    t0 = time.perf_counter()
    schedules = [clip_schedule(rng, CLIP_FRAMES) for _ in range(n_clips)]
    clips = [render_long_clip(s, CLIP_FRAMES, rng) for s in schedules]
    prompts = torch.tensor([chunk_prompts(s, CLIP_FRAMES) for s in schedules])      # (N, chunks)
    render_s = time.perf_counter() - t0
    log(f"rendered {n_clips} clips of {CLIP_FRAMES} frames in {render_s:.0f} s")

    t0 = time.perf_counter()
    vae = new_vae(seed + 3)
    vae_losses = train_vae(vae, clips, vae_steps, rng, log)
    vae_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    raw = encode_clips(vae, clips)                                                     # (N, z, T, h, w)
    mean = [round(float(m), 4) for m in raw.mean(dim=(0, 2, 3, 4))]
    std = [round(float(s), 4) for s in raw.std(dim=(0, 2, 3, 4))]
    vae.register_to_config(latents_mean=mean, latents_std=std)
    latents = (raw - torch.tensor(mean).view(1, -1, 1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1, 1)
    del clips
    encode_s = time.perf_counter() - t0
    log(f"encoded in {encode_s:.0f} s; latents_mean {mean}, latents_std {std}")

    t0 = time.perf_counter()
    transformer = new_transformer(seed + 2)
    windows = Windows(latents, prompts, g)
    start_losses, sink_losses = train_transformer(transformer, windows, text, text_bias, steps, g, log, lr=lr)
    transformer_s = time.perf_counter() - t0

    write_checkpoint(out, transformer, vae)
    wall_s = time.perf_counter() - t_start
    cpu_s = time.process_time() - cpu_start
    record = {
        "seed": seed, "threads": threads, "vae_steps": vae_steps, "steps": steps, "clips": n_clips,
        "clip_frames": CLIP_FRAMES, "colour_changes": len(windows.switches),
        "start_batch": START_BATCH, "sink_batch": SINK_BATCH, "lr": lr, "ema_decay": EMA_DECAY,
        "vae_crop": VAE_CROP, "vae_crop_batch": VAE_CROP_BATCH, "vae_full_batch": VAE_FULL_BATCH,
        "vae_frames": VAE_FRAMES, "vae_anchor_weight": VAE_ANCHOR_WEIGHT, "vae_lr": VAE_LR,
        "vae_kl_weight": VAE_KL_WEIGHT, "switch_window_prob": SWITCH_WINDOW_PROB, "recache_prob": RECACHE_PROB,
        "context_noise_aug": [CONTEXT_AUG_PROB, CONTEXT_AUG_MAX],
        "context_blur_aug": [CONTEXT_BLUR_PROB, CONTEXT_BLUR_MAX],
        "causal_config": causal_config(), "warped_timesteps": warped_timesteps(),
        "latents_mean": mean, "latents_std": std,
        "final_vae_reconstruction_loss": float(np.mean(vae_losses[-50:])),
        "final_loss_start": float(np.mean(start_losses[-50:])),
        "final_loss_sink": float(np.mean(sink_losses[-50:])),
        "transformer_parameters": sum(p.numel() for p in transformer.parameters()),
        "vae_parameters": sum(p.numel() for p in vae.parameters()),
        "seconds": {"render": round(render_s, 1), "vae": round(vae_s, 1), "encode": round(encode_s, 1),
                    "transformer": round(transformer_s, 1), "total": round(wall_s, 1)},
        "cpu_seconds": round(cpu_s, 1),
        **run_provenance(out, "tools.weights.train_tiny_live", threads),
    }
    if record_path is not None:
        Path(record_path).write_text(json.dumps(record, indent=2) + "\n")
    if plot is not None:
        plot_losses(vae_losses, start_losses, sink_losses, plot,
                    f"weights/tiny-live training: {wall_s / 60:.1f} min on {threads} CPU threads, seed {seed}")
    log(f"wrote {out} in {wall_s / 60:.1f} min ({cpu_s / 60:.1f} min of CPU): loss start "
        f"{record['final_loss_start']:.4f}, sink {record['final_loss_sink']:.4f}, vae "
        f"{record['final_vae_reconstruction_loss']:.4f}")
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.weights.train_tiny_live", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help=f"output directory (not {DEFAULT_OUT}: that is this stage and "
                                                 f"tools.weights.finetune_tiny_live's)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--vae-steps", type=int, default=VAE_STEPS)
    ap.add_argument("--steps", type=int, default=STEPS, help="transformer steps")
    ap.add_argument("--clips", type=int, default=CLIPS, help=f"long training clips of {CLIP_FRAMES} frames")
    ap.add_argument("--lr", type=float, default=LR, help="transformer peak learning rate")
    ap.add_argument("--threads", type=int, default=THREADS, help="torch CPU threads (results depend on it)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    if out == DEFAULT_OUT:          # the shipped checkpoint is this stage and the fine-tune: never stage one alone
        ap.error(f"{DEFAULT_OUT} is stage one and its fine-tune (weights/README.md): train stage one elsewhere, "
                 f"--out /tmp/stage1, then python -m tools.weights.finetune_tiny_live --source /tmp/stage1")
    stem = out.parent / out.name
    train(out, seed=args.seed, vae_steps=args.vae_steps, steps=args.steps, clips=args.clips, threads=args.threads,
          lr=args.lr, record_path=Path(f"{stem}.json"), plot=Path(f"{stem}-loss.png"),
          log=lambda msg: print(msg, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
