"""Image-to-video with the Wan family: `WanImageToVideoPipeline` checkpoints (Wan 2.1 I2V with its CLIP image
encoder; Wan 2.1 FLF2V, first and last frame; Wan 2.2 I2V A14B, two experts and no image encoder) and
`SkyReelsV2ImageToVideoPipeline` ones (SkyReels-V2 I2V: Wan 2.1 I2V's recipe on SkyReels' transformer, with a
`CLIPVisionModelWithProjection`, whose `hidden_states[-2]` the pipeline reads as Wan's does). Wan 2.2 TI2V-5B,
which loads into `WanImageToVideoPipeline` too, is engine/families/wan_ti2v.py (per-token timesteps).

What diffusers' pipeline does, and where it happens here:

    diffusers' __call__                                   here
    encode_prompt (UMT5)                                  rank 0, broadcast (as text-to-video)
    encode_image(image | [image, last_image])             rank 0 (the only rank that loads the image encoder
      CLIPImageProcessor + CLIPVisionModel,                 and processor), broadcast with the prompt
      hidden_states[-2]: (k, T, C_img), repeated B times
    video_processor.preprocess(image, height, width)      rank 0, inside the same broadcast: the pipeline's own
    prepare_latents: VAE-encode [image, 0..., (last)],    `prepare_latents` with placeholder latents (argmax:
      normalise, + the 4-channel first(-last)-frame mask   no randomness) -> the condition (B, 4 + z, f, h, w)
    randn latents from the generator                      every rank, from the request's seed (as T2V)
    per step: cat([latents, condition], dim=1) and the    `inputs`: the same rows, the condition and the CLIP
      CLIP tokens -> transformer                            tokens per CFG row; the sharded forward (Ulysses,
                                                            Ring, USP) is the Wan family's, unchanged
    scheduler.step, decode                                the Wan family's

Why encode on one rank and broadcast, rather than compute identically on every rank: the image encoder
(ViT-H/14, 0.6 B parameters) then lives on rank 0 alone, like the text encoder; and the ranks step the
same latents in lockstep, so the condition must be bitwise equal on every rank, which one broadcast
guarantees and N separate VAE encodes on N GPUs do not (kernel choices may differ per device). The
cost: the VAE encode is not split across the workers (it takes the time it takes on one).

The image is resized as diffusers' pipeline resizes it (the rule, for the docs): for the VAE condition,
`VideoProcessor.preprocess(image, height, width)` stretches it to exactly `width x height` (Lanczos, the
aspect ratio not kept, nothing cropped), where height and width are the request's (the checkpoint's
defaults when not given: 480x832 for the published ones); for the image encoder, the
`CLIPImageProcessor` of the checkpoint resizes the original image's shorter side to its size (224,
bicubic) and centre-crops a square. A size that does not match the video's is therefore never an error.

Requests batch at the step level like text-to-video ones: the batch key is the latent shape (and Wan 2.2's
expert); the condition and the CLIP tokens are per row, so requests with different images share a step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from longserve.engine.config import OPTIONAL, REFUSED, REQUIRED, ModelDescription
from longserve.engine.families.base import cfg_rows, check_common, check_number, read_json
from longserve.engine.families.wan import WanFacts, WanFamily, WanRequest, check_schedule
from longserve.engine.images import as_rgb_array, to_pil
from longserve.engine.request import GenerationSpec, RequestError

#: AutoencoderKLWan.encode encodes the first frame, then chunks of this many frames (a remainder is dropped)
WAN_ENCODE_CHUNK = 4


@dataclass(frozen=True)
class WanI2VFacts(WanFacts):
    image_encoder: bool = False           # a CLIP image encoder conditions the transformer (Wan 2.1 I2V, FLF2V)


@dataclass
class WanI2VRequest(WanRequest):
    condition: torch.Tensor = None      # (B, 4 + z, f, h, w): the first(-last)-frame mask and the encoded image(s)
    image_embeds: torch.Tensor = None   # (k B, T, C_img): k CLIP token sets per video (FLF2V: 2), or None


class WanImageToVideoFamily(WanFamily):
    """`WanImageToVideoPipeline` checkpoints: the Wan family's forward and decode, plus the image conditions."""

    name = "wan-i2v"
    #: diffusers' `__call__` defaults per pipeline class (and the fps the models were trained at: Wan 2.1's 16,
    #: SkyReels-V2's 24). SkyReelsV2ImageToVideoPipeline differs from WanImageToVideoPipeline in nothing this
    #: family does but these numbers and its classes (no experts, no expand_timesteps; the same
    #: encode_image, prepare_latents and denoising step).
    pipeline_defaults = {
        "WanImageToVideoPipeline": {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50,
                                    "guidance_scale": 5.0, "fps": 16},
        "SkyReelsV2ImageToVideoPipeline": {"height": 544, "width": 960, "num_frames": 97, "num_inference_steps": 50,
                                           "guidance_scale": 5.0, "fps": 24},
    }
    pipeline_classes = frozenset(pipeline_defaults)
    request_class = WanI2VRequest
    rank0_components = ("text_encoder", "tokenizer", "image_encoder", "image_processor")
    #: why a checkpoint refuses `last_image` (one that conditions on one image's CLIP tokens)
    last_image_refusal = ("last_image needs a first-last-frame checkpoint (Wan 2.1 FLF2V, or Wan 2.2 I2V); this one "
                          "conditions on one image")

    @classmethod
    def describe(cls, model_dir: Path) -> ModelDescription:
        desc = super().describe(model_dir)
        cfg = read_json(Path(model_dir) / "transformer" / "config.json")
        if cfg.get("image_dim") is None:
            last_image = OPTIONAL        # Wan 2.2 I2V A14B: the condition video alone carries the images
        elif cfg.get("pos_embed_seq_len") is not None:
            last_image = REQUIRED        # FLF2V: the image embedder views two images' CLIP tokens as one row
        else:
            last_image = REFUSED         # Wan 2.1 I2V: one image's CLIP tokens per row
        # the condition video goes through AutoencoderKLWan.encode, which keeps 1 + 4k frames (its first frame, then
        # chunks of 4) whatever its temporal compression: a VAE without one (tiny-i2v's) still needs 4k + 1 frames
        return dataclasses.replace(desc, options=("image", "last_image", *desc.options),
                                   frame_multiple=math.lcm(desc.frame_multiple, WAN_ENCODE_CHUNK),
                                   capabilities=dataclasses.replace(desc.capabilities, image=REQUIRED,
                                                                    last_image=last_image),
                                   facts=WanI2VFacts(**vars(desc.facts),
                                                     image_encoder=cfg.get("image_dim") is not None))

    @classmethod
    def check_request(cls, desc: ModelDescription, spec: GenerationSpec) -> GenerationSpec:
        check_schedule(desc, spec)
        check_common(desc, spec)
        if "guidance_scale_2" in spec.options:
            check_number("guidance_scale_2", spec.options["guidance_scale_2"], 0, 100)
        if spec.options.get("image") is not None:
            options = dict(spec.options, image=as_rgb_array(spec.options["image"], "image"))
        elif desc.capabilities.image == REQUIRED:
            raise RequestError("image", "image is required: this is an image-to-video model (pass a PIL image or an "
                                        "(H, W, 3) array; HTTP: the input_reference file)")
        else:                            # Wan 2.2 TI2V without an image: text-to-video
            options = {k: v for k, v in spec.options.items() if k != "image"}
        rule = desc.capabilities.last_image
        if options.get("last_image") is not None:
            if rule == REFUSED:
                raise RequestError("last_image", cls.last_image_refusal)
            options["last_image"] = as_rgb_array(options["last_image"], "last_image")
            if spec.num_frames < 2:
                raise RequestError("num_frames", f"num_frames must be at least 2 with last_image (its first and "
                                                 f"last frames); got {spec.num_frames}")
        else:
            options.pop("last_image", None)
            if rule == REQUIRED:
                raise RequestError("last_image", "last_image is required: this is a first-last-frame (FLF2V) "
                                                 "checkpoint, conditioned on a first and a last image")
        return cls.check_cache(desc, dataclasses.replace(spec, options=options))

    # -- worker side -----------------------------------------------------------------------------------

    def component_dtypes(self) -> dict:
        """The image encoder in float32 too, as diffusers' Wan I2V example loads it."""
        return {**super().component_dtypes(), "image_encoder": torch.float32}

    def encode_conditions(self, spec: GenerationSpec) -> dict[str, torch.Tensor]:
        """Rank 0: the CLIP tokens of the image(s) and the VAE condition, by the pipeline's own methods."""
        pipe, device = self.pipe, self.pg.device
        image = to_pil(spec.options["image"])
        last = spec.options.get("last_image")
        last = None if last is None else to_pil(last)
        out = {}
        if pipe.transformer.config.image_dim is not None:
            embeds = pipe.encode_image(image if last is None else [image, last], device)      # (k, T, C_img)
            out["image_embeds"] = embeds.repeat(spec.batch_size, 1, 1)                     # (k B, T, C_img)
        pixels = pipe.video_processor.preprocess(image, height=spec.height, width=spec.width)
        pixels = pixels.to(device, dtype=torch.float32)                                     # (1, 3, H, W)
        if last is not None:
            last = pipe.video_processor.preprocess(last, height=spec.height, width=spec.width)
            last = last.to(device, dtype=torch.float32)
        frames = (spec.num_frames - 1) // self.vae_temporal + 1
        placeholder = torch.zeros(self.latent_shape(spec, frames), device=device)         # the noise is drawn later
        _, condition = pipe.prepare_latents(pixels, spec.batch_size, pipe.vae.config.z_dim, spec.height, spec.width,
                                            spec.num_frames, torch.float32, device, None, placeholder, last)
        out["condition"] = condition                                                        # (B, 4 + z, f, h, w)
        return out

    def prepare(self, spec: GenerationSpec, text: torch.Tensor, condition: torch.Tensor = None,
                image_embeds: torch.Tensor = None) -> WanI2VRequest:
        req = super().prepare(spec, text)
        req.condition = None if condition is None else condition.to(torch.float32)
        req.image_embeds = None if image_embeds is None else image_embeds.to(self.dtype)
        return req

    def inputs(self, r: WanI2VRequest) -> dict:
        rows = super().inputs(r)
        x = torch.cat([r.latents, r.condition], dim=1)                                    # (B, 2z + 4, f, h, w)
        rows["x"] = cfg_rows(r, x).to(self.dtype)                                          # (2B|B, 2z + 4, f, h, w)
        if r.image_embeds is not None:
            rows["image"] = cfg_rows(r, r.image_embeds)                                    # (2kB|kB, T, C_img)
        return rows


FAMILY = WanImageToVideoFamily
