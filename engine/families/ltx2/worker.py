"""LTX-2's worker parts: the encoder (Gemma 3 through the text connectors, the first frame; rank 0) and the guided
loop, what diffusers' `LTX2Pipeline.__call__` does step for step.

Video latents and audio latents are drawn from the request's generator in that order, one FlowMatchEuler schedule
(dynamic shift from the video's token count) serves both streams, and at every step one forward of the transformer
runs over the video tokens and the audio tokens together, sequence-parallel by `plan.py` (video split, audio
replicated), with CFG-parallel around it (`VideoFamily.denoise`). Guidance is LTX-2's: in x0 space, per stream
(video, audio), the sum of

    CFG       (guidance_scale - 1) * (cond - uncond)           [uncond; cond] rows of the one forward
    STG       stg_scale * (cond - perturbed)                    a second forward, self-attention skipped in the
                                                                `spatio_temporal_guidance_blocks`
    modality  (modality_scale - 1) * (cond - isolated)          a third forward without the audio<->video attention

then `guidance_rescale` (diffusers' `rescale_noise_cfg`) and back to a velocity for the scheduler. The STG and
modality forwards run on the conditional rows only, batched over the requests of a step (their settings are part of
the batch key, so a batch shares them). The distilled few-step schedule (`distilled: true`): diffusers'
`DISTILLED_SIGMA_VALUES` (8 steps), no CFG, no STG, no modality guidance, as the distilled checkpoints are run.
Every call into diffusers' pipeline internals goes through `pipeline_api.py`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from longserve.engine.decoding import FramesPolicy, FrameStream
from longserve.engine.families.base import WorkerRequest, order_rows, seeded_generator, split_rows, sync_cuda
from longserve.engine.families.ltx2 import pipeline_api as api
from longserve.engine.families.ltx2.rules import STAGE_2_SIGMAS, guidance_settings
from longserve.engine.outputs import Sound
from longserve.engine.request import GenerationSpec

MAX_SEQUENCE_LENGTH = 1024          # diffusers' LTX2Pipeline pads every prompt to it


@dataclass
class LTX2Request(WorkerRequest):
    audio_latents: torch.Tensor = None  # (B, A, C_audio) packed, float32
    audio_scheduler: object = None
    latent_frames: int = 0
    latent_height: int = 0
    latent_width: int = 0
    audio_frames: int = 0
    video_coords: torch.Tensor = None   # (B, 3, S, 2)
    audio_coords: torch.Tensor = None
    guidance: dict = None               # the request's resolved guidance settings (see `guidance_settings`)
    mask: torch.Tensor = None           # image-to-video: (B, S) 1 on the conditioned (first-frame) tokens, else None
    cfg: bool = False                   # this stage's forward has [uncond; cond] rows (the second stage has none)
    upsample: bool = False              # two stages: half the size, the latent upsampler, the distilled second stage
    stage: int = 0
    stage_start: int = 0                # steps done before this stage (its scheduler counts from there)
    fps_rate: float = 24.0              # the frame rate the positions are conditioned on
    clip: torch.Tensor = None           # the final video latents (B, C, F, h, w) de-normalised, once denoised


class LTX2Encoder:
    """Rank 0's encodings, as `LTX2Pipeline` and `LTX2ImageToVideoPipeline` make them."""

    components = ("text_encoder", "tokenizer", "connectors")

    def __init__(self, worker):
        self.w = worker

    def prompt(self, spec: GenerationSpec):
        """Gemma 3's stacked hidden states through the text connectors: per row, the video context, the audio
        context and the connectors' mask, packed side by side in one tensor (B, L, D_video + D_audio + 1) for the
        broadcast."""
        pipe = self.w.pipe

        def encoded(prompts):
            embeds, mask = api.gemma_embeds(pipe, prompts, MAX_SEQUENCE_LENGTH, self.w.pg.device, self.w.dtype)
            side = getattr(pipe.tokenizer, "padding_side", "left")
            video, audio, mask = pipe.connectors(embeds, mask, padding_side=side)
            return torch.cat([video, audio, mask[..., None].to(video.dtype)], dim=-1)

        positive = encoded(spec.prompt)
        negative = encoded(spec.negative_prompts()) if spec.use_cfg else None
        return positive, negative

    def conditions(self, spec: GenerationSpec) -> dict[str, torch.Tensor]:
        """Image-to-video: the first frame re-compressed at the model's H.264 CRF, resized, VAE-encoded (the latent
        distribution's mode) and normalised -> (1, C, 1, h, w)."""
        if "image" not in spec.options:
            return {}
        from longserve.engine.images import to_pil

        pipe, w = self.w.pipe, self.w
        image = api.image_at_crf(pipe, to_pil(spec.options["image"]), spec.options.get("image_crf"))
        pixels = pipe.video_processor.preprocess(image, height=spec.height, width=spec.width)
        pixels = pixels.to(w.pg.device, dtype=w.dtype).to(pipe.vae.dtype)
        latents = pipe.vae.encode(pixels[:, :, None]).latent_dist.mode()
        return {"image_latents": api.normalize(pipe, latents.to(w.dtype), scaled=False)}


class LTX2Loop:
    """The guided loop (the module docstring): its own `step`, of up to three forwards."""

    def __init__(self, worker):
        self.w = worker
        self.upsampler = None
        if worker.desc.facts.upsampler:                 # every rank runs it (identical inputs, identical outputs)
            self.upsampler = api.latent_upsampler(Path(worker.config.model_dir) / "latent_upsampler",
                                                  worker.dtype).to(worker.pg.device).eval()

    def _text_parts(self, text: torch.Tensor):
        """The packed context -> (video context, audio context, mask)."""
        c = self.w.pipe.transformer.config
        # the audio context's width: the connectors' (caption_channels) when the transformer projects it (LTX-2.0),
        # else the audio stream's (LTX-2.3's per-modality connectors)
        da = c.caption_channels if c.use_prompt_embeddings else c.audio_cross_attention_dim
        video, audio, mask = text.split([text.shape[-1] - da - 1, da, 1], dim=-1)
        return video, audio, mask[..., 0]

    @staticmethod
    def batch_key(r: LTX2Request) -> tuple:
        g = r.guidance
        return ("ltx2", *r.latents.shape[1:], *r.audio_latents.shape[1:], r.latent_frames, r.latent_height,
                r.latent_width, tuple(g["spatio_temporal_guidance_blocks"]) if g["stg"] else None, g["modality"])

    def prepare(self, spec: GenerationSpec, text: torch.Tensor, image_latents: torch.Tensor = None) -> LTX2Request:
        w, pipe, o = self.w, self.w.pipe, spec.options
        generator = seeded_generator(spec.seed)
        B, device = spec.batch_size, w.pg.device
        vae_s, vae_t = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
        upsample = bool(o.get("upsample", False))
        scale = 2 if upsample else 1                        # the first stage at half the size
        F, h, w_ = (spec.num_frames - 1) // vae_t + 1, spec.height // vae_s // scale, spec.width // vae_s // scale
        noise = torch.randn((B, pipe.transformer.config.in_channels, F, h, w_), generator=generator,
                            dtype=torch.float32)                                          # prepare_latents
        mask = None
        if image_latents is not None:                       # the first latent frame is the image's, kept clean
            cond = torch.zeros((B, 1, F, h, w_))
            cond[:, :, 0] = 1.0
            image_latents = image_latents.float().cpu().repeat(B, 1, F, 1, 1)
            noise = image_latents * cond + noise * (1 - cond)
            mask = api.pack(pipe, cond).squeeze(-1).to(device)                            # (B, S)
        latents = api.pack(pipe, noise).to(device)
        fps = float(spec.fps)
        A = round(spec.num_frames / fps * pipe.audio_sampling_rate / pipe.audio_hop_length
                  / float(pipe.audio_vae_temporal_compression_ratio))
        mel = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        audio_noise = torch.randn((B, pipe.audio_vae.config.latent_channels, A, mel), generator=generator,
                                  dtype=torch.float32)                                    # prepare_audio_latents
        audio_latents = api.pack_audio(pipe, audio_noise).to(device)
        steps = spec.num_inference_steps
        sigmas = o.get("sigmas")
        sigmas = np.linspace(1.0, 1 / steps, steps) if sigmas is None else np.asarray(sigmas, dtype=np.float64)
        scheduler, audio_scheduler = api.flow_schedulers(pipe, steps, sigmas, latents.shape[1], device)
        rate = api.conditioning_rate(fps, o.get("motion_speed", 1.0))
        video_coords = pipe.transformer.rope.prepare_video_coords(B, F, h, w_, device, fps=rate)
        audio_coords = pipe.transformer.audio_rope.prepare_audio_coords(B, A, device)
        req = LTX2Request(spec=spec, num_steps=len(scheduler.timesteps), batch_key=(), num_frames=spec.num_frames,
                          text=text, scheduler=scheduler, latents=latents, audio_latents=audio_latents,
                          audio_scheduler=audio_scheduler, latent_frames=F, latent_height=h, latent_width=w_,
                          audio_frames=A, video_coords=video_coords, audio_coords=audio_coords,
                          guidance=guidance_settings(spec), mask=mask, cfg=spec.use_cfg, upsample=upsample,
                          fps_rate=rate)
        if upsample:
            req.num_steps += len(STAGE_2_SIGMAS)
        # the whole clip is pushed once, when denoising ends, and decoded a window at a time (the decoder's
        # `frames_per_call`), the sound with the first; output "latent" hands the latents out in one piece
        req.frames = FrameStream(FramesPolicy(vae_t, whole=spec.output == "latent"),
                                 lambda _: w.decoder.clip(req), spec.output, w.pg.rank, spec.num_frames)
        req.batch_key = self.batch_key(req)
        return req

    def inputs(self, r: LTX2Request, cond_only: bool = False) -> dict:
        rows = 2 if r.cfg and not cond_only else 1
        text = r.text[-r.spec.batch_size:] if cond_only and r.cfg else r.text
        video_ctx, audio_ctx, mask = self._text_parts(text)
        t = r.scheduler.timesteps[r.steps_done - r.stage_start].reshape(1).expand(rows * r.spec.batch_size)
        # image-to-video: a timestep per video token, 0 on the conditioned first frame (the sound's stays per row)
        video_t = t if r.mask is None else t.unsqueeze(-1) * (1 - torch.cat([r.mask] * rows))

        def rep(x):
            return torch.cat([x] * rows) if rows > 1 else x

        dtype = self.w.dtype
        return {"hidden_states": rep(r.latents).to(dtype), "audio_hidden_states": rep(r.audio_latents).to(dtype),
                "encoder_hidden_states": video_ctx, "audio_encoder_hidden_states": audio_ctx,
                "timestep": video_t, "audio_timestep": t, "encoder_attention_mask": mask,
                "video_coords": rep(r.video_coords), "audio_coords": rep(r.audio_coords)}

    def forward(self, model, inputs: dict, cfg_parallel: bool, r: LTX2Request = None, **flags):
        kw = {k: torch.cat(v) for k, v in inputs.items()}
        kw["timestep"] = kw["timestep"].to(self.w.pg.device)
        kw["audio_timestep"] = kw["audio_timestep"].to(self.w.pg.device)
        kw.update(sigma=kw["audio_timestep"], audio_encoder_attention_mask=kw["encoder_attention_mask"],
                  num_frames=r.latent_frames, height=r.latent_height, width=r.latent_width,
                  audio_num_frames=r.audio_frames, use_cross_timestep=True, **flags)
        video, audio = self.w.denoise(model, cfg_parallel, kw.pop("hidden_states"), **kw)
        return torch.cat([video.float().flatten(1), audio.float().flatten(1)], dim=1)   # (rows, S*C + A*Ca)

    def step(self, reqs: list[LTX2Request]) -> None:
        """One denoising step for a batch: the [uncond; cond] forward (CFG-parallel when every request uses CFG),
        then, when the batch's guidance asks for them, the STG and the modality forwards of the conditional rows."""
        t0 = time.perf_counter()
        model, first = self.w.model_for(reqs), reqs[0]
        cfg_parallel = self.w.cfg_groups is not None and all(r.cfg for r in reqs)
        g = first.guidance
        passes = {}
        with torch.no_grad():
            passes["main"] = self._run(model, reqs, cfg_parallel, cond_only=False)
            if g["stg"]:
                passes["stg"] = self._run(model, reqs, False, cond_only=True, isolate_modalities=False,
                                          spatio_temporal_guidance_blocks=list(g["spatio_temporal_guidance_blocks"]))
            if g["modality"]:
                passes["modality"] = self._run(model, reqs, False, cond_only=True, isolate_modalities=True)
            for i, r in enumerate(reqs):
                self._advance(r, {k: v[i] for k, v in passes.items()})
        sync_cuda()
        elapsed = time.perf_counter() - t0
        for r in reqs:
            r.timings["transformer_s"] += elapsed / len(reqs)

    def _run(self, model, reqs, cfg_parallel: bool, cond_only: bool, **flags) -> list[torch.Tensor]:
        rows = [self.inputs(r, cond_only) for r in reqs]
        names = list(rows[0])
        columns = order_rows([[x[n] for n in names] for x in rows], cfg_parallel)
        sizes = [len(x[names[0]]) for x in rows]
        out = self.forward(model, dict(zip(names, columns)), cfg_parallel, r=reqs[0], **flags)
        return split_rows(out, sizes, cfg_parallel)

    def _advance(self, r: LTX2Request, outs: dict) -> None:
        """LTX-2's guidance in x0 space for both streams, then each stream's scheduler step."""
        g, B, i = r.guidance, r.spec.batch_size, r.steps_done - r.stage_start
        S, A = r.latents.shape[1], r.audio_latents.shape[1]

        def streams(o):                     # (rows, S*C + A*Ca) -> video (rows, S, C), audio (rows, A, Ca)
            v, a = o.split([S * r.latents.shape[2], A * r.audio_latents.shape[2]], dim=1)
            return v.reshape(len(o), S, -1), a.reshape(len(o), A, -1)

        main = streams(outs["main"])
        extra = {k: streams(v) for k, v in outs.items() if k != "main"}
        new = []
        for s, (x, sched, prefix) in enumerate(((r.latents, r.scheduler, ""), (r.audio_latents, r.audio_scheduler,
                                                                                "audio_"))):
            sigma = sched.sigmas[i]

            def x0(v, x=x, sigma=sigma):
                return x - v * sigma

            pred = main[s]
            if r.cfg:
                uncond, cond = x0(pred[:B]), x0(pred[B:])
                delta = (g[f"{prefix}guidance_scale"] - 1) * (cond - uncond)
            else:
                cond, delta = x0(pred), 0
            if "stg" in extra:
                delta = delta + g[f"{prefix}stg_scale"] * (cond - x0(extra["stg"][s]))
            if "modality" in extra:
                delta = delta + (g[f"{prefix}modality_scale"] - 1) * (cond - x0(extra["modality"][s]))
            guided = cond + delta
            if g[f"{prefix}guidance_rescale"] > 0:
                guided = api.rescale(guided, cond, g[f"{prefix}guidance_rescale"])
            velocity = (x - guided) / sigma
            stepped = sched.step(velocity, sched.timesteps[i], x, return_dict=False)[0]
            if s == 0 and r.mask is not None:     # image-to-video: the conditioned tokens stay as they are
                stepped = torch.where(r.mask[..., None].bool(), x, stepped)
            new.append(stepped)
        r.latents, r.audio_latents = new
        r.steps_done += 1
        if r.upsample and r.stage == 0 and r.steps_done == r.num_steps - len(STAGE_2_SIGMAS):
            self._start_stage_2(r)
        if r.denoised:
            if r.spec.output == "latent":       # the audio latents, with the video's
                r.frames.audio = Sound(self.final_audio_latents(r).cpu(), 0)
            r.clip = self.final_latents(r)
            r.frames.push(r.clip, last=True)

    def _start_stage_2(self, r: LTX2Request) -> None:
        """The latent upsampler's second stage, as diffusers' two-stage recipe runs it: the first stage's latents
        (de-normalised) through `LTX2LatentUpsamplerModel`, then `LTX2Pipeline` again at the full size from those
        latents and the first stage's sound, re-noised to `STAGE_2_DISTILLED_SIGMA_VALUES[0]` by a generator seeded
        with the request's seed, over those sigmas, without CFG, STG or modality guidance."""
        pipe, device = self.w.pipe, self.w.pg.device
        video = self.final_latents(r)                                               # (B, C, F, h, w) de-normalised
        audio = self.final_audio_latents(r)                                         # (B, C, L, M) de-normalised
        up = self.upsampler(video.to(self.upsampler.dtype)).float()                 # (B, C, F, 2h, 2w)
        generator, scale = seeded_generator(r.spec.seed), STAGE_2_SIGMAS[0]
        r.latent_height, r.latent_width = up.shape[3], up.shape[4]
        up = api.pack(pipe, api.normalize(pipe, up))
        noise = torch.randn(up.shape, generator=generator, dtype=torch.float32).to(device)     # on the tokens
        r.latents = scale * noise + (1 - scale) * up
        audio = api.normalize_audio(pipe, api.pack_audio(pipe, audio))
        noise = torch.randn(audio.shape, generator=generator, dtype=torch.float32).to(device)
        r.audio_latents = scale * noise + (1 - scale) * audio
        r.scheduler, r.audio_scheduler = api.flow_schedulers(pipe, len(STAGE_2_SIGMAS), STAGE_2_SIGMAS,
                                                             r.latents.shape[1], device)
        B = r.spec.batch_size
        r.video_coords = pipe.transformer.rope.prepare_video_coords(B, r.latent_frames, r.latent_height,
                                                                    r.latent_width, device, fps=r.fps_rate)
        r.text = r.text[-B:]                                                         # the conditional rows only
        r.cfg, r.stage, r.stage_start = False, 1, r.steps_done
        r.guidance = {**r.guidance, "guidance_scale": 1.0, "audio_guidance_scale": 1.0, "stg_scale": 0.0,
                      "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0, "stg": False,
                      "modality": False}
        r.batch_key = self.batch_key(r)

    def final_latents(self, r: LTX2Request) -> torch.Tensor:
        """The denoised video latents unpacked and de-normalised (B, C, F, h, w): what diffusers decodes (and returns
        for output "latent")."""
        pipe = self.w.pipe
        return api.denormalize(pipe, api.unpack(pipe, r.latents, r.latent_frames, r.latent_height, r.latent_width))

    def final_audio_latents(self, r: LTX2Request) -> torch.Tensor:
        pipe = self.w.pipe
        mel = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        return api.unpack_audio(pipe, api.denormalize_audio(pipe, r.audio_latents), r.audio_frames, mel)
