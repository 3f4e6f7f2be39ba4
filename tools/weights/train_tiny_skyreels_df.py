"""Train `weights/tiny-skyreels-df`: a tiny SkyReels-V2 diffusion-forcing transformer that draws `tools.weights.clips`'
long clips of the 40 prompts, segment after segment, each segment continuing the frames it is given.

Usage::

    python -m tools.weights.train_tiny_skyreels_df           # both stages: weights/tiny-skyreels-df/, .json, -loss.png
    python -m tools.weights.train_tiny_skyreels_df --init-from DIR   # stage 2 only, from stage 1's checkpoint DIR
    python -m tools.weights.train_tiny_skyreels_df --out DIR # writes DIR instead (and DIR.json, DIR-loss.png beside it)
    python -m tools.weights.train_tiny_skyreels_df --out DIR --steps 4 --clips-per-prompt 1   # a smoke run

The shipped weights are two stages (issue 45): stage 1 is issue 23's run (`STAGE1_STEPS` from scratch on tiny-live's
bounce, 2 threads; its weights were weights/tiny-skyreels-df until issue 45, `STAGE1_DIGEST`); stage 2 continues them
for `STEPS` on clips whose bounce is slower (`BOUNCE`), because stage 1's model split the ball in two where tiny-live's
bounce moves 10-13 px a frame. The shipped run gave stage 1 with `--init-from` (its digest is checked and recorded).

Seeded like `tools.weights.train_tiny_live` (numpy and torch generators, deterministic algorithms, a fixed thread
count): the same seed, thread count, CPU and library versions give the same files.

What the model is for: diffusers' `SkyReelsV2DiffusionForcingPipeline` makes a long video as segments of
`base_num_frames` latent frames; every segment after the first starts from the last `overlap_history` latent
frames of the video so far, given clean (timestep 0; or lightly noised, `addnoise_condition`), and denoises
the rest from noise; with `ar_step` 0 the frames to make share one timestep a step, with `ar_step` > 0 later
causal blocks lag behind. So the model must denoise frames whose noise levels differ frame by frame, and
above all continue a clean prefix. The recipe, in order:

1. Text: `weights/tiny-wan`'s random tiny UMT5 and tokenizer, frozen (copied into the checkpoint as they
   are), the 40 prompts and the empty prompt (the pipeline's negative prompt) encoded as the pipeline
   encodes them, with `train_tiny_live`'s exact 512-row trick (the prompt's rows plus one zero row weighted
   log(512 - n)).
2. Clips: `--clips-per-prompt` long clips (`render_long_clip`, `CLIP_FRAMES` frames) of each of the 40
   prompts: bouncing for ever, or moving straight and wrapping round the frame.
3. VAE: `weights/tiny-live`'s trained `AutoencoderKLWan` (8x spatial, no temporal compression: one latent
   frame is one video frame), copied byte for byte with its latents_mean / latents_std; the clips are
   encoded whole (posterior mean) and normalised by them, as the pipeline de-normalises.
4. Transformer: diffusers' `SkyReelsV2Transformer3DModel` (adaLN-Zero start), trained on windows of
   `WINDOW` latent frames (the checkpoint's `base_num_frames`) at RoPE positions 0..WINDOW-1, as a segment
   sits, with diffusion forcing: every frame has its own noise level. Each window draws one of three
   patterns:
   * "prefix" (`PREFIX_PROB`): the first k frames clean (k = `OVERLAP` most of the time, else 1..WINDOW-1;
     a quarter of them lightly noised as `addnoise_condition` does), the others at one shared level: a
     synchronous segment after the first;
   * "independent" (`INDEPENDENT_PROB`): every frame its own level (the paper's objective; half of these
     with a clean prefix too): what asynchronous schedules show the model;
   * "uniform": every frame at one level: the first segment.
   Levels are sigma = s u / (1 + (s - 1) u), u uniform, s the scheduler's `flow_shift`; x_t = (1 - sigma) x0
   + sigma noise; loss: MSE of the flow (noise - x0) on the frames that are not a given prefix. 10% of the
   windows get the empty prompt (for guidance). fps embedding class 1 (any fps but 16). AdamW, warm-up and
   cosine decay, gradient clipping; the saved weights are the EMA.
5. Stage 2: steps 2-4 again from stage 1's weights with fresh generators (seed + 1), on clips whose bounce is
   `BOUNCE` (the straight motions as before), at peak lr `LR`.
6. Output: a `SkyReelsV2DiffusionForcingPipeline` directory (`UniPCMultistepScheduler`, flow prediction, the
   shift above) with generation_defaults.json, its training record and loss curve beside it.
"""

from __future__ import annotations

import os

# see weights/train_tiny_live.py: OpenMP's default waiting slows 2-thread ops 10-100x on a shared machine
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import functools  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from longserve.weights.registry import GENERATION_DEFAULTS_FILE, TINY_MODELS  # noqa: E402
from tools.weights.build_tiny_wan import SKYREELS_DF_TRANSFORMER_CONFIG, build_scheduler  # noqa: E402
from tools.weights.clips import render_long_clip  # noqa: E402
from tools.weights.live_teacher_forcing import CrossAttnProcessor, Layout  # noqa: E402
from tools.weights.loop import train_with_ema, training_main  # noqa: E402
from tools.weights.prompts import PROMPTS  # noqa: E402
from tools.weights.train_tiny_latte import run_provenance, seed_everything  # noqa: E402
from tools.weights.train_tiny_live import (  # noqa: E402
    adaln_zero_,
    compress_text,
    encode_clips,
    encode_prompts,
    load_text,
)
from tools.weights.wan import SKYREELS_V2_DF_MODEL_INDEX, SKYREELS_V2_SCHEDULER  # noqa: E402
from tools.weights.writing import write_whole  # noqa: E402

SEED = 0
THREADS = 1                                       # stage 2's (stage 1 ran on 2)
DEFAULT_OUT = TINY_MODELS["tiny-skyreels-df"]
RECORDS = DEFAULT_OUT.parent                    # the shipped runs' records (.json, -loss.png) lie in weights/
TEXT_FROM = TINY_MODELS["tiny-wan"]
VAE_FROM = TINY_MODELS["tiny-live"]
NEGATIVE = ""                                   # the pipeline's negative prompt when none is given

# -- the sampler's settings (generation_defaults.json; `make demo-long`) --------------------------------
WINDOW = 17                                     # base_num_frames = latent frames a segment (no temporal compression)
OVERLAP = 9                                     # overlap_history: the prefix a later segment is given
FPS = 8
FLOW_SHIFT = 3.0
STEPS_DEFAULT = 10
GUIDANCE = 1.0          # issue 45: the demo splits the ball in 0 frames at 1.0, 3 at 2.0 (weights/README.md)
GENERATION_DEFAULTS = {
    "height": 64, "width": 64, "num_frames": 37, "base_num_frames": WINDOW, "overlap_history": OVERLAP,
    "ar_step": 0, "causal_block_size": 1, "addnoise_condition": 0, "num_inference_steps": STEPS_DEFAULT,
    "guidance_scale": GUIDANCE, "fps": FPS,
}

# -- model: SkyReels-V2 DF 1.3B's structure (fps embedding, num_frame_per_block 1) at toy size ------------
Z_DIM = 4                                       # tiny-live's VAE
TRANSFORMER_CONFIG = {**SKYREELS_DF_TRANSFORMER_CONFIG,
                      "num_attention_heads": 3,     # odd on purpose (divides by neither 2 nor 4), as before
                      "attention_head_dim": 32,     # 96 wide (tiny-latte's, tiny-live's); rope t/h/w 12/10/10
                      "num_layers": 4, "ffn_dim": 256, "in_channels": Z_DIM, "out_channels": Z_DIM}

# -- data ---------------------------------------------------------------------------------------------------
CLIPS_PER_PROMPT = 4
CLIP_FRAMES = 80
#: The bounce of stage 2's clips (issue 45): a floor contact every 18-22 frames, arcs 45-55% of the frame high, so
#: the fastest step (at the floor, about 4 height / period) is under 8 px, half of the ball's width; tiny-live's
#: bounce (`clips.LONG_PERIOD`, `LONG_HEIGHT`: 11-13 frames, 50-60%; stage 1's) steps up to 13 px a frame, and a
#: model one frame off in phase draws two balls there (weights/README.md).
BOUNCE = {"period_range": (18.0, 22.0), "height_range": (0.45, 0.55)}
# -- training -------------------------------------------------------------------------------------------------
#: Stage 1 (issue 23's run, weights/tiny-skyreels-df until issue 45): from scratch on tiny-live's bounce.
STAGE1_STEPS = 2200
STAGE1_LR = 2e-3
#: its EMA transformer's sha256 (issue 23's `train_tiny_skyreels_df.json`): `--init-from` checks a given checkpoint
STAGE1_DIGEST = "7d79b0191ce4a6dbf8901a55933c49d9b6984e2a8ca8c313d1dd7335dea46b6f"
#: Stage 2 (issue 45): from stage 1's weights, on clips with `BOUNCE` (the straight motions as before).
STEPS = 1600
LR = 1e-3
BATCH = 16
WARMUP = 60
WEIGHT_DECAY = 0.01
EMA_DECAY = 0.995
EMPTY_PROMPT_PROB = 0.1
PREFIX_PROB, INDEPENDENT_PROB = 0.45, 0.2       # the rest: every frame at one level
OVERLAP_PROB = 0.6                              # a prefix of exactly OVERLAP frames (else 1..WINDOW-1)
ADDNOISE_PROB, ADDNOISE_MAX = 0.25, 0.06        # a prefix lightly noised, as addnoise_condition <= 60 does


def shifted_sigma(u: torch.Tensor, shift: float = FLOW_SHIFT) -> torch.Tensor:
    """The scheduler's flow shift: sigma = s u / (1 + (s - 1) u)."""
    return shift * u / (1 + (shift - 1) * u)


def new_transformer(seed: int):
    from diffusers import SkyReelsV2Transformer3DModel

    torch.manual_seed(seed)
    return adaln_zero_(SkyReelsV2Transformer3DModel(**TRANSFORMER_CONFIG))


def load_vae(vae_from: Path = VAE_FROM):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(Path(vae_from) / "vae").eval()


def noise_levels(batch: int, window: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-frame sigma (B, T) and the frames the loss counts (B, T) bool: False for a given (clean or lightly
    noised) prefix. The three patterns of the module doc, drawn per window."""
    sigma = torch.empty(batch, window)
    target = torch.ones(batch, window, dtype=torch.bool)
    for b in range(batch):
        r = float(torch.rand(1, generator=g))
        if r < PREFIX_PROB + INDEPENDENT_PROB and r >= PREFIX_PROB:                 # independent levels
            sigma[b] = shifted_sigma(torch.rand(window, generator=g))
            with_prefix = float(torch.rand(1, generator=g)) < 0.5
        else:                                                                        # one shared level
            sigma[b] = shifted_sigma(torch.rand(1, generator=g))
            with_prefix = r < PREFIX_PROB
        if with_prefix:
            k = OVERLAP if float(torch.rand(1, generator=g)) < OVERLAP_PROB else \
                int(torch.randint(1, window, (1,), generator=g))
            light = float(torch.rand(1, generator=g)) < ADDNOISE_PROB
            sigma[b, :k] = float(torch.rand(1, generator=g)) * ADDNOISE_MAX if light else 0.0
            target[b, :k] = False
    return sigma, target


class Windows:
    """Training windows of WINDOW latent frames from the encoded clips (N, C, T, h, w), each with its prompt."""

    def __init__(self, latents: torch.Tensor, prompt_index: torch.Tensor, empty_index: int, g: torch.Generator):
        self.latents, self.prompt_index, self.empty_index, self.g = latents, prompt_index, empty_index, g

    def draw(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, _, T = self.latents.shape[:3]
        clips = torch.randint(n, (batch,), generator=self.g)
        starts = torch.randint(T - WINDOW + 1, (batch,), generator=self.g)
        x0 = torch.stack([self.latents[c, :, s:s + WINDOW] for c, s in zip(clips.tolist(), starts.tolist())])
        captions = self.prompt_index[clips].clone()
        captions[torch.rand(batch, generator=self.g) < EMPTY_PROMPT_PROB] = self.empty_index
        return x0, captions                                                          # (B, C, W, h, w), (B,)


def install_cross_attention(model) -> Layout:
    layout = Layout()
    for block in model.blocks:
        block.attn2.set_processor(CrossAttnProcessor(layout))
    return layout


def restore_cross_attention(model) -> None:
    from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2AttnProcessor

    for block in model.blocks:
        block.attn2.set_processor(SkyReelsV2AttnProcessor())


def flow_prediction(model, layout: Layout, x: torch.Tensor, sigma: torch.Tensor, captions: torch.Tensor, text,
                    text_bias) -> torch.Tensor:
    """The pipeline's forward (per-frame timesteps 1000 sigma, fps class 1) with the compressed captions:
    x (B, C, T, h, w), sigma (B, T), captions (B,) into text (P, N, 32) / text_bias (P, N)."""
    layout.cross_bias = text_bias[captions][:, None, None, :]                      # (B, 1, 1, N)
    return model(x, timestep=1000 * sigma, encoder_hidden_states=text[captions], enable_diffusion_forcing=True,
                 fps=[1], return_dict=False)[0]            # one fps id for the batch, as the pipeline


def df_loss(model, layout, windows: Windows, text, text_bias, g: torch.Generator) -> torch.Tensor:
    x0, captions = windows.draw(BATCH)
    sigma, target = noise_levels(*x0.shape[0:1], x0.shape[2], g)                    # (B, W) each
    noise = torch.randn(x0.shape, generator=g)
    s = sigma[:, None, :, None, None]
    xt = (1 - s) * x0 + s * noise
    v = flow_prediction(model, layout, xt, sigma, captions, text, text_bias)
    err = ((v - (noise - x0)) ** 2).mean(dim=(1, 3, 4))                              # (B, W)
    return (err * target).sum() / target.sum()


def train_transformer(model, windows: Windows, text, text_bias, steps: int, g: torch.Generator, log,
                      lr: float = LR) -> list[float]:
    layout = install_cross_attention(model)

    def step_loss(step: int):
        loss = df_loss(model, layout, windows, text, text_bias, g)
        return loss, {"loss": loss.item()}

    losses = train_with_ema(model, step_loss, steps, lr=lr, warmup=WARMUP, weight_decay=WEIGHT_DECAY,
                            ema_decay=EMA_DECAY, log=log).get("loss", [])
    restore_cross_attention(model)
    return losses


def write_checkpoint(out: Path, transformer, text_from: Path = TEXT_FROM, vae_from: Path = VAE_FROM) -> None:
    """The pipeline directory, written to a temporary sibling and swapped in (`write_whole`)."""
    import diffusers

    def write(tmp: Path) -> None:
        transformer.save_pretrained(str(tmp / "transformer"), safe_serialization=True)
        build_scheduler({**SKYREELS_V2_SCHEDULER, "flow_shift": FLOW_SHIFT}).save_pretrained(str(tmp / "scheduler"))
        for part, source in (("text_encoder", text_from), ("tokenizer", text_from), ("vae", vae_from)):
            shutil.copytree(Path(source) / part, tmp / part)
        index = {"_class_name": "SkyReelsV2DiffusionForcingPipeline", "_diffusers_version": diffusers.__version__,
                 **{k: list(v) for k, v in SKYREELS_V2_DF_MODEL_INDEX.items() if not k.startswith("_")}}
        (tmp / "model_index.json").write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")
        (tmp / GENERATION_DEFAULTS_FILE).write_text(json.dumps(GENERATION_DEFAULTS, indent=2) + "\n")

    write_whole(out, write)


def plot_losses(losses, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    window = max(1, len(losses) // 40)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    ax.plot(np.arange(1, len(losses) + 1), losses, color="0.85", lw=0.5)
    ax.plot(np.arange(window, len(losses) + 1), smooth, color="C0", lw=1.5, label="flow MSE (frames to make)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_transformer(model_dir: Path):
    """A checkpoint's transformer (`init_from`: its weights in a model of `TRANSFORMER_CONFIG`, so the saved config
    names no path) and the sha256 of its weights file."""
    from safetensors.torch import load_file

    weights = Path(model_dir) / "transformer" / "diffusion_pytorch_model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    model = new_transformer(SEED)
    model.load_state_dict(load_file(str(weights)))
    return model.train(), digest


def train(out: Path, seed: int = SEED, steps: int = STEPS, clips_per_prompt: int = CLIPS_PER_PROMPT,
          clip_frames: int = CLIP_FRAMES, threads: int = THREADS, lr: float = LR, record_path: Path | None = None,
          plot: Path | None = None, log=print, prompts: tuple[str, ...] = PROMPTS, init_from: Path | None = None,
          stage1_steps: int = STAGE1_STEPS) -> dict:
    """Train and write the checkpoint to `out`: stage 1 (`stage1_steps` from scratch on tiny-live's bounce; skipped
    when `init_from` gives its checkpoint), then stage 2 (`steps` on `BOUNCE`). `prompts` (the clips' prompts,
    default all 40) is for short tests."""
    threads_before, deterministic_before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        return _train(Path(out), seed=seed, steps=steps, clips_per_prompt=clips_per_prompt, clip_frames=clip_frames,
                      threads=threads, lr=lr, record_path=record_path, plot=plot, log=log, clip_prompts=prompts,
                      init_from=init_from, stage1_steps=stage1_steps)
    finally:
        torch.set_num_threads(threads_before)
        torch.use_deterministic_algorithms(deterministic_before)


def _stage(transformer, vae, prompts, clip_frames, rng, g, bounce, steps, lr, text, text_bias, log) -> dict:
    """Render and encode the clips (with `rng`), train `transformer` on their windows (with `g`) in place."""
    t0 = time.perf_counter()
    clips = [render_long_clip(p, clip_frames, rng, bounce=bounce) for p in prompts]
    render_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    latents = (encode_clips(vae, clips) - mean) / std                                 # (N, z, T, h, w)
    del clips
    encode_s = time.perf_counter() - t0
    log(f"rendered {len(prompts)} clips of {clip_frames} frames in {render_s:.0f} s, encoded in {encode_s:.0f} s; "
        f"normalised latents: mean {latents.mean():.3f}, std {latents.std():.3f}")
    t0 = time.perf_counter()
    windows = Windows(latents, torch.tensor([PROMPTS.index(p) for p in prompts]), len(PROMPTS), g)
    losses = train_transformer(transformer, windows, text, text_bias, steps, g, log, lr=lr)
    return {"losses": losses, "seconds": {"render": round(render_s, 1), "encode": round(encode_s, 1),
                                          "transformer": round(time.perf_counter() - t0, 1)}}


def _train(out, *, seed, steps, clips_per_prompt, clip_frames, threads, lr, record_path, plot, log,
           clip_prompts, init_from, stage1_steps) -> dict:
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    t_start, cpu_start = time.perf_counter(), time.process_time()
    seed_everything(seed, threads)
    captions = (*PROMPTS, NEGATIVE)
    text, text_bias = compress_text(encode_prompts(*load_text(), captions))
    prompts = [p for p in clip_prompts for _ in range(clips_per_prompt)]
    vae = load_vae()

    if init_from is None:             # stage 1: issue 23's run (its generators, in its order)
        transformer = new_transformer(seed + 2)
        first = _stage(transformer, vae, prompts, clip_frames, np.random.default_rng(seed),
                       torch.Generator().manual_seed(seed), None, stage1_steps, STAGE1_LR, text, text_bias, log)
        stage1 = {"from": "scratch", "steps": stage1_steps, "lr": STAGE1_LR, "seconds": first["seconds"],
                  "final_loss": float(np.mean(first["losses"][-50:]))}
        transformer.train()
    else:
        transformer, digest = load_transformer(init_from)
        stage1 = {"from": str(init_from), "transformer_sha256": digest, "is_issue_23_run": digest == STAGE1_DIGEST}
        log(f"stage 1 from {init_from} (sha256 {digest[:12]}, issue 23's run: {digest == STAGE1_DIGEST})")
    second = _stage(transformer, vae, prompts, clip_frames, np.random.default_rng(seed + 1),
                    torch.Generator().manual_seed(seed + 1), BOUNCE, steps, lr, text, text_bias, log)
    losses = second["losses"]

    write_checkpoint(out, transformer)
    wall_s = time.perf_counter() - t_start
    cpu_s = time.process_time() - cpu_start
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    record = {
        "seed": seed, "threads": threads, "steps": steps, "batch": BATCH, "clips": len(prompts),
        "clips_per_prompt": clips_per_prompt, "clip_frames": clip_frames, "window": WINDOW, "overlap": OVERLAP,
        "lr": lr, "ema_decay": EMA_DECAY, "flow_shift": FLOW_SHIFT, "empty_prompt_prob": EMPTY_PROMPT_PROB,
        "bounce": {k: list(v) for k, v in BOUNCE.items()},
        "patterns": {"prefix": PREFIX_PROB, "independent": INDEPENDENT_PROB,
                     "uniform": round(1 - PREFIX_PROB - INDEPENDENT_PROB, 3), "overlap_prefix": OVERLAP_PROB,
                     "addnoise": [ADDNOISE_PROB, ADDNOISE_MAX]},
        "stage1": stage1,
        "final_loss": float(np.mean(losses[-50:])),
        "transformer_parameters": sum(p.numel() for p in transformer.parameters()),
        "vae_from": str(Path(VAE_FROM).relative_to(RECORDS.parent)),
        "text_from": str(Path(TEXT_FROM).relative_to(RECORDS.parent)),
        "seconds": {**second["seconds"], "total": round(wall_s, 1)},
        "cpu_seconds": round(cpu_s, 1), "load_average_at_end": load,
        **run_provenance(out, "tools.weights.train_tiny_skyreels_df", threads),
    }
    if record_path is not None:
        Path(record_path).write_text(json.dumps(record, indent=2) + "\n")
    if plot is not None:
        plot_losses(losses, plot, f"weights/tiny-skyreels-df stage 2: {wall_s / 60:.1f} min on {threads} CPU "
                                  f"thread(s), seed {seed}")
    log(f"wrote {out} in {wall_s / 60:.1f} min ({cpu_s / 60:.1f} min of CPU): loss {record['final_loss']:.4f}")
    return record


def main(argv: list[str] | None = None) -> int:
    """The trainers' command line (`training_main`) plus `--init-from DIR`: stage 1's checkpoint."""
    argv = list(sys.argv[1:] if argv is None else argv)
    init_from = None
    if "--init-from" in argv:
        at = argv.index("--init-from")
        init_from = Path(argv[at + 1])
        del argv[at:at + 2]
    return training_main(argv, module="train_tiny_skyreels_df", doc=__doc__,
                         train=functools.partial(train, init_from=init_from), default_out=DEFAULT_OUT,
                         seed=SEED, steps=STEPS, clips_per_prompt=CLIPS_PER_PROMPT, lr=LR, threads=THREADS)


if __name__ == "__main__":
    sys.exit(main())
