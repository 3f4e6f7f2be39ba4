"""Every use longserve makes of diffusers' LTX-2 pipeline internals, in one place: the pipeline's private methods
(`pipe._pack_latents`, `_normalize_latents`, `_get_gemma_prompt_embeds`, ...) and the module-level helpers of
`diffusers.pipelines.ltx2`. An upgrade of diffusers that renames or changes one breaks this module alone (and the
exactness tests, tests/pipelines/test_ltx2_pipeline.py, say so). diffusers is imported when a function is called,
so the coordinator can import the family's rules without it.
"""

from __future__ import annotations

import numpy as np
import torch


def distilled_sigmas() -> list[float]:
    """The distilled checkpoints' fixed 8-step schedule (diffusers' `DISTILLED_SIGMA_VALUES`)."""
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES

    return list(DISTILLED_SIGMA_VALUES)


def flow_schedulers(pipe, steps: int, sigmas, tokens: int, device) -> tuple:
    """(video, audio) schedulers, as `LTX2Pipeline.__call__` sets them: one FlowMatchEuler schedule over `sigmas`
    with the dynamic shift of `tokens` video tokens (`calculate_shift`), a copy for the sound."""
    import copy

    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps

    c = pipe.scheduler.config
    mu = calculate_shift(tokens, c.get("base_image_seq_len", 1024), c.get("max_image_seq_len", 4096),
                         c.get("base_shift", 0.95), c.get("max_shift", 2.05))
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    audio_scheduler = copy.deepcopy(scheduler)
    for s in (audio_scheduler, scheduler):
        retrieve_timesteps(s, steps, device, None, sigmas=np.asarray(sigmas), mu=mu)
        s.set_begin_index(0)
    return scheduler, audio_scheduler


def rescale(guided: torch.Tensor, cond: torch.Tensor, amount: float) -> torch.Tensor:
    """diffusers' `rescale_noise_cfg`."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

    return rescale_noise_cfg(guided, cond, guidance_rescale=amount)


def conditioning_rate(fps: float, motion_speed: float) -> float:
    from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

    return conditioning_frame_rate(fps, motion_speed)


def image_at_crf(pipe, image, crf: int | None):
    """The first frame re-compressed at H.264 `crf` as `LTX2ImageToVideoPipeline` does (None: the model's)."""
    import PIL.Image
    from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf

    crf = resolve_default_image_crf(pipe.text_encoder) if crf is None else crf
    if crf != 0:
        image = PIL.Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))
    return image


def latent_upsampler(path, dtype):
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel

    return LTX2LatentUpsamplerModel.from_pretrained(path, dtype=dtype)


def gemma_embeds(pipe, prompts, max_sequence_length: int, device, dtype) -> tuple:
    """Gemma 3's stacked hidden states and their mask (`_get_gemma_prompt_embeds`)."""
    return pipe._get_gemma_prompt_embeds(prompts, max_sequence_length=max_sequence_length, device=device,
                                         dtype=dtype)


def pack(pipe, latents: torch.Tensor) -> torch.Tensor:
    """(B, C, F, h, w) -> the transformer's tokens (B, S, C')."""
    return pipe._pack_latents(latents, pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)


def unpack(pipe, tokens: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
    return pipe._unpack_latents(tokens, frames, height, width, pipe.transformer_spatial_patch_size,
                                pipe.transformer_temporal_patch_size)


def normalize(pipe, latents: torch.Tensor, scaled: bool = True) -> torch.Tensor:
    """The VAE's latents -> the transformer's (the image's encode omits the scaling factor, as diffusers' I2V)."""
    vae = pipe.vae
    if not scaled:
        return pipe._normalize_latents(latents, vae.latents_mean, vae.latents_std)
    return pipe._normalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


def denormalize(pipe, latents: torch.Tensor) -> torch.Tensor:
    vae = pipe.vae
    return pipe._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


def pack_audio(pipe, latents: torch.Tensor) -> torch.Tensor:
    return pipe._pack_audio_latents(latents)


def unpack_audio(pipe, tokens: torch.Tensor, frames: int, mel_bins: int) -> torch.Tensor:
    return pipe._unpack_audio_latents(tokens, frames, num_mel_bins=mel_bins)


def normalize_audio(pipe, latents: torch.Tensor) -> torch.Tensor:
    return pipe._normalize_audio_latents(latents, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)


def denormalize_audio(pipe, latents: torch.Tensor) -> torch.Tensor:
    return pipe._denormalize_audio_latents(latents, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
