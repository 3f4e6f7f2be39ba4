"""LTX-2 (`LTX2Pipeline` checkpoints): video with its sound, from one audio-video transformer.

What diffusers' `LTX2Pipeline.__call__` does, step for step, with the engine's stages: the prompt through Gemma 3 and
the text connectors (rank 0, broadcast), video latents and audio latents drawn from the request's generator in that
order, one FlowMatchEuler schedule (dynamic shift from the video's token count) for both streams, and at every step
one forward of the transformer over the video tokens and the audio tokens together, sequence-parallel by
`engine/models/ltx2.py` (video split, audio replicated) and CFG-parallel around it. Guidance is LTX-2's: in x0 space,
per stream (video, audio), the sum of

    CFG       (guidance_scale - 1) * (cond - uncond)           [uncond; cond] rows of the one forward
    STG       stg_scale * (cond - perturbed)                    a second forward, self-attention skipped in the
                                                                `spatio_temporal_guidance_blocks`
    modality  (modality_scale - 1) * (cond - isolated)          a third forward without the audio<->video attention

then `guidance_rescale` (diffusers' `rescale_noise_cfg`) and back to a velocity for the scheduler. The STG and
modality forwards run on the conditional rows only, batched over the requests of a step (their settings are part of
the batch key, so a batch shares them).

The distilled few-step schedule (`distilled: true`): diffusers' `DISTILLED_SIGMA_VALUES` (8 steps), no CFG, no STG,
no modality guidance, as the distilled checkpoints are run.

Output: every latent frame is final when denoising ends; the video is decoded on rank 0 a window at a time and
handed out window by window (engine/ltx2_vae.py: the LTX-2 VAE's decoder is not causal in time, so each window is
decoded with a halo of H latent frames on either side, and its frames equal the one-call decode's). A window keeps
2H latent frames, whatever `decode_chunk_frames` (the last one the rest); a clip no longer than a window plus its
two halos is decoded whole, in one call, as diffusers does, and so is every clip where the VAE cannot be windowed
(`engine.ltx2_vae.not_streamable`). The sound: the audio latents through the audio VAE and the vocoder, decoded
before the first video window and handed out with it (`FramesChunk.audio`, an `engine.outputs.Sound`: float32
(B, channels, samples) at the vocoder's rate), so a streamed download knows the sound when it writes the first
frames. A request with `audio: false` skips the audio decode (its latents are still denoised: the two streams are one
model).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from longserve.engine.config import REFUSED, REQUIRED, FamilyFacts, ModelDescription
from longserve.engine.decoding import FramesPolicy, FrameStream
from longserve.engine.families.base import (
    Denoisers,
    VideoFamily,
    WorkerRequest,
    check_common,
    check_int,
    check_number,
    generation_defaults,
    order_rows,
    read_json,
    seeded_generator,
    split_rows,
    sync_cuda,
)
from longserve.engine.families.wan_parts import WanParts
from longserve.engine.models.ltx2 import LTX2SequenceParallel
from longserve.engine.outputs import Sound
from longserve.engine.request import GenerationSpec, RequestError

MAX_SEQUENCE_LENGTH = 1024          # diffusers' LTX2Pipeline pads every prompt to it
#: the guidance options and diffusers' defaults for them (`LTX2Pipeline.__call__`); a checkpoint's
#: generation_defaults.json may set others
GUIDANCE_DEFAULTS = {"guidance_rescale": 0.7, "stg_scale": 1.0, "modality_scale": 3.0,
                     "audio_guidance_scale": 7.0, "audio_guidance_rescale": 0.7, "audio_stg_scale": 1.0,
                     "audio_modality_scale": 3.0, "spatio_temporal_guidance_blocks": [28]}
OPTIONS = (*GUIDANCE_DEFAULTS, "sigmas", "distilled", "motion_speed", "audio", "fps")
#: image-to-video (`LTX2ImageToVideoPipeline` checkpoints): the first frame, and the H.264 CRF it is re-compressed at
#: before its VAE encode (diffusers' `image_crf`; None: the model's, 33 for the Gemma 3 generations; 0: none)
I2V_OPTIONS = ("image", "image_crf")
IMAGE_PIPELINES = frozenset({"LTX2ImageToVideoPipeline"})
#: the second stage's schedule (diffusers' `STAGE_2_DISTILLED_SIGMA_VALUES`), for `upsample`
STAGE_2_SIGMAS = (0.909375, 0.725, 0.421875)


@dataclass(frozen=True)
class LTX2Facts(FamilyFacts):
    layers: int                         # transformer blocks (STG's block indices are checked against it)
    audio_rate: int                     # the vocoder's output sampling rate (Hz)
    upsampler: bool = False             # the checkpoint ships a latent upsampler (`latent_upsampler/`): `upsample`


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


def guidance_settings(spec: GenerationSpec) -> dict:
    """The request's guidance, as `LTX2Pipeline.__call__` resolves it (an audio value of 0 falls back to the
    video's, as diffusers' `or` does)."""
    o = spec.options
    g = {k: o.get(k, v) for k, v in GUIDANCE_DEFAULTS.items()}
    g["guidance_scale"] = spec.guidance_scale
    for name in ("guidance_scale", "stg_scale", "modality_scale", "guidance_rescale"):
        g[f"audio_{name}"] = g[f"audio_{name}"] or g[name]
    g["stg"] = g["stg_scale"] > 0 or g["audio_stg_scale"] > 0
    g["modality"] = g["modality_scale"] > 1 or g["audio_modality_scale"] > 1
    return g


class LTX2Family(VideoFamily):
    """`LTX2Pipeline` checkpoints: text to video with sound."""

    name = "ltx2"
    plans = ("ulysses", "ring", "usp")
    auto_plan = "sequence"
    pipeline_defaults = {"LTX2Pipeline": {"height": 512, "width": 768, "num_frames": 121, "num_inference_steps": 30,
                                          "guidance_scale": 3.0, "fps": 24},
                         "LTX2ImageToVideoPipeline": {"height": 512, "width": 768, "num_frames": 121,
                                                      "num_inference_steps": 30, "guidance_scale": 3.0, "fps": 24}}
    pipeline_classes = frozenset(pipeline_defaults)
    rank0_components = ("text_encoder", "tokenizer", "connectors")

    @classmethod
    def describe(cls, model_dir: Path) -> ModelDescription:
        model_dir = Path(model_dir)
        index = read_json(model_dir / "model_index.json")
        cfg = read_json(model_dir / "transformer" / "config.json")
        vae = read_json(model_dir / "vae" / "config.json")
        vocoder = read_json(model_dir / "vocoder" / "config.json")
        audio_vae = read_json(model_dir / "audio_vae" / "config.json")
        spatial = vae.get("spatial_compression_ratio") or vae.get("patch_size", 4) * 8
        temporal = vae.get("temporal_compression_ratio") or 8
        # the audio latent's frames a second, as LTX2Pipeline.prepare_audio_latents counts them (the audio VAE
        # compresses 4x in time): one transformer token each
        sound_tokens = audio_vae.get("sample_rate", 16000) / audio_vae.get("mel_hop_length", 160) / 4
        pixels_per_token = spatial ** 2 * temporal * cfg.get("patch_size", 1) ** 2 * cfg.get("patch_size_t", 1)
        i2v = index["_class_name"] in IMAGE_PIPELINES
        upsampler = (model_dir / "latent_upsampler" / "config.json").is_file()
        options = (*OPTIONS, *(I2V_OPTIONS if i2v else ()), *(("upsample",) if upsampler else ()))
        return ModelDescription(
            family=cls.name, pipeline=index["_class_name"], heads=cfg["num_attention_heads"],
            size_multiple=spatial * cfg.get("patch_size", 1), frame_multiple=temporal * cfg.get("patch_size_t", 1),
            defaults=generation_defaults(model_dir, cls.pipeline_defaults[index["_class_name"]]),
            options=options, capabilities=cls.capabilities(options, image=REQUIRED if i2v else REFUSED, sound=True,
                                                           sound_tokens_per_second=sound_tokens,
                                                           pixels_per_token=pixels_per_token),
            facts=LTX2Facts(layers=cfg["num_layers"], audio_rate=vocoder.get("output_sampling_rate", 24000),
                            upsampler=upsampler))

    @classmethod
    def check_request(cls, desc: ModelDescription, spec: GenerationSpec) -> GenerationSpec:
        from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES

        o = dict(spec.options)
        distilled = o.get("distilled", desc.defaults.options.get("distilled", False))
        if not isinstance(distilled, bool):
            raise RequestError("distilled", f"distilled must be true or false; got {distilled!r}")
        if distilled:
            if o.get("sigmas") is not None and list(o["sigmas"]) != list(DISTILLED_SIGMA_VALUES):
                raise RequestError("sigmas", "give sigmas or distilled, not both (distilled is a fixed schedule)")
            o.update(sigmas=list(DISTILLED_SIGMA_VALUES), stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0,
                     audio_modality_scale=1.0, audio_guidance_scale=1.0, guidance_rescale=0.0,
                     audio_guidance_rescale=0.0)
            spec.guidance_scale = 1.0
            spec.num_inference_steps = len(DISTILLED_SIGMA_VALUES)
        for k, v in desc.defaults.options.items():           # the checkpoint's guidance defaults
            if k in GUIDANCE_DEFAULTS:
                o.setdefault(k, v)
        if spec.guidance_scale <= 1 and "audio_guidance_scale" not in o:
            o["audio_guidance_scale"] = 1.0       # no CFG asked: none for the sound either (diffusers' default is 7)
        spec.options = o
        check_common(desc, spec)
        for name in ("guidance_rescale", "audio_guidance_rescale"):
            if name in o:
                check_number(name, o[name], 0, 1)
        for name in ("stg_scale", "audio_stg_scale", "modality_scale", "audio_modality_scale", "audio_guidance_scale"):
            if name in o:
                check_number(name, o[name], 0, 100)
        if "motion_speed" in o:
            check_number("motion_speed", o["motion_speed"], 0.01, 100)
        if o.get("upsample") is not None:
            if not isinstance(o["upsample"], bool):
                raise RequestError("upsample", f"upsample must be true or false; got {o['upsample']!r}")
            m = 2 * desc.size_multiple
            for name in ("height", "width"):
                if o["upsample"] and getattr(spec, name) % m:
                    raise RequestError(name, f"{name} must be a multiple of {m} with upsample (the first stage "
                                             f"makes half the size); got {getattr(spec, name)}")
        if "audio" in o and not isinstance(o["audio"], bool):
            raise RequestError("audio", f"audio must be true or false; got {o['audio']!r}")
        blocks = o.get("spatio_temporal_guidance_blocks", GUIDANCE_DEFAULTS["spatio_temporal_guidance_blocks"])
        if not isinstance(blocks, (list, tuple)) or any(isinstance(b, bool) or not isinstance(b, int) or b < 0
                                                        for b in blocks):
            raise RequestError("spatio_temporal_guidance_blocks", f"spatio_temporal_guidance_blocks must be a list "
                                                                  f"of block indices; got {blocks!r}")
        g = guidance_settings(spec)
        if g["stg"] and not blocks:
            raise RequestError("spatio_temporal_guidance_blocks", "STG (stg_scale > 0) needs at least one block "
                                                                  "in spatio_temporal_guidance_blocks")
        if g["audio_guidance_scale"] > 1 and not spec.use_cfg:
            raise RequestError("audio_guidance_scale", "audio_guidance_scale > 1 needs guidance_scale > 1 (the "
                                                       "unconditional rows are the video's and the sound's)")
        if desc.capabilities.image == REQUIRED:
            from longserve.engine.images import as_rgb_array

            if o.get("image") is None:
                raise RequestError("image", "image is required: this is an image-to-video model (pass a PIL image or "
                                            "an (H, W, 3) array; HTTP: the input_reference file)")
            o["image"] = as_rgb_array(o["image"], "image")
            if o.get("image_crf") is not None:
                check_int("image_crf", o["image_crf"], 0, 51)
            if spec.batch_size != 1:
                raise RequestError("prompt", "image-to-video takes one prompt (its image is the first frame)")
        sigmas = o.get("sigmas")
        if sigmas is not None:
            if not isinstance(sigmas, (list, tuple)) or not 1 <= len(sigmas) <= 1000 or any(
                    isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1 for v in sigmas) \
                    or any(a <= b for a, b in zip(sigmas, sigmas[1:])):
                raise RequestError("sigmas", f"sigmas must be a decreasing list of numbers in (0, 1]; got {sigmas!r}")
            spec.num_inference_steps = len(sigmas)
            o["sigmas"] = [float(v) for v in sigmas]
        return spec

    # -- worker side: loading ---------------------------------------------------------------------

    def __init__(self, ctx, config):
        import diffusers

        super().__init__(ctx, config)
        self.refuse_xformers(config)
        self.desc = self.describe(Path(config.model_dir))
        self.pipe = self.load_pipeline(getattr(diffusers, self.desc.pipeline),
                                       {"default": self.dtype, "vae": torch.float32, "audio_vae": torch.float32,
                                        "vocoder": torch.float32})
        self.experts = self.load_denoisers(Denoisers((self.pipe.transformer,)))
        self.upsampler = None
        if self.desc.facts.upsampler:                   # every rank runs it (identical inputs, identical outputs)
            from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel

            self.upsampler = LTX2LatentUpsamplerModel.from_pretrained(
                Path(config.model_dir) / "latent_upsampler", dtype=self.dtype).to(self.pg.device).eval()
        from longserve.engine.ltx2_vae import halos, not_streamable

        self.vae_halos = halos(self.pipe.vae.decoder)         # (before, after): latent frames a window reads
        self.vae_refused = not_streamable(self.pipe.vae)       # why the clip is decoded whole, or None
        self.set_plan(config.plan)

    def shard(self, denoiser):
        return LTX2SequenceParallel(denoiser)

    set_plan = WanParts.set_plan          # the sequence-parallel groups of a plan (and of each CFG half)
    refuse_xformers = WanParts.refuse_xformers   # PyTorch SDPA only
    dispatcher_attention = True           # attention_backend: diffusers' processors and our video self-attention
    attention_masks = True                # the prompt cross-attention's mask
    merges_across_workers = "the video->audio attention's log-sum-exp merge of each worker's video keys"

    # -- a request ----------------------------------------------------------------------------------

    def encode_prompt(self, spec: GenerationSpec):
        """Gemma 3's stacked hidden states through the text connectors (rank 0), as `LTX2Pipeline` makes them: per
        row, the video context, the audio context and the connectors' mask, packed side by side in one tensor
        (B, L, D_video + D_audio + 1) for the broadcast."""
        pipe = self.pipe

        def encoded(prompts):
            embeds, mask = pipe._get_gemma_prompt_embeds(prompts, max_sequence_length=MAX_SEQUENCE_LENGTH,
                                                         device=self.pg.device, dtype=self.dtype)
            side = getattr(pipe.tokenizer, "padding_side", "left")
            video, audio, mask = pipe.connectors(embeds, mask, padding_side=side)
            return torch.cat([video, audio, mask[..., None].to(video.dtype)], dim=-1)

        positive = encoded(spec.prompt)
        negative = encoded(spec.negative_prompts()) if spec.use_cfg else None
        return positive, negative

    def encode_conditions(self, spec: GenerationSpec) -> dict[str, torch.Tensor]:
        """Image-to-video (rank 0): the first frame as `LTX2ImageToVideoPipeline` takes it: re-compressed at the
        model's H.264 CRF, resized, VAE-encoded (the latent distribution's mode) and normalised -> (1, C, 1, h, w)."""
        if "image" not in spec.options:
            return {}
        import PIL.Image
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf

        from longserve.engine.images import to_pil

        pipe = self.pipe
        image = to_pil(spec.options["image"])
        crf = spec.options.get("image_crf")
        crf = resolve_default_image_crf(pipe.text_encoder) if crf is None else crf
        if crf != 0:
            image = PIL.Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))
        pixels = pipe.video_processor.preprocess(image, height=spec.height, width=spec.width)
        pixels = pixels.to(self.pg.device, dtype=self.dtype).to(pipe.vae.dtype)
        latents = pipe.vae.encode(pixels[:, :, None]).latent_dist.mode()
        latents = pipe._normalize_latents(latents.to(self.dtype), pipe.vae.latents_mean, pipe.vae.latents_std)
        return {"image_latents": latents}

    def _text_parts(self, text: torch.Tensor):
        """The packed context -> (video context, audio context, mask)."""
        da = self._audio_context_dim
        video, audio, mask = text.split([text.shape[-1] - da - 1, da, 1], dim=-1)
        return video, audio, mask[..., 0]

    @property
    def _audio_context_dim(self) -> int:
        """The audio context's width: the connectors' (caption_channels) when the transformer projects it (LTX-2.0),
        else the audio stream's (LTX-2.3's per-modality connectors)."""
        c = self.pipe.transformer.config
        return c.caption_channels if c.use_prompt_embeddings else c.audio_cross_attention_dim

    def batch_key(self, r: LTX2Request) -> tuple:
        g = r.guidance
        return ("ltx2", *r.latents.shape[1:], *r.audio_latents.shape[1:], r.latent_frames, r.latent_height,
                r.latent_width, tuple(g["spatio_temporal_guidance_blocks"]) if g["stg"] else None, g["modality"])

    def prepare(self, spec: GenerationSpec, text: torch.Tensor, image_latents: torch.Tensor = None) -> LTX2Request:
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps
        from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

        pipe, o = self.pipe, spec.options
        generator = seeded_generator(spec.seed)
        B, device = spec.batch_size, self.pg.device
        vae_s, vae_t = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
        upsample = bool(o.get("upsample", False))
        scale = 2 if upsample else 1                        # the first stage at half the size
        F, h, w = (spec.num_frames - 1) // vae_t + 1, spec.height // vae_s // scale, spec.width // vae_s // scale
        noise = torch.randn((B, pipe.transformer.config.in_channels, F, h, w), generator=generator,
                            dtype=torch.float32)                                          # prepare_latents
        mask = None
        if image_latents is not None:                       # the first latent frame is the image's, kept clean
            cond = torch.zeros((B, 1, F, h, w))
            cond[:, :, 0] = 1.0
            image_latents = image_latents.float().cpu().repeat(B, 1, F, 1, 1)
            noise = image_latents * cond + noise * (1 - cond)
            mask = pipe._pack_latents(cond, pipe.transformer_spatial_patch_size,
                                      pipe.transformer_temporal_patch_size).squeeze(-1).to(device)   # (B, S)
        latents = pipe._pack_latents(noise, pipe.transformer_spatial_patch_size,
                                     pipe.transformer_temporal_patch_size).to(device)
        fps = float(spec.fps)
        A = round(spec.num_frames / fps * pipe.audio_sampling_rate / pipe.audio_hop_length
                  / float(pipe.audio_vae_temporal_compression_ratio))
        mel = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        audio_noise = torch.randn((B, pipe.audio_vae.config.latent_channels, A, mel), generator=generator,
                                  dtype=torch.float32)                                    # prepare_audio_latents
        audio_latents = pipe._pack_audio_latents(audio_noise).to(device)
        steps = spec.num_inference_steps
        sigmas = o.get("sigmas")
        sigmas = np.linspace(1.0, 1 / steps, steps) if sigmas is None else np.asarray(sigmas, dtype=np.float64)
        c = pipe.scheduler.config
        mu = calculate_shift(latents.shape[1], c.get("base_image_seq_len", 1024), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.95), c.get("max_shift", 2.05))
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        audio_scheduler = copy.deepcopy(scheduler)
        for s in (audio_scheduler, scheduler):
            retrieve_timesteps(s, steps, device, None, sigmas=sigmas, mu=mu)
            s.set_begin_index(0)
        rate = conditioning_frame_rate(fps, o.get("motion_speed", 1.0))
        video_coords = pipe.transformer.rope.prepare_video_coords(B, F, h, w, device, fps=rate)
        audio_coords = pipe.transformer.audio_rope.prepare_audio_coords(B, A, device)
        req = LTX2Request(spec=spec, num_steps=len(scheduler.timesteps), batch_key=(), num_frames=spec.num_frames,
                          text=text, scheduler=scheduler, latents=latents, audio_latents=audio_latents,
                          audio_scheduler=audio_scheduler, latent_frames=F, latent_height=h, latent_width=w,
                          audio_frames=A, video_coords=video_coords, audio_coords=audio_coords,
                          guidance=guidance_settings(spec), mask=mask, cfg=spec.use_cfg, upsample=upsample,
                          fps_rate=rate)
        if upsample:
            req.num_steps += len(STAGE_2_SIGMAS)
        # the whole clip is pushed once, when denoising ends, and decoded a window at a time (`decode_next`), the
        # sound with the first; output "latent" hands the latents out in one piece
        req.frames = FrameStream(FramesPolicy(vae_t, whole=spec.output == "latent"),
                                 lambda _: LTX2Decoder(self, req), spec.output, self.pg.rank, spec.num_frames)
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

        return {"hidden_states": rep(r.latents).to(self.dtype),
                "audio_hidden_states": rep(r.audio_latents).to(self.dtype),
                "encoder_hidden_states": video_ctx, "audio_encoder_hidden_states": audio_ctx,
                "timestep": video_t, "audio_timestep": t, "encoder_attention_mask": mask,
                "video_coords": rep(r.video_coords),
                "audio_coords": rep(r.audio_coords)}

    def forward(self, model, inputs: dict, cfg_parallel: bool, r: LTX2Request = None, **flags):
        kw = {k: torch.cat(v) for k, v in inputs.items()}
        kw["timestep"] = kw["timestep"].to(self.pg.device)
        kw["audio_timestep"] = kw["audio_timestep"].to(self.pg.device)
        kw.update(sigma=kw["audio_timestep"], audio_encoder_attention_mask=kw["encoder_attention_mask"],
                  num_frames=r.latent_frames, height=r.latent_height, width=r.latent_width,
                  audio_num_frames=r.audio_frames, use_cross_timestep=True, **flags)
        video, audio = model(self.sp_cfg if cfg_parallel else self.sp,
                             cfg=self.cfg_groups if cfg_parallel else None, **kw)
        return torch.cat([video.float().flatten(1), audio.float().flatten(1)], dim=1)   # (rows, S*C + A*Ca)

    def step(self, reqs: list[LTX2Request]) -> None:
        """One denoising step for a batch: the [uncond; cond] forward (CFG-parallel when every request uses CFG),
        then, when the batch's guidance asks for them, the STG and the modality forwards of the conditional rows."""
        t0 = time.perf_counter()
        model, first = self.experts[0], reqs[0]
        cfg_parallel = self.cfg_groups is not None and all(r.cfg for r in reqs)
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
        from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

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
                guided = rescale_noise_cfg(guided, cond, guidance_rescale=g[f"{prefix}guidance_rescale"])
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

    def decode_next(self, r: LTX2Request, max_frames: int):
        """The next window's frames, whatever the scheduler's `max_frames` (`window_frames`)."""
        return super().decode_next(r, self.window_frames(r))

    def window_frames(self, r: LTX2Request) -> int:
        """The frames a decode call hands out (`FrameStream.next`'s max_frames): a window of 2H latent frames (fewer
        would decode more halo than frames; more would hand out the first frames later), the last window taking the
        rest (less than two windows); the whole clip in one call when it is no longer than a window and its two
        halos (4H latent frames), or the VAE cannot be windowed."""
        before, after = self.vae_halos
        window = before + after                                       # latent frames kept per call
        if r.spec.output == "latent" or self.vae_refused or r.latent_frames <= 2 * window:
            return r.num_frames                                       # the whole clip, one call
        if r.latent_frames - r.frames.latents_done < 2 * window:
            return r.num_frames                                       # the rest: no window shorter than the others
        return window * self.pipe.vae_temporal_compression_ratio

    def _start_stage_2(self, r: LTX2Request) -> None:
        """The latent upsampler's second stage, as diffusers' two-stage recipe runs it: the first stage's latents
        (de-normalised) through `LTX2LatentUpsamplerModel`, then `LTX2Pipeline` again at the full size from those
        latents and the first stage's sound, re-noised to `STAGE_2_DISTILLED_SIGMA_VALUES[0]` by a generator seeded
        with the request's seed, over those sigmas, without CFG, STG or modality guidance."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps

        pipe, device = self.pipe, self.pg.device
        video = self.final_latents(r)                                               # (B, C, F, h, w) de-normalised
        audio = self.final_audio_latents(r)                                         # (B, C, L, M) de-normalised
        up = self.upsampler(video.to(self.upsampler.dtype)).float()                 # (B, C, F, 2h, 2w)
        generator, scale = seeded_generator(r.spec.seed), STAGE_2_SIGMAS[0]
        r.latent_height, r.latent_width = up.shape[3], up.shape[4]
        up = pipe._normalize_latents(up, pipe.vae.latents_mean, pipe.vae.latents_std, pipe.vae.config.scaling_factor)
        up = pipe._pack_latents(up, pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        noise = torch.randn(up.shape, generator=generator, dtype=torch.float32).to(device)     # on the tokens
        r.latents = scale * noise + (1 - scale) * up
        audio = pipe._normalize_audio_latents(pipe._pack_audio_latents(audio), pipe.audio_vae.latents_mean,
                                              pipe.audio_vae.latents_std)
        noise = torch.randn(audio.shape, generator=generator, dtype=torch.float32).to(device)
        r.audio_latents = scale * noise + (1 - scale) * audio
        c = pipe.scheduler.config
        mu = calculate_shift(r.latents.shape[1], c.get("base_image_seq_len", 1024), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.95), c.get("max_shift", 2.05))
        r.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        r.audio_scheduler = copy.deepcopy(r.scheduler)
        for s in (r.audio_scheduler, r.scheduler):
            retrieve_timesteps(s, len(STAGE_2_SIGMAS), device, None, sigmas=np.asarray(STAGE_2_SIGMAS), mu=mu)
            s.set_begin_index(0)
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
        pipe = self.pipe
        latents = pipe._unpack_latents(r.latents, r.latent_frames, r.latent_height, r.latent_width,
                                       pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        return pipe._denormalize_latents(latents, pipe.vae.latents_mean, pipe.vae.latents_std,
                                         pipe.vae.config.scaling_factor)

    def final_audio_latents(self, r: LTX2Request) -> torch.Tensor:
        pipe = self.pipe
        audio = pipe._denormalize_audio_latents(r.audio_latents, pipe.audio_vae.latents_mean,
                                                pipe.audio_vae.latents_std)
        mel = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        return pipe._unpack_audio_latents(audio, r.audio_frames, num_mel_bins=mel)

    def decode_audio(self, r: LTX2Request) -> np.ndarray:
        """The request's sound: the audio VAE's mel spectrogram through the vocoder -> float32 (B, channels, n)."""
        pipe = self.pipe
        latents = self.final_audio_latents(r).to(pipe.audio_vae.dtype)
        mel = pipe.audio_vae.decode(latents, return_dict=False)[0]
        return pipe.vocoder(mel).float().cpu().numpy()


class LTX2Decoder:
    """A clip's decode on rank 0, a window of latent frames at a time as the frame stream hands them
    (`engine.ltx2_vae.LTX2WindowedDecode`: each with its halo from the whole clip's latents; one window of the whole
    clip is diffusers' one call), and the sound with the first window, decoded before it."""

    def __init__(self, family: LTX2Family, r: LTX2Request):
        self.family, self.r = family, r
        self.window = None
        self.start = 0                      # the clip's latent frames handed out so far

    def decode(self, latents: torch.Tensor, keep: slice):
        fam = self.family
        rows = fam.vae_split == "rows" and fam.pg.world_size > 1     # every rank decodes its band of the rows
        if fam.pg.rank != 0 and not rows:
            return None
        from longserve.engine.decoding import to_pixels
        from longserve.engine.ltx2_vae import LTX2WindowedDecode
        from longserve.engine.vae_split import RowSplit, split_rows_fits

        pipe, r = fam.pipe, self.r
        with torch.no_grad():
            if self.start == 0 and r.spec.options.get("audio", True) and fam.pg.rank == 0:   # the sound first
                r.frames.audio = Sound(fam.decode_audio(r), fam.desc.facts.audio_rate)
            if self.window is None:
                clip = r.clip.to(pipe.vae.dtype)
                timestep = None
                if pipe.vae.config.timestep_conditioning:
                    timestep = torch.zeros(clip.shape[0], device=clip.device, dtype=clip.dtype)
                split = RowSplit(fam.pg, clip.shape[3]) if rows and split_rows_fits(clip.shape[3],
                                                                                     fam.pg.world_size) else None
                if fam.pg.rank != 0 and split is None:
                    self.start += latents.shape[2]
                    return None
                self.window = LTX2WindowedDecode(pipe.vae, clip, timestep, fam.vae_halos, rows=split)
            a = self.start
            self.start += latents.shape[2]
            video = self.window.decode(a, self.start)
        return None if video is None else to_pixels(video[:, :, keep], pipe.video_processor, r.spec.output)

    def close(self) -> None:
        self.window, self.r.clip = None, None          # the clip is handed out: its latents are not kept


FAMILY = LTX2Family
