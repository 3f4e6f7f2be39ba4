"""Train `weights/tiny-i2v`: a tiny Wan 2.1 image-to-video model that continues the first frame it is given, the
object of `tools.weights.clips`' long clips moving as the prompt says.

Usage::

    python -m tools.weights.train_tiny_i2v            # rewrites weights/tiny-i2v/ (+ train_tiny_i2v.json, -loss.png)
    python -m tools.weights.train_tiny_i2v --out DIR  # writes DIR instead (and DIR.json, DIR-loss.png beside it)
    python -m tools.weights.train_tiny_i2v --out DIR --steps 4 --clips-per-prompt 1   # a smoke run

Seeded like `tools.weights.train_tiny_skyreels_df` (numpy and torch generators, deterministic algorithms, a fixed
thread count): the same seed, thread count, CPU and library versions give the same files.

What the model is for: diffusers' `WanImageToVideoPipeline` (Wan 2.1 I2V) encodes the image followed by
num_frames - 1 grey frames with the VAE, and gives the transformer, beside the noisy latents, a one-channel mask
(1 on the first latent frame) and those condition latents on the channels, and the image's CLIP features in the
cross-attention; every latent frame, the first included, is denoised from noise. The recipe, in order:

1. Text: `weights/tiny-wan`'s random tiny UMT5 and tokenizer, frozen (copied into the checkpoint as they are),
   encoded as the pipeline does, with `train_tiny_live`'s exact 512-row trick.
2. Image encoder: `weights/tiny-wan-i2v`'s random tiny CLIP vision tower and its processor, frozen and copied.
3. Clips: `--clips-per-prompt` long clips (`render_long_clip`, `CLIP_FRAMES` frames) of each of the 40 prompts,
   and `WINDOWS_PER_CLIP` windows of `FRAMES` frames from each; a window's first frame is its image.
4. VAE: `weights/tiny-live`'s trained `AutoencoderKLWan` (8x spatial, no temporal compression), copied byte for
   byte; clips are encoded whole (posterior mean), and each window's condition exactly as the pipeline encodes
   it (the image, then grey frames; argmax), both normalised by latents_mean / latents_std.
5. Transformer: a `WanTransformer3DModel` with tiny-skyreels-df's width and depth (96 wide, 4 blocks) plus the
   I2V inputs (9 channels in: 4 noisy, 1 mask, 4 condition; the CLIP branch), started from tiny-skyreels-df's
   trained weights: the shared keys copied, its fps embedding (class 1) folded into the timestep projection's
   bias, the new input channels and the image values zero, so that the starting model is tiny-skyreels-df
   exactly and has only to learn to read the condition. Flow matching: x_t = (1 - sigma) x0 + sigma noise
   with sigma = s u / (1 + (s - 1) u), u uniform, s the scheduler's flow shift; loss: MSE of the flow
   (noise - x0) on every frame; 10% of the windows with the empty prompt (for guidance). AdamW, warm-up and
   cosine decay, gradient clipping, EMA (`tools.weights.loop`); the saved weights are the EMA.
6. Output: a `WanImageToVideoPipeline` directory (`UniPCMultistepScheduler`, flow prediction, the shift above)
   with generation_defaults.json, its training record and loss curve beside it.
"""

from __future__ import annotations

import os

# see tools/weights/train_tiny_live.py: OpenMP's default waiting slows 2-thread ops 10-100x on a shared machine
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from longserve.weights.registry import GENERATION_DEFAULTS_FILE, TINY_MODELS  # noqa: E402
from tools.weights.build_tiny_wan import build_scheduler  # noqa: E402
from tools.weights.clips import render_long_clip  # noqa: E402
from tools.weights.live_teacher_forcing import Layout  # noqa: E402
from tools.weights.loop import train_with_ema, training_main  # noqa: E402
from tools.weights.prompts import PROMPTS  # noqa: E402
from tools.weights.train_tiny_latte import run_provenance, seed_everything  # noqa: E402
from tools.weights.train_tiny_live import (  # noqa: E402
    compress_text,
    encode_prompts,
    load_text,
    to_vae_pixels,
    vae_encode,
)
from tools.weights.train_tiny_skyreels_df import plot_losses, shifted_sigma  # noqa: E402
from tools.weights.wan import WAN_2_1_I2V_MODEL_INDEX, WAN_2_1_I2V_SCHEDULER  # noqa: E402
from tools.weights.writing import write_whole  # noqa: E402

SEED = 0
THREADS = 2
DEFAULT_OUT = TINY_MODELS["tiny-i2v"]
RECORDS = DEFAULT_OUT.parent                    # the shipped runs' records (.json, -loss.png) lie in weights/
TEXT_FROM = TINY_MODELS["tiny-wan"]
VAE_FROM = TINY_MODELS["tiny-live"]
IMAGE_FROM = TINY_MODELS["tiny-wan-i2v"]
INIT_FROM = TINY_MODELS["tiny-skyreels-df"]
NEGATIVE = ""                                   # the pipeline's negative prompt when none is given

# -- the sampler's settings (generation_defaults.json; `make demo-i2v`) ---------------------------------------
FRAMES = 9                                      # num_frames = latent frames (no temporal compression)
FPS = 8
FLOW_SHIFT = 3.0
STEPS_DEFAULT = 10
GUIDANCE = 2.0
GENERATION_DEFAULTS = {"height": 64, "width": 64, "num_frames": FRAMES, "num_inference_steps": STEPS_DEFAULT,
                       "guidance_scale": GUIDANCE, "fps": FPS}

# -- model ----------------------------------------------------------------------------------------------------
Z_DIM = 4                                       # tiny-live's VAE
MASK_CHANNELS = 1                               # the first-frame mask: one pixel frame a latent frame
IMAGE_TOKENS = 17                               # tiny-wan-i2v's CLIP: (32 / 8)^2 patches + the class token
CLIP_DIM = 32
TRANSFORMER_CONFIG = {
    "patch_size": [1, 2, 2], "num_attention_heads": 3, "attention_head_dim": 32,
    "in_channels": 2 * Z_DIM + MASK_CHANNELS, "out_channels": Z_DIM, "text_dim": 32, "freq_dim": 256,
    "ffn_dim": 256, "num_layers": 4, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": CLIP_DIM, "added_kv_proj_dim": 96,
    "rope_max_seq_len": 1024, "pos_embed_seq_len": None,
}

# -- data -----------------------------------------------------------------------------------------------------
CLIPS_PER_PROMPT = 8
CLIP_FRAMES = FRAMES
WINDOWS_PER_CLIP = 1
# -- training -------------------------------------------------------------------------------------------------
STEPS = 1800
BATCH = 12
LR = 1.5e-3
WARMUP = 60
WEIGHT_DECAY = 0.01
EMA_DECAY = 0.995
EMPTY_PROMPT_PROB = 0.1


# -- the starting transformer ---------------------------------------------------------------------------------

@torch.no_grad()
def new_transformer(seed: int, init_from: Path = INIT_FROM):
    """The I2V transformer started from tiny-skyreels-df's (see the module doc): it predicts what that model does,
    whatever the condition channels and the image features are."""
    from diffusers import SkyReelsV2Transformer3DModel, WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**TRANSFORMER_CONFIG)
    source = SkyReelsV2Transformer3DModel.from_pretrained(Path(init_from) / "transformer").eval()
    theirs = source.state_dict()
    state = model.state_dict()
    for key, value in theirs.items():
        if key in state and key != "patch_embedding.weight":
            state[key].copy_(value)
    state["patch_embedding.weight"].zero_()
    state["patch_embedding.weight"][:, :Z_DIM] = theirs["patch_embedding.weight"]
    fps = source.fps_projection(source.fps_embedding(torch.tensor([1])))[0]         # (6 * inner,), class 1
    state["condition_embedder.time_proj.bias"].add_(fps)
    for block in model.blocks:
        block.attn2.add_v_proj.weight.zero_()
        block.attn2.add_v_proj.bias.zero_()
    return model


class I2VCrossAttnProcessor:
    """WanAttnProcessor's cross-attention for I2V (the image tokens first, then the text) with the compressed text
    (`compress_text`: an additive bias (B, 1, 1, N) from the layout) instead of 512 rows."""

    def __init__(self, layout: Layout, image_tokens: int = IMAGE_TOKENS):
        self.layout, self.image_tokens = layout, image_tokens

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        image, text = encoder_hidden_states[:, :self.image_tokens], encoder_hidden_states[:, self.image_tokens:]

        def heads(x):
            return x.unflatten(2, (attn.heads, -1)).transpose(1, 2)

        q = heads(attn.norm_q(attn.to_q(hidden_states)))
        out = F.scaled_dot_product_attention(q, heads(attn.norm_k(attn.to_k(text))), heads(attn.to_v(text)),
                                             attn_mask=self.layout.cross_bias)
        out = out + F.scaled_dot_product_attention(q, heads(attn.norm_added_k(attn.add_k_proj(image))),
                                                   heads(attn.add_v_proj(image)))
        out = out.transpose(1, 2).flatten(2).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def install_cross_attention(model) -> Layout:
    layout = Layout()
    for block in model.blocks:
        block.attn2.set_processor(I2VCrossAttnProcessor(layout))
    return layout


def restore_cross_attention(model) -> None:
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    for block in model.blocks:
        block.attn2.set_processor(WanAttnProcessor())


def flow_prediction(model, layout: Layout, x, condition, sigma, captions, text, text_bias, image_embeds):
    """The pipeline's forward with the compressed captions: x (B, 4, T, h, w) noisy latents, condition
    (B, 5, T, h, w) the mask and condition latents, sigma (B,), captions (B,) into text (P, N, 32) / text_bias
    (P, N), image_embeds (B, 17, 32)."""
    layout.cross_bias = text_bias[captions][:, None, None, :]
    return model(torch.cat([x, condition], dim=1), timestep=1000 * sigma, encoder_hidden_states=text[captions],
                 encoder_hidden_states_image=image_embeds, return_dict=False)[0]


# -- data -----------------------------------------------------------------------------------------------------

def load_vae(vae_from: Path = VAE_FROM):
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(Path(vae_from) / "vae").eval()


def load_image_encoder(image_from: Path = IMAGE_FROM):
    from transformers import CLIPImageProcessor, CLIPVisionModel

    return (CLIPImageProcessor.from_pretrained(Path(image_from) / "image_processor"),
            CLIPVisionModel.from_pretrained(Path(image_from) / "image_encoder").eval())


@torch.no_grad()
def image_features(processor, encoder, frames: np.ndarray) -> torch.Tensor:
    """CLIP features (N, 17, 32) of first frames (N, H, W, 3) in [0, 1] as the pipeline computes them (uint8
    images through the processor, the penultimate hidden state)."""
    from PIL import Image

    images = [Image.fromarray(np.round(f * 255).astype(np.uint8)) for f in frames]
    pixels = processor(images=images, return_tensors="pt")
    return encoder(**pixels, output_hidden_states=True).hidden_states[-2]


@torch.no_grad()
def encode_windows(vae, clips: list[np.ndarray], starts: list[list[int]], chunk: int = 16):
    """Latents (W, 4, FRAMES, h, w) of every window, cut from its whole clip's posterior mean (the encoder on all
    frames at once: `vae.encode` keeps 4k + 1 frames), and the pipeline's condition (W, 5, FRAMES, h, w): the
    first-frame mask, then the encoded image followed by grey frames (FRAMES is 4k + 1)."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    latents, firsts = [], []
    for i in range(0, len(clips), chunk):
        pixels = torch.stack([to_vae_pixels(c) for c in clips[i:i + chunk]])            # (b, 3, T, H, W)
        whole = (vae_encode(vae, pixels)[:, :Z_DIM] - mean) / std                        # (b, z, T, h, w)
        for clip, clip_starts, encoded in zip(clips[i:i + chunk], starts[i:i + chunk], whole):
            for s in clip_starts:
                latents.append(encoded[:, s:s + FRAMES])
                firsts.append(clip[s])
    conditions = []
    for i in range(0, len(firsts), chunk):
        image = torch.from_numpy(np.stack(firsts[i:i + chunk])).permute(0, 3, 1, 2)[:, :, None] * 2 - 1  # (b,3,1,H,W)
        video = torch.cat([image, image.new_zeros(image.shape[0], 3, FRAMES - 1, *image.shape[3:])], dim=2)
        conditions.append((vae.encode(video).latent_dist.mode() - mean) / std)
    condition = torch.cat(conditions)
    mask = torch.zeros(condition.shape[0], MASK_CHANNELS, *condition.shape[2:])
    mask[:, :, 0] = 1
    return torch.stack(latents), torch.cat([mask, condition], dim=1), np.stack(firsts)


# -- training -------------------------------------------------------------------------------------------------

def train_transformer(model, latents, condition, image_embeds, window_prompts, text, text_bias, steps: int,
                      g: torch.Generator, log, lr: float = LR, empty_index: int = len(PROMPTS)) -> list[float]:
    layout = install_cross_attention(model)

    def step_loss(step: int):
        pick = torch.randint(len(latents), (BATCH,), generator=g)
        x0 = latents[pick]
        captions = window_prompts[pick].clone()
        captions[torch.rand(BATCH, generator=g) < EMPTY_PROMPT_PROB] = empty_index
        sigma = shifted_sigma(torch.rand(BATCH, generator=g), FLOW_SHIFT)
        noise = torch.randn(x0.shape, generator=g)
        s = sigma[:, None, None, None, None]
        v = flow_prediction(model, layout, (1 - s) * x0 + s * noise, condition[pick], sigma, captions, text,
                            text_bias, image_embeds[pick])
        loss = ((v - (noise - x0)) ** 2).mean()
        return loss, {"loss": loss.item()}

    records = train_with_ema(model, step_loss, steps, lr=lr, warmup=WARMUP, weight_decay=WEIGHT_DECAY,
                             ema_decay=EMA_DECAY, log=log)
    restore_cross_attention(model)
    return records.get("loss", [])


def write_checkpoint(out: Path, transformer) -> None:
    """The pipeline directory, written to a temporary sibling and swapped in (`write_whole`)."""
    import diffusers

    def write(tmp: Path) -> None:
        transformer.save_pretrained(str(tmp / "transformer"), safe_serialization=True)
        build_scheduler({**WAN_2_1_I2V_SCHEDULER, "flow_shift": FLOW_SHIFT}).save_pretrained(str(tmp / "scheduler"))
        for part, source in (("text_encoder", TEXT_FROM), ("tokenizer", TEXT_FROM), ("vae", VAE_FROM),
                             ("image_encoder", IMAGE_FROM), ("image_processor", IMAGE_FROM)):
            shutil.copytree(Path(source) / part, tmp / part)
        index = {"_class_name": "WanImageToVideoPipeline", "_diffusers_version": diffusers.__version__,
                 **{k: list(v) for k, v in WAN_2_1_I2V_MODEL_INDEX.items() if not k.startswith("_")}}
        (tmp / "model_index.json").write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")
        (tmp / GENERATION_DEFAULTS_FILE).write_text(json.dumps(GENERATION_DEFAULTS, indent=2) + "\n")

    write_whole(out, write)


def train(out: Path, seed: int = SEED, steps: int = STEPS, clips_per_prompt: int = CLIPS_PER_PROMPT,
          clip_frames: int = CLIP_FRAMES, windows_per_clip: int = WINDOWS_PER_CLIP, threads: int = THREADS,
          lr: float = LR, record_path: Path | None = None, plot: Path | None = None, log=print,
          prompts: tuple[str, ...] = PROMPTS) -> dict:
    """Train and write the checkpoint to `out`; `prompts` (the clips' prompts, default all 40) is for short tests."""
    threads_before, deterministic_before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        return _train(Path(out), seed=seed, steps=steps, clips_per_prompt=clips_per_prompt, clip_frames=clip_frames,
                      windows_per_clip=windows_per_clip, threads=threads, lr=lr, record_path=record_path,
                      plot=plot, log=log, clip_prompts=prompts)
    finally:
        torch.set_num_threads(threads_before)
        torch.use_deterministic_algorithms(deterministic_before)


def _train(out, *, seed, steps, clips_per_prompt, clip_frames, windows_per_clip, threads, lr, record_path, plot,
           log, clip_prompts) -> dict:
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    t_start, cpu_start = time.perf_counter(), time.process_time()
    seed_everything(seed, threads)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)

    text, text_bias = compress_text(encode_prompts(*load_text(TEXT_FROM), (*PROMPTS, NEGATIVE)))

    t0 = time.perf_counter()
    prompts = [p for p in clip_prompts for _ in range(clips_per_prompt)]
    clips = [render_long_clip(p, clip_frames, rng) for p in prompts]
    starts = [sorted(rng.choice(clip_frames - FRAMES + 1, size=min(windows_per_clip, clip_frames - FRAMES + 1),
                                replace=False).tolist()) for _ in clips]
    render_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    latents, condition, firsts = encode_windows(load_vae(), clips, starts)
    image_embeds = image_features(*load_image_encoder(), firsts)
    window_prompts = torch.tensor([PROMPTS.index(p) for p, s in zip(prompts, starts) for _ in s])
    del clips
    encode_s = time.perf_counter() - t0
    log(f"rendered {len(prompts)} clips of {clip_frames} frames in {render_s:.0f} s; {len(latents)} windows encoded "
        f"in {encode_s:.0f} s; latents: mean {latents.mean():.3f}, std {latents.std():.3f}")

    t0 = time.perf_counter()
    transformer = new_transformer(seed + 2)
    losses = train_transformer(transformer, latents, condition, image_embeds, window_prompts, text, text_bias, steps,
                               g, log, lr=lr)
    transformer_s = time.perf_counter() - t0

    write_checkpoint(out, transformer)
    wall_s = time.perf_counter() - t_start
    cpu_s = time.process_time() - cpu_start
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    record = {
        "seed": seed, "threads": threads, "steps": steps, "batch": BATCH, "clips": len(prompts),
        "clips_per_prompt": clips_per_prompt, "clip_frames": clip_frames, "windows": len(latents),
        "frames": FRAMES, "lr": lr, "ema_decay": EMA_DECAY, "flow_shift": FLOW_SHIFT,
        "empty_prompt_prob": EMPTY_PROMPT_PROB,
        "final_loss": float(np.mean(losses[-50:])) if losses else None,
        "transformer_parameters": sum(p.numel() for p in transformer.parameters()),
        **{f"{part}_from": str(Path(path).relative_to(RECORDS.parent)) for part, path in
           (("init", INIT_FROM), ("vae", VAE_FROM), ("text", TEXT_FROM), ("image_encoder", IMAGE_FROM))},
        "seconds": {"render": round(render_s, 1), "encode": round(encode_s, 1), "transformer": round(transformer_s, 1),
                    "total": round(wall_s, 1)},
        "cpu_seconds": round(cpu_s, 1), "load_average_at_end": load,
        **run_provenance(out, "tools.weights.train_tiny_i2v", threads),
    }
    if record_path is not None:
        Path(record_path).write_text(json.dumps(record, indent=2) + "\n")
    if plot is not None and losses:
        plot_losses(losses, plot, f"weights/tiny-i2v training: {wall_s / 60:.1f} min on {threads} CPU threads, "
                                  f"seed {seed}")
    log(f"wrote {out} in {wall_s / 60:.1f} min ({cpu_s / 60:.1f} min of CPU): loss {record['final_loss']}")
    return record


def main(argv: list[str] | None = None) -> int:
    return training_main(argv, module="train_tiny_i2v", doc=__doc__, train=train, default_out=DEFAULT_OUT, seed=SEED,
                         steps=STEPS, clips_per_prompt=CLIPS_PER_PROMPT, lr=LR, threads=THREADS)


if __name__ == "__main__":
    sys.exit(main())
