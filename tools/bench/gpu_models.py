"""The models, inputs and checkpoint directories `longserve bench gpu`'s sections share (tools/bench/gpu.py,
gpu_wan.py, backends.py): published shapes with seeded random weights, our one-worker step and diffusers' forward on
them, and the device-waiting timers."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

LATTE_1 = dict(heads=16, head_dim=72, layers=28, caption_channels=4096, text_len=120, latent=64)
LATTE_SMOKE = dict(heads=3, head_dim=8, layers=2, caption_channels=32, text_len=8, latent=8)
WAN_SMOKE = dict(num_attention_heads=3, attention_head_dim=12, ffn_dim=48, text_dim=16, in_channels=4,
                 out_channels=4, num_layers=2, freq_dim=32)


def device_sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_call(dev, fn, *args) -> float:
    """Seconds of fn(*args) (the arguments are passed, not captured, so a loop's values are the current ones)."""
    device_sync(dev)
    t = time.perf_counter()
    fn(*args)
    device_sync(dev)
    return time.perf_counter() - t


def peak_memory(dev, fn, *args) -> tuple[float, float]:
    """(peak bytes above the memory at entry, seconds) of fn(*args)."""
    from longserve.engine.memory import PeakMemory

    device_sync(dev)
    t = time.perf_counter()
    with PeakMemory(dev) as mem:
        fn(*args)
        device_sync(dev)
    return mem.peak_bytes, time.perf_counter() - t


def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def free(dev) -> None:
    """Between a GPU section's cases: collect what cycles hold (modules with hooks), and give the cache back. On the
    CPU a tensor goes with its last reference and nothing is cached: no collection (a full one costs 0.25 s in a
    process holding torch, diffusers and transformers; the smoke tests made 19)."""
    import gc

    import torch

    if dev.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# -- models ---------------------------------------------------------------------------------------------------


def latte_cfg(smoke: bool) -> dict:
    return dict(LATTE_SMOKE if smoke else LATTE_1)


def wan_config(smoke: bool, layers: int | None = None) -> dict:
    from tools.weights.wan import WAN_2_1_T2V_1_3B_TRANSFORMER, init_kwargs

    cfg = init_kwargs(WAN_2_1_T2V_1_3B_TRANSFORMER)
    if smoke:
        cfg.update(WAN_SMOKE)
    if layers is not None:
        cfg["num_layers"] = layers
    return cfg


def build_latte(cfg: dict, layers: int | None = None, video_length: int = 16):
    from tools.bench.models import random_latte_transformer

    return random_latte_transformer(cfg["heads"], cfg["head_dim"], layers or cfg["layers"], video_length=video_length,
                                    sample_size=cfg["latent"], caption_channels=cfg["caption_channels"])


def build_wan(cfg: dict):
    import torch
    from diffusers import WanTransformer3DModel

    from tools.weights.seeded import redraw_

    torch.manual_seed(0)
    with torch.no_grad():
        return redraw_(WanTransformer3DModel(**cfg).eval(), 0)


def latte_inputs(cfg: dict, frames: int, latent: int, dev, dtype, batch: int = 2, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, frames, latent, latent, generator=g)
    t = torch.tensor([900.0, 300.0] * (batch // 2) + [500.0] * (batch % 2))
    e = torch.randn(batch, cfg["text_len"], cfg["caption_channels"], generator=g)
    return x.to(dev, dtype), t.to(dev), e.to(dev, dtype)


def wan_inputs(cfg: dict, latent_frames: int, h: int, w: int, dev, dtype, batch: int = 2, seed: int = 0,
               text_len: int = 512):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg["in_channels"], latent_frames, h, w, generator=g)
    t = torch.tensor([900.0, 300.0] * (batch // 2) + [500.0] * (batch % 2))
    e = torch.randn(batch, text_len, cfg["text_dim"], generator=g)
    return x.to(dev, dtype), t.to(dev), e.to(dev, dtype)


def solo_group(dev):
    from longserve.engine.dist import ParallelGroup

    return ParallelGroup(rank=0, world_size=1, device=dev)


def latte_ours(model, dev):
    from longserve.engine.models import latte

    pg = solo_group(dev)
    return lambda x, t, e: latte.parallel_forward(model, x, t, e, pg, "dsp")


def latte_theirs(model):
    return lambda x, t, e: model(x, timestep=t, encoder_hidden_states=e).sample


def wan_ours(model, dev):
    from longserve.engine.models.wan import WanSequenceParallel
    from longserve.engine.parallel import make_sequence_parallel

    sp = make_sequence_parallel(solo_group(dev), "ulysses")
    hooked = WanSequenceParallel(model)
    return lambda x, t, e: hooked(x, t, e, sp)


def wan_theirs(model):
    return lambda x, t, e: model(x, t, e, return_dict=False)[0]


def build_sd_vae(smoke: bool):
    import torch
    from diffusers import AutoencoderKL

    channels = (8, 8, 16, 16) if smoke else (128, 256, 512, 512)
    torch.manual_seed(0)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=channels, layers_per_block=2,
                         latent_channels=4, norm_num_groups=8 if smoke else 32, sample_size=512,
                         scaling_factor=0.18215).eval()


def copy_shared_parts(shipped: str, out_dir: Path) -> Path:
    """The tokenizer, scheduler and model_index.json of a shipped tiny checkpoint, into out_dir; its path."""
    from longserve.weights.registry import resolve_model

    src = resolve_model(shipped)
    for part in ("tokenizer", "scheduler", "model_index.json"):
        (shutil.copytree if (src / part).is_dir() else shutil.copy)(src / part, out_dir / part)
    return src


def build_latte_dir(out_dir: Path, smoke: bool) -> Path:
    import torch
    from transformers import T5Config, T5EncoderModel

    src = copy_shared_parts("tiny-latte", out_dir)
    cfg = latte_cfg(smoke)
    build_latte(cfg).to(torch.bfloat16).save_pretrained(out_dir / "transformer")
    t5 = T5Config.from_pretrained(src / "text_encoder")
    torch.manual_seed(0)
    T5EncoderModel(T5Config(**{**t5.to_dict(), "d_model": cfg["caption_channels"], "num_layers": 1, "num_heads": 2,
                               "d_kv": 32, "d_ff": 256})).to(torch.bfloat16).save_pretrained(out_dir / "text_encoder")
    build_sd_vae(smoke).to(torch.bfloat16).save_pretrained(out_dir / "vae")
    return out_dir


def build_wan_dir(out_dir: Path, smoke: bool) -> Path:
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    from tools.weights.seeded import redraw_
    from tools.weights.wan import WAN_2_1_VAE, init_kwargs

    src = copy_shared_parts("tiny-wan", out_dir)
    cfg = wan_config(smoke)
    build_wan(cfg).to(torch.bfloat16).save_pretrained(out_dir / "transformer")
    # tiny-wan's UMT5 (its tokenizer's vocabulary) at the transformer's text width, one layer, seeded as tiny-wan's
    umt5 = UMT5Config.from_pretrained(src / "text_encoder")
    umt5 = UMT5Config(**{**umt5.to_dict(), "d_model": cfg["text_dim"], "d_kv": 8, "num_heads": 2, "d_ff": 16,
                         "num_layers": 1})
    redraw_(UMT5EncoderModel(umt5).eval(), 1).to(torch.bfloat16).save_pretrained(out_dir / "text_encoder")
    vae_cfg = init_kwargs(WAN_2_1_VAE)
    if smoke:
        vae_cfg.update(base_dim=16, z_dim=4, latents_mean=vae_cfg["latents_mean"][:4],
                       latents_std=vae_cfg["latents_std"][:4])
    torch.manual_seed(0)
    AutoencoderKLWan(**vae_cfg).eval().to(torch.bfloat16).save_pretrained(out_dir / "vae")
    return out_dir
