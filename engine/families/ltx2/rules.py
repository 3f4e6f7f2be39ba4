"""LTX-2's coordinator side: what a checkpoint is (from its JSON configs), what a request may ask, and the guidance a
request resolves to. See `worker.py` for what the workers run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from longserve.engine.config import REFUSED, REQUIRED, FamilyFacts, ModelDescription
from longserve.engine.families.rules import (
    FamilyRules,
    check_common,
    check_int,
    check_number,
    generation_defaults,
    read_json,
)
from longserve.engine.request import GenerationSpec, RequestError

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


class LTX2Rules(FamilyRules):
    """`LTX2Pipeline` (text to video with sound) and `LTX2ImageToVideoPipeline` checkpoints."""

    plans = ("ulysses", "ring", "usp")
    auto_plan = "sequence"
    pipeline_defaults = {"LTX2Pipeline": {"height": 512, "width": 768, "num_frames": 121, "num_inference_steps": 30,
                                          "guidance_scale": 3.0, "fps": 24},
                         "LTX2ImageToVideoPipeline": {"height": 512, "width": 768, "num_frames": 121,
                                                      "num_inference_steps": 30, "guidance_scale": 3.0, "fps": 24}}
    dispatcher_attention = True           # attention_backend: diffusers' processors and our video self-attention
    attention_masks = True                # the prompt cross-attention's mask
    merges_across_workers = "the video->audio attention's log-sum-exp merge of each worker's video keys"

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
        from longserve.engine.families.ltx2.pipeline_api import distilled_sigmas

        o = dict(spec.options)
        distilled = o.get("distilled", desc.defaults.options.get("distilled", False))
        if not isinstance(distilled, bool):
            raise RequestError("distilled", f"distilled must be true or false; got {distilled!r}")
        if distilled:
            sigmas = distilled_sigmas()
            if o.get("sigmas") is not None and list(o["sigmas"]) != sigmas:
                raise RequestError("sigmas", "give sigmas or distilled, not both (distilled is a fixed schedule)")
            o.update(sigmas=sigmas, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0,
                     audio_modality_scale=1.0, audio_guidance_scale=1.0, guidance_rescale=0.0,
                     audio_guidance_rescale=0.0)
            spec.guidance_scale = 1.0
            spec.num_inference_steps = len(sigmas)
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
