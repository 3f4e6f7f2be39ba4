"""Train `weights/tiny-latte`: a tiny Latte that draws the procedural clips of `tools.weights.clips`.

Usage::

    python -m tools.weights.train_tiny_latte       # rewrites weights/tiny-latte/ (see weights/README.md for the time)
    python -m tools.weights.train_tiny_latte --out DIR      # writes DIR instead
    python -m tools.weights.train_tiny_latte --out DIR --vae-steps 4 --steps 4 --clips-per-prompt 1   # a smoke run

Everything runs on the CPU, seeded (python, numpy and torch generators, deterministic torch
algorithms, a fixed thread count), so the same seed, thread count, CPU and library versions
give the same weights. The recipe, in order:

1. Text: the tiny T5 encoder and tokenizer of `tools.weights.build_tiny_latte` (rebuilt from their
   seeds, byte-identical to before; frozen). Every prompt of the vocabulary is encoded once in
   both forms `LattePipeline.encode_prompt(..., negative_prompt="", mask_feature=True)` gives:
   alone (the prompt's tokens; the empty negative cut to that length) and as a row of a list of
   prompts (all 120 positions, padding zeroed; the negative whole). diffusers gives a list call
   the second form, so a model trained on one form only draws the wrong thing for the other.
2. VAE: diffusers' `AutoencoderKL` (8x downsampling, 4 latent channels), trained on frames of
   random clips: squared error in [-1, 1] pixels, weighted up on the object's pixels (they are a
   few percent of a frame but are all that matters), plus a small KL term. Its log-variance
   output starts small, so the latents carry information from the first step. Then
   `scaling_factor` = 1 / std of the encoded training latents, as Stable Diffusion's was set.
3. Latents: `--clips-per-prompt` clips of every prompt, encoded (posterior mean x scaling_factor).
4. Transformer: `LatteTransformer3DModel` (Latte-1's options at toy width, adaLN-Zero start: every
   block starts as the identity) trained on the DDPM objective of the shipped DDIMScheduler's
   schedule (linear betas, 1000 steps), uniform timesteps, predicting **v** (the scheduler's
   `prediction_type` is set to match; the variance half of the learned-sigma output is dropped by
   the pipeline for DDIM and is not trained). The loss is weighted min(SNR + 1, 5) / (SNR + 1)
   (min-SNR for v). Why v: an epsilon loss weighs an error in the clean latent by SNR, which is
   ~0 at the high noise levels where every frame's object position is decided; a model trained
   so (the first attempt, weights/README.md) drew the colour but left objects scattered and still,
   while v keeps that weight >= 1 and learns coherent motion in a few hundred steps. Prompts are
   replaced by the negative ("") embedding 10% of the time so classifier-free guidance works;
   half of the steps use the list form of the text. AdamW with linear warm-up and cosine decay,
   gradient clipping at 1; the saved weights are the EMA of the trained ones.
5. Output: a diffusers `LattePipeline` directory (plus `tokenizer/spiece.model`), its
   `TRAINING.json` (seed, steps, losses, wall and CPU time, versions) and the loss curves as a PNG.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from longserve.weights.registry import GENERATION_DEFAULTS_FILE, TINY_MODELS
from tools.weights import build_tiny_latte as random_build
from tools.weights.clips import FRAMES, render_clip
from tools.weights.loop import cosine_lr, train_with_ema
from tools.weights.prompts import PROMPTS
from tools.weights.writing import file_digests, write_whole

SEED = 0
DEFAULT_OUT = TINY_MODELS["tiny-latte"]
DEFAULT_PLOT = DEFAULT_OUT.parent / "train_tiny_latte_loss.png"   # the records of the shipped runs lie in weights/

TRANSFORMER_CONFIG = dict(
    random_build.TRANSFORMER_CONFIG,
    num_attention_heads=3,        # odd on purpose: divides by neither 2 nor 4 workers
    attention_head_dim=32,
    num_layers=3,
    cross_attention_dim=96,       # == inner dim, as in Latte-1
)
VAE_CONFIG = dict(random_build.VAE_CONFIG)   # (16, 16, 32, 32) channels, 4 latent channels, 8x down

# VAE training
VAE_BATCH_CLIPS, VAE_FRAMES_PER_CLIP = 8, 4   # 32 frames a step
VAE_LR = 1e-3
VAE_KL_WEIGHT = 1e-5                          # per latent element, against the per-pixel squared error
VAE_OBJECT_WEIGHT = 4.0                       # extra loss weight on pixels the object covers
VAE_INITIAL_LOGVAR = -6.0                     # posterior std starts at e^-3 instead of 1
# transformer training
BATCH = 16
LR = 2e-3
WARMUP = 100
UNCOND_PROB = 0.1
BATCHED_FORM_PROB = 0.5                       # steps whose text is in encode_prompt's list form (encode_vocabulary)
WEIGHT_DECAY = 0.01
# loss weight in x0 terms: min(SNR, gamma) for epsilon, min(SNR + 1, gamma) for v
MIN_SNR_GAMMA = 5.0
PREDICTION = "v_prediction"                   # what the transformer predicts (the scheduler's prediction_type)
EMA_DECAY = 0.998                             # the saved transformer is the EMA of its weights
# defaults of the command (the committed weights are these)
VAE_STEPS = 600
STEPS = 1500
CLIPS_PER_PROMPT = 64
THREADS = 2
#: longserve's call defaults for the trained checkpoint (generation_defaults.json; diffusers ignores it):
#: 25 DDIM steps draw the clips as well as 50 do (weights/README.md), in half the time
GENERATION_DEFAULTS = {"num_inference_steps": 25, "guidance_scale": 7.5}


def seed_everything(seed: int, threads: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def to_vae_pixels(clips: np.ndarray) -> torch.Tensor:
    """float (N, H, W, 3) in [0, 1] -> (N, 3, H, W) in [-1, 1], as the VAE sees images."""
    return torch.from_numpy(clips).permute(0, 3, 1, 2) * 2 - 1


# -- 1. text ---------------------------------------------------------------------------------------

def encode_vocabulary(pipe, prompts=PROMPTS) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """prompt -> {form: (positive (L, C_text), negative (L, C_text))}, exactly as inference encodes it.

    `LattePipeline.encode_prompt(..., mask_feature=True)` has two forms, and the model learns both:
    "single" (one prompt a call: its tokens only, and the empty negative prompt cut to that length)
    and "batched" (a list of prompts: all 120 token positions, the prompt's padding zeroed, the
    negative prompt whole). A server request is encoded alone; `pipeline(["...", "..."])` is batched.
    """
    out = {}
    with torch.no_grad():
        for prompt in prompts:
            forms = {}
            for form, text in (("single", prompt), ("batched", [prompt, prompt])):
                positive, negative = pipe.encode_prompt(text, do_classifier_free_guidance=True, negative_prompt="",
                                                        device=torch.device("cpu"), clean_caption=False,
                                                        mask_feature=True)
                forms[form] = (positive[0], negative[0])
            out[prompt] = forms
    return out


# -- 2. VAE ----------------------------------------------------------------------------------------

def random_frames(rng: np.random.Generator, clips: int, per_clip: int) -> np.ndarray:
    """`per_clip` distinct frames of each of `clips` random clips: float32 (clips*per_clip, H, W, 3)."""
    frames = []
    for _ in range(clips):
        clip = render_clip(PROMPTS[rng.integers(len(PROMPTS))], rng)
        frames.append(clip[rng.choice(FRAMES, per_clip, replace=False)])
    return np.concatenate(frames)


def train_vae(vae, steps: int, rng: np.random.Generator, log) -> list[float]:
    """Train `vae` in place; returns the per-step reconstruction loss."""
    with torch.no_grad():
        vae.quant_conv.bias[vae.config.latent_channels:] += VAE_INITIAL_LOGVAR
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=VAE_LR, betas=(0.9, 0.99), weight_decay=0.0)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, VAE_LR, min(WARMUP, steps // 10 + 1))
        x = to_vae_pixels(random_frames(rng, VAE_BATCH_CLIPS, VAE_FRAMES_PER_CLIP))   # (B, 3, H, W)
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample(generator=torch.Generator().manual_seed(step))).sample
        on_object = (x.abs().amax(dim=1, keepdim=True) > 0.05).float()               # (B, 1, H, W); grey is 0
        weight = 1 + VAE_OBJECT_WEIGHT * on_object
        rec = ((recon - x) ** 2 * weight).mean() / weight.mean()
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        loss = rec + VAE_KL_WEIGHT * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        losses.append(rec.item())
        if step % 50 == 0 or step == steps - 1:
            log(f"vae {step + 1}/{steps}: reconstruction {np.mean(losses[-50:]):.4f}, kl {kl.item():.3f}, "
                f"{time.perf_counter() - t0:.0f} s")
    vae.eval()
    return losses


# -- 3. latents ------------------------------------------------------------------------------------

@torch.no_grad()
def encode_clips(vae, clips_per_prompt: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Render and encode clips: unscaled latents (N, C, T, h, w) and prompt indices (N,), N = 40 x clips_per_prompt."""
    latents, labels = [], []
    for _ in range(clips_per_prompt):
        for index, prompt in enumerate(PROMPTS):
            frames = to_vae_pixels(render_clip(prompt, rng))                         # (T, 3, H, W)
            z = vae.encode(frames).latent_dist.mean                                  # (T, C, h, w)
            latents.append(z.permute(1, 0, 2, 3))                                    # (C, T, h, w)
            labels.append(index)
    return torch.stack(latents), torch.tensor(labels)


# -- 4. transformer --------------------------------------------------------------------------------

def batch_text(conditioning, prompts: list[str], uncond: torch.Tensor, batched: torch.Tensor, frames: int):
    """Text for a batch: padded embeddings (B, L, C) and the cross-attention bias (B*frames, 1, L)
    that masks the padding for every frame, as `engine.models.latte.parallel_forward` builds it.
    `uncond` (B,) picks the negative prompt, `batched` (B,) the list form of the encoding."""
    texts = [conditioning[p]["batched" if b else "single"][1 if u else 0]
             for p, u, b in zip(prompts, uncond.tolist(), batched.tolist())]
    L = max(t.shape[0] for t in texts)
    text = torch.stack([F.pad(t, (0, 0, 0, L - t.shape[0])) for t in texts])         # (B, L, C)
    keep = torch.stack([torch.arange(L) < t.shape[0] for t in texts])                # (B, L)
    bias = torch.zeros(keep.shape).masked_fill(~keep, -10000.0)[:, None, :]         # (B, 1, L)
    return text, bias.repeat_interleave(frames, dim=0)                               # (B*T, 1, L)


def train_transformer(transformer, scheduler, latents, labels, conditioning, steps: int,
                      generator: torch.Generator, log, batch: int = BATCH, lr: float = LR,
                      on_step=None, prediction: str = PREDICTION) -> list[float]:
    """DDPM training of `transformer` on scaled latents (N, C, T, h, w) to predict `prediction` (v or
    epsilon); at the end the transformer holds the exponential moving average of its weights. Returns
    the per-step loss (the plain MSE of the target, before the min-SNR weighting, so that it reads like
    the usual curve).
    `on_step(steps_done, ema_state_dict)`, when given, is called after every step."""
    alphas_cumprod = scheduler.alphas_cumprod                                        # (1000,)
    snr = alphas_cumprod / (1 - alphas_cumprod)                                      # (1000,)
    # min-SNR weighting (Hang et al. 2023) expressed for the target: an epsilon error is sqrt(SNR) x0
    # errors, a v error sqrt(SNR + 1); v keeps a weight >= 1 on x0 at high noise, where the layout
    # (where the object is in every frame) is decided
    if prediction == "epsilon":
        snr_weight = snr.clamp(max=MIN_SNR_GAMMA) / snr                              # (1000,) <= 1
    elif prediction == "v_prediction":
        snr_weight = (snr + 1).clamp(max=MIN_SNR_GAMMA) / (snr + 1)                  # (1000,) <= 1
    else:
        raise ValueError(f"prediction must be 'epsilon' or 'v_prediction', not {prediction!r}")
    C = latents.shape[1]

    def step_loss(step: int):
        pick = torch.randint(len(latents), (batch,), generator=generator)
        x0 = latents[pick]                                                           # (B, C, T, h, w)
        t = torch.randint(scheduler.config.num_train_timesteps, (batch,), generator=generator)
        noise = torch.randn(x0.shape, generator=generator)
        a = alphas_cumprod[t].view(-1, 1, 1, 1, 1)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        uncond = torch.rand(batch, generator=generator) < UNCOND_PROB
        # one form for the whole step: a batch with any list-form text pads all of it to 120 tokens
        batched = (torch.rand(1, generator=generator) < BATCHED_FORM_PROB).expand(batch)
        text, bias = batch_text(conditioning, [PROMPTS[i] for i in labels[pick].tolist()], uncond, batched,
                                x0.shape[2])
        out = transformer(xt, timestep=t, encoder_hidden_states=text, encoder_attention_mask=bias,
                          return_dict=False)[0]                                      # (B, 2C, T, h, w)
        target = noise if prediction == "epsilon" else a.sqrt() * noise - (1 - a).sqrt() * x0
        per_sample = ((out[:, :C] - target) ** 2).mean(dim=(1, 2, 3, 4))               # (B,)
        return (snr_weight[t] * per_sample).mean(), {"loss": per_sample.mean().item()}

    return train_with_ema(transformer, step_loss, steps, lr=lr, warmup=WARMUP, weight_decay=WEIGHT_DECAY,
                          ema_decay=EMA_DECAY, log=log, log_every=50, on_step=on_step).get("loss", [])


def new_transformer(seed: int):
    """The untrained transformer: diffusers' initialisation from `seed`, then DiT's adaLN-Zero start:
    the output projection, the shared timestep modulation (`adaln_single.linear`) and every block's
    gates (rows 2 and 5 of its `scale_shift_table`: attention and MLP) are zero, so every spatial and
    temporal block starts as the identity and the model starts by predicting no noise."""
    from diffusers import LatteTransformer3DModel

    torch.manual_seed(seed)
    model = LatteTransformer3DModel(**TRANSFORMER_CONFIG)
    with torch.no_grad():
        model.proj_out.weight.zero_()
        model.proj_out.bias.zero_()
        model.adaln_single.linear.weight.zero_()
        model.adaln_single.linear.bias.zero_()
        for block in [*model.transformer_blocks, *model.temporal_transformer_blocks]:
            block.scale_shift_table[2].zero_()
            block.scale_shift_table[5].zero_()
    return model


def new_vae(seed: int):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(**VAE_CONFIG)


# -- 5. output -------------------------------------------------------------------------------------

def smoothed(values: list[float], window: int) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    window = max(1, min(window, len(v)))
    return np.convolve(v, np.ones(window) / window, mode="valid")


def plot_losses(vae_losses: list[float], losses: list[float], path: Path, title: str,
                target: str = "v") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, values, name in ((axes[0], vae_losses, "VAE reconstruction (weighted MSE)"),
                             (axes[1], losses, f"transformer ({target} MSE, unweighted)")):
        ax.plot(np.arange(1, len(values) + 1), values, color="0.8", lw=0.6, label="per step")
        window = max(1, len(values) // 40)
        ax.plot(np.arange(window, len(values) + 1), smoothed(values, window), color="C0", lw=1.5,
                label=f"mean of {window} steps")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def library_versions() -> dict:
    import diffusers
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
            "transformers": transformers.__version__, "numpy": np.__version__}


def run_provenance(out: Path, module: str, threads: int) -> dict:
    """A training record's closing fields: the machine, the libraries, the digests of the files written to `out`,
    and the command that ran `module` (`python -m <module>` with this process's arguments)."""
    return {"machine": {"cpu": platform.processor() or platform.machine(), "threads": threads},
            "versions": library_versions(), "files": file_digests(out),
            "command": " ".join([f"python -m {module}", *sys.argv[1:]])}


def train(out: Path, seed: int = SEED, vae_steps: int = VAE_STEPS, steps: int = STEPS,
          clips_per_prompt: int = CLIPS_PER_PROMPT, threads: int = THREADS, batch: int = BATCH, lr: float = LR,
          prediction: str = PREDICTION, plot: Path | None = DEFAULT_PLOT, vae_from: Path | None = None,
          snapshot_every: int = 0, log=print) -> dict:
    """Train the whole pipeline and write it to `out` (swapped in at the end); returns the training record.
    torch's thread count and determinism setting are restored afterwards."""
    threads_before, deterministic_before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        return _train(out, seed=seed, vae_steps=vae_steps, steps=steps, clips_per_prompt=clips_per_prompt,
                      threads=threads, batch=batch, lr=lr, prediction=prediction, plot=plot, vae_from=vae_from,
                      snapshot_every=snapshot_every, log=log)
    finally:
        torch.set_num_threads(threads_before)
        torch.use_deterministic_algorithms(deterministic_before)


def _train(out, *, seed, vae_steps, steps, clips_per_prompt, threads, batch, lr, prediction, plot, vae_from,
           snapshot_every, log) -> dict:
    import diffusers
    import transformers
    from diffusers import LattePipeline

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    t_start, cpu_start = time.perf_counter(), time.process_time()
    seed_everything(seed, threads)
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)

    tokenizer, spiece_model = random_build.build_tokenizer()
    text_encoder = random_build.build_text_encoder()
    vae = new_vae(seed + 3)
    transformer = new_transformer(seed + 2)
    scheduler = random_build.build_scheduler()
    scheduler.register_to_config(prediction_type=prediction)
    pipe = LattePipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                         scheduler=scheduler)
    # encoded with a tokenizer of its own: encoding leaves padding to 120 set on a fast tokenizer,
    # which save_pretrained would write into the shipped tokenizer.json
    conditioning = encode_vocabulary(LattePipeline(tokenizer=random_build.build_tokenizer()[0],
                                                   text_encoder=text_encoder, vae=None, transformer=None,
                                                   scheduler=scheduler))

    t0 = time.perf_counter()
    if vae_from is None:
        vae_losses = train_vae(vae, vae_steps, rng, log)
    else:   # for experiments on the transformer alone
        from diffusers import AutoencoderKL

        vae.load_state_dict(AutoencoderKL.from_pretrained(vae_from, subfolder="vae").state_dict())
        vae.eval()
        vae_losses, vae_steps = [float("nan")], 0
    vae_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    latents, labels = encode_clips(vae, clips_per_prompt, rng)                        # (N, C, T, h, w)
    scaling_factor = float(1.0 / latents.std())
    vae.register_to_config(scaling_factor=scaling_factor)
    latents = latents * scaling_factor
    encode_s = time.perf_counter() - t0
    log(f"encoded {len(latents)} clips in {encode_s:.0f} s; scaling_factor {scaling_factor:.4f}, "
        f"latent mean {latents.mean().item():.3f}")

    def snapshot(done: int, ema: dict) -> None:
        """Every `snapshot_every` steps: the pipeline with the EMA weights so far, in OUT-stepN."""
        if snapshot_every and done % snapshot_every == 0 and done < steps:
            live = {k: v.clone() for k, v in transformer.state_dict().items()}
            transformer.load_state_dict(ema)
            write(pipe, spiece_model, {"seed": seed, "steps_done": done},
                  Path(out).with_name(f"{Path(out).name}-step{done}"))
            transformer.load_state_dict(live)
            transformer.train()

    t0 = time.perf_counter()
    losses = train_transformer(transformer, scheduler, latents, labels, conditioning, steps, generator, log,
                               batch=batch, lr=lr, on_step=snapshot, prediction=prediction)
    transformer_s = time.perf_counter() - t0
    wall_s = time.perf_counter() - t_start
    cpu_s = time.process_time() - cpu_start

    record = {
        "seed": seed, "threads": threads, "vae_steps": vae_steps, "steps": steps, "batch": batch,
        "vae_batch_frames": VAE_BATCH_CLIPS * VAE_FRAMES_PER_CLIP, "clips_per_prompt": clips_per_prompt,
        "training_clips": len(latents), "lr": lr, "prediction": prediction, "min_snr_gamma": MIN_SNR_GAMMA,
        "ema_decay": EMA_DECAY, "vae_lr": VAE_LR, "warmup": WARMUP,
        "uncond_prob": UNCOND_PROB, "batched_form_prob": BATCHED_FORM_PROB, "weight_decay": WEIGHT_DECAY,
        "vae_kl_weight": VAE_KL_WEIGHT,
        "vae_object_weight": VAE_OBJECT_WEIGHT, "scaling_factor": scaling_factor,
        "final_vae_reconstruction_loss": float(np.mean(vae_losses[-50:])),
        "final_loss": float(np.mean(losses[-50:])), "final_loss_window": min(50, len(losses)),
        "transformer_parameters": sum(p.numel() for p in transformer.parameters()),
        "vae_parameters": sum(p.numel() for p in vae.parameters()),
        "seconds": {"vae": round(vae_s, 1), "encode": round(encode_s, 1), "transformer": round(transformer_s, 1),
                    "total": round(wall_s, 1)},
        # CPU time of this process (all its threads): what the run costs on an otherwise idle machine
        # when threads == 1, whatever else shared the cores while it ran
        "cpu_seconds": round(cpu_s, 1),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": threads},
        "versions": library_versions(),
        "vae_from": None if vae_from is None else str(vae_from),
        "command": " ".join(["python -m tools.weights.train_tiny_latte", *sys.argv[1:]]),
    }
    write(pipe, spiece_model, record, out)
    if plot is not None:
        plot_losses(vae_losses, losses, plot,
                    f"weights/tiny-latte training: {wall_s / 60:.1f} min on {threads} CPU threads, seed {seed}",
                    target="epsilon" if prediction == "epsilon" else "v")
    log(f"wrote {out} in {wall_s / 60:.1f} min ({cpu_s / 60:.1f} min of CPU): final loss {record['final_loss']:.4f} "
        f"(vae reconstruction {record['final_vae_reconstruction_loss']:.4f})")
    return record


def write(pipe, spiece_model: bytes, record: dict, out: Path) -> None:
    """Save the pipeline to a temporary sibling of `out`, then swap it in (never a half-written `out`)."""
    def write_files(tmp: Path) -> None:
        pipe.save_pretrained(str(tmp), safe_serialization=True)
        (tmp / "tokenizer" / "spiece.model").write_bytes(spiece_model)
        (tmp / "TRAINING.json").write_text(json.dumps(record, indent=2) + "\n")
        (tmp / GENERATION_DEFAULTS_FILE).write_text(json.dumps(GENERATION_DEFAULTS, indent=2) + "\n")

    write_whole(out, write_files)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.weights.train_tiny_latte", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help=f"output directory (default: {DEFAULT_OUT})")
    ap.add_argument("--plot", default=None,
                    help=f"loss-curve PNG (default: {DEFAULT_PLOT} when writing the default --out, else "
                         f"OUT-loss.png beside OUT)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--vae-steps", type=int, default=VAE_STEPS)
    ap.add_argument("--steps", type=int, default=STEPS, help="transformer steps")
    ap.add_argument("--batch", type=int, default=BATCH, help="transformer batch (clips a step)")
    ap.add_argument("--lr", type=float, default=LR, help="transformer peak learning rate")
    ap.add_argument("--prediction", choices=("v_prediction", "epsilon"), default=PREDICTION,
                    help="the transformer's target (written as the scheduler's prediction_type)")
    ap.add_argument("--clips-per-prompt", type=int, default=CLIPS_PER_PROMPT,
                    help="training clips of each of the 40 prompts")
    ap.add_argument("--threads", type=int, default=THREADS, help="torch CPU threads (results depend on it)")
    ap.add_argument("--vae-from", default=None, help="reuse the VAE of this pipeline directory (no VAE training)")
    ap.add_argument("--snapshot-every", type=int, default=0,
                    help="also write the pipeline with the EMA weights every N steps, to OUT-stepN")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    plot = Path(args.plot) if args.plot else DEFAULT_PLOT if out == DEFAULT_OUT else out.parent / f"{out.name}-loss.png"
    train(out, seed=args.seed, vae_steps=args.vae_steps, steps=args.steps, clips_per_prompt=args.clips_per_prompt,
          threads=args.threads, batch=args.batch, lr=args.lr, prediction=args.prediction, plot=plot,
          vae_from=args.vae_from,
          snapshot_every=args.snapshot_every, log=lambda msg: print(msg, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
