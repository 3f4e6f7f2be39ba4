"""Helios with a pyramid (`HeliosPyramidPipeline` checkpoints: Helios-Mid, and Helios-Distilled with the DMD scheduler).

The chunk loop, the history and the per-chunk decode are `engine/families/helios.py`'s. What the pyramid adds,
as diffusers' `HeliosPyramidPipeline.__call__` does it:

- each chunk is denoised in `len(pyramid_num_inference_steps_list)` stages (3) at rising resolutions: the chunk's
  noise is downsampled twice (bilinear, x2 each time), and each later stage starts from the stage before
  upsampled (nearest) and renoised with the scheduler's block noise (diffusers' `sample_block_noise`, from the
  request's generator, in order), to the stage's start sigma;
- the scheduler's schedule is set per stage (`set_timesteps(steps, stage)`), with the shift of the latents the
  stage starts from; the forward's timestep is an integer;
- a distilled checkpoint (`is_distilled`: `HeliosDMDScheduler`) steps by re-noising the predicted clean latents
  to the stage's starting noise; `is_amplify_first_chunk` doubles the first chunk's steps;
- `is_cfg_zero_star` checkpoints guide with CFG-Zero*: the unconditional prediction scaled by its projection on
  the conditional one, and a zero prediction for the first `zero_steps` + 1 steps of the first stage.

Every stage's forward is the same sequence-parallel forward over history and chunk tokens (the chunk's tokens at
the stage's resolution); requests batch with others at the same stage resolution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from longserve.engine.config import ModelDescription
from longserve.engine.families.base import check_int, read_json
from longserve.engine.families.helios import HeliosFacts, HeliosFamily, HeliosRequest
from longserve.engine.request import GenerationSpec, RequestError

PYRAMID_OPTIONS = ("pyramid_num_inference_steps_list", "is_amplify_first_chunk", "use_zero_init", "zero_steps")


#: the smallest eigenvalue of the block-noise covariance that diffusers' float32 Cholesky factors on every CPU; nearer
#: to singular, whether `torch.linalg.cholesky` succeeds depends on the CPU's LAPACK path (the 1e-8 jitter diffusers
#: adds is below float32's resolution of 1 + gamma)
MIN_BLOCK_NOISE_EIGENVALUE = 1e-4


def check_block_noise(gamma: float, n: int, patch: str) -> None:
    """Refuse a `gamma` whose block noise cannot be drawn: diffusers' `sample_block_noise` factors the covariance
    (1 + gamma) I - gamma J of the n = ph * pw pixels of a patch, whose eigenvalues are 1 + gamma (n - 1 times, the
    directions that sum to zero) and 1 - gamma (n - 1) (the all-ones direction). It must be positive definite with a
    margin float32 keeps: decided from these numbers, never by trying the factorisation on this CPU (ValueError
    naming gamma)."""
    smallest = min(1.0 + gamma, 1.0 - gamma * (n - 1))
    if not smallest >= MIN_BLOCK_NOISE_EIGENVALUE:
        raise ValueError(f"this checkpoint's scheduler gamma ({gamma:g}) makes the pyramid's block-noise covariance "
                         f"(1 + gamma) I - gamma J of {patch} patches singular or nearly so (smallest eigenvalue "
                         f"{smallest:.3g}, below {MIN_BLOCK_NOISE_EIGENVALUE:g}): diffusers' sample_block_noise "
                         f"cannot factor it reliably; gamma must be below 1/(n-1) = {1 / (n - 1):.4g} by a margin")


@dataclass(frozen=True)
class HeliosPyramidFacts(HeliosFacts):
    stages: int = 3                       # the scheduler's resolutions per chunk
    is_distilled: bool = False            # the DMD scheduler: a step re-noises to the stage's starting noise
    is_cfg_zero_star: bool = False        # guidance by CFG-Zero*


class HeliosPyramidFamily(HeliosFamily):
    """`HeliosPyramidPipeline` checkpoints: Helios' chunks, each denoised in a pyramid of resolutions."""

    name = "helios-pyramid"
    #: diffusers' `HeliosPyramidPipeline.__call__` defaults (num_inference_steps: the stages' sum)
    pipeline_defaults = {"HeliosPyramidPipeline": {
        "height": 384, "width": 640, "num_frames": 132, "num_inference_steps": 30, "guidance_scale": 5.0, "fps": 24,
        "history_sizes": [16, 2, 1], "num_latent_frames_per_chunk": 9, "pyramid_num_inference_steps_list": [10, 10, 10],
        "is_amplify_first_chunk": False, "use_zero_init": True, "zero_steps": 1}}
    pipeline_classes = frozenset(pipeline_defaults)

    @classmethod
    def describe(cls, model_dir: Path) -> ModelDescription:
        desc = super().describe(model_dir)
        index = read_json(Path(model_dir) / "model_index.json")
        scheduler = read_json(Path(model_dir) / "scheduler" / "scheduler_config.json")
        stages = scheduler.get("stages", 3)
        patch = read_json(Path(model_dir) / "transformer" / "config.json").get("patch_size", [1, 2, 2])
        # refused at start, before any worker loads, not at a request's second stage
        check_block_noise(scheduler.get("gamma", 1 / 3), patch[1] * patch[2], f"{patch[1]}x{patch[2]}")
        # the lowest stage is 2^(stages-1) times smaller, in whole patches: 64 px for 3 stages of an 8x VAE
        return replace(desc, size_multiple=desc.size_multiple * 2 ** (stages - 1),
                       options=(*(o for o in desc.options if o != "sigmas"), *PYRAMID_OPTIONS),
                       facts=HeliosPyramidFacts(**vars(desc.facts), stages=stages,
                                                is_distilled=bool(index.get("is_distilled")),
                                                is_cfg_zero_star=bool(index.get("is_cfg_zero_star"))))

    @classmethod
    def check_request(cls, desc: ModelDescription, spec: GenerationSpec) -> GenerationSpec:
        o, d = spec.options, desc.defaults.options
        steps = o.get("pyramid_num_inference_steps_list", d.get("pyramid_num_inference_steps_list", [10, 10, 10]))
        stages = desc.facts.stages
        if not isinstance(steps, (list, tuple)) or len(steps) != stages:
            raise RequestError("pyramid_num_inference_steps_list",
                               f"pyramid_num_inference_steps_list must be a list of {stages} step counts (one per "
                               f"stage of this checkpoint's scheduler); got {steps!r}")
        for v in steps:
            check_int("pyramid_num_inference_steps_list", v, 1, 1000)
        for name in ("is_amplify_first_chunk", "use_zero_init"):
            value = o.get(name, d.get(name, False))
            if not isinstance(value, bool):
                raise RequestError(name, f"{name} must be true or false; got {value!r}")
        check_int("zero_steps", o.get("zero_steps", d.get("zero_steps", 1)), 0, 1000)
        spec.num_inference_steps = sum(steps)          # what the stages make together (checked as any step count)
        spec = super().check_request(desc, spec)
        spec.options = {**{k: d[k] for k in PYRAMID_OPTIONS if k in d}, **spec.options,
                        "pyramid_num_inference_steps_list": [int(v) for v in steps]}
        return spec

    # -- the schedule --------------------------------------------------------------------------------

    def stages(self, spec: GenerationSpec) -> int:
        return len(spec.options["pyramid_num_inference_steps_list"])

    def set_timesteps(self, scheduler, spec: GenerationSpec, stage: int, first: bool, mu: float) -> None:
        o = spec.options
        scheduler.set_timesteps(o["pyramid_num_inference_steps_list"][stage], stage, device=self.pg.device, mu=mu,
                                is_amplify_first_chunk=bool(o.get("is_amplify_first_chunk")) and first)

    def chunk_start(self, noise: torch.Tensor) -> torch.Tensor:
        """The noise at the lowest stage's resolution: bilinear halvings, each times 2 (diffusers' pyramid)."""
        B, C, T, h, w = noise.shape
        x = noise.permute(0, 2, 1, 3, 4).reshape(B * T, C, h, w)                  # (B T, C, h, w)
        for _ in range(self.desc.facts.stages - 1):
            h, w = h // 2, w // 2
            x = F.interpolate(x, size=(h, w), mode="bilinear") * 2
        return x.reshape(B, T, C, h, w).permute(0, 2, 1, 3, 4)                    # (B, C, T, h', w')

    def stage_start(self, r: HeliosRequest) -> torch.Tensor:
        """The stage before's latents upsampled (nearest, x2) and renoised to this stage's start, with the block
        noise diffusers' own `sample_block_noise` draws from the request's generator."""
        B, C, T, h, w = r.latents.shape
        x = r.latents.permute(0, 2, 1, 3, 4).reshape(B * T, C, h, w)
        x = F.interpolate(x, size=(2 * h, 2 * w), mode="nearest")
        x = x.reshape(B, T, C, 2 * h, 2 * w).permute(0, 2, 1, 3, 4)               # (B, C, T, 2h, 2w)
        ori_sigma = 1 - r.scheduler.ori_start_sigmas[r.stage]                       # the signal's original weight
        gamma = r.scheduler.config.gamma
        alpha = 1 / (math.sqrt(1 + (1 / gamma)) * (1 - ori_sigma) + ori_sigma)
        beta = alpha * (1 - ori_sigma) / math.sqrt(gamma)
        noise = type(self.pipe).sample_block_noise(self.pipe, B, C, T, 2 * h, 2 * w,
                                                   self.pipe.transformer.config.patch_size, self.pg.device,
                                                   r.generator)
        return alpha * x + beta * noise.to(device=self.pg.device, dtype=self.dtype)

    def timestep(self, r: HeliosRequest) -> torch.Tensor:
        return r.scheduler.timesteps[r.stage_step].to(torch.int64)

    def scheduler_step(self, r: HeliosRequest, pred: torch.Tensor) -> torch.Tensor:
        t = r.scheduler.timesteps[r.stage_step]
        dmd = {}
        if self.desc.facts.is_distilled:
            dmd = dict(cur_sampling_step=r.stage_step, dmd_noisy_tensor=r.start_point, dmd_sigmas=r.scheduler.sigmas,
                       dmd_timesteps=r.scheduler.timesteps, all_timesteps=r.scheduler.timesteps)
        return r.scheduler.step(pred, t, r.latents, generator=r.generator, return_dict=False, **dmd)[0]

    def guide(self, r: HeliosRequest, out: torch.Tensor) -> torch.Tensor:
        """CFG-Zero* on `is_cfg_zero_star` checkpoints (diffusers' `optimized_scale` per row), else plain CFG."""
        if not (r.spec.use_cfg and self.desc.facts.is_cfg_zero_star):
            return super().guide(r, out)
        from diffusers.pipelines.helios.pipeline_helios_pyramid import optimized_scale

        uncond, cond = out.chunk(2)
        o = r.spec.options
        if r.stage == 0 and r.stage_step <= o.get("zero_steps", 1) and o.get("use_zero_init", True):
            return cond * 0.0
        B = cond.shape[0]
        alpha = optimized_scale(cond.reshape(B, -1), uncond.reshape(B, -1))
        alpha = alpha.view(B, *([1] * (cond.ndim - 1))).to(cond.dtype)
        return uncond * alpha + r.spec.guidance_scale * (cond - uncond * alpha)


FAMILY = HeliosPyramidFamily
