"""A declared family's worker (engine/families/declaration.py): `VideoFamily`'s loading and loop, with the hooks
that differ between families taken from the family's parts rather than from a subclass.

    part        builds from                 answers
    encoder     the worker                  rank 0's `prompt(spec)` and `conditions(spec)` (`admit` broadcasts
                                            them); `components`: the pipeline's parts only rank 0 loads
    denoiser    a diffusers denoiser        the sharded forward (`entry(*inputs, sp=...)`) over the family's
                                            shard plan; CFG-parallel is put around it by `VideoFamily.denoise`
    loop        the worker                  `prepare(spec, text, **conditions)`, `inputs(r)`, `forward(model,
                                            inputs, cfg_parallel)`, and `step(reqs)` (`DenoisingLoop`'s: the
                                            generic step; LTX-2's guided loop runs its own)
    decoder     the worker                  `dtypes` (the VAE's components' dtypes), `__call__(spec, latents)`:
                                            the frame stream's VAE path, `frames_per_call(r, max_frames)`
"""

from __future__ import annotations

from pathlib import Path

import torch

from longserve.engine.families.base import Denoisers, VideoFamily, WorkerRequest
from longserve.engine.request import GenerationSpec

#: what the worker side reads of its family's rules (class-level facts: the message's name, the load pipeline's
#: attention and compile switches, step caching's kinds)
RULES_READ = ("name", "dispatcher_attention", "dispatcher_attention_note", "attention_masks", "merges_across_workers",
              "supports_lora", "supports_compile", "supports_cuda_graphs", "cache_kinds", "split_variance")


class ComposedFamily(VideoFamily):
    """The worker of a declared family: `family.encoder`, `.denoiser`, `.loop` and `.decoder` put together."""

    def __init__(self, ctx, config, family):
        import diffusers

        super().__init__(ctx, config)
        self.family = family
        for name in RULES_READ:
            setattr(self, name, getattr(family.rules, name))
        if config.engine.attention == "xformers":
            raise ValueError(f"attention='xformers' is not available for the {self.name} family (it uses PyTorch "
                             f"SDPA)")
        self.desc = family.rules.describe(Path(config.model_dir))
        encoder, self.entry, loop, decoder = (family.part(p) for p in ("encoder", "denoiser", "loop", "decoder"))
        self.rank0_components = encoder.components
        self.pipe = self.load_pipeline(getattr(diffusers, self.desc.pipeline),
                                       {"default": self.dtype, **decoder.dtypes})
        self.denoisers = self.load_denoisers(Denoisers((self.pipe.transformer,)))
        self.encoder, self.loop, self.decoder = encoder(self), loop(self), decoder(self)
        self.set_plan(config.plan)

    @property
    def rules(self):
        return self.family.rules

    def shard(self, denoiser):
        return self.entry(denoiser)

    def model_for(self, reqs: list[WorkerRequest]):
        """The sharded denoiser (a declared family has one)."""
        return self.denoisers[0]

    def encode_prompt(self, spec: GenerationSpec):
        return self.encoder.prompt(spec)

    def encode_conditions(self, spec: GenerationSpec) -> dict[str, torch.Tensor]:
        return self.encoder.conditions(spec)

    def prepare(self, spec: GenerationSpec, text: torch.Tensor, **conditions) -> WorkerRequest:
        return self.loop.prepare(spec, text, **conditions)

    def inputs(self, r: WorkerRequest) -> dict:
        return self.loop.inputs(r)

    def forward(self, model, inputs: dict, cfg_parallel: bool) -> torch.Tensor:
        return self.loop.forward(model, inputs, cfg_parallel)

    def step(self, reqs: list[WorkerRequest]) -> None:
        self.loop.step(reqs)

    def vae_decoder(self, spec: GenerationSpec, latents: torch.Tensor):
        return self.decoder(spec, latents)

    def decode_next(self, r: WorkerRequest, max_frames: int):
        return super().decode_next(r, self.decoder.frames_per_call(r, max_frames))


class DenoisingLoop:
    """The loop part most families take: `VideoFamily.step` (one forward of every request's rows, guidance, the
    scheduler's step) over the family's `prepare`, `inputs` and `forward`."""

    def __init__(self, worker: ComposedFamily):
        self.w = worker

    def step(self, reqs: list[WorkerRequest]) -> None:
        VideoFamily.step(self.w, reqs)


class Decoder:
    """The decoder part's defaults: the VAE in float32, a decode call hands out what the scheduler asks."""

    dtypes = {"vae": torch.float32}

    def __init__(self, worker: ComposedFamily):
        self.w = worker

    def frames_per_call(self, r: WorkerRequest, max_frames: int) -> int:
        return max_frames
